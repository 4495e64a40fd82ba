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
from consumer.jobs.upgrades import create_schema as create_job_schema
from outbox import status
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


def indexes(plan: dict[str, Any], table: str) -> set[str]:
    """The indexes the plan's scans of ``table`` use."""
    return {
        node["Index Name"]
        for node in _nodes(plan["Plan"])
        if node.get("Relation Name") == table and "Index Name" in node
    }


def buffers(plan: dict[str, Any]) -> int:
    top = plan["Plan"]
    return int(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))


def _describe(plan: dict[str, Any]) -> str:
    return ", ".join(
        f"{n['Node Type']}({n.get('Relation Name', '')} {n.get('Index Name', '')} "
        f"rows={n.get('Actual Rows')}"
        f"x{n.get('Actual Loops')})"
        for n in _nodes(plan["Plan"])
    )


@pytest.mark.parametrize("stats", ["none", "stale", "published"])
@pytest.mark.slow  # 100,000 rows loaded for EXPLAIN ANALYZE (7-22 s under load)
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


@pytest.mark.parametrize("analyze", [False, True])
def test_relay_claim_of_a_few_rows_reads_them_not_the_published_history(
    conn: psycopg.Connection[Any], analyze: bool
) -> None:
    """Issue 25: a relay keeping up claims a few dozen rows per cycle from a table of
    published rows. The update took the picked rows through a hash join the planner costs
    at a few hundred of them, so on a table of some thousands of rows it read every row,
    published ones included, per claim (O(table) per cycle)."""
    conn.execute(
        """INSERT INTO outbox_events (event_id, topic, key, key_hash, tenant, identity, payload,
                                      state, published_at)
        SELECT 'e-' || g, 'plan.t', 'key-' || (g %% %(keys)s),
               hashtext('key-' || (g %% %(keys)s))::bigint & 2147483647, 'plan', 'id-' || g,
               '{}'::jsonb, CASE WHEN g > %(n)s - 20 THEN 'pending' ELSE 'published' END,
               CASE WHEN g > %(n)s - 20 THEN NULL ELSE now() END
        FROM generate_series(1, %(n)s) g""",
        {"n": 20_000, "keys": KEYS},
    )
    if analyze:
        conn.execute("ANALYZE outbox_events")
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
    assert plan["Plan"]["Actual Rows"] == 20, _describe(plan)
    read = rows_read(plan, "outbox_events")
    assert read <= 5 * 20, f"read {read} rows: {_describe(plan)}"


@pytest.mark.parametrize("analyze", [False, True])
def test_the_backlog_statements_read_the_pending_rows_not_the_published_history(
    conn: psycopg.Connection[Any], analyze: bool
) -> None:
    """Issue 25: `status` and the metrics group the backlog by topic through the pending
    index (the table has no (topic, created_at) index, which every writer paid for): on
    20,000 published rows and 200 pending ones they read the 200, with or without ANALYZE."""
    conn.execute(
        """INSERT INTO outbox_events (event_id, topic, key, key_hash, tenant, identity, payload,
                                      state, published_at)
        SELECT 'e-' || g, 'plan.t' || (g %% 3), 'key-' || g, g, 'plan', 'id-' || g,
               '{}'::jsonb, CASE WHEN g > %(n)s - 200 THEN 'pending' ELSE 'published' END,
               CASE WHEN g > %(n)s - 200 THEN NULL ELSE now() END
        FROM generate_series(1, %(n)s) g""",
        {"n": 20_000},
    )
    if analyze:
        conn.execute("ANALYZE outbox_events")
    table = '"outbox_events"'
    for statement in (status.backlog_by_topic(table), status.pending_attempts(table)):
        plan = _explain(conn, str(statement), {})
        read = rows_read(plan, "outbox_events")
        assert read <= 200, f"read {read} rows: {_describe(plan)}"
    rows = conn.execute(str(status.backlog_by_topic(table))).fetchall()
    assert sorted((topic, n) for topic, n, _ in rows) == [
        ("plan.t0", 66),
        ("plan.t1", 67),
        ("plan.t2", 67),
    ]


