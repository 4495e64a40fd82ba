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
pause and rate reservations), ``driver_schedules``, ``driver_retention`` and
``driver_cancels`` (cancel requests).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import lru_cache
from typing import Any

from sqlalchemy import Double, Select, bindparam, inspect, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from consumer.jobs.driver_cancels import CancelStatements
from consumer.jobs.driver_claims import ClaimStatements
from consumer.jobs.driver_fleet import FleetStatements
from consumer.jobs.driver_jobs import INSERT_CHUNK as INSERT_CHUNK  # re-exported
from consumer.jobs.driver_jobs import JobStatements
from consumer.jobs.driver_jobs import ReadyListener as ReadyListener  # re-exported
from consumer.jobs.driver_leases import LeaseStatements
from consumer.jobs.driver_queues import QueueStatements
from consumer.jobs.driver_recovery import RecoveryStatements
from consumer.jobs.driver_retention import RetentionStatements
from consumer.jobs.driver_schedules import ScheduleStatements
from consumer.jobs.migrations import upgrade_schema
from consumer.jobs.schema import metadata, operations, provider_limits
from outbox.dialect import db_epoch, insert_or_ignore

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
    ABC,
):
    """The SQL both databases share; each dialect implements the abstract methods, where
    they differ (module docstring): no method is left to fail at run time. The statements
    of each area live in a mixin of their own (``consumer.jobs.driver_<area>``); this class
    keeps the connections, the schema, the provider's pause and the operations' receipts."""

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
    def begin(self) -> Iterator[Connection]:
        """A short read-write transaction owned by the store (commits on success)."""
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

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection for reads."""
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
        with self.connect() as conn:
            row = conn.execute(_pause_query(self.clock is not None), params).first()
        return None if row is None or row[0] is None else (float(row[0]), float(row[1]))

    # -- operation intents and receipts (consumer.jobs.operations) ------------------------

    def operation_insert(self, conn: Connection, values: Mapping[str, Any]) -> float | None:
        """Insert an intent unless its operation id exists: the call deadline it was created
        with, or None when it existed."""
        created = conn.execute(
            insert_or_ignore(operations, ("operation_id",), conn.dialect.name)
            .values(**values)
            .returning(operations.c.call_deadline)
        ).first()
        return None if created is None else float(created[0])

    def operation_intent(
        self,
        *,
        operation_id: str,
        job_id: int,
        provider: str,
        digest: str,
        timeout: float,
        worker: str,
        epoch: int,
    ) -> str:
        """The fast path of a dispatch, committed on its own: create the intent of a call
        (PENDING, its deadline now + ``timeout``, the call counted) and extend the lease to
        that deadline, both or neither. ``"created"``; ``"exists"`` when the operation has
        an intent already (nothing written; the caller reads it); ``"fenced"`` when the
        lease is not held at ``epoch``; ``"paused"`` when the provider is paused (the
        check before every call, in the same unit of work; nothing written)."""
        now: Any = db_epoch() if self.clock is None else self.clock()
        try:
            with self.begin() as conn:
                given = {"now": now} if self.clock is not None else {}
                row = conn.execute(_pause_query(bool(given)), {"provider": provider, **given})
                if (found := row.first()) is not None and found[0] > found[1]:
                    return "paused"
                created = self.operation_insert(
                    conn,
                    {
                        "operation_id": operation_id,
                        "job_id": job_id,
                        "provider": provider,
                        "request_digest": digest,
                        "state": "PENDING",
                        "attempts": 1,
                        "call_deadline": now + timeout,
                        "created_at": now,
                        "updated_at": now,
                    },
                )
                if created is None:
                    return "exists"
                if not self.job_lease_extend(conn, job_id, worker, epoch, created):
                    raise FencedOut  # rolls the intent back with the transaction
        except FencedOut:
            return "fenced"
        return "created"

    def operation_get(self, conn: Connection, operation_id: str, *, lock: bool = False) -> Any:
        query = select(operations).where(operations.c.operation_id == operation_id)
        if lock:
            query = query.with_for_update()
        return conn.execute(query).first()

    def operation_update(
        self,
        conn: Connection,
        operation_id: str,
        values: Mapping[str, Any],
        *,
        unless_states: Sequence[str] = (),
        if_states: Sequence[str] = (),
        if_attempts: int | None = None,
    ) -> bool:
        """Update one receipt; True if it matched. ``unless_states``/``if_states`` filter on
        its state, ``if_attempts`` on its call count (compare-and-set: no new call was made
        since it was read)."""
        stmt = update(operations).where(operations.c.operation_id == operation_id)
        if unless_states:
            stmt = stmt.where(operations.c.state.not_in(list(unless_states)))
        if if_states:
            stmt = stmt.where(operations.c.state.in_(list(if_states)))
        if if_attempts is not None:
            stmt = stmt.where(operations.c.attempts == if_attempts)
        row = conn.execute(stmt.values(**values).returning(operations.c.operation_id)).first()
        return row is not None

    def operation_record(
        self,
        operation_id: str,
        values: Mapping[str, Any],
        *,
        stamp: Sequence[str] = (),
        unless_states: Sequence[str] = (),
        if_states: Sequence[str] = (),
        if_attempts: int | None = None,
        durable: bool = True,
    ) -> bool:
        """Record a call's outcome on its receipt in one statement, committed on its own:
        ``values`` are plain column values, ``stamp`` names the columns set to the database
        clock; the filters are :meth:`operation_update`'s. True if the receipt matched.
        ``durable=False``: no wait for the WAL flush (PostgreSQL; ``Operations._update``)."""
        check_operation_columns([*values, *stamp])
        stamped = dict(values)
        for column in stamp:
            stamped[column] = db_epoch()
        with self.autocommit() as conn:
            return self.operation_update(
                conn,
                operation_id,
                stamped,
                unless_states=unless_states,
                if_states=if_states,
                if_attempts=if_attempts,
            )

    def operation_list(
        self,
        conn: Connection,
        *,
        states: Sequence[str] | None = None,
        due_before: float | None = None,
        limit: int = 1000,
        skip_locked: bool = False,
    ) -> Sequence[Any]:
        """Receipts, oldest first; ``due_before``: only those whose call deadline passed
        (no deadline counts as passed)."""
        query = select(operations)
        if states:
            query = query.where(operations.c.state.in_(list(states)))
        if due_before is not None:
            query = query.where(
                (operations.c.call_deadline.is_(None)) | (operations.c.call_deadline <= due_before)
            )
        query = query.order_by(operations.c.updated_at, operations.c.operation_id).limit(limit)
        if skip_locked:
            query = query.with_for_update(skip_locked=True)
        return conn.execute(query).all()


@lru_cache(maxsize=2)
def _pause_query(now_given: bool) -> Select[Any]:
    # Built once: building and compiling it on each call cost several times the read itself.
    now = bindparam("now", type_=Double) if now_given else db_epoch()
    return select(provider_limits.c.paused_until, now).where(
        provider_limits.c.provider == bindparam("provider")
    )


def check_operation_columns(names: Sequence[str]) -> None:
    for name in names:
        if name not in operations.c:
            raise ValueError(f"{name!r} is not a column of {operations.name}")
