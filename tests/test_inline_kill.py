"""A SIGKILL while the claims' own thread runs quick handlers (``consumer.jobs.claim_runs``):
a real worker process killed mid-drain, another started. Every job ends
DONE with one finish; no job ran twice under one epoch (a rerun always took a new lease);
and the runs before the kill were made in the claims' thread."""

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

JOBS = 6000


def _worker(pg_url: str, runs: Path, log: Path) -> subprocess.Popen[str]:
    env = {"OUTBOX_DATABASE_URL": pg_url, "INLINE_RUNS": str(runs)}
    return start_worker_app("tests.inline_app:build", env, log)


def _in_claims(text: str) -> bool:
    """Whether a run was made in a claims' thread (``<worker>-db_N``; slots: ``-slot_N``)."""
    return "-db_" in text


def _done(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        sql = "SELECT count(*) FROM outbox_jobs WHERE state = 'DONE'"
        return int(conn.execute(sa.text(sql)).scalar_one())


def test_a_sigkill_while_claims_run_quick_handlers_reruns_only_with_a_new_epoch(
    pg_url: str, tmp_path: Path
) -> None:
    runs, log = tmp_path / "runs.txt", tmp_path / "workers.log"
    store = Store(pg_url)
    engine = store.engine
    store.enqueue_many([{"tenant": f"t{i % 4}", "action": f"tick-{i}"} for i in range(JOBS)])
    first = _worker(pg_url, runs, log)
    try:
        # Killed mid-drain, once its claims' thread runs the handlers.
        wait_for(
            lambda: runs.exists() and _in_claims(runs.read_text()) and _done(engine) >= 1000,
            "the first worker to run jobs in its claims' thread",
            timeout=60,
        )
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        before = runs.read_text().splitlines()
        second = _worker(pg_url, runs, log)
        try:
            wait_for(lambda: _done(engine) == JOBS, "every job DONE after the restart", 120)
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
    # No job ran twice under one epoch: a rerun always took a new lease.
    assert max(Counter((job, epoch) for job, epoch, _ in lines).values()) == 1
    assert any(_in_claims(thread) for _, _, thread in lines)
    with engine.connect() as conn:
        finishes = conn.execute(
            sa.text(
                "SELECT count(*), count(DISTINCT job_id) FROM outbox_job_attempts "
                "WHERE outcome = 'done'"
            )
        ).one()
    assert tuple(finishes) == (JOBS, JOBS)  # one finish per job, whatever ran twice
    store.dispose()
