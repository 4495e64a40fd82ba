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
- **Steps** (``after=`` at enqueue; ``consumer.jobs.steps``): a job whose parents are not
  all DONE is WAITING_PARENTS, never claimed; the finish of its last parent makes it READY in
  the same transaction. A handler's return value is its job's ``result``
  (``consumer.jobs.step_results``: ``result`` / ``aresult`` wait for it).
- **Wake-ups** (PostgreSQL, ``StoreConfig(notify=True)``; off by default): an enqueue that
  creates a job, a ``resume`` and a recovery that makes jobs READY send a NOTIFY at commit;
  idle workers LISTEN. Without it idle workers poll adaptively (``consumer.jobs.slots``).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from consumer.bulk import deferred_writes
from consumer.errors import JobError, JobNotFound
from consumer.jobs import cancels
from consumer.jobs.base import StoreConfig
from consumer.jobs.checks import (
    SPEC_FIELDS,
    Time,
    job_key,
    job_values,
    valid_limit,
    valid_limits,
    valid_name,
    valid_time,
    valid_ttl,
)
from consumer.jobs.claims import BatchClaims
from consumer.jobs.driver import JobDriver, driver_for, engine_for
from consumer.jobs.enqueues import EnqueueBuffer, enqueue_one, enqueue_rows
from consumer.jobs.moves import LeaseMoves
from consumer.jobs.order_keys import KeyLine, read_line
from consumer.jobs.queues import QueueMethods
from consumer.jobs.recovery import Recovery
from consumer.jobs.replies import (
    Reply,
    ReplyResult,
    adopt,
    check_reply,
    early_key,
    listed,
    record_reply,
    reply_from_row,
)
from consumer.jobs.rows import (
    Attempt,
    BatchResult,
    DeferredEnqueue,
    EnqueueResult,
    Job,
    Lease,
    QueueDepth,
    RecoveryResult,
    Timer,
    job_from_row,
)
from consumer.jobs.schedules import ScheduleMethods
from consumer.jobs.schema import DEFAULT_QUEUE
from consumer.jobs.states import (
    HELD,
    LEASED,
    READY,
    STATES,
)
from consumer.jobs.step_results import ResultMethods
from consumer.jobs.steps import enqueue_graph, valid_after, valid_policy
from outbox.errors import ConfigError
from outbox.validate import check_number

__all__ = [
    "Attempt",
    "BatchResult",
    "DeferredEnqueue",
    "EnqueueResult",
    "Job",
    "KeyLine",
    "Lease",
    "QueueDepth",
    "RecoveryResult",
    "Reply",
    "ReplyResult",
    "Store",
    "StoreConfig",
    "Time",
    "Timer",
    "valid_time",  # consumer.jobs.worker's import of it predates consumer.jobs.checks
]

_T = TypeVar("_T")
_STEP_FIELDS = frozenset({"after", "on_parent_failure"})  # enqueue_many's graph items


# -- the store -------------------------------------------------------------------------------


