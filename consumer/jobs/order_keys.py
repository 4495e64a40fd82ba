"""Order keys: the jobs of one key run one at a time, in enqueue order (issue 56).

``Store.enqueue(..., order_key="invoice-42")`` (an ``"order_key"`` item in ``enqueue_many``)
puts the job in its key's **line**. Contract:

- **One at a time, in enqueue order.** At most one job of a key is its **head**: the only one
  a claim can see. Every later job of the key waits in the state HELD, which no claim reads
  (the claim statement is the same indexed statement as without keys). "Earlier" is the order
  in which the enqueues took the key's lock: commit order, which for a consumer's jobs is
  stream order.
- **What ends a head's hold.** DONE and CANCELLED. A head waiting on a reply
  (WAITING_EXTERNAL) or a timer (``schedule``) holds the line, unless it was enqueued with
  ``hold="run"``: then the later jobs pass it while it waits (it leaves the line and runs
  when its wait ends). A head in NEEDS_ATTENTION or WAITING_REVIEW always holds: a person
  decides (``resume`` or ``cancel``). A retry's backoff, a defer, a drain's hand-back and an
  expired lease keep the head in place.
- **Promotion in the same transaction.** The move that ends a head's hold makes the key's
  first HELD job READY and the new head in the same transaction (:func:`release`, and on
  PostgreSQL inside the batch finish's statement itself: ``consumer.jobs.order_ddl``). A
  crash cannot leave a line without a head.
- **Race-safe.** Every change of a key's line (an enqueue, a finish, a cancel, a wait) first
  locks the key's row in ``outbox_order_keys`` and reads the line after the lock; SQLite's
  write lock does the same. Keys are locked in sorted order. An operator's cancel of a HELD
  job takes no key lock: the promotion skips a row that is no longer HELD.
- **Cost.** A job without an order key pays nothing but two NULL columns; the finish of a
  keyed job runs the promotion (a few index probes) in its own statement or transaction.

**Concurrency keys.** ``concurrency_key=`` with ``concurrency_limit=N``: at most N of the
key's jobs are admitted (READY or further) and unfinished at once, across every worker. The
others wait HELD and are admitted in enqueue order when a place frees: the finish or cancel
of an admitted job, in its transaction (``order_ddl.pg_concurrency_release_sql``; the key's
row in ``outbox_concurrency_keys`` counts the places taken). A job keeps its place while it
waits or retries. A job has an order key or a concurrency key, not both.

What is NOT ordered: jobs of different keys (they run in parallel, fairly across tenants),
jobs without a key, and the queue, tenant or priority of a keyed job decide nothing about its
turn within the key (only when its turn came, whether a worker of its queue claims it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.engine import Connection

from consumer.errors import JobError
from consumer.jobs.order_ddl import CONCURRENCY_RELEASE_FUNCTION, ORDER_RELEASE_FUNCTION
from consumer.jobs.schema import concurrency_keys, db_epoch, jobs, order_keys
from consumer.jobs.states import CANCELLED, DONE, HELD, READY, WAITING_EXTERNAL
from outbox.dialect import EPOCH_SQL, POSTGRESQL, is_postgresql
from outbox.validate import check_name

__all__ = ["HOLDS", "KeyLine", "concurrency_values", "hold_value", "key_values", "read_line"]
__all__ += ["release"]
__all__ += ["releases"]

HOLDS = ("wait", "run")
"""``hold=``: ``"wait"`` (the default: a waiting head holds its key's later jobs) or
``"run"`` (they pass it while it waits on a reply or a timer)."""

_PG_ARGS = (
    f"CAST(:ids AS bigint[]), :ended, coalesce(CAST(:now AS double precision),"
    f" {EPOCH_SQL[POSTGRESQL]})"
)
_PG_RELEASE = text(
    f"SELECT {ORDER_RELEASE_FUNCTION}({_PG_ARGS}) + {CONCURRENCY_RELEASE_FUNCTION}({_PG_ARGS})"
)


def hold_value(order_key: str | None, hold: str) -> str | None:
    """The ``order_hold`` column for ``hold=``, the order key checked too: NULL for the
    default."""
    if order_key is None and hold == "wait":  # the usual job: nothing to check
        return None
    if order_key is not None:
        check_name("order_key", order_key, JobError)
    if hold not in HOLDS:
        raise JobError("hold", f"must be 'wait' or 'run', got {hold!r}")
    if hold == "run" and order_key is None:
        raise JobError("hold", "applies to a job with an order_key only")
    return "run" if hold == "run" else None


def releases(target: str, timer: bool) -> bool:
    """Whether a move to ``target`` may end a head's hold (and so calls :func:`release`):
    a finish, a cancel, a wait on a reply, a timer. Retries, defers, hand-backs and waits
    for a person never do."""
    return target in (DONE, CANCELLED, WAITING_EXTERNAL) or (target == READY and timer)


def release(conn: Connection, ids: Sequence[int], *, ended: bool, now: float | None) -> int:
    """After the jobs ``ids`` moved, in the mover's transaction: for each of their order keys
    whose head no longer holds its line, make the key's first HELD job READY and its head.
    ``ended``: the jobs finished (DONE or CANCELLED). Jobs without a key cost one probe by
    primary key. Returns the jobs promoted."""
    if not ids:
        return 0
    if is_postgresql(conn.dialect.name):
        params = {"ids": list(ids), "ended": ended, "now": now}
        return int(conn.execute(_PG_RELEASE, params).scalar_one())
    clock = now if now is not None else float(conn.execute(select(db_epoch())).scalar_one())
    promoted = _release_sqlite(conn, ids, ended=ended, now=clock)
    return promoted + _admit_sqlite(conn, ids, ended=ended, now=clock)


def _release_sqlite(conn: Connection, ids: Sequence[int], *, ended: bool, now: float) -> int:
    # The caller holds SQLite's write lock (BEGIN IMMEDIATE): nothing changes under this.
    keys = sorted(
        {
            str(key)
            for (key,) in conn.execute(
                select(jobs.c.order_key).where(
                    jobs.c.id.in_(list(ids)), jobs.c.order_key.is_not(None)
                )
            )
        }
    )
    if not keys:
        return 0
    clock = now
    promoted = 0
    for key in keys:
        row = conn.execute(
            select(order_keys.c.head_id).where(order_keys.c.order_key == key)
        ).first()
        if row is None:
            conn.execute(insert(order_keys).values(order_key=key, head_id=None, updated_at=clock))
            head = None
        else:
            head = row[0]
        if head is not None and not (ended and int(head) in ids) and _holds(conn, int(head), clock):
            continue
        next_id = conn.execute(
            select(jobs.c.id)
            .where(jobs.c.order_key == key, jobs.c.state == HELD)
            .order_by(jobs.c.id)
            .limit(1)
        ).scalar()
        if next_id is not None:
            conn.execute(
                update(jobs).where(jobs.c.id == next_id).values(state=READY, updated_at=clock)
            )
            promoted += 1
        conn.execute(
            update(order_keys)
            .where(order_keys.c.order_key == key)
            .values(head_id=next_id, updated_at=clock)
        )
    return promoted


def _admit_sqlite(conn: Connection, ids: Sequence[int], *, ended: bool, now: float) -> int:
    """SQLite: ``order_ddl.pg_concurrency_release_sql``'s rule, under the write lock."""
    lines: dict[str, list[Any]] = {}
    for key, cap in conn.execute(
        select(jobs.c.concurrency_key, jobs.c.concurrency_limit)
        .where(jobs.c.id.in_(list(ids)), jobs.c.concurrency_key.is_not(None))
        .order_by(jobs.c.id)
    ):
        found = lines.setdefault(str(key), [0, cap])
        found[0] += 1
        found[1] = cap  # the latest job's limit
    admitted = 0
    for key in sorted(lines):
        ended_here, cap = lines[key]
        taken = conn.execute(
            select(concurrency_keys.c.active).where(concurrency_keys.c.concurrency_key == key)
        ).scalar()
        if taken is None:
            conn.execute(
                insert(concurrency_keys).values(
                    concurrency_key=key, active=0, concurrency_limit=cap, updated_at=now
                )
            )
            taken = 0
        taken = max(0, int(taken) - ended_here) if ended else int(taken)
        room = int(cap) - taken
        moved = []
        if room > 0:
            moved = [
                int(r[0])
                for r in conn.execute(
                    select(jobs.c.id)
                    .where(jobs.c.concurrency_key == key, jobs.c.state == HELD)
                    .order_by(jobs.c.id)
                    .limit(room)
                )
            ]
        if moved:
            conn.execute(
                update(jobs).where(jobs.c.id.in_(moved)).values(state=READY, updated_at=now)
            )
        conn.execute(
            update(concurrency_keys)
            .where(concurrency_keys.c.concurrency_key == key)
            .values(active=taken + len(moved), concurrency_limit=cap, updated_at=now)
        )
        admitted += len(moved)
    return admitted


def key_values(
    order_key: str | None, hold: str, concurrency_key: str | None, concurrency_limit: int | None
) -> dict[str, Any]:
    """A new job's ``state`` and its keys' columns (checked): HELD for a job of an order or
    concurrency key (its enqueue's :func:`release` admits it), else READY."""
    values = {
        "order_key": order_key,
        "order_hold": hold_value(order_key, hold),
        **concurrency_values(concurrency_key, concurrency_limit, order_key),
    }
    values["state"] = READY if order_key is None and concurrency_key is None else HELD
    return values


def concurrency_values(key: str | None, limit: int | None, order_key: str | None) -> dict[str, Any]:
    """The concurrency columns for ``concurrency_key=`` / ``concurrency_limit=`` (checked)."""
    if key is None and limit is None:
        return {"concurrency_key": None, "concurrency_limit": None}
    if key is None:
        raise JobError("concurrency_limit", "applies to a job with a concurrency_key only")
    check_name("concurrency_key", key, JobError)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise JobError("concurrency_limit", f"must be a positive integer, got {limit!r}")
    if order_key is not None:
        raise JobError(
            "concurrency_key",
            "cannot be combined with an order_key (the jobs of an order key run one at a time)",
        )
    return {"concurrency_key": key, "concurrency_limit": limit}


def _holds(conn: Connection, job_id: int, clock: float) -> bool:
    """Whether the head ``job_id`` still holds its line (``order_ddl.holds_sql``'s rule)."""
    row = conn.execute(
        select(jobs.c.state, jobs.c.order_hold, jobs.c.timer_scheduled_for, jobs.c.run_after).where(
            jobs.c.id == job_id
        )
    ).first()
    if row is None or row.state in (DONE, CANCELLED):
        return False
    if row.order_hold != "run":
        return True
    if row.state == WAITING_EXTERNAL:
        return False
    timed = row.state == READY and row.timer_scheduled_for is not None
    return not (timed and row.run_after is not None and row.run_after > clock)


# -- reading a key's line (the CLI and the console) ---------------------------------------


@dataclass(frozen=True)
class KeyLine:
    """One order key's line (``Store.order_line``): ``head``, the key's job that runs or may
    run now (its ``id``, ``tenant``, ``action``, ``state``, ``wait_reason``, ``hold``), or
    None; ``holding``: whether the head holds the jobs behind it now (False once it
    finished, or while it waits with ``hold="run"``); ``held``: the jobs HELD behind it, in
    the order they will run (at most the ``limit`` asked for; ``id``, ``tenant``,
    ``action``); ``held_count``: all of them."""

    order_key: str
    head: dict[str, Any] | None
    holding: bool
    held: list[dict[str, Any]]
    held_count: int

    @property
    def why(self) -> str:
        """The line in words: what runs, what waits, and what holds it."""
        behind = f"{self.held_count} job(s) HELD behind it"
        if self.head is None:
            return f"order key {self.order_key}: no job runs; {behind}"
        head = self.head
        what = f"job {head['id']} ({head['tenant']}/{head['action']}) is {head['state']}"
        if head["wait_reason"]:
            what += f" ({head['wait_reason']})"
        if not self.holding:
            return f"order key {self.order_key}: {what} and holds nothing; {behind}"
        return f"order key {self.order_key}: {what}; {behind}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "order_key": self.order_key,
            "head": self.head,
            "holding": self.holding,
            "held": self.held,
            "held_count": self.held_count,
            "why": self.why,
        }


