"""The durable job store: leases fenced by epochs, waiting states, timers, tenant fairness.

A job is an obligation with a lifecycle, not a sleeping process: a row in ``outbox_jobs``
(see ``consumer.jobs.schema``) that moves between the states of ``consumer.jobs.states``.

Contract:

- **Identity.** ``(tenant, action)`` is unique; ``enqueue`` of an existing identity returns
  the existing job with ``duplicate=True`` (also when it is DONE: an action happens once).
- **Fencing.** ``claim`` increments ``lease_epoch``. Every move by a lease holder (``renew``,
  ``finish``, ``fail``, ``wait_external``, ``wait_review``, ``schedule`` and ``cancel`` given a
  lease) is one ``UPDATE ... WHERE id = :id AND lease_epoch = :epoch AND lease_owner =
  :worker AND state = 'LEASED'``; no row matched means :class:`~consumer.errors.Conflict`.
  The epoch is the fence, not the clock: after its lease expired a holder may still finish
  as long as nobody claimed or recovered the job meanwhile (doing so changes the epoch or
  the state and fences it out).
- **Refused claims return None.** ``claim`` of a job whose lease is live, or that is not
  READY (or not yet eligible), returns ``None``; an unknown job raises ``JobNotFound``.
- **Time.** ``now`` (unix seconds, or a datetime; naive means UTC) replaces the database
  clock in a call; without it every comparison uses the database server's clock.
- **Transitions** are checked against ``consumer.jobs.states.TRANSITIONS`` (one table); a
  disallowed one raises ``IllegalTransition``.
- **Fairness** (``claim_batch`` / ``claim_next``): round robin over the tenants that have
  READY work. Each claim splits its batch into equal shares per tenant (a tenant with fewer
  eligible jobs leaves its share unused for that claim) and the order of tenants rotates
  from claim to claim, so with ``claim_next`` (batch of one) tenants alternate: tenant B's
  10 jobs are all claimed within the first 20 claims even if tenant A has 10,000 ready.
  Within a tenant: higher ``priority`` first, then enqueue order.
- **Recovery** (``recover``, run by workers periodically): expired leases go back to READY,
  or to NEEDS_ATTENTION when ``max_attempts`` claims were spent; due timers of waiting jobs
  make them READY. Bounded by ``limit`` rows per call; it never touches a live lease.
- **Storage.** Every statement runs through ``Store.driver`` (``consumer.jobs.driver``: one
  PostgreSQL and one SQLite implementation side by side); this module never asks which
  database it runs on. Names are checked by ``outbox.validate`` before anything is written.
- **Wake-ups** (PostgreSQL, ``StoreConfig.notify``): an enqueue that creates a job, a
  ``resume`` and a recovery that makes jobs READY send a NOTIFY at commit; idle workers
  LISTEN.
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, and_, case
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from consumer.bulk import deferred_writes
from consumer.errors import Conflict, IllegalTransition, JobError, JobNotFound
from consumer.jobs.driver import JobDriver, driver_for, engine_for
from consumer.jobs.retry import RetryPolicy
from consumer.jobs.schema import db_epoch, jobs
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING,
    WAITING_EXTERNAL,
    WAITING_REVIEW,
    check_transition,
    sources,
)
from outbox.errors import ConfigError
from outbox.validate import check_name

Time = float | int | datetime
_T = TypeVar("_T")


# -- rows ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnqueueResult:
    """``job_id`` of the job; ``duplicate`` is True when the identity existed already."""

    job_id: int
    duplicate: bool


class DeferredEnqueue(EnqueueResult):
    """The result of an ``enqueue`` buffered in a consumer's batch transaction (see
    ``Store.enqueue``): reading ``job_id`` or ``duplicate`` writes the buffer first (flush on
    access), so the answer is always right; a handler that never reads it costs no round
    trip of its own."""

    def __init__(self, buffer: _EnqueueBuffer, index: int) -> None:
        object.__setattr__(self, "_buffer", buffer)
        object.__setattr__(self, "_index", index)

    def _resolved(self) -> EnqueueResult:
        buffer: _EnqueueBuffer = object.__getattribute__(self, "_buffer")
        return buffer.result(object.__getattribute__(self, "_index"))

    @property
    def job_id(self) -> int:
        return self._resolved().job_id

    @property
    def duplicate(self) -> bool:
        return self._resolved().duplicate

    def __repr__(self) -> str:
        return f"DeferredEnqueue(job_id={self.job_id}, duplicate={self.duplicate})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EnqueueResult):
            return NotImplemented
        return (self.job_id, self.duplicate) == (other.job_id, other.duplicate)

    def __hash__(self) -> int:
        return hash((self.job_id, self.duplicate))


class _EnqueueBuffer:
    """Jobs enqueued in one consumer batch Session, written together at its flush
    (``consumer.bulk``'s deferred writes: one statement per 500 instead of one round trip
    per job)."""

    def __init__(self, store: Store, session: Session) -> None:
        self.store = store
        self.session = session
        self.rows: list[dict[str, Any]] = []
        self.results: list[EnqueueResult | None] = []
        self.start = 0  # index of self.rows[0] in self.results

    def add(self, values: dict[str, Any]) -> DeferredEnqueue:
        self.rows.append(values)
        self.results.append(None)
        return DeferredEnqueue(self, len(self.results) - 1)

    def flush(self, conn: Connection) -> None:
        rows, start = self.rows, self.start
        self.rows, self.start = [], len(self.results)
        # Rows with an explicit ``now`` keep their own timestamp: one statement per run of
        # rows that share it (usually the whole buffer).
        index = 0
        while index < len(rows):
            end = index + 1
            while end < len(rows) and _same_stamp(rows[end], rows[index]):
                end += 1
            for offset, result in enumerate(self.store._enqueue_many(conn, rows[index:end])):
                self.results[start + index + offset] = result
            index = end

    def result(self, index: int) -> EnqueueResult:
        found = self.results[index]
        if found is None:
            writers = deferred_writes(self.session)
            if writers is None or writers.get(self.store) is not self:
                raise Conflict("this enqueue was rolled back with its handler's savepoint")
            self.flush(self.session.connection())
            found = self.results[index]
        assert found is not None
        return found


def _same_stamp(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    x, y = a["created_at"], b["created_at"]
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y
    return not isinstance(x, (int, float)) and not isinstance(y, (int, float))


@dataclass(frozen=True)
class Timer:
    """A business timer: when, why, against which subject version, and the condition (JSON
    data the handler interprets) under which it must not act."""

    scheduled_for: float
    reason: str
    subject_version: str | None = None
    cancellation_condition: Any = None


@dataclass(frozen=True)
class Lease:
    """A claimed job: what a worker needs to run it and to prove it still holds it."""

    job_id: int
    tenant: str
    action: str
    kind: str | None
    subject: str | None
    subject_version: str | None
    payload: Any
    provider: str | None
    attempts: int
    epoch: int
    worker: str
    expires_at: float
    timer: Timer | None = None


@dataclass(frozen=True)
class Job:
    """A snapshot of a job row (``Store.get``)."""

    id: int
    tenant: str
    action: str
    kind: str | None
    subject: str | None
    subject_version: str | None
    payload: Any
    provider: str | None
    state: str
    priority: int
    run_after: float | None
    attempts: int
    auth_failures: int
    last_error: str | None
    wait_reason: str | None
    lease_owner: str | None
    lease_expires_at: float | None
    lease_epoch: int
    timer: Timer | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class Attempt:
    """One row of a job's history."""

    job_id: int
    epoch: int | None
    worker: str | None
    outcome: str
    error: str | None
    at: float


