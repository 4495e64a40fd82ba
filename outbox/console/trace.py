"""One business identity's story, from the outbox row to the receipt, and its verdict.

A query is an identity, an event key, an event id, a job id or an operation id. The trace
finds every record it names, then follows the links between the parts:

- outbox rows: by ``event_id`` (unique), ``identity`` and ``key`` (lookup indexes);
- the stream entry of each published row: ``XRANGE stream id id`` in Redis;
- inbox rows: per consumer group, by the rows' identities (the inbox's primary key is
  (group, identity): the groups are found by a loose index scan, then one probe each);
- dead letters of those identities or event ids;
- jobs: by id, and the jobs a consumer made for these events. Nothing in the tables links a
  job to the event that created it, so the trace follows the conventions of the README and
  DESIGN: a handler enqueues with ``subject=event.subject`` (the event key) in the event's
  tenant, or names the action after the identity (``identity = "tenant:action"`` or
  ``action = identity``);
- each job's history (``outbox_job_attempts``), timer, replies (``outbox_job_replies``), a
  cancel request, and operation intents and receipts with their delivery callbacks
  (``outbox_deliveries``);
- the audit rows of every record found.

The **verdict** answers "was it sent?" in words, receipts first (the receipt decides before
the job's state: an UNKNOWN receipt on a job in WAITING_REVIEW reads ``unknown``):

1. ``not found``: no record at all;
2. ``unknown``: a receipt UNKNOWN, or PENDING past its call deadline;
3. ``sent``: an ACCEPTED receipt; ``sent, bounced`` when a delivery callback said it bounced,
   ``sent, delivered`` when one said it was delivered (or opened, or complained of). A
   CANCELLED job with an ACCEPTED receipt reads ``sent`` too, and says so: a cancel cannot
   recall an effect whose intent was written before it;
4. ``not sent``: a receipt NOT_SENT or FAILED;
5. ``in progress``: a receipt PENDING within its deadline (the call may be in flight);
6. then the jobs: WAITING_REVIEW or NEEDS_ATTENTION ``needs review``; WAITING_EXTERNAL,
   WAITING_PARENTS, HELD (behind an earlier job of its order key), or a job with a timer or
   a ``run_after`` in the future, ``waiting``; READY or LEASED ``in progress``; every job
   CANCELLED ``not sent``; DONE (no receipt recorded: the handler finished) ``sent``;
7. no job: a dead letter ``needs review``; an outbox row pending or quarantined
   ``not published yet``; published (in the stream, no job yet) ``in progress``.

Before all of them, an **identity collision**: the inbox dedups by (group, identity), so an
event whose identity a group already recorded for *another* event is dropped as a duplicate
of it and never handled. When every event the trace found is such a one (its identity in a
group's inbox under another event id of the same topic, its own event id in none), the
verdict is ``dropped
as a duplicate``, naming the group and the event that took the identity: the jobs and
receipts found through the identity are that other event's. When only some are, the
verdict is the others', and the reason says which were dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import or_, select, text, tuple_
from sqlalchemy.engine import Connection

from consumer.jobs.schema import attempts, deliveries, job_steps, jobs, operations, replies
from outbox.codec import text_fields
from outbox.console.queries import TRACE_LIMIT, Tables, jsonable
from outbox.console.schema import audit
from outbox.console.trace_cap import capped_fields, capped_select, uncapped
from outbox.console.trace_pages import Window
from outbox.dialect import db_epoch
from outbox.logs import fields
from outbox.validate import INT64_MAX, int_problem

log = logging.getLogger("outbox.console")

SENT = "sent"
SENT_DELIVERED = "sent, delivered"
SENT_BOUNCED = "sent, bounced"
UNKNOWN = "unknown"
IN_PROGRESS = "in progress"
WAITING = "waiting"
NEEDS_REVIEW = "needs review"
NOT_SENT = "not sent"
NOT_PUBLISHED = "not published yet"
NOT_FOUND = "not found"
DUPLICATE = "dropped as a duplicate"
VERDICTS = (
    *(SENT, SENT_DELIVERED, SENT_BOUNCED, UNKNOWN, IN_PROGRESS, WAITING, NEEDS_REVIEW),
    *(NOT_SENT, NOT_PUBLISHED, NOT_FOUND, DUPLICATE),
)
_DELIVERY_RANK = {"delivered": 1, "opened": 2, "complained": 3, "bounced": 4}


@dataclass
class Trace:
    """What a trace found, and its verdict with the sentence that explains it."""

    query: str
    verdict: str = NOT_FOUND
    because: str = "nothing in the outbox, the inbox, the jobs or the receipts matches"
    events: list[dict[str, Any]] = field(default_factory=list)
    stream_entries: list[dict[str, Any]] = field(default_factory=list)
    inbox: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    receipts: list[dict[str, Any]] = field(default_factory=list)
    deliveries: list[dict[str, Any]] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    clock: float = 0.0
    window: Window = field(default_factory=Window)
    tables: Tables | None = field(default=None, repr=False)
    jobs_here: bool = field(default=True, repr=False)
    """Whether the database has the job store's tables (not on MySQL/MariaDB)."""

    @property
    def found(self) -> bool:
        return self.verdict != NOT_FOUND

    def as_dict(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "verdict": self.verdict,
            "because": self.because,
            "events": self.events,
            "stream_entries": self.stream_entries,
            "inbox": self.inbox,
            "dead_letters": self.dead_letters,
            "jobs": self.jobs,
            "receipts": self.receipts,
            "deliveries": self.deliveries,
            "audit": self.audit,
            "next_cursor": self.window.next_cursor,
        }

    def rows(self, result: Iterable[Any], table: Any) -> list[dict[str, Any]]:
        """``result`` of a :func:`capped_select` of ``table`` as JSON-able rows."""
        assert self.tables is not None
        return uncapped(result, table, self.tables)


