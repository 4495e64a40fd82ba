"""The hot claims cost what the batch costs, whatever the planner statistics say.

Issue 10: on a never-analyzed outbox table the relay's claim read the whole backlog per
batch (a bitmap scan of every pending row, the blocked-key probe for each, then a sort), so
draining a backlog cost O(backlog^2). These tests run the real statements (``PG_CLAIM`` of
the relay, ``pg_claim_batch`` of the job store) under EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
on 100,000 pending rows with no statistics at all and with stale ones (ANALYZE while the
table was empty), and assert on what the plan read (rows and buffers), never on time.

The rows are inserted with one INSERT ... SELECT generate_series (seconds, not minutes);
``python -m bench relay --backlog N --stats none,stale,fresh`` drains such a backlog written
through the public API and prints the rates.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from consumer.jobs import queries as job_queries
from consumer.jobs.schema import create_schema as create_job_schema
from outbox.db import make_engine
from outbox.maintenance import psycopg_connector
from outbox.schema import build_schema, create_schema
from relay.store import PG_CLAIM, PG_PUBLISHED

ROWS = 100_000
BATCH = 500
JOB_BATCH = 100
KEYS = 1000
PARTITIONS = 16


@pytest.fixture
def conn(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    engine = make_engine(pg_url)
    create_schema(engine, build_schema())
    create_job_schema(engine)
    connection = psycopg_connector(engine)()
    try:
        yield connection
    finally:
        connection.close()
        engine.dispose()


def _fill_outbox(conn: psycopg.Connection[Any], stats: str) -> None:
    if stats == "stale":
        conn.execute("ANALYZE outbox_events")
    conn.execute(
        """INSERT INTO outbox_events (event_id, topic, key, key_hash, tenant, identity, payload)
        SELECT 'e-' || g, 'plan.t' || (g %% 4), 'key-' || (g %% %(keys)s),
               hashtext('key-' || (g %% %(keys)s))::bigint & 2147483647, 'plan', 'id-' || g,
               jsonb_build_object('n', g, 'pad', repeat('p', 120))
        FROM generate_series(1, %(n)s) g""",
        {"n": ROWS, "keys": KEYS},
    )
    if stats == "published":
        # Statistics taken while every row was published (a relay keeping up), then a
        # backlog of pending rows: the planner believes almost no row is pending.
        conn.execute("UPDATE outbox_events SET state = 'published'")
        conn.execute("ANALYZE outbox_events")
        conn.execute("UPDATE outbox_events SET state = 'pending'")
        # The point is the statistics, not the dead tuples of the two updates: VACUUM (it
        # leaves pg_statistic as it is) so that buffers count live rows.
        conn.execute("VACUUM outbox_events")
    # One failing row blocks its key: the claim must skip that key's later rows.
    conn.execute(
        "UPDATE outbox_events SET attempts = 1, available_at = now() + interval '1 hour' "
        "WHERE seq = (SELECT min(seq) FROM outbox_events WHERE key = 'key-7')"
    )


def _explain(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN ANALYZE the statement in a transaction rolled back afterwards."""
    with conn.transaction(force_rollback=True):
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
    assert row is not None
    plan = row[0][0]
    assert isinstance(plan, dict)
    return plan


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def rows_read(plan: dict[str, Any], table: str) -> int:
    """Rows the plan's scans of ``table`` produced or filtered away, over all their loops."""
    total = 0
    for node in _nodes(plan["Plan"]):
        if node.get("Relation Name") != table or node["Node Type"] == "ModifyTable":
            continue
        per_loop = (
            node.get("Actual Rows", 0)
            + node.get("Rows Removed by Filter", 0)
            + node.get("Rows Removed by Index Recheck", 0)
        )
        total += per_loop * node.get("Actual Loops", 1)
    return int(total)


def buffers(plan: dict[str, Any]) -> int:
    top = plan["Plan"]
    return int(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))


def _describe(plan: dict[str, Any]) -> str:
    return ", ".join(
        f"{n['Node Type']}({n.get('Relation Name', '')} rows={n.get('Actual Rows')}"
        f"x{n.get('Actual Loops')})"
        for n in _nodes(plan["Plan"])
    )


