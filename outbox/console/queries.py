"""Every read of the console: the overview, the lists (keyset pages) and the records a trace
follows. SQLAlchemy Core on the parts' own tables; nothing here writes.

Two rules keep each statement's cost bounded whatever the size of the tables:

- **Keyset, never OFFSET.** A list page is ``WHERE <key> < :cursor ORDER BY <key> DESC LIMIT
  n + 1`` (the extra row says whether there is a next page; its key is the next cursor).
  OFFSET reads and throws away every row before the page: page 10,000 of a 10-million-row
  table would read 500,000 rows. With a filter, the lookup index on (filter, key)
  (``outbox.console.schema.LOOKUP_INDEXES``) keeps the page an index range scan.
- **States as literals.** A state the filter or the overview asks for is rendered into the
  SQL (``literal_execute``), never bound: psycopg prepares a statement after five runs, and a
  generic plan cannot match a partial index's predicate (``WHERE state = 'pending'``), so a
  bound state would fall back to a scan of the table (relay/store/ says the same).
  Only validated values are rendered (one of the part's states).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    Table,
    and_,
    func,
    inspect,
    literal,
    or_,
    select,
    tuple_,
    union_all,
)
from sqlalchemy.engine import Connection, Engine

from consumer.inbox import NEEDS_ATTENTION as DL_NEEDS_ATTENTION
from consumer.inbox import REPLAYED as DL_REPLAYED
from consumer.inbox import InboxSchema, build_inbox_schema
from consumer.jobs.rows import QueueDepth
from consumer.jobs.schema import (
    attempts,
    deliveries,
    job_steps,
    jobs,
    operations,
    order_keys,
    paused_queues,
    replies,
    schedules,
    workers,
)
from consumer.jobs.states import (
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING_EXTERNAL,
    WAITING_REVIEW,
)
from consumer.jobs.states import (
    STATES as JOB_STATES,
)
from consumer.jobs.store import Store
from outbox.console.columns import (
    DEAD_LETTER_LIST_COLUMNS,
    EVENT_LIST_COLUMNS,
    JOB_LIST_COLUMNS,
    LONG_TEXT,
    RECEIPT_LIST_COLUMNS,
)
from outbox.console.schema import audit
from outbox.dialect import db_epoch, db_now
from outbox.schema import PENDING, QUARANTINED, OutboxSchema, build_schema
from outbox.schema import STATES as EVENT_STATES
from outbox.validate import INT64_MAX

RECEIPT_STATES = ("PENDING", "ACCEPTED", "UNKNOWN", "NOT_SENT", "FAILED")
DEAD_LETTER_STATES = (DL_NEEDS_ATTENTION, DL_REPLAYED)
ACTIVE_JOB_STATES = (READY, LEASED, WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION)
TERMINAL_COUNT_CAP = 10_000
"""DONE and CANCELLED jobs are counted up to this many (then shown as "10000+"): an exact
count of a terminal state reads every row of it, and those only grow until retention."""

MAX_PAGE = 500
CELL_CHARS = 2000
"""A list shows at most this many characters of a long text cell (an error, a reason, an
audit row's before/after): a page of 500 rows stays a few megabytes at most, whatever the
tables hold. Payloads are never part of a list; a dead letter's comes one at a time
(:func:`dead_letter`), capped at :data:`MAX_PAYLOAD_CHARS`."""
MAX_PAYLOAD_CHARS = 1024 * 1024
TRACE_LIMIT = 50
"""At most this many rows of each kind in one trace (an identity has a handful)."""


class FilterError(ValueError):
    """A list filter or cursor that is not valid (the API answers 400)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


class NotFound(FilterError):
    """The record a read names does not exist (the API answers 404)."""


def lit(value: str) -> Any:
    """A validated state rendered into the SQL (see the module docstring)."""
    return literal(value, literal_execute=True)


def jsonable(value: Any) -> Any:
    """Rows as JSON: datetimes as ISO-8601, the rest as they are (JSON columns decoded)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def capped(column: Any, chars: int = CELL_CHARS) -> Any:
    """``column``'s first ``chars`` characters, cut in the database (the rest never leaves
    it), under the column's own name."""
    return func.substr(column, 1, chars).label(column.name)