def _rows(result: Iterable[Any]) -> list[dict[str, Any]]:
    return [{k: jsonable(v) for k, v in r._mapping.items()} for r in result]


def _add(
    into: list[dict[str, Any]], rows: list[dict[str, Any]], key: str, cap: int | None = TRACE_LIMIT
) -> None:
    """The rows not in ``into`` yet, up to ``cap`` in all (None: each lookup is bounded, and
    the page's window cuts the whole: events and jobs)."""
    seen = {r[key] for r in into}
    for row in rows:
        if row[key] not in seen and (cap is None or len(into) < cap):
            into.append(row)
            seen.add(row[key])


def _groups(conn: Connection, tables: Tables) -> list[str]:
    """The consumer groups in the inbox, by a loose index scan of its primary key (one probe
    per group, however many rows each has)."""
    t = tables.inbox.inbox.name
    sql = text(
        f'WITH RECURSIVE g(name) AS (SELECT min(group_name) FROM "{t}" '
        f'UNION ALL SELECT (SELECT min(group_name) FROM "{t}" WHERE group_name > g.name) '
        "FROM g WHERE g.name IS NOT NULL) SELECT name FROM g WHERE name IS NOT NULL"
    )
    return [str(r[0]) for r in conn.execute(sql)]


def _as_int(q: str) -> int | None:
    digits = q[1:] if q.startswith("#") else q
    # ASCII digits only: isdigit() passes "\u00b2", which int() then refuses (a 500).
    if int_problem(digits, minimum=0, maximum=INT64_MAX) is None:
        return int(digits)
    return None


def collect(
    conn: Connection,
    tables: Tables,
    q: str,
    present: set[str],
    redis: Any = None,
    *,
    window: Window | None = None,
) -> Trace:
    """Find everything ``q`` names and what it links to (see the module docstring): what
    ``q`` names directly, the events of the jobs found so, the inbox rows and dead letters,
    the jobs the events made, the jobs' history and receipts, the stream entries, the audit
    of it all, and the verdict. ``window``: which page of a long flow (events by ``seq``,
    jobs by id; :mod:`outbox.console.trace_pages`); its first by default."""
    trace = Trace(query=q, window=window or Window(), tables=tables)
    trace.clock = float(conn.execute(select(db_epoch())).scalar_one())
    has = present.__contains__
    trace.jobs_here = has(jobs.name)
    _named(conn, tables, q, has, trace)
    if has(tables.outbox.name) and trace.jobs and not trace.events:
        _events_of_jobs(conn, tables, trace)  # a job id or an operation id was asked
    trace.window.cut_events(trace.events)
    _inbox_and_dead_letters(conn, tables, q, has, trace)
    if has(jobs.name) and trace.events:
        _add(trace.jobs, _event_jobs(conn, trace), "id", cap=None)
    trace.window.cut_jobs(trace.jobs)
    if trace.jobs:
        _history_and_receipts(conn, has, trace)
    if trace.jobs and has(job_steps.name):
        _steps(conn, trace)
    if redis is not None:
        trace.stream_entries = stream_entries(redis, trace.events)
    if has(audit.name):
        trace.audit = _audit_of(conn, trace)
    trace.verdict, trace.because = judged(trace)
    return trace


