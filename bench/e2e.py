"""End to end: quote approved -> effect at the provider, the whole loop as real processes.

``python -m bench e2e [--rates 100,500,1000] [--seconds S] [--warmup S]
[--provider-latency SECONDS] [--provider-jitter FRACTION] [--provider-capacity N]
[--provider http|blocking] [--rollback FRACTION]``

One loop (``bench.loop``: writers, 2 relays, 2 consumers with a batch handler, 2 workers
dispatching through ``HttpProvider`` to ``outbox-simulator serve``, a private PostgreSQL and
a private Redis, default settings) runs each offered rate in turn: a warm-up, then a measured
window, then the load stops and the loop settles (so each rate starts with no backlog) and
the books are checked. Per rate it prints:

- the achieved rate: quotes committed per second and effects per second in the window;
- commit -> effect p50 / p99 / max of the quotes committed in the window (the writer stamps
  ``time.time()`` into the event just before COMMIT; the simulator stamps the effect);
- CPU per component over the window, in % of one core, from ``/proc/PID/stat`` (utime +
  stime of each process; PostgreSQL: the postmaster and all its backends).

``--provider-latency`` is what the simulator adds to every send (``--provider-jitter``, 0.5
by default: ±50 %), as a real provider answering in 50-300 ms; the workers run with their
defaults (slots, issue 21). ``--provider-capacity N``: the simulator serves N sends at once
and queues the others. ``--provider blocking`` (issue 37): the workers send through a
user's own provider as the docs show it (``tests.blocking_app.PostMail``: ``urllib``, a
new connection per call, an ``Operations`` built apart from the worker, a ``def``
handler) instead of ``HttpProvider`` registered with ``Worker(providers=...)``. Each row
also gives the provider requests per effect and the most claims of one job.

Offered is approvals attempted: the loop's writers roll back ``--rollback`` of them (10 % by
default, as every ``bench.loop`` run, so that rolled-back quotes are checked to have no
effect), so committed q/s is about 0.9 x offered. ``--rollback 0`` makes every approval a
commit.

Writers: one process per 250 quotes/s offered (one writer process commits ~1,000/s at best
on this machine). The figures depend on what else the machine runs: say so when quoting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import text

from bench.loop import Loop, LoopSettings, private_postgres, problems
from bench.procstat import children_of, cpu_seconds


def components(loop: Loop) -> dict[str, list[int]]:
    """PIDs per component of the running loop."""
    postmaster = int(Path(loop.pg.data, "postmaster.pid").read_text().split()[0])
    groups = {
        "writers": [w.pid for w in loop.writers if w.alive() and w.pid],
        "relays": [p.pid for p in loop.procs["relay"] if p.pid],
        "consumers": [p.pid for p in loop.procs["consumer"] if p.pid],
        "workers": [p.pid for p in loop.procs["worker"] if p.pid],
        "simulator": [loop.simulator.proc.pid] if loop.simulator.proc else [],
        "postgres": [postmaster, *children_of(postmaster)],
        "redis": [loop.redis.process.pid] if loop.redis.process else [],
    }
    return {k: [p for p in v if p] for k, v in groups.items()}


def cpu_snapshot(loop: Loop) -> dict[str, dict[int, float]]:
    return {name: {p: cpu_seconds(p) for p in pids} for name, pids in components(loop).items()}


def cpu_percent(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], seconds: float
) -> dict[str, float]:
    """% of one core per component; processes that appeared count from zero."""
    result = {}
    for name, now in after.items():
        then = before.get(name, {})
        used = sum(t - then.get(pid, 0.0) for pid, t in now.items())
        result[name] = 100.0 * used / seconds
    return result


COMPONENTS = ("writers", "relays", "consumers", "workers", "simulator", "postgres", "redis")


def measure(loop: Loop, rate: float, warmup: float, seconds: float) -> dict[str, object]:
    loop.settings.rate = rate
    loop.settings.writers = max(1, round(rate / 250))
    requests_before = _arrivals(loop)
    effects_before = len(loop.simulator.effects())
    loop.start_load()
    time.sleep(warmup)
    start_at = loop.now()
    wall_start = time.time()
    cpu_before = cpu_snapshot(loop)
    first = loop.samples[-1]
    time.sleep(seconds)
    cpu_after = cpu_snapshot(loop)
    wall_end = time.time()
    last = loop.samples[-1]
    elapsed = last.at - first.at
    loop.stop_load()
    stopped = time.monotonic()
    settled = loop.settle(180.0)
    settle_seconds = time.monotonic() - stopped
    books = loop.books()
    calls = _arrivals(loop)
    made = len(loop.simulator.effects())
    assert loop.engine is not None
    with loop.engine.connect() as conn:
        claims = conn.execute(text("SELECT coalesce(max(lease_epoch), 0) FROM outbox_jobs"))
        most_claims = int(claims.scalar_one())
    latencies = sorted(
        e["time"] - e["body"]["t"]
        for e in loop.simulator.effects()
        if isinstance(e["body"].get("t"), float) and wall_start <= e["body"]["t"] <= wall_end
    )

    def q(p: float) -> float | None:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else None

    return {
        "offered": rate,
        "committed_per_s": ((last.committed or 0) - (first.committed or 0)) / max(elapsed, 0.001),
        "effects_per_s": ((last.effects or 0) - (first.effects or 0)) / max(elapsed, 0.001),
        "p50": q(0.50),
        "p99": q(0.99),
        "max": latencies[-1] if latencies else None,
        "measured": len(latencies),
        "cpu": cpu_percent(cpu_before, cpu_after, seconds),
        "books": "ok" if settled and not problems(books) else "; ".join(problems(books)),
        "settled_s": settle_seconds,
        "requests": (calls - requests_before) / max(made - effects_before, 1),
        "most_claims": most_claims,
        "window": (start_at, loop.now()),
    }


def _arrivals(loop: Loop) -> int:
    """Every call that reached the provider so far (sends, resends, lookups)."""
    answer = loop.simulator.client.get(f"{loop.simulator.url}/arrivals")
    answer.raise_for_status()
    return len(answer.json()["arrivals"])


def _ms(value: object) -> str:
    return "-" if value is None else f"{float(value) * 1000:.0f}"  # type: ignore[arg-type]


def table(rows: Sequence[dict[str, object]]) -> str:
    head = (
        "| offered q/s | committed q/s | effects/s | p50 ms | p99 ms | max ms | "
        + " | ".join(f"CPU {c} %" for c in COMPONENTS)
        + " | settled s | requests/effect | most claims | books |"
    )
    lines = [head, "|" + "---|" * (10 + len(COMPONENTS))]
    for r in rows:
        cpu = r["cpu"]
        assert isinstance(cpu, dict)
        lines.append(
            f"| {r['offered']:.0f} | {r['committed_per_s']:.0f} | {r['effects_per_s']:.0f} | "
            f"{_ms(r['p50'])} | {_ms(r['p99'])} | {_ms(r['max'])} | "
            + " | ".join(f"{cpu.get(c, 0.0):.0f}" for c in COMPONENTS)
            + f" | {float(r['settled_s']):.1f} | {float(r['requests']):.2f}"  # type: ignore[arg-type]
            + f" | {r['most_claims']} | {r['books']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rates", default="100,500,1000", help="quotes/s offered, in turn")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per rate")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument(
        "--provider-latency", type=float, default=0.0, help="seconds added to every send"
    )
    parser.add_argument(
        "--provider-jitter", type=float, default=0.5, help="the latency varies by this fraction"
    )
    parser.add_argument(
        "--provider-capacity", type=int, default=None, help="sends the provider serves at once"
    )
    parser.add_argument("--provider", choices=("http", "blocking"), default="http")
    parser.add_argument(
        "--rollback",
        type=float,
        default=LoopSettings.rollback,
        help="fraction of approvals the writers roll back (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.rollback < 1:
        parser.error(f"--rollback must be in [0, 1), got {args.rollback}")
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    with os.popen("uptime") as uptime:
        print(f"machine: {os.cpu_count()} cores; {uptime.read().strip()}", flush=True)
    print(
        f"provider: {args.provider}, {args.provider_latency * 1000:.0f} ms "
        f"±{args.provider_jitter * 100:.0f} % per send"
        + (f", {args.provider_capacity} at once" if args.provider_capacity else ""),
        flush=True,
    )
    pg = private_postgres()
    rows = []
    try:
        env = {"LOOP_PROVIDER": args.provider}
        settings = LoopSettings(rate=rates[0], rollback=args.rollback, env=env)
        loop = Loop(pg, "e2e", settings)
        try:
            loop.start(load=False)
            loop.simulator.client.post(
                f"{loop.simulator.url}/config",
                json={
                    "latency": args.provider_latency,
                    "jitter": args.provider_jitter,
                    "capacity": args.provider_capacity,
                },
            ).raise_for_status()
            for rate in rates:
                row = measure(loop, rate, args.warmup, args.seconds)
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
        finally:
            loop.close()
    finally:
        pg.close()
    print()
    print(table(rows))
    return 0 if all(r["books"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