@dataclass(frozen=True)
class RecoveryResult:
    requeued: int = 0
    needs_attention: int = 0
    woken: int = 0


@dataclass(frozen=True)
class BatchResult:
    """``finish_batch``: the job ids finished, and those whose lease was lost (fenced)."""

    done: list[int] = field(default_factory=list)
    conflicts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StoreConfig:
    """Frozen store settings. ``max_attempts`` of ``retry`` also bounds lease expiries.

    ``notify`` (PostgreSQL): enqueues, resumes and recoveries NOTIFY, so LISTENing workers
    claim at once instead of at their next poll. False turns it off (a transaction that sent
    NOTIFY takes a global lock at commit: heavy concurrent enqueuers may prefer polling)."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_tenants_scanned: int = 1000
    recover_limit: int = 500
    notify: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError("retry", "must be a RetryPolicy")
        if not isinstance(self.notify, bool):
            raise ConfigError("notify", f"must be True or False, got {self.notify!r}")
        for name in ("max_tenants_scanned", "recover_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")


# -- the store -------------------------------------------------------------------------------


class Store:
    """The job store on one database (see the module docstring for the contract).

    ``Store()`` is an in-memory SQLite database (one shared connection, so it lives as long
    as the Store); ``Store(url_or_engine)`` otherwise: a URL or the same Engine the rest of
    the application uses. The schema is created on construction (idempotent) unless
    ``create_schema=False``.

    ``driver`` (:class:`consumer.jobs.driver.JobDriver`) is the storage seam: every statement
    the store runs goes through it, and the other modules of ``consumer.jobs`` (operation
    intents) use it too, in transactions from ``driver.begin()``.
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine | None = None,
        *,
        config: StoreConfig | None = None,
        create_schema: bool = True,
    ) -> None:
        if isinstance(url_or_engine, Engine):
            self.engine = url_or_engine
        elif url_or_engine is None or isinstance(url_or_engine, (str, URL)):
            self.engine = engine_for(url_or_engine)
        else:
            raise ConfigError(
                "url_or_engine",
                f"expected a URL string or an Engine, got {type(url_or_engine).__name__}",
            )
        self.config = config if config is not None else StoreConfig()
        if not isinstance(self.config, StoreConfig):
            raise ConfigError("config", "must be a StoreConfig")
        self.driver: JobDriver = driver_for(self.engine, notify=self.config.notify)
        self._cursor = ""  # fairness rotation: the tenant served first by the last claim
        self._cursor_lock = threading.Lock()
        if create_schema:
            self.create_schema()

    def create_schema(self) -> None:
        """Create the job tables if they do not exist (idempotent)."""
        with self.driver.begin() as conn:
            self.driver.schema_create(conn)

    def dispose(self) -> None:
        self.engine.dispose()

    # -- plumbing ------------------------------------------------------------------------

    def _clock(self, conn: Connection, now: float | None) -> float:
        return self.driver.clock_read(conn, now)

    # -- enqueue -------------------------------------------------------------------------

    def enqueue(
        self,
        tenant: str,
        action: str,
        *,
        subject: str | None = None,
        subject_version: str | int | None = None,
        payload: Any = None,
        priority: int = 0,
        run_after: Time | None = None,
        kind: str | None = None,
        provider: str | None = None,
        session: Session | Connection | None = None,
        now: Time | None = None,
    ) -> EnqueueResult:
        """Create the job ``(tenant, action)`` in READY, or return the existing one.

        With ``session`` (a SQLAlchemy Session or Connection) the insert joins the caller's
        transaction and is never committed here; otherwise the store commits it. In a
        consumer's batch Session (``tx.session``, marked by ``consumer.bulk.defer_writes``) the
        row is buffered and written with the batch's other enqueues in one statement before
        the handlers' savepoint is released; the result (:class:`DeferredEnqueue`) writes the
        buffer first if ``job_id`` or ``duplicate`` is read before that.
        ``run_after`` delays eligibility; ``kind`` names the handler (default: routed by the
        action's prefix); ``provider`` selects a per-provider backoff ceiling.
        """
        values = _job_values(
            tenant,
            action,
            subject=subject,
            subject_version=subject_version,
            payload=payload,
            priority=priority,
            run_after=run_after,
            kind=kind,
            provider=provider,
            now=now,
        )
        writers = deferred_writes(session)
        if writers is not None:  # a consumer's batch Session: written with the batch
            buffer = writers.get(self)
            if not isinstance(buffer, _EnqueueBuffer):
                assert isinstance(session, Session)
                buffer = _EnqueueBuffer(self, session)
                writers[self] = buffer
            return buffer.add(values)
        return self._in_session(session, lambda conn: self._enqueue(conn, values))

    def enqueue_many(
        self,
        specs: Iterable[Mapping[str, Any]],
        *,
        session: Session | Connection | None = None,
        now: Time | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue many jobs in one statement per 500; results in the order given.

        Each spec is a mapping of ``enqueue``'s arguments (``tenant`` and ``action``
        required). Every spec is validated before anything is written. An identity that
        already existed, or that appears earlier in the same list, comes back with
        ``duplicate=True``. ``session`` joins the caller's transaction as in ``enqueue``:
        a consumer's batch handler creates a whole batch of jobs in one round trip.
        """
        if isinstance(specs, Mapping):
            raise JobError("specs", "enqueue_many takes a list of job specs, not one mapping")
        rows: list[dict[str, Any]] = []
        for index, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise JobError("specs", f"item {index} is {type(spec).__name__}, not a mapping")
            unknown = set(spec) - _SPEC_FIELDS
            if unknown:
                raise JobError("specs", f"item {index} has unknown fields {sorted(unknown)}")
            if "tenant" not in spec or "action" not in spec:
                raise JobError("specs", f"item {index} needs tenant and action")
            rows.append(_job_values(**spec, now=now))
        if not rows:
            return []
        return self._in_session(session, lambda conn: self._enqueue_many(conn, rows))

    def _in_session(
        self, session: Session | Connection | None, work: Callable[[Connection], _T]
    ) -> _T:
        if session is None:
            with self.driver.begin() as conn:
                return work(conn)
        if isinstance(session, Session):
            return work(session.connection())
        if isinstance(session, Connection):
            return work(session)
        raise JobError("session", f"must be a Session or Connection, got {type(session).__name__}")

    def _enqueue(self, conn: Connection, values: dict[str, Any]) -> EnqueueResult:
        try:
            job_id, created = self.driver.job_insert(conn, values)
        except LookupError as exc:  # pragma: no cover - the conflicting row was deleted
            raise Conflict(str(exc)) from None
        return EnqueueResult(job_id, not created)

    def _enqueue_many(self, conn: Connection, rows: list[dict[str, Any]]) -> list[EnqueueResult]:
        # Every row of one call shares its timestamp (``now``, else the database clock read
        # once), and the batch goes as ONE statement per 500 (the driver). ON CONFLICT DO
        # NOTHING skips identities that exist and the second of two equal ones in the batch;
        # RETURNING names the rows that were created.
        stamp = rows[0]["created_at"]
        if any(row["created_at"] is not stamp for row in rows):
            rows = [{**row, "created_at": stamp, "updated_at": stamp} for row in rows]
        created, existing = self.driver.job_insert_many(conn, rows)
        keys = [(row["tenant"], row["action"]) for row in rows]
        results: list[EnqueueResult] = []
        seen: set[tuple[str, str]] = set()
        for key in keys:
            if key in created and key not in seen:
                results.append(EnqueueResult(created[key], False))
            elif key in created:
                results.append(EnqueueResult(created[key], True))
            elif key in existing:
                results.append(EnqueueResult(existing[key], True))
            else:  # pragma: no cover - the conflicting row vanished (deleted)
                raise Conflict(f"job {key[0]}/{key[1]} was deleted meanwhile")
            seen.add(key)
        return results

    # -- reading -------------------------------------------------------------------------

    def get(self, job: Any, action: str | None = None) -> Job:
        """The job's current row; ``JobNotFound`` if it does not exist."""
        where, label = _key(job, action)
        with self.driver.connect() as conn:
            row = self.driver.job_get(conn, where)
        if row is None:
            raise JobNotFound(f"no job {label}")
        return _job(row)

    def history(self, job: Any, action: str | None = None) -> list[Attempt]:
        """The job's attempt history, oldest first."""
        job_id = self.get(job, action).id
        with self.driver.connect() as conn:
            rows = self.driver.attempt_list(conn, job_id)
        return [Attempt(r.job_id, r.epoch, r.worker, r.outcome, r.error, float(r.at)) for r in rows]

    def counts(self) -> dict[str, int]:
        """Jobs per state (every state present, zero when none)."""
        with self.driver.connect() as conn:
            found = self.driver.job_count_by_state(conn)
        result = dict.fromkeys(
            (READY, LEASED, WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION, DONE, CANCELLED), 0
        )
        result.update(found)
        return result

    def next_timer(self) -> float | None:
        """When the earliest timer of a waiting job comes due (unix seconds), or None: a
        worker wakes for it instead of waiting for its next recovery."""
        with self.driver.connect() as conn:
            return self.driver.job_next_timer(conn)

    # -- claiming ------------------------------------------------------------------------

    def claim(
        self,
        tenant: str,
        action: str,
        worker: str,
        now: Time | None = None,
        ttl: float = 30,
    ) -> int | None:
        """Lease the job ``(tenant, action)`` to ``worker`` for ``ttl`` seconds.

        Returns the new epoch, or ``None`` when the job cannot be claimed now: its lease is
        live, it is not READY, or ``run_after`` is still ahead. An expired lease is taken
        over (the old holder is fenced out by the new epoch and its attempt recorded as
        ``expired``). Unknown job: ``JobNotFound``.
        """
        _name("tenant", tenant)
        _name("action", action)
        _name("worker", worker)
        seconds = _ttl(ttl)
        when = _time("now", now)
        where, label = _key(tenant, action)
        with self.driver.begin() as conn:
            row = self.driver.job_lock_for_claim(conn, where)
            if row is None:
                raise JobNotFound(f"no job {label}")
            clock = self._clock(conn, when)
            takeover = row.state == LEASED and row.lease_expires_at <= clock
            if row.state == LEASED and not takeover:
                return None
            if row.state == READY and row.run_after is not None and row.run_after > clock:
                return None
            if row.state not in (READY, LEASED):
                return None
            if takeover and row.attempts >= self.config.retry.max_attempts:
                return None  # spent: recovery moves it to NEEDS_ATTENTION
            new_epoch = int(row.lease_epoch) + 1
            leased = self.driver.job_lease(
                conn, row.id, row.state, int(row.lease_epoch), worker, clock + seconds, clock
            )
            if not leased:  # pragma: no cover - the row lock makes this unreachable
                return None
            if takeover:
                self._record(
                    conn,
                    row.id,
                    int(row.lease_epoch),
                    row.lease_owner,
                    "expired",
                    "lease expired",
                    clock,
                )
            return new_epoch

    def claim_next(self, worker: str, ttl: float = 30, *, now: Time | None = None) -> Lease | None:
        """Claim one eligible job, fairly across tenants (see the module docstring)."""
        leases = self.claim_batch(worker, 1, ttl, now=now)
        return leases[0] if leases else None

    def claim_batch(
        self, worker: str, limit: int, ttl: float = 30, *, now: Time | None = None
    ) -> list[Lease]:
        """Claim up to ``limit`` eligible jobs in one short transaction, round robin over
        tenants; each gets its own epoch. PostgreSQL: one statement, FOR UPDATE SKIP LOCKED."""
        _name("worker", worker)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise JobError("limit", f"must be a positive integer, got {limit!r}")
        seconds = _ttl(ttl)
        when = _time("now", now)
        with self._cursor_lock:
            cursor = self._cursor
        params: dict[str, Any] = {
            "cursor": cursor,
            "max_tenants": self.config.max_tenants_scanned,
            "limit": limit,
            "worker": worker,
            "ttl": seconds,
        }
        if when is not None:
            params["now"] = when
        with self.driver.begin() as conn:
            rows = self.driver.job_claim_batch(conn, params, when is not None)
        leases = [_lease(row) for row in rows]
        leases.sort(key=lambda lease: (lease.tenant <= cursor, lease.tenant, lease.job_id))
        if leases:
            with self._cursor_lock:
                self._cursor = leases[0].tenant
        return leases

    # -- the lease holder's moves (compare-and-set on (job, epoch)) ----------------------

    def renew(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        ttl: float = 30,
        now: Time | None = None,
    ) -> float:
        """Extend the lease to at least ``now + ttl``, never shorter than it is: a heartbeat
        landing just after a dispatch extended the lease to its provider call's deadline must
        not pull it back (the lease would expire mid-call). Returns the lease's expiry.
        ``Conflict`` if fenced."""
        seconds = _ttl(ttl)
        when = _time("now", now)
        where, label, who, epoch_ = _holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            until = clock + seconds
            # One fenced UPDATE, max(current, until) in SQL on both databases (like
            # JobDriver.job_lease_extend), so no concurrent extension is lost in between.
            longest = case((jobs.c.lease_expires_at < until, until), else_=jobs.c.lease_expires_at)
            job_id = self._cas(
                conn, where, label, who, epoch_, LEASED, {"lease_expires_at": longest}, clock
            )
            row = self.driver.job_get(conn, jobs.c.id == job_id)
        expires = None if row is None else row.lease_expires_at
        return until if expires is None else max(until, float(expires))

    def finish(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        now: Time | None = None,
    ) -> None:
        """LEASED -> DONE. ``Conflict`` if ``epoch`` is stale or the lease is not held."""
        when = _time("now", now)
        where, label, who, epoch_ = _holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            self._move(conn, where, label, who, epoch_, DONE, {}, "done", None, when)

    def finish_batch(self, leases: Iterable[Lease], *, now: Time | None = None) -> BatchResult:
        """Finish many leases in one transaction, each fenced on its own epoch. Leases that
        were lost are returned in ``conflicts`` (nothing raised): the caller decides."""
        items = list(leases)
        for lease in items:
            if not isinstance(lease, Lease):
                raise JobError("leases", f"expected Lease objects, got {type(lease).__name__}")
        when = _time("now", now)
        if not items:
            return BatchResult()
        done: list[int] = []
        by_worker: dict[str, list[Lease]] = {}
        for lease in items:
            by_worker.setdefault(lease.worker, []).append(lease)
        with self.driver.begin() as conn:
            for worker, group in by_worker.items():
                pairs = [(lease.job_id, lease.epoch) for lease in group]
                done.extend(self.driver.job_finish_batch(conn, worker, pairs, when))
        finished = set(done)
        return BatchResult(
            done=sorted(finished),
            conflicts=sorted(x.job_id for x in items if x.job_id not in finished),
        )

    def release(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        now: Time | None = None,
    ) -> None:
        """LEASED -> READY without counting a failure: a draining worker hands back a job it
        claimed but did not start (the claim is not counted as an attempt)."""
        self._hand_back(job, action, worker, epoch, None, "released", None, now)

    def defer(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        until: Time,
        reason: str | None = None,
        now: Time | None = None,
    ) -> None:
        """LEASED -> READY at ``until`` without counting a failure: the job cannot act yet
        (an earlier provider call may still be in flight until its deadline)."""
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        at = _time("until", until)
        if at is None:
            raise JobError("until", "is required")
        self._hand_back(job, action, worker, epoch, at, "deferred", reason, now)

    def _hand_back(
        self,
        job: Any,
        action: str | None,
        worker: str | None,
        epoch: int | None,
        run_after: float | None,
        outcome: str,
        note: str | None,
        now: Time | None,
    ) -> None:
        when = _time("now", now)
        where, label, who, epoch_ = _holder(job, action, worker, epoch)
        values: dict[str, Any] = {"attempts": jobs.c.attempts - 1}
        if run_after is not None:
            values["run_after"] = run_after
        with self.driver.begin() as conn:
            self._move(
                conn,
                where,
                label,
                who,
                epoch_,
                READY,
                values,
                outcome,
                note,
                when,
                clear_timer=False,
            )

    def fail(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        error: str | BaseException = "",
        kind: str = "transient",
        provider: str | None = None,
        now: Time | None = None,
        rng: random.Random | None = None,
        retry_after: float | None = None,
    ) -> str:
        """Record a failed attempt; returns the job's new state (see ``consumer.jobs.retry``):
        transient -> READY after a jittered backoff (NEEDS_ATTENTION when spent), permanent
        -> WAITING_REVIEW, auth -> READY then NEEDS_ATTENTION after a few. ``retry_after``
        (seconds, a provider's ``Retry-After``) is the shortest delay before the retry."""
        if kind not in ("transient", "permanent", "auth"):
            raise JobError("kind", f"must be transient, permanent or auth, got {kind!r}")
        if retry_after is not None and (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, (int, float))
            or not math.isfinite(retry_after)
            or retry_after < 0
        ):
            raise JobError("retry_after", f"must be a non-negative number, got {retry_after!r}")
        _name("provider", provider, optional=True)
        text_error = _error_text(error)
        when = _time("now", now)
        where, label, who, epoch_ = _holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            row = self.driver.job_lock_held(conn, where, who, epoch_)
            if row is None:
                self._diagnose(conn, where, label, who, epoch_)
            assert row is not None
            clock = self._clock(conn, when)
            auth_failures = row.auth_failures + 1 if kind == "auth" else 0
            started = row.first_failed_at if row.first_failed_at is not None else clock
            decision = self.config.retry.decide(
                kind,
                attempts=int(row.attempts),
                auth_failures=auth_failures,
                elapsed=max(0.0, clock - started),
                provider=provider or row.provider,
                rng=rng,
            )
            values: dict[str, Any] = {
                "auth_failures": auth_failures,
                "first_failed_at": started,
                "last_error": text_error,
            }
            if decision.state == READY:
                values["run_after"] = clock + max(decision.delay, retry_after or 0.0)
            else:
                values["wait_reason"] = decision.reason
            outcome = {READY: "retry"}.get(decision.state, decision.state.lower())
            self._move(
                conn, where, label, who, epoch_, decision.state, values, outcome, text_error, clock
            )
        return decision.state

    def wait_external(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        reason: str | None = None,
        until: Time | None = None,
        now: Time | None = None,
    ) -> None:
        """LEASED -> WAITING_EXTERNAL: the worker is released; ``resume`` (the reply) or the
        timer at ``until`` (if given) makes the job READY again."""
        self._wait(job, action, worker, epoch, WAITING_EXTERNAL, reason, until, now)

    def wait_review(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        reason: str | None = None,
        until: Time | None = None,
        now: Time | None = None,
    ) -> None:
        """LEASED -> WAITING_REVIEW: a person must decide (``resume`` or ``cancel``)."""
        self._wait(job, action, worker, epoch, WAITING_REVIEW, reason, until, now)

    def _wait(
        self,
        job: Any,
        action: str | None,
        worker: str | None,
        epoch: int | None,
        state: str,
        reason: str | None,
        until: Time | None,
        now: Time | None,
    ) -> None:
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        when = _time("now", now)
        wake = _time("until", until)
        where, label, who, epoch_ = _holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            self._move(
                conn,
                where,
                label,
                who,
                epoch_,
                state,
                {"wait_reason": reason, "run_after": wake},
                state.lower(),
                reason,
                when,
            )

    def schedule(
        self,
        job: Any,
        scheduled_for: Time,
        reason: str,
        subject_version: str | int | None = None,
        cancellation_condition: Any = None,
        *,
        now: Time | None = None,
    ) -> None:
        """Set a business timer on ``job``: at ``scheduled_for`` it becomes eligible, and its
        handler re-reads the subject (``Lease.timer``): a changed version or a holding
        cancellation condition means cancel or re-plan instead of acting.

        ``job`` is a :class:`Lease` (the holder re-plans: LEASED -> READY, fenced by its
        epoch) or a job id / ``(tenant, action)`` for a job that is READY (stays READY,
        delayed) or waiting (stays waiting; the timer wakes it).
        """
        at = _time("scheduled_for", scheduled_for)
        if at is None:
            raise JobError("scheduled_for", "is required")
        if not isinstance(reason, str) or not reason:
            raise JobError("reason", "must be a non-empty string")
        version = _version("subject_version", subject_version)
        _check_json("cancellation_condition", cancellation_condition)
        when = _time("now", now)
        timer_values = {
            "run_after": at,
            "timer_scheduled_for": at,
            "timer_reason": reason,
            "timer_subject_version": version,
            "timer_cancellation_condition": cancellation_condition,
        }
        if isinstance(job, Lease):
            with self.driver.begin() as conn:
                self._move(
                    conn,
                    jobs.c.id == job.job_id,
                    str(job.job_id),
                    job.worker,
                    job.epoch,
                    READY,
                    {**timer_values, "wait_reason": None},
                    "scheduled",
                    reason,
                    when,
                    clear_timer=False,
                )
            return
        where, label = _key(job, None)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            moved = self.driver.job_update_from(
                conn, where, (READY, *WAITING), {**timer_values, "updated_at": clock}
            )
            if moved is None:
                state = self._state(conn, where, label)
                # A timer on a leased, finished or attention-needing job is not ours to set.
                if state == LEASED:
                    raise Conflict(f"job {label} is leased: its holder schedules it")
                check_transition(label, state, READY)
                raise Conflict(f"job {label} changed meanwhile")  # pragma: no cover

    def cancel(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        reason: str | None = None,
        now: Time | None = None,
    ) -> None:
        """-> CANCELLED. Given a lease (or worker and epoch) it is the holder's fenced move;
        otherwise an operator's, allowed from READY, waiting states and NEEDS_ATTENTION (a
        leased job raises ``Conflict``: only its holder may cancel it)."""
        when = _time("now", now)
        if isinstance(job, Lease) or worker is not None or epoch is not None:
            where, label, who, epoch_ = _holder(job, action, worker, epoch)
            with self.driver.begin() as conn:
                self._move(
                    conn,
                    where,
                    label,
                    who,
                    epoch_,
                    CANCELLED,
                    {"wait_reason": reason},
                    "cancelled",
                    reason,
                    when,
                )
            return
        where, label = _key(job, action)
        self._operator_move(
            where, label, CANCELLED, {"wait_reason": reason}, "cancelled", reason, when
        )

    def resume(
        self,
        job: Any,
        action: str | None = None,
        *,
        run_after: Time | None = None,
        reason: str | None = None,
        now: Time | None = None,
    ) -> None:
        """A reply or an operator's decision: WAITING_EXTERNAL, WAITING_REVIEW or
        NEEDS_ATTENTION -> READY (eligible at ``run_after``, default at once). The failure
        counters restart, so a fixed job gets its full retry budget again."""
        when = _time("now", now)
        after = _time("run_after", run_after)
        where, label = _key(job, action)
        values = {
            "run_after": after,
            "wait_reason": None,
            "auth_failures": 0,
            "first_failed_at": None,
            "attempts": 0,
        }
        self._operator_move(
            where,
            label,
            READY,
            values,
            "resumed",
            reason,
            when,
            allowed=(WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION),
        )

    def park(
        self,
        job: Any,
        action: str | None = None,
        *,
        reason: str | None = None,
        now: Time | None = None,
    ) -> None:
        """An operator's (or the reconciliation sweep's) READY or WAITING_EXTERNAL ->
        WAITING_REVIEW: a person must decide before the job runs again."""
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        when = _time("now", now)
        where, label = _key(job, action)
        self._operator_move(
            where,
            label,
            WAITING_REVIEW,
            {"wait_reason": reason},
            "waiting_review",
            reason,
            when,
            allowed=(READY, WAITING_EXTERNAL),
        )

    def _operator_move(
        self,
        where: ColumnElement[bool],
        label: str,
        target: str,
        values: dict[str, Any],
        outcome: str,
        note: str | None,
        when: float | None,
        allowed: tuple[str, ...] | None = None,
    ) -> None:
        from_states = tuple(s for s in (allowed or sources(target)) if s != LEASED)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            job_id = self.driver.job_update_from(
                conn,
                where,
                from_states,
                {**values, "state": target, "updated_at": clock, **_NO_TIMER},
            )
            if job_id is None:
                state = self._state(conn, where, label)
                if state == LEASED and target in (CANCELLED,):
                    raise Conflict(f"job {label} is leased: only its holder may move it")
                if state not in from_states:
                    check_transition(label, state, target)
                    raise IllegalTransition(label, state, target)
                raise Conflict(f"job {label} changed meanwhile")  # pragma: no cover
            self._record(conn, job_id, None, None, outcome, note, clock)
            if target == READY:
                self.driver.job_ready_notify(conn)

    def _move(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        label: str,
        worker: str,
        epoch: int,
        target: str,
        values: dict[str, Any],
        outcome: str,
        note: str | None,
        when: float | None,
        *,
        clear_timer: bool = True,
    ) -> int:
        """The holder's move LEASED -> ``target``, ended lease, history row. Returns the id."""
        check_transition(label, LEASED, target)
        clock = self._clock(conn, when)
        moved = {**values, "state": target, "lease_owner": None, "lease_expires_at": None}
        if clear_timer:
            moved.update(_NO_TIMER)
        job_id = self._cas(conn, where, label, worker, epoch, target, moved, clock)
        self._record(conn, job_id, epoch, worker, outcome, note, clock)
        return job_id

    def _cas(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        label: str,
        worker: str,
        epoch: int,
        target: str,
        values: dict[str, Any],
        clock: float,
    ) -> int:
        # The fence: one UPDATE matching (job, epoch, owner, LEASED); no row = Conflict.
        job_id = self.driver.job_update_fenced(
            conn, where, worker, epoch, {**values, "updated_at": clock}
        )
        if job_id is None:
            self._diagnose(conn, where, label, worker, epoch)
        assert job_id is not None
        return job_id

    def _diagnose(
        self, conn: Connection, where: ColumnElement[bool], label: str, worker: str, epoch: int
    ) -> None:
        row = self.driver.job_lease_state(conn, where)
        if row is None:
            raise JobNotFound(f"no job {label}")
        raise Conflict(
            f"job {label}: {worker} with epoch {epoch} is fenced out "
            f"(state {row.state}, epoch {row.lease_epoch}, owner {row.lease_owner})"
        )

    def _state(self, conn: Connection, where: ColumnElement[bool], label: str) -> str:
        state = self.driver.job_state(conn, where)
        if state is None:
            raise JobNotFound(f"no job {label}")
        return str(state)

    def _record(
        self,
        conn: Connection,
        job_id: int,
        epoch: int | None,
        worker: str | None,
        outcome: str,
        error: str | None,
        clock: float,
    ) -> None:
        self.driver.attempt_insert(conn, job_id, epoch, worker, outcome, error, clock)

    # -- recovery ------------------------------------------------------------------------

    def recover(self, *, now: Time | None = None, limit: int | None = None) -> RecoveryResult:
        """Return expired leases to READY (NEEDS_ATTENTION when ``max_attempts`` claims are
        spent) and wake waiting jobs whose timer is due. At most ``limit`` rows of each.

        Rows are locked with SKIP LOCKED (PostgreSQL) and re-checked against the epoch read,
        so a lease renewed or finished meanwhile is left alone: a live lease is never touched.
        """
        bound = self.config.recover_limit if limit is None else limit
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise JobError("limit", f"must be a positive integer, got {bound!r}")
        when = _time("now", now)
        requeued = attention = woken = 0
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            expired = self.driver.job_expired_list(conn, clock, bound)
            requeued, attention = self._take_back(conn, expired, clock, None)
            dead = self._take_back_dead(conn, clock, bound)
            requeued += dead.requeued
            attention += dead.needs_attention
            due = self.driver.job_due_list(conn, clock, bound)
            for waiting in due:
                check_transition(str(waiting.id), waiting.state, READY)
                hit = self.driver.job_update_from(
                    conn,
                    jobs.c.id == waiting.id,
                    (waiting.state,),
                    {"state": READY, "wait_reason": None, "updated_at": clock},
                )
                if hit is not None:
                    self._record(conn, waiting.id, None, None, "timer_fired", None, clock)
                    woken += 1
            if requeued or woken:
                self.driver.job_ready_notify(conn)
        return RecoveryResult(requeued=requeued, needs_attention=attention, woken=woken)

    def recover_dead(self, *, now: Time | None = None, limit: int | None = None) -> RecoveryResult:
        """Return to READY (NEEDS_ATTENTION when ``max_attempts`` claims are spent) the leases
        of workers whose liveness row expired (:meth:`worker_alive`), without waiting for the
        leases' own expiry. A worker without a row is left to its leases' expiry. Fenced like
        :meth:`recover`: the next claim increments the epoch and the dead worker's late moves
        get ``Conflict``. Cheap when nobody died: one read of the small liveness table."""
        bound = self.config.recover_limit if limit is None else limit
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise JobError("limit", f"must be a positive integer, got {bound!r}")
        when = _time("now", now)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            return self._take_back_dead(conn, clock, bound)

    def _take_back_dead(self, conn: Connection, clock: float, bound: int) -> RecoveryResult:
        names = self.driver.worker_dead_list(conn, clock)
        if not names:
            return RecoveryResult(requeued=0, needs_attention=0, woken=0)
        rows = self.driver.job_owned_list(conn, names, bound)
        requeued, attention = self._take_back(conn, rows, clock, "lease owner stopped (liveness)")
        self.driver.worker_forget_dead(conn, names, clock)
        if requeued:
            self.driver.job_ready_notify(conn)
        return RecoveryResult(requeued=requeued, needs_attention=attention, woken=0)

    def _take_back(
        self, conn: Connection, rows: Sequence[Any], clock: float, dead_reason: str | None
    ) -> tuple[int, int]:
        """Expired leases (``dead_reason`` None) or leases of dead owners back to READY or
        NEEDS_ATTENTION, each fenced on the epoch read; returns (requeued, attention)."""
        max_attempts = self.config.retry.max_attempts
        requeued = attention = 0
        reason = dead_reason or "lease expired"
        for row in rows:
            target = NEEDS_ATTENTION if row.attempts >= max_attempts else READY
            check_transition(str(row.id), LEASED, target)
            values: dict[str, Any] = {
                "state": target,
                "lease_owner": None,
                "lease_expires_at": None,
                "last_error": reason,
                "updated_at": clock,
            }
            if target == NEEDS_ATTENTION:
                values["wait_reason"] = f"{row.attempts} attempts spent ({reason})"
            epoch = int(row.lease_epoch)
            if dead_reason is None:
                taken = self.driver.job_expire(conn, row.id, epoch, clock, values)
            else:
                taken = self.driver.job_take_back(
                    conn, row.id, epoch, str(row.lease_owner), clock, values
                )
            if not taken:
                continue
            self._record(conn, row.id, epoch, row.lease_owner, "expired", reason, clock)
            if target == READY:
                requeued += 1
            else:
                attention += 1
        return requeued, attention

    def worker_alive(self, name: str, ttl: float, *, now: Time | None = None) -> None:
        """Worker liveness: ``name`` (the ``lease_owner`` it claims as) is alive until the
        database clock (or ``now``) + ``ttl`` seconds."""
        _name("name", name)
        seconds = _ttl(ttl)
        when = _time("now", now)
        with self.driver.begin() as conn:
            self.driver.worker_beat(conn, name, self._clock(conn, when), seconds)

    def worker_gone(self, name: str) -> None:
        """Remove ``name``'s liveness row (a clean stop: its leases were released)."""
        _name("name", name)
        with self.driver.begin() as conn:
            self.driver.worker_delete(conn, name)


