"""A worker whose database connections are cut while it drains (issue 53): what a failover,
a pooler restart or an operator's ``pg_terminate_backend`` does to a running worker.

``outbox-worker run tests.cut_app:build`` (16 slots, a ``def`` or an ``async def`` handler
that waits ~1 ms and dispatches every other job through a provider: claims, finishes,
intents, receipts, the heartbeat, the duties and LISTEN all hold connections) drains 3,000
jobs while the test
terminates every backend of the worker 16 times, at random points of the drain. The
worker's sessions are found by the ``application_name`` its URL carries.

It never exits by itself; every job ends DONE, none is left LEASED; no job ran twice under
one epoch (a job handed back after a cut runs again only under a new lease); every
dispatch's receipt is ACCEPTED; each loss of the connections is logged once, and so is each
recovery.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from consumer import Store
from tests.services import start_worker_app, wait_for

pytestmark = pytest.mark.slow

JOBS = 3000
CUTS = 16


def _count(engine: sa.Engine, state: str) -> int:
    with engine.connect() as conn:
        sql = "SELECT count(*) FROM outbox_jobs WHERE state = :state"
        return int(conn.execute(sa.text(sql), {"state": state}).scalar_one())


def _cut(admin: sa.Engine, name: str) -> int:
    """Terminate every backend of the worker's; how many there were."""
    with admin.connect() as conn:
        sql = (
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = :name AND pid <> pg_backend_pid()"
        )
        return int(conn.execute(sa.text(sql), {"name": name}).scalar_one())


def _log_lines(log: Path) -> list[dict[str, object]]:
    lines = []
    for text in log.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            lines.append({"level": "raw", "message": text})
    return lines


@pytest.mark.parametrize("handler", ["def", "async"])
def test_a_worker_outlives_its_connections_cut_16_times_while_it_drains(
    handler: str, pg_url: str, pg_schema: str, pg_admin_engine: sa.Engine, tmp_path: Path
) -> None:
    name = f"cut-{pg_schema}"
    url = f"{pg_url}&application_name={name}"
    runs, log = tmp_path / "runs.txt", tmp_path / "worker.log"
    store = Store(pg_url)
    engine = store.engine
    store.enqueue_many([{"tenant": f"t{i % 4}", "action": f"tick-{i}"} for i in range(JOBS)])
    worker = start_worker_app(
        "tests.cut_app:build",
        {"OUTBOX_DATABASE_URL": url, "CUT_RUNS": str(runs), "CUT_HANDLER": handler},
        log,
    )
    rng = random.Random()
    points = sorted(rng.sample(range(30, JOBS - 300), CUTS))  # DONE counts to cut at
    cut: list[int] = []

    def reached(done: int) -> bool:
        return worker.poll() is not None or _count(engine, "DONE") >= done

    try:
        for point in points:
            wait_for(
                lambda: reached(point),  # noqa: B023 - called before the loop moves on
                f"{point} jobs DONE",
                timeout=120,
                diagnose=lambda: log.read_text()[-3000:],
            )
            assert worker.poll() is None, log.read_text()[-3000:]
            # The worker's sessions, once they are back after the last cut.
            cut.append(wait_for(lambda: _cut(pg_admin_engine, name), "the worker's sessions"))
        wait_for(
            lambda: reached(JOBS),
            "every job DONE",
            timeout=180,
            diagnose=lambda: log.read_text()[-3000:],
        )
        assert worker.poll() is None, log.read_text()[-3000:]  # never exited by itself
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
        try:
            code = worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            raise
    assert code == 0, log.read_text()[-3000:]
    assert len(cut) == CUTS and min(cut) >= 1
    assert _count(engine, "DONE") == JOBS
    assert _count(engine, "LEASED") == 0
    lines = [line.split() for line in runs.read_text().splitlines()]
    assert {int(job) for job, _ in lines} == set(range(1, JOBS + 1))
    # No job ran twice under one epoch: a job handed back after a cut ran under a new lease.
    assert max(Counter((job, epoch) for job, epoch in lines).values()) == 1
    with engine.connect() as conn:
        sql = "SELECT state, count(*) FROM outbox_operations GROUP BY state"
        receipts = {state: count for state, count in conn.execute(sa.text(sql))}
    assert receipts == {"ACCEPTED": JOBS // 2}  # every dispatch's receipt, none left open
    messages = Counter(str(entry["message"]) for entry in _log_lines(log))
    lost = messages["database connection lost; retrying on new connections"]
    assert 1 <= lost <= CUTS * 2  # once per outage, not once per statement cut
    assert messages["database connection back"] == lost
    levels = Counter(str(entry["level"]) for entry in _log_lines(log))
    assert set(levels) <= {"warning", "info"}, messages  # no error, no traceback
    store.dispose()
