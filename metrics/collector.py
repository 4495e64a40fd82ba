"""Gauges computed from the database at scrape time: :class:`DatabaseCollector`.

What a process cannot know by itself (how old the oldest unpublished event is, which record
keeps failing, how many jobs wait) is read from the tables when Prometheus scrapes. Rules:

- **A short cache** (``cache_seconds``, 5 s by default): several Prometheus servers, or a
  scrape plus ``curl``, within the window share one round of queries. ``refreshes`` counts
  the rounds actually run.
- **Bounded queries**: each statement is served by a (partial) index, see
  :mod:`metrics.queries`, and runs under a statement timeout (PostgreSQL:
  ``statement_timeout`` set for the transaction only; SQLite: a progress handler that
  interrupts the statement), so a sick database slows a scrape down by at most that much.
- **Missing tables produce no series.** A relay-only deployment has no jobs table; each
  source names the tables it needs, existence is checked once and cached (missing ones are
  looked for again every ``table_recheck_seconds``, for a schema created after the exporter
  started), and a source whose tables are absent is skipped without error.
- **Failures do not break the scrape.** The process metrics on the same registry must still
  be served when the database is down: a failing source is logged, and reported as
  ``outbox_metrics_source_up{source} 0``.
- **Bounded labels**: topics, states and the top-N stuck records only (``top_n`` series at
  most, never one series per row).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import inspect
from sqlalchemy.engine import Connection, Engine

from metrics import queries
from metrics.horizon import horizon_source
from metrics.schedules import schedules_source
from metrics.steps import steps_source
from metrics.tables import Source as Source
from metrics.tables import table_sizes_source
from outbox.dialect import limit_statements
from outbox.errors import ConfigError
from outbox.outage import report_failure
from outbox.schema import OutboxSchema, build_schema, check_identifier
from outbox.status import age_seconds as age_seconds

log = logging.getLogger("outbox.metrics")

DEFAULT_CACHE_SECONDS = 5.0
DEFAULT_TOP_N = 10
DEFAULT_STATEMENT_TIMEOUT_MS = 2000
DEFAULT_TABLE_RECHECK_SECONDS = 60.0
# Upper bounds of the pending-attempts histogram (``le`` labels); +Inf is added.
ATTEMPTS_BUCKETS: tuple[int, ...] = (0, 1, 2, 3, 5, 10, 20, 50, 100)

SourceFn = Callable[["ScrapeContext"], list[Metric]]


@dataclass
class ScrapeContext:
    """What a source needs: a connection in its own transaction, and the database clock."""

    conn: Connection
    dialect: str
    now: datetime


class DatabaseCollector(Collector):
    """The database-derived gauges of one outbox (and, when present, consumer and job tables).

    ``top_n`` bounds ``outbox_stuck_record_attempts`` to that many series.
    """

    def __init__(
        self,
        engine: Engine,
        outbox_schema: OutboxSchema | None = None,
        *,
        cache_seconds: float = DEFAULT_CACHE_SECONDS,
        top_n: int = DEFAULT_TOP_N,
        statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
        table_recheck_seconds: float = DEFAULT_TABLE_RECHECK_SECONDS,
        attempts_buckets: Sequence[int] = ATTEMPTS_BUCKETS,
        consumer_schema: str | None = None,
        jobs_schema: str | None = None,
        extra_sources: Iterable[Source] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cache_seconds < 0:
            raise ConfigError("metrics.cache_seconds", "must be zero or positive")
        if not 0 <= top_n <= 1000:
            raise ConfigError("metrics.top_n", "must be between 0 and 1000")
        if statement_timeout_ms <= 0:
            raise ConfigError("metrics.statement_timeout_ms", "must be positive")
        buckets = tuple(sorted(set(int(b) for b in attempts_buckets)))
        if not buckets:
            raise ConfigError("metrics.attempts_buckets", "needs at least one bound")
        self.engine = engine
        self.outbox_schema = outbox_schema if outbox_schema is not None else build_schema()
        self.cache_seconds = float(cache_seconds)
        self.top_n = int(top_n)
        self.statement_timeout_ms = int(statement_timeout_ms)
        self.table_recheck_seconds = float(table_recheck_seconds)
        self.attempts_buckets = buckets
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: list[Metric] | None = None
        self._cached_at = 0.0
        self._tables: dict[tuple[str, str | None], bool] = {}
        self._tables_checked_at: float | None = None
        self.refreshes = 0
        """Rounds of queries actually run (a cached scrape does not count)."""
        self.consumer_schema = check_identifier("consumer_schema", consumer_schema, optional=True)
        self.jobs_schema = check_identifier("jobs_schema", jobs_schema, optional=True)
        self.sources: list[Source] = [
            self._outbox_source(),
            self._dead_letter_source(),
            self._jobs_source(),
            self._queues_source(),
            # Operation receipts of the job store (consumer/jobs/operations.py): an UNKNOWN receipt
            # ages from when it became UNKNOWN (updated_at), not from the intent's creation.
            unknown_receipts_source(
                queries.OPERATIONS_TABLE, self.jobs_schema, since_column="updated_at"
            ),
            # Sizes, dead rows and the oldest row's age per table (issue 25; metrics.tables).
            table_sizes_source(
                self.outbox_schema.table_name,
                self.outbox_schema.schema,
                self.consumer_schema,
                self.jobs_schema,
            ),
            # Schedules: slots fired and missed, overdue slots, live workers (issue 39).
            schedules_source(self.jobs_schema),
            # The oldest holder of the vacuum horizon, seen from the job tables' database
            # (issue 60; metrics.horizon).
            horizon_source(self.jobs_schema),
            steps_source(self.jobs_schema),  # steps a parent did not release (issue 57)
            *extra_sources,
        ]

    # -- prometheus_client protocol ---------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        # Returning nothing stops the registry from calling collect() (a database round)
        # when the collector is registered.
        return []

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._cached_at >= self.cache_seconds:
                self._cached = self._refresh()
                self._cached_at = self._clock()
            return list(self._cached)

    def invalidate(self) -> None:
        """Forget the cached values: the next scrape queries the database."""
        with self._lock:
            self._cached = None

    # -- one round ----------------------------------------------------------------------------

    def _refresh(self) -> list[Metric]:
        self.refreshes += 1
        started = time.perf_counter()
        metrics: list[Metric] = []
        up = GaugeMetricFamily(
            "outbox_metrics_source_up",
            "1 if the last scrape read this source's tables, 0 if its queries failed.",
            labels=["source"],
        )
        try:
            present = self._present_tables()
        except Exception as exc:
            report_failure(log, "metrics: cannot inspect the database", exc)
            present = None
        for source in self.sources:
            if present is None:
                up.add_metric([source.name], 0.0)
                continue
            if not all(present.get(t, False) for t in source.tables):
                continue  # e.g. no jobs table in a relay-only deployment: no series, no error
            try:
                metrics.extend(self._run_source(source))
                up.add_metric([source.name], 1.0)
            except Exception as exc:
                report_failure(log, "metrics: source query failed", exc, source=source.name)
                up.add_metric([source.name], 0.0)
        metrics.append(up)
        duration = GaugeMetricFamily(
            "outbox_metrics_refresh_duration_seconds",
            "Time the last round of database queries for these gauges took.",
            value=time.perf_counter() - started,
        )
        metrics.append(duration)
        return metrics

    def _present_tables(self) -> dict[tuple[str, str | None], bool]:
        wanted = {t for s in self.sources for t in s.tables}
        now = self._clock()
        recheck = (
            self._tables_checked_at is None
            or now - self._tables_checked_at >= self.table_recheck_seconds
        )
        missing = [t for t in wanted if not self._tables.get(t, False)]
        if missing and recheck:
            with self.engine.connect() as conn:
                inspector = inspect(conn)
                for name, schema in missing:
                    self._tables[(name, schema)] = bool(inspector.has_table(name, schema=schema))
                conn.rollback()
            self._tables_checked_at = now
        return dict(self._tables)

    def _run_source(self, source: Source) -> list[Metric]:
        with self.engine.connect() as conn:
            dialect = conn.dialect.name
            with conn.begin():
                restore = limit_statements(conn, self.statement_timeout_ms)
                try:
                    now = conn.execute(queries.now_sql(dialect)).scalar_one()
                    return source.run(ScrapeContext(conn=conn, dialect=dialect, now=now))
                finally:
                    restore()

    # -- sources ------------------------------------------------------------------------------

    def _outbox_source(self) -> Source:
        s = self.outbox_schema
        table = queries.qualified(s.table_name, s.schema)
        top_n = self.top_n
        buckets = self.attempts_buckets

        def run(ctx: ScrapeContext) -> list[Metric]:
            conn = ctx.conn
            age = GaugeMetricFamily(
                "outbox_oldest_unpublished_age_seconds",
                "Age (database clock) of the oldest pending outbox event, per topic. "
                "Topics with nothing pending have no series.",
                labels=["topic"],
            )
            backlog = GaugeMetricFamily(
                "outbox_backlog",
                "Pending (unpublished) outbox events, per topic.",
                labels=["topic"],
            )
            for topic, count, oldest in conn.execute(queries.backlog_by_topic(table)):
                backlog.add_metric([topic], float(count))
                value = age_seconds(ctx.now, oldest)
                if value is not None:
                    age.add_metric([topic], value)
            quarantined = GaugeMetricFamily(
                "outbox_quarantined",
                "Outbox events quarantined after a permanent failure; they wait for a fix "
                "and `outbox-relay requeue`.",
                value=float(conn.execute(queries.quarantined_count(table)).scalar_one()),
            )

            by_attempts = {int(a): int(n) for a, n in conn.execute(queries.pending_attempts(table))}
            hist_buckets: list[tuple[str, float]] = []
            for bound in buckets:
                hist_buckets.append(
                    (str(bound), float(sum(n for a, n in by_attempts.items() if a <= bound)))
                )
            hist_buckets.append(("+Inf", float(sum(by_attempts.values()))))
            attempts = HistogramMetricFamily(
                "outbox_pending_attempts",
                "Distribution of the publish attempts of pending outbox events.",
                buckets=hist_buckets,
                sum_value=float(sum(a * n for a, n in by_attempts.items())),
            )
            max_attempts = GaugeMetricFamily(
                "outbox_max_attempts",
                "Highest publish attempts among pending outbox events (0 when none).",
                value=float(max(by_attempts, default=0)),
            )

            stuck = GaugeMetricFamily(
                "outbox_stuck_record_attempts",
                f"Publish attempts of the {top_n} most-attempted pending events (attempts > "
                "0), labelled so an operator can find them; at most that many series.",
                labels=["event_id", "topic"],
            )
            if top_n > 0:
                for event_id, topic, n in conn.execute(queries.most_attempted(table, top_n)):
                    stuck.add_metric([event_id, topic], float(n))
            return [age, backlog, quarantined, attempts, max_attempts, stuck]

        return Source(name="outbox", tables=((s.table_name, s.schema),), run=run)

    def _dead_letter_source(self) -> Source:
        name, schema = queries.DEAD_LETTER_TABLE, self.consumer_schema
        table = queries.qualified(name, schema)

        def run(ctx: ScrapeContext) -> list[Metric]:
            letters = GaugeMetricFamily(
                "outbox_dead_letters",
                "Consumer entries given up on and recorded as NEEDS_ATTENTION (also copied to "
                "the dead-letter stream), per consumer group and reason.",
                labels=["group", "reason"],
            )
            oldest_by_group: dict[str, float] = {}
            for group, reason, count, oldest in ctx.conn.execute(queries.dead_letters(table)):
                letters.add_metric([group, reason], float(count))
                age = age_seconds(ctx.now, oldest)
                if age is not None:
                    oldest_by_group[group] = max(age, oldest_by_group.get(group, 0.0))
            oldest_age = GaugeMetricFamily(
                "outbox_oldest_dead_letter_age_seconds",
                "Age of the oldest NEEDS_ATTENTION dead letter, per consumer group.",
                labels=["group"],
            )
            for group, age in sorted(oldest_by_group.items()):
                oldest_age.add_metric([group], age)
            return [letters, oldest_age]

        return Source(name="dead_letters", tables=((name, schema),), run=run)

    def _jobs_source(self) -> Source:
        name, schema = queries.JOBS_TABLE, self.jobs_schema
        table = queries.qualified(name, schema)

        def run(ctx: ScrapeContext) -> list[Metric]:
            conn, dialect = ctx.conn, ctx.dialect
            jobs = GaugeMetricFamily(
                "outbox_jobs",
                "Open jobs per state (READY, LEASED, WAITING_EXTERNAL, WAITING_REVIEW, "
                "NEEDS_ATTENTION, HELD, WAITING_PARENTS); DONE and CANCELLED are history and "
                "not counted.",
                labels=["state"],
            )
            counts = dict.fromkeys(queries.OPEN_JOB_STATES, 0)
            for state, count in conn.execute(queries.jobs_per_open_state(table)):
                counts[state] = int(count)
            for state, count in counts.items():
                jobs.add_metric([state], float(count))
            age = conn.execute(queries.oldest_ready_job(table, dialect)).scalar_one()
            oldest_ready = GaugeMetricFamily(
                "outbox_oldest_ready_job_age_seconds",
                "How long the oldest runnable READY job has been eligible without a worker "
                "claiming it (0 when none is waiting).",
                value=max(0.0, float(age)) if age is not None else 0.0,
            )
            expired = GaugeMetricFamily(
                "outbox_expired_leases",
                "LEASED jobs whose lease has expired (database clock): their worker died and "
                "no worker has recovered them yet.",
                value=float(conn.execute(queries.expired_leases(table, dialect)).scalar_one()),
            )
            return [jobs, oldest_ready, expired]

        return Source(name="jobs", tables=((name, schema),), run=run)

    def _queues_source(self) -> Source:
        """Ready jobs and the oldest READY age per queue: a job no running worker takes (no
        handler for its kind, its queue served by no worker, or paused) shows here, and
        ``OutboxQueueNotTaken`` fires on it. A source of its own, so that a job table made
        before queues (no ``queue`` column until a worker upgrades it) loses only these."""
        name, schema = queries.JOBS_TABLE, self.jobs_schema
        table = queries.qualified(name, schema)
        top_n = self.top_n

        def run(ctx: ScrapeContext) -> list[Metric]:
            found = [
                (str(queue), int(n), max(0.0, float(age)) if age is not None else 0.0)
                for queue, n, age in ctx.conn.execute(
                    queries.ready_jobs_per_queue(table, ctx.dialect)
                )
            ]
            found.sort(key=lambda row: (-row[1], row[0]))
            shown, rest = found[:top_n], found[top_n:]
            if rest:  # bounded labels: the top_n fullest queues, then one "other"
                shown.append(("other", sum(r[1] for r in rest), max(r[2] for r in rest)))
            ready = GaugeMetricFamily(
                "outbox_queue_ready_jobs",
                f"READY jobs per queue (the {top_n} fullest queues, the rest as "
                'queue="other"); queues with none have no series.',
                labels=["queue"],
            )
            oldest = GaugeMetricFamily(
                "outbox_queue_oldest_ready_age_seconds",
                "How long the oldest eligible READY job of the queue has waited for a worker "
                "(0 when all its READY jobs are scheduled for later).",
                labels=["queue"],
            )
            for queue, n, age in shown:
                ready.add_metric([queue], float(n))
                oldest.add_metric([queue], age)
            return [ready, oldest]

        return Source(name="queues", tables=((name, schema),), run=run)


def unknown_receipts_source(
    table: str,
    schema: str | None = None,
    *,
    state_column: str = "state",
    unknown_value: str = "UNKNOWN",
    since_column: str = "created_at",
) -> Source:
    """A source for ``outbox_unknown_receipts`` and ``outbox_oldest_unknown_receipt_age_seconds``
    over an operation-receipts table (``since_column`` in unix seconds). Pass it in
    ``extra_sources``; the names are checked as plain identifiers."""
    names = {
        "table": table,
        "state_column": state_column,
        "since_column": since_column,
    }
    for setting, name in names.items():
        check_identifier(setting, name)
    if not unknown_value.replace("_", "").isalnum():
        raise ConfigError("unknown_value", f"{unknown_value!r} is not a plain state name")
    check_identifier("schema", schema, optional=True)
    qualified = queries.qualified(table, schema)

    def run(ctx: ScrapeContext) -> list[Metric]:
        count, age = ctx.conn.execute(
            queries.unknown_receipts(
                qualified, f'"{state_column}"', unknown_value, f'"{since_column}"', ctx.dialect
            )
        ).one()
        return [
            GaugeMetricFamily(
                "outbox_unknown_receipts",
                "External operations whose outcome is UNKNOWN (a timeout; reconciliation has "
                "not settled them yet).",
                value=float(count),
            ),
            GaugeMetricFamily(
                "outbox_oldest_unknown_receipt_age_seconds",
                "Age of the oldest UNKNOWN operation receipt (0 when none).",
                value=max(0.0, float(age)) if age is not None else 0.0,
            ),
        ]

    return Source(name="receipts", tables=((table, schema),), run=run)