def judged(trace: Trace) -> tuple[str, str]:
    """The verdict: :func:`verdict`, unless every event found was dropped as a duplicate of
    another's identity (:func:`collisions`); the reason names any event dropped."""
    said, because = verdict(trace)
    dropped = collisions(trace)
    if dropped and len(dropped) == len(trace.events):
        return DUPLICATE, dropped[0]
    if dropped:
        because += "; " + "; ".join(dropped)
    return said, because


def collisions(trace: Trace) -> list[str]:
    """Why each event the trace found was dropped as a duplicate of another event with the
    same identity (the module docstring's identity collision), one sentence each."""
    handled = {r["event_id"] for r in trace.inbox}
    said = []
    for event in trace.events:
        if event["event_id"] in handled:
            continue
        taken = [
            r
            for r in trace.inbox
            if r["identity"] == event["identity"]
            and r["event_id"] != event["event_id"]
            and r["topic"] == event["topic"]  # a group reading this topic: it drops this one
        ]
        if taken:
            r = taken[0]
            said.append(
                f"event {event['event_id']} carries identity {event['identity']}, which consumer "
                f"group {r['group_name']} recorded for event {r['event_id']}: it is dropped as a "
                "duplicate of that event and never handled (give each business fact an identity "
                "of its own)"
            )
    return said


def _named(
    conn: Connection, tables: Tables, q: str, has: Callable[[str], bool], trace: Trace
) -> None:
    """The events, receipts and jobs ``q`` names: an event id, identity or key; an
    operation id (and its job); a job id, subject or action."""
    t = tables.outbox
    if has(t.name):
        for column in (t.c.event_id, t.c.identity, t.c.key):
            _add(trace.events, _lookup(conn, trace, t, column, [q], t.c.seq), "event_id", None)
    job_ids: set[int] = set()
    if has(operations.name):
        one = capped_select(operations).where(operations.c.operation_id == q)
        ops = trace.rows(conn.execute(one), operations)
        _add(trace.receipts, ops, "operation_id")
        job_ids.update(int(r["job_id"]) for r in ops)
    if has(jobs.name):
        number = _as_int(q)
        if number is not None:
            job_ids.add(number)
        for column, values in ((jobs.c.id, sorted(job_ids)), (jobs.c.subject, [q])):
            _add(trace.jobs, _lookup(conn, trace, jobs, column, values, jobs.c.id), "id", None)
        _add(trace.jobs, _lookup(conn, trace, jobs, jobs.c.action, [q], jobs.c.id), "id", None)


def _events_of_jobs(conn: Connection, tables: Tables, trace: Trace) -> None:
    """The events of the jobs found directly, by identity and by subject."""
    t = tables.outbox
    subjects = sorted({j["subject"] for j in trace.jobs if j["subject"]})
    actions = {j["action"] for j in trace.jobs}
    names = sorted(actions | {f"{j['tenant']}:{j['action']}" for j in trace.jobs})
    for column, values in ((t.c.identity, names), (t.c.key, subjects)):
        _add(trace.events, _lookup(conn, trace, t, column, values, t.c.seq), "event_id", None)
    trace.events.sort(key=lambda e: int(e["seq"]))


