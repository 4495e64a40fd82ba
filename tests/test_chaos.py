"""The chaos matrix, CI-sized (issue 12): every fault for a few seconds on the whole loop as
real processes (writers, 2 relays, 2 consumers, 2 workers, the connector simulator), on a
private PostgreSQL and a private Redis; after each fault the load stops, the loop settles and
the books must balance (``bench.loop.problems``): every committed quote exactly one effect,
rolled-back quotes none, one job per identity, nothing pending anywhere, no UNKNOWN receipt.

``python -m bench chaos`` runs the same matrix with longer faults and writes the report.
The pipeline runs with its default settings: recovery is whatever the defaults give.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.chaos import FAULTS, Plan, Row, run_matrix, table

# Every fault by default; CHAOS_FAULTS=a,b narrows it when chasing one row.
NAMES = [n for n in os.environ.get("CHAOS_FAULTS", ",".join(FAULTS)).split(",") if n]


@pytest.mark.slow
def test_the_books_balance_after_every_fault() -> None:
    plan = Plan(duration=3.0, warmup=2.0, tail=2.0, settle=240.0, rate=30.0)
    rows: list[Row] = run_matrix(NAMES, plan)
    assert [r.fault for r in rows] == NAMES
    failing = [r for r in rows if not r.ok]
    detail = "\n\n".join(f"{r.fault}: {r.problems}\n{r.logs[-4000:]}" for r in failing)
    assert not failing, f"{table(rows)}\n\n{detail}"
    for row in rows:
        assert row.lost == 0 and row.duplicated == 0, table([row])
        assert row.settled, table([row])


def test_a_process_that_exits_by_itself_is_a_problem_a_killed_one_is_not(tmp_path: Path) -> None:
    """Issue 53: the chaos checks count processes that exit by themselves (0 is the target);
    ``ensure_running`` restarted them silently before. One the harness kills is a fault's
    casualty, not counted."""
    import sys
    from types import SimpleNamespace

    from bench.loop import Loop, Proc

    env = dict(os.environ)
    quits = Proc(
        "worker-1",
        [sys.executable, "-c", "print('cannot go on'); raise SystemExit(3)"],
        env,
        tmp_path / "w.log",
    )
    killed = Proc(
        "relay-1", [sys.executable, "-c", "import time; time.sleep(60)"], env, tmp_path / "r.log"
    )
    loop = SimpleNamespace(procs=[quits.start(), killed.start()], self_exits=[])
    loop.all_procs = lambda: loop.procs
    killed.kill()
    assert quits.popen is not None and quits.popen.wait(60) == 3
    Loop.note_self_exits(loop)  # type: ignore[arg-type]
    Loop.note_self_exits(loop)  # type: ignore[arg-type]  # once per run of a process
    assert loop.self_exits == ["worker-1 exited 3: cannot go on"]
    quits.start()  # a new run: its own exit counts again
    assert quits.popen is not None and quits.popen.wait(60) == 3
    Loop.note_self_exits(loop)  # type: ignore[arg-type]
    assert len(loop.self_exits) == 2
