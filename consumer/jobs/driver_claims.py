"""The job driver's claim statements: one job locked and leased (an operator's or a test's
claim), the tenant limit's count, and the fair batch claim each dialect writes its own way. A
mixin of :class:`consumer.jobs.driver.JobDriver`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.engine import Connection

from consumer.jobs import queries as q
from consumer.jobs.schema import jobs
from consumer.jobs.states import LEASED


class ClaimStatements(ABC):
    """Claims: lock and lease one job, count a tenant's leases, the batch claim."""

    job_claim_finishes = False
    """``job_claim_batch`` also finishes ``params["finishing"]`` (``Store.finish_and_claim``)."""

    def job_lock_for_claim(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        """Lock one job row (PostgreSQL; SQLite holds its write lock already) so a claim's
        check and move are one step."""
        return conn.execute(
            select(
                jobs.c.id,
                jobs.c.queue,
                jobs.c.tenant,
                jobs.c.state,
                jobs.c.run_after,
                jobs.c.lease_owner,
                jobs.c.lease_epoch,
                jobs.c.lease_expires_at,
                jobs.c.attempts,
                jobs.c.cancel_requested_at,
            )
            .where(where)
            .with_for_update()
        ).first()

    def job_lease(
        self,
        conn: Connection,
        job_id: int,
        state: str,
        epoch: int,
        worker: str,
        expires_at: float,
        clock: float,
    ) -> bool:
        """Lease the job read as ``(state, epoch)`` to ``worker`` with the next epoch."""
        moved = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.state == state, jobs.c.lease_epoch == epoch)
            .values(
                state=LEASED,
                lease_owner=worker,
                lease_epoch=epoch + 1,
                lease_expires_at=expires_at,
                attempts=jobs.c.attempts + 1,
                updated_at=clock,
            )
            .returning(jobs.c.id)
        ).first()
        return moved is not None

    def job_tenant_leased(self, conn: Connection, queue: str, tenant: str, cap: int) -> int:
        """How many jobs of ``tenant`` are LEASED in ``queue`` (at most ``cap`` counted), for a
        claim under a tenant limit: race-safe until the caller's transaction ends (SQLite: its
        write lock; PostgreSQL: the tenant's advisory lock, taken first)."""
        params = {"queue": queue, "tenant": tenant, "cap": cap}
        return int(conn.execute(q.sqlite_leased_count(), params).scalar_one())

    @abstractmethod
    def job_claim_batch(
        self, conn: Connection, params: dict[str, Any], now_given: bool
    ) -> Sequence[Any]:
        """Lease up to ``params["limit"]`` READY jobs fairly across tenants; rows carry
        ``consumer.jobs.queries.LEASE_COLUMNS``.

        ``params``: ``cursor``, ``max_tenants``, ``limit``, ``worker``, ``ttl`` (and ``now``
        when ``now_given``); the filters ``queues`` (names, or None: every queue), ``routes``
        (handler names, or None: every job) and the tenant limit ``tenant_limit`` (None: no
        default limit) with its overrides ``tenant_limits`` (tenant to limit). Paused queues
        are never claimed from. Where :attr:`job_claim_finishes`, ``finishing`` ((job id,
        epoch) pairs of ``worker``'s leases) are finished by the same statement, each coming
        back as a row with its ``id`` and a NULL ``lease_epoch``."""
