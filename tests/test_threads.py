"""The bounded pool of ``def`` handler threads (``consumer.jobs.threads``): its size rule and
its waiting jobs, which hold no thread. The processes' side is in tests/test_user_provider.py."""

from __future__ import annotations

import asyncio

from consumer.jobs import threads
from consumer.jobs.config import WorkerConfig
from consumer.jobs.threads import ThreadGate, default_threads


def test_jobs_beyond_the_size_wait_in_turn() -> None:
    gate = ThreadGate(slots=256, fixed=2)
    inside: list[int] = []
    most = 0
    order: list[int] = []

    async def job(i: int) -> None:
        nonlocal most
        async with gate:
            inside.append(i)
            most = max(most, len(inside))
            order.append(i)
            await asyncio.sleep(0.01)
            inside.remove(i)

    async def scenario() -> None:
        await asyncio.gather(*(job(i) for i in range(7)))

    asyncio.run(scenario())
    assert most == 2 and order == list(range(7)) and gate.running == 0 and gate.waiting == 0


def test_a_cancelled_wait_gives_its_turn_back() -> None:
    gate = ThreadGate(slots=4, fixed=1)

    async def scenario() -> None:
        await gate.__aenter__()
        waiting = asyncio.ensure_future(gate.__aenter__())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await gate.__aexit__()
        assert gate.running == 0 and gate.waiting == 0
        async with gate:
            assert gate.running == 1

    asyncio.run(scenario())


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
