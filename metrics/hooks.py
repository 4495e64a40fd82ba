"""Process metrics: :class:`PrometheusHooks` implements :class:`outbox.hooks.Hooks`.

The relay, consumers and workers call the hooks; this module turns the calls into counters,
histograms and gauges on an injected registry (never the global one, so tests and several
parts in one process do not collide). Label values are the bounded ones the hooks receive:
topics, groups, streams, error classes, actions and outcomes, never event or job ids.

A hook must be cheap and must not raise: every method clamps its inputs (a negative count
would make ``Counter.inc`` raise). The parts call hooks through :func:`outbox.hooks.call_hook`,
the one guard that logs whatever the client library could still throw.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outbox.hooks import Hooks

log = logging.getLogger("outbox.metrics")

# Batches take milliseconds to seconds; commit-to-stream latency spans sub-millisecond
# (NOTIFY wake-up) to minutes (a backlog after an outage), so its buckets reach an hour.
BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)
PERSISTENCE_MODES = ("aof", "rdb", "none", "unknown")
BATCH_SIZE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
JOB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _label(value: object, default: str = "unknown") -> str:
    return default if value is None or value == "" else str(value)


class PrometheusHooks(Hooks):
    """Counters, histograms and gauges for every hook, registered on ``registry``.

    ``collector`` is the database-derived collector registered next to these (or None) and
    ``server`` the HTTP server started by :func:`metrics.start_metrics` (or None); both are
    kept here so the caller that only holds the hooks can still reach and stop them.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, max_queue_labels: int = 20
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.max_queue_labels = max_queue_labels
        self._queues: set[str] = set()
        self.collector: Any = None
        self.server: Any = None
        self._server_thread: Any = None
        self._registered: set[int] = set()
        self._register_lock = threading.Lock()
        # Labelled children of the per-job series, looked up once (``_child``).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry

        # -- relay ------------------------------------------------------------------------
        self.relay_published_total = Counter(
            "outbox_relay_published",
            "Events the relay published to their stream (receipt recorded), by topic.",
            ["topic"],
            registry=r,
        )
        self.relay_publish_errors_total = Counter(
            "outbox_relay_publish_errors",
            "Failed publish attempts, by error class (transient, permanent or exception name).",
            ["error_class"],
            registry=r,
        )
        self.relay_quarantined_total = Counter(
            "outbox_relay_quarantined",
            "Records this relay quarantined after a permanent failure, by topic.",
            ["topic"],
            registry=r,
        )
        self.relay_batch_duration_seconds = Histogram(
            "outbox_relay_batch_duration_seconds",
            "Duration of one claim-publish-record cycle of the relay.",
            buckets=BATCH_BUCKETS,
            registry=None,
        )
        self.relay_batch_size = Histogram(
            "outbox_relay_batch_size",
            "Records handled per relay cycle.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=None,
        )
        self.relay_commit_to_stream_seconds = Histogram(
            "outbox_relay_commit_to_stream_seconds",
            "Latency from the outbox row's creation (database clock) to its stream entry.",
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.relay_reconciled_total = Counter(
            "outbox_relay_reconciled",
            "Orphaned publish intents reconciled against the stream, by result "
            "(found_in_stream: receipt recovered, republished: entry was missing).",
            ["result"],
            registry=r,
        )
        self.relay_last_success = Gauge(
            "outbox_relay_last_success_timestamp_seconds",
            "Unix time of the relay's last cycle that completed without an infrastructure error.",
            registry=None,
        )
        self.relay_redis_persistence_mode = Gauge(
            "outbox_relay_redis_persistence",
            "Redis's persistence as the relay last read it: 1 for the current mode (aof, rdb, "
            "none, or unknown when CONFIG is refused), 0 for the others. Without aof a crash "
            "loses entries the relay has acknowledged.",
            ["mode"],
            registry=r,
        )
        self.relay_redis_data_loss_at = Gauge(
            "outbox_relay_redis_data_loss_timestamp_seconds",
            "Unix time the relay last found that Redis lost entries it had published "
            "(OutboxRedisDataLoss; the relay's log names the republish command to run).",
            registry=None,
        )

        # -- consumer ---------------------------------------------------------------------
        self.consumer_handled_total = Counter(
            "outbox_consumer_handled",
            "Stream entries handled and acknowledged, by consumer group and stream.",
            ["group", "stream"],
            registry=r,
        )
        self.consumer_duplicates_total = Counter(
            "outbox_consumer_duplicates",
            "Entries skipped because their business identity was already in the inbox.",
            ["group"],
            registry=r,
        )
        self.consumer_dead_lettered_total = Counter(
            "outbox_consumer_dead_lettered",
            "Entries moved to the dead-letter stream and recorded as NEEDS_ATTENTION.",
            ["group", "stream"],
            registry=r,
        )
        self.consumer_group_lag = Gauge(
            "outbox_consumer_group_lag",
            "Entries in the stream not yet delivered to the group (XINFO GROUPS lag; "
            "keeps its last value while Redis cannot tell).",
            ["group", "stream"],
            registry=r,
        )
        self.consumer_group_pending = Gauge(
            "outbox_consumer_group_pending",
            "Entries delivered to the group but not acknowledged (XINFO GROUPS pending).",
            ["group", "stream"],
            registry=r,
        )
        self.consumer_last_success = Gauge(
            "outbox_consumer_last_success_timestamp_seconds",
            "Unix time of the consumer's last batch that completed without an "
            "infrastructure error.",
            registry=None,
        )

        # -- worker -----------------------------------------------------------------------
        self.worker_jobs_finished_total = Counter(
            "outbox_worker_jobs_finished",
            "Job handler runs, by action and outcome (done, retry, waiting, failed, ...).",
            ["action", "outcome"],
            registry=r,
        )
        self.worker_job_duration_seconds = Histogram(
            "outbox_worker_job_duration_seconds",
            "Duration of one job handler run, by action.",
            ["action"],
            buckets=JOB_BUCKETS,
            registry=r,
        )
        self.worker_lease_conflicts_total = Counter(
            "outbox_worker_lease_conflicts",
            "Times a worker was fenced out: its (job, epoch) compare-and-set found a newer lease.",
            ["action"],
            registry=r,
        )
        self.worker_slots_busy = Gauge(
            "outbox_worker_slots_busy",
            "Slots of this worker holding a job now (jobs in flight).",
            registry=r,
        )
        self.worker_slots_total = Gauge(
            "outbox_worker_slots", "Slots of this worker (--concurrency).", registry=r
        )
        self.worker_queue_slots_busy = Gauge(
            "outbox_worker_queue_slots_busy",
            "Slots of a queue holding a job now, per group of this worker's slots (queue: "
            'the queue that has them as its own, "*": the slots its other queues share).',
            ["queue"],
            registry=r,
        )
        self.worker_queue_slots_total = Gauge(
            "outbox_worker_queue_slots",
            'Slots of each group of this worker\'s slots (--queues NAME=N; "*": the rest).',
            ["queue"],
            registry=r,
        )
        self.provider_limit_waiting_jobs = Gauge(
            "outbox_provider_limit_waiting",
            "Jobs of this process waiting in their slot on a provider's limit (its rate_limit "
            "or its adaptive calls in flight).",
            ["provider"],
            registry=r,
        )
        self.provider_limit_calls = Gauge(
            "outbox_provider_limit",
            "Calls in flight this process allows a provider (its adaptive limit), from its "
            "first change; the log line 'provider limit fell' says why it fell.",
            ["provider"],
            registry=r,
        )
        self.provider_pauses_total = Counter(
            "outbox_provider_pauses",
            "Times a provider answered 429/503 with Retry-After and was paused for the fleet.",
            ["provider"],
            registry=r,
        )
        self.provider_paused_until = Gauge(
            "outbox_provider_paused_until_timestamp_seconds",
            "Unix time (database clock) until which the provider is paused, as this process "
            "last paused it.",
            ["provider"],
            registry=r,
        )
        self.worker_jobs_started_total = Counter(
            "outbox_worker_jobs_started",
            "Job handler runs started, by queue (at most max_queue_labels queues; the rest "
            'are counted as queue="other").',
            ["queue"],
            registry=r,
        )
        self.worker_job_wait_seconds = Histogram(
            "outbox_worker_job_wait_seconds",
            "From a job's enqueue (database clock) to its handler's start, by queue.",
            ["queue"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_tenant_limit_waiting_jobs = Gauge(
            "outbox_worker_jobs_waiting_tenant_limit",
            "READY jobs whose tenant is at this worker's tenant limit (they wait, holding no "
            "lease, while other tenants run).",
            registry=r,
        )
        self.worker_last_success = Gauge(
            "outbox_worker_last_success_timestamp_seconds",
            "Unix time of the worker's last loop iteration without an infrastructure error.",
            registry=None,
        )

    # -- relay ----------------------------------------------------------------------------
    def _register_relay(self) -> None:
        # A histogram without labels exports its buckets at once, count 0: only a process
        # that runs a relay (its first cycle calls a relay hook) exports the relay's, not a
        # consumer's, a worker's or the standalone exporter's /metrics (issue 26).
        for histogram in (
            self.relay_batch_duration_seconds,
            self.relay_batch_size,
            self.relay_commit_to_stream_seconds,
        ):
            self._register_once(histogram)

    def relay_published(self, topic: str, count: int, latencies_seconds: list[float]) -> None:
        self._register_relay()
        if count > 0:
            self.relay_published_total.labels(_label(topic)).inc(count)
        observe = self.relay_commit_to_stream_seconds.observe
        for latency in latencies_seconds:
            # Clock skew between the database and this host can make a latency negative.
            observe(max(0.0, float(latency)))

    def relay_publish_error(self, error_class: str, topic: str | None) -> None:
        self.relay_publish_errors_total.labels(_label(error_class)).inc()

    def relay_batch(self, duration_seconds: float, size: int) -> None:
        self._register_relay()
        self.relay_batch_duration_seconds.observe(max(0.0, float(duration_seconds)))
        self.relay_batch_size.observe(max(0, int(size)))

    def relay_reconciled(self, found_in_stream: int, republished: int) -> None:
        if found_in_stream > 0:
            self.relay_reconciled_total.labels("found_in_stream").inc(found_in_stream)
        if republished > 0:
            self.relay_reconciled_total.labels("republished").inc(republished)

    def relay_quarantined(self, topic: str, count: int) -> None:
        if count > 0:
            self.relay_quarantined_total.labels(_label(topic)).inc(count)

    def relay_cycle_ok(self, timestamp: float) -> None:
        self._register_relay()
        self._register_once(self.relay_last_success)
        self.relay_last_success.set(float(timestamp))

    def relay_redis_persistence(self, mode: str) -> None:
        for known in PERSISTENCE_MODES:
            self.relay_redis_persistence_mode.labels(known).set(1.0 if known == mode else 0.0)

    def relay_redis_data_loss(self, timestamp: float) -> None:
        self._register_once(self.relay_redis_data_loss_at)
        self.relay_redis_data_loss_at.set(float(timestamp))

    # -- consumer -------------------------------------------------------------------------
    def consumer_handled(self, group: str, stream: str, count: int) -> None:
        if count > 0:
            self.consumer_handled_total.labels(_label(group), _label(stream)).inc(count)

    def consumer_duplicate(self, group: str, count: int) -> None:
        if count > 0:
            self.consumer_duplicates_total.labels(_label(group)).inc(count)

    def consumer_dead_lettered(self, group: str, stream: str, count: int) -> None:
        if count > 0:
            self.consumer_dead_lettered_total.labels(_label(group), _label(stream)).inc(count)

    def consumer_lag(self, group: str, stream: str, lag: int | None, pending: int) -> None:
        labels = (_label(group), _label(stream))
        if lag is not None:
            self.consumer_group_lag.labels(*labels).set(max(0, int(lag)))
        self.consumer_group_pending.labels(*labels).set(max(0, int(pending)))

    def consumer_cycle_ok(self, timestamp: float) -> None:
        self._register_once(self.consumer_last_success)
        self.consumer_last_success.set(float(timestamp))

    # -- worker ---------------------------------------------------------------------------
    def worker_job_started(
        self,
        action: str,
        *,
        job_id: int | None = None,
        queue: str | None = None,
        kind: str | None = None,
        enqueued_at: float | None = None,
    ) -> None:
        label = self._queue_label(queue)
        self._child(self.worker_jobs_started_total, label).inc()
        if enqueued_at is not None:
            self._child(self.worker_job_wait_seconds, label).observe(
                max(0.0, time.time() - float(enqueued_at))
            )

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once per series: a worker reports every job
        (``labels`` costs ~1.6 us a call, a third of a per-job hook). Bounded like the series
        themselves (handler names, outcomes, bounded queue labels); nothing here removes a
        series, so a child stays the series' own."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def worker_tenant_limit_waiting(self, jobs: int) -> None:
        self.worker_tenant_limit_waiting_jobs.set(max(0, int(jobs)))

    def _queue_label(self, queue: str | None) -> str:
        # Queues are few by design; a bound keeps a misuse (one queue per customer) from
        # growing the series without end: the first max_queue_labels names keep their own.
        name = _label(queue, "default")
        if name in self._queues:
            return name
        with self._register_lock:
            if len(self._queues) < self.max_queue_labels:
                self._queues.add(name)
                return name
        return "other"

    def worker_job_finished(
        self,
        action: str,
        outcome: str,
        duration_seconds: float,
        *,
        job_id: int | None = None,
        queue: str | None = None,
        kind: str | None = None,
        enqueued_at: float | None = None,
    ) -> None:
        self._child(self.worker_jobs_finished_total, _label(action), _label(outcome)).inc()
        self._child(self.worker_job_duration_seconds, _label(action)).observe(
            max(0.0, float(duration_seconds))
        )

    def worker_lease_conflict(self, action: str) -> None:
        self.worker_lease_conflicts_total.labels(_label(action)).inc()

    def worker_cycle_ok(self, timestamp: float) -> None:
        self._register_once(self.worker_last_success)
        self.worker_last_success.set(float(timestamp))

    def worker_slots(self, busy: int, total: int) -> None:
        self.worker_slots_busy.set(max(0, int(busy)))
        self.worker_slots_total.set(max(0, int(total)))

    def worker_queue_slots(self, queue: str, busy: int, total: int) -> None:
        # Bounded: one series per group of the worker's slots (its configuration).
        self._child(self.worker_queue_slots_busy, _label(queue)).set(max(0, int(busy)))
        self._child(self.worker_queue_slots_total, _label(queue)).set(max(0, int(total)))

    def provider_limit_waiting(self, provider: str, delta: int) -> None:
        self.provider_limit_waiting_jobs.labels(_label(provider)).inc(int(delta))

    def provider_limit(self, provider: str, limit: int, *, reason: str | None) -> None:
        self.provider_limit_calls.labels(_label(provider)).set(int(limit))

    def provider_paused(self, provider: str, seconds: float, until: float) -> None:
        self.provider_pauses_total.labels(_label(provider)).inc()
        self.provider_paused_until.labels(_label(provider)).set(float(until))

    def _register_once(self, metric: Gauge | Histogram) -> None:
        # The last-success gauges appear only once a part reports a cycle: a consumer process
        # must not export a relay's "last success 0" that a stalled-relay alert would read.
        if id(metric) not in self._registered:
            with self._register_lock:
                if id(metric) not in self._registered:
                    self.registry.register(metric)
                    self._registered.add(id(metric))

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def port(self) -> int | None:
        """The port the exporter listens on (useful after ``start_metrics(0)``), or None."""
        return int(self.server.server_port) if self.server is not None else None

    def close(self) -> None:
        """Stop the HTTP exporter started with these hooks, if any (idempotent)."""
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        thread, self._server_thread = self._server_thread, None
        if thread is not None:
            thread.join(timeout=5)


def hook_names() -> Iterable[str]:
    """The public hook methods of :class:`outbox.hooks.Hooks` (for completeness tests)."""
    return sorted(n for n in vars(Hooks) if not n.startswith("_") and callable(vars(Hooks)[n]))
