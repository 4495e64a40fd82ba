"""Retention (issue 25): finished jobs with their history, gone workers' rows, dead letters,
and the safety rule that no retention setting makes a second effect possible.

Real PostgreSQL and SQLite (``db_url``), real Redis. "Time passes" by moving every stored
timestamp back (``age``), so the purges run their real statements against the database
clock, with no sleeps."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from consumer import Consumer, Store, Worker
from consumer.consumer import ConsumerConfig, ConsumerTx
from consumer.event import ConsumedEvent
from consumer.jobs.retention import JobRetention, JobRetentionConfig, job_retention_duty
from consumer.jobs.schema import operations
from consumer.jobs.worker import WorkerConfig
from consumer.retention import DeadLetterRetention
from outbox import Outbox
from outbox.dialect import db_now
from outbox.errors import ConfigError
from outbox.retention import (
    DEFAULT_DEAD_LETTER_RETENTION,
    DEFAULT_INBOX_WINDOW,
    DEFAULT_OUTBOX_RETENTION,
    DEFAULT_STREAM_RETENTION,
    RetentionDuty,
    count_due,
    purge_all,
)
from relay import RedisStreamPublisher, Relay, RelayConfig
from relay.republish import republish

TOPIC = "quote.approved"


# -- the windows and the safety rule ---------------------------------------------------------


def test_the_declared_windows_are_the_other_processes_defaults() -> None:
    from consumer.consumer import DEFAULT_RETENTION_SECONDS as inbox_default
    from relay.config import DEFAULT_RETENTION_SECONDS as outbox_default
    from relay.redis.publisher import DEFAULT_STREAM_RETENTION as stream_default

    assert inbox_default == DEFAULT_INBOX_WINDOW
    assert outbox_default == DEFAULT_OUTBOX_RETENTION
    assert stream_default == DEFAULT_STREAM_RETENTION
    assert ConsumerConfig().dead_letter_retention_seconds == DEFAULT_DEAD_LETTER_RETENTION
    config = JobRetentionConfig()  # the defaults keep the rule
    assert config.job_retention_seconds >= config.shortest_safe_retention()
    assert WorkerConfig().retention == config  # on by default in every worker


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"job_retention_seconds": 3600.0}, "inbox window"),
        (
            {"job_retention_seconds": 100.0, "inbox_window_seconds": 50.0},
            "republished event would create its job again",
        ),
        ({"outbox_retention_seconds": 0.0}, "outbox_retention_seconds is 0"),
        ({"inbox_window_seconds": 0.0}, "inbox_window_seconds is 0"),
        ({"job_retention_seconds": -1.0}, "non-negative"),
        ({"purge_batch": 0}, "positive"),
        ({"purge_batch": 100_001}, "at most 100000"),
    ],
)
def test_settings_that_would_allow_a_second_job_are_refused(
    options: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        JobRetentionConfig(**options)
    assert says in str(raised.value)
    field = raised.value.setting
    assert field in ("job_retention_seconds", "purge_batch")


def test_windows_that_keep_the_rule_are_accepted() -> None:
    short = JobRetentionConfig(
        job_retention_seconds=130.0,
        inbox_window_seconds=50.0,
        outbox_retention_seconds=100.0,
        stream_retention_seconds=60.0,
        redelivery_margin_seconds=30.0,
    )
    assert short.shortest_safe_retention() == 130.0
    assert JobRetentionConfig(job_retention_seconds=0.0, outbox_retention_seconds=0.0)
    with pytest.raises(ConfigError):
        WorkerConfig(retention="7 days")  # type: ignore[arg-type]


# -- helpers ---------------------------------------------------------------------------------


def age(engine: sa.Engine, seconds: float) -> None:
    """Time passes: every stored timestamp moves ``seconds`` into the past."""
    pg = engine.dialect.name == "postgresql"
    mysql = engine.dialect.name in ("mysql", "mariadb")

    def ts(col: str) -> str:
        if pg:
            return f"{col} = {col} - make_interval(secs => {seconds})"
        if mysql:
            return f"{col} = {col} - INTERVAL {int(seconds * 1e6)} MICROSECOND"
        return f"{col} = strftime('%Y-%m-%d %H:%M:%f', {col}, '-{seconds} seconds')"

    statements = [
        f"UPDATE outbox_events SET {ts('created_at')}, {ts('published_at')}",
        f"UPDATE consumer_inbox SET {ts('processed_at')}",
        f"UPDATE consumer_dead_letters SET {ts('created_at')}, {ts('replayed_at')}",
        f"UPDATE outbox_jobs SET created_at = created_at - {seconds}, "
        f"updated_at = updated_at - {seconds}",
        f"UPDATE outbox_job_attempts SET at = at - {seconds}",
        f"UPDATE outbox_operations SET updated_at = updated_at - {seconds}",
        f"UPDATE outbox_workers SET alive_until = alive_until - {seconds}",
    ]
    with engine.begin() as conn:
        names = set(sa.inspect(conn).get_table_names())
        for statement in statements:
            if statement.split()[1] in names:
                conn.execute(sa.text(statement))


def count(engine: sa.Engine, table: str, where: str = "1 = 1") -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table} WHERE {where}")).scalar())


def finish_all(store: Store) -> int:
    done = 0
    while leases := store.claim_batch("worker-a", 50, 30):
        done += len(store.finish_batch(leases).done)
    return done


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def add_operation(store: Store, job_id: int, state: str) -> None:
    with store.driver.begin() as conn:
        conn.execute(
            sa.insert(operations).values(
                operation_id=f"op-{job_id}-{state}",
                job_id=job_id,
                provider="mail",
                request_digest="d" * 64,
                state=state,
                attempts=1,
                created_at=0.0,
                updated_at=0.0,
            )
        )


# -- finished jobs ---------------------------------------------------------------------------


def test_finished_jobs_go_with_their_attempts_and_receipts_and_nothing_else(store: Store) -> None:
    engine = store.engine
    ids = {a: store.enqueue("studio", a).job_id for a in ("done", "open", "ready", "cancel")}
    store.enqueue("studio", "leased")
    for lease in store.claim_batch("worker-a", 10, 30):
        if lease.action in ("done", "open"):
            store.finish(lease)
        elif lease.action == "cancel":
            store.cancel(lease, reason="not wanted")
        elif lease.action == "ready":
            store.release(lease)
    add_operation(store, ids["done"], "ACCEPTED")
    add_operation(store, ids["open"], "UNKNOWN")  # an unsettled effect keeps its job
    retention = JobRetention(store, JobRetentionConfig())
    week = JobRetentionConfig().job_retention_seconds

    assert retention.count_finished() == 0  # nothing is old yet
    assert retention.purge_finished(1000) == 0
    age(engine, week + 60)
    assert retention.count_finished() == 2
    assert count_due(retention.targets())["outbox_jobs"] == 2
    assert purge_all(retention.targets(), batch=1)["outbox_jobs"] == 2  # one per statement

    with engine.connect() as conn:
        actions = {r[0] for r in conn.execute(sa.text("SELECT action FROM outbox_jobs"))}
        history = {
            r[0] for r in conn.execute(sa.text("SELECT DISTINCT job_id FROM outbox_job_attempts"))
        }
        receipts = {r[0] for r in conn.execute(sa.text("SELECT job_id FROM outbox_operations"))}
    assert actions == {"open", "ready", "leased"}
    assert ids["done"] not in history and ids["cancel"] not in history
    assert ids["open"] in history
    assert receipts == {ids["open"]}
    assert retention.count_finished() == 0


def test_a_purge_is_bounded_by_its_batch(store: Store) -> None:
    store.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(25)])
    assert finish_all(store) == 25
    retention = JobRetention(store, JobRetentionConfig())
    age(store.engine, JobRetentionConfig().job_retention_seconds + 1)
    assert retention.purge_finished(10) == 10
    assert retention.purge_finished(10) == 10
    assert retention.purge_finished(10) == 5
    assert count(store.engine, "outbox_jobs") == 0


def test_gone_workers_liveness_rows_go_unless_they_hold_a_lease(store: Store) -> None:
    store.worker_alive("gone", 3)
    store.worker_alive("gone-with-lease", 3)
    store.worker_alive("alive", 3)
    store.enqueue("t", "held")
    assert store.claim_batch("gone-with-lease", 1, 10**6)
    age(store.engine, 2 * 3600)
    store.worker_alive("alive", 3)  # it beats again
    retention = JobRetention(store)
    assert retention.count_gone_workers() == 1
    assert retention.purge_gone_workers(1000) == 1
    with store.engine.connect() as conn:
        names = {r[0] for r in conn.execute(sa.text("SELECT name FROM outbox_workers"))}
    assert names == {"gone-with-lease", "alive"}


def test_the_worker_runs_its_retention_duty_in_the_background(store: Store) -> None:
    store.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(3)])
    assert finish_all(store) == 3
    age(store.engine, 9 * 24 * 3600)
    worker = Worker(store, retention=JobRetentionConfig(purge_interval=0.01))
    duty = worker.retention
    assert isinstance(duty, RetentionDuty) and duty.name == "job retention"
    assert worker.run_once() == 0  # the first round comes one interval after start...
    duty._next = 0.0  # ...which has passed
    worker.run_once()
    duty.join(10)
    assert duty.total_deleted["outbox_jobs"] == 3
    assert count(store.engine, "outbox_jobs") == 0


def test_a_duty_comes_back_at_once_when_behind_and_survives_a_failure() -> None:
    class Target:
        table = "t"

        def __init__(self) -> None:
            self.rows = 5
            self.fail = False

        def due(self) -> int:
            return self.rows

        def purge(self, limit: int) -> int:
            if self.fail:
                raise RuntimeError("database down")
            gone = min(limit, self.rows)
            self.rows -= gone
            return gone

    now = [0.0]
    target = Target()
    duty = RetentionDuty("test", [target], interval=10.0, batch=2, clock=lambda: now[0])
    assert duty.maybe_run() is None  # not due before one interval
    now[0] = 10.0
    assert duty.maybe_run() == {"t": 2}
    assert duty.maybe_run() == {"t": 2}  # a full batch: due again at once
    assert duty.maybe_run() == {"t": 1}
    assert duty.maybe_run() is None  # caught up: the next round one interval later
    target.fail = True
    now[0] = 30.0
    assert duty.maybe_run() is None and duty.failures == 1


# -- dead letters ----------------------------------------------------------------------------


def test_replayed_dead_letters_go_after_their_retention_others_stay(outbox_db_url: str) -> None:
    consumer = Consumer(outbox_db_url, "redis://127.0.0.1:6379/0", group="g", topics=[TOPIC])
    consumer.create_schema()
    inbox = consumer.inbox
    table = inbox.tables.dead_letters
    with inbox.engine.begin() as conn:
        for n, state in enumerate(["needs_attention", "replayed", "replayed"]):
            conn.execute(
                sa.insert(table).values(
                    group_name="g",
                    stream="s",
                    entry_id=f"1-{n}",
                    reason="poison",
                    error="E",
                    deliveries=5,
                    payload="{}",
                    state=state,
                    dead_letter_stream="s.dead-letter",
                    replayed_at=db_now() if state == "replayed" else None,
                )
            )
    retention = DeadLetterRetention(inbox)
    assert retention.due() == 0
    age(inbox.engine, DEFAULT_DEAD_LETTER_RETENTION + 60)
    assert retention.due() == 2
    assert retention.purge(1) == 1 and retention.purge(1000) == 1
    assert count(inbox.engine, "consumer_dead_letters") == 1
    assert count(inbox.engine, "consumer_dead_letters", "state = 'needs_attention'") == 1
    assert consumer.retention.targets  # the consumer steps it from its maintenance
    consumer.engine.dispose()


# -- the safety rule, end to end -------------------------------------------------------------


def test_a_republished_event_creates_no_second_job_at_any_point_of_the_windows(
    db_url: str, redis_url: str, redis_client: redis.Redis, stream_prefix: str
) -> None:
    """Outbox retention 100 s, inbox window 50 s, margin 30 s: jobs are kept 130 s. At every
    point of that timeline a republish of the event creates no second job; the same steps
    with the job purged before its safe retention do (the rule is what protects it)."""
    windows = JobRetentionConfig(
        job_retention_seconds=130.0,
        inbox_window_seconds=50.0,
        outbox_retention_seconds=100.0,
        stream_retention_seconds=60.0,
        redelivery_margin_seconds=30.0,
    )
    outbox = Outbox(db_url)
    outbox.create_schema()
    publisher = RedisStreamPublisher(redis_client, f"{stream_prefix}.{{topic}}")
    relay = Relay(outbox, publisher, RelayConfig(retention_seconds=100.0))
    store = Store(outbox.engine)
    consumer = Consumer(
        outbox.engine,
        redis_url,
        group="billing",
        topics=[TOPIC],
        stream=f"{stream_prefix}.{{topic}}",
        config=ConsumerConfig(inbox_retention_seconds=50.0, block_ms=50),
    )
    created: list[bool] = []

    @consumer.handler(TOPIC)
    def on_quote(event: ConsumedEvent, tx: ConsumerTx) -> None:
        result = store.enqueue(event.tenant or "", f"send-{event.subject}", session=tx.session)
        created.append(not result.duplicate)

    retention = JobRetention(store, windows)

    def deliver() -> None:
        while relay.run_once():
            pass
        while consumer.run_once(block=False):
            pass

    def purge_everything() -> None:
        consumer.purge_inbox()
        relay.delete_expired()
        purge_all(retention.targets())

    def again() -> int:
        republished = republish(relay.store, publisher, from_seq=0).republished
        while consumer.run_once(block=False):
            pass
        return republished

    with outbox.transaction() as tx:
        tx.emit(TOPIC, key="quote-017", payload={"total": 120}, tenant="studio")
    deliver()
    assert created == [True]
    assert finish_all(store) == 1
    jobs = "outbox_jobs"

    age(outbox.engine, 80)  # past the inbox window, within the outbox's and the jobs'
    purge_everything()
    assert count(outbox.engine, "consumer_inbox") == 0
    assert count(outbox.engine, "outbox_events") == 1
    assert again() == 1
    assert created == [True, False]  # the job row caught it
    assert count(outbox.engine, jobs) == 1

    age(outbox.engine, 60)  # 140 s: past every window
    purge_everything()
    assert count(outbox.engine, "outbox_events") == 0
    assert count(outbox.engine, jobs) == 0
    assert again() == 0  # nothing left to republish: no copy can come
    assert created == [True, False]

    # The same, with the job purged before its safe retention (the rule bypassed):
    with outbox.transaction() as tx:
        tx.emit(TOPIC, key="quote-018", payload={"total": 7}, tenant="studio")
    deliver()
    assert finish_all(store) == 1
    age(outbox.engine, 80)
    purge_everything()
    with store.engine.connect() as conn:
        clock = float(conn.execute(sa.text("SELECT max(updated_at) FROM outbox_jobs")).scalar())
    assert retention.purge_finished(1000, now=clock + 131) == 1  # as if kept only 80 s
    again()
    assert created[-1] is True  # a second job: what the refused settings would allow
    consumer.engine.dispose()
    store.dispose()


def test_a_job_retention_duty_is_built_from_the_config(store: Store) -> None:
    duty = job_retention_duty(store, JobRetentionConfig(purge_interval=0.0))
    assert duty.maybe_run() is None  # interval 0: never runs
    off = job_retention_duty(
        store,
        JobRetentionConfig(
            job_retention_seconds=0.0,
            worker_grace_seconds=0.0,
            audit_retention_seconds=0.0,
            early_retention_seconds=0.0,
        ),
    )
    assert off.targets == []


# -- PostgreSQL: the purge is an index range, whatever the statistics say --------------------


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


@pytest.mark.parametrize("stats", ["none", "fresh"])
@pytest.mark.slow  # 60,000 jobs loaded for EXPLAIN ANALYZE (~12 s each at load 3)
def test_the_job_purge_reads_its_batch_not_the_table(pg_url: str, stats: str) -> None:
    from consumer.jobs.retention import PG_JOB_PURGE
    from outbox.maintenance import psycopg_connector

    store = Store(pg_url)
    conn = psycopg_connector(store.engine)()
    try:
        # 60,000 jobs: 20,000 DONE long ago, the rest READY; two attempts and one receipt
        # per job. Planner statistics: none at all, or fresh.
        conn.execute(
            """INSERT INTO outbox_jobs (tenant, action, state, created_at, updated_at)
            SELECT 't' || (g % 50), 'a-' || g, CASE WHEN g <= 20000 THEN 'DONE' ELSE 'READY'
                   END, 0, CASE WHEN g <= 20000 THEN 1000 + g ELSE 10 END
            FROM generate_series(1, 60000) g"""
        )
        conn.execute(
            """INSERT INTO outbox_job_attempts (job_id, outcome, at)
            SELECT id, 'done', 0 FROM outbox_jobs, generate_series(1, 2)"""
        )
        conn.execute(
            """INSERT INTO outbox_operations (operation_id, job_id, provider, request_digest,
                   state, created_at, updated_at)
            SELECT 'op-' || id, id, 'mail', 'd', 'ACCEPTED', 0, 0 FROM outbox_jobs"""
        )
        conn.execute(  # a reply per job and a delivery callback per receipt (issue 38)
            """INSERT INTO outbox_job_replies (job_id, seq, reply_id, received_at)
            SELECT id, 1, 'r', 0 FROM outbox_jobs"""
        )
        conn.execute(
            """INSERT INTO outbox_deliveries (event_id, operation_id, status, received_at)
            SELECT 'e-' || id, 'op-' || id, 'delivered', 0 FROM outbox_jobs"""
        )
        if stats == "fresh":
            conn.execute(
                "ANALYZE outbox_jobs, outbox_job_attempts, outbox_operations,"
                " outbox_job_replies, outbox_deliveries"
            )
        sql = PG_JOB_PURGE.replace(":cutoff", "%(cutoff)s").replace(":limit", "%(limit)s")
        with conn.transaction(force_rollback=True):
            row = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + sql, {"cutoff": 1e9, "limit": 1000}
            ).fetchone()
        assert row is not None
        plan = row[0][0]
        nodes = list(_plan_nodes(plan["Plan"]))
        described = [
            (
                n["Node Type"],
                n.get("Relation Name"),
                n.get("Index Name"),
                n.get("Actual Rows"),
                n.get("Actual Loops"),
                n.get("Rows Removed by Filter"),
            )
            for n in nodes
        ]
        assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], described
        read = sum(
            (n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0))
            * n.get("Actual Loops", 1)
            for n in nodes
            if n.get("Relation Name") == "outbox_jobs" and n["Node Type"] != "ModifyTable"
        )
        assert read <= 3000, "\n".join(map(str, described))  # the batch, not 60,000 rows
        assert any(n.get("Index Name") == "ix_outbox_jobs_finished" for n in nodes), described
    finally:
        conn.close()
        store.dispose()


# -- the purge commands ----------------------------------------------------------------------


def test_outbox_worker_purge_dry_run_then_purge(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from consumer.jobs.cli import main

    store.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(5)])
    assert finish_all(store) == 5
    store.worker_alive("gone", 1)
    age(store.engine, 8 * 24 * 3600)
    assert main(["purge", "--database-url", db_url, "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] is True
    assert out["tables"]["outbox_jobs"] == 5
    assert out["tables"]["outbox_job_attempts"] == 5  # one "done" row per job
    assert out["tables"]["outbox_workers"] == 1
    assert count(store.engine, "outbox_jobs") == 5  # a dry run deletes nothing
    assert main(["purge", "--database-url", db_url, "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"^outbox_jobs +5 deleted$", captured.out, re.M)  # aligned columns
    assert "outbox-worker: outbox_jobs: 5 deleted, done" in captured.err  # progress
    assert count(store.engine, "outbox_jobs") == 0
    assert count(store.engine, "outbox_job_attempts") == 0
    # Windows that would let a republished event create a job again: bad usage.
    assert main(["purge", "--database-url", db_url, "--job-retention", "3600"]) == 2
    assert "inbox window" in capsys.readouterr().err


def test_outbox_relay_purge_dry_run_then_purge(
    outbox_db_url: str,
    redis_client: redis.Redis,
    stream_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    db_url = outbox_db_url

    from relay.cli import main

    outbox = Outbox(db_url)
    outbox.create_schema()
    with outbox.transaction() as tx:
        for n in range(3):
            tx.emit(TOPIC, key=f"k-{n}", payload={"n": n})
    relay = Relay(outbox, RedisStreamPublisher(redis_client, f"{stream_prefix}.{{topic}}"))
    while relay.run_once():
        pass
    with outbox.transaction() as tx:
        tx.emit(TOPIC, key="pending", payload={})  # never deleted: not published
    age(outbox.engine, 2 * 24 * 3600)
    assert main(["purge", "--database-url", db_url, "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "dry_run": True,
        "tables": {"outbox_events": 3},
    }
    assert main(["purge", "--database-url", db_url, "--retention", "86400"]) == 0
    assert "outbox_events  3 deleted" in capsys.readouterr().out
    assert count(outbox.engine, "outbox_events") == 1
    assert main(["purge", "--database-url", db_url, "--retention", "-1"]) == 2
    outbox.engine.dispose()


def test_the_job_store_refuses_a_mysql_url(mysql_url: str) -> None:
    """The job store stays on PostgreSQL and SQLite (issue 58): a MySQL URL is a typed error
    naming the setting, the database and the URL, before anything is created."""
    with pytest.raises(ConfigError) as caught:
        Store(mysql_url)
    assert caught.value.setting == "database_url"
    message = str(caught.value)
    assert "PostgreSQL or SQLite" in message and "mysql" in message
    assert mysql_url.rsplit("/", 1)[1] in message  # the database named
    engine = sa.create_engine(mysql_url)
    try:
        assert sa.inspect(engine).get_table_names() == []  # nothing created
    finally:
        engine.dispose()


# -- the console's audit ---------------------------------------------------------------------


def test_the_consoles_audit_rows_go_after_their_retention(store: Store) -> None:
    from outbox.console.schema import audit, create_audit_table
    from outbox.retention import DEFAULT_AUDIT_RETENTION, AuditRetention

    target = AuditRetention(store.engine)
    assert target.due() == 0 and target.purge(10) == 0  # no console table: nothing to do
    create_audit_table(store.engine)
    with store.engine.begin() as conn:
        for n, at in enumerate([0.0, 1.0, 9e12]):  # two long ago, one in the future
            conn.execute(
                sa.insert(audit).values(
                    at=at,
                    actor="op",
                    via="api",
                    action="requeue",
                    target_kind="event",
                    target_id=str(n),
                    reason="r",
                    outcome="ok",
                )
            )
    assert target.due() == 2
    retention = JobRetention(store)
    assert any(isinstance(t, AuditRetention) for t in retention.targets())  # the worker's duty
    assert purge_all(retention.targets(), batch=1)["outbox_audit"] == 2
    assert count(store.engine, "outbox_audit") == 1
    assert JobRetentionConfig().audit_retention_seconds == DEFAULT_AUDIT_RETENTION


# -- sizes -----------------------------------------------------------------------------------


def test_table_stats_show_rows_sizes_and_the_oldest_rows_age(store: Store, db_url: str) -> None:
    from outbox.tablestats import DEFAULT_WINDOWS, table_stats

    outbox = Outbox(store.engine)
    outbox.create_schema()
    with outbox.transaction() as tx:
        tx.emit(TOPIC, key="k", payload={})
    store.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(4)])
    assert finish_all(store) == 4
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_events SET state = 'published', published_at = created_at")
        )
    age(store.engine, 3600)
    with store.engine.connect() as conn:
        stats = {s.table: s for s in table_stats(conn)}
    assert set(stats) >= {"outbox_events", "outbox_jobs", "outbox_job_attempts"}
    assert "consumer_inbox" not in stats  # absent tables are left out
    jobs = stats["outbox_jobs"]
    assert jobs.retention_seconds == DEFAULT_WINDOWS["outbox_jobs"]
    assert jobs.oldest_age_seconds is not None and 3500 < jobs.oldest_age_seconds < 3700
    events = stats["outbox_events"]
    assert events.oldest_age_seconds is not None and 3500 < events.oldest_age_seconds < 3700
    if store.engine.dialect.name == "postgresql":
        assert jobs.table_bytes and jobs.index_bytes  # from the catalog
        assert jobs.dead_rows is not None
    else:
        assert jobs.rows == 4  # counted
    assert jobs.as_dict()["oldest_age_seconds"] == round(jobs.oldest_age_seconds, 3)


def test_status_and_metrics_show_each_tables_size_and_age(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from metrics.collector import DatabaseCollector
    from relay.cli import main

    outbox = Outbox(db_url)
    outbox.create_schema()
    store = Store(outbox.engine)
    with outbox.transaction() as tx:
        tx.emit(TOPIC, key="k", payload={})
    store.enqueue("t", "a")
    assert finish_all(store) == 1
    age(outbox.engine, 600)
    assert main(["status", "--database-url", db_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pending"] == 1 and "topics" in report  # the keys scripts rely on stay
    jobs = report["tables"]["outbox_jobs"]
    assert jobs["rows"] >= 0 and jobs["retention_seconds"] == 7 * 24 * 3600
    assert 550 < jobs["oldest_age_seconds"] < 700
    assert report["tables"]["outbox_events"]["oldest_age_seconds"] is None  # none published
    assert main(["status", "--database-url", db_url]) == 0
    assert "outbox_job_attempts" in capsys.readouterr().out

    families = {m.name: m for m in DatabaseCollector(outbox.engine).collect()}
    ages = {
        s.labels["table"]: s.value for s in families["outbox_table_oldest_row_age_seconds"].samples
    }
    assert 550 < ages["outbox_jobs"] < 700
    windows = {
        s.labels["table"]: s.value for s in families["outbox_table_retention_seconds"].samples
    }
    assert windows["outbox_events"] == 24 * 3600
    assert {s.labels["table"] for s in families["outbox_table_rows"].samples} >= {
        "outbox_events",
        "outbox_jobs",
    }
    assert "outbox_table_index_bytes" in families
    store.dispose()
