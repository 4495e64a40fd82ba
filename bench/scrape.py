"""Scrape cost of the database-derived gauges on a big outbox (PostgreSQL).

    python -m bench scrape                 # 200,000 published + 10,000 pending rows
    python -m bench scrape --full          # 1,000,000 published + 10,000 pending rows
    python -m bench scrape --rows N --pending M --database-url URL

Bulk-loads the rows with ``INSERT ... SELECT generate_series`` into a schema of its own
(dropped afterwards), VACUUM ANALYZEs, then times one scrape of :class:`DatabaseCollector`
cold (queries run) and cached, prints the EXPLAIN (ANALYZE, BUFFERS) plan of every gauge
query, and compares with a naive baseline in the same run: the ``GROUP BY topic, state``
dashboard query over the whole table, which reads every published row. Prints figures; it
asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest

from metrics import queries
from metrics.collector import DatabaseCollector
from outbox.db import make_engine
from outbox.schema import build_schema, create_schema

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def load(engine: sa.Engine, table: str, rows: int, pending: int, topics: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {table} (event_id, topic, key, key_hash, identity, payload, state, "
                "created_at, available_at, attempts, published_at, stream, stream_id) "
                "SELECT 'pub-' || g, 'topic' || (g % :topics), 'k' || (g % 5000), g % 5000, "
                "'pub-' || g, '{\"total\": 120}'::jsonb, 'published', "
                "now() - make_interval(secs => :rows - g), "
                "now() - make_interval(secs => :rows - g), "
                "1, now(), 'outbox.t', g || '-0' FROM generate_series(1, :rows) AS g"
            ),
            {"rows": rows, "topics": topics},
        )
        conn.execute(
            sa.text(
                f"INSERT INTO {table} (event_id, topic, key, key_hash, identity, payload, state, "
                "created_at, available_at, attempts) "
                "SELECT 'pend-' || g, 'topic' || (g % :topics), 'k' || (g % 5000), g % 5000, "
                "'pend-' || g, '{\"total\": 120}'::jsonb, 'pending', "
                "now() - make_interval(secs => :pending - g), now(), g % 7 "
                "FROM generate_series(1, :pending) AS g"
            ),
            {"pending": pending, "topics": topics},
        )
        conn.execute(
            sa.text(
                f"INSERT INTO {table} (event_id, topic, key, key_hash, identity, payload, state, "
                "created_at, available_at, attempts, last_error) "
                "SELECT 'quar-' || g, 'topic1', 'q' || g, g, 'quar-' || g, '{}'::jsonb, "
                "'quarantined', now(), now(), 1, 'ValueError: bad' FROM generate_series(1, 25) g"
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM ANALYZE {table}"))


def explain(engine: sa.Engine, name: str, statement: sa.TextClause | sa.TextualSelect) -> None:
    sql = str(statement.compile(engine))
    with engine.connect() as conn:
        plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {sql}").scalars().all()
    print(f"\n-- {name}: {sql}")
    for line in plan:
        print(f"   {line}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench scrape", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_URL, help="PostgreSQL URL")
    parser.add_argument("--rows", type=int, default=200_000, help="published rows")
    parser.add_argument("--pending", type=int, default=10_000, help="pending rows")
    parser.add_argument("--topics", type=int, default=8, help="distinct topics")
    parser.add_argument("--full", action="store_true", help="1,000,000 published rows")
    parser.add_argument("--repeat", type=int, default=7, help="timed repetitions")
    parser.add_argument("--keep", action="store_true", help="keep the bench schema")
    args = parser.parse_args(argv)
    rows = 1_000_000 if args.full else args.rows

    schema = f"bench_scrape_{uuid.uuid4().hex[:8]}"
    admin = make_engine(args.database_url)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in args.database_url else "?"
    engine = make_engine(f"{args.database_url}{sep}options=-csearch_path%3D{schema}")
    try:
        outbox = build_schema()
        create_schema(engine, outbox)
        table = queries.qualified(outbox.table_name, None)
        started = time.perf_counter()
        load(engine, table, rows, args.pending, args.topics)
        print(
            f"loaded {rows:,} published + {args.pending:,} pending + 25 quarantined rows "
            f"in {time.perf_counter() - started:.1f} s (schema {schema})"
        )

        collector = DatabaseCollector(engine, outbox, cache_seconds=3600)
        registry = CollectorRegistry()
        registry.register(collector)
        generate_latest(registry)  # warm the pool and the table-existence check

        def cold() -> None:
            collector.invalidate()
            generate_latest(registry)

        cold_times = timed(cold, args.repeat)
        cached_times = timed(lambda: generate_latest(registry), args.repeat)
        naive = queries.naive_state_counts(table)

        def baseline() -> None:
            with engine.connect() as conn:
                conn.execute(naive).all()

        naive_times = timed(baseline, max(3, args.repeat // 2))
        cold_median = statistics.median(cold_times)
        naive_median = statistics.median(naive_times)
        print(f"\nscrape, queries run (cold): median {ms(cold_median)} over {args.repeat}")
        print(f"scrape, cached:             median {ms(statistics.median(cached_times))}")
        print(f"naive GROUP BY topic, state: median {ms(naive_median)}")
        print(f"ratio naive / scrape: {naive_median / cold_median:.1f}x")
        print(f"series exported: {len(generate_latest(registry).splitlines())} lines")

        explain(engine, "backlog and oldest age per topic", queries.backlog_by_topic(table))
        explain(engine, "quarantined", queries.quarantined_count(table))
        explain(engine, "pending attempts histogram and max", queries.pending_attempts(table))
        explain(engine, "top-N stuck records", queries.most_attempted(table, 10))
        explain(engine, "baseline: naive GROUP BY", naive)
    finally:
        engine.dispose()
        if not args.keep:
            with admin.begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    return 0
