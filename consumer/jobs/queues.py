"""The store's queues: depth, pause and resume, and the READY jobs a tenant limit holds
back. A part of ``Store`` (``consumer.jobs.base``), every statement through its driver.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from consumer.jobs.base import StoreBase
from consumer.jobs.checks import (
    Time,
    valid_limit,
    valid_limits,
    valid_name,
    valid_names,
    valid_time,
)
from consumer.jobs.rows import QueueDepth


class QueueMethods(StoreBase):
    """``Store``'s queue methods."""

    # -- queues --------------------------------------------------------------------------

    def depth(self, queue: str | None = None) -> dict[str, QueueDepth]:
        """READY jobs and the oldest eligible READY job's age per queue (``queue``: that one
        only, present even when empty), paused queues included. Read from the READY index:
        O(ready), never the DONE history."""
        if queue is not None:
            valid_name("queue", queue)
        with self.driver.connect() as conn:
            rows = self.driver.job_depth(conn, queue)
            paused = self.driver.queue_paused_list(conn)
        found: dict[str, QueueDepth] = {}
        for name, ready, age in rows:
            found[str(name)] = QueueDepth(
                queue=str(name),
                ready=int(ready),
                oldest_ready_age_seconds=max(0.0, float(age)) if age is not None else 0.0,
                paused=name in paused,
            )
        extra = [queue] if queue is not None else sorted(paused)
        for name in extra:
            if name not in found and (queue is None or name == queue):
                found[name] = QueueDepth(name, 0, 0.0, paused=name in paused)
        return dict(sorted(found.items()))

    def pause_queue(self, queue: str, *, now: Time | None = None) -> bool:
        """Stop every worker claiming from ``queue`` (jobs in hand run to their end; new jobs
        are still enqueued). True if it was running. Idempotent."""
        valid_name("queue", queue)
        when = valid_time("now", now)
        with self.driver.begin() as conn:
            return self.driver.queue_pause(conn, queue, self._clock(conn, when))

    def resume_queue(self, queue: str) -> bool:
        """Let workers claim from ``queue`` again; True if it was paused. Idempotent."""
        valid_name("queue", queue)
        with self.driver.begin() as conn:
            resumed = self.driver.queue_resume(conn, queue)
            if resumed:
                self.driver.job_ready_notify(conn)  # idle workers claim at once
        return resumed

    def paused_queues(self) -> list[str]:
        """The paused queues, by name."""
        with self.driver.connect() as conn:
            return sorted(self.driver.queue_paused_list(conn))

    def waiting_on_tenant_limit(
        self,
        tenant_limit: int | None = None,
        tenant_limits: Mapping[str, int] | None = None,
        *,
        queues: Iterable[str] | None = None,
    ) -> int:
        """READY jobs whose tenant is at its limit in their queue (what a claim with these
        limits skips now). O(leased) plus the READY jobs of the tenants at their limit."""
        default = valid_limit("tenant_limit", tenant_limit)
        limits = valid_limits(tenant_limits)
        wanted = valid_names("queues", queues)
        if default is None and not limits:
            return 0
        waiting = 0
        with self.driver.connect() as conn:
            for queue, tenant, leased in self.driver.job_leased_by_tenant(conn):
                cap = limits.get(tenant, default)
                if cap is None or leased < cap or (wanted is not None and queue not in wanted):
                    continue
                waiting += self.driver.job_ready_count(conn, queue, tenant)
        return waiting
