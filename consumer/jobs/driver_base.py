"""The job store's storage seam, the SQL both databases share: :class:`JobDriver`.

In the spirit of River's ``riverdriver``: :class:`consumer.jobs.store.Store` validates, decides
and keeps the contract; a :class:`JobDriver` runs the SQL. Methods are named noun first
(``job_claim_batch``, ``job_update_fenced``, ``operation_insert``) and take an open
:class:`~sqlalchemy.engine.Connection` so that several of them make one transaction
(:meth:`JobDriver.begin`). The exceptions are the dispatch path's ``operation_intent`` and
``operation_record`` (and the read ``provider_pause``): each is one unit of work committed on
its own, on the DBAPI connection (docs/contributing.md, "Storage seams"). What differs
between the databases lives in the subclasses, each in its own module:
``consumer.jobs.driver_pg`` and ``consumer.jobs.driver_sqlite``; ``consumer.jobs.driver``
picks one for an engine.

The statements of one area live in a mixin module of their own, which :class:`JobDriver`
inherits: ``driver_jobs`` (wake-up, clock, inserts, reads, history rows), ``driver_claims``,
``driver_queues``, ``driver_leases`` (the lease holder's moves), ``driver_recovery``
(expired leases, workers' liveness, due timers), ``driver_fleet`` (the provider limits' row,
pause and rate reservations), ``driver_schedules``, ``driver_retention``, ``driver_cancels``
(cancel requests), ``driver_operations`` (operation intents and receipts), ``driver_replies``
and ``driver_deliveries`` (delivery callbacks).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import lru_cache
from typing import Any

from sqlalchemy import Double, Select, bindparam, inspect, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from consumer.jobs.driver_cancels import CancelStatements
from consumer.jobs.driver_claims import ClaimStatements
from consumer.jobs.driver_deliveries import DeliveryStatements
from consumer.jobs.driver_fleet import FleetStatements
from consumer.jobs.driver_jobs import INSERT_CHUNK as INSERT_CHUNK  # re-exported
from consumer.jobs.driver_jobs import JobStatements
from consumer.jobs.driver_jobs import ReadyListener as ReadyListener  # re-exported
from consumer.jobs.driver_leases import LeaseStatements
from consumer.jobs.driver_operations import OperationStatements
from consumer.jobs.driver_operations import (  # re-exported: driver_base's name before
    check_operation_columns as check_operation_columns,
)
from consumer.jobs.driver_queues import QueueStatements
from consumer.jobs.driver_recovery import RecoveryStatements
from consumer.jobs.driver_replies import ReplyStatements
from consumer.jobs.driver_retention import RetentionStatements
from consumer.jobs.driver_schedules import ScheduleStatements
from consumer.jobs.migrations import upgrade_schema
from consumer.jobs.schema import metadata, provider_limits
from outbox.dialect import db_epoch
from outbox.outage import ConnectionWatch, retry_lost, watch_engine

READY_CHANNEL_SQL = "left('outbox_jobs_ready.' || current_schema(), 63)"
"""PostgreSQL NOTIFY channel: jobs became READY (enqueued, resumed, recovered, timers fired).
One channel per schema (``outbox_jobs_ready.<schema>``, computed by the server from the
session's ``current_schema()``, where the job table resolves): NOTIFY channels are
database-wide, and job stores in other schemas of the same database must not wake each
other's workers (nor make a quiet store look loud). A transaction that sent NOTIFY takes a
global lock at commit (it serialises heavy concurrent enqueuers), so it is sent only with
``StoreConfig(notify=True)``; by default workers poll."""

_NO_TIMER: dict[str, Any] = {
    "timer_scheduled_for": None,
    "timer_reason": None,
    "timer_subject_version": None,
    "timer_cancellation_condition": None,
}


class FencedOut(Exception):
    """Internal: the lease is not held; roll the transaction back."""


class JobDriver(
    JobStatements,
    ClaimStatements,
    QueueStatements,
    LeaseStatements,
    RecoveryStatements,
    FleetStatements,
    ScheduleStatements,
    RetentionStatements,
    CancelStatements,
    OperationStatements,
    ReplyStatements,
    DeliveryStatements,
    ABC,
):
    """The SQL both databases share; each dialect implements the abstract methods, where
    they differ (module docstring): no method is left to fail at run time. The statements
    of each area live in a mixin of their own (``consumer.jobs.driver_<area>``); this class
    keeps the connections, the schema and the provider's pause."""

    name = "generic"

    def __init__(self, engine: Engine, *, notify: bool = True) -> None:
        self.engine = engine
        self.notify = notify  # PostgreSQL: NOTIFY the ready channel when jobs become READY
        # Replaces the database clock where a call gives no ``now`` (``Store(clock=...)``: a
        # test that controls time, ``outbox.testing``); None: the database server's clock.
        self.clock: Callable[[], float] | None = None
        # An in-memory SQLite database is ONE connection shared by every thread (StaticPool):
        # transactions must not interleave on it.
        self._lock: AbstractContextManager[Any] = (
            threading.RLock() if isinstance(engine.pool, StaticPool) else nullcontext()
        )
        self._pinned = threading.local()  # a thread's own connection (:meth:`pinned`)
        # A connection cut under a statement (a failover, ``pg_terminate_backend``): logged
        # once when the first cut is seen, once when a new connection is made.
        self.watch: ConnectionWatch = watch_engine(
            engine, logging.getLogger("outbox.worker"), "job store"
        )
        self._joined = threading.local()  # a caller's transaction (:meth:`joined`)

    # -- connections and schema -----------------------------------------------------------

    @contextmanager
    def _checkout(self) -> Iterator[Connection]:
        pinned: Connection | None = getattr(self._pinned, "conn", None)
        with nullcontext(pinned) if pinned is not None else self.engine.connect() as conn:
            yield conn

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """This thread's :meth:`begin` and :meth:`connect` on ONE connection, held for the
        block: a worker's heartbeat, whose renewals must not queue for a pooled connection
        behind 256 slots' statements (its leases expired there)."""
        with self.engine.connect() as conn:
            self._pinned.conn = conn
            try:
                yield
            finally:
                self._pinned.conn = None

    @contextmanager
    def joined(self, conn: Connection) -> Iterator[None]:
        """This thread's :meth:`begin` (a savepoint) and :meth:`connect` on ``conn``, in its
        transaction, for the block: an operator's action commits with its audit row or not
        at all (``outbox.console.actions``). Only the operators' calls run joined: the
        dispatch path's own statements (its raw connections) never do."""
        self._joined.conn = conn
        try:
            yield
        finally:
            self._joined.conn = None

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A short read-write transaction owned by the store (commits on success)."""
        joined: Connection | None = getattr(self._joined, "conn", None)
        if joined is not None:
            with joined.begin_nested():
                yield joined
            return
        with self._lock, self._checkout() as conn:
            self._prepare(conn)
            with conn.begin():
                yield conn

    @contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """For ONE write statement that commits on its own (PostgreSQL: no BEGIN and COMMIT
        round trips; here: a short transaction)."""
        with self.begin() as conn:
            yield conn

    def job_claim_scope(self) -> AbstractContextManager[Connection]:
        """Where a batch claim runs alone (``Store.claim_batch``): a short transaction here
        (SQLite's claim is several statements under its write lock)."""
        return self.begin()

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection for reads."""
        joined: Connection | None = getattr(self._joined, "conn", None)
        if joined is not None:
            yield joined
            return
        with self._lock, self._checkout() as conn:
            yield conn

    @abstractmethod
    def _prepare(self, conn: Connection) -> None:
        """Per-dialect set-up of a write transaction before it begins."""

    def schema_create(self, conn: Connection) -> None:
        """Create the job tables if missing (idempotent), in ``conn``'s transaction."""
        metadata.create_all(conn, checkfirst=True)
        upgrade_schema(conn)

    def schema_has_table(self, conn: Connection, name: str) -> bool:
        """Whether a table ``name`` exists in this database (``outbox-worker purge``: the
        consumer's dead letters, when they share the job store's database)."""
        return bool(inspect(conn).has_table(name))

    # -- provider limits (consumer.jobs.limits) -------------------------------------------

    def provider_pause(self, provider: str) -> tuple[float, float] | None:
        """The provider's ``paused_until`` and the clock to compare it with (the database's,
        or :attr:`clock`), or None when it has no row: read before every provider call."""
        params: dict[str, Any] = {"provider": provider}
        if self.clock is not None:
            params["now"] = self.clock()

        def read() -> Any:
            with self.connect() as conn:
                return conn.execute(_pause_query(self.clock is not None), params).first()

        row = retry_lost(read)  # a read: again on a new connection when cut under it
        return None if row is None or row[0] is None else (float(row[0]), float(row[1]))


@lru_cache(maxsize=2)
def _pause_query(now_given: bool) -> Select[Any]:
    # Built once: building and compiling it on each call cost several times the read itself.
    now = bindparam("now", type_=Double) if now_given else db_epoch()
    return select(provider_limits.c.paused_until, now).where(
        provider_limits.c.provider == bindparam("provider")
    )