class Store(LeaseMoves, BatchClaims, QueueMethods, Recovery, ScheduleMethods, ResultMethods):
    """The job store on one database (see the module docstring for the contract).

    ``Store()`` is an in-memory SQLite database (one shared connection, so it lives as long
    as the Store); ``Store(url_or_engine)`` otherwise: a URL or the same Engine the rest of
    the application uses. The schema is created on construction (idempotent) unless
    ``create_schema=False``. ``clock`` (a callable returning unix seconds) replaces the
    database clock in every call that gives no ``now``, the operation intents' deadlines
    included: a test moves the whole job pipeline's time with it (``outbox.testing``).
    ``rng`` (a ``random.Random``) draws the retry backoffs' jitter wherever ``fail`` is given
    none (default: the ``random`` module): a seeded one makes a test's retries repeat.

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
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
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
        self.local_wakers = []
        if clock is not None and not callable(clock):
            raise ConfigError("clock", f"must be a callable returning unix seconds, got {clock!r}")
        # ``clock``: unix seconds that replace the database clock wherever a call gives no
        # ``now`` (leases, backoffs, timers, intents' deadlines): a test's own time.
        self.driver.clock = clock
        if rng is not None and not isinstance(rng, random.Random):
            raise ConfigError("rng", f"must be a random.Random, got {type(rng).__name__}")
        self.rng = rng
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
        queue: str = DEFAULT_QUEUE,
        order_key: str | None = None,
        hold: str = "wait",
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        session: Session | Connection | None = None,
        now: Time | None = None,
        after: Iterable[tuple[str, str]] | None = None,
        on_parent_failure: str | None = None,
    ) -> EnqueueResult:
        """Create the job ``(tenant, action)`` in READY, or return the existing one.

        With ``session`` (a SQLAlchemy Session or Connection) the insert joins the caller's
        transaction and is never committed here; otherwise the store commits it. In a
        consumer's batch Session (``tx.session``, marked by ``consumer.bulk.defer_writes``) the
        row is buffered and written with the batch's other enqueues in one statement before
        the handlers' savepoint is released; the result (:class:`DeferredEnqueue`) writes the
        buffer first if ``job_id`` or ``duplicate`` is read before that.
        ``run_after`` delays eligibility; ``kind`` names the handler (default: routed by the
        action's prefix); ``provider`` selects a per-provider backoff ceiling; ``queue``
        names the queue the job waits in (``"default"``): workers claim from the queues they
        are given. ``after``: the ``(tenant, action)`` of jobs it waits for (WAITING_PARENTS
        until every one is DONE; ``consumer.jobs.steps``), ``on_parent_failure``: ``review``
        (default) or ``cancel``.
        are given. ``order_key``: the jobs of one key run one at a time in enqueue order,
        a later one HELD until the earlier ones finished; ``hold="run"`` lets later jobs of
        the key pass this one while it waits on a reply or a timer
        ``concurrency_key`` with ``concurrency_limit``: at most that many jobs of the key
        admitted and unfinished at once across every worker (the others wait HELD, in
        enqueue order); ``consumer.jobs.order_keys`` has the contract of both.
        """
        values = job_values(
            tenant,
            action,
            subject=subject,
            subject_version=subject_version,
            payload=payload,
            priority=priority,
            run_after=run_after,
            kind=kind,
            provider=provider,
            queue=queue,
            order_key=order_key,
            hold=hold,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
            now=now,
        )
        parents, policy = valid_after(after), valid_policy(on_parent_failure)
        writers = deferred_writes(session)
        if parents:
            buffer = None if writers is None else writers.get(self)
            if isinstance(buffer, EnqueueBuffer) and isinstance(session, Session):
                buffer.flush(session.connection())  # its parents may be in the buffer
            return self._in_session(
                session,
                lambda conn: enqueue_graph(self.driver, conn, [values], [parents], [policy])[0],
            )
        if writers is not None:  # a consumer's batch Session: written with the batch
            buffer = writers.get(self)
            if not isinstance(buffer, EnqueueBuffer):
                assert isinstance(session, Session)
                buffer = EnqueueBuffer(self, session)
                writers[self] = buffer
            return buffer.add(values)
        # Alone, the insert commits on its own (PostgreSQL: one round trip, not three); a
        # duplicate's look-up after it is a read of the committed row. Replies kept before
        # the job existed are then moved right after (the INSERT counted them).
        alone = session is None
        result, waiting = self._in_session(
            session,
            lambda conn: enqueue_one(self.driver, conn, values, adopting=not alone),
            alone=values["state"] != HELD,
        )
        if waiting:
            with self.driver.begin() as conn:
                adopt(self.driver, conn, result.job_id)
        return result

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
        ``"after"`` and ``"on_parent_failure"`` items make a graph (``enqueue``'s arguments):
        items may depend on each other, and a cycle or an unknown parent refuses the whole
        call before anything is written.
        """
        if isinstance(specs, Mapping):
            raise JobError("specs", "enqueue_many takes a list of job specs, not one mapping")
        rows: list[dict[str, Any]] = []
        afters: list[list[tuple[str, str]]] = []
        policies: list[str | None] = []
        for index, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise JobError("specs", f"item {index} is {type(spec).__name__}, not a mapping")
            unknown = set(spec) - SPEC_FIELDS - _STEP_FIELDS
            if unknown:
                raise JobError("specs", f"item {index} has unknown fields {sorted(unknown)}")
            if "tenant" not in spec or "action" not in spec:
                raise JobError("specs", f"item {index} needs tenant and action")
            fields = {k: v for k, v in spec.items() if k not in _STEP_FIELDS}
            rows.append(job_values(**fields, now=now))
            afters.append(valid_after(spec.get("after"), f"specs[{index}].after"))
            policies.append(valid_policy(spec.get("on_parent_failure")))
        if not rows:
            return []
        if any(afters):
            return self._in_session(
                session, lambda conn: enqueue_graph(self.driver, conn, rows, afters, policies)
            )
        return self._in_session(session, lambda conn: enqueue_rows(self.driver, conn, rows))

    def _in_session(
        self,
        session: Session | Connection | None,
        work: Callable[[Connection], _T],
        *,
        alone: bool = False,
    ) -> _T:
        """``work`` in the caller's ``session``, or committed here (``alone``: one write
        statement, which commits on its own)."""
        if session is None:
            with self.driver.autocommit() if alone else self.driver.begin() as conn:
                done = work(conn)
            for wake in tuple(self.local_wakers):  # committed: this process's idle workers
                wake()
            return done
        if isinstance(session, Session):
            return work(session.connection())
        if isinstance(session, Connection):
            return work(session)
        raise JobError("session", f"must be a Session or Connection, got {type(session).__name__}")

    # -- reading -------------------------------------------------------------------------

    def get(self, job: Any, action: str | None = None) -> Job:
        """The job's current row; ``JobNotFound`` if it does not exist."""
        where, label = job_key(job, action)
        with self.driver.connect() as conn:
            row = self.driver.job_get(conn, where)
        if row is None:
            raise JobNotFound(f"no job {label}")
        return job_from_row(row)

    def reply(
        self,
        job: Any,
        action: str | None = None,
        *,
        payload: Any,
        reply_id: str,
        source: str | None = None,
        now: Time | None = None,
        session: Session | Connection | None = None,
    ) -> ReplyResult:
        """Record a reply to ``job`` (a job id, or tenant with ``action``), deduplicated by
        ``reply_id`` per job, in one transaction with its move: a job in WAITING_EXTERNAL
        becomes READY; any other job keeps it for its next run (``JobContext.replies``), or,
        finished, just keeps it (``consumer.jobs.replies`` has the contract). A reply to a
        ``(tenant, action)`` not enqueued yet is kept, deduplicated the same way, and its
        first run sees it (``kept=True``; retention drops it if the job never comes).
        ``session`` joins the caller's transaction (``ConsumerTx.reply`` does).
        ``JobNotFound`` for a job id that does not exist."""
        check_reply(payload, reply_id, source)
        when = valid_time("now", now)
        where, label = job_key(job, action)
        early = early_key(job, action)

        def work(conn: Connection) -> ReplyResult:
            return record_reply(
                self.driver,
                conn,
                where,
                label,
                payload=payload,
                reply_id=reply_id,
                source=source,
                when=when,
                early=early,
            )

        return self._in_session(session, work)

    def replies(self, job: Any, action: str | None = None) -> list[Reply]:
        """Every reply the job received, consumed or not, oldest first."""
        job_id = self.get(job, action).id
        with self.driver.connect() as conn:
            return [
                reply_from_row(row) for row in listed(self.driver, conn, [job_id], limit=10_000)
            ]

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
        result = dict.fromkeys(STATES, 0)
        result.update(found)
        return result

    def order_line(self, order_key: str, *, limit: int = 50) -> KeyLine:
        """The line of ``order_key`` (``consumer.jobs.order_keys.KeyLine``): what runs, what
        waits HELD behind it (the first ``limit``), and whether the head holds them."""
        check_number("limit", limit, JobError, integer=True)
        with self.driver.connect() as conn:
            return read_line(conn, order_key, limit)

    def next_timer(self) -> float | None:
        """When the earliest timer of a waiting job comes due (unix seconds), or None: a
        worker wakes for it instead of waiting for its next recovery."""
        with self.driver.connect() as conn:
            return self.driver.job_next_timer(conn)

    # -- claiming ------------------------------------------------------------------------

    # complexity: the seed example's claim: one check per argument, then one fenced move
    def claim(
        self,
        tenant: str,
        action: str,
        worker: str,
        now: Time | None = None,
        ttl: float = 30,
        *,
        tenant_limit: int | None = None,
        tenant_limits: Mapping[str, int] | None = None,
    ) -> int | None:
        """Lease the job ``(tenant, action)`` to ``worker`` for ``ttl`` seconds.

        Returns the new epoch, or ``None`` when the job cannot be claimed now: its lease is
        live, it is not READY, ``run_after`` is still ahead, its queue is paused
        (:meth:`pause_queue`), or its tenant is at its limit: ``tenant_limit`` /
        ``tenant_limits`` as in :meth:`claim_batch`, the jobs of the tenant LEASED in the
        job's queue counted over every worker on the database, race-safe with every other
        claim. An expired lease is taken over (the old holder is fenced out by the new epoch
        and its attempt recorded as ``expired``; the tenant's count does not change, so the
        limit does not refuse it). Unknown job: ``JobNotFound``.
        """
        valid_name("tenant", tenant)
        valid_name("action", action)
        valid_name("worker", worker)
        seconds = valid_ttl(ttl)
        when = valid_time("now", now)
        default, limits = valid_limit("tenant_limit", tenant_limit), valid_limits(tenant_limits)
        where, label = job_key(tenant, action)
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
            if takeover and row.cancel_requested_at is not None:
                # Cancelled while it ran: it ends CANCELLED instead of running again.
                how = "lease expired"
                cancels.end_expired(self.driver, conn, row.id, int(row.lease_epoch), clock, how)
                return None
            if takeover and row.attempts >= self.config.retry.max_attempts:
                return None  # spent: recovery moves it to NEEDS_ATTENTION
            if row.queue in self.driver.queue_paused_list(conn):
                return None  # no claim takes from a paused queue
            cap = limits.get(row.tenant, default)
            if (
                cap is not None
                and not takeover
                and self.driver.job_tenant_leased(conn, row.queue, row.tenant, cap) >= cap
            ):
                return None  # at its limit: the job stays READY, holding no lease
            new_epoch = int(row.lease_epoch) + 1
            leased = self.driver.job_lease(
                conn, row.id, row.state, int(row.lease_epoch), worker, clock + seconds, clock
            )
            if not leased:  # pragma: no cover - the row lock makes this unreachable
                return None
            if takeover:
                self.driver.attempt_insert(
                    conn,
                    row.id,
                    int(row.lease_epoch),
                    row.lease_owner,
                    "expired",
                    "lease expired",
                    clock,
                )
            return new_epoch