def _row(row: Any) -> dict[str, Any]:
    return {k: jsonable(v) for k, v in row._mapping.items()}


@dataclass(frozen=True)
class Tables:
    """The tables the console reads, on one database."""

    outbox: Table
    inbox: InboxSchema

    @classmethod
    def build(cls, outbox_schema: OutboxSchema | None = None) -> Tables:
        schema = outbox_schema if outbox_schema is not None else build_schema()
        return cls(outbox=schema.table, inbox=build_inbox_schema())


@dataclass
class Page:
    """One page of a list: its rows, and the cursor of the next page (None: the last)."""

    rows: list[dict[str, Any]]
    next_cursor: str | None
    filters: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "next_cursor": self.next_cursor, "filters": self.filters}


def encode_cursor(values: Sequence[Any]) -> str:
    raw = json.dumps(list(values), separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _cursor_value(value: Any, kind: type) -> Any:
    """One value of a cursor, checked: its type, and a range its column can hold."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError("wrong type")
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        raise ValueError("out of range")  # a BIGINT column cannot hold it
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not finite")
    if isinstance(value, str) and (len(value) > 400 or "\x00" in value):
        raise ValueError("too long or holds NUL")
    return value


def decode_cursor(cursor: str | None, types: Sequence[type]) -> list[Any] | None:
    if not cursor:
        return None
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(values, list) or len(values) != len(types):
            raise ValueError("wrong shape")
        return [_cursor_value(v, kind) for v, kind in zip(values, types, strict=True)]
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise FilterError("cursor", f"not a cursor of this list ({exc})") from None


def _limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise FilterError("limit", f"must be an integer from 1 to {MAX_PAGE}")
    return limit


def _choice(name: str, value: str | None, allowed: Sequence[str]) -> str | None:
    if value in (None, ""):
        return None
    if value not in allowed:
        raise FilterError(name, f"must be one of {', '.join(allowed)}")
    return value


def _text(name: str, value: str | None) -> str | None:
    if value in (None, ""):
        return None
    assert value is not None
    if len(value) > 400 or "\x00" in value:
        raise FilterError(name, "too long or holds NUL")
    return value


def _paged(
    conn: Connection,
    query: Select[Any],
    keys: Sequence[Any],
    cursor: list[Any] | None,
    limit: int,
    filters: dict[str, str],
) -> Page:
    """Newest first by ``keys``, from after ``cursor``: one index range scan per page."""
    if cursor is not None:
        if len(keys) == 1:
            query = query.where(keys[0] < cursor[0])
        else:
            query = query.where(tuple_(*keys) < tuple_(*[literal(v) for v in cursor]))
    query = query.order_by(*[k.desc() for k in keys]).limit(limit + 1)
    rows = [_row(r) for r in conn.execute(query)]
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = encode_cursor([rows[-1][k.name] for k in keys])
    return Page(rows, next_cursor, filters)


# -- lists ----------------------------------------------------------------------------------


def event_filter(t: Table, topic: str | None, key: str | None, state: str | None) -> Any:
    conditions: list[ColumnElement[bool]] = []
    if topic:
        conditions.append(t.c.topic == topic)
    if key:
        conditions.append(t.c.key == key)
    if state:
        conditions.append(t.c.state == lit(state))
    return and_(*conditions) if conditions else None


def list_events(
    conn: Connection,
    tables: Tables,
    *,
    topic: str | None = None,
    key: str | None = None,
    state: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> Page:
    """Outbox rows, newest first (``seq`` desc)."""
    topic, key = _text("topic", topic), _text("key", key)
    state = _choice("state", state, EVENT_STATES)
    t = tables.outbox
    query = select(*[capped(t.c[c]) if c == "last_error" else t.c[c] for c in EVENT_LIST_COLUMNS])
    where = event_filter(t, topic, key, state)
    if where is not None:
        query = query.where(where)
    filters = {k: v for k, v in (("topic", topic), ("key", key), ("state", state)) if v}
    return _paged(conn, query, [t.c.seq], decode_cursor(cursor, [int]), _limit(limit), filters)


def job_filter(state: str | None, tenant: str | None, action: str | None) -> Any:
    conditions: list[ColumnElement[bool]] = []
    if state:
        conditions.append(jobs.c.state == lit(state))
    if tenant:
        conditions.append(jobs.c.tenant == tenant)
    if action:
        conditions.append(jobs.c.action == action)
    return and_(*conditions) if conditions else None


def list_jobs(
    conn: Connection,
    *,
    state: str | None = None,
    tenant: str | None = None,
    action: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> Page:
    """Jobs, newest first (``id`` desc)."""
    state = _choice("state", state, JOB_STATES)
    tenant, action = _text("tenant", tenant), _text("action", action)
    query = select(*[capped(jobs.c[c]) if c in LONG_TEXT else jobs.c[c] for c in JOB_LIST_COLUMNS])
    where = job_filter(state, tenant, action)
    if where is not None:
        query = query.where(where)
    filters = {k: v for k, v in (("state", state), ("tenant", tenant), ("action", action)) if v}
    return _paged(conn, query, [jobs.c.id], decode_cursor(cursor, [int]), _limit(limit), filters)


def _shown(table: Table, names: Sequence[str]) -> list[Any]:
    return [capped(table.c[n]) if n in LONG_TEXT else table.c[n] for n in names]


def list_receipts(
    conn: Connection, *, state: str | None = None, cursor: str | None = None, limit: int = 50
) -> Page:
    """Operation receipts, latest change first (``updated_at``, ``operation_id`` desc)."""
    state = _choice("state", state, RECEIPT_STATES)
    query = select(*_shown(operations, RECEIPT_LIST_COLUMNS))
    if state:
        query = query.where(operations.c.state == lit(state))
    keys = [operations.c.updated_at, operations.c.operation_id]
    return _paged(
        conn,
        query,
        keys,
        decode_cursor(cursor, [float, str]),
        _limit(limit),
        {"state": state} if state else {},
    )


def dead_letter_filter(dl: Table, group: str | None, state: str | None) -> Any:
    conditions: list[ColumnElement[bool]] = []
    if group:
        conditions.append(dl.c.group_name == group)
    if state:
        conditions.append(dl.c.state == lit(state))
    return and_(*conditions) if conditions else None


def list_dead_letters(
    conn: Connection,
    tables: Tables,
    *,
    group: str | None = None,
    state: str | None = DL_NEEDS_ATTENTION,
    cursor: str | None = None,
    limit: int = 50,
) -> Page:
    """Dead-letter records, newest first (``id`` desc); by default those needing attention."""
    group = _text("group", group)
    state = _choice("state", state, DEAD_LETTER_STATES)
    dl = tables.inbox.dead_letters
    query = select(*_shown(dl, DEAD_LETTER_LIST_COLUMNS))
    where = dead_letter_filter(dl, group, state)
    if where is not None:
        query = query.where(where)
    filters = {k: v for k, v in (("group", group), ("state", state)) if v}
    return _paged(conn, query, [dl.c.id], decode_cursor(cursor, [int]), _limit(limit), filters)


def list_audit(
    conn: Connection,
    *,
    action: str | None = None,
    target: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> Page:
    """The audit, newest first (``id`` desc)."""
    action, target = _text("action", action), _text("target", target)
    query = select(*_shown(audit, [c.name for c in audit.c]))
    if action:
        query = query.where(audit.c.action == action)
    if target:
        query = query.where(audit.c.target_id == target)
    filters = {k: v for k, v in (("action", action), ("target", target)) if v}
    return _paged(conn, query, [audit.c.id], decode_cursor(cursor, [int]), _limit(limit), filters)


def dead_letter(conn: Connection, tables: Tables, record_id: int) -> dict[str, Any] | None:
    """One dead-letter record with its payload (the first :data:`MAX_PAYLOAD_CHARS`
    characters; ``payload_truncated`` says whether there was more)."""
    dl = tables.inbox.dead_letters
    names = [*DEAD_LETTER_LIST_COLUMNS]
    query = select(
        *_shown(dl, names),
        capped(dl.c.payload, MAX_PAYLOAD_CHARS),
        func.length(dl.c.payload).label("payload_chars"),
    ).where(dl.c.id == record_id)
    row = conn.execute(query).first()
    if row is None:
        return None
    out = _row(row)
    out["payload_truncated"] = int(out.get("payload_chars") or 0) > MAX_PAYLOAD_CHARS
    return out


def count_matching(conn: Connection, table: Table, where: Any, cap: int) -> int:
    """How many rows a bulk action would take (at most ``cap`` + 1: "more than cap")."""
    inner = select(literal(1).label("one")).select_from(table)
    if where is not None:
        inner = inner.where(where)
    bounded = inner.limit(cap + 1).subquery()
    return int(conn.execute(select(func.count()).select_from(bounded)).scalar_one())


def ids_matching(conn: Connection, column: Any, where: Any, order: Any, cap: int) -> list[Any]:
    """The ids a bulk action takes, oldest first, at most ``cap``."""
    query = select(column)
    if where is not None:
        query = query.where(where)
    return [r[0] for r in conn.execute(query.order_by(order).limit(cap))]


# -- overview -------------------------------------------------------------------------------


def present_tables(engine: Engine, tables: Tables) -> set[str]:
    """Which of the parts' tables exist (a console may watch a database without consumers)."""
    inspector = inspect(engine)
    names = [
        tables.outbox.name,
        tables.inbox.inbox.name,
        tables.inbox.dead_letters.name,
        jobs.name,
        attempts.name,
        operations.name,
        workers.name,
        paused_queues.name,
        schedules.name,
        replies.name,
        deliveries.name,
        job_steps.name,
        order_keys.name,
        audit.name,
    ]
    return {name for name in names if inspector.has_table(name, schema=None)}


def list_queues(store: Store) -> Page:
    """The job queues: READY jobs and the oldest READY age (``Store.depth``, O(ready)), the
    jobs LEASED now (O(leased)) and whether an operator paused each. Every queue with READY
    or LEASED jobs, and every paused one; by name."""
    leased: dict[str, int] = {}
    with store.driver.connect() as conn:
        for queue, _tenant, n in store.driver.job_leased_by_tenant(conn):
            leased[str(queue)] = leased.get(str(queue), 0) + int(n)
    depth = store.depth()
    rows = []
    for name in sorted(set(depth) | set(leased)):
        found = depth.get(name)
        row = found.as_dict() if found is not None else QueueDepth(name, 0, 0.0).as_dict()
        row["leased"] = leased.get(name, 0)
        rows.append(row)
    return Page(rows, None, {})


def list_schedules(store: Store) -> Page:
    """The schedules, by name: each with its next slot, its last fired slot and that job's
    state, slots fired and missed, paused or running (``Store.schedules``: one statement)."""
    return Page([info.as_dict() for info in store.schedules()], None, {})


def job_counts(conn: Connection) -> dict[str, dict[str, int]]:
    """Jobs per state and tenant. Active states exactly, one statement per state so that
    each reads its partial index; DONE and CANCELLED per state only, capped
    (:data:`TERMINAL_COUNT_CAP`)."""
    parts = [
        select(jobs.c.state, jobs.c.tenant, func.count().label("n"))
        .where(jobs.c.state == lit(state))
        .group_by(jobs.c.state, jobs.c.tenant)
        for state in ACTIVE_JOB_STATES
    ]
    out: dict[str, dict[str, int]] = {}
    for state, tenant, n in conn.execute(union_all(*parts)):
        out.setdefault(str(state), {})[str(tenant)] = int(n)
    for state in ("DONE", "CANCELLED"):
        n = count_matching(conn, jobs, jobs.c.state == lit(state), TERMINAL_COUNT_CAP)
        if n:
            out[state] = {"*": n}
    return out


def open_receipts(conn: Connection, limit: int = 20) -> dict[str, Any]:
    """UNKNOWN receipts, and PENDING ones past their call deadline (both read through the
    partial index of open receipts)."""
    now = float(conn.execute(select(db_epoch())).scalar_one())
    unknown = int(
        conn.execute(select(func.count()).where(operations.c.state == lit("UNKNOWN"))).scalar_one()
    )
    overdue_where = and_(
        operations.c.state == lit("PENDING"),
        operations.c.call_deadline < now,
    )
    overdue = int(conn.execute(select(func.count()).where(overdue_where)).scalar_one())
    rows = conn.execute(
        select(operations)
        .where(
            or_(
                operations.c.state == lit("UNKNOWN"),
                overdue_where,
            )
        )
        .order_by(operations.c.updated_at)
        .limit(limit)
    )
    return {"unknown": unknown, "pending_past_deadline": overdue, "oldest": [_row(r) for r in rows]}


def live_workers(conn: Connection) -> list[dict[str, Any]]:
    now = float(conn.execute(select(db_epoch())).scalar_one())
    rows = conn.execute(
        select(workers).where(workers.c.alive_until > now).order_by(workers.c.name).limit(200)
    )
    return [_row(r) for r in rows]


def dead_letters_by_group(conn: Connection, tables: Tables) -> dict[str, int]:
    dl = tables.inbox.dead_letters
    rows = conn.execute(
        select(dl.c.group_name, func.count())
        .where(dl.c.state == lit(DL_NEEDS_ATTENTION))
        .group_by(dl.c.group_name)
    )
    return {str(g): int(n) for g, n in rows}


def recent_streams(conn: Connection, tables: Tables, sample: int = 200) -> list[str]:
    """The streams named by the latest published rows' receipts (a bounded read of the
    primary key's end): where the consumer groups whose lag the overview shows read."""
    t = tables.outbox
    latest = select(t.c.stream).order_by(t.c.seq.desc()).limit(sample).subquery()
    rows = conn.execute(select(latest.c.stream).where(latest.c.stream.is_not(None)).distinct())
    return sorted(str(r[0]) for r in rows)


def database_clock(conn: Connection) -> datetime:
    value = conn.execute(select(db_now())).scalar_one()
    assert isinstance(value, datetime)
    return value


def oldest_pending(conn: Connection, tables: Tables) -> dict[str, Any]:
    """The oldest pending row (the head of the pending partial index)."""
    t = tables.outbox
    row = conn.execute(
        select(t.c.event_id, t.c.topic, t.c.created_at, t.c.attempts)
        .where(t.c.state == lit(PENDING))
        .order_by(t.c.seq)
        .limit(1)
    ).first()
    return _row(row) if row is not None else {}


def quarantined_sample(conn: Connection, tables: Tables, limit: int = 10) -> list[dict[str, Any]]:
    t = tables.outbox
    rows = conn.execute(
        select(t.c.seq, t.c.event_id, t.c.topic, t.c.key, t.c.attempts, t.c.last_error)
        .where(t.c.state == lit(QUARANTINED))
        .order_by(t.c.seq.desc())
        .limit(limit)
    )
    return [_row(r) for r in rows]