def read_line(conn: Connection, order_key: str, limit: int = 50) -> KeyLine:
    """The line of ``order_key`` as it stands (reads only: the head by its key's row, the
    HELD jobs by ``ix_outbox_jobs_order_held``)."""
    check_name("order_key", order_key, JobError)
    head_id = conn.execute(
        select(order_keys.c.head_id).where(order_keys.c.order_key == order_key)
    ).scalar()
    head: dict[str, Any] | None = None
    holding = False
    if head_id is not None:
        row = conn.execute(
            select(
                *(jobs.c.id, jobs.c.tenant, jobs.c.action, jobs.c.state, jobs.c.wait_reason),
                jobs.c.order_hold,
            ).where(jobs.c.id == head_id)
        ).first()
        if row is not None:
            head = {
                "id": int(row.id),
                "tenant": row.tenant,
                "action": row.action,
                "state": row.state,
                "wait_reason": row.wait_reason,
                "hold": row.order_hold or "wait",
            }
            clock = float(conn.execute(select(db_epoch())).scalar_one())
            holding = _holds(conn, int(head_id), clock)
    waiting = (jobs.c.order_key == order_key) & (jobs.c.state == HELD)
    held = [
        {"id": int(r.id), "tenant": r.tenant, "action": r.action}
        for r in conn.execute(
            select(jobs.c.id, jobs.c.tenant, jobs.c.action)
            .where(waiting)
            .order_by(jobs.c.id)
            .limit(limit)
        )
    ]
    count = int(conn.execute(select(func.count()).select_from(jobs).where(waiting)).scalar_one())
    return KeyLine(order_key, head, holding, held, count)
