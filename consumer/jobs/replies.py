"""Replies to jobs: what the customer (or a provider, or another service) answered, kept with
the job until a run has seen it (issue 38; DESIGN, "Obligations that span days").

``Store.reply(job, action=None, *, payload, reply_id, source=None, now=None)`` and
``ConsumerTx.reply(...)`` (the same, in a consumer handler's transaction) call
:func:`record_reply`. In one transaction with the job's row locked:

- the reply is inserted into ``outbox_job_replies`` unless the job has one with that
  ``reply_id`` already (then nothing changes, and the result says ``duplicate=True``);
- it is numbered: ``seq`` = the job's ``replies_received`` + 1, and the job counts it;
- a job in WAITING_EXTERNAL becomes READY at once (its failure counters restart, as with
  ``resume``); a job READY, LEASED or scheduled keeps its state and its next run sees the
  reply; a job waiting for review, needing attention, DONE or CANCELLED keeps it too (it is
  visible in the trace) and moves nothing;
- a history row (outcome ``reply``) puts it in the job's story.

A run sees the replies its job had when it was claimed and no earlier run consumed: those
with ``replies_consumed < seq <= replies_received`` of its lease (``JobContext.replies``;
nothing is read when the two are equal, the usual case). A run that ends well (DONE, a wait,
a defer or a re-plan) consumes exactly those, in the same fenced transaction as its move
(:func:`consume`); a run that fails or loses its lease consumes nothing, so the next run
sees them again. A reply that arrives while a run is under way is not seen by it: when that
run then waits for a reply, the job becomes READY at once instead (``Store.wait_external``),
so the reply is never left behind a wait.

**A reply to a job that does not exist yet** (given as tenant with action: a job id names
a job that exists) is kept in ``outbox_kept_replies``, deduplicated by ``reply_id`` per
``(tenant, action)`` the same way, and the result says ``kept=True`` (``job_id`` and
``state`` None). The job's enqueue counts the kept replies in its own INSERT
(``replies_received``) and moves them into ``outbox_job_replies`` in its transaction
(:func:`adopt`), so the job's first run sees them in ``ctx.replies``, oldest first; on
PostgreSQL an enqueue outside any transaction (one self-committing statement) moves them
right after, and a run that finds numbers without rows moves them itself. A reply that raced
its job's enqueue (it saw no job, the job committed before the reply did) is moved by the
reply itself when it sees the job on a second look, else by retention's sweep. Kept replies
whose job never came go after ``JobRetentionConfig.early_retention_seconds`` (default 7
days: the consumers' inbox window, the longest an event may take to create its job).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, func, select
from sqlalchemy.engine import Connection

from consumer.errors import JobError, JobNotFound
from consumer.jobs.checks import NO_TIMER, job_key, valid_json, valid_time
from consumer.jobs.driver import JobDriver, driver_for
from consumer.jobs.rows import Lease
from consumer.jobs.schema import early_replies, jobs
from consumer.jobs.states import READY, WAITING_EXTERNAL
from outbox.validate import MAX_NAME_LENGTH, check_name

__all__ = ["MAX_REPLY_BYTES", "Reply", "ReplyResult", "adopt", "consume", "record_reply"]
__all__ += ["run_replies", "unconsumed"]

MAX_REPLY_BYTES = 256 * 1024
"""The largest reply payload, as JSON (a reply is a message, not a document store)."""


@dataclass(frozen=True)
class Reply:
    """One reply to a job, as a handler sees it (``ctx.replies``), oldest first."""

    reply_id: str
    payload: Any
    source: str | None
    received_at: float
    seq: int = 0
    consumed_at: float | None = None


@dataclass(frozen=True)
class ReplyResult:
    """What ``Store.reply`` did: ``duplicate`` (this ``reply_id`` was recorded for the job
    before: nothing changed), ``resumed`` (the job was WAITING_EXTERNAL and is READY now),
    and the job's ``state`` after the call. ``kept``: there is no such job yet, the reply
    is kept for its first run (``job_id`` and ``state`` are None then)."""

    job_id: int | None
    reply_id: str
    duplicate: bool
    resumed: bool
    state: str | None
    kept: bool = False


def check_reply(payload: Any, reply_id: object, source: object) -> None:
    """``JobError`` naming the field for a reply that cannot be recorded."""
    check_name("reply_id", reply_id, JobError, limit=MAX_NAME_LENGTH * 2)
    if source is not None:
        check_name("source", source, JobError)
    valid_json("payload", payload)
    if len(json.dumps(payload, separators=(",", ":"))) > MAX_REPLY_BYTES:
        raise JobError("payload", f"is larger than {MAX_REPLY_BYTES} bytes as JSON")


def record_reply(
    driver: JobDriver,
    conn: Connection,
    where: ColumnElement[bool],
    label: str,
    *,
    payload: Any,
    reply_id: str,
    source: str | None,
    when: float | None,
    early: tuple[str, str] | None = None,
) -> ReplyResult:
    """Record a reply in ``conn``'s transaction (module docstring); validated already.
    ``early``: the ``(tenant, action)`` to keep it for when there is no such job yet (else
    ``JobNotFound``)."""
    row = driver.reply_job_lock(conn, where)
    if row is None:
        if early is None:
            raise JobNotFound(f"no job {label}")
        return keep_early(driver, conn, early, payload, reply_id, source, when)
    job_id, state = int(row.id), str(row.state)
    clock = driver.clock_read(conn, when)
    seq = int(row.replies_received) + 1  # the row is locked: no other reply takes this number
    if not driver.reply_insert(
        conn,
        job_id=job_id,
        seq=seq,
        reply_id=reply_id,
        payload=payload,
        source=source,
        received_at=clock,
    ):
        return ReplyResult(job_id, reply_id, duplicate=True, resumed=False, state=state)
    values: dict[str, Any] = {"replies_received": seq}
    resumed = state == WAITING_EXTERNAL
    if resumed:  # as ``resume``: eligible at once, a full retry budget for the next step
        values.update(
            state=READY,
            run_after=None,
            wait_reason=None,
            auth_failures=0,
            first_failed_at=None,
            attempts=0,
            updated_at=clock,
            **NO_TIMER,
        )
    # Filtered on the state read: under the row lock it cannot have changed.
    driver.reply_job_count(conn, job_id, state, values)
    note = f"reply {reply_id}" + (f" from {source}" if source else "")
    if resumed:
        note += f": {WAITING_EXTERNAL} -> {READY}"
    driver.attempt_insert(conn, job_id, None, None, "reply", note, clock)
    if resumed:
        driver.job_ready_notify(conn)
    return ReplyResult(job_id, reply_id, duplicate=False, resumed=resumed, state=state_after(state))


def keep_early(
    driver: JobDriver,
    conn: Connection,
    key: tuple[str, str],
    payload: Any,
    reply_id: str,
    source: str | None,
    when: float | None,
) -> ReplyResult:
    """Keep a reply for a job not enqueued yet (module docstring)."""
    tenant, action = key
    values = {
        "tenant": tenant,
        "action": action,
        "reply_id": reply_id,
        "payload": payload,
        "source": source,
        "received_at": driver.clock_read(conn, when),
    }
    inserted = driver.reply_keep(conn, values)
    # A second look: the job's enqueue may have committed since the first (its INSERT did
    # not see this reply): then the reply goes to it now, as to any job.
    found = driver.reply_job_lock(conn, and_(jobs.c.tenant == tenant, jobs.c.action == action))
    if found is not None:
        adopt(driver, conn, int(found.id), when=when)
    return ReplyResult(None, reply_id, duplicate=not inserted, resumed=False, state=None, kept=True)


def adopt(driver: JobDriver, conn: Connection, job_id: int, *, when: float | None = None) -> int:
    """Move the replies kept for the job's ``(tenant, action)`` into its replies, in
    ``conn``'s transaction, the job's row locked; how many were moved. The numbers its
    enqueue reserved for them (``replies_received`` counted them, no row carries them yet)
    are used first, oldest first; any that came later are recorded as any reply (a job
    waiting for one becomes READY)."""
    row = driver.reply_job_lock(conn, jobs.c.id == job_id)
    if row is None:
        return 0
    kept = driver.reply_kept_take(conn, str(row.tenant), str(row.action))
    if not kept:
        return 0
    taken = driver.reply_seqs(conn, job_id)
    holes = [seq for seq in range(1, int(row.replies_received) + 1) if seq not in taken]
    moved = 0
    for reply in kept:
        if holes:
            seq = holes.pop(0)
            if driver.reply_insert(
                conn,
                job_id=job_id,
                seq=seq,
                reply_id=reply.reply_id,
                payload=reply.payload,
                source=reply.source,
                received_at=float(reply.received_at),
            ):
                note = f"reply {reply.reply_id} (kept before the job existed)"
                driver.attempt_insert(conn, job_id, None, None, "reply", note, reply.received_at)
                moved += 1
            continue
        result = record_reply(
            driver,
            conn,
            jobs.c.id == job_id,
            f"#{job_id}",
            payload=reply.payload,
            reply_id=reply.reply_id,
            source=reply.source,
            when=when,
        )
        moved += not result.duplicate
    return moved


def kept_count(tenant: str, action: str) -> Any:
    """The count of the replies kept for ``(tenant, action)``, as a scalar subquery: an
    enqueue's INSERT numbers them in the same statement (``replies_received``)."""
    return (
        select(func.count())
        .select_from(early_replies)
        .where(early_replies.c.tenant == tenant, early_replies.c.action == action)
        .scalar_subquery()
    )


