"""The worker app of tests/test_finish_kill.py: a provider whose effects are
rows in a table of the test's own schema (written on its own connection, so an effect
survives the worker's SIGKILL, as a real provider's would), and every run recorded with
its lease's epoch before the handler dispatches."""

from __future__ import annotations

import os
import uuid
from typing import Any

import sqlalchemy as sa

from consumer import Store, Worker

URL = os.environ["OUTBOX_DATABASE_URL"]
_side = sa.create_engine(URL, isolation_level="AUTOCOMMIT", pool_size=4)


class TableProvider:
    """Effects are rows of ``effects``; lookup by operation id."""

    name = "mail"
    supports_lookup = True
    supports_idempotency = False
    timeout = 5.0

    def send(self, request: Any, *, operation_id: str, idempotency_key: str) -> str:
        ref = uuid.uuid4().hex
        with _side.connect() as conn:
            conn.execute(
                sa.text("INSERT INTO effects (operation_id, ref) VALUES (:o, :r)"),
                {"o": operation_id, "r": ref},
            )
        return ref

    def lookup(self, operation_id: str) -> str | None:
        with _side.connect() as conn:
            return conn.execute(
                sa.text("SELECT ref FROM effects WHERE operation_id = :o"), {"o": operation_id}
            ).scalar()


def build() -> Worker:
    worker = Worker(
        Store(URL),
        providers={"mail": TableProvider()},
        concurrency=16,
        liveness_ttl=2.0,
        liveness_interval=0.5,
        recover_interval=0.5,
    )

    @worker.handler("send")
    def send(job: Any) -> None:
        with _side.connect() as conn:
            conn.execute(
                sa.text("INSERT INTO runs (job_id, epoch) VALUES (:j, :e)"),
                {"j": job.job_id, "e": job.lease.epoch},
            )
        job.dispatch("email", "mail", {"to": job.subject})

    return worker
