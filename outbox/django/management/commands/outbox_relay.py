"""``manage.py outbox_relay``: ``outbox-relay`` on the database of ``DATABASES``
(``outbox.django.commands``)."""

from __future__ import annotations

from collections.abc import Callable

from outbox.django.commands import ToolkitCommand


class Command(ToolkitCommand):
    help = (
        "outbox-relay on the database of DATABASES (--database ALIAS); e.g. `outbox-relay --help`"
    )
    program = "outbox-relay"

    def toolkit_main(self) -> Callable[[list[str]], int]:
        from relay.cli import main

        return main
