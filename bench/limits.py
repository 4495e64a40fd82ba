"""The fleet-wide limits of issue 21, across two worker processes: tenant, rate, Retry-After.

``python -m bench limits [--tenant-limit 4] [--rate 20] [--latency 0.2] [--jobs 300]
[--concurrency N] [--parts tenant,rate,retry-after] [--provider http|blocking]``

``--provider blocking`` (issue 37): the workers run ``tests.blocking_app:build`` instead, a
user's own provider as the docs show it (``urllib``, a new connection per call, an
``Operations`` built apart from the worker, a ``def`` handler; a 429 becomes
``TransientFailure(retry_after=S)``).

Every part runs its own ``outbox-simulator serve`` (each send takes ``--latency`` seconds
± 50 %: 100-300 ms by default), two ``outbox-worker run tests.effects_app:build`` processes
(a ``def`` handler calling ``job.dispatch`` on an ``HttpProvider``; the workers' default
slots unless ``--concurrency``) and a PostgreSQL schema of its own on the shared server,
dropped at the end. What is counted comes from the database and from the simulator (its
``/arrivals``: when each call reached it, its headers read), never from what the workers say
about themselves. Each part prints a table: its settings, the machine's load average when
it started, then the figures beside what issue 21 asks.

1. **Tenant limit** (``--tenant-limit N`` on both workers). Tenant ``big`` gets 200 jobs,
   then tenant ``small`` 20. A thread samples the job table every 20 ms while they run
   (``SELECT tenant, count(*) FROM outbox_jobs WHERE state = 'LEASED' GROUP BY tenant``, one
   statement, so one snapshot over both workers); *most LEASED at once* is the highest count
   of one tenant in any sample, against N. A sample every 20 ms can miss a lease that lasted
   less: it shows the limit was reached and not exceeded when looked at, it does not prove
   it. *Done after*: from a tenant's enqueue to the last of its jobs DONE (the job rows'
   ``updated_at``, database clock on this machine). The small tenant should be done in a few
   seconds, not after the big one.
2. **Rate limit** (``MAIL_RATE=R``: the mail provider's ``rate_limit``, calls/s for the whole
   fleet). ``--jobs`` jobs. From the simulator's arrivals (every call: sends, resends,
   lookups): the most calls in any one-second window ``[t, t + 1)`` starting at an arrival,
   against R, and the achieved calls/s (arrivals over the span from the first to the last).
   The limiter spaces calls ``1.25 / R`` apart (``consumer.jobs.limits``: a margin for a call
   reaching the provider late), so the achieved rate tops out near ``R / 1.25``. *Handed
   back*: attempts that ended ``deferred`` (a job handed back READY because its wait for
   the limit was too long): each a claim and a write without an effect.
3. **Retry-After**. ``--jobs`` jobs enqueued at a steady pace over 6 s, no rate limit; 2 s
   in, once both workers hold leased jobs, the simulator is told to answer the next send
   ``429`` with ``Retry-After: 3`` (once), while jobs keep coming. From its arrivals: the
   calls that reached the provider in the 3 s after the 429 was answered (the 429 is
   answered as it arrives, before any latency; its arrival time stands for its answer).
   Each of those sends is split by when its call started at the worker: the operation's
   ``call_deadline`` minus the call timeout (``SIM_TIMEOUT``, 5 s) is the database clock at
   which the worker wrote the call's intent, in the same statement that checks the pause,
   right before it sends. *In flight*: its intent was written before the 429 was answered
   (it had passed its pause check). *Sent after*: written after; those are calls the pause
   should have stopped. Also shown: how long after the 429 the pause reached the database
   (``paused_until`` minus 3 s), and when the next call came.

Each part also counts the effects at the provider against the jobs (one each: none lost,
none doubled). Figures depend on what else the machine runs (the load average says how
busy it was): a benchmark that prints and compares, never a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from consumer import Store  # noqa: E402
from tests.services import wait_for  # noqa: E402
from tests.simulator_support import SimulatorProcess  # noqa: E402

BASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
APP = "tests.effects_app:build"
JITTER = 0.5  # the simulator's latency varies by this fraction either way
CALL_TIMEOUT = 5.0  # SIM_TIMEOUT: the provider call's timeout, in the workers
RETRY_AFTER = 3
SAMPLE_EVERY = 0.02
PARTS = ("tenant", "rate", "retry-after")
RAMP = 6.0  # part 3 enqueues its jobs over this many seconds
FAULT_AT = 2.0  # ... and sets the 429 fault this long after it began, once both are busy


@dataclass
class Run:
    """One part's world: a schema, a simulator, two workers."""

    store: Store
    sim: SimulatorProcess
    workers: list[subprocess.Popen[bytes]]
    logs: list[Path]
    command: str


