"""``python -m relay``: the ``outbox-relay`` command line."""

import sys

from relay.cli import main

sys.exit(main())
