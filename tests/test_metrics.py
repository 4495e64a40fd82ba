"""The database-derived gauges against rows the tests write (PostgreSQL and SQLite), their
cache and bounds, and the process metrics of :class:`metrics.PrometheusHooks`."""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

import consumer.inbox
import consumer.jobs.schema
import consumer.jobs.upgrades
from metrics import (
    DatabaseCollector,
    PrometheusHooks,
    Source,
    build_metrics,
    queries,
    start_metrics,
    unknown_receipts_source,
)
from metrics.collector import ScrapeContext
from outbox.db import make_engine
from outbox.errors import ConfigError
from outbox.hooks import Hooks
from outbox.schema import OutboxSchema, build_schema, create_schema, db_now

_ids = itertools.count()


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def outbox_schema(engine: sa.Engine) -> OutboxSchema:
    s = build_schema()
    create_schema(engine, s)
    return s


@pytest.fixture
def outbox_only(outbox_db_url: str) -> Iterator[tuple[sa.Engine, OutboxSchema]]:
    """An outbox table alone, on PostgreSQL, SQLite and MariaDB: the outbox gauges read it
    on all three (the job store's gauges stay on the first two)."""
    eng = make_engine(outbox_db_url)
    s = build_schema()
    create_schema(eng, s)
    yield eng, s
    eng.dispose()


