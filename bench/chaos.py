"""The chaos matrix: the whole loop under one fault at a time, and its books.

``python -m bench chaos [--faults a,b] [--duration S] [--rate R] [--report FILE.md]``

For each fault: start the whole pipeline as real processes (``bench.loop``: writers, 2
relays, 2 consumers, 2 workers, the connector simulator as the provider, on a private
PostgreSQL and a private Redis), let a steady load flow (warm-up), apply the fault for
``--duration`` seconds, keep the load for a tail, stop it, wait until everything settled,
and check the books:

- every committed quote has exactly one effect at the provider; rolled-back quotes none;
- duplicate events of one identity made one job (jobs == committed quotes);
- nothing pending in the outbox, the consumer group (pending or unread) or the job store;
- no receipt left UNKNOWN or PENDING (the provider has lookup and idempotency).

One row per fault: events lost, duplicated effects, recovery time (from the fault clearing
to the backlog, committed quotes without an effect yet, back at its steady level: the 90th
percentile of the warm-up's), the longest commit -> effect time of the quotes committed from
the fault's start, and the throughput (effects per second) during the fault next to the
offered rate. ``--report`` writes the table as markdown, and a PNG of throughput and
backlog over time for one fault's run (``--chart FAULT``, default the first).

Every fault is bounded in time and count, uses loopback only and cleans up: the servers and
processes are private to the run and removed at its end (``--keep`` leaves the logs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench.loop import (
    POISON_STREAM,
    ROOT,
    STREAM,
    Loop,
    LoopSettings,
    Sample,
    backlog_series,
    private_postgres,
    problems,
    rate_series,
    steady_backlog,
)

# -- the faults ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    apply: Callable[[Loop, float], str]  # runs the fault for ~duration s; returns a note
    minute: bool = False  # the issue asks for a minute of it (full runs; --duration overrides)
    note: str = ""


def _every(loop: Loop, duration: float, period: float, action: Callable[[int], None]) -> int:
    """Call ``action(i)`` every ``period`` seconds for ``duration`` seconds; the count."""
    end = time.monotonic() + duration
    count = 0
    while time.monotonic() < end:
        action(count)
        count += 1
        time.sleep(max(0.0, min(period, end - time.monotonic())))
    return count


def kill_one_relay(loop: Loop, duration: float) -> str:
    victim = loop.procs["relay"][0]
    victim.kill()  # the other relay must carry the load alone
    time.sleep(duration)
    victim.start()
    return "relay-0 SIGKILLed, down for the fault"


def kill_relays_every_second(loop: Loop, duration: float) -> str:
    relays = loop.procs["relay"]
    count = _every(loop, duration, 1.0, lambda i: relays[i % len(relays)].restart())
    return f"{count} relay SIGKILLs, each restarted at once"


def kill_consumers_and_workers_every_second(loop: Loop, duration: float) -> str:
    victims = [*loop.procs["consumer"], *loop.procs["worker"]]
    count = _every(loop, duration, 1.0, lambda i: victims[i % len(victims)].restart())
    return f"{count} SIGKILLs (consumers and workers in turn), each restarted at once"


def kill_worker_at_accept(loop: Loop, duration: float) -> str:
    """The provider acts and holds its answer; the worker that made the call is SIGKILLed
    before it hears back (its receipt stays PENDING, the next worker reconciles)."""
    end = time.monotonic() + duration
    kills = 0
    assert loop.engine is not None
    while time.monotonic() < end and kills < 5:
        loop.simulator.faults({"kind": "hang", "count": 1, "delay": 30})
        while time.monotonic() < end:
            plan = loop.simulator.fault_plan()
            if not plan or plan[0].get("count") == 0:
                break
            time.sleep(0.02)
        time.sleep(0.2)  # the other calls of that moment answer; the hung one does not
        # Quick, so the victim is still waiting for the answer (its call times out in
        # provider_timeout): the open intents, then which of them the provider acted on.
        victim_pid = None
        with loop.engine.connect() as conn:
            open_ops = [
                r[0]
                for r in conn.execute(
                    text("SELECT operation_id FROM outbox_operations WHERE state = 'PENDING'")
                )
            ]
        for operation_id in open_ops:
            for effect in loop.simulator.effects(operation_id):
                victim_pid = int(effect["headers"].get("x-loop-worker", "0"))
        for proc in loop.procs["worker"]:
            if victim_pid is not None and proc.pid == victim_pid:
                proc.kill()
                kills += 1
                proc.start()
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
    loop.simulator.faults()
    return f"{kills} workers SIGKILLed after the provider acted, before its answer"


def terminate_backends(loop: Loop, duration: float) -> str:
    admin = create_engine(loop.pg.url, isolation_level="AUTOCOMMIT")
    killed = [0]

    def terminate(_: int) -> None:
        with contextlib.suppress(Exception), admin.connect() as conn:
            killed[0] += int(
                conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = :db AND pid <> pg_backend_pid()"
                    ),
                    {"db": loop.name},
                ).scalar_one()
            )

    rounds = _every(loop, duration, 0.2, terminate)
    admin.dispose()
    return f"{rounds} rounds, {killed[0]} backends terminated"


def restart_postgres(mode: str) -> Callable[[Loop, float], str]:
    def apply(loop: Loop, duration: float) -> str:
        started = time.monotonic()
        loop.pg.restart(mode)
        took = time.monotonic() - started
        time.sleep(max(0.0, duration - took))
        return f"pg_ctl restart -m {mode}: down {took:.1f} s"

    return apply


def kill_redis_aof(loop: Loop, duration: float) -> str:
    loop.redis.stop(kill=True)
    time.sleep(min(1.0, duration))
    loop.redis.start()
    time.sleep(max(0.0, duration - 1.0))
    return "redis-server SIGKILLed, restarted after 1 s from its AOF (appendfsync always)"


def redis_restarts_empty(loop: Loop, duration: float) -> str:
    """Redis without persistence dies: every acknowledged entry is gone. The operator
    runs ``outbox-relay republish --since`` (the run's start) once Redis is back."""
    since = int(loop.wall_started) - 5
    loop.redis.stop(kill=True)
    # The loop's Redis runs with AOF (for the kill -9 row); losing its files is what a
    # Redis without persistence, or a failover to an empty replica, does.
    for leftover in ("appendonlydir", "dump.rdb"):
        path = Path(loop.redis.directory) / leftover
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    time.sleep(min(1.0, duration))
    loop.redis.start()
    loop.redis_client().set(POISON_STREAM, "not a stream")
    time.sleep(max(0.0, duration - 1.0))
    done = subprocess.run(
        [sys.executable, "-m", "relay.cli", "republish", "--since", str(since)],
        cwd=ROOT,
        env=loop.env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode == 2 or "invalid choice" in done.stderr:
        return "NOT YET: outbox-relay republish is not there (relay engineer's part)"
    return f"republish --since {since}: exit {done.returncode}: {done.stdout.strip()[-200:]}"


def redis_restarts_empty_auto(loop: Loop, duration: float) -> str:
    """The same loss, repaired by the relays themselves (``--auto-republish``)."""
    for proc in loop.procs["relay"]:
        proc.argv = [*proc.argv, "--auto-republish"]
        proc.restart()
    loop.redis.stop(kill=True)
    for leftover in ("appendonlydir", "dump.rdb"):
        path = Path(loop.redis.directory) / leftover
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    time.sleep(min(1.0, duration))
    loop.redis.start()
    loop.redis_client().set(POISON_STREAM, "not a stream")
    time.sleep(max(0.0, duration - 1.0))
    for proc in loop.procs["relay"]:  # back to the defaults for the next fault
        proc.argv = [a for a in proc.argv if a != "--auto-republish"]
    return "relays run with --auto-republish; no operator"


def long_transaction(loop: Loop, duration: float) -> str:
    """A transaction holds its snapshot (and the xmin horizon) for the whole fault."""
    engine = create_engine(loop.url)
    with engine.connect() as conn:
        xid = conn.execute(text("SELECT txid_current()")).scalar_one()
        time.sleep(duration)
        conn.rollback()
    engine.dispose()
    return f"transaction {xid} open {duration:.0f} s"


def exhaust_connections(loop: Loop, duration: float) -> str:
    import psycopg

    dsn = loop.url.replace("postgresql+psycopg://", "postgresql://")
    held = []
    refused = ""
    for _ in range(400):
        try:
            held.append(psycopg.connect(dsn, connect_timeout=5))
        except Exception as exc:
            refused = str(exc).strip().splitlines()[-1][:120]
            break
    time.sleep(duration)
    for conn in held:
        with contextlib.suppress(Exception):
            conn.close()
    return f"{len(held)} connections held until refused ({refused})"


def burst(loop: Loop, duration: float) -> str:
    extra = loop.start_writers(loop.settings.rate * 0.5, tag="burst")
    time.sleep(duration)
    for proc in extra:
        proc.stop()
    return f"rate {loop.settings.rate * 1.5:.0f}/s for {duration:.0f} s"


def poison(loop: Loop, duration: float) -> str:
    """Poison records mixed into the load: events the relay cannot publish (WRONGTYPE), events
    whose handler always fails, and stream entries that cannot be decoded."""
    extra = loop.start_writers(max(2.0, loop.settings.rate * 0.05), poison=1.0, tag="poison")
    client = loop.redis_client()
    raw = 0
    for index in range(10):
        with contextlib.suppress(Exception):
            client.xadd(STREAM, {"garbage": f"poison-{index}", "data": "{not json"})
            raw += 1
        time.sleep(duration / 10)
    client.close()
    for proc in extra:
        proc.stop()
    return f"{raw} undecodable stream entries, and relay/handler poison events"


def provider_timeouts(loop: Loop, duration: float) -> str:
    """5 % of sends time out: half act and never answer, half act after the client gave up."""
    timeout = loop.settings.provider_timeout
    loop.simulator.faults(
        {"kind": "hang", "probability": 0.025, "delay": timeout * 3},
        {"kind": "slow", "probability": 0.025, "delay": timeout * 1.5},
        seed=7,
    )
    time.sleep(duration)
    loop.simulator.faults()
    return f"hang/slow on 5 % of sends (client timeout {timeout:.0f} s)"


def redis_maxmemory(loop: Loop, duration: float) -> str:
    client = loop.redis_client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used + 64 * 1024))
    time.sleep(duration)
    client.config_set("maxmemory", "0")
    client.close()
    return f"maxmemory {used // 1024 + 64} KiB (noeviction), then lifted"


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("kill-relay", "kill one relay", kill_one_relay),
        Fault("kill-relays", "kill relays every second", kill_relays_every_second, minute=True),
        Fault(
            "kill-consumers-workers",
            "kill consumers and workers every second",
            kill_consumers_and_workers_every_second,
        ),
        Fault(
            "kill-worker-at-accept", "kill a worker as the provider accepts", kill_worker_at_accept
        ),
        Fault("pg-terminate", "pg_terminate_backend on every connection, 5/s", terminate_backends),
        Fault("pg-restart-fast", "restart PostgreSQL (fast)", restart_postgres("fast")),
        Fault(
            "pg-restart-immediate", "restart PostgreSQL (immediate)", restart_postgres("immediate")
        ),
        Fault("redis-kill-aof", "kill -9 Redis, restart with AOF", kill_redis_aof),
        Fault("redis-empty", "Redis restarts empty, then republish", redis_restarts_empty),
        Fault(
            "redis-empty-auto",
            "Redis restarts empty, relays with --auto-republish",
            redis_restarts_empty_auto,
        ),
        Fault("long-transaction", "a transaction held open", long_transaction, minute=True),
        Fault(
            "connections-exhausted", "connections exhausted to max_connections", exhaust_connections
        ),
        Fault("burst", "a burst at 1.5x the sustained rate", burst),
        Fault("poison", "poison records mixed into the load", poison),
        Fault("provider-timeouts", "the provider times out on 5 % of sends", provider_timeouts),
        Fault("redis-maxmemory", "Redis at maxmemory", redis_maxmemory),
    )
}

