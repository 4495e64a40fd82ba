"""consumer.jobs.claim_runs: quick handlers run in their claim's thread, and chained claims.

A fake worker (its claims, finishes, jobs in hand and handler runs recorded in memory)
drives ``ClaimRuns`` directly: which claims it chains, which finishes each claim carries,
what it hands back to the loop, and where it stops (a claim short of its slots, a slow or
failed job, a stop, a chained claim that fails)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from consumer.jobs import claim_runs, threads
from consumer.jobs.claim_runs import CHAIN_ROUNDS, ClaimRuns
from consumer.jobs.outcomes import Settled
from consumer.jobs.threads import ThreadGate


class FakeParts:
    """The worker as ``ClaimRuns`` sees it; ``backlog`` jobs to claim, ``slow`` and
    ``failing`` job ids, ``fail_claim``: the claim (1-based) that raises."""

    def __init__(self, backlog: int, *, slow: set[int] | None = None) -> None:
        self.ids = itertools.count(1)
        self.backlog = backlog
        self.slow = slow or set()
        self.stop = SimpleNamespace(stopped=False)
        self.in_hand: set[int] = set()
        self.claims: list[tuple[list[int], int]] = []  # (finished ids, claimed count)
        self.ran: list[int] = []
        self.fail_claim = 0
        self.stop_after_claim = 0
        self.outcomes = SimpleNamespace(run=self._run)
        self.in_hand_view = SimpleNamespace(remove=self.in_hand.discard)

    def route(self, lease: Any) -> tuple[str, Any]:
        return ("tick", lambda job: None)

    def claim(self, free: int, queues: Any) -> list[Any]:
        return self.finish_and_claim([], free, queues)

    def finish_and_claim(self, done: Sequence[Settled], free: int, queues: Any) -> list[Any]:
        if len(self.claims) + 1 == self.fail_claim:
            raise OperationalError("claim", {}, Exception("server closed the connection"))
        taken = min(free, self.backlog)
        self.backlog -= taken
        self.claims.append(([s.ctx.job_id for s in done], taken))
        if len(self.claims) == self.stop_after_claim:
            self.stop.stopped = True
        return [SimpleNamespace(job_id=next(self.ids)) for _ in range(taken)]

    def context(self, lease: Any, executor: Any = None) -> Any:
        self.in_hand.add(lease.job_id)
        return SimpleNamespace(job_id=lease.job_id, lease=lease)

    def _run(self, ctx: Any) -> Settled:
        self.ran.append(ctx.job_id)
        return Settled(ctx, "done", "tick", time.monotonic())


@pytest.fixture(autouse=True)
def _walls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs take the wall time their job calls for, whatever the machine's load: 20 us, or
    four times QUICK_WALL for a job of ``FakeParts.slow``."""

    def timed(fn: Any, ctx: Any) -> tuple[Settled, float, float]:
        slow = ctx.job_id in getattr(fn.__self__, "slow", ())
        wall = threads.QUICK_WALL * 4 if slow else 0.00002
        return fn(ctx), wall, 0.00002

    monkeypatch.setattr(claim_runs, "timed", timed)


def _runs(parts: FakeParts, *, chain: bool = True) -> ClaimRuns:
    gate = ThreadGate(slots=4)
    for _ in range(threads.SAMPLES):
        gate.learn(0.00002, 0.00002)
    assert gate.quick
    view = SimpleNamespace(
        stop=parts.stop,
        route=parts.route,
        in_hand=parts.in_hand_view,
        outcomes=parts.outcomes,
        claim=parts.claim,
        finish_and_claim=parts.finish_and_claim,
        context=parts.context,
    )
    return ClaimRuns(view, gate, lambda handler: False, None, inline=True, chain=chain)  # type: ignore[arg-type]


def test_a_full_claim_of_quick_done_jobs_chains_the_next_with_their_finishes() -> None:
    parts = FakeParts(backlog=1000)
    claimed, learned = _runs(parts)([], 4, None)
    assert len(parts.claims) == CHAIN_ROUNDS
    # Each claim after the first carries exactly the finishes of the one before it.
    for (_, before), (finished, taken) in zip(parts.claims, parts.claims[1:], strict=False):
        assert len(finished) == before == taken == 4
    assert parts.claims[1][0] == [1, 2, 3, 4]
    # The last claim's jobs go to the loop as they ran, still in hand; the others left.
    last = [ctx.job_id for ctx, _ in claimed]
    assert last == list(range(4 * CHAIN_ROUNDS - 3, 4 * CHAIN_ROUNDS + 1))
    assert all(isinstance(ran, tuple) and ran[0].outcome == "done" for _, ran in claimed)
    assert parts.in_hand == set(last)
    assert len(learned) == 4 * (CHAIN_ROUNDS - 1)  # the chained runs, for the gate
    assert parts.ran == list(range(1, 4 * CHAIN_ROUNDS + 1))  # each job once


def test_no_chain_with_several_groups_of_slots_or_a_short_claim() -> None:
    parts = FakeParts(backlog=1000)
    claimed, _ = _runs(parts, chain=False)([], 4, None)
    assert len(parts.claims) == 1 and len(claimed) == 4
    parts = FakeParts(backlog=6)  # the second claim comes back short: no third
    claimed, _ = _runs(parts)([], 4, None)
    assert [taken for _, taken in parts.claims] == [4, 2]
    assert [ctx.job_id for ctx, _ in claimed] == [5, 6]


def test_a_slow_job_ends_the_runs_here_and_the_chain() -> None:
    parts = FakeParts(backlog=1000, slow={6})
    claimed, _ = _runs(parts)([], 4, None)
    assert len(parts.claims) == 2  # the second claim held the slow job
    runs = {ctx.job_id: ran for ctx, ran in claimed}
    assert runs[5] is not None and runs[6] is not None  # run here, the slow one included
    assert runs[7] is None and runs[8] is None  # the rest go to the slots' threads
    assert parts.ran == [1, 2, 3, 4, 5, 6]


def test_a_stop_ends_the_chain_after_the_claim_it_came_in() -> None:
    parts = FakeParts(backlog=1000)
    parts.stop_after_claim = 2
    claimed, _ = _runs(parts)([], 4, None)
    assert len(parts.claims) == 2
    assert all(ran is None for _, ran in claimed)  # not run after the stop: the loop's
    assert parts.in_hand == {5, 6, 7, 8}


def test_a_chained_claim_that_fails_hands_the_jobs_before_it_back_unfinished() -> None:
    parts = FakeParts(backlog=1000)
    parts.fail_claim = 3
    claimed, learned = _runs(parts)([], 4, None)
    assert len(parts.claims) == 2  # the third raised
    # The second claim's jobs ran, and their finishes are the loop's to write: still in hand.
    assert [ctx.job_id for ctx, _ in claimed] == [5, 6, 7, 8]
    assert all(isinstance(ran, tuple) for _, ran in claimed)
    assert parts.in_hand == {5, 6, 7, 8}
    assert len(learned) == 4


def test_the_first_claim_failing_raises_for_the_loop() -> None:
    parts = FakeParts(backlog=1000)
    parts.fail_claim = 1
    with pytest.raises(OperationalError):
        _runs(parts)([], 4, None)
    assert claim_runs.CHAIN_ROUNDS >= 2
