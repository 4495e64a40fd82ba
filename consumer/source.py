"""The consumer's seam to its broker: what :class:`consumer.Consumer` reads through.

Two implementations: :class:`consumer.reading.StreamReader` (Redis Streams consumer groups,
on one server or a Redis Cluster) and :class:`consumer.nats_reading.NatsReader` (JetStream
durable pull consumers). The batch (:mod:`consumer.handling`: the inbox's deduplication,
the handlers, the dead-letter records) is the same on both.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from consumer.reading import Entry


class Source(Protocol):
    """What the consumer's batch loop needs from its broker."""

    ready: bool
    """The group exists (made again after the broker lost it)."""
    heartbeat: Any
    """A duty the loop runs when no heartbeat thread does (``maybe_run()``)."""

    def create_groups(self) -> None: ...

    def claim(self, room: int, *, ahead_ms: int = 0) -> list[Entry]:
        """Entries another consumer of the group held too long (or died with)."""
        ...

    def read(self, room: int, *, block: bool) -> list[Entry]:
        """New entries (or, on a broker that redelivers by itself, redelivered ones)."""
        ...

    def acknowledge(
        self, outcome: Any, dead_letter_stream_for: Callable[[str], str], group: str
    ) -> None:
        """Copy the dead letters to their stream, acknowledge every settled entry."""
        ...

    def dead_letter_name(self, name: str, stream: str) -> str: ...

    def heartbeat_key(self, consumer: str) -> str: ...

    def heartbeat_loop(self, done: threading.Event) -> None: ...

    def lag(self, stream: str) -> tuple[int | None, int] | None:
        """(not delivered yet, delivered and not acknowledged) of the group, or None."""
        ...

    def remove_stale(self, stream: str, stale_ms: int) -> None: ...

    def forget(self) -> None:
        """At stop: let the group's other consumers take over at once."""
        ...


__all__ = ["Source"]
