"""The relay's pipeline in ``run`` (PostgreSQL): three stages that overlap.

- the relay loop claims batch N+1 (and does maintenance) on the claim connection;
- the :class:`Sender` thread publishes batch N to Redis meanwhile;
- the :class:`Recorder` thread writes batch N-1's outcome on a second connection.

Order holds without waiting: batches are published in claim order by one thread, and keys
that failed in a batch whose outcome is not committed yet are held back in memory by the
relay (``Relay._unrecorded_failures``). Whatever requires the database to be up to date
(a sweep, giving partitions back) first waits for the stages to be idle.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.logs import fields
from relay.records import Record
from relay.store import Store

if TYPE_CHECKING:
    from relay.relay import Relay

log = logging.getLogger("outbox.relay")

Batch = tuple[list[Record], int, float, float]
"""A claimed batch: records, epoch, cycle start and claim start (monotonic seconds)."""


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
    recorded = store.mark_published(outcome.owner, outcome.epoch, outcome.receipts)
    if recorded != len(outcome.receipts):
        log.warning(
            "some receipts were fenced out (their intent was reconciled by another relay)",
            extra=fields(expected=len(outcome.receipts), recorded=recorded, epoch=outcome.epoch),
        )
    store.mark_failed(outcome.owner, outcome.epoch, outcome.failed)
    store.quarantine(outcome.owner, outcome.epoch, outcome.quarantine)
    store.release(outcome.owner, outcome.epoch, outcome.release)


class Recorder:
    """Writes batch outcomes on its own database connection while the relay claims and
    publishes the next batch (PostgreSQL, in :meth:`Relay.run`): the receipt round trip
    overlaps the next claim and XADD instead of adding to them.

    Order is kept without waiting for it: keys that failed in a batch whose outcome is not
    yet committed are held back in memory (:meth:`Relay._publish`) until a claim that
    started after the commit could see them in the blocked index. A failure of this
    connection is handed to the relay loop, which drops its partitions; whatever was not
    recorded keeps its intent and is reconciled.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.recorded_epoch = 0
        self.error: BaseException | None = None
        self._queue: queue.Queue[Outcome | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="relay-recorder", daemon=True)
        self._thread.start()

    def submit(self, outcome: Outcome) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(outcome)

    def _run(self) -> None:
        while True:
            outcome = self._queue.get()
            if outcome is None:
                return
            try:
                if self.error is None:
                    self.store.connect()
                    record_outcome(self.store, outcome)
                    self.recorded_epoch = outcome.epoch
            except BaseException as exc:
                self.error = exc
                self.store.close()
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every submitted outcome is written (or dropped after an error)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.store.close()


class Sender:
    """Publishes claimed batches on its own thread while the relay claims the next one
    (PostgreSQL, in :meth:`Relay.run`), so the claim's round trip overlaps the XADD.

    One batch waits at most while another is being published; batches go out in claim order.
    An exception from a batch (Redis down) is kept for the relay loop, which backs off.
    """

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.error: BaseException | None = None
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=1)
        self._inflight = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="relay-sender", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch) -> None:
        with self._lock:
            self._inflight += 1
            self._idle.clear()
        self._queue.put(batch)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                self.relay._publish(*batch)
            except BaseException as exc:
                self.error = exc
            finally:
                with self._lock:
                    self._inflight -= 1
                    if self._inflight == 0:
                        self._idle.set()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        return self._idle.wait(timeout)

    def close(self) -> None:
        self.wait_idle()
        self._queue.put(None)
        self._thread.join(timeout=10)