def _inbox_and_dead_letters(
    conn: Connection, tables: Tables, q: str, has: Callable[[str], bool], trace: Trace
) -> None:
    """The inbox rows of the events' identities in every group, and the dead letters of
    those identities or events."""
    identities = {e["identity"] for e in trace.events}
    event_ids = {e["event_id"] for e in trace.events}
    if not trace.events:
        identities.add(q)  # an identity whose outbox row retention removed
    inbox = tables.inbox.inbox
    if has(inbox.name):
        groups = _groups(conn, tables)
        if groups:
            pairs = [(g, i) for g in groups for i in sorted(identities)][: TRACE_LIMIT * 4]
            rows = conn.execute(
                select(inbox)
                .where(tuple_(inbox.c.group_name, inbox.c.identity).in_(pairs))
                .order_by(inbox.c.group_name)
            )
            trace.inbox = _rows(rows)[:TRACE_LIMIT]
            event_ids.update(r["event_id"] for r in trace.inbox)
    dl = tables.inbox.dead_letters
    if has(dl.name):
        match: Any = dl.c.identity.in_(sorted(identities))
        if event_ids:
            match = or_(match, dl.c.event_id.in_(sorted(event_ids)))
        query = capped_select(dl).where(match).order_by(dl.c.id).limit(TRACE_LIMIT)
        trace.dead_letters = trace.rows(conn.execute(query), dl)


def _history_and_receipts(conn: Connection, has: Callable[[str], bool], trace: Trace) -> None:
    """Each job's attempt history (its last TRACE_LIMIT moves, read so: a job retried for
    months has thousands) and the jobs' receipts."""
    ids = sorted(int(j["id"]) for j in trace.jobs)
    for job in trace.jobs:
        job["history"] = []
        if has(attempts.name):
            query = (
                capped_select(attempts)
                .where(attempts.c.job_id == int(job["id"]))
                .order_by(attempts.c.job_id, attempts.c.id.desc())
                .limit(TRACE_LIMIT)
            )
            job["history"] = trace.rows(conn.execute(query), attempts)[::-1]
        job["replies"] = []
    if has(replies.name):
        by_job = {int(j["id"]): j for j in trace.jobs}
        query = (
            capped_select(replies)
            .where(replies.c.job_id.in_(ids))
            .order_by(replies.c.job_id, replies.c.seq)
            .limit(TRACE_LIMIT * 4)
        )
        for row in trace.rows(conn.execute(query), replies):
            kept = by_job[int(row["job_id"])]["replies"]
            if len(kept) < TRACE_LIMIT:
                kept.append(row)
    if has(operations.name):
        receipts = (
            capped_select(operations)
            .where(operations.c.job_id.in_(ids))
            .order_by(operations.c.created_at)
            .limit(TRACE_LIMIT)
        )
        _add(trace.receipts, trace.rows(conn.execute(receipts), operations), "operation_id")
    if has(deliveries.name) and trace.receipts:
        callbacks = (
            capped_select(deliveries)
            .where(deliveries.c.operation_id.in_([r["operation_id"] for r in trace.receipts]))
            .order_by(deliveries.c.operation_id, deliveries.c.received_at)
            .limit(TRACE_LIMIT)
        )
        trace.deliveries = trace.rows(conn.execute(callbacks), deliveries)


def _steps(conn: Connection, trace: Trace) -> None:
    """Each job's parents and children (``after=`` at enqueue: consumer.jobs.steps), each
    with its id, tenant, action and state; its ``result`` is a column of its own row."""
    by_job = {int(j["id"]): j for j in trace.jobs}
    other = jobs.alias("other")
    for mine, theirs, key in (
        (job_steps.c.child_id, job_steps.c.parent_id, "parents"),
        (job_steps.c.parent_id, job_steps.c.child_id, "children"),
    ):
        for job in trace.jobs:
            job[key] = []
        query = (
            select(mine.label("job_id"), other.c.id, other.c.tenant, other.c.action, other.c.state)
            .join(other, other.c.id == theirs)
            .where(mine.in_(sorted(by_job)))
            .order_by(mine, other.c.id)
            .limit(TRACE_LIMIT * 4)
        )
        for row in conn.execute(query):
            step = {"id": int(row.id), "tenant": row.tenant, "action": row.action}
            by_job[int(row.job_id)][key].append({**step, "state": row.state})


def _lookup(
    conn: Connection, trace: Trace, table: Any, column: Any, values: list[Any], then: Any
) -> list[dict[str, Any]]:
    """Rows whose ``column`` is one of ``values``, through that column's index, in the
    trace's window (``then`` past its cursor, one row more than a page: whether more follow).

    One statement per column, ordered by the column itself (then ``then``): with LIMIT and no
    planner statistics (autovacuum off), an OR of several columns, or an order by another
    column, lets PostgreSQL pick a sequential scan that it hopes stops early. Ordered by the
    indexed column, the index scan is the only plan that can stop early, so it is chosen."""
    if not values:
        return []
    where = column == values[0] if len(values) == 1 else column.in_(values)
    query = capped_select(table).where(where)
    query = trace.window.after(query, then).order_by(column, then).limit(trace.window.limit + 1)
    return trace.rows(conn.execute(query), table)