REDIS_ONLY = frozenset(
    {"redis-kill-aof", "redis-empty", "redis-empty-auto", "redis-maxmemory", "poison"}
)
"""Faults that break the Redis server or rely on it (the poison route is a Redis key of the
wrong type, the undecodable entries are XADDed): ``--broker redis`` only."""


# -- one run -------------------------------------------------------------------------------


@dataclass
class Row:
    fault: str
    what: str
    note: str = ""
    lost: int = 0
    duplicated: int = 0
    recovery: float | None = None  # seconds; None: not back within the tail
    recovery_bound: float | None = None  # when not recovered under load: settled after
    longest: float | None = None
    p99: float | None = None
    throughput: float = 0.0
    offered: float = 0.0
    steady: float = 0.0
    committed_rate: float = 0.0
    slowest: list[dict[str, Any]] = field(default_factory=list)
    settled: bool = False
    problems: list[str] = field(default_factory=list)
    books: dict[str, Any] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)
    logs: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Plan:
    duration: float = 20.0
    warmup: float = 8.0
    tail: float = 20.0
    settle: float = 180.0
    rate: float = 100.0
    env: dict[str, str] = field(default_factory=dict)
    minute: bool = False  # the faults marked "minute" last 60 s instead of ``duration``
    broker: str = "redis"  # or "nats": the relays and consumers on a private JetStream