def adopt_created(
    driver: JobDriver,
    conn: Connection,
    created: Mapping[tuple[str, str], int],
    kept: set[tuple[str, str]],
) -> int:
    """After an enqueue of many, in its transaction: move the replies kept for the jobs it
    created (``(tenant, action)`` -> id) that have some (``kept``, as
    ``job_insert_many`` found them); how many."""
    moved = 0
    for key in sorted(kept):
        if key in created:
            moved += adopt(driver, conn, created[key])
    return moved


def early_key(job: Any, action: str | None) -> tuple[str, str] | None:
    """The ``(tenant, action)`` a reply names, when it names a job that way (only then can
    it be kept for a job not enqueued yet); checked already by ``job_key``."""
    if isinstance(job, tuple) and len(job) == 2 and action is None:
        job, action = job
    if isinstance(job, str) and isinstance(action, str):
        return job, action
    return None


def reply_in(
    conn: Connection,
    job: Any,
    action: str | None,
    *,
    payload: Any,
    reply_id: str,
    source: str | None,
    now: Any,
) -> ReplyResult:
    """:func:`record_reply` on a connection of the caller's (``ConsumerTx.reply``: there is no
    job store there), with a job driver for its engine (a light object, made per reply)."""
    check_reply(payload, reply_id, source)
    where, label = job_key(job, action)
    return record_reply(
        driver_for(conn.engine),
        conn,
        where,
        label,
        payload=payload,
        reply_id=reply_id,
        source=source,
        when=valid_time("now", now),
        early=early_key(job, action),
    )


