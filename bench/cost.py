"""What the whole loop costs per effect: CPU milliseconds by kind of process, from ``/proc``.

``python -m bench cost [--rates 10,100,500] [--seconds 30] [--warmup 5] [--idle 30]
[--provider blocking|http] [--statements]``

The HA layout of the docs on its defaults (``bench.loop``: 2 relays, 2 consumers, 2 workers,
a private PostgreSQL and a private Redis), the writers approving quotes at a steady rate, and
the user's own blocking provider as the docs show it (``tests.blocking_app.PostMail``:
``urllib``, a new connection per call, an ``Operations`` built apart from the worker, a
plain ``def`` handler) against ``outbox-simulator serve``, which answers at once.

Per rate, over a steady window (after a warm-up; the loop settles between rates), from the
utime + stime deltas in ``/proc/PID/stat``:

- CPU ms per effect of the relays, the consumers, the workers, PostgreSQL (the backends of
  each kind's sessions, named by ``PGAPPNAME``, are counted with that kind: ``pg relays``,
  ``pg consumers``, ``pg workers``; ``pg background`` is the cluster's own processes,
  ``pg ended`` the backends that ended in the window: a pool's overflow connections) and
  Redis; ``total`` is their sum: what the loop
  costs beyond the application's own transaction. The writers (the application: their
  process and their backends) and the provider are shown apart, not in the total.
- committed/s and effects/s in the window, and commit -> effect p50 / p99 of the quotes
  committed in it.

``--idle S`` then measures the same processes with no writes for S seconds (after the last
rate settled): CPU ms per second by kind. ``--statements`` loads ``pg_stat_statements`` in
the private cluster and prints, per rate, the statements the loop ran per effect (the 12
most frequent), to see where PostgreSQL's share goes.

The figures depend on what else the machine runs (the load average is printed first): say
so when quoting them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench.loop import Loop, LoopSettings, PrivatePostgres, problems
from bench.procstat import children_of, cpu_seconds

KINDS = ("relays", "consumers", "workers", "pg relays", "pg consumers", "pg workers")
TOTAL = (*KINDS, "pg ended", "pg background", "redis")
APART = ("writers", "pg writers", "provider")
ROLE_OF_PREFIX = {"relay-": "relays", "consumer-": "consumers", "worker-": "workers"}


def postmaster_of(loop: Loop) -> int:
    return int(Path(loop.pg.data, "postmaster.pid").read_text().split()[0])


def backend_roles(loop: Loop) -> dict[int, str]:
    """Backend pid -> the kind of process whose session it serves (``pg relays``...)."""
    roles: dict[int, str] = {}
    with loop._admin.connect() as conn:
        rows = conn.execute(
            text("SELECT pid, application_name FROM pg_stat_activity WHERE pid <> pg_backend_pid()")
        ).all()
    for pid, name in rows:
        name = name or ""
        for prefix, role in ROLE_OF_PREFIX.items():
            if name.startswith(prefix):
                roles[int(pid)] = f"pg {role}"
        if name.startswith("writer-"):
            roles[int(pid)] = "pg writers"
        if name == "harness":
            roles[int(pid)] = "harness"
    return roles


def snapshot(loop: Loop) -> dict[str, Any]:
    """CPU seconds so far: per kind of process, and per live backend (its kind, its time)."""
    found: dict[str, Any] = dict.fromkeys((*TOTAL, *APART, "harness"), 0.0)
    for role, kind in (("relay", "relays"), ("consumer", "consumers"), ("worker", "workers")):
        found[kind] = sum(cpu_seconds(p.pid) for p in loop.procs[role] if p.pid)
    found["writers"] = sum(cpu_seconds(w.pid) for w in loop.writers if w.alive() and w.pid)
    if loop.simulator.proc is not None:
        found["provider"] = cpu_seconds(loop.simulator.proc.pid)
    if loop.redis.process is not None:
        found["redis"] = cpu_seconds(loop.redis.process.pid)
    postmaster = postmaster_of(loop)
    roles = backend_roles(loop)
    # The postmaster with its ended children (their whole time is in its cutime + cstime)
    found["_reaped"] = cpu_seconds(postmaster, children=True)
    found["_backends"] = {
        pid: (roles.get(pid, "pg background"), cpu_seconds(pid)) for pid in children_of(postmaster)
    }
    with loop._admin.connect() as conn:
        found["_sessions"] = int(
            conn.execute(
                text("SELECT sessions FROM pg_stat_database WHERE datname = :name"),
                {"name": loop.name},
            ).scalar_one()
        )
    return found


def spent(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """CPU seconds per kind between two snapshots. A backend counts with the kind of the
    session it serves; one that started in the window counts from zero; the time of those
    that ended in it (reaped by the postmaster: its cutime) is ``pg ended``, less what they
    had spent before the window."""
    used = {k: after[k] - before[k] for k in after if not k.startswith("_")}
    then = before["_backends"]
    for pid, (kind, cpu) in after["_backends"].items():
        used[kind] = used.get(kind, 0.0) + cpu - then.get(pid, (kind, 0.0))[1]
    ended = sum(cpu for pid, (_, cpu) in then.items() if pid not in after["_backends"])
    used["pg ended"] = after["_reaped"] - before["_reaped"] - ended
    used["sessions"] = float(after["_sessions"] - before["_sessions"])
    return used


def measure(loop: Loop, rate: float, warmup: float, seconds: float, statements: bool) -> dict:
    loop.settings.rate = rate
    # One writer per 50/s: on a loaded 2-core machine a writer's round trips wait for the
    # scheduler, and one writer made ~60 commits/s when asked for 100.
    loop.settings.writers = max(1, round(rate / 50))
    before = loop.samples[-1].committed or 0
    loop.start_load()
    # The writers are Python processes: on a loaded machine they take seconds to start.
    # The warm-up counts from their first second of commits.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (loop.samples[-1].committed or 0) < before + rate:
        time.sleep(0.2)
    time.sleep(warmup)
    if statements:
        reset_statements(loop)
    first = loop.samples[-1]
    wall_start = time.time()
    before = snapshot(loop)
    time.sleep(seconds)
    after = snapshot(loop)
    wall_end = time.time()
    last = loop.samples[-1]
    top = read_statements(loop) if statements else []
    elapsed = max(last.at - first.at, 0.001)
    loop.stop_load()
    settled = loop.settle(180.0)
    books = loop.books()
    latencies = sorted(
        e["time"] - e["body"]["t"]
        for e in loop.simulator.effects()
        if isinstance(e["body"].get("t"), float) and wall_start <= e["body"]["t"] <= wall_end
    )
    effects = (last.effects or 0) - (first.effects or 0)
    return {
        "rate": rate,
        "committed_per_s": ((last.committed or 0) - (first.committed or 0)) / elapsed,
        "effects_per_s": effects / elapsed,
        "effects": effects,
        "cpu": spent(before, after),
        "p50": _quantile(latencies, 0.50),
        "p99": _quantile(latencies, 0.99),
        "books": "ok" if settled and not problems(books) else "; ".join(problems(books)),
        "statements": top,
    }


def idle(loop: Loop, seconds: float) -> dict[str, float]:
    time.sleep(5.0)  # past the busy windows of the last rate
    before = snapshot(loop)
    time.sleep(seconds)
    return {k: v / seconds for k, v in spent(before, snapshot(loop)).items()}


def reset_statements(loop: Loop) -> None:
    with loop._admin.connect() as conn:
        conn.execute(text("SELECT pg_stat_statements_reset()"))


def read_statements(loop: Loop) -> list[tuple[int, float, str]]:
    """(calls, total ms, query) of the run's database, most frequent first."""
    with loop._admin.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT calls, total_exec_time, query FROM pg_stat_statements s"
                " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = :name"
                " ORDER BY calls DESC"
            ),
            {"name": loop.name},
        ).all()
    return [(int(c), float(t), " ".join(str(q).split())) for c, t, q in rows]