# -- the world ----------------------------------------------------------------------------------


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def _world(part: str, flags: list[str], env: dict[str, str], latency: float) -> Iterator[Run]:
    """A schema, a simulator adding ``latency`` to each send and two ``outbox-worker run``
    processes with ``flags`` and ``env``; all stopped and dropped on the way out."""
    schema = f"bench_limits_{part.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(BASE_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = f"{BASE_URL}?options=-csearch_path%3D{schema}"
    directory = Path(tempfile.mkdtemp(prefix=f"bench-limits-{part}-"))
    store = Store(url)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        store.create_schema()
        with SimulatorProcess(directory / "sim.db") as sim:
            sim.configure(latency=latency, jitter=JITTER)
            command = [sys.executable, "-m", "consumer.jobs.cli", "run", APP, *flags]
            full_env = dict(
                os.environ,
                OUTBOX_DATABASE_URL=url,
                OUTBOX_LOG_LEVEL="warning",
                MAIL_URL=sim.url,
                SIM_TIMEOUT=str(CALL_TIMEOUT),
                **env,
            )
            logs = [directory / f"worker{n}.log" for n in range(2)]
            try:
                for log in logs:
                    with open(log, "ab") as out:
                        workers.append(
                            subprocess.Popen(
                                command,
                                cwd=ROOT,
                                env=full_env,
                                stdout=out,
                                stderr=subprocess.STDOUT,
                            )
                        )
                wait_for(lambda: _alive(store) >= 2, "two live workers", timeout=60)
                shown = " ".join(f"{k}={v}" for k, v in env.items())
                yield Run(
                    store,
                    sim,
                    workers,
                    logs,
                    f"2 x `{shown + ' ' if shown else ''}outbox-worker run {APP}"
                    f"{' ' + shlex.join(flags) if flags else ''}`",
                )
            finally:
                _stop(workers, logs)
    finally:
        store.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
        shutil.rmtree(directory, ignore_errors=True)  # a failed worker's log is printed above