def state_after(state: str) -> str:
    return READY if state == WAITING_EXTERNAL else state


def unconsumed(driver: JobDriver, conn: Connection, lease: Lease) -> list[Reply]:
    """The replies a run of ``lease`` sees (module docstring), oldest first."""
    if lease.replies_received <= lease.replies_consumed:
        return []
    rows = driver.reply_unconsumed(
        conn, lease.job_id, lease.replies_consumed, lease.replies_received
    )
    return [reply_from_row(r) for r in rows]


def run_replies(driver: JobDriver, lease: Lease) -> list[Reply]:
    """:func:`unconsumed` for a run (``JobContext.replies``), on connections of its own."""
    with driver.connect() as conn:
        found = unconsumed(driver, conn, lease)
    if len(found) < lease.replies_received - lease.replies_consumed:
        # Numbers without rows: replies kept before the job existed, which its enqueue
        # counted and (PostgreSQL, outside a transaction) had not moved yet. Move them now.
        with driver.begin() as conn:
            adopt(driver, conn, lease.job_id)
            found = unconsumed(driver, conn, lease)
    return found


def listed(
    driver: JobDriver, conn: Connection, job_ids: Sequence[int], limit: int = 100
) -> list[Any]:
    """The replies of some jobs, oldest first (the console's trace)."""
    if not job_ids:
        return []
    return list(driver.reply_list(conn, job_ids, limit))


def watermark(job: object) -> int | None:
    """The reply ``seq`` a run of this lease saw up to, when it saw any new one."""
    if isinstance(job, Lease) and job.replies_received > job.replies_consumed:
        return job.replies_received
    return None


def consume(driver: JobDriver, conn: Connection, job_id: int, upto: int, clock: Any) -> None:
    """Mark the job's replies up to ``seq`` ``upto`` consumed (a run that saw them ended
    well), in the caller's transaction, after its fenced move."""
    driver.reply_consume(conn, job_id, upto, clock)


def reply_from_row(row: Any) -> Reply:
    return Reply(
        reply_id=row.reply_id,
        payload=row.payload,
        source=row.source,
        received_at=float(row.received_at),
        seq=int(row.seq),
        consumed_at=None if row.consumed_at is None else float(row.consumed_at),
    )
