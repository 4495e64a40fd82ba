"""``manage.py outbox_consumer``: ``outbox-consumer`` on the database of ``DATABASES``
(``outbox.django.commands``)."""

from __future__ import annotations

from collections.abc import Callable

from outbox.django.commands import ToolkitCommand


class Command(ToolkitCommand):
    help = "outbox-consumer on the database of DATABASES (--database ALIAS)"
    program = "outbox-consumer"

    def toolkit_main(self) -> Callable[[list[str]], int]:
        from consumer.cli import main

        return main