@pytest.mark.parametrize("stats", ["none", "stale"])
@pytest.mark.slow  # 100,000 rows loaded for EXPLAIN ANALYZE (~6 s under load)
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
@pytest.mark.slow  # 100,000 rows loaded for EXPLAIN ANALYZE (4-5 s under load)
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


def _compiled(statement: Any, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    compiled = statement.compile(dialect=sa.dialects.postgresql.psycopg.dialect())  # type: ignore[attr-defined]
    return compiled.string, {name: params[name] for name in compiled.params}


@pytest.mark.parametrize("stats", ["none", "stale", "fresh"])
@pytest.mark.slow  # 100,000 rows loaded for EXPLAIN ANALYZE (12-27 s under load)
def test_jobs_claim_with_queues_routes_and_a_tenant_limit_reads_a_batch(
    conn: psycopg.Connection[Any], stats: str
) -> None:
    """Issue 27: the claim of a worker of queue "mine" with its handler routes and a tenant
    limit reads its batch, not the 100,000 READY rows of another queue, nor the rows of its
    own queue that it has no handler for (they sort after its jobs here)."""
    if stats == "stale":
        conn.execute("ANALYZE outbox_jobs")
    conn.execute(
        """INSERT INTO outbox_jobs (queue, tenant, action, kind, payload, state, created_at,
                                    updated_at)
        SELECT 'other', 'tenant-' || (g %% 10), 'other-' || g, 'plan', '{}'::jsonb, 'READY',
               extract(epoch FROM now()), extract(epoch FROM now())
        FROM generate_series(1, %(n)s) g""",
        {"n": ROWS},
    )
    conn.execute(
        """INSERT INTO outbox_jobs (queue, tenant, action, kind, payload, state, created_at,
                                    updated_at)
        SELECT 'mine', 'tenant-' || (g %% 10), 'mine-' || g,
               CASE WHEN g <= %(n)s / 2 THEN 'plan' ELSE 'nobody' END, '{}'::jsonb, 'READY',
               extract(epoch FROM now()), extract(epoch FROM now())
        FROM generate_series(1, %(n)s) g""",
        {"n": ROWS},
    )
    if stats == "fresh":
        conn.execute("ANALYZE outbox_jobs")
    statement = job_queries.pg_claim_batch(False, all_queues=False, routed=True, limited=True)
    params = {
        "cursor": "",
        "max_tenants": 64,
        "limit": JOB_BATCH,
        "worker": "w",
        "ttl": 30.0,
        "queues": '["mine"]',
        "route_names": ["plan"],
        "route_patterns": job_queries.route_patterns(("plan",)),
        "tenant_limit": 1000,
        "tenant_limits": '{"tenant-3": 2}',
    }
    sql, positional = _compiled(statement, params)
    plan = _explain(conn, sql, positional)
    if stats == "fresh":
        # Fresh statistics of 200,000 rows cost the claim past jit_above_cost: JIT would
        # compile for ~270 ms per claim. The driver turns it off for the claim's transaction.
        assert "JIT" in plan, "the server no longer JIT-compiles this plan: drop the setting"
        with conn.transaction(force_rollback=True):
            conn.execute(job_queries.PG_CLAIM_SETTINGS)
            plan = _explain(conn, sql, positional)
    assert "JIT" not in plan, plan["JIT"]
    # Ten tenants: shares of 10; tenant-3 is held to 2 and leaves the rest of its share unused
    # for this claim (as a tenant with fewer eligible jobs does).
    expected = 9 * (JOB_BATCH // 10) + 2
    assert plan["Plan"]["Actual Rows"] == expected, _describe(plan)
    read = rows_read(plan, "outbox_jobs")
    assert read <= 3 * JOB_BATCH + 4 * 10 + 20, f"read {read} rows: {_describe(plan)}"
    assert buffers(plan) <= 25 * JOB_BATCH, f"{buffers(plan)} buffers: {_describe(plan)}"
    # For real: only queue "mine", only kind "plan", at most 2 of tenant-3.
    rows = conn.execute(sql, positional).fetchall()
    assert len(rows) == expected
    picked = conn.execute(
        "SELECT queue, kind, tenant, count(*) FROM outbox_jobs WHERE state = 'LEASED' "
        "GROUP BY queue, kind, tenant"
    ).fetchall()
    assert {(q, k) for q, k, _, _ in picked} == {("mine", "plan")}
    assert dict((t, n) for _, _, t, n in picked)["tenant-3"] == 2


def _fill_history(conn: psycopg.Connection[Any], stats: str) -> int:
    """1,000,000 DONE jobs (the history) and 1,500 READY ones in three queues."""
    if stats == "stale":
        conn.execute("ANALYZE outbox_jobs")
    conn.execute(
        """INSERT INTO outbox_jobs (queue, tenant, action, state, created_at, updated_at)
        SELECT 'q' || (g % 3), 't' || (g % 50), 'done-' || g, 'DONE',
               extract(epoch FROM now()) - 86400, extract(epoch FROM now()) - 86400
        FROM generate_series(1, 1000000) g"""
    )
    conn.execute(
        """INSERT INTO outbox_jobs (queue, tenant, action, state, created_at, updated_at)
        SELECT 'q' || (g % 3), 't' || (g % 50), 'ready-' || g, 'READY',
               extract(epoch FROM now()) - g, extract(epoch FROM now()) - g
        FROM generate_series(1, 1500) g"""
    )
    return 1500


@pytest.mark.slow
@pytest.mark.parametrize("stats", ["none", "stale"])
def test_depth_reads_the_ready_jobs_not_the_history(
    conn: psycopg.Connection[Any], stats: str
) -> None:
    """Issue 27: ``Store.depth`` (and the per-queue gauges) on 1,000,000 DONE rows reads the
    1,500 READY ones through ix_outbox_jobs_ready, whatever the statistics: O(ready)."""
    from metrics.queries import ready_jobs_per_queue

    ready = _fill_history(conn, stats)
    for sql in (
        job_queries.depth("postgresql", False).text,
        str(ready_jobs_per_queue("outbox_jobs", "postgresql")),
    ):
        plan = _explain(conn, sql, {})
        read = rows_read(plan, "outbox_jobs")
        assert read <= ready, f"read {read} rows: {_describe(plan)}"
        assert buffers(plan) <= 2_000, f"{buffers(plan)} buffers: {_describe(plan)}"
        assert plan["Execution Time"] < 1000  # milliseconds; the scan of 1M rows is ~10x that
    one = _explain(conn, *_compiled(job_queries.depth("postgresql", True), {"queue": "q1"}))
    assert rows_read(one, "outbox_jobs") <= ready / 3 + 1, _describe(one)
    rows = conn.execute(job_queries.depth("postgresql", False).text).fetchall()
    assert [(q, n) for q, n, _ in rows] == [("q0", 500), ("q1", 500), ("q2", 500)]
    assert all(age >= 1400 for _, _, age in rows)  # the oldest READY job of each queue


def test_claims_and_finishes_are_one_round_trip_on_the_stores_engine(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's own engine turns JIT off once per session, so a claim is one statement
    that commits on its own: no SET LOCAL, no BEGIN, no COMMIT (issue 44); so are a finish of
    one worker's leases and an enqueue outside the caller's transaction. A store on the
    user's engine leaves the user's sessions alone and claims in a transaction that turns
    JIT off for itself."""
    from psycopg import _connection_base

    from consumer.jobs.store import Store

    commands: list[bytes] = []
    exec_command = _connection_base.BaseConnection._exec_command

    def spy(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        commands.append(bytes(command) if isinstance(command, bytes) else str(command).encode())
        return exec_command(self, command, *args, **kwargs)

    own = Store(pg_url)
    user_engine = make_engine(pg_url)
    users = Store(user_engine)
    sent: list[str] = []
    for engine in (own.engine, user_engine):
        sa.event.listen(
            engine, "before_cursor_execute", lambda c, cur, stmt, *rest: sent.append(stmt)
        )
    try:
        own.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(3)])
        with own.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW jit").scalar() == "off"
        monkeypatch.setattr(_connection_base.BaseConnection, "_exec_command", spy)
        leases = own.claim_batch("w", 3)
        assert own.finish_batch(leases).done == sorted(lease.job_id for lease in leases)
        assert own.enqueue("t", "b").duplicate is False
        assert own.enqueue("t", "b").duplicate is True  # found after its insert skipped it
        assert commands == [] and job_queries.PG_CLAIM_SETTINGS not in sent
        with user_engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW jit").scalar() == "on"
        commands.clear()
        users.claim_batch("w", 1)
        assert job_queries.PG_CLAIM_SETTINGS in sent
        assert commands[0] == b"BEGIN" and b"COMMIT" in commands
    finally:
        monkeypatch.undo()
        own.dispose()
        users.dispose()
        user_engine.dispose()


def _churned(conn: psycopg.Connection[Any]) -> list[tuple[int, int]]:
    """20,000 jobs of which 15 are LEASED now, after all of them were LEASED once and
    finished, with statistics from before (no LEASED row) and no vacuum since: every
    partial index on LEASED rows holds 20,000 entries of finished jobs. The 15 leases."""
    _fill_jobs(conn, "none", 4)
    conn.execute("DELETE FROM outbox_jobs WHERE id > 20000")
    conn.execute("ANALYZE outbox_jobs")  # fresh statistics: no LEASED row at all
    conn.execute(
        "UPDATE outbox_jobs SET state = 'LEASED', lease_owner = 'w', lease_epoch = 1, "
        "lease_expires_at = 0 WHERE id <= 20000"
    )
    conn.execute("UPDATE outbox_jobs SET state = 'DONE', lease_owner = NULL WHERE id <= 20000")
    leases = conn.execute(
        "UPDATE outbox_jobs SET state = 'LEASED', lease_owner = 'w', lease_epoch = 2, "
        "lease_expires_at = 1e12 WHERE id > 19985 RETURNING id, lease_epoch"
    ).fetchall()
    assert len(leases) == 15
    return [(int(job_id), int(epoch)) for job_id, epoch in leases]


@pytest.mark.slow  # 20,000 jobs leased and finished by hand for EXPLAIN ANALYZE (~2 s)
def test_the_batch_finish_reads_its_leases_by_key_after_churn(
    conn: psycopg.Connection[Any],
) -> None:
    """Every job passes through LEASED, so between two vacuums the partial indexes on LEASED
    rows fill with entries of jobs already finished, which the statistics (a handful of
    LEASED rows) do not show. The batch finish must find its leases by primary key, not by
    a scan of those entries (issue 44: 58,000 walked per finish 20 s after a vacuum under a
    held backlog, 11 ms a finish of 15, the worker's rate halved until autovacuum came)."""
    leases = _churned(conn)
    params = {
        "ids": ",".join(str(job_id) for job_id, _ in leases),
        "epochs": ",".join(str(epoch) for _, epoch in leases),
        "worker": "w",
    }
    plan = _explain(conn, *_compiled(job_queries.pg_finish_batch(False), params))
    assert plan["Plan"]["Actual Rows"] == 15, _describe(plan)
    read = rows_read(plan, "outbox_jobs")
    assert indexes(plan, "outbox_jobs") == {"outbox_jobs_pkey"}, _describe(plan)
    assert read <= 2 * len(leases), f"read {read} rows: {_describe(plan)}"
    assert buffers(plan) <= 40 * len(leases), f"{buffers(plan)} buffers: {_describe(plan)}"


@pytest.mark.slow  # 20,000 jobs leased and finished by hand for EXPLAIN ANALYZE (~2 s)
def test_a_claim_that_finishes_reads_its_leases_by_key_after_churn(
    conn: psycopg.Connection[Any],
) -> None:
    """The claim that also writes its slots' finishes (``pg_claim_batch(finishing=True)``,
    the worker's default path): the finish's part finds the 15 leases by primary key after
    the same churn, never through the LEASED indexes' dead entries."""
    leases = _churned(conn)
    conn.execute(
        "INSERT INTO outbox_jobs (tenant, action, created_at, updated_at) "
        "SELECT 't', 'next-' || g, 0, 0 FROM generate_series(1, 15) g"
    )
    params = {
        "ids": ",".join(str(job_id) for job_id, _ in leases),
        "epochs": ",".join(str(epoch) for _, epoch in leases),
        "worker": "w",
        "cursor": "",
        "max_tenants": 100,
        "limit": 15,
        "ttl": 30.0,
    }
    statement = job_queries.pg_claim_batch(False, finishing=True)
    # The first scan after the churn marks the dead index entries it meets (any statement
    # pays that once), and later scans still prune a little as they pass, so every
    # statement's buffers are its fewest over three runs after a first one.
    _explain(conn, *_compiled(statement, params))
    plan = min((_explain(conn, *_compiled(statement, params)) for _ in range(3)), key=buffers)
    assert plan["Plan"]["Actual Rows"] == 30, _describe(plan)  # 15 finished, 15 claimed
    used = indexes(plan, "outbox_jobs")
    assert "outbox_jobs_pkey" in used, _describe(plan)
    assert not used & {"ix_outbox_jobs_leased", "ix_outbox_jobs_leased_tenant"}, _describe(plan)
    # No dearer than the claim and the finish apart (the READY index's dead entries of the
    # churn are the claim's own cost, which the worker's catch-up vacuum bounds).
    apart = 0
    for alone in (job_queries.pg_claim_batch(False), job_queries.pg_finish_batch(False)):
        apart += min(buffers(_explain(conn, *_compiled(alone, params))) for _ in range(3))
    # 40 buffers and 5% of slack: a page pruned during one run and not another moves the
    # count by a few dozen (1,625 against 1,577 apart on a loaded CI run), while reading the
    # LEASED indexes' 20,000 dead entries would add hundreds.
    assert buffers(plan) <= apart * 1.05 + 40, f"{buffers(plan)} buffers, {apart} apart"


@pytest.mark.slow  # 20,000 jobs leased and finished by hand for EXPLAIN ANALYZE (~2 s)
def test_the_heartbeats_renewal_reads_its_leases_by_key_after_churn(
    conn: psycopg.Connection[Any], pg_url: str
) -> None:
    """The heartbeat's batch renewal, the same churn as the finish's test: by primary key
    (before, an index scan of ix_outbox_jobs_leased_tenant: 528 buffers here, 1,494 in a
    probe where it had not been scanned since the churn)."""
    from consumer.jobs.store import Store

    leases = _churned(conn)
    conn.commit()
    store = Store(pg_url)
    sent: list[tuple[str, Any]] = []

    def capture(_c: Any, _cur: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE"):
            sent.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", capture)
    try:
        with store.engine.connect() as sa_conn, sa_conn.begin() as transaction:
            renewed, _ = store.driver.job_renew_batch(sa_conn, "w", leases, 2e12, 0.0)
            transaction.rollback()
    finally:
        store.dispose()
    assert sorted(renewed) == sorted(job_id for job_id, _ in leases)
    [(statement, parameters)] = sent
    plan = _explain(conn, statement, parameters)
    assert plan["Plan"]["Actual Rows"] == 15, _describe(plan)
    read = rows_read(plan, "outbox_jobs")
    assert indexes(plan, "outbox_jobs") == {"outbox_jobs_pkey"}, _describe(plan)
    assert read <= 2 * len(leases), f"read {read} rows: {_describe(plan)}"
    assert buffers(plan) <= 40 * len(leases), f"{buffers(plan)} buffers: {_describe(plan)}"
