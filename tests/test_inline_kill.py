"""A SIGKILL mid-drain with jobs of every shape in one queue (no-op, 1, 5 and 50 ms ``def``
handlers, a 1 ms ``async def`` one): a real worker process killed while jobs run and their
finishes wait for the next statement, another started. Every job ends DONE with one finish;
no job ran twice under one epoch (a rerun always took a new lease)."""

from __future__ import annotations

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
KINDS = ("w0", "w1", "w5", "w50", "a1")


def _worker(pg_url: str, runs: Path, log: Path) -> subprocess.Popen[str]:
    env = {"OUTBOX_DATABASE_URL": pg_url, "INLINE_RUNS": str(runs)}
    return start_worker_app("tests.inline_app:build", env, log)


def _done(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        sql = "SELECT count(*) FROM outbox_jobs WHERE state = 'DONE'"
        return int(conn.execute(sa.text(sql)).scalar_one())


def test_a_sigkill_mid_drain_with_jobs_of_every_shape_reruns_only_with_a_new_epoch(
    pg_url: str, tmp_path: Path
) -> None:
    runs, log = tmp_path / "runs.txt", tmp_path / "workers.log"
    store = Store(pg_url)
    engine = store.engine
    store.enqueue_many(
        [
            {"tenant": f"t{i % 4}", "action": f"job-{i}", "kind": KINDS[i % len(KINDS)]}
            for i in range(JOBS)
        ]
    )
    first = _worker(pg_url, runs, log)
    try:
        wait_for(lambda: _done(engine) >= 500, "the first worker to finish some jobs", 120)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        before = runs.read_text().splitlines()
        second = _worker(pg_url, runs, log)
        try:
            wait_for(lambda: _done(engine) == JOBS, "every job DONE after the restart", 180)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert len(before) < JOBS  # the kill came mid-drain
    lines = [line.split() for line in runs.read_text().splitlines()]
    ran = Counter(int(job) for job, _, _ in lines)
    assert len(ran) == JOBS  # every job ran
    assert {kind for _, _, kind in lines} == set(KINDS)
    # No job ran twice under one epoch: a rerun always took a new lease.
    assert max(Counter((job, epoch) for job, epoch, _ in lines).values()) == 1
    with engine.connect() as conn:
        finishes = conn.execute(
            sa.text(
                "SELECT count(*), count(DISTINCT job_id) FROM outbox_job_attempts "
                "WHERE outcome = 'done'"
            )
        ).one()
    assert tuple(finishes) == (JOBS, JOBS)  # one finish per job, whatever ran twice
    store.dispose()
