"""``python -m metrics``: the standalone exporter (same as ``outbox-relay metrics``)."""

import sys

from metrics.cli import main

sys.exit(main())
