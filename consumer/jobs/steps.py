"""Steps: jobs that wait for other jobs (``after=`` at enqueue), in the job store's own tables.

Contract (``docs/how-to/steps.md`` has the user's side):

- **The graph is written whole or not at all.** ``enqueue(..., after=[(tenant, action),
  ...])`` and the ``"after"`` item of ``enqueue_many`` name parents that exist or that the
  same call creates. A cycle (:class:`~consumer.errors.DependencyCycle`) or a parent that is
  neither (:class:`~consumer.errors.UnknownParent`) is refused before anything is written.
  An identity that existed already keeps its own parents (an enqueue of it is a duplicate).
- **Edges.** ``outbox_job_steps`` holds one row per (parent, child). A child with a parent not
  DONE is WAITING_PARENTS, never claimed (the claim's statement is unchanged: it takes READY
  rows only), with ``parents_pending`` counting those parents; ``children`` on the parent
  counts its dependents, so a lease without any finishes on the plain path.
- **Release, exactly once.** :func:`settle_children` applies the ends of parents to their
  children, in the caller's transaction (the parent's finish): each edge is marked
  ``released`` by one UPDATE that only an unreleased edge matches (row-locked on PostgreSQL,
  the write lock on SQLite), and the child's ``parents_pending`` is decremented by the edges
  released, so the child of N parents finishing together on N workers becomes READY once, in
  the transaction of the last one. The decrement reads the row's latest version on
  PostgreSQL (an UPDATE waits for a concurrent one, then re-evaluates).
- **A parent that fails** (NEEDS_ATTENTION, WAITING_REVIEW) sends its WAITING_PARENTS
  children to WAITING_REVIEW, the reason naming the parent (``on_parent_failure="cancel"``:
  CANCELLED). A parent CANCELLED cancels its children, and theirs. A child in review because
  of a parent becomes READY like any other when its last parent ends DONE after all (the
  operator resumed the parent).
- **The sweep.** A finish on the plain path (a lease claimed before a child was enqueued
  after it) or a run killed between the parent's finish and nothing else: ``Store.recover``
  applies the ends of parents whose edges are not released yet (:func:`sweep`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import and_, bindparam, case, exists, insert, or_, select, text, update
from sqlalchemy.engine import Connection

from consumer.errors import DependencyCycle, JobError, UnknownParent
from consumer.jobs.checks import valid_name
from consumer.jobs.driver import JobDriver
from consumer.jobs.enqueues import enqueue_rows
from consumer.jobs.rows import EnqueueResult, Lease
from consumer.jobs.schema import attempts, job_steps, jobs
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING_EXTERNAL,
    WAITING_PARENTS,
    WAITING_REVIEW,
)
from outbox.dialect import is_postgresql

__all__ = [
    "FAILED_PARENT",
    "POLICIES",
    "enqueue_graph",
    "plain",
    "settle_children",
    "sweep",
    "valid_after",
    "valid_policy",
    "write_results",
]

Key = tuple[str, str]

POLICIES = ("review", "cancel")
"""``on_parent_failure``: ``review`` (the default: WAITING_REVIEW) or ``cancel``."""
FAILED_PARENT = "parent failed: "
"""How the wait reason of a child parked by a failed parent begins (its release reads it)."""
_FAILED = (NEEDS_ATTENTION, WAITING_REVIEW)
_OPEN = (READY, WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION, WAITING_PARENTS)


def valid_after(after: object, field: str = "after") -> list[Key]:
    """``after=``: a list of ``(tenant, action)`` pairs; ``JobError`` naming ``field``."""
    if after is None:
        return []
    if isinstance(after, (str, bytes, Mapping)) or not isinstance(after, Iterable):
        raise JobError(field, "must be a list of (tenant, action) pairs")
    keys: list[Key] = []
    for item in after:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise JobError(field, f"must hold (tenant, action) pairs, got {item!r}")
        tenant, action = item
        valid_name(f"{field} tenant", tenant)
        valid_name(f"{field} action", action)
        keys.append((tenant, action))
    return list(dict.fromkeys(keys))


def valid_policy(policy: object) -> str | None:
    """``on_parent_failure``: None or ``review`` (stored NULL), or ``cancel``."""
    if policy is None or policy == "review":
        return None
    if policy == "cancel":
        return "cancel"
    raise JobError("on_parent_failure", f"must be 'review' or 'cancel', got {policy!r}")


def _label(key: Key) -> str:
    return f"{key[0]}/{key[1]}"


def check_cycles(keys: Sequence[Key], afters: Sequence[Sequence[Key]]) -> None:
    """Refuse a cycle among the jobs of one call (existing jobs cannot depend on new ones)."""
    parents: dict[Key, list[Key]] = {}
    for key, after in zip(keys, afters, strict=True):
        parents.setdefault(key, []).extend(after)
    state: dict[Key, int] = {}  # 1: on the current path, 2: done
    for start in parents:
        if state.get(start):
            continue
        path: list[Key] = [start]
        stack = [iter(parents[start])]
        state[start] = 1
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                state[path.pop()] = 2
                continue
            if step not in parents or state.get(step) == 2:
                continue
            if state.get(step) == 1:
                cycle = [*path[path.index(step) :], step]
                raise DependencyCycle([_label(k) for k in cycle])
            state[step] = 1
            path.append(step)
            stack.append(iter(parents[step]))


def enqueue_graph(
    driver: JobDriver,
    conn: Connection,
    rows: list[dict[str, Any]],
    afters: list[list[Key]],
    policies: list[str | None],
) -> list[EnqueueResult]:
    """Insert jobs and their edges in ``conn``'s transaction (``Store.enqueue_many`` checked
    every row). Refusals come before the first write."""
    keys = [(row["tenant"], row["action"]) for row in rows]
    check_cycles(keys, afters)
    found = _known_parents(driver, conn, set(keys), afters)
    rows = [
        {
            **row,
            "state": WAITING_PARENTS if after else row["state"],
            "on_parent_failure": policy,
        }
        for row, after, policy in zip(rows, afters, policies, strict=True)
    ]
    results = enqueue_rows(driver, conn, rows)
    ids = {**found, **{k: r.job_id for k, r in zip(keys, results, strict=True)}}
    edges = [
        (ids[parent], result.job_id)
        for result, after in zip(results, afters, strict=True)
        if after and not result.duplicate
        for parent in after
    ]
    if edges:
        stamp = rows[0]["updated_at"]
        if not isinstance(stamp, (int, float)):
            stamp = driver.clock_read(conn, None)  # the history rows need a number
        policy_of = {r.job_id: policy for r, policy in zip(results, policies, strict=True)}
        _write_edges(driver, conn, edges, policy_of, stamp)
    return results


def _known_parents(
    driver: JobDriver, conn: Connection, batch: set[Key], afters: list[list[Key]]
) -> dict[Key, int]:
    """The ids of the parents outside this call; ``UnknownParent`` names those not found."""
    outside = sorted({p for after in afters for p in after if p not in batch})
    found = driver.job_ids(conn, outside) if outside else {}
    missing = [_label(k) for k in outside if k not in found]
    if missing:
        raise UnknownParent(missing)
    return found


def _write_edges(
    driver: JobDriver,
    conn: Connection,
    edges: list[tuple[int, int]],
    policy_of: dict[int, str | None],
    stamp: float,
) -> None:
    """The edges, with each child's first state and count from its parents' states read
    under their locks; a child that ended at once ends its own children."""
    states = _lock_parents(conn, Counter(parent for parent, _ in edges))
    conn.execute(
        insert(job_steps),
        [
            {"parent_id": p, "child_id": c, "released": int(states[p].state in (DONE, CANCELLED))}
            for p, c in edges
        ],
    )
    by_child: dict[int, list[int]] = {}
    for parent, child in edges:
        by_child.setdefault(child, []).append(parent)
    moves: dict[tuple[Any, ...], list[int]] = {}  # the children's first values -> ids
    ended: list[int] = []
    for child, parents in by_child.items():
        first = _first_values(parents, states, policy_of.get(child))
        moves.setdefault(tuple(sorted(first.items())), []).append(child)
        if first.get("state") in (CANCELLED, WAITING_REVIEW):
            ended.append(child)
    for values, children in moves.items():  # one UPDATE per kind of start, 500 ids a time
        for start in range(0, len(children), _CHUNK):
            chunk = children[start : start + _CHUNK]
            conn.execute(
                update(jobs).where(jobs.c.id.in_(chunk)).values(**dict(values), updated_at=stamp)
            )
    if ended:  # a child that ended at once ends its own children (created in this call)
        settle_children(driver, conn, ended, stamp)
    if any(dict(values).get("state") == READY for values in moves):
        driver.job_ready_notify(conn)


_CHUNK = 500


def _lock_parents(conn: Connection, counts: Counter[int]) -> dict[int, Any]:
    """The parents' rows locked in id order and their dependents counted (a finish of one of
    them waits for this transaction, and its release then reads the edges written here);
    their state read after the lock, by parent id."""
    ids = sorted(counts)
    by_count: dict[int, list[int]] = {}
    for parent in ids:
        by_count.setdefault(counts[parent], []).append(parent)
    states: dict[int, Any] = {}
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        conn.execute(
            select(jobs.c.id).where(jobs.c.id.in_(chunk)).order_by(jobs.c.id).with_for_update()
        )
    for n, group in by_count.items():
        for start in range(0, len(group), _CHUNK):
            chunk = group[start : start + _CHUNK]
            conn.execute(
                update(jobs).where(jobs.c.id.in_(chunk)).values(children=jobs.c.children + n)
            )
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        query = select(jobs.c.id, jobs.c.state, jobs.c.tenant, jobs.c.action, jobs.c.wait_reason)
        for row in conn.execute(query.where(jobs.c.id.in_(chunk))):
            states[int(row.id)] = row
    return states


def _first_values(parents: list[int], states: dict[int, Any], policy: str | None) -> dict[str, Any]:
    """A new child's count of pending parents and, when its parents decide it at once, its
    state: CANCELLED (a parent cancelled), parked (a parent failed) or READY (all DONE)."""
    pending = sum(states[p].state != DONE for p in parents)
    values: dict[str, Any] = {"parents_pending": pending}
    cancelled = [p for p in parents if states[p].state == CANCELLED]
    failed = [p for p in parents if _failed(states[p])]
    if cancelled:
        values.update(state=CANCELLED, wait_reason=_why(states[cancelled[0]], "cancelled"))
    elif failed:
        state = CANCELLED if policy == "cancel" else WAITING_REVIEW
        values.update(state=state, wait_reason=_why(states[failed[0]], "failed"))
    elif pending == 0:
        values["state"] = READY
    return values


def _why(parent: Any, how: str) -> str:
    """The wait reason of a child whose parent ended without a result."""
    reason = f" ({parent.wait_reason})" if how == "failed" and parent.wait_reason else ""
    return f"{FAILED_PARENT}{parent.tenant}/{parent.action} is {parent.state}{reason}"[:2000]


def plain(lease: Lease) -> bool:
    """A lease whose finish needs nothing of this module: no dependents at its claim, no
    result (the worker's finishes keep their one-statement path for it)."""
    return lease.children == 0 and lease.result is None


def write_results(driver: JobDriver, conn: Connection, leases: Iterable[Lease]) -> None:
    """The results of the leases that have one, each fenced on its lease, in the finish's
    transaction, before its statement (a lease lost meanwhile writes nothing): one statement
    for the batch on PostgreSQL (the rows as one JSON parameter), one executemany on SQLite."""
    del driver  # the columns are the same on both databases
    rows = [
        {"id": x.job_id, "epoch": x.epoch, "worker": x.worker, "result": x.result}
        for x in leases
        if x.result is not None
    ]
    if not rows:
        return
    if is_postgresql(conn.dialect.name):
        conn.execute(text(_PG_RESULTS), {"rows": json.dumps(rows)})
        return
    conn.execute(
        update(jobs)
        .where(
            jobs.c.id == bindparam("r_id"),
            jobs.c.lease_epoch == bindparam("r_epoch"),
            jobs.c.lease_owner == bindparam("r_worker"),
            jobs.c.state == LEASED,
        )
        .values(result=bindparam("r_result", type_=jobs.c.result.type)),
        [{f"r_{k}": v for k, v in row.items()} for row in rows],
    )


# By primary key (``state || ''`` keeps the partial LEASED indexes out of the plan, as the
# batch finish does: consumer.jobs.queries.pg_finish_batch has the reason).
_PG_RESULTS = f"""
UPDATE {jobs.name} AS j SET result = r.result
FROM jsonb_to_recordset(CAST(:rows AS jsonb))
     AS r(id bigint, epoch bigint, worker text, result jsonb)
WHERE j.id = r.id AND j.lease_epoch = r.epoch AND j.lease_owner = r.worker
  AND j.state || '' = '{LEASED}'
"""

# The release of DONE parents' edges and their children's counts in ONE statement
# (PostgreSQL): the edges claimed by the first CTE (an edge released already does not match),
# each child decremented by its count of them; the UPDATE of a child waits for a concurrent
# one and re-evaluates on its latest version, so counts never go astray. The children are
# locked in id order first: two finishes releasing the same children (diamonds finished by
# two workers) wait for each other instead of deadlocking.
_READY_NOW = f"""(j.parents_pending - n.c <= 0 AND (j.state = '{WAITING_PARENTS}'
    OR (j.state = '{WAITING_REVIEW}' AND j.wait_reason LIKE '{FAILED_PARENT}%')))"""
_PG_RELEASE = f"""
WITH e AS (
    UPDATE {job_steps.name} SET released = 1
    WHERE parent_id = ANY(string_to_array(:ids, ',')::bigint[]) AND released = 0
    RETURNING child_id
),
n AS (SELECT child_id, count(*) AS c FROM e GROUP BY child_id),
locked AS MATERIALIZED (
    SELECT id FROM {jobs.name} WHERE id IN (SELECT child_id FROM n) ORDER BY id FOR UPDATE
)
UPDATE {jobs.name} AS j
SET parents_pending = j.parents_pending - n.c,
    state = CASE WHEN {_READY_NOW} THEN '{READY}' ELSE j.state END,
    wait_reason = CASE WHEN {_READY_NOW} THEN NULL ELSE j.wait_reason END,
    run_after = CASE WHEN {_READY_NOW} THEN NULL ELSE j.run_after END,
    updated_at = CAST(:clock AS double precision)
FROM n, locked WHERE j.id = n.child_id AND locked.id = n.child_id
RETURNING j.state
"""


def _release_done(conn: Connection, done: list[int], clock: Any) -> bool:
    """The edges of DONE parents released and their children counted down (READY at zero).
    True if a child became READY."""
    if not done:
        return False
    if is_postgresql(conn.dialect.name):
        ids = ",".join(str(i) for i in done)
        states = conn.execute(text(_PG_RELEASE), {"ids": ids, "clock": clock}).scalars()
        return READY in set(states)
    released = conn.execute(
        update(job_steps)
        .where(job_steps.c.parent_id.in_(done), job_steps.c.released == 0)
        .values(released=1)
        .returning(job_steps.c.child_id)
    ).scalars()
    ready = False
    for child, n in sorted(Counter(int(c) for c in released).items()):
        ready = _decrement(conn, child, n, clock) or ready
    return ready


# complexity: one pass per generation of the cascade, each end of a parent in turn
def settle_children(
    driver: JobDriver, conn: Connection, parent_ids: Iterable[int], clock: Any
) -> bool:
    """Apply the ends of ``parent_ids`` (DONE, CANCELLED, failed) to their children, in the
    caller's transaction: the ONE function every path that ends a job calls (a job without
    children costs one UPDATE that matches nothing). Cascades: a child cancelled or parked
    here ends its own children in the same transaction. True when a child became READY."""
    ids = sorted(set(parent_ids))
    ready = False
    while ids:
        rows = conn.execute(
            select(jobs.c.id, jobs.c.state, jobs.c.tenant, jobs.c.action, jobs.c.wait_reason).where(
                jobs.c.id.in_(ids)
            )
        ).all()
        by_id = {int(r.id): r for r in rows}
        ready = (
            _release_done(conn, [i for i, r in by_id.items() if r.state == DONE], clock) or ready
        )
        cancelled = [i for i, r in by_id.items() if r.state == CANCELLED]
        released: Sequence[Any] = ()
        if cancelled:
            released = conn.execute(
                update(job_steps)
                .where(job_steps.c.parent_id.in_(cancelled), job_steps.c.released == 0)
                .values(released=1)
                .returning(job_steps.c.parent_id, job_steps.c.child_id)
            ).all()
        nexts: list[int] = []
        for parent, child in released:
            nexts += _end_child(conn, int(child), CANCELLED, by_id[int(parent)], clock)
        for parent in sorted(i for i, r in by_id.items() if _failed(r)):
            nexts += _fail_children(conn, parent, by_id[parent], clock)
        ids = sorted(set(nexts))
    if ready:
        driver.job_ready_notify(conn)
    return ready


def _failed(row: Any) -> bool:
    """A parent that needs a person, itself: one parked only because of its own parent is
    not (its children keep waiting for it, as it waits)."""
    parked = row.state == WAITING_REVIEW and (row.wait_reason or "").startswith(FAILED_PARENT)
    return row.state in _FAILED and not parked


def _decrement(conn: Connection, child: int, n: int, clock: Any) -> bool:
    """One child's count of pending parents down by ``n``; READY at zero. True if READY."""
    left = jobs.c.parents_pending - n
    parked = (jobs.c.state == WAITING_REVIEW) & jobs.c.wait_reason.like(FAILED_PARENT + "%")
    now_ready = (left <= 0) & ((jobs.c.state == WAITING_PARENTS) | parked)
    state = conn.execute(
        update(jobs)
        .where(jobs.c.id == child)
        .values(
            parents_pending=left,
            state=case((now_ready, READY), else_=jobs.c.state),
            wait_reason=case((now_ready, None), else_=jobs.c.wait_reason),
            run_after=case((now_ready, None), else_=jobs.c.run_after),
            updated_at=clock,
        )
        .returning(jobs.c.state)
    ).scalar()
    return state == READY


def _end_child(conn: Connection, child: int, target: str, parent: Any, clock: Any) -> list[int]:
    """A child of a cancelled parent: CANCELLED (a running one gets a cancel request)."""
    reason = _why(parent, "cancelled")
    moved = conn.execute(
        update(jobs)
        .where(jobs.c.id == child, jobs.c.state.in_(_OPEN))
        .values(state=target, wait_reason=reason, run_after=None, updated_at=clock)
        .returning(jobs.c.id)
    ).scalar()
    if moved is None:
        conn.execute(
            update(jobs)
            .where(jobs.c.id == child, jobs.c.state == LEASED)
            .where(jobs.c.cancel_requested_at.is_(None))
            .values(cancel_requested_at=clock, cancel_reason=reason)
        )
        return []
    _history(conn, [child], "cancelled", reason, clock)
    return [child]


def _fail_children(conn: Connection, parent: int, row: Any, clock: Any) -> list[int]:
    """The WAITING_PARENTS children of a failed parent: WAITING_REVIEW, or CANCELLED when
    they asked for it. The edges stay unreleased: the parent may still end DONE."""
    reason = _why(row, "failed")
    waiting = select(job_steps.c.child_id).where(
        job_steps.c.parent_id == parent, job_steps.c.released == 0
    )
    moved = conn.execute(
        update(jobs)
        .where(jobs.c.id.in_(waiting), jobs.c.state == WAITING_PARENTS)
        .values(
            state=case((jobs.c.on_parent_failure == "cancel", CANCELLED), else_=WAITING_REVIEW),
            wait_reason=reason,
            updated_at=clock,
        )
        .returning(jobs.c.id, jobs.c.state)
    ).all()
    for child, state in moved:
        _history(conn, [int(child)], state.lower(), reason, clock)
    return [int(child) for child, state in moved if state == CANCELLED]


def _history(conn: Connection, ids: list[int], outcome: str, note: str, clock: Any) -> None:
    conn.execute(
        insert(attempts),
        [
            {
                "job_id": i,
                "epoch": None,
                "worker": None,
                "outcome": outcome,
                "error": note,
                "at": clock,
            }
            for i in ids
        ],
    )


def sweep(driver: JobDriver, conn: Connection, clock: Any, limit: int) -> int:
    """Parents whose end was not applied to their children yet (a plain finish of a lease
    claimed before its child was enqueued, a failure moved by a path of its own): applied
    now. Returns how many parents were settled. At most ``limit`` of them."""
    parent = jobs.alias("parent")
    child = jobs.alias("child")
    waiting_child = exists().where(
        child.c.id == job_steps.c.child_id, child.c.state == WAITING_PARENTS
    )
    # A parent parked only because of its own parent is not a failure (``_failed``).
    not_parked = or_(
        parent.c.wait_reason.is_(None), ~parent.c.wait_reason.startswith(FAILED_PARENT)
    )
    found = (
        conn.execute(
            select(job_steps.c.parent_id)
            .join(parent, parent.c.id == job_steps.c.parent_id)
            .where(
                job_steps.c.released == 0,
                parent.c.state.in_((DONE, CANCELLED))
                | and_(parent.c.state == NEEDS_ATTENTION, waiting_child)
                | and_(parent.c.state == WAITING_REVIEW, waiting_child, not_parked),
            )
            .distinct()
            .limit(limit)
        )
        .scalars()
        .all()
    )
    if found:
        settle_children(driver, conn, [int(i) for i in found], clock)
    return len(found)
