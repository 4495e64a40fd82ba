"""The bounded pool of ``def`` handler threads (``consumer.jobs.threads``): its size rule and
its waiting jobs, which hold no thread. The processes' side is in tests/test_user_provider.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from consumer.jobs import threads
from consumer.jobs.config import WorkerConfig
from consumer.jobs.threads import HandlerThreads, ThreadGate, default_threads


def _ran(gate: ThreadGate, jobs: int, run: Any) -> list[tuple[int, Any, Any]]:
    """Hand ``jobs`` jobs to HandlerThreads on a loop; their ends, in the order delivered."""
    ended: list[tuple[int, Any, Any]] = []

    async def scenario() -> None:
        done = asyncio.Event()

        def end(arg: int, key: str, result: Any, error: BaseException | None) -> None:
            assert key == f"k{arg}" and threading.current_thread() is threading.main_thread()
            ended.append((arg, result, error))
            if len(ended) == jobs:
                done.set()

        pool: HandlerThreads[int, str] = HandlerThreads(gate, "test", run, end)
        for i in range(jobs):
            pool.submit(i, f"k{i}")
        assert gate.running <= gate.size and pool.waiting == jobs - gate.running
        await asyncio.wait_for(done.wait(), 60)
        assert gate.running == 0 and pool.waiting == 0
        pool.shutdown()

    asyncio.run(scenario())
    return ended


def test_jobs_beyond_the_size_wait_in_turn_holding_no_thread() -> None:
    gate = ThreadGate(slots=256, fixed=2)
    inside: list[int] = []
    most = 0
    started: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> int:
        nonlocal most
        with lock:
            inside.append(i)
            started.append(i)
            most = max(most, len(inside))
        time.sleep(0.01)  # the scenario: the handler's work, so the jobs overlap meanwhile
        with lock:
            inside.remove(i)
        return i * 10

    ended = _ran(gate, 7, job)
    assert most == 2 and started[2:] == list(range(2, 7))  # the waiting ones in turn
    assert sorted(ended) == [(i, i * 10, None) for i in range(7)]


def test_every_end_comes_back_on_the_loop_errors_too() -> None:
    """A handler's end is delivered on the loop's thread, once per job, with what it returned
    or raised (a worker-side error is the loop's to handle, never lost on a thread)."""

    def job(i: int) -> int:
        if i % 3 == 0:
            raise RuntimeError(f"job {i}")
        return i

    ended = _ran(ThreadGate(slots=64), 60, job)
    assert sorted(arg for arg, _, _ in ended) == list(range(60))
    for arg, result, error in ended:
        if arg % 3 == 0:
            assert isinstance(error, RuntimeError) and str(error) == f"job {arg}"
        else:
            assert result == arg and error is None


def test_the_size_follows_the_jobs_wait_over_compute() -> None:
    cpus = threads.cpus()
    waiting = ThreadGate(slots=10_000)
    for _ in range(20):
        waiting.learn(0.3, 0.003)  # a 300 ms provider, 3 ms of CPU: ~100 threads per CPU
    assert waiting.size == threads.MAX_PER_CPU * cpus  # capped
    some = ThreadGate(slots=10_000)
    for _ in range(20):
        some.learn(0.1, 0.005)  # 19 waits per compute: 20 per CPU
    assert some.size == max(threads.MIN_PER_CPU * cpus, 20 * cpus)
    busy = ThreadGate(slots=10_000)
    for _ in range(20):
        busy.learn(0.01, 0.01)  # CPU-bound handlers: the least
    assert busy.size == threads.MIN_PER_CPU * cpus
    small = ThreadGate(slots=3)
    assert small.most == 3 and small.size <= 3  # never more threads than slots


def test_defaults_fit_the_machine() -> None:
    assert default_threads(256) == min(256, threads.MAX_PER_CPU * threads.cpus())
    assert WorkerConfig().threads is None
    assert WorkerConfig(threads=12).threads == 12
    fixed = ThreadGate(slots=256, fixed=12)
    fixed.learn(0.3, 0.001)
    assert fixed.size == 12


def test_threads_must_be_a_positive_integer() -> None:
    import pytest

    from outbox.errors import ConfigError

    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ConfigError, match="threads"):
            WorkerConfig(threads=bad)  # type: ignore[arg-type]
