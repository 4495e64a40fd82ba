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
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import lru_cache
from typing import Any, Protocol

from sqlalchemy import (
    ColumnElement,
    Double,
    Select,
    bindparam,
    case,
    delete,
    func,
    insert,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from consumer.bulk import bulk_insert
from consumer.jobs import queries as q
from consumer.jobs.migrations import upgrade_schema
from consumer.jobs.schema import (
    attempts,
    jobs,
    metadata,
    operations,
    paused_queues,
    provider_limits,
    workers,
)
from consumer.jobs.states import LEASED, READY, WAITING
from outbox.dialect import db_epoch, insert_or_ignore, is_postgresql

READY_CHANNEL_SQL = "left('outbox_jobs_ready.' || current_schema(), 63)"
"""PostgreSQL NOTIFY channel: jobs became READY (enqueued, resumed, recovered, timers fired).
One channel per schema (``outbox_jobs_ready.<schema>``, computed by the server from the
session's ``current_schema()``, where the job table resolves): NOTIFY channels are
database-wide, and job stores in other schemas of the same database must not wake each
other's workers (nor make a quiet store look loud). A transaction that sent NOTIFY takes a
global lock at commit (it serialises heavy concurrent enqueuers), so it is sent only with
``StoreConfig(notify=True)``; by default workers poll."""

INSERT_CHUNK = 500
"""Rows per statement of ``job_insert_many`` (one binary array per column on PostgreSQL)."""

_NO_TIMER: dict[str, Any] = {
    "timer_scheduled_for": None,
    "timer_reason": None,
    "timer_subject_version": None,
    "timer_cancellation_condition": None,
}


class FencedOut(Exception):
    """Internal: the lease is not held; roll the transaction back."""


class ReadyListener(Protocol):
    """A wake-up source for idle workers: ``wait`` returns True when jobs became READY."""

    def wait(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


class JobDriver(ABC):
    """The SQL both databases share; each dialect implements the abstract methods, where
    they differ (module docstring): no method is left to fail at run time."""

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

    # -- wake-up --------------------------------------------------------------------------

    @abstractmethod
    def job_ready_notify(self, conn: Connection) -> None:
        """Tell listening workers that jobs became READY (at ``conn``'s commit)."""

    @property
    def job_ready_channel_sql(self) -> str | None:
        """SQL naming the channel an INSERT of READY jobs notifies, or None (no NOTIFY)."""
        return None

    def job_ready_listener(self) -> ReadyListener | None:
        """A listener for :meth:`job_ready_notify` and enqueues, or None (poll only)."""
        return None

    def clock_read(self, conn: Connection, now: float | None) -> float:
        """``now`` if given, else the database clock in unix seconds."""
        if now is not None:
            return now
        if self.clock is not None:
            return self.clock()
        return float(conn.execute(select(db_epoch())).scalar_one())

    # -- jobs: insert ---------------------------------------------------------------------

    def job_insert(self, conn: Connection, values: Mapping[str, Any]) -> tuple[int, bool]:
        """Insert one job or find the existing ``(tenant, action)``: ``(id, created)``.

        ON CONFLICT DO NOTHING + RETURNING: SQLAlchemy 2.1 reports rowcount -1 for Core
        inserts, so RETURNING is how we learn whether this call created the row."""
        stmt = (
            insert_or_ignore(jobs, ("tenant", "action"), conn.dialect.name)
            .values(**values)
            .returning(jobs.c.id)
        )
        new_id = conn.execute(stmt).scalar()
        if new_id is not None:
            return int(new_id), True
        existing = conn.execute(
            select(jobs.c.id).where(
                jobs.c.tenant == values["tenant"], jobs.c.action == values["action"]
            )
        ).scalar()
        if existing is None:  # pragma: no cover - the conflicting row vanished (deleted)
            raise LookupError(f"job {values['tenant']}/{values['action']} was deleted meanwhile")
        return int(existing), False

    def job_insert_many(
        self, conn: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """Insert many jobs, one statement per :data:`INSERT_CHUNK`; returns the ids of the
        identities created and of those that existed (``consumer.bulk.bulk_insert``: binary
        ``unnest`` arrays on PostgreSQL, insertmanyvalues on SQLite).

        ``created_at``/``updated_at`` are numbers, or the database clock as an expression
        (the same object in every row): :meth:`job_rows_stamped` makes them what this database
        can bind."""
        rows = self.job_rows_stamped(conn, rows)
        created: dict[tuple[str, str], int] = {}
        for start in range(0, len(rows), INSERT_CHUNK):
            returned = bulk_insert(
                conn,
                jobs,
                rows[start : start + INSERT_CHUNK],
                conflict=("tenant", "action"),
                returning=("id", "tenant", "action"),
                notify=self.job_ready_channel_sql,
            )
            for job_id, tenant, action in returned:
                created[(tenant, action)] = int(job_id)
        missing = sorted({(r["tenant"], r["action"]) for r in rows} - set(created))
        existing: dict[tuple[str, str], int] = {}
        for start in range(0, len(missing), INSERT_CHUNK):
            existing.update(self.job_ids(conn, missing[start : start + INSERT_CHUNK]))
        return created, existing

    def job_rows_stamped(
        self, conn: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> Sequence[Mapping[str, Any]]:
        """Rows whose timestamps are the database clock get the clock read once (one value
        for the whole call, as ``now()`` is on PostgreSQL)."""
        stamp = rows[0]["created_at"]
        if isinstance(stamp, (int, float)):
            return rows
        value = self.clock_read(conn, None)
        return [{**row, "created_at": value, "updated_at": value} for row in rows]

    def job_ids(
        self, conn: Connection, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], int]:
        """The ids of existing jobs among ``(tenant, action)`` keys (SQLite: a row-value IN
        list, which its planner answers from the unique index)."""
        query = select(jobs.c.id, jobs.c.tenant, jobs.c.action).where(
            tuple_(jobs.c.tenant, jobs.c.action).in_(list(keys))
        )
        return {(tenant, action): int(job_id) for job_id, tenant, action in conn.execute(query)}

    # -- jobs: reads ----------------------------------------------------------------------

    def job_get(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        return conn.execute(select(jobs).where(where)).first()

    def job_state(self, conn: Connection, where: ColumnElement[bool]) -> str | None:
        state = conn.execute(select(jobs.c.state).where(where)).scalar()
        return None if state is None else str(state)

    def job_lease_state(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        """State, epoch and owner: what a refused fenced move reports."""
        return conn.execute(
            select(jobs.c.state, jobs.c.lease_epoch, jobs.c.lease_owner).where(where)
        ).first()

    def job_count_by_state(self, conn: Connection) -> dict[str, int]:
        rows = conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state)).all()
        return {str(state): int(n) for state, n in rows}

    def job_next_timer(self, conn: Connection) -> float | None:
        """The earliest ``run_after`` of a waiting job (``ix_outbox_jobs_waiting``: one probe)."""
        value = conn.execute(
            select(func.min(jobs.c.run_after)).where(jobs.c.state.in_(WAITING))
        ).scalar()
        return None if value is None else float(value)

    def attempt_list(self, conn: Connection, job_id: int) -> Sequence[Any]:
        return conn.execute(
            select(attempts).where(attempts.c.job_id == job_id).order_by(attempts.c.id)
        ).all()

    # -- jobs: claiming -------------------------------------------------------------------

    def job_lock_for_claim(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        """Lock one job row (PostgreSQL; SQLite holds its write lock already) so a claim's
        check and move are one step."""
        return conn.execute(
            select(
                jobs.c.id,
                jobs.c.queue,
                jobs.c.tenant,
                jobs.c.state,
                jobs.c.run_after,
                jobs.c.lease_owner,
                jobs.c.lease_epoch,
                jobs.c.lease_expires_at,
                jobs.c.attempts,
            )
            .where(where)
            .with_for_update()
        ).first()

    def job_lease(
        self,
        conn: Connection,
        job_id: int,
        state: str,
        epoch: int,
        worker: str,
        expires_at: float,
        clock: float,
    ) -> bool:
        """Lease the job read as ``(state, epoch)`` to ``worker`` with the next epoch."""
        moved = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.state == state, jobs.c.lease_epoch == epoch)
            .values(
                state=LEASED,
                lease_owner=worker,
                lease_epoch=epoch + 1,
                lease_expires_at=expires_at,
                attempts=jobs.c.attempts + 1,
                updated_at=clock,
            )
            .returning(jobs.c.id)
        ).first()
        return moved is not None

    def job_tenant_leased(self, conn: Connection, queue: str, tenant: str, cap: int) -> int:
        """How many jobs of ``tenant`` are LEASED in ``queue`` (at most ``cap`` counted), for a
        claim under a tenant limit: race-safe until the caller's transaction ends (SQLite: its
        write lock; PostgreSQL: the tenant's advisory lock, taken first)."""
        params = {"queue": queue, "tenant": tenant, "cap": cap}
        return int(conn.execute(q.sqlite_leased_count(), params).scalar_one())

    @abstractmethod
    def job_claim_batch(
        self, conn: Connection, params: dict[str, Any], now_given: bool
    ) -> Sequence[Any]:
        """Lease up to ``params["limit"]`` READY jobs fairly across tenants; rows carry
        ``consumer.jobs.queries.LEASE_COLUMNS``.

        ``params``: ``cursor``, ``max_tenants``, ``limit``, ``worker``, ``ttl`` (and ``now``
        when ``now_given``); the filters ``queues`` (names, or None: every queue), ``routes``
        (handler names, or None: every job) and the tenant limit ``tenant_limit`` (None: no
        default limit) with its overrides ``tenant_limits`` (tenant to limit). Paused queues
        are never claimed from."""

    # -- queues ---------------------------------------------------------------------------

    def job_depth(self, conn: Connection, queue: str | None) -> Sequence[Any]:
        """``(queue, ready, age)`` per queue with READY jobs (``queries.depth``: O(ready))."""
        params = {} if queue is None else {"queue": queue}
        return conn.execute(q.depth(conn.dialect.name, queue is not None), params).all()

    def queue_pause(self, conn: Connection, queue: str, clock: float) -> bool:
        """Pause ``queue``: True if it was not paused already."""
        stmt = insert_or_ignore(paused_queues, ("queue",), conn.dialect.name)
        row = conn.execute(
            stmt.values(queue=queue, paused_at=clock).returning(paused_queues.c.queue)
        ).first()
        return row is not None

    def queue_resume(self, conn: Connection, queue: str) -> bool:
        """Resume ``queue``: True if it was paused."""
        row = conn.execute(
            delete(paused_queues)
            .where(paused_queues.c.queue == queue)
            .returning(paused_queues.c.queue)
        ).first()
        return row is not None

    def queue_paused_list(self, conn: Connection) -> dict[str, float]:
        """Paused queues and when they were paused (a handful of rows)."""
        rows = conn.execute(select(paused_queues.c.queue, paused_queues.c.paused_at))
        return {str(name): float(at) for name, at in rows}

    def job_leased_by_tenant(self, conn: Connection) -> Sequence[Any]:
        """``(queue, tenant, leased)`` over LEASED jobs: O(leased), the jobs in flight
        (``ix_outbox_jobs_leased_tenant``), never the history."""
        return conn.execute(
            select(jobs.c.queue, jobs.c.tenant, func.count())
            .where(jobs.c.state == LEASED)
            .group_by(jobs.c.queue, jobs.c.tenant)
        ).all()

    def job_ready_count(self, conn: Connection, queue: str, tenant: str) -> int:
        """READY jobs of one tenant in one queue (a range of ``ix_outbox_jobs_ready``)."""
        return int(
            conn.execute(
                select(func.count()).where(
                    jobs.c.state == READY, jobs.c.queue == queue, jobs.c.tenant == tenant
                )
            ).scalar_one()
        )

    # -- jobs: the lease holder's moves ---------------------------------------------------

    def job_update_fenced(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        worker: str,
        epoch: int,
        values: Mapping[str, Any],
    ) -> int | None:
        """The fence: one UPDATE matching (job, epoch, owner, LEASED). The id, or None when
        no row matched (the caller raises Conflict or JobNotFound)."""
        row = conn.execute(
            update(jobs)
            .where(
                where,
                jobs.c.lease_epoch == epoch,
                jobs.c.lease_owner == worker,
                jobs.c.state == LEASED,
            )
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return None if row is None else int(row[0])

    def job_lease_extend(
        self, conn: Connection, job_id: int, worker: str, epoch: int, until: Any
    ) -> bool:
        """Fenced: make the lease last at least until ``until`` (a number or SQL expression),
        never shorter than it is. False when the lease is not held."""
        extended = case((jobs.c.lease_expires_at < until, until), else_=jobs.c.lease_expires_at)
        moved = self.job_update_fenced(
            conn, jobs.c.id == job_id, worker, epoch, {"lease_expires_at": extended}
        )
        return moved is not None

    def job_renew_batch(
        self,
        conn: Connection,
        worker: str,
        leases: Sequence[tuple[int, int]],
        until: float,
        clock: float,
    ) -> tuple[list[int], list[int]]:
        """Fenced: make each ``(job_id, epoch)`` lease of ``worker`` last at least until
        ``until``, never shorter than it is: ``(renewed, skipped)``. A row locked by another
        transaction (its holder finishing or moving it) is skipped, not waited for: the
        renewal never deadlocks with a batch finish (measured: it did, locking in another
        order); the others were lost."""
        wanted = tuple_(jobs.c.id, jobs.c.lease_epoch).in_(list(leases))
        present = {job_id for job_id, _ in leases}
        locking = (
            select(jobs.c.id)
            .where(jobs.c.id.in_(sorted(present)))
            .order_by(jobs.c.id)
            .with_for_update(skip_locked=True)
        )
        locked = {int(r[0]) for r in conn.execute(locking)}
        extended = case((jobs.c.lease_expires_at < until, until), else_=jobs.c.lease_expires_at)
        rows = conn.execute(
            update(jobs)
            .where(
                jobs.c.id.in_(sorted(locked)),
                wanted,
                jobs.c.lease_owner == worker,
                jobs.c.state == LEASED,
            )
            .values(lease_expires_at=extended, updated_at=clock)
            .returning(jobs.c.id)
        ).all()
        return [int(r[0]) for r in rows], sorted(present - locked)

    def job_lock_held(
        self, conn: Connection, where: ColumnElement[bool], worker: str, epoch: int
    ) -> Any:
        """Lock the job if ``worker`` holds it at ``epoch``: its failure counters."""
        return conn.execute(
            select(jobs.c.attempts, jobs.c.auth_failures, jobs.c.first_failed_at, jobs.c.provider)
            .where(
                where,
                jobs.c.lease_epoch == epoch,
                jobs.c.lease_owner == worker,
                jobs.c.state == LEASED,
            )
            .with_for_update()
        ).first()

    @abstractmethod
    def job_finish_batch(
        self, conn: Connection, worker: str, leases: Sequence[tuple[int, int]], when: float | None
    ) -> list[int]:
        """Finish ``(job_id, epoch)`` leases of ``worker``, each fenced on its own epoch, with
        their history rows; returns the ids finished (the others lost their lease)."""

    # -- jobs: moves by anyone (operators, timers, recovery) ------------------------------

    def job_update_from(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        from_states: Sequence[str],
        values: Mapping[str, Any],
    ) -> int | None:
        """Move the job if it is in one of ``from_states``: its id, or None."""
        row = conn.execute(
            update(jobs)
            .where(where, jobs.c.state.in_(list(from_states)))
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return None if row is None else int(row[0])

    def job_expired_list(self, conn: Connection, clock: float, limit: int) -> Sequence[Any]:
        """Expired leases, oldest first, locked with SKIP LOCKED (PostgreSQL)."""
        return conn.execute(
            select(jobs.c.id, jobs.c.lease_epoch, jobs.c.lease_owner, jobs.c.attempts)
            .where(jobs.c.state == LEASED, jobs.c.lease_expires_at <= clock)
            .order_by(jobs.c.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()

    def job_expire(
        self, conn: Connection, job_id: int, epoch: int, clock: float, values: Mapping[str, Any]
    ) -> bool:
        """Take back an expired lease, re-checked against the epoch read: a lease renewed or
        finished meanwhile is left alone."""
        hit = conn.execute(
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.lease_epoch == epoch,
                jobs.c.state == LEASED,
                jobs.c.lease_expires_at <= clock,
            )
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return hit is not None

    # -- worker liveness (outbox_workers) -------------------------------------------------

    def worker_beat(self, conn: Connection, name: str, clock: float, ttl: float) -> None:
        """Upsert ``name``'s liveness row: alive until ``clock + ttl``."""
        make = postgresql.insert if is_postgresql(conn.dialect.name) else sqlite.insert
        stmt = make(workers).values(name=name, alive_until=clock + ttl)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[workers.c.name],
                set_={"alive_until": stmt.excluded.alive_until},
            )
        )

    def worker_delete(self, conn: Connection, name: str) -> None:
        conn.execute(delete(workers).where(workers.c.name == name))

    def worker_dead_list(self, conn: Connection, clock: float) -> list[str]:
        """Workers whose liveness row expired (a tiny table: one row per running worker)."""
        rows = conn.execute(select(workers.c.name).where(workers.c.alive_until <= clock))
        return [str(r[0]) for r in rows]

    def job_owned_list(self, conn: Connection, owners: Sequence[str], limit: int) -> Sequence[Any]:
        """LEASED jobs held by ``owners``, locked with SKIP LOCKED (PostgreSQL)."""
        return conn.execute(
            select(jobs.c.id, jobs.c.lease_epoch, jobs.c.lease_owner, jobs.c.attempts)
            .where(jobs.c.state == LEASED, jobs.c.lease_owner.in_(list(owners)))
            .order_by(jobs.c.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()

    def job_take_back(
        self,
        conn: Connection,
        job_id: int,
        epoch: int,
        owner: str,
        clock: float,
        values: Mapping[str, Any],
    ) -> bool:
        """Take back a lease whose owner's liveness expired, re-checked against the epoch and
        owner read and the owner's row (a worker that beat again meanwhile keeps it)."""
        dead = (
            select(workers.c.name)
            .where(workers.c.name == owner, workers.c.alive_until <= clock)
            .exists()
        )
        hit = conn.execute(
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.lease_epoch == epoch,
                jobs.c.state == LEASED,
                jobs.c.lease_owner == owner,
                dead,
            )
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return hit is not None

    def worker_forget_dead(self, conn: Connection, names: Sequence[str], clock: float) -> None:
        """Delete expired liveness rows that no longer own a lease."""
        owns = (
            select(jobs.c.id)
            .where(jobs.c.state == LEASED, jobs.c.lease_owner == workers.c.name)
            .exists()
        )
        conn.execute(
            delete(workers).where(
                workers.c.name.in_(list(names)), workers.c.alive_until <= clock, ~owns
            )
        )

    def job_due_list(self, conn: Connection, clock: float, limit: int) -> Sequence[Any]:
        """Waiting jobs whose timer is due, locked with SKIP LOCKED (PostgreSQL)."""
        return conn.execute(
            select(jobs.c.id, jobs.c.state)
            .where(jobs.c.state.in_(WAITING), jobs.c.run_after <= clock)
            .order_by(jobs.c.run_after)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()

    def attempt_insert(
        self,
        conn: Connection,
        job_id: int,
        epoch: int | None,
        worker: str | None,
        outcome: str,
        error: str | None,
        clock: float,
    ) -> None:
        conn.execute(
            insert(attempts).values(
                job_id=job_id, epoch=epoch, worker=worker, outcome=outcome, error=error, at=clock
            )
        )

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