@pytest.mark.parametrize("stats", ["none", "stale", "published"])
def test_relay_claim_reads_a_batch_not_the_backlog(
    conn: psycopg.Connection[Any], stats: str
) -> None:
    _fill_outbox(conn, stats)
    sql = PG_CLAIM.replace("{t}", '"outbox_events"')
    params = {
        "floor": 0,
        "nparts": PARTITIONS,
        "parts": list(range(PARTITIONS)),
        "limit": BATCH,
        "owner": "plan-test",
        "epoch": 1,
    }
    plan = _explain(conn, sql, params)
    assert plan["Plan"]["Actual Rows"] == BATCH, _describe(plan)
    # A few batches' worth: the chunks read a batch or two of pending rows, the lock and
    # the update fetch the claimed rows once more each. The unshaped statement read all
    # 100,000 (and 209,000 buffers).
    read = rows_read(plan, "outbox_events")
    assert read <= 5 * BATCH, f"read {read} rows: {_describe(plan)}"
    assert buffers(plan) <= 25 * BATCH, f"{buffers(plan)} buffers: {_describe(plan)}"

    # Same statement for real: the batch is the first BATCH rows in seq order, less the
    # blocked key's rows after its failing one.
    rows = conn.execute(sql, params).fetchall()
    seqs = [int(r[0]) for r in rows]
    failing = conn.execute(
        "SELECT seq FROM outbox_events WHERE key = 'key-7' AND attempts > 0"
    ).fetchone()
    assert failing is not None
    expected = [
        int(r[0])
        for r in conn.execute(
            "SELECT seq FROM outbox_events o WHERE NOT (o.key = 'key-7' AND o.seq >= %s) "
            "ORDER BY seq LIMIT %s",
            (failing[0], BATCH),
        )
    ]
    assert sorted(seqs) == expected


@pytest.mark.parametrize("stats", ["none", "stale"])
def test_relay_receipts_read_the_batch_not_the_backlog(
    conn: psycopg.Connection[Any], stats: str
) -> None:
    _fill_outbox(conn, stats)
    seqs = [
        int(r[0])
        for r in conn.execute(
            "UPDATE outbox_events SET claimed_by = 'plan-test', claim_epoch = 1 "
            "WHERE seq IN (SELECT seq FROM outbox_events ORDER BY seq LIMIT %s) RETURNING seq",
            (BATCH,),
        )
    ]
    params = {
        "seqs": ",".join(map(str, seqs)),
        "sids": ",".join(f"1-{i}" for i in range(len(seqs))),
        "sidxs": ",".join("1" for _ in seqs),
        "streams": ["plan.stream"],
        "owner": "plan-test",
        "epoch": 1,
    }
    plan = _explain(conn, PG_PUBLISHED.replace("{t}", '"outbox_events"'), params)
    read = rows_read(plan, "outbox_events")
    assert read <= 2 * BATCH, f"read {read} rows: {_describe(plan)}"
    assert buffers(plan) <= 25 * BATCH, f"{buffers(plan)} buffers: {_describe(plan)}"


def _fill_jobs(conn: psycopg.Connection[Any], stats: str, tenants: int) -> None:
    if stats == "stale":
        conn.execute("ANALYZE outbox_jobs")
    conn.execute(
        """INSERT INTO outbox_jobs (tenant, action, kind, payload, state, created_at, updated_at)
        SELECT 'tenant-' || (g %% %(tenants)s), 'action-' || g, 'plan', '{}'::jsonb, 'READY',
               extract(epoch FROM now()), extract(epoch FROM now())
        FROM generate_series(1, %(n)s) g""",
        {"n": ROWS, "tenants": tenants},
    )


@pytest.mark.parametrize("tenants", [1, 10])
@pytest.mark.parametrize("stats", ["none", "stale"])
def test_jobs_claim_reads_a_batch_not_the_backlog(
    conn: psycopg.Connection[Any], stats: str, tenants: int
) -> None:
    _fill_jobs(conn, stats, tenants)
    statement = job_queries.pg_claim_batch(False)
    compiled = statement.compile(dialect=sa.dialects.postgresql.psycopg.dialect())  # type: ignore[attr-defined]
    params = {"cursor": "", "max_tenants": 64, "limit": JOB_BATCH, "worker": "w", "ttl": 30.0}
    sql = compiled.string
    positional = {name: params[name] for name in compiled.params}
    plan = _explain(conn, sql, positional)
    assert plan["Plan"]["Actual Rows"] == JOB_BATCH, _describe(plan)
    read = rows_read(plan, "outbox_jobs")
    # The tenant scan probes the index once per tenant (twice around the wrap), each share
    # reads its rows, the update fetches them again.
    assert read <= 3 * JOB_BATCH + 4 * tenants, f"read {read} rows: {_describe(plan)}"
    assert buffers(plan) <= 25 * JOB_BATCH, f"{buffers(plan)} buffers: {_describe(plan)}"
