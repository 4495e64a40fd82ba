"""SQLite's job driver: every write transaction takes the database's write lock up front
(``BEGIN IMMEDIATE``), so the claim picks its rows in a few statements without row locks, and
the batch finish is a loop of fenced updates in that one transaction.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from consumer.jobs import queries as q
from consumer.jobs.driver_base import _NO_TIMER, JobDriver
from consumer.jobs.schema import (
    jobs,
)
from consumer.jobs.states import DONE


class SqliteJobDriver(JobDriver):
    """SQLite: every write transaction holds the database's write lock from its start
    (``BEGIN IMMEDIATE``), so picks and moves need no row locks."""

    name = "sqlite"

    def _prepare(self, conn: Connection) -> None:
        conn.execution_options(sqlite_begin="IMMEDIATE")

    def job_claim_batch(
        self, conn: Connection, params: dict[str, Any], now_given: bool
    ) -> Sequence[Any]:
        # The same rotating tenant scan as PostgreSQL's, then each tenant's share picked in
        # (priority desc, id) order, then one UPDATE ... RETURNING leasing the picked ids.
        scan = {k: params[k] for k in ("cursor", "max_tenants")}
        tenants = [r[0] for r in conn.execute(q.sqlite_tenants(), scan)]
        if not tenants:
            return []
        per = max(1, math.ceil(params["limit"] / len(tenants)))
        ids: list[int] = []
        for tenant in tenants:
            pick: dict[str, Any] = {"tenant": tenant, "per": per}
            if now_given:
                pick["now"] = params["now"]
            ids.extend(int(r[0]) for r in conn.execute(q.sqlite_pick(now_given), pick))
            if len(ids) >= params["limit"]:
                break
        ids = ids[: params["limit"]]
        if not ids:
            return []
        lease: dict[str, Any] = {"ids": json.dumps(ids), "worker": params["worker"]}
        lease["ttl"] = params["ttl"]
        if now_given:
            lease["now"] = params["now"]
        return conn.execute(q.sqlite_lease(now_given), lease).all()

    def job_finish_batch(
        self, conn: Connection, worker: str, leases: Sequence[tuple[int, int]], when: float | None
    ) -> list[int]:
        clock = self.clock_read(conn, when)
        done: list[int] = []
        moved = {
            "state": DONE,
            "lease_owner": None,
            "lease_expires_at": None,
            "updated_at": clock,
            **_NO_TIMER,
        }
        for job_id, epoch in leases:
            if self.job_update_fenced(conn, jobs.c.id == job_id, worker, epoch, moved) is None:
                continue
            self.attempt_insert(conn, job_id, epoch, worker, "done", None, clock)
            done.append(job_id)
        return done
