"""The relay's poll follows the flow (issue 54): a trickle of events is claimed a few at a
time, every 50 ms at most, instead of one or none every 5 ms."""

from __future__ import annotations

from types import SimpleNamespace

from relay.config import RelayConfig
from relay.loop import BUSY_SLOWEST, BUSY_WINDOW, FEW, RelayLoop, _LoopState


def _pacer(**config: float) -> tuple[SimpleNamespace, _LoopState]:
    relay = SimpleNamespace(config=RelayConfig(**config))  # _pace reads only the config
    return relay, _LoopState(interval=relay.config.poll_interval, last_progress=0.0)


def _pace(relay: SimpleNamespace, state: _LoopState, found: int, now: float) -> float:
    RelayLoop._pace(relay, state, found, now)  # type: ignore[arg-type]
    return state.interval


def test_a_trickle_slows_the_poll_to_its_busy_bound_and_a_batch_speeds_it_up() -> None:
    relay, state = _pacer()
    fast = relay.config.poll_interval
    slowest = fast * BUSY_SLOWEST
    assert _pace(relay, state, FEW, 0.0) == fast  # a batch: the short poll
    waits = [_pace(relay, state, n, 0.01 * i) for i, n in enumerate([1, 0, 1, 0, 1, 0])]
    assert waits[:2] == [2 * fast, 4 * fast]  # fewer than FEW: the wait doubles
    assert max(waits) == slowest == 0.05  # ... but never past 50 ms while work flows
    # The flow grew: each batch worth its round trips halves the wait, down to 5 ms.
    assert _pace(relay, state, FEW + 3, 0.1) == slowest / 2
    assert [_pace(relay, state, FEW, 0.1) for _ in range(3)] == [slowest / 4, slowest / 8, fast]


def test_a_steady_flow_settles_near_few_events_a_cycle() -> None:
    """A flow of ``rate`` events/s, each cycle finding what arrived during its wait: the wait
    settles near FEW / rate (between half and twice it), not swinging between bounds."""
    relay, state = _pacer()
    for rate in (100.0, 400.0):
        waits = []
        for step in range(60):
            found = int(rate * state.interval + 0.5)
            waits.append(_pace(relay, state, found, step * 0.01))
        settled = waits[20:]
        assert min(settled) >= FEW / rate / 2 - 1e-9  # (a reset to 5 ms each batch: 5 ms)
        assert max(settled) <= 2 * FEW / rate + 1e-9


def test_a_second_without_work_backs_off_toward_the_idle_interval() -> None:
    relay, state = _pacer()
    _pace(relay, state, 1, 0.0)
    assert _pace(relay, state, 0, BUSY_WINDOW / 2) <= relay.config.poll_interval * BUSY_SLOWEST
    waits = [_pace(relay, state, 0, BUSY_WINDOW + i) for i in range(12)]
    assert waits[-1] == relay.config.max_poll_interval  # 1 s idle
    assert _pace(relay, state, 1, 20.0) == relay.config.poll_interval * BUSY_SLOWEST


def test_the_busy_bound_follows_the_configured_intervals() -> None:
    relay, state = _pacer(poll_interval=0.05, max_poll_interval=0.1)
    for i in range(5):
        _pace(relay, state, 1, float(i) / 100)
    assert state.interval == 0.1  # 10 x 50 ms is past max_poll_interval: capped there