_NO_TIMER: dict[str, Any] = {
    "timer_scheduled_for": None,
    "timer_reason": None,
    "timer_subject_version": None,
    "timer_cancellation_condition": None,
}


# -- helpers ---------------------------------------------------------------------------------


_SPEC_FIELDS = frozenset(
    {
        "tenant",
        "action",
        "subject",
        "subject_version",
        "payload",
        "priority",
        "run_after",
        "kind",
        "provider",
    }
)


# One shared expression (SQLAlchemy elements are immutable): building one per row cost about a
# fifth of enqueue_many's CPU.
_DB_NOW = db_epoch()


def _job_values(
    tenant: str,
    action: str,
    *,
    subject: str | None = None,
    subject_version: str | int | None = None,
    payload: Any = None,
    priority: int = 0,
    run_after: Time | None = None,
    kind: str | None = None,
    provider: str | None = None,
    now: Time | None = None,
) -> dict[str, Any]:
    """Validate one job's fields (raising JobError naming the field); its row values."""
    # The natural consumer handler calls this once per event: the absent optional fields
    # (most of them) skip their checks.
    _name("tenant", tenant)
    _name("action", action)
    if subject is not None:
        _name("subject", subject)
    version = None if subject_version is None else _version("subject_version", subject_version)
    if kind is not None:
        _name("kind", kind)
    if provider is not None:
        _name("provider", provider)
    if priority.__class__ is not int and (
        isinstance(priority, bool) or not isinstance(priority, int)
    ):
        raise JobError("priority", f"must be an integer, got {priority!r}")
    if payload is not None:
        _check_json("payload", payload)
    when = None if now is None else _time("now", now)
    after = None if run_after is None else _time("run_after", run_after)
    # A number when ``now`` was given; else the database clock as a SQL expression.
    stamp: Any = when if when is not None else _DB_NOW
    return {
        "tenant": tenant,
        "action": action,
        "kind": kind,
        "subject": subject,
        "subject_version": version,
        "payload": payload,
        "provider": provider,
        "state": READY,
        "priority": priority,
        "run_after": after,
        "created_at": stamp,
        "updated_at": stamp,
    }


