"""Order keys cost the claim nothing and the finish a few probes, whatever the planner
statistics say (issue 56): the claim with 1,000 order keys over 100,000 finished jobs of those
keys is the same one indexed statement as without keys (a key's later jobs are HELD, which the
READY index never holds), and the batch finish that promotes each finished head's next job
reads by key, never the keys' history. EXPLAIN (ANALYZE, BUFFERS) on the real statements, with
no statistics and with stale ones (autovacuum is not trusted here), asserting on what the plan
read, never on time (``tests/test_query_plans.py`` has the method)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from consumer.jobs import queries as job_queries
from consumer.jobs.upgrades import create_schema as create_job_schema
from outbox.db import make_engine
from outbox.maintenance import psycopg_connector
from tests.test_query_plans import _compiled, _describe, _explain, buffers, indexes, rows_read

FINISHED = 100_000
KEYS = 1_000
HELD_PER_KEY = 3
TENANTS = 10
BATCH = 100
FINISHING = 15


@pytest.fixture
def conn(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    engine = make_engine(pg_url)
    create_job_schema(engine)
    connection = psycopg_connector(engine)()
    connection.autocommit = True
    try:
        yield connection
    finally:
        connection.close()
        engine.dispose()


def _fill(conn: psycopg.Connection[Any], stats: str) -> None:
    """100,000 DONE jobs over 1,000 order keys, then each key's line: a READY head and three
    HELD jobs behind it; the key table names the heads."""
    if stats == "stale":
        conn.execute("ANALYZE outbox_jobs")
        conn.execute("ANALYZE outbox_order_keys")
    conn.execute(
        """INSERT INTO outbox_jobs (tenant, action, kind, state, order_key, created_at,
                                    updated_at)
        SELECT 't' || (g %% %(tenants)s), 'done-' || g, 'plan', 'DONE', 'key-' || (g %% %(keys)s),
               0, 0
        FROM generate_series(1, %(n)s) g""",
        {"n": FINISHED, "keys": KEYS, "tenants": TENANTS},
    )
    conn.execute(
        """INSERT INTO outbox_jobs (tenant, action, kind, state, order_key, created_at,
                                    updated_at)
        SELECT 't' || (k %% %(tenants)s), 'line-' || k || '-' || p, 'plan',
               CASE WHEN p = 0 THEN 'READY' ELSE 'HELD' END, 'key-' || k, 1, 1
        FROM generate_series(0, %(keys)s - 1) k, generate_series(0, %(held)s) p
        ORDER BY p, k""",
        {"keys": KEYS, "held": HELD_PER_KEY, "tenants": TENANTS},
    )
    conn.execute(
        """INSERT INTO outbox_order_keys (order_key, head_id, updated_at)
        SELECT order_key, id, 1 FROM outbox_jobs WHERE state = 'READY'"""
    )


@pytest.mark.parametrize("stats", ["none", "stale"])
def test_the_claim_with_order_keys_is_one_indexed_statement(
    conn: psycopg.Connection[Any], stats: str
) -> None:
    _fill(conn, stats)
    params = {"cursor": "", "max_tenants": 64, "limit": BATCH, "worker": "w", "ttl": 30.0}
    plan = _explain(conn, *_compiled(job_queries.pg_claim_batch(False), params))
    assert plan["Plan"]["Actual Rows"] == BATCH, _describe(plan)
    assert indexes(plan, "outbox_jobs") <= {"ix_outbox_jobs_ready", "outbox_jobs_pkey"}
    read = rows_read(plan, "outbox_jobs")
    assert read <= 3 * BATCH + 4 * TENANTS, f"read {read} rows: {_describe(plan)}"
    assert buffers(plan) <= 25 * BATCH, f"{buffers(plan)} buffers: {_describe(plan)}"
    # For real: the heads only, one per key.
    rows = conn.execute(*_compiled(job_queries.pg_claim_batch(False), params)).fetchall()
    assert len(rows) == BATCH
    leased = conn.execute(
        "SELECT count(*), count(DISTINCT order_key), min(action) FROM outbox_jobs"
        " WHERE state = 'LEASED'"
    ).fetchone()
    assert leased is not None and leased[0] == leased[1] == BATCH
    assert str(leased[2]).endswith("-0")


@pytest.mark.parametrize("stats", ["none", "stale"])
def test_the_finish_promotes_by_key_not_through_the_history(
    conn: psycopg.Connection[Any], stats: str
) -> None:
    _fill(conn, stats)
    leases = conn.execute(
        """UPDATE outbox_jobs SET state = 'LEASED', lease_owner = 'w', lease_epoch = 1,
                                  lease_expires_at = 1e12
        WHERE id IN (SELECT head_id FROM outbox_order_keys ORDER BY order_key LIMIT %(n)s)
        RETURNING id, lease_epoch""",
        {"n": FINISHING},
    ).fetchall()
    params = {
        "ids": ",".join(str(job_id) for job_id, _ in leases),
        "epochs": ",".join(str(epoch) for _, epoch in leases),
        "worker": "w",
    }
    # The session's first call plans the function's statements (catalog reads, once per
    # session): measured after it.
    _explain(conn, *_compiled(job_queries.pg_finish_batch(False), params))
    plan = _explain(conn, *_compiled(job_queries.pg_finish_batch(False), params))
    assert plan["Plan"]["Actual Rows"] == FINISHING, _describe(plan)
    # The promotion's own statements (in the function) count in the plan's buffers: per
    # finished head, the next job's move (as dear as the finish's own: a row and its index
    # entries), the key's row and a few probes by key (measured: 1,078 buffers for 15, 285
    # without keys), never the 100 finished jobs of its key (a walk of them would add
    # ~1,500). Compared with the finish of as many jobs without a key, on the same table.
    plain = conn.execute(
        """INSERT INTO outbox_jobs (tenant, action, state, lease_owner, lease_epoch,
                                    lease_expires_at, created_at, updated_at)
        SELECT 't', 'plain-' || g, 'LEASED', 'w', 1, 1e12, 1, 1
        FROM generate_series(1, %(n)s) g RETURNING id, lease_epoch""",
        {"n": FINISHING},
    ).fetchall()
    unkeyed = {
        "ids": ",".join(str(job_id) for job_id, _ in plain),
        "epochs": ",".join(str(epoch) for _, epoch in plain),
        "worker": "w",
    }
    _explain(conn, *_compiled(job_queries.pg_finish_batch(False), unkeyed))
    alone = buffers(_explain(conn, *_compiled(job_queries.pg_finish_batch(False), unkeyed)))
    keyed = buffers(plan)
    assert keyed <= 5 * alone, f"{keyed} buffers, {alone} without keys: {_describe(plan)}"
    # The promotion's pick as the function plans it (a generic plan: the key is a
    # parameter), on the partial index of HELD rows.
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute(
        "PREPARE pick(text) AS SELECT id FROM outbox_jobs"
        " WHERE order_key = $1 AND state = 'HELD' ORDER BY id LIMIT 1"
    )
    pick = _explain(conn, "EXECUTE pick('key-7')", {})
    assert indexes(pick, "outbox_jobs") == {"ix_outbox_jobs_order_held"}, _describe(pick)
    assert rows_read(pick, "outbox_jobs") <= 1, _describe(pick)
    # For real: each finished head's next job is READY and its key's head.
    conn.execute(*_compiled(job_queries.pg_finish_batch(False), params))
    promoted = conn.execute(
        """SELECT count(*) FROM outbox_order_keys k JOIN outbox_jobs j ON j.id = k.head_id
        WHERE j.state = 'READY' AND j.action LIKE '%%-1'"""
    ).fetchone()
    assert promoted is not None and promoted[0] == FINISHING