def _count_at(samples: Sequence[Sample], at: float) -> int:
    best = 0
    for s in samples:
        if s.at > at:
            break
        if s.effects is not None:
            best = s.effects
    return best


def run_fault(loop: Loop, fault: Fault, plan: Plan, before: dict[str, Any]) -> Row:
    """One fault on a running loop: load, fault, tail, stop, settle, books.

    The books are the whole loop's since its start (every fault so far); ``before`` holds
    the previous fault's, so a row counts only what went wrong during its own fault."""
    row = Row(fault.name, fault.what, offered=plan.rate)
    exits = len(loop.self_exits)
    try:
        loop.ensure_running()
        loop.start_load()
        warm = loop.now()
        time.sleep(plan.warmup)
        start = loop.mark("fault_start")
        wall_start = time.time()
        duration = 60.0 if fault.minute and plan.minute else plan.duration
        row.note = fault.apply(loop, duration)
        cleared = loop.mark("fault_cleared")
        loop.ensure_running()
        time.sleep(plan.tail)
        loop.stop_load()
        row.settled = loop.settle(plan.settle)
        row.books = loop.books()
        row.problems = problems(row.books)
        if not row.settled:
            row.problems.insert(0, f"not settled within {plan.settle:.0f} s: {loop.open_work()}")
        loop.note_self_exits()
        if loop.self_exits[exits:]:  # issue 53: a fault is outlived, never a reason to exit
            row.problems.append(f"exited by themselves: {loop.self_exits[exits:]}")
        row.lost = row.books["lost"] - before.get("lost", 0)
        row.duplicated = row.books["duplicated_effects"] - before.get("duplicated_effects", 0)
        row.samples = [s for s in loop.samples if s.at >= warm]
        row.marks = {k: v for k, v in loop.marks.items() if v >= warm}
        row.steady = steady_backlog(row.samples, warm + 2.0, start)
        threshold = max(2.0 * row.steady, row.steady + plan.rate * 0.5, 10.0)
        for at, backlog in backlog_series(row.samples):
            if at >= cleared and backlog <= threshold:
                row.recovery = max(0.0, at - cleared)
                break
        if row.recovery is None and "settled" in row.marks:
            row.recovery_bound = row.marks["settled"] - cleared
        row.throughput = (_count_at(row.samples, cleared) - _count_at(row.samples, start)) / max(
            0.001, cleared - start
        )
        row.committed_rate = (
            _committed_at(row.samples, cleared) - _committed_at(row.samples, start)
        ) / max(0.001, cleared - start)
        row.slowest = loop.slowest(since=wall_start - 1.0)
        latencies = loop.effect_latencies(since=wall_start)
        if latencies:
            row.longest = latencies[-1]
            row.p99 = latencies[int(0.99 * (len(latencies) - 1))]
        if not row.ok:
            row.logs = loop.logs()
    except Exception as exc:
        row.problems.append(f"harness: {type(exc).__name__}: {exc}")
        row.logs = loop.logs()
        with contextlib.suppress(Exception):
            loop.stop_load()
    return row