def _name(field_name: str, value: object, *, optional: bool = False) -> None:
    """The shared name rules (``outbox.validate``: non-blank, at most 200 characters, no
    NUL), checked before anything reaches either database; ``JobError`` names the field."""
    check_name(field_name, value, JobError, required=not optional)


def _version(field_name: str, value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise JobError(field_name, f"must be a string or an integer, got {value!r}")
    text_value = str(value)
    _name(field_name, text_value)
    return text_value


def _ttl(ttl: object) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
        raise JobError("ttl", f"must be a number of seconds, got {ttl!r}")
    if ttl <= 0:
        raise JobError("ttl", f"must be positive, got {ttl!r}")
    return float(ttl)


def _time(field_name: str, value: object) -> float | None:
    """A time argument as unix seconds: a number, or a datetime (naive means UTC)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return aware.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JobError(field_name, f"must be unix seconds or a datetime, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise JobError(field_name, f"must be a finite, non-negative time, got {value!r}")
    return float(value)


def _check_json(field_name: str, value: object) -> None:
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise JobError(field_name, f"is not JSON-serialisable ({exc})") from None
    if "\\u0000" in encoded:
        # PostgreSQL's jsonb refuses NUL in strings while SQLite stores it: refuse on both.
        raise JobError(field_name, "must not contain NUL characters")


def _error_text(error: object) -> str:
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"[:2000]
    if not isinstance(error, str):
        raise JobError("error", f"must be a string or an exception, got {error!r}")
    return error[:2000]


def _key(job: object, action: str | None) -> tuple[ColumnElement[bool], str]:
    """A job reference: a Lease, a job id, ``(tenant, action)`` or ``tenant, action``."""
    if isinstance(job, Lease):
        return jobs.c.id == job.job_id, f"{job.tenant}/{job.action}"
    if isinstance(job, int) and not isinstance(job, bool):
        if action is not None:
            raise JobError("action", "give a job id or (tenant, action), not both")
        return jobs.c.id == job, f"#{job}"
    if isinstance(job, tuple) and len(job) == 2 and action is None:
        job, action = job
    if isinstance(job, str):
        _name("tenant", job)
        _name("action", action)
        return and_(jobs.c.tenant == job, jobs.c.action == action), f"{job}/{action}"
    raise JobError("job", f"expected a Lease, a job id or (tenant, action), got {job!r}")


def _holder(
    job: object, action: str | None, worker: str | None, epoch: int | None
) -> tuple[ColumnElement[bool], str, str, int]:
    if isinstance(job, Lease):
        worker = job.worker if worker is None else worker
        epoch = job.epoch if epoch is None else epoch
    where, label = _key(job, action)
    _name("worker", worker)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise JobError("epoch", f"must be a positive integer (from claim), got {epoch!r}")
    assert worker is not None
    return where, label, worker, epoch


def _timer(row: Any) -> Timer | None:
    if row.timer_scheduled_for is None:
        return None
    return Timer(
        scheduled_for=float(row.timer_scheduled_for),
        reason=row.timer_reason or "",
        subject_version=row.timer_subject_version,
        cancellation_condition=row.timer_cancellation_condition,
    )


def _lease(row: Any) -> Lease:
    return Lease(
        job_id=int(row.id),
        tenant=row.tenant,
        action=row.action,
        kind=row.kind,
        subject=row.subject,
        subject_version=row.subject_version,
        payload=row.payload,
        provider=row.provider,
        attempts=int(row.attempts),
        epoch=int(row.lease_epoch),
        worker=row.lease_owner,
        expires_at=float(row.lease_expires_at),
        timer=_timer(row),
    )


def _job(row: Any) -> Job:
    return Job(
        id=int(row.id),
        tenant=row.tenant,
        action=row.action,
        kind=row.kind,
        subject=row.subject,
        subject_version=row.subject_version,
        payload=row.payload,
        provider=row.provider,
        state=row.state,
        priority=int(row.priority),
        run_after=row.run_after,
        attempts=int(row.attempts),
        auth_failures=int(row.auth_failures),
        last_error=row.last_error,
        wait_reason=row.wait_reason,
        lease_owner=row.lease_owner,
        lease_expires_at=row.lease_expires_at,
        lease_epoch=int(row.lease_epoch),
        timer=_timer(row),
        created_at=float(row.created_at),
        updated_at=float(row.updated_at),
    )
