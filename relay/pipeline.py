"""The relay's pipeline in ``run`` (PostgreSQL): three stages that overlap.

- the relay loop claims batch N+1 (and does maintenance) on the claim connection;
- a :class:`Sender` thread publishes batch N to Redis meanwhile;
- a :class:`Recorder` thread writes batch N-1's outcome on a second connection.

Order holds without waiting: batches are published in claim order by one thread, and keys
that failed in a batch whose outcome is not committed yet are held back in memory by the
relay (``relay.batch.BatchPublisher``). Whatever requires the database to be up to date
(a sweep, giving partitions back) first waits for the stages to be idle.

This module knows nothing of :class:`relay.Relay`: the sender is given the function that
publishes a batch, the recorder the store it writes to.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from outbox.logs import fields
from relay.records import Record
from relay.store import Store

log = logging.getLogger("outbox.relay")

Batch = tuple[list[Record], int, float, float]
"""A claimed batch: records, epoch, cycle start and claim start (monotonic seconds)."""

T = TypeVar("T")


@dataclass
class Outcome:
    """What one batch's publish needs written back: receipts, backoffs, quarantines and
    releases (all compare-and-set on ``(owner, epoch)``)."""

    owner: str
    epoch: int
    receipts: list[tuple[int, str, str]] = field(default_factory=list)
    failed: list[tuple[int, float, str, bool]] = field(default_factory=list)
    quarantine: list[tuple[int, str]] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    failed_keys: frozenset[str] = frozenset()


def record_outcome(store: Store, outcome: Outcome) -> None:
    recorded = store.outbox_mark_published(outcome.owner, outcome.epoch, outcome.receipts)
    if recorded != len(outcome.receipts):
        log.warning(
            "some receipts were fenced out (their intent was reconciled by another relay)",
            extra=fields(expected=len(outcome.receipts), recorded=recorded, epoch=outcome.epoch),
        )
    store.outbox_mark_failed(outcome.owner, outcome.epoch, outcome.failed)
    store.outbox_quarantine(outcome.owner, outcome.epoch, outcome.quarantine)
    store.outbox_release(outcome.owner, outcome.epoch, outcome.release)


class Stage(Generic[T]):
    """One pipeline stage: a thread that handles submitted items in order.

    The first exception an item raises is kept in :attr:`error` for the relay loop, which
    backs off and clears it. ``drop_after_error``: items submitted before the loop has seen
    the error are dropped instead of handled (the relay then gives its partitions back, and
    whatever was not handled keeps its intent and is reconciled). ``maxsize`` bounds how many
    items wait (0: unbounded).
    """

    name = "relay-stage"
    drop_after_error = False

    def __init__(self, maxsize: int = 0) -> None:
        self.error: BaseException | None = None
        self._queue: queue.Queue[tuple[T] | None] = queue.Queue(maxsize=maxsize)
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def handle(self, item: T) -> None:
        raise NotImplementedError

    def failed(self, exc: BaseException) -> None:
        """Called on the stage's thread after ``handle`` raised ``exc``."""

    def submit(self, item: T) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put((item,))

    def _run(self) -> None:
        while True:
            boxed = self._queue.get()
            if boxed is None:
                return
            try:
                if self.error is None or not self.drop_after_error:
                    self.handle(boxed[0])
            except BaseException as exc:
                self.error = exc
                self.failed(exc)
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until every submitted item is handled (or dropped after an error)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Handle what was submitted, then end the thread."""
        self.wait_idle()
        self._queue.put(None)
        self._thread.join(timeout=10)


class Recorder(Stage[Outcome]):
    """Writes batch outcomes on its own database connection while the relay claims and
    publishes the next batch: the receipt round trip overlaps the next claim and XADD
    instead of adding to them.

    Order is kept without waiting for it: keys that failed in a batch whose outcome is not
    yet committed are held back in memory (``relay.batch.BatchPublisher``) until a claim
    that started after the commit could see them in the blocked index. A failure of this
    connection is handed to the relay loop, which drops its partitions; whatever was not
    recorded keeps its intent and is reconciled.
    """

    name = "relay-recorder"
    drop_after_error = True

    def __init__(self, store: Store) -> None:
        self.store = store
        self.recorded_epoch = 0
        super().__init__()

    def handle(self, item: Outcome) -> None:
        self.store.connect()
        record_outcome(self.store, item)
        self.recorded_epoch = item.epoch

    def failed(self, exc: BaseException) -> None:
        self.store.close()

    def close(self) -> None:
        super().close()
        self.store.close()


class Sender(Stage[Batch]):
    """Publishes claimed batches on its own thread while the relay claims the next one, so
    the claim's round trip overlaps the XADD. ``publish`` sends one batch and records (or
    hands over) its outcome.

    One batch waits at most while another is being published; batches go out in claim order.
    An exception from a batch (Redis down) is kept for the relay loop, which backs off.
    """

    name = "relay-sender"

    def __init__(self, publish: Callable[[list[Record], int, float, float], int]) -> None:
        self._publish = publish
        super().__init__(maxsize=1)

    def handle(self, item: Batch) -> None:
        self._publish(*item)