def _event_jobs(conn: Connection, trace: Trace) -> list[dict[str, Any]]:
    """The jobs a consumer made for these events, by the conventions (module docstring)."""
    events = trace.events
    pairs: set[tuple[str, str]] = set()
    plain: set[str] = set()
    keys: dict[str, str | None] = {}
    for event in events:
        identity, tenant, key = event["identity"], event["tenant"], event["key"]
        plain.add(identity)
        prefix, sep, rest = identity.partition(":")
        if sep and rest:
            pairs.add((prefix, rest))
        keys[key] = tenant
    found: list[dict[str, Any]] = []
    _add(found, _lookup(conn, trace, jobs, jobs.c.action, sorted(plain), jobs.c.id), "id", None)
    by_subject = _lookup(conn, trace, jobs, jobs.c.subject, sorted(keys), jobs.c.id)
    same_tenant = [j for j in by_subject if keys[j["subject"]] in (None, j["tenant"])]
    _add(found, same_tenant, "id", None)
    for tenant, action in sorted(pairs):  # the unique (tenant, action) index, one probe each
        one = capped_select(jobs).where(jobs.c.tenant == tenant, jobs.c.action == action)
        row = conn.execute(trace.window.after(one, jobs.c.id)).first()
        if row is not None:
            _add(found, trace.rows([row], jobs), "id", None)
    return sorted(found, key=lambda j: int(j["id"]))


def _audit_of(conn: Connection, trace: Trace) -> list[dict[str, Any]]:
    targets = [("event", e["event_id"]) for e in trace.events]
    targets += [("job", str(j["id"])) for j in trace.jobs]
    targets += [("receipt", r["operation_id"]) for r in trace.receipts]
    targets += [("dead_letter", str(d["id"])) for d in trace.dead_letters]
    if not targets:
        return []
    rows = conn.execute(
        capped_select(audit)
        .where(tuple_(audit.c.target_kind, audit.c.target_id).in_(targets[: TRACE_LIMIT * 4]))
        .order_by(audit.c.id)
        .limit(TRACE_LIMIT)
    )
    return trace.rows(rows, audit)