def _alive(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outbox_workers")).scalar_one())


def _stop(workers: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, log in zip(workers, logs, strict=False):
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code != 0:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            print(f"worker {proc.pid} exited {code}; its log ({log}):\n{tail}", flush=True)


def _states(store: Store) -> Counter[str]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT state, count(*) FROM outbox_jobs GROUP BY state"))
        return Counter({str(state): int(n) for state, n in rows})


def _wait_done(store: Store, count: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _states(store)["DONE"] >= count:
            return True
        time.sleep(0.1)
    return False


def _enqueue(store: Store, tenant: str, count: int, *, start: int = 0) -> None:
    store.enqueue_many(
        [
            {"tenant": tenant, "action": f"email-{tenant}-{i}", "subject": f"{tenant}{i}@x.test"}
            for i in range(start, start + count)
        ]
    )


def _effects(sim: SimulatorProcess, jobs: int) -> str:
    made = Counter(e["operation_id"] for e in sim.effects())
    doubled = sum(1 for n in made.values() if n > 1)
    return f"{sum(made.values())} for {jobs} jobs, {len(made)} distinct, {doubled} doubled"


def _most_in_a_second(times: list[float]) -> tuple[int, float]:
    """The most arrivals in any window ``[t, t + 1)`` starting at an arrival, and that t."""
    times = sorted(times)
    best, at, end = 0, times[0] if times else 0.0, 0
    for start, t in enumerate(times):
        while end < len(times) and times[end] < t + 1.0:
            end += 1
        if end - start > best:
            best, at = end - start, t
    return best, at


def _table(rows: list[tuple[str, str, str]]) -> None:
    print("| | measured | issue 21 asks |")
    print("|---|---|---|")
    for name, value, target in rows:
        print(f"| {name} | {value} | {target} |")
    print(flush=True)


# -- 1. tenant limit ----------------------------------------------------------------------------


def tenant_part(args: argparse.Namespace, flags: list[str]) -> None:
    limit = args.tenant_limit
    print(f"## 1. tenant limit: --tenant-limit {limit}, 200 jobs of `big`, then 20 of `small`")
    load = _load()
    with _world("tenant", [*flags, "--tenant-limit", str(limit)], {}, args.latency) as run:
        samples: list[dict[str, int]] = []
        sampled_at: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            with run.store.engine.connect() as conn:
                query = text(
                    "SELECT tenant, count(*) FROM outbox_jobs WHERE state = 'LEASED' "
                    "GROUP BY tenant"
                )
                while not stop.wait(SAMPLE_EVERY):
                    found = {str(t): int(n) for t, n in conn.execute(query)}
                    conn.commit()
                    samples.append(found)
                    sampled_at.append(time.monotonic())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            big_at = time.time()
            _enqueue(run.store, "big", 200)
            small_at = time.time()
            _enqueue(run.store, "small", 20)
            finished = _wait_done(run.store, 220, 150)
        finally:
            stop.set()
            sampler.join(10)
        with run.store.engine.connect() as conn:
            done = {
                str(tenant): (int(n), float(last))
                for tenant, n, last in conn.execute(
                    text(
                        "SELECT tenant, count(*), max(updated_at) FROM outbox_jobs "
                        "WHERE state = 'DONE' GROUP BY tenant"
                    )
                )
            }
        effects = _effects(run.sim, 220)
        left = dict(_states(run.store))
    most = {t: max((s.get(t, 0) for s in samples), default=0) for t in ("big", "small")}
    at_limit = sum(1 for s in samples if s.get("big", 0) == limit)
    over = sum(1 for s in samples if any(n > limit for n in s.values()))
    spanned = sampled_at[-1] - sampled_at[0] if len(sampled_at) > 1 else 0.0
    every = 1000 * spanned / (len(sampled_at) - 1) if spanned else 0.0

    def done_after(tenant: str, since: float, jobs: int) -> str:
        n, last = done.get(tenant, (0, 0.0))
        if n < jobs:
            return f"not done: {n} of {jobs} DONE"
        return f"{last - since:.2f} s"

    _table(
        [
            ("workers", run.command, "2 processes"),
            ("provider", f"{args.latency * 1000:.0f} ms ± {JITTER:.0%} per send", "100-300 ms"),
            ("load average at start", load, ""),
            (
                "samples of LEASED per tenant",
                f"{len(samples)}, one every {every:.0f} ms on average",
                f"every {SAMPLE_EVERY * 1000:.0f} ms",
            ),
            (
                "most `big` jobs LEASED at once",
                f"{most['big']} ({at_limit} samples at {limit})",
                f"≤ {limit}",
            ),
            ("most `small` jobs LEASED at once", str(most["small"]), f"≤ {limit}"),
            ("samples with a tenant over the limit", str(over), "0"),
            ("`small` (20) done after its enqueue", done_after("small", small_at, 20), "a few s"),
            ("`big` (200) done after its enqueue", done_after("big", big_at, 200), ""),
            ("effects at the provider", effects, "one per job"),
        ]
    )
    if not finished:
        print(f"not every job was DONE within 150 s; states: {left}\n", flush=True)


# -- 2. rate limit ------------------------------------------------------------------------------


def rate_part(args: argparse.Namespace, flags: list[str]) -> None:
    rate, jobs = args.rate, args.jobs
    print(f"## 2. rate limit: MAIL_RATE={rate:g} calls/s for the fleet, {jobs} jobs")
    load = _load()
    with _world("rate", flags, {"MAIL_RATE": f"{rate:g}"}, args.latency) as run:
        _enqueue(run.store, "acme", jobs)
        finished = _wait_done(run.store, jobs, 60 + 2 * jobs / rate)
        calls = run.sim.arrivals()
        effects = _effects(run.sim, jobs)
        left = dict(_states(run.store))
        with run.store.engine.connect() as conn:
            handed_back = int(
                conn.execute(
                    text("SELECT count(*) FROM outbox_job_attempts WHERE outcome = 'deferred'")
                ).scalar_one()
            )
    times = sorted(a["time"] for a in calls)
    kinds = Counter(str(a["kind"]) for a in calls)
    most, at = _most_in_a_second(times)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    achieved = (len(times) - 1) / span if span else 0.0
    _table(
        [
            ("workers", run.command, "2 processes"),
            ("provider", f"{args.latency * 1000:.0f} ms ± {JITTER:.0%} per send", ""),
            ("load average at start", load, ""),
            (
                "calls at the provider",
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                "",
            ),
            (
                "most calls in one second (sliding)",
                f"{most} (window starting {at - times[0]:.2f} s in)" if times else "-",
                f"≤ {rate:g}",
            ),
            (
                "achieved calls/s",
                f"{achieved:.1f} over {span:.1f} s",
                f"≤ {rate:g} (spacing tops out at {rate / 1.25:.1f})",
            ),
            ("jobs handed back by the limiter", str(handed_back), ""),
            ("effects at the provider", effects, "one per job"),
        ]
    )
    if not finished:
        print(f"not every job was DONE; states: {left}\n", flush=True)


# -- 3. Retry-After -----------------------------------------------------------------------------


def retry_after_part(args: argparse.Namespace, flags: list[str]) -> None:
    jobs = args.jobs
    print(f"## 3. Retry-After: one `429 Retry-After: {RETRY_AFTER}` while both workers are busy")
    load = _load()
    with _world("retry-after", flags, {}, args.latency) as run:
        began = time.monotonic()
        feeding = threading.Event()

        def feed() -> None:  # jobs/RAMP a second, in ticks of 50 ms: the workers stay busy
            sent = 0
            while sent < jobs and not feeding.wait(0.05):
                due = min(jobs, int(jobs * (time.monotonic() - began) / RAMP)) - sent
                if due > 0:
                    _enqueue(run.store, "acme", due, start=sent)
                    sent += due

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        leased: Counter[str] = Counter()

        def busy() -> bool:
            nonlocal leased
            if time.monotonic() - began < FAULT_AT:
                return False
            with run.store.engine.connect() as conn:
                leased = Counter(
                    {
                        str(owner): int(n)
                        for owner, n in conn.execute(
                            text(
                                "SELECT lease_owner, count(*) FROM outbox_jobs "
                                "WHERE state = 'LEASED' GROUP BY lease_owner"
                            )
                        )
                    }
                )
            return len(leased) >= 2

        injected = True
        try:
            wait_for(busy, "both workers busy", timeout=60, interval=0.02)
        except AssertionError:
            injected = False  # report what happened; inject anyway
        run.sim.faults({"kind": "rate_limit", "retry_after": RETRY_AFTER, "count": 1})
        fault_set = time.monotonic() - began
        try:
            finished = _wait_done(run.store, jobs, 120)
        finally:
            feeding.set()
            feeder.join(10)
        calls = run.sim.arrivals()
        effects = _effects(run.sim, jobs)
        left = dict(_states(run.store))
        with run.store.engine.connect() as conn:
            starts = {
                str(op): float(deadline) - CALL_TIMEOUT
                for op, deadline in conn.execute(
                    text("SELECT operation_id, call_deadline FROM outbox_operations")
                )
                if deadline is not None
            }
            pause = conn.execute(
                text("SELECT paused_until, pauses FROM outbox_provider_limits")
            ).first()
    limited = [a["time"] for a in calls if a["fault"] == "rate_limit"]
    if not limited:
        print("no send met the 429 fault: nothing to measure\n", flush=True)
        return
    t429 = limited[0]
    during = [a for a in calls if t429 < a["time"] <= t429 + RETRY_AFTER]
    in_flight: list[float] = []
    after: list[float] = []
    unknown = 0
    lookups = 0
    for a in during:
        start = starts.get(str(a["operation_id"]))
        if a["kind"] != "send":
            lookups += 1
        elif start is None or start > a["time"]:
            unknown += 1  # the operation's recorded start is a later call's
        elif start <= t429:
            in_flight.append(a["time"] - t429)
        else:
            after.append(start - t429)
    later = [a["time"] for a in calls if a["time"] > t429 + RETRY_AFTER]
    written = f"{(float(pause[0]) - RETRY_AFTER - t429) * 1000:.0f} ms" if pause else "-"
    busy_text = " and ".join(str(n) for n in sorted(leased.values(), reverse=True)) or "none"
    _table(
        [
            ("workers", run.command, "2 processes"),
            ("provider", f"{args.latency * 1000:.0f} ms ± {JITTER:.0%} per send", ""),
            ("load average at start", load, ""),
            ("jobs offered", f"{jobs} over {RAMP:.0f} s ({jobs / RAMP:.0f}/s)", ""),
            (
                "jobs LEASED per worker when the fault was set",
                f"{busy_text} ({fault_set:.1f} s in)"
                + ("" if injected else " (not both busy: set anyway)"),
                "both busy",
            ),
            (
                f"calls reaching the provider in the {RETRY_AFTER} s after the 429",
                str(len(during)),
                "only those in flight",
            ),
            (
                "... in flight (intent before the 429's answer)",
                f"{len(in_flight)}"
                + (f", arrived within {max(in_flight) * 1000:.0f} ms of it" if in_flight else ""),
                "",
            ),
            (
                "... sent after the 429's answer",
                f"{len(after)}"
                + (
                    f", intents {min(after) * 1000:.0f}-{max(after) * 1000:.0f} ms after it"
                    if after
                    else ""
                ),
                "0",
            ),
            ("... lookups / sends of unknown start", f"{lookups} / {unknown}", ""),
            ("the pause reached the database", f"{written} after the 429", ""),
            (
                "next call after the window",
                f"{later[0] - t429:.2f} s after the 429" if later else "none",
                f"≥ {RETRY_AFTER} s",
            ),
            ("pauses recorded", str(pause[1]) if pause else "0", "1"),
            ("effects at the provider", effects, "one per job"),
        ]
    )
    if not finished:
        print(f"not every job was DONE; states: {left}\n", flush=True)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench limits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tenant-limit",
        type=int,
        default=4,
        help="part 1: --tenant-limit N on both workers (most jobs of one tenant LEASED)",
    )
    parser.add_argument(
        "--rate", type=float, default=20.0, help="part 2: the provider's rate_limit, calls/s"
    )
    parser.add_argument(
        "--latency",
        type=float,
        default=0.2,
        help=f"seconds the simulator adds to each send (± {JITTER:.0%}); every part",
    )
    parser.add_argument("--jobs", type=int, default=300, help="jobs in parts 2 and 3")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="slots per worker (--concurrency); default: the workers' own",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"which parts to run, comma-separated, of {', '.join(PARTS)}",
    )
    parser.add_argument("--provider", choices=("http", "blocking"), default="http")
    args = parser.parse_args(argv)
    global APP
    APP = "tests.blocking_app:build" if args.provider == "blocking" else APP
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    flags = ["--concurrency", str(args.concurrency)] if args.concurrency else []
    print(f"machine: {os.cpu_count()} cores; command: python -m bench limits {shlex.join(argv)}")
    print(flush=True)
    started = time.monotonic()
    runs = {"tenant": tenant_part, "rate": rate_part, "retry-after": retry_after_part}
    for part in parts:
        runs[part](args, flags)
    print(f"all parts: {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
