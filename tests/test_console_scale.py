"""The console's reads on big tables (issue 22: "a table of 10 million rows must answer in
well under a second"): 1 million jobs (and 200,000 events) built by ``INSERT ... SELECT
generate_series`` (bench/console.py's fill), no ANALYZE (the project's servers run without
autovacuum). Every statement a list page, the overview and a trace run is captured and
EXPLAINed: no sequential scan and no sort of a big table, so a page's cost does not grow with
the table. And walking pages by cursor returns the right rows in order.

Timings are the benchmark's (``python -m bench console``), not asserted here."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from bench.console import fill
from outbox.console import queries
from outbox.console.overview import overview
from outbox.console.queries import Tables, encode_cursor, present_tables
from outbox.console.schema import create_lookup_indexes, missing_lookup_indexes
from outbox.console.trace import collect
from outbox.db import make_engine
from outbox.schema import build_schema

pytestmark = pytest.mark.slow

JOBS = 1_000_000
EVENTS = 200_000
BIG = {"outbox_jobs", "outbox_events", "consumer_inbox", "outbox_operations", "outbox_job_attempts"}


@pytest.fixture(scope="module")
def big(pg_admin_engine: sa.Engine) -> Iterator[sa.Engine]:
    # One schema per xdist worker: two workers filling and dropping one fixed name collided.
    schema = f"t_console_scale_{uuid.uuid4().hex[:8]}"
    with pg_admin_engine.connect() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"
    fill(url, EVENTS, JOBS, 20_000)
    engine = make_engine(url)
    create_lookup_indexes(engine)
    assert missing_lookup_indexes(engine) == []
    yield engine
    engine.dispose()
    with pg_admin_engine.connect() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


class Statements:
    """The statements an engine ran, to EXPLAIN them afterwards with the same parameters."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.seen: list[tuple[str, Any]] = []
        sa.event.listen(engine, "before_cursor_execute", self._record)

    def _record(self, conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            self.seen.append((statement, params))

    def close(self) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._record)

    def plans(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        with self.engine.connect() as conn:
            for statement, params in self.seen:
                raw = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement, params).scalar()
                plan = raw if isinstance(raw, list) else json.loads(raw)
                out.append((statement, plan[0]["Plan"]))
        return out


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def assert_bounded(statements: Statements) -> int:
    """No Seq Scan of a big table, no Sort above a scan of one."""
    checked = 0
    for statement, plan in statements.plans():
        for node in _nodes(plan):
            relation = node.get("Relation Name")
            assert not (node["Node Type"] == "Seq Scan" and relation in BIG), (
                statement,
                json.dumps(plan, indent=1),
            )
            # An index walked only for its order, testing every row against a filter, is a
            # scan of the table in disguise, unless the filter is a dense state (published
            # events, DONE jobs: a page of them is met at once).
            if node["Node Type"] in ("Index Scan", "Index Only Scan") and relation in BIG:
                dense = any(s in node.get("Filter", "") for s in ("'published'", "'DONE'"))
                assert "Index Cond" in node or "Filter" not in node or dense, (statement, plan)
            if node["Node Type"] == "Sort":
                sorted_tables = {n.get("Relation Name") for n in _nodes(node)} & BIG
                rows = node.get("Plan Rows", 0)
                assert not sorted_tables or rows <= 1000, (statement, plan)
        checked += 1
    return checked


def test_list_pages_are_index_range_scans_at_any_depth(big: sa.Engine) -> None:
    tables = Tables.build()
    statements = Statements(big)
    try:
        with big.connect() as conn:
            pages = [
                queries.list_jobs(conn),
                queries.list_jobs(conn, cursor=encode_cursor([JOBS // 2])),
                queries.list_jobs(conn, state="CANCELLED", cursor=encode_cursor([900_000])),
                queries.list_jobs(conn, state="DONE", cursor=encode_cursor([10_000])),
                queries.list_jobs(conn, state="WAITING_REVIEW"),
                queries.list_jobs(conn, tenant="tenant-7", cursor=encode_cursor([600_000])),
                queries.list_jobs(conn, action="send-quote-777"),
                queries.list_jobs(conn, state="READY", tenant="tenant-0"),
                queries.list_events(conn, tables, topic="quote.sent"),
                queries.list_events(conn, tables, key="quote-123"),
                queries.list_events(conn, tables, state="quarantined"),
                queries.list_events(conn, tables, state="published", cursor=encode_cursor([5000])),
                queries.list_receipts(conn, state="UNKNOWN"),
                queries.list_receipts(conn, state="ACCEPTED"),
                queries.list_receipts(conn),
                queries.list_dead_letters(conn, tables, group="billing"),
                queries.list_audit(conn),
            ]
    finally:
        statements.close()
    assert assert_bounded(statements) == len(pages)
    jobs_page, deep, cancelled = pages[0], pages[1], pages[2]
    assert [r["id"] for r in jobs_page.rows] == list(range(JOBS, JOBS - 50, -1))
    assert [r["id"] for r in deep.rows] == list(range(JOBS // 2 - 1, JOBS // 2 - 51, -1))
    assert all(r["state"] == "CANCELLED" and r["id"] < 900_000 for r in cancelled.rows)
    assert [r["id"] for r in cancelled.rows][:2] == [899_001, 898_001]
    tenant = pages[5].rows
    assert all(r["tenant"] == "tenant-7" and r["id"] < 600_000 for r in tenant)
    assert [r["id"] for r in tenant] == sorted((r["id"] for r in tenant), reverse=True)
    assert [r["action"] for r in pages[6].rows] == ["send-quote-777"]


def test_walking_a_filtered_list_by_cursor_never_repeats_or_skips(big: sa.Engine) -> None:
    seen: list[int] = []
    cursor = None
    with big.connect() as conn:
        for _ in range(6):
            page = queries.list_jobs(conn, state="CANCELLED", cursor=cursor, limit=100)
            seen += [r["id"] for r in page.rows]
            cursor = page.next_cursor
    assert seen == [g for g in range(JOBS, 0, -1) if g % 1000 == 1 and g % 100 != 0][:600]


def test_overview_and_trace_read_through_indexes(big: sa.Engine) -> None:
    tables = Tables.build()
    present = present_tables(big, tables)
    statements = Statements(big)
    try:
        data = overview(big, tables, build_schema(), None, present)
        with big.connect() as conn:
            sent = collect(conn, tables, "tenant-3:send-quote-1003", present)
            by_key = collect(conn, tables, "quote-1003", present)
            by_job = collect(conn, tables, "1003", present)
            by_op = collect(conn, tables, "1002:email", present)
            missing = collect(conn, tables, "quote-nope", present)
    finally:
        statements.close()
    assert assert_bounded(statements) > 10
    assert data["jobs"]["DONE"] == {"*": queries.TERMINAL_COUNT_CAP + 1}
    assert data["jobs"]["READY"] == {"tenant-0": JOBS // 100}  # g % 100 == 0: tenant g % 50
    assert data["receipts"]["unknown"] == 20
    assert sent.verdict == by_key.verdict == by_job.verdict == "sent"
    assert [e["event_id"] for e in sent.events] == ["ev-1003"]
    assert by_op.verdict == "unknown" and missing.verdict == "not found"
