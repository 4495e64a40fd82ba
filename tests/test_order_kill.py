"""Order keys under real workers (issue 56): two worker processes of 16 slots drain jobs of
40 order keys, one of them SIGKILLed mid-drain and another started: every key's jobs ran in
enqueue order, one at a time (a job of a key never started while an earlier one of the key
had not finished; a job killed mid-run ran again before the next one of its key), and every
job ended DONE once."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from consumer import Store
from tests.services import start_worker_app, wait_for

KEYS = 40
PER_KEY = 25


def _runs(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    return [tuple(line.split()) for line in path.read_text().splitlines() if line]  # type: ignore[misc]


@pytest.mark.slow  # two worker processes, a SIGKILL and the recovery of its leases (~15 s)
def test_keys_stay_in_order_across_workers_and_a_sigkill(pg_url: str, tmp_path: Path) -> None:
    store = Store(pg_url)
    store.enqueue_many(
        [
            {"tenant": f"t{k % 4}", "action": f"k{k}-{i:03d}", "kind": "step", "order_key": f"k{k}"}
            for i in range(PER_KEY)
            for k in range(KEYS)
        ]
    )
    runs, log = tmp_path / "runs", tmp_path / "workers.log"
    env = {"OUTBOX_DATABASE_URL": pg_url, "ORDER_RUNS": str(runs)}
    first = start_worker_app("tests.order_app:build", env, log)
    second = start_worker_app("tests.order_app:build", env, log)
    third = None
    try:
        wait_for(lambda: len(_runs(runs)) >= 300, "the workers to run jobs", timeout=60)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        third = start_worker_app("tests.order_app:build", env, log)
        total = KEYS * PER_KEY
        wait_for(
            lambda: store.counts()["DONE"] == total,
            "every job DONE",
            timeout=120,
            diagnose=lambda: f"{store.counts()}\n{log.read_text()[-2000:]}",
        )
    finally:
        for process in (first, second, third):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(30)
    starts: dict[str, list[str]] = defaultdict(list)
    running: dict[str, str] = {}
    overlaps = []
    for what, action in _runs(runs):
        key = action.split("-")[0]
        if what == "START":
            earlier = running.get(key)
            if earlier is not None and earlier != action:
                overlaps.append(f"{action} started while {earlier} ran")
            running[key] = action
            starts[key].append(action)
        elif running.get(key) == action:
            del running[key]
    # A run killed mid-way leaves a START without its END: its rerun (the same job) starts
    # next, never a later job of its key.
    assert overlaps == [], overlaps[:5]
    for key, seen in starts.items():
        order = [a for n, a in enumerate(seen) if n == 0 or seen[n - 1] != a]
        assert order == sorted(set(seen)), f"{key}: {order}"
    assert store.counts()["DONE"] == KEYS * PER_KEY
    store.dispose()
