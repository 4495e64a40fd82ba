"""``manage.py outbox_worker``: ``outbox-worker`` on the database of ``DATABASES``
(``outbox.django.commands``)."""

from __future__ import annotations

from collections.abc import Callable

from outbox.django.commands import ToolkitCommand


class Command(ToolkitCommand):
    help = (
        "outbox-worker on the database of DATABASES (--database ALIAS); e.g. `outbox-worker --help`"
    )
    program = "outbox-worker"

    def toolkit_main(self) -> Callable[[list[str]], int]:
        from consumer.jobs.cli import main

        return main