def stream_entries(redis: Any, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each published row's stream entry, read back from Redis (``XRANGE id id``), with its
    CloudEvents fields (a long one cut to its first VALUE_CHARS characters, its whole size in
    ``capped``: the outbox row's payload is the whole); ``missing`` when the stream no longer
    holds it (trimmed, or a Redis that lost it: ``outbox-relay republish``)."""
    out = []
    for event in events:
        stream, entry_id = event.get("stream"), event.get("stream_id")
        if not stream or not entry_id:
            continue
        item: dict[str, Any] = {"event_id": event["event_id"], "stream": stream, "id": entry_id}
        try:
            found = redis.xrange(stream, min=entry_id, max=entry_id, count=1)
        except Exception as exc:  # Redis down: the page still shows the database's story
            log.warning("stream entry not read", extra=fields(stream=stream, error=repr(exc)))
            item.update(state="unreadable", error=f"{type(exc).__name__}: {exc}", fields={})
        else:
            if found:
                shown, cut = capped_fields(text_fields(found[0][1]))
                item.update(state="present", fields=shown, **({"capped": cut} if cut else {}))
            else:
                item.update(state="missing", fields={})
        out.append(item)
    return out


# complexity: the verdict's rules in the module docstring's order, one branch each
def verdict(trace: Trace) -> tuple[str, str]:
    """The verdict and its reason (the rules are the module docstring's)."""
    if not (trace.events or trace.jobs or trace.receipts or trace.inbox or trace.dead_letters):
        return NOT_FOUND, "nothing in the outbox, the inbox, the jobs or the receipts matches"
    now = trace.clock
    by_state: dict[str, list[dict[str, Any]]] = {}
    for receipt in trace.receipts:
        by_state.setdefault(receipt["state"], []).append(receipt)
    overdue = [
        r
        for r in by_state.get("PENDING", [])
        if r["call_deadline"] is not None and float(r["call_deadline"]) <= now
    ]
    if by_state.get("UNKNOWN") or overdue:
        r = (by_state.get("UNKNOWN") or overdue)[0]
        return UNKNOWN, (
            f"receipt {r['operation_id']} is {r['state']}"
            + (" past its call deadline" if r["state"] == "PENDING" else "")
            + ": the provider may or may not have acted; settle it"
        )
    if by_state.get("ACCEPTED"):
        return _sent(trace, by_state["ACCEPTED"])
    for state in ("NOT_SENT", "FAILED"):
        if by_state.get(state):
            r = by_state[state][0]
            return NOT_SENT, f"receipt {r['operation_id']} is {state}"
    if by_state.get("PENDING"):
        r = by_state["PENDING"][0]
        return IN_PROGRESS, f"receipt {r['operation_id']} is PENDING: a call may be in flight"
    if trace.jobs:
        return _job_verdict(trace.jobs, now)
    if trace.dead_letters and any(d["state"] == "needs_attention" for d in trace.dead_letters):
        d = trace.dead_letters[0]
        return NEEDS_REVIEW, f"consumer group {d['group_name']} dead-lettered it ({d['reason']})"
    unpublished = [e for e in trace.events if e["state"] in ("pending", "quarantined")]
    if unpublished:
        e = unpublished[0]
        return NOT_PUBLISHED, f"outbox event {e['event_id']} is {e['state']}"
    if trace.inbox and not trace.jobs_here:
        return IN_PROGRESS, "consumed; the jobs are not in this database, so the trace ends here"
    if trace.inbox:
        return IN_PROGRESS, "consumed, and no job found for it yet"
    return IN_PROGRESS, "published to its stream; no consumer has made a job for it yet"


def _sent(trace: Trace, accepted: list[dict[str, Any]]) -> tuple[str, str]:
    """``sent``, or with what the provider said later: the furthest delivery callback of an
    ACCEPTED receipt (applied to it, or kept because it came first: the same facts)."""
    r = accepted[0]
    because = f"receipt {r['operation_id']} is ACCEPTED (ref {r['provider_ref']})"
    ids = {x["operation_id"] for x in accepted}
    said = [x.get("delivery_status") for x in accepted]
    said += [d["status"] for d in trace.deliveries if d["operation_id"] in ids]
    furthest = max((s for s in said if s), key=lambda s: _DELIVERY_RANK.get(s, 0), default=None)
    cancelled = [
        j
        for j in trace.jobs
        if j["state"] == "CANCELLED" and int(j["id"]) in {int(x["job_id"]) for x in accepted}
    ]
    if cancelled:
        because += (
            f"; job {cancelled[0]['id']} was cancelled after its intent was written: "
            "a cancel cannot recall the effect"
        )
    if furthest == "bounced":
        return SENT_BOUNCED, because + "; the provider says it bounced"
    if furthest is not None:
        return SENT_DELIVERED, because + f"; the provider says {furthest}"
    return SENT, because


# complexity: the job rules of the verdict, in the module docstring's order
def _job_verdict(found: list[dict[str, Any]], now: float) -> tuple[str, str]:
    def label(job: dict[str, Any]) -> str:
        return f"job {job['id']} ({job['tenant']}/{job['action']}) is {job['state']}"

    for job in found:
        if job["state"] in ("WAITING_REVIEW", "NEEDS_ATTENTION"):
            return NEEDS_REVIEW, label(job)
    for job in found:
        if job["state"] in ("WAITING_EXTERNAL", "WAITING_PARENTS"):  # a reply, a step
            return WAITING, label(job)
        if job["state"] == "HELD":  # issue 56: behind an earlier job of its order key
            return WAITING, label(job) + ", behind an earlier job of its order key"
        future = job["run_after"] is not None and float(job["run_after"]) > now
        if job["state"] == "READY" and (job["timer_scheduled_for"] is not None or future):
            return WAITING, label(job) + " with a timer"
    for job in found:
        if job["state"] in ("READY", "LEASED"):
            if job.get("cancel_requested_at") is not None:
                return IN_PROGRESS, label(job) + ", a cancel was requested: its run ends it"
            return IN_PROGRESS, label(job)
    if all(job["state"] == "CANCELLED" for job in found):
        return NOT_SENT, label(found[0])
    done = next(job for job in found if job["state"] == "DONE")
    return SENT, label(done) + " (no receipt recorded: its handler finished)"
