"""Lifecycle hooks: how metrics (or anything else) observe the relay, consumers and workers.

The core never imports prometheus-client. Each long-running part takes a ``hooks`` object
(default: this no-op base) and calls these methods at the points named below;
``metrics.PrometheusHooks`` implements them with an injected registry. A hook must be cheap
and must not raise; the parts call hooks through :func:`call_hook`, the one guard that keeps a
failing hook from breaking a relay, consumer or worker.
Label values passed here are bounded (topics, groups, error classes, outcomes), never ids.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger("outbox.hooks")


class Hooks:
    """No-op base. Override what you observe."""

    # -- relay ----------------------------------------------------------------------------
    def relay_published(self, topic: str, count: int, latencies_seconds: list[float]) -> None:
        """``count`` events of ``topic`` reached their stream; commit-to-stream latencies."""

    def relay_publish_error(self, error_class: str, topic: str | None) -> None:
        """A publish failed; ``error_class`` is ``transient`` / ``permanent`` or the
        exception's class name."""

    def relay_batch(self, duration_seconds: float, size: int) -> None:
        """One claim-publish-record cycle finished."""

    def relay_reconciled(self, found_in_stream: int, republished: int) -> None:
        """Orphaned intents were reconciled against the stream."""

    def relay_quarantined(self, topic: str, count: int) -> None:
        """Records were quarantined (permanent failures)."""

    def relay_cycle_ok(self, timestamp: float) -> None:
        """A cycle completed without an infrastructure error (unix time)."""

    def relay_redis_persistence(self, mode: str) -> None:
        """Redis's persistence, checked at start and every minute: ``aof``, ``rdb``,
        ``none`` or ``unknown`` (CONFIG refused)."""

    def relay_redis_data_loss(self, timestamp: float) -> None:
        """The relay found that Redis lost entries it had acknowledged (unix time)."""

    # -- consumer -------------------------------------------------------------------------
    def consumer_handled(self, group: str, stream: str, count: int) -> None:
        """Entries handled and acknowledged."""

    def consumer_duplicate(self, group: str, count: int) -> None:
        """Entries whose business identity was already in the inbox (skipped, acknowledged)."""

    def consumer_dead_lettered(self, group: str, stream: str, count: int) -> None:
        """Entries moved to the dead-letter stream and NEEDS_ATTENTION."""

    def consumer_lag(self, group: str, stream: str, lag: int | None, pending: int) -> None:
        """Group lag and pending count read from XINFO GROUPS."""

    def consumer_cycle_ok(self, timestamp: float) -> None:
        """A consumer batch completed without an infrastructure error (unix time)."""

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
        """A worker starts a job's handler (``action``: the handler's name, bounded). Which
        job: ``job_id``, its ``queue`` and ``kind``, and ``enqueued_at`` (unix seconds,
        database clock), so an observer can measure enqueue -> start per job. Never use
        ``job_id`` as a metric label."""

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
        """A job's handler ended with ``outcome`` (done, retry, waiting, failed, ...); the
        job's facts as in :meth:`worker_job_started` (enqueue -> finish per job)."""

    def worker_tenant_limit_waiting(self, jobs: int) -> None:
        """READY jobs whose tenant is at the worker's tenant limit (read every recovery
        interval by workers that have a limit)."""

    def worker_lease_conflict(self, action: str) -> None:
        """A worker lost a compare-and-set on (job, epoch): it was fenced out."""

    def worker_cycle_ok(self, timestamp: float) -> None:
        """A worker loop iteration completed without an infrastructure error (unix time)."""

    def worker_slots(self, busy: int, total: int) -> None:
        """A worker's slots changed: ``busy`` of ``total`` hold a job now."""

    def worker_queue_slots(self, queue: str, busy: int, total: int) -> None:
        """One group of a worker's slots changed (``WorkerConfig.slot_pools``): ``queue`` is
        the queue that has them as its own, or ``*`` for the slots its other queues share;
        ``busy`` of ``total`` hold a job now."""

    def provider_limit_waiting(self, provider: str, delta: int) -> None:
        """A job started (+1) or stopped (-1) waiting on a provider's limit (its rate, or
        its calls in flight), holding its slot."""

    def provider_paused(self, provider: str, seconds: float, until: float) -> None:
        """A 429/503 with Retry-After paused ``provider`` for every worker until ``until``."""

    def provider_limit(self, provider: str, limit: int, *, reason: str | None) -> None:
        """The calls in flight this process allows ``provider`` changed to ``limit``:
        ``reason`` says why it fell (a timeout, or the median latency over its threshold);
        None when it grew."""


NO_HOOKS = Hooks()


def call_hook(hooks: Hooks, name: str, *args: Any, **facts: Any) -> None:
    """Call ``hooks.<name>(*args, **facts)``; a hook that raises is logged (warning, with the
    traceback) and otherwise ignored: observing must never break the observed loop.

    Keyword ``facts`` a hook does not declare are left out: an observer written before a hook
    gained them (``worker_job_finished(self, action, outcome, duration_seconds)``) keeps
    working."""
    if _inert(type(hooks), name) and name not in getattr(hooks, "__dict__", ()):
        return  # the base class's no-op: nothing to look up or call (a worker's hot path)
    try:
        method = getattr(hooks, name)
        if facts:
            accepted = _accepted_keywords(type(hooks), name, method)
            if accepted is not None:
                facts = {k: v for k, v in facts.items() if k in accepted}
        method(*args, **facts)
    except Exception:
        log.warning("hook %s failed", name, exc_info=True, extra={"fields": {"hook": name}})


_KEYWORDS: dict[tuple[type, str], frozenset[str] | None] = {}
_INERT: dict[tuple[type, str], bool] = {}


def _inert(cls: type, name: str) -> bool:
    """``cls`` keeps :class:`Hooks`' own no-op for the hook ``name`` (once per class)."""
    key = (cls, name)
    found = _INERT.get(key)
    if found is None:
        base = getattr(Hooks, name, None)
        found = _INERT[key] = base is not None and getattr(cls, name, None) is base
    return found


def _accepted_keywords(cls: type, name: str, method: Any) -> frozenset[str] | None:
    """The keyword parameters of a hook method (None: it takes ``**kwargs``), once per class."""
    key = (cls, name)
    if key not in _KEYWORDS:
        try:
            parameters = inspect.signature(method).parameters.values()
        except (TypeError, ValueError):
            _KEYWORDS[key] = None
        else:
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
                _KEYWORDS[key] = None
            else:
                _KEYWORDS[key] = frozenset(
                    p.name
                    for p in parameters
                    if p.kind
                    in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                )
    return _KEYWORDS[key]
