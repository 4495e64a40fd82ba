"""What ``manage.py outbox_relay``, ``outbox_worker`` and ``outbox_consumer`` share: the
toolkit's command line, run with ``--database-url`` taken from ``DATABASES``.

``manage.py outbox_relay [--database ALIAS] [SUBCOMMAND [ARGS...]]`` is ``outbox-relay
SUBCOMMAND --database-url URL ARGS...`` (the subcommand defaults to ``run``); a
``--database-url`` given among the arguments wins. Django is set up first, so a consumer's or
a worker's ``MODULE:ATTRIBUTE`` may import models.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand

from outbox.django.connection import database_url


class ToolkitCommand(BaseCommand):
    """A Django command that runs one of the toolkit's command lines on ``DATABASES``."""

    program = ""
    default_subcommand = "run"

    def toolkit_main(self) -> Callable[[list[str]], int]:
        raise NotImplementedError

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--database",
            default="default",
            help="the DATABASES alias whose database the command uses (default: default)",
        )
        parser.add_argument(
            "toolkit_args",
            nargs=argparse.REMAINDER,
            help=f"a subcommand of {self.program} and its arguments (default: "
            f"{self.default_subcommand}); `{self.program} --help` lists them",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        argv = list(options["toolkit_args"]) or [self.default_subcommand]
        if argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            argv.insert(0, self.default_subcommand)
        given = any(a == "--database-url" or a.startswith("--database-url=") for a in argv)
        helping = any(a in ("-h", "--help") for a in argv)
        if not given and not helping:
            argv[1:1] = ["--database-url", database_url(options["database"])]
        code = self.toolkit_main()(argv)
        if code:
            raise SystemExit(code)