def db_clock(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        now = conn.execute(sa.select(db_now())).scalar_one()
    return now if now.tzinfo else now.replace(tzinfo=UTC)


def add_event(
    engine: sa.Engine,
    s: OutboxSchema,
    *,
    topic: str = "orders",
    state: str = "pending",
    attempts: int = 0,
    age: float = 0.0,
    event_id: str | None = None,
) -> str:
    eid = event_id or f"ev-{next(_ids)}"
    created = db_clock(engine) - timedelta(seconds=age)
    with engine.begin() as conn:
        conn.execute(
            s.table.insert().values(
                event_id=eid,
                topic=topic,
                key="k",
                key_hash=1,
                identity=eid,
                payload={},
                state=state,
                attempts=attempts,
                created_at=created,
                available_at=created,
            )
        )
    return eid


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def series(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_outbox_gauges_match_the_rows(outbox_only: tuple[sa.Engine, OutboxSchema]) -> None:
    engine, s = outbox_only
    add_event(engine, s, topic="orders", attempts=0, age=100)
    stuck = add_event(engine, s, topic="orders", attempts=7, age=50)
    retried = add_event(engine, s, topic="orders", attempts=2, age=10)
    flaky = add_event(engine, s, topic="mail", attempts=1, age=30)
    add_event(engine, s, topic="archive", state="published", attempts=3, age=1000)
    add_event(engine, s, topic="orders", state="quarantined", attempts=40, age=500)
    registry = build_metrics(engine=engine, outbox_schema=s).registry

    assert series(registry, "outbox_backlog") == {
        (("topic", "orders"),): 3.0,
        (("topic", "mail"),): 1.0,
    }
    ages = series(registry, "outbox_oldest_unpublished_age_seconds")
    assert set(ages) == {(("topic", "orders"),), (("topic", "mail"),)}
    # Written 100 s and 30 s before the database's now; the scrape follows within seconds.
    assert 100.0 <= ages[(("topic", "orders"),)] < 160.0
    assert 30.0 <= ages[(("topic", "mail"),)] < 90.0
    assert value(registry, "outbox_quarantined") == 1.0
    assert value(registry, "outbox_max_attempts") == 7.0
    assert value(registry, "outbox_pending_attempts_bucket", le="0") == 1.0
    assert value(registry, "outbox_pending_attempts_bucket", le="1") == 2.0
    assert value(registry, "outbox_pending_attempts_bucket", le="2") == 3.0
    assert value(registry, "outbox_pending_attempts_bucket", le="5") == 3.0
    assert value(registry, "outbox_pending_attempts_bucket", le="10") == 4.0
    assert value(registry, "outbox_pending_attempts_bucket", le="+Inf") == 4.0
    assert value(registry, "outbox_pending_attempts_count") == 4.0
    assert value(registry, "outbox_pending_attempts_sum") == 10.0
    # Only pending records that were tried are "stuck"; published and quarantined are not.
    assert series(registry, "outbox_stuck_record_attempts") == {
        (("event_id", stuck), ("topic", "orders")): 7.0,
        (("event_id", retried), ("topic", "orders")): 2.0,
        (("event_id", flaky), ("topic", "mail")): 1.0,
    }
    assert value(registry, "outbox_metrics_source_up", source="outbox") == 1.0


def test_empty_outbox_exports_zeros_not_errors(
    outbox_only: tuple[sa.Engine, OutboxSchema],
) -> None:
    engine, outbox_schema = outbox_only
    registry = build_metrics(engine=engine, outbox_schema=outbox_schema).registry
    assert series(registry, "outbox_backlog") == {}
    assert value(registry, "outbox_quarantined") == 0.0
    assert value(registry, "outbox_max_attempts") == 0.0
    assert value(registry, "outbox_pending_attempts_count") == 0.0
    assert series(registry, "outbox_stuck_record_attempts") == {}


def test_top_n_keeps_the_label_set_bounded(outbox_only: tuple[sa.Engine, OutboxSchema]) -> None:
    engine, outbox_schema = outbox_only
    for attempts in range(1, 31):
        add_event(engine, outbox_schema, topic=f"t{attempts % 3}", attempts=attempts)
    metrics = build_metrics(engine=engine, outbox_schema=outbox_schema, top_n=5, cache_seconds=0)
    stuck = series(metrics.registry, "outbox_stuck_record_attempts")
    assert sorted(stuck.values()) == [26.0, 27.0, 28.0, 29.0, 30.0]
    # More stuck rows do not grow it: still five series, the new worst among them.
    add_event(engine, outbox_schema, topic="t0", attempts=99, event_id="worst")
    stuck = series(metrics.registry, "outbox_stuck_record_attempts")
    assert len(stuck) == 5
    assert stuck[(("event_id", "worst"), ("topic", "t0"))] == 99.0
    assert value(metrics.registry, "outbox_max_attempts") == 99.0


def test_missing_tables_produce_no_series_and_no_error(engine: sa.Engine) -> None:
    metrics = build_metrics(engine=engine, cache_seconds=0, table_recheck_seconds=0)
    assert metrics.collector is not None
    text = metrics.render().decode()
    assert "outbox_backlog" not in text
    assert "outbox_jobs" not in text
    assert "outbox_dead_letters" not in text
    assert 'outbox_metrics_source_up{source="outbox"}' not in text
    # The schema created after the exporter started is found at the next check.
    s = build_schema()
    create_schema(engine, s)
    add_event(engine, s, attempts=3)
    assert value(metrics.registry, "outbox_max_attempts") == 3.0
    assert "outbox_jobs" not in metrics.render().decode()


def test_table_existence_is_checked_once_and_cached(engine: sa.Engine) -> None:
    metrics = build_metrics(engine=engine, cache_seconds=0, table_recheck_seconds=3600)
    assert "outbox_backlog" not in metrics.render().decode()
    create_schema(engine, build_schema())
    # Within the recheck period the exporter keeps its answer: no inspection per scrape.
    assert value(metrics.registry, "outbox_quarantined") is None


def test_two_scrapes_within_the_ttl_query_once(
    engine: sa.Engine, outbox_schema: OutboxSchema
) -> None:
    now = [1000.0]
    collector = DatabaseCollector(engine, outbox_schema, cache_seconds=5, clock=lambda: now[0])
    registry = CollectorRegistry()
    registry.register(collector)
    assert collector.refreshes == 0  # registering does not query
    add_event(engine, outbox_schema)
    assert registry.get_sample_value("outbox_backlog", {"topic": "orders"}) == 1.0
    add_event(engine, outbox_schema)
    now[0] += 4.9
    # Cached: the second scrape sees the first one's values and ran no queries.
    assert registry.get_sample_value("outbox_backlog", {"topic": "orders"}) == 1.0
    assert collector.refreshes == 1
    now[0] += 0.2
    assert registry.get_sample_value("outbox_backlog", {"topic": "orders"}) == 2.0
    assert collector.refreshes == 2
    collector.invalidate()
    registry.get_sample_value("outbox_backlog", {"topic": "orders"})
    assert collector.refreshes == 3


def test_dead_letter_gauges(engine: sa.Engine) -> None:
    inbox = consumer.inbox.build_inbox_schema()
    consumer.inbox.create_inbox_schema(engine, inbox)
    rows: list[dict[str, Any]] = [
        dict(group_name="billing", entry_id="1-0", reason="poison", state="needs_attention"),
        dict(group_name="billing", entry_id="2-0", reason="poison", state="needs_attention"),
        dict(group_name="billing", entry_id="3-0", reason="undecodable", state="needs_attention"),
        dict(group_name="billing", entry_id="4-0", reason="poison", state="replayed"),
        dict(group_name="mailer", entry_id="5-0", reason="poison", state="replayed"),
    ]
    then = db_clock(engine) - timedelta(seconds=200)
    with engine.begin() as conn:
        for row in rows:
            conn.execute(
                inbox.dead_letters.insert().values(
                    stream="outbox.orders",
                    error="ValueError: boom",
                    deliveries=5,
                    payload="{}",
                    dead_letter_stream="outbox.dead",
                    created_at=then,
                    **row,
                )
            )
    registry = build_metrics(engine=engine).registry
    assert series(registry, "outbox_dead_letters") == {
        (("group", "billing"), ("reason", "poison")): 2.0,
        (("group", "billing"), ("reason", "undecodable")): 1.0,
    }
    ages = series(registry, "outbox_oldest_dead_letter_age_seconds")
    assert list(ages) == [(("group", "billing"),)]
    assert 200.0 <= ages[(("group", "billing"),)] < 260.0
    assert value(registry, "outbox_metrics_source_up", source="dead_letters") == 1.0


def test_job_gauges(engine: sa.Engine) -> None:
    consumer.jobs.upgrades.create_schema(engine)
    with engine.connect() as conn:
        now = float(
            conn.execute(sa.text("SELECT " + queries.epoch_sql(conn.dialect.name))).scalar_one()
        )
    jobs: list[dict[str, Any]] = [
        # READY and eligible since 300 s (run_after wins over created_at)...
        dict(state="READY", created_at=now - 900, run_after=now - 300),
        # ... since 120 s (no run_after: created_at) ...
        dict(state="READY", created_at=now - 120, run_after=None),
        # ... and not yet eligible: not late.
        dict(state="READY", created_at=now - 5000, run_after=now + 600),
        dict(state="LEASED", created_at=now, lease_expires_at=now - 60),
        dict(state="LEASED", created_at=now, lease_expires_at=now + 60),
        dict(state="NEEDS_ATTENTION", created_at=now),
        dict(state="NEEDS_ATTENTION", created_at=now),
        dict(state="HELD", created_at=now),  # behind an earlier job of its order key
        dict(state="WAITING_REVIEW", created_at=now),
        dict(state="DONE", created_at=now),
        dict(state="CANCELLED", created_at=now),
    ]
    with engine.begin() as conn:
        for i, job in enumerate(jobs):
            conn.execute(
                consumer.jobs.schema.jobs.insert().values(
                    tenant="studio", action=f"send-{i}", updated_at=now, **job
                )
            )
    registry = build_metrics(engine=engine).registry
    assert series(registry, "outbox_jobs") == {
        (("state", "READY"),): 3.0,
        (("state", "LEASED"),): 2.0,
        (("state", "WAITING_EXTERNAL"),): 0.0,
        (("state", "WAITING_REVIEW"),): 1.0,
        (("state", "NEEDS_ATTENTION"),): 2.0,
        (("state", "HELD"),): 1.0,
        (("state", "WAITING_PARENTS"),): 0.0,
    }
    age = value(registry, "outbox_oldest_ready_job_age_seconds")
    assert age is not None and 300.0 <= age < 360.0
    assert value(registry, "outbox_expired_leases") == 1.0


def test_queue_gauges_show_jobs_no_worker_takes_with_bounded_labels(engine: sa.Engine) -> None:
    """Issue 27: a job no running worker can run stays READY and shows per queue; with more
    queues than ``top_n`` the fullest keep their series and the rest are one ``other``."""
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    store = Store(engine)
    store.enqueue_many([{"tenant": "t", "action": f"send-{i}", "queue": "mail"} for i in range(4)])
    store.enqueue_many(
        [{"tenant": "t", "action": f"r-{i}", "kind": "remind", "queue": "mail"} for i in range(3)]
    )
    for n in range(5):  # q0 has 1 READY job ... q4 has 5
        store.enqueue_many(
            [{"tenant": "t", "action": f"q{n}-{i}", "queue": f"q{n}"} for i in range(n + 1)]
        )
    worker = Worker(store, queues=["mail"], batch_size=100)
    worker.register("send", lambda job: None)
    assert worker.run_once() == 4  # the reminders: no handler here, left READY
    registry = build_metrics(engine=engine, top_n=3).registry
    assert series(registry, "outbox_queue_ready_jobs") == {
        (("queue", "q4"),): 5.0,
        (("queue", "q3"),): 4.0,
        (("queue", "mail"),): 3.0,  # the 3 reminders no running worker has a handler for
        (("queue", "other"),): 3.0 + 2.0 + 1.0,  # q2, q1, q0
    }
    oldest = series(registry, "outbox_queue_oldest_ready_age_seconds")
    assert set(oldest) == {(("queue", q),) for q in ("q4", "q3", "mail", "other")}
    assert all(age >= 0.0 for age in oldest.values())
    assert store.get("t", "r-0").state == "READY" and store.get("t", "r-0").attempts == 0
    store.dispose()


def test_table_names_match_the_job_store_and_consumer() -> None:
    assert queries.JOBS_TABLE == consumer.jobs.schema.JOBS_TABLE
    assert queries.DEAD_LETTER_TABLE == consumer.inbox.DEAD_LETTER_TABLE
    assert queries.NEEDS_ATTENTION_LETTER == consumer.inbox.NEEDS_ATTENTION


def slow_source(dialect: str) -> Source:
    def run(ctx: ScrapeContext) -> list[Metric]:
        if ctx.dialect == "postgresql":
            ctx.conn.execute(sa.text("SELECT pg_sleep(30)"))
        else:  # a CPU-bound statement for SQLite's progress handler to interrupt
            ctx.conn.execute(
                sa.text(
                    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
                    "WHERE x < 1000000000) SELECT count(*) FROM c"
                )
            )
        return [GaugeMetricFamily("outbox_test_never", "never reached", value=1)]

    return Source(name="slow", tables=(), run=run)


def test_statement_timeout_bounds_a_slow_query(
    engine: sa.Engine, outbox_schema: OutboxSchema
) -> None:
    add_event(engine, outbox_schema, attempts=2)
    collector = DatabaseCollector(
        engine,
        outbox_schema,
        statement_timeout_ms=200,
        extra_sources=[slow_source(engine.dialect.name)],
    )
    registry = CollectorRegistry()
    registry.register(collector)
    assert registry.get_sample_value("outbox_metrics_source_up", {"source": "slow"}) == 0.0
    assert registry.get_sample_value("outbox_test_never") is None
    # The other sources are unaffected, and the pooled connection is usable afterwards.
    assert registry.get_sample_value("outbox_metrics_source_up", {"source": "outbox"}) == 1.0
    assert registry.get_sample_value("outbox_max_attempts") == 2.0
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "0"
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1


def test_database_down_still_serves_process_metrics() -> None:
    engine = make_engine(
        "postgresql://postgres@127.0.0.1:1/test", connect_args={"connect_timeout": 2}
    )
    metrics = build_metrics(engine=engine)
    metrics.hooks.relay_published("orders", 3, [0.1])
    assert value(metrics.registry, "outbox_relay_published_total", topic="orders") == 3.0
    assert value(metrics.registry, "outbox_metrics_source_up", source="outbox") == 0.0
    assert value(metrics.registry, "outbox_backlog", topic="orders") is None
    engine.dispose()


# -- process metrics -----------------------------------------------------------------------------


def test_only_a_relay_exports_the_relays_histograms() -> None:
    """A consumer's, a worker's or the standalone exporter's /metrics has no relay histogram
    with count 0 (issue 26); a relay's has them from its first cycle."""
    registry = CollectorRegistry()
    hooks = PrometheusHooks(registry)
    hooks.consumer_handled("g", "s", 1)
    hooks.worker_job_finished("send", "done", 0.1)
    names = {s.name for m in registry.collect() for s in m.samples}
    assert not {n for n in names if n.startswith("outbox_relay_")}, names
    hooks.relay_cycle_ok(1.0)
    samples = {s.name for m in registry.collect() for s in m.samples}
    assert "outbox_relay_batch_duration_seconds_count" in samples
    assert "outbox_relay_commit_to_stream_seconds_count" in samples
    assert registry.get_sample_value("outbox_relay_batch_size_count") == 0.0


def test_prometheus_hooks_implement_every_hook() -> None:
    names = [n for n, v in vars(Hooks).items() if callable(v) and not n.startswith("_")]
    assert len(names) >= 14
    for name in names:
        assert name in vars(PrometheusHooks), f"PrometheusHooks does not implement {name}"


def test_hooks_record_process_metrics() -> None:
    registry = CollectorRegistry()
    hooks = PrometheusHooks(registry)
    v = lambda name, **labels: registry.get_sample_value(name, labels)  # noqa: E731
    assert v("outbox_relay_last_success_timestamp_seconds") is None  # absent until reported

    hooks.relay_published("orders", 3, [0.002, 0.2, 4.0])
    hooks.relay_published("orders", 2, [0.5, -1.0])  # a skewed clock gives a negative latency
    hooks.relay_publish_error("transient", "orders")
    hooks.relay_publish_error("ConnectionError", None)
    hooks.relay_batch(0.03, 5)
    hooks.relay_reconciled(found_in_stream=2, republished=1)
    hooks.relay_quarantined("orders", 1)
    hooks.relay_cycle_ok(1_700_000_000.5)
    assert v("outbox_relay_published_total", topic="orders") == 5.0
    assert v("outbox_relay_commit_to_stream_seconds_count") == 5.0
    assert v("outbox_relay_commit_to_stream_seconds_bucket", le="0.005") == 2.0
    assert v("outbox_relay_commit_to_stream_seconds_bucket", le="0.25") == 3.0
    assert v("outbox_relay_publish_errors_total", error_class="transient") == 1.0
    assert v("outbox_relay_publish_errors_total", error_class="ConnectionError") == 1.0
    assert v("outbox_relay_batch_duration_seconds_count") == 1.0
    assert v("outbox_relay_batch_size_sum") == 5.0
    assert v("outbox_relay_reconciled_total", result="found_in_stream") == 2.0
    assert v("outbox_relay_reconciled_total", result="republished") == 1.0
    assert v("outbox_relay_quarantined_total", topic="orders") == 1.0
    assert v("outbox_relay_last_success_timestamp_seconds") == 1_700_000_000.5
    assert v("outbox_consumer_last_success_timestamp_seconds") is None

    hooks.consumer_handled("billing", "outbox.orders", 4)
    hooks.consumer_duplicate("billing", 2)
    hooks.consumer_dead_lettered("billing", "outbox.orders", 1)
    hooks.consumer_lag("billing", "outbox.orders", 12, 3)
    hooks.consumer_lag("billing", "outbox.orders", None, 1)  # unknown lag keeps the last one
    hooks.consumer_cycle_ok(1_700_000_001.0)
    assert v("outbox_consumer_handled_total", group="billing", stream="outbox.orders") == 4.0
    assert v("outbox_consumer_duplicates_total", group="billing") == 2.0
    assert v("outbox_consumer_dead_lettered_total", group="billing", stream="outbox.orders") == 1
    assert v("outbox_consumer_group_lag", group="billing", stream="outbox.orders") == 12.0
    assert v("outbox_consumer_group_pending", group="billing", stream="outbox.orders") == 1.0
    assert v("outbox_consumer_last_success_timestamp_seconds") == 1_700_000_001.0

    hooks.worker_job_finished("send-quote", "done", 0.2)
    hooks.worker_job_finished("send-quote", "retry", 1.0)
    hooks.worker_lease_conflict("send-quote")
    hooks.worker_cycle_ok(1_700_000_002.0)
    assert v("outbox_worker_jobs_finished_total", action="send-quote", outcome="done") == 1.0
    assert v("outbox_worker_jobs_finished_total", action="send-quote", outcome="retry") == 1.0
    assert v("outbox_worker_job_duration_seconds_count", action="send-quote") == 2.0
    assert v("outbox_worker_lease_conflicts_total", action="send-quote") == 1.0
    assert v("outbox_worker_last_success_timestamp_seconds") == 1_700_000_002.0


def test_hooks_never_raise_on_odd_input() -> None:
    hooks = PrometheusHooks()
    hooks.relay_published("orders", -1, [])
    hooks.relay_quarantined("", -5)
    hooks.consumer_handled("g", "s", -3)
    hooks.consumer_lag("g", "s", -1, -1)
    hooks.relay_batch(-1.0, -1)
    assert (
        hooks.registry.get_sample_value("outbox_relay_published_total", {"topic": "orders"}) is None
    )
    assert (
        hooks.registry.get_sample_value("outbox_consumer_group_lag", {"group": "g", "stream": "s"})
        == 0.0
    )


def test_start_metrics_serves_a_fresh_registry_on_localhost(
    engine: sa.Engine, outbox_schema: OutboxSchema
) -> None:
    add_event(engine, outbox_schema, attempts=4, topic="orders")
    hooks = start_metrics(0, engine=engine, outbox_schema=outbox_schema)
    try:
        assert isinstance(hooks, Hooks)
        assert hooks.registry is not REGISTRY
        assert hooks.server is not None and hooks.server.server_address[0] == "127.0.0.1"
        hooks.relay_published("orders", 1, [0.01])
        with urllib.request.urlopen(f"http://127.0.0.1:{hooks.port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'outbox_relay_published_total{topic="orders"} 1.0' in body
        assert 'outbox_backlog{topic="orders"} 1.0' in body
        assert 'outbox_stuck_record_attempts{event_id="' in body
        assert (
            REGISTRY.get_sample_value("outbox_relay_published_total", {"topic": "orders"}) is None
        )
    finally:
        hooks.close()


def make_receipts_table(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE test_receipts (id integer primary key, state varchar(16) NOT NULL,"
                " created_at double precision NOT NULL)"
            )
        )


def test_unknown_receipts_source(engine: sa.Engine) -> None:
    collector_registry = CollectorRegistry()
    source = unknown_receipts_source("test_receipts")
    collector = DatabaseCollector(
        engine, cache_seconds=0, table_recheck_seconds=0, extra_sources=[source]
    )
    collector_registry.register(collector)
    # No table yet: no series, no error.
    assert collector_registry.get_sample_value("outbox_unknown_receipts") is None
    make_receipts_table(engine)
    assert collector_registry.get_sample_value("outbox_unknown_receipts") == 0.0
    assert collector_registry.get_sample_value("outbox_oldest_unknown_receipt_age_seconds") == 0.0
    with engine.begin() as conn:
        now = float(
            conn.execute(sa.text("SELECT " + queries.epoch_sql(conn.dialect.name))).scalar_one()
        )
        for i, (state, age) in enumerate([("UNKNOWN", 700), ("UNKNOWN", 30), ("SUCCEEDED", 9000)]):
            conn.execute(
                sa.text("INSERT INTO test_receipts VALUES (:i, :s, :t)"),
                {"i": i, "s": state, "t": now - age},
            )
    assert collector_registry.get_sample_value("outbox_unknown_receipts") == 2.0
    age = collector_registry.get_sample_value("outbox_oldest_unknown_receipt_age_seconds")
    assert age is not None and 700.0 <= age < 760.0


def test_unknown_receipts_source_rejects_unsafe_names() -> None:
    with pytest.raises(ConfigError):
        unknown_receipts_source("receipts; DROP TABLE x")
    with pytest.raises(ConfigError):
        unknown_receipts_source("receipts", unknown_value="x' OR '1")


def test_unknown_receipts_of_the_job_store_are_exported_by_default(engine: sa.Engine) -> None:
    from consumer.jobs.schema import db_epoch, operations
    from consumer.jobs.upgrades import create_schema as create_job_tables

    collector_registry = CollectorRegistry()
    collector_registry.register(DatabaseCollector(engine, cache_seconds=0, table_recheck_seconds=0))
    assert collector_registry.get_sample_value("outbox_unknown_receipts") is None
    create_job_tables(engine)
    with engine.begin() as conn:
        now = float(conn.execute(sa.select(db_epoch())).scalar_one())
        for i, (state, age) in enumerate([("UNKNOWN", 400), ("ACCEPTED", 9000), ("UNKNOWN", 5)]):
            conn.execute(
                operations.insert().values(
                    operation_id=f"{i}:send",
                    job_id=i,
                    provider="mail",
                    request_digest="0" * 64,
                    state=state,
                    created_at=now - 10_000,  # the intent is old; UNKNOWN since updated_at
                    updated_at=now - age,
                )
            )
    assert collector_registry.get_sample_value("outbox_unknown_receipts") == 2.0
    age = collector_registry.get_sample_value("outbox_oldest_unknown_receipt_age_seconds")
    assert age is not None and 400.0 <= age < 460.0
