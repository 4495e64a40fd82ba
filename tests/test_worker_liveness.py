"""Worker liveness (issue 12): a killed worker's leases are taken back within seconds.

Each running Worker keeps a row in ``outbox_workers`` (alive until the database clock +
``liveness_ttl``); the survivors' beats take back the leases of a worker whose row expired,
fenced (the dead worker's late finish gets ``Conflict``). A live worker keeps its lease even
while its handler reports no progress; a lease without a liveness row waits for its expiry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from consumer.errors import Conflict
from consumer.jobs.schema import workers
from consumer.jobs.states import DONE, LEASED, READY
from consumer.jobs.store import Store
from consumer.jobs.worker import JobContext, Worker, WorkerConfig
from outbox.errors import ConfigError
from tests.services import wait_for

ROOT = Path(__file__).resolve().parent.parent
T = 1_900_000_000.0  # a fixed "now" (the tests pass it; no clock needed)


def _rows(store: Store) -> dict[str, float]:
    with store.engine.connect() as conn:
        return {r.name: float(r.alive_until) for r in conn.execute(sa.select(workers))}


def test_a_dead_workers_lease_goes_to_a_survivor_at_once(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "job-1", now=T)
    lease = store.claim_next("dead", ttl=30, now=T)
    assert lease is not None
    store.worker_alive("dead", 3, now=T)
    survivor = Worker(store, name="survivor")
    # Still alive at T + 2: nothing is taken.
    assert survivor.beat(now=T + 2).requeued == 0
    assert store.get(lease.job_id).state == LEASED
    # Its liveness expired at T + 3, long before its lease (T + 30): taken back at once.
    result = survivor.beat(now=T + 4)
    assert result.requeued == 1
    job = store.get(lease.job_id)
    assert job.state == READY and job.lease_owner is None
    assert "survivor" in _rows(store) and "dead" not in _rows(store)  # its row is forgotten
    history = store.history(lease.job_id)
    assert [(a.outcome, a.worker, a.epoch) for a in history] == [("expired", "dead", lease.epoch)]
    again = store.claim_next("survivor", ttl=30, now=T + 4)
    assert again is not None and again.job_id == lease.job_id
    assert again.epoch > lease.epoch
    with pytest.raises(Conflict):  # the dead worker's late finish is fenced
        store.finish(lease, now=T + 5)
    store.finish(again, now=T + 5)
    assert store.get(lease.job_id).state == DONE
    store.dispose()


def test_the_regular_recovery_sweep_also_takes_dead_workers_leases(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "job-1", now=T)
    lease = store.claim_next("dead", ttl=30, now=T)
    assert lease is not None
    store.worker_alive("dead", 3, now=T)
    assert store.recover(now=T + 4).requeued == 1
    assert store.get(lease.job_id).state == READY
    store.dispose()


def test_a_lease_without_a_liveness_row_waits_for_its_expiry(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "job-1", now=T)
    lease = store.claim_next("old-version", ttl=30, now=T)  # never writes a liveness row
    assert lease is not None
    survivor = Worker(store, name="survivor")
    assert survivor.beat(now=T + 10).requeued == 0
    assert store.recover(now=T + 10).requeued == 0
    assert store.get(lease.job_id).lease_owner == "old-version"
    assert store.recover(now=T + 31).requeued == 1  # its own expiry still applies
    store.dispose()


def test_a_beat_renews_liveness_so_a_live_lease_is_kept(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "job-1", now=T)
    lease = store.claim_next("live", ttl=30, now=T)
    assert lease is not None
    store.worker_alive("live", 3, now=T)
    store.worker_alive("live", 3, now=T + 2)  # alive until T + 5
    assert store.recover_dead(now=T + 4).requeued == 0
    assert store.recover(now=T + 4).requeued == 0
    store.finish(lease, now=T + 4)
    assert store.get(lease.job_id).state == DONE
    store.dispose()


def test_a_worker_stalled_past_its_ttl_never_takes_back_its_own_lease(db_url: str) -> None:
    """A beat renews and sweeps on one clock. The clock below moves a whole ttl at every
    read, as it does for a worker whose thread stalls between two statements: the sweep of
    the beating worker must not find that worker dead, requeue its running job, and delete
    its row (it did when the renewal and the sweep were two transactions: CI caught it)."""
    ticks = iter(T + 2.0 * n for n in range(1_000))
    store = Store(db_url, clock=lambda: next(ticks))
    worker = Worker(store, name="stalled", liveness_ttl=1.0, liveness_interval=0.1)
    store.enqueue("t", "job-1")
    lease = store.claim_next("stalled", ttl=300)
    assert lease is not None
    for _ in range(3):
        assert worker.beat().requeued == 0
        assert store.get(lease.job_id).state == LEASED
        assert "stalled" in _rows(store)
    store.finish(lease)
    assert store.get(lease.job_id).state == DONE
    store.dispose()


def test_an_idle_handler_keeps_its_lease_and_a_clean_stop_removes_the_row(db_url: str) -> None:
    """A running worker beats from its own thread: a handler that reports no progress for
    several liveness ttls (database clock) keeps its lease; a survivor's sweeps take nothing."""
    store = Store(db_url)
    release = threading.Event()
    started = threading.Event()
    worker = Worker(store, name="busy", liveness_ttl=0.5, liveness_interval=0.1, poll_interval=0.05)

    @worker.handler("hold")
    def hold(job: JobContext) -> None:
        started.set()
        release.wait(30)

    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    try:
        job_id = store.enqueue("t", "hold-1").job_id
        assert started.wait(30)
        survivor = Worker(store, name="survivor", liveness_ttl=0.5, liveness_interval=0.1)
        wait_for(lambda: "busy" in _rows(store), "its first beat", timeout=30)
        alive = _rows(store)["busy"]

        # Sweep until the busy worker's row has been renewed past several ttls of idleness.
        def swept_while_renewed() -> bool:
            assert survivor.beat().requeued == 0
            assert store.get(job_id).lease_owner == "busy"
            return _rows(store)["busy"] >= alive + 1.5

        wait_for(swept_while_renewed, "the busy worker's row renewed", timeout=30)
        release.set()
        wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=30)
    finally:
        release.set()
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert "busy" not in _rows(store)  # removed on the clean stop
    store.dispose()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"liveness_ttl": 0}, "liveness_ttl"),
        ({"liveness_interval": -1}, "liveness_interval"),
        ({"liveness_ttl": 2, "liveness_interval": 2}, "liveness_interval"),
        ({"liveness_ttl": "3"}, "liveness_ttl"),
    ],
)
def test_liveness_settings_are_validated(options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        WorkerConfig(**options)  # type: ignore[arg-type]
    cfg = WorkerConfig()
    assert (cfg.liveness_ttl, cfg.liveness_interval) == (3.0, 1.0)


@pytest.mark.slow  # a process of its own (the fast tier stays under 2 minutes)
def test_cli_liveness_flags_and_environment(tmp_path: Path) -> None:
    from consumer.jobs import cli

    url = f"sqlite:///{tmp_path / 'w.db'}"
    args = ["run", "tests.jobs_support:build", "--database-url", url]
    assert cli.main([*args, "--liveness-ttl", "1", "--liveness-interval", "2"]) == 2
    env = {**os.environ, "OUTBOX_LIVENESS_INTERVAL": "5"}
    proc = subprocess.run(
        [sys.executable, "-m", "consumer.jobs.cli", *args, "--recover-interval", "1"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert b"liveness_interval" in proc.stderr


@pytest.mark.slow
def test_a_sigkilled_worker_s_job_is_finished_by_the_survivor_before_the_lease_ttl(
    pg_url: str, tmp_path: Path
) -> None:
    """Two ``outbox-worker run`` processes with the default settings (lease ttl 30 s,
    liveness ttl 3 s); the one holding a long job is SIGKILLed; the survivor finishes it
    well before the 30 s lease would have expired."""
    store = Store(pg_url)
    effects = tmp_path / "effects.txt"
    effects.touch()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUTBOX_DATABASE_URL": pg_url,
        "JOBS_EFFECTS_FILE": str(effects),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "consumer.jobs.cli", "run", "tests.jobs_support:build_slow"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    try:
        wait_for(lambda: len(_rows(store)) == 2, "both to beat: both running", timeout=60)
        job_id = store.enqueue("t", "slow-1").job_id
        wait_for(lambda: effects.read_text().strip() != "", "an effect", timeout=60)
        holder_pid = int(effects.read_text().split()[0])
        holder = next(p for p in procs if p.pid == holder_pid)
        assert store.get(job_id).state == LEASED
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        # Strictly less than the 30 s lease ttl: it did not wait for the lease to expire.
        wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=20)
        lines = effects.read_text().split("\n")
        survivor_pid = next(p.pid for p in procs if p.pid != holder_pid)
        assert f"{survivor_pid} slow-1 2" in lines
        assert store.history(job_id)[0].outcome == "expired"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        store.dispose()
