"""The store's batch claims: the fair claim of a worker's free slots, and the claim that also
writes the finishes of the slots it takes (``finish_and_claim``, the worker's default path).

Part of :class:`consumer.jobs.store.Store` (see the store's module docstring for the
contract: fairness, fencing, time).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from consumer.errors import JobError
from consumer.jobs.batch_moves import BatchMoves, leases_by_worker
from consumer.jobs.checks import (
    Time,
    valid_limit,
    valid_limits,
    valid_name,
    valid_names,
    valid_time,
    valid_ttl,
)
from consumer.jobs.queries import LEASE_COLUMNS
from consumer.jobs.replies import watermark
from consumer.jobs.rows import BatchResult, Lease, lease_from_row
from consumer.jobs.steps import plain
from outbox.outage import report_failure
from outbox.validate import check_number

log = logging.getLogger("outbox.worker")

_EPOCH = LEASE_COLUMNS.index("lease_epoch")


class BatchClaims(BatchMoves):
    """Claim many jobs in one statement, fairly across tenants."""

    _cursor: str  # fairness rotation: the tenant served first by the last claim
    _cursor_lock: threading.Lock

    def claim_next(
        self,
        worker: str,
        ttl: float = 30,
        *,
        now: Time | None = None,
        queues: Iterable[str] | None = None,
        routes: Iterable[str] | None = None,
        tenant_limit: int | None = None,
        tenant_limits: Mapping[str, int] | None = None,
    ) -> Lease | None:
        """Claim one eligible job, fairly across tenants (see the module docstring), with
        :meth:`claim_batch`'s filters."""
        leases = self.claim_batch(
            worker,
            1,
            ttl,
            now=now,
            queues=queues,
            routes=routes,
            tenant_limit=tenant_limit,
            tenant_limits=tenant_limits,
        )
        return leases[0] if leases else None

    def claim_batch(
        self,
        worker: str,
        limit: int,
        ttl: float = 30,
        *,
        now: Time | None = None,
        queues: Iterable[str] | None = None,
        routes: Iterable[str] | None = None,
        tenant_limit: int | None = None,
        tenant_limits: Mapping[str, int] | None = None,
    ) -> list[Lease]:
        """Claim up to ``limit`` eligible jobs in one short transaction, round robin over
        tenants within each queue; each gets its own epoch. PostgreSQL: one statement, FOR
        UPDATE SKIP LOCKED.

        Filters, all inside that one statement:

        - ``queues``: claim only from these queues (None: every queue). Paused queues
          (:meth:`pause_queue`) are never claimed from.
        - ``routes``: only jobs these handler names can run, as ``Worker.route`` decides
          (the kind is a name; without kind, the action is a name or starts with a name and
          one of ``-:/.#_``). None: every job. A worker passes its handlers' names, so it
          never claims a job it would have to park for lack of a handler.
        - ``tenant_limit`` / ``tenant_limits`` (tenant -> limit, overriding the default):
          at most that many jobs of one tenant LEASED at once in a queue, counted over every
          worker on the database. A tenant at its limit is skipped: its jobs stay READY,
          holding no lease. Race-safe on PostgreSQL (a per-tenant advisory lock and a count
          taken after it, ``queries.PG_TENANT_ROOM_SQL``) and on SQLite (the write lock).
        """
        params = self._claim_params(
            worker, limit, ttl, now, queues, routes, tenant_limit, tenant_limits
        )
        if params is None:
            return []  # nothing this worker could take
        return self._claimed(self._claim_rows(params), params["cursor"])

    def finish_and_claim(
        self,
        finished: Sequence[Lease],
        worker: str,
        limit: int,
        ttl: float = 30,
        *,
        queues: Iterable[str] | None = None,
        routes: Iterable[str] | None = None,
        tenant_limit: int | None = None,
        tenant_limits: Mapping[str, int] | None = None,
    ) -> tuple[BatchResult, list[Lease]]:
        """:meth:`finish_batch` of ``worker``'s ``finished`` leases, then :meth:`claim_batch`
        of up to ``limit`` jobs for it (its slots those finishes free, and any other free
        one), with the same filters. The finishes commit no later than the claim: the worker
        never holds more leases than before, plus ``limit`` minus the jobs finished.

        PostgreSQL: one statement (``queries.pg_claim_batch(finishing=True)``), one round
        trip and one commit for both, when every lease is ``worker``'s and none has replies
        to consume, a result or dependents; otherwise the finish's statements and the
        claim in one transaction (one commit: a step's slot claims its next job, maybe the
        step it made READY, without a commit of its own). On SQLite the finish commits
        first, then the claim."""
        items, by_worker = leases_by_worker(finished)
        params = self._claim_params(
            worker, limit, ttl, None, queues, routes, tenant_limit, tenant_limits
        )
        together = (
            self.driver.job_claim_finishes
            and list(by_worker) == [worker]
            and all(watermark(x) is None and plain(x) for x in items)
        )
        if params is None or not together:
            return self._finish_then_claim(items, by_worker, params)
        params["finishing"] = by_worker[worker]
        ended: set[int] = set()
        claimed: list[Any] = []
        for row in self._claim_rows(params):  # LEASE_COLUMNS; a finish's epoch is NULL
            if row[_EPOCH] is None:
                ended.add(int(row[0]))
            else:
                claimed.append(row)
        result = BatchResult(
            done=sorted(ended),
            conflicts=sorted(x.job_id for x in items if x.job_id not in ended),
        )
        return result, self._claimed(claimed, params["cursor"])

    def _finish_then_claim(
        self,
        items: list[Lease],
        by_worker: dict[str, list[tuple[int, int]]],
        params: dict[str, Any] | None,
    ) -> tuple[BatchResult, list[Lease]]:
        """:meth:`finish_and_claim` of finishes its one statement cannot carry (or with
        nothing to claim): on PostgreSQL in the claim's transaction, one commit for both; on
        SQLite the finishes commit first, then the claim."""
        if params is not None and items and self.driver.job_claim_finishes:
            with self.driver.begin() as conn:  # both, or neither: retried whole
                written, woke = self._finish_in(conn, items, by_worker, None)
                rows = self.driver.job_claim_batch(conn, params, "now" in params)
            return self._finished(items, written, woke), self._claimed(rows, params["cursor"])
        result = self.finish_batch(items)
        if params is None:
            return result, []
        try:
            rows = self._claim_rows(params)
        except SQLAlchemyError as exc:
            # The finishes committed: say so (the caller must not write them again, and a
            # second write would be refused as fenced out); the claim is the next one's.
            report_failure(log, "claim after committed finishes failed; claimed next time", exc)
            return result, []
        return result, self._claimed(rows, params["cursor"])

    def _claim_params(
        self,
        worker: str,
        limit: int,
        ttl: float,
        now: Time | None,
        queues: Iterable[str] | None,
        routes: Iterable[str] | None,
        tenant_limit: int | None,
        tenant_limits: Mapping[str, int] | None,
    ) -> dict[str, Any] | None:
        """A claim's checked parameters (``now`` among them only when there is one); None
        when the filters leave nothing this worker could take."""
        valid_name("worker", worker)
        check_number("limit", limit, JobError, integer=True)
        seconds = valid_ttl(ttl)
        when = valid_time("now", now)
        if when is None and self.driver.clock is not None:
            when = self.driver.clock()
        with self._cursor_lock:
            cursor = self._cursor
        params: dict[str, Any] = {
            "cursor": cursor,
            "max_tenants": self.config.max_tenants_scanned,
            "limit": limit,
            "worker": worker,
            "ttl": seconds,
            "queues": valid_names("queues", queues),
            "routes": valid_names("routes", routes),
            "tenant_limit": valid_limit("tenant_limit", tenant_limit),
            "tenant_limits": valid_limits(tenant_limits),
        }
        if params["queues"] == [] or params["routes"] == []:
            return None
        if when is not None:
            params["now"] = when
        return params

    def _claim_rows(self, params: dict[str, Any]) -> Sequence[Any]:
        with self.driver.job_claim_scope() as conn:
            return self.driver.job_claim_batch(conn, params, "now" in params)

    def _claimed(self, rows: Sequence[Any], cursor: str) -> list[Lease]:
        """The leases of a claim's rows, in the rotation's order; the next claim's cursor."""
        leases = [lease_from_row(row) for row in rows]
        leases.sort(key=lambda lease: (lease.tenant <= cursor, lease.tenant, lease.job_id))
        if leases:
            with self._cursor_lock:
                self._cursor = leases[0].tenant
        return leases