def _quantile(values: Sequence[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(rows: Sequence[dict]) -> str:
    kinds = (*TOTAL, "total", *APART)
    head = (
        "| offered/s | committed/s | effects/s | "
        + " | ".join(kinds)
        + " | p50 ms | p99 ms | sessions/effect |"
    )
    lines = [head, "|" + "---|" * (6 + len(kinds))]
    for r in rows:
        per = {k: 1000 * v / max(r["effects"], 1) for k, v in r["cpu"].items()}
        per["total"] = sum(per[k] for k in TOTAL)
        sessions = r["cpu"]["sessions"] / max(r["effects"], 1)
        lines.append(
            f"| {r['rate']:.0f} | {r['committed_per_s']:.0f} | {r['effects_per_s']:.0f} | "
            + " | ".join(f"{per.get(k, 0.0):.2f}" for k in kinds)
            + f" | {_ms(r['p50'])} | {_ms(r['p99'])} | {sessions:.2f} |"
        )
    return "\n".join(lines)


def idle_table(cost: dict[str, float]) -> str:
    kinds = (*TOTAL, "total")
    cost = {**cost, "total": sum(cost[k] for k in TOTAL)}
    return (
        "| idle | "
        + " | ".join(kinds)
        + " |\n|"
        + "---|" * (1 + len(kinds))
        + "\n| CPU ms/s | "
        + " | ".join(f"{1000 * cost[k]:.1f}" for k in kinds)
        + " |"
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rates", default="10,100,500", help="quotes/s offered, in turn")
    parser.add_argument("--seconds", type=float, default=30.0, help="steady window per rate")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--idle", type=float, default=30.0, help="idle window (0: none)")
    parser.add_argument("--provider", choices=("blocking", "http"), default="blocking")
    parser.add_argument("--statements", action="store_true", help="pg_stat_statements per rate")
    parser.add_argument(
        "--rollback", type=float, default=0.0, help="fraction of approvals rolled back"
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="processes log at info; their logs are kept"
    )
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    with os.popen("uptime") as uptime:
        print(f"machine: {os.cpu_count()} cores; {uptime.read().strip()}", flush=True)
    os.environ["PGAPPNAME"] = "harness"  # the harness's own sessions, apart
    settings = ["autovacuum=on"]
    if args.statements:
        settings.append("shared_preload_libraries=pg_stat_statements")
    pg = PrivatePostgres(settings=tuple(settings)).start()
    rows = []
    try:
        if args.statements:
            admin = create_engine(pg.url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
            admin.dispose()
        env = {"LOOP_PROVIDER": args.provider}
        if args.keep_logs:
            env["OUTBOX_LOG_LEVEL"] = "info"
        loop = Loop(pg, "cost", LoopSettings(rollback=args.rollback, duplicates=0.0, env=env))
        try:
            loop.start(load=False)
            for rate in rates:
                row = measure(loop, rate, args.warmup, args.seconds, args.statements)
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                for calls, total, query in row["statements"][:12]:
                    per = calls / max(row["effects"], 1)
                    print(f"    {per:6.2f}/effect {total / calls:6.3f} ms  {query[:150]}")
            print()
            print(table(rows))
            if args.idle > 0:
                print()
                print(idle_table(idle(loop, args.idle)))
        finally:
            loop.close(keep=args.keep_logs)
    finally:
        pg.close()
    return 0 if all(r["books"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