def _committed_at(samples: Sequence[Sample], at: float) -> int:
    best = 0
    for s in samples:
        if s.at > at:
            break
        if s.committed is not None:
            best = s.committed
    return best


# -- the report ----------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| fault | lost | duplicated effects | recovery (s) | longest commit->effect (s) "
        "| p99 (s) | during the fault: effects/s (commits/s) | books |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.recovery is not None:
            recovery = f"{row.recovery:.1f}"
        elif row.recovery_bound is not None:
            recovery = f"> tail; settled {row.recovery_bound:.1f} after"
        else:
            recovery = "not recovered"
        books = "ok" if row.ok else "FAIL: " + "; ".join(row.problems)
        lines.append(
            f"| {row.what} | {row.lost} | {row.duplicated} | {recovery} | "
            f"{_seconds(row.longest)} | {_seconds(row.p99)} | "
            f"{row.throughput:.0f} ({row.committed_rate:.0f}) | {books} |"
        )
    return "\n".join(lines)


def chart(row: Row, path: Path) -> None:
    import matplotlib  # dev-only dependency, imported when a chart is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    rates = rate_series(row.samples)
    top.plot([t for t, _ in rates], [r for _, r in rates], color="tab:blue")
    top.axhline(row.offered, color="grey", linestyle=":", label="offered")
    top.set_ylabel("effects / s")
    top.legend(loc="lower left")
    backlog = backlog_series(row.samples)
    bottom.plot([t for t, _ in backlog], [b for _, b in backlog], color="tab:red")
    bottom.set_ylabel("committed, no effect yet")
    bottom.set_xlabel("seconds since start")
    for axis in (top, bottom):
        if "fault_start" in row.marks:
            axis.axvspan(row.marks["fault_start"], row.marks["fault_cleared"], alpha=0.15)
        if "load_stopped" in row.marks:
            axis.axvline(row.marks["load_stopped"], color="grey", linestyle="--")
    fig.suptitle(f"chaos: {row.what} (shaded: the fault; dashed: load stopped)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


MINUTE_NOTE = "60 s for killing relays every second and the open transaction, "


def report(rows: Sequence[Row], plan: Plan, command: str, chart_name: str | None) -> str:
    lines = [
        "# Chaos matrix",
        "",
        f"Command: `{command}`  ",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on this 2-core machine; "
        f"{plan.rate:.0f} quotes/s offered (10 % rolled back, 5 % approved with a duplicate "
        f"event), {plan.warmup:.0f} s warm-up, each fault {plan.duration:.0f} s "
        f"({MINUTE_NOTE if plan.minute else ''}"
        f"bounded in count as listed below), "
        f"{plan.tail:.0f} s of load after it, then load stopped and the books checked.",
        "",
        "The pipeline: writer processes, 2 relays, 2 consumers (batch handler, "
        "`store.enqueue_many`), 2 workers (`HttpProvider` to `outbox-simulator serve`, lookup "
        "and idempotency key on), a private PostgreSQL and a private Redis. Default settings "
        "unless said below.",
        "",
        "Recovery: seconds from the fault clearing until the backlog (committed quotes without "
        "an effect yet) is back at its steady level (2x the 90th percentile of the warm-up's, "
        "at least half a second of load); '> tail' when it was not back before the load "
        "stopped, with the time the run settled after the fault cleared.",
        "",
        table(rows),
        "",
        "## What each fault did",
        "",
    ]
    for row in rows:
        lines.append(f"- **{row.what}** (`{row.fault}`): {row.note or '-'}")
    lines += [
        "",
        "## Where the slowest quote of each fault waited",
        "",
        "Seconds from its commit to the relay's publish, the consumer's inbox row, the job's "
        "creation, the worker's first dispatch (the intent) and the provider's effect; claims: "
        "the job's lease epoch; calls: provider calls made.",
        "",
        "| fault | quote | total | relay | consumer | to job | worker claim | provider "
        "| claims | calls |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for slow in row.slowest[:1]:
            lines.append(
                f"| {row.fault} | "
                + " | ".join(
                    str(slow.get(k))
                    for k in (
                        "quote",
                        "total",
                        "relay",
                        "consumer",
                        "to_job",
                        "worker_claim",
                        "provider",
                        "claims",
                        "calls",
                    )
                )
                + " |"
            )
    if plan.env:
        lines += [
            "",
            "Settings changed from the defaults: "
            + ", ".join(f"`{k}={v}`" for k, v in sorted(plan.env.items())),
        ]
    if chart_name:
        lines += ["", f"![throughput and backlog over time]({chart_name})"]
    failing = [r for r in rows if not r.ok]
    if failing:
        lines += ["", "## Failing books: logs", ""]
        for row in failing:
            lines += [f"### {row.fault}", "", "```", row.logs[-6000:], "```", ""]
    return "\n".join(lines) + "\n"


def run_matrix(
    names: Sequence[str],
    plan: Plan,
    *,
    on_row: Callable[[Row], None] | None = None,
    keep: bool = False,
    provider_latency: float = 0.0,
) -> list[Row]:
    """Every fault in turn on ONE loop (its processes start once: a Python process costs a
    second or two of CPU to start, and the books hold for the loop as a whole)."""
    pg = private_postgres()
    settings = LoopSettings(rate=plan.rate, redis_aof=True, env=dict(plan.env), broker=plan.broker)
    loop = Loop(pg, "chaos", settings)
    rows: list[Row] = []
    try:
        loop.start(load=False)
        if provider_latency:  # a real provider's pace: every send takes this long (±50 %)
            loop.simulator.client.post(
                f"{loop.simulator.url}/config",
                json={"latency": provider_latency, "jitter": 0.5},
            ).raise_for_status()
        before: dict[str, Any] = {}
        for name in names:
            if not pg.running():  # a fault left it down: bring it back for the next one
                pg.start()
            row = run_fault(loop, FAULTS[name], plan, before)
            before = row.books or before
            rows.append(row)
            if on_row is not None:
                on_row(row)
    finally:
        loop.close(keep=keep)
        pg.close()
    return rows


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated fault names")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds per fault (default 20, and 60 for killing relays every second and the "
        "open transaction)",
    )
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--tail", type=float, default=20.0, help="seconds of load after a fault")
    parser.add_argument("--settle", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=100.0, help="quotes/s offered")
    parser.add_argument("--report", type=Path, default=None, help="markdown report (+ PNG)")
    parser.add_argument("--chart", default=None, help="the fault whose run the PNG shows")
    parser.add_argument("--json", type=Path, default=None, help="rows as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    parser.add_argument(
        "--broker",
        choices=("redis", "nats"),
        default="redis",
        help="the relays' and consumers' broker (nats: a private nats-server -js)",
    )
    parser.add_argument(
        "--provider-latency",
        type=float,
        default=0.0,
        help="seconds the provider adds to every send (±50 %%)",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    redis_only = [n for n in names if n in REDIS_ONLY]
    if args.broker != "redis" and redis_only:
        parser.error(f"{redis_only} break Redis or rely on it: --broker redis only")
    plan = Plan(
        args.duration or 20.0,
        args.warmup,
        args.tail,
        args.settle,
        args.rate,
        minute=args.duration is None,
        broker=args.broker,
    )

    def show(row: Row) -> None:
        print(table([row]).splitlines()[-1], flush=True)
        if not row.ok:
            print(row.logs[-3000:], file=sys.stderr, flush=True)

    print("\n".join(table([]).splitlines()), flush=True)
    rows = run_matrix(
        names, plan, on_row=show, keep=args.keep, provider_latency=args.provider_latency
    )
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                [{k: v for k, v in vars(r).items() if k not in ("samples", "logs")} for r in rows],
                indent=2,
                default=str,
            )
        )
    if args.report:
        chart_row = next((r for r in rows if r.fault == args.chart), rows[0] if rows else None)
        chart_name = None
        if chart_row is not None and chart_row.samples:
            png = args.report.with_suffix(".png")
            chart(chart_row, png)
            chart_name = png.name
        command = "python -m bench chaos " + " ".join(argv)
        args.report.write_text(report(rows, plan, command.strip(), chart_name))
        print(f"report: {args.report}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
