"""One worker process with its defaults against a slow provider: effects/s, CPU per effect.

``python -m bench effects [--latency 0.3] [--rates 50,100,200,400] [--seconds S]
[--backlog N] [--handlers sync,async] [--capacity N] [--jitter FRACTION]
[--provider http|blocking] [--concurrency N] [--threads N]``

One ``outbox-simulator serve`` adding ``--latency`` seconds to every send, one ``outbox-worker
run tests.effects_app:build`` process with no flags (its default slots), PostgreSQL (the
shared server, a schema of its own per run). For each handler kind (``sync``: a ``def``
handler calling ``job.dispatch``; ``async``: an ``async def`` one awaiting
``job.adispatch``, on ``HttpProvider``'s ``httpx.AsyncClient``):

- the curve: jobs enqueued at each offered rate for ``--seconds``; effects/s at the provider,
  enqueue -> effect p50 / p99, the worker's CPU (% of one core) and CPU per effect (ms);
- the ceiling: ``--backlog`` jobs enqueued at once, drained; effects/s from the first effect
  to the last, and CPU per effect.

``--provider blocking`` (issue 37): the user's path instead of ours, as the docs show it:
``outbox-worker run tests.blocking_app:build``, a provider of the user's own around plain
``urllib`` (a new connection per call), registered with an ``Operations`` built apart from
the worker, called from a ``def`` handler (``--handlers`` is then ``sync`` only).
``--concurrency`` / ``--threads`` set ``OUTBOX_CONCURRENCY`` / ``OUTBOX_THREADS`` for the
worker (the defaults otherwise).

``--capacity N``: the provider serves N sends at once and queues the others (a provider
slower than what is offered: overload). Each row also gives the provider requests per
effect (every call that reached it, sends, resends and lookups, over the effects made),
the jobs handed back by a provider limit, and the most claims of one job (its lease epoch).

The CPU is the worker process's utime + stime from ``/proc``. Figures depend on what else
the machine runs (say so when quoting them): a benchmark, never a timed test.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procstat import cpu_seconds  # noqa: E402
from consumer import Store  # noqa: E402
from tests.simulator_support import SimulatorProcess  # noqa: E402

HEAD = (
    "| offered jobs/s | effects/s | p50 ms | p99 ms | worker CPU % | ms CPU/effect "
    "| handed back | requests/effect | most claims |"
)
BASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _schema_url() -> tuple[str, str]:
    schema = f"bench_effects_{uuid.uuid4().hex[:8]}"
    engine = create_engine(BASE_URL)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    return schema, f"{BASE_URL}?options=-csearch_path%3D{schema}"


def _drop(schema: str) -> None:
    engine = create_engine(BASE_URL)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    engine.dispose()


def _worker(
    url: str, sim: SimulatorProcess, handler: str, log: Path, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        OUTBOX_DATABASE_URL=url,
        OUTBOX_LOG_LEVEL="warning",
        MAIL_URL=sim.url,
        HANDLER=handler,
    )
    if args.concurrency:
        env["OUTBOX_CONCURRENCY"] = str(args.concurrency)
    if args.threads:
        env["OUTBOX_THREADS"] = str(args.threads)
    app = "tests.blocking_app:build" if args.provider == "blocking" else "tests.effects_app:build"
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "consumer.jobs.cli", "run", app],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _enqueue(store: Store, tag: str, start: int, count: int) -> None:
    store.enqueue_many(
        [
            {"tenant": "bench", "action": f"email-{tag}-{i}", "subject": f"{i}@example.com"}
            for i in range(start, start + count)
        ]
    )


def _handed_back(store: Store) -> int:
    """Jobs handed back READY by a provider limit so far (``deferred`` attempts): each costs
    a move and a claim again, without an effect."""
    with store.engine.connect() as conn:
        query = text("SELECT count(*) FROM outbox_job_attempts WHERE outcome = 'deferred'")
        return int(conn.execute(query).scalar_one())


def _most_claims(store: Store) -> int:
    with store.engine.connect() as conn:
        query = text("SELECT coalesce(max(lease_epoch), 0) FROM outbox_jobs")
        return int(conn.execute(query).scalar_one())


def _latencies(store: Store, effects: list[dict[str, Any]], since: float) -> list[float]:
    created: dict[int, float] = {}
    with store.engine.connect() as conn:
        for job_id, at in conn.execute(text("SELECT id, created_at FROM outbox_jobs")):
            created[int(job_id)] = float(at)
    return sorted(
        e["time"] - created[int(e["body"]["job"])]
        for e in effects
        if e["time"] >= since and int(e["body"]["job"]) in created
    )


def _q(values: list[float], p: float) -> float | None:
    return values[min(len(values) - 1, int(p * len(values)))] if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def offered(
    store: Store, sim: SimulatorProcess, pid: int, rate: float, seconds: float, tag: str
) -> dict[str, Any]:
    """Enqueue at ``rate`` for ``seconds`` (ticks of 50 ms), then let it settle."""
    before, back, calls = len(sim.effects()), _handed_back(store), len(sim.arrivals())
    cpu0, t0 = cpu_seconds(pid), time.time()
    sent = 0
    while (elapsed := time.time() - t0) < seconds:
        due = int(rate * elapsed) - sent
        if due > 0:
            _enqueue(store, tag, sent, due)
            sent += due
        time.sleep(0.05)
    window = time.time() - t0
    effects = sim.effects()
    made = len(effects) - before
    cpu = cpu_seconds(pid) - cpu0
    deadline = time.time() + 60
    while len(sim.effects()) - before < sent and time.time() < deadline:
        time.sleep(0.2)
    lat = _latencies(store, sim.effects(), t0)
    settled = len(sim.effects()) - before
    return {
        "offered": rate,
        "effects_per_s": made / window,
        "p50": _q(lat, 0.5),
        "p99": _q(lat, 0.99),
        "cpu_pct": 100 * cpu / window,
        "cpu_ms": 1000 * cpu / max(made, 1),
        "handed_back": _handed_back(store) - back,
        "requests": (len(sim.arrivals()) - calls) / max(settled, 1),
        "claims": _most_claims(store),
    }


def ceiling(
    store: Store, sim: SimulatorProcess, pid: int, backlog: int, tag: str
) -> dict[str, Any]:
    before, back, calls = len(sim.effects()), _handed_back(store), len(sim.arrivals())
    _enqueue(store, tag, 0, backlog)
    cpu0 = cpu_seconds(pid)
    deadline = time.time() + 300
    while len(sim.effects()) - before < backlog and time.time() < deadline:
        time.sleep(0.2)
    cpu = cpu_seconds(pid) - cpu0
    times = sorted(e["time"] for e in sim.effects()[before:])
    span = (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {
        "effects": len(times),
        "effects_per_s": (len(times) - 1) / span if span else 0.0,
        "cpu_ms": 1000 * cpu / max(len(times), 1),
        "handed_back": _handed_back(store) - back,
        "requests": (len(sim.arrivals()) - calls) / max(len(times), 1),
        "claims": _most_claims(store),
    }


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench effects",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--latency", type=float, default=0.3, help="seconds per send")
    parser.add_argument("--rates", default="50,100,200,400", help="jobs/s offered, in turn")
    parser.add_argument("--seconds", type=float, default=8.0, help="each rate's window")
    parser.add_argument("--backlog", type=int, default=3000, help="jobs for the ceiling")
    parser.add_argument("--handlers", default="async,sync")
    parser.add_argument("--capacity", type=int, default=None, help="sends served at once")
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="each send's latency varies by ± this fraction"
    )
    parser.add_argument("--provider", choices=("http", "blocking"), default="http")
    parser.add_argument("--concurrency", type=int, default=None, help="the worker's slots")
    parser.add_argument("--threads", type=int, default=None, help="its threads for def handlers")
    args = parser.parse_args(argv)
    if args.provider == "blocking":
        args.handlers = "sync"
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    with os.popen("uptime") as uptime:
        print(f"machine: {os.cpu_count()} cores; {uptime.read().strip()}", flush=True)
    served = f", {args.capacity} sends at once" if args.capacity else ""
    jitter = f" ± {args.jitter:.0%}" if args.jitter else ""
    print(
        f"provider: {args.provider}, {args.latency * 1000:.0f} ms{jitter} per send{served}; "
        f"one worker, concurrency {args.concurrency or 'default'}, "
        f"threads {args.threads or 'default'}"
    )
    for handler in [h.strip() for h in args.handlers.split(",") if h.strip()]:
        schema, url = _schema_url()
        directory = Path(tempfile.mkdtemp(prefix="bench-effects-"))
        store = Store(url)
        store.create_schema()
        try:
            with SimulatorProcess(directory / "sim.db") as sim:
                sim.configure(latency=args.latency, jitter=args.jitter, capacity=args.capacity)
                worker = _worker(url, sim, handler, directory / "worker.log", args)
                try:
                    time.sleep(2.0)  # the worker is up
                    label = "user's blocking provider" if args.provider == "blocking" else ""
                    print(f"\n{handler} handler {label}")
                    print(HEAD)
                    print("|---|---|---|---|---|---|---|---|---|")
                    for i, rate in enumerate(rates):
                        row = offered(store, sim, worker.pid, rate, args.seconds, f"r{i}")
                        print(
                            f"| {rate:.0f} | {row['effects_per_s']:.0f} | {_ms(row['p50'])} | "
                            f"{_ms(row['p99'])} | {row['cpu_pct']:.0f} | {row['cpu_ms']:.2f} | "
                            f"{row['handed_back']} | {row['requests']:.2f} | {row['claims']} |",
                            flush=True,
                        )
                    top = ceiling(store, sim, worker.pid, args.backlog, "max")
                    print(
                        f"ceiling: {top['effects']} jobs drained at {top['effects_per_s']:.0f} "
                        f"effects/s, {top['cpu_ms']:.2f} ms CPU per effect, "
                        f"{top['handed_back']} handed back, "
                        f"{top['requests']:.2f} requests per effect, "
                        f"at most {top['claims']} claims of one job",
                        flush=True,
                    )
                finally:
                    worker.send_signal(signal.SIGTERM)
                    try:
                        worker.wait(60)
                    except subprocess.TimeoutExpired:
                        worker.kill()
        finally:
            store.dispose()
            _drop(schema)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
