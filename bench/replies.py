"""``python -m bench replies``: the two figures of issue 38, on PostgreSQL.

**Reply latency** (``--skip-latency`` to leave out): a :class:`consumer.Worker` with its
defaults (``Worker(store)``: 256 slots, no NOTIFY, the adaptive poll) runs ``run()`` in a
thread. Jobs wait in WAITING_EXTERNAL; another Store (as the inbound endpoint's would be)
records a reply to one of them every ``--gap`` seconds (``Store.reply``: the job becomes
READY in that transaction), and the handler records ``perf_counter()`` minus the moment
before ``reply`` was called, when it sees the reply in ``job.replies``. In the same run and
alternated with it, the baseline: a new job enqueued (``Store.enqueue``) and its handler's
start, the worker's plain wake-up latency. Figures: p50 / p99 / max in ms, both.

**Inbound throughput** (``--skip-inbound``): ``outbox-worker inbound serve`` as one process;
``--clients`` concurrent HTTP/1.1 connections (one asyncio client in this process) post
signed delivery callbacks, each for an ACCEPTED receipt and with a new event id (signature
checked, deduplicated, applied, committed), for ``--seconds`` per round; alternated rounds of
``GET /healthz`` on the same connections measure the HTTP stack alone. Medians of
``--rounds``: accepted callbacks/s and healthz/s. The client shares the machine's cores with
the server: on 2 cores it takes a large part of one.

Options: ``--database-url``, ``--replies``, ``--gap``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from bench.procstat import cpu_seconds

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SECRET = "bench-secret-of-at-least-16"
ROOT = Path(__file__).resolve().parent.parent


def _schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


def _percentiles(values: list[float]) -> str:
    ordered = sorted(values)
    if not ordered:
        return "none"
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"max {ordered[-1] * 1000:.1f} ms (n={len(ordered)})"
    )


# -- reply latency --------------------------------------------------------------------------


def latency(url: str, replies: int, gap: float) -> None:
    from consumer import JobContext, Store, Worker

    store = Store(url)
    sender = Store(url, create_schema=False)
    worker = Worker(store)  # the defaults
    sent: dict[str, float] = {}
    seen: dict[str, list[float]] = {"reply": [], "enqueue": []}
    expected = {"reply": replies, "enqueue": replies}
    done = threading.Event()

    def handle(job: JobContext) -> None:
        if job.action.startswith("new-"):
            seen["enqueue"].append(time.perf_counter() - sent[job.action])
        elif job.replies:
            seen["reply"].append(time.perf_counter() - sent[job.action])
            return  # DONE: the reply consumed
        else:
            job.wait_external("the customer's answer")
            return
        if all(len(seen[k]) >= expected[k] for k in seen):
            done.set()

    worker.register("conv", handle)
    worker.register("new", handle)
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    actions = [f"conv-{n}" for n in range(replies)]
    store.enqueue_many([{"tenant": f"t{n % 10}", "action": a} for n, a in enumerate(actions)])
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while store.counts()["WAITING_EXTERNAL"] < replies and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # idle: the poll has backed off
        for n, action in enumerate(actions):
            sent[action] = time.perf_counter()
            sender.reply(f"t{n % 10}", action, payload={"answer": "accepted"}, reply_id="r")
            time.sleep(gap)
            fresh = f"new-{n}"
            sent[fresh] = time.perf_counter()
            sender.enqueue(f"t{n % 10}", fresh)
            time.sleep(gap)
        if all(len(seen[k]) >= expected[k] for k in seen):
            done.set()
        done.wait(60)
    finally:
        worker.stop()
        runner.join(60)
        sender.dispose()
        store.dispose()
    print(f"reply -> READY -> handler sees it: {_percentiles(seen['reply'])}")
    print(f"enqueue -> handler (baseline):     {_percentiles(seen['enqueue'])}")
    if seen["reply"] and seen["enqueue"]:
        ratio = statistics.median(seen["reply"]) / statistics.median(seen["enqueue"])
        print(f"p50 ratio reply/enqueue: x{ratio:.2f}")


# -- inbound throughput ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _receipts(url: str, n: int) -> list[str]:
    from consumer import Store
    from consumer.jobs.schema import operations

    store = Store(url)
    ids = [f"{i + 1}:email" for i in range(n)]
    with store.driver.begin() as conn:
        for start in range(0, n, 1000):
            conn.execute(
                sa.insert(operations),
                [
                    {
                        "operation_id": op,
                        "job_id": int(op.split(":")[0]),
                        "provider": "mail",
                        "request_digest": "d" * 64,
                        "state": "ACCEPTED",
                        "provider_ref": f"m-{op}",
                        "attempts": 1,
                        "created_at": 0.0,
                        "updated_at": 0.0,
                    }
                    for op in ids[start : start + 1000]
                ],
            )
    store.dispose()
    return ids


async def _round(base: str, clients: int, seconds: float, ops: list[str], health: bool) -> float:
    import httpx

    from consumer.jobs.inbound import sign

    done = 0
    stop = time.monotonic() + seconds
    counter = iter(range(10**9))

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop:
            if health:
                answer = await http.get(f"{base}/healthz")
            else:
                n = next(counter)
                body = json.dumps(
                    {
                        "operation_id": ops[n % len(ops)],
                        "status": "delivered",
                        "event_id": f"ev-{uuid.uuid4().hex}",
                    }
                ).encode()
                headers = {"Content-Type": "application/json", **sign(SECRET, body)}
                answer = await http.post(f"{base}/deliveries", content=body, headers=headers)
            if answer.status_code == 200:
                done += 1
            else:
                raise RuntimeError(f"{answer.status_code} {answer.text}")

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=30) as http:
        started = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return done / (time.monotonic() - started)


def inbound(url: str, clients: int, seconds: float, rounds: int, tmp: Path) -> None:
    import httpx

    ops = _receipts(url, 20_000)
    port = _free_port()
    secret_file = tmp / "secret"
    secret_file.write_text(SECRET + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_LOG_LEVEL"] = "warning"
    command = ["inbound", "serve", "--port", str(port), "--secret-file", str(secret_file)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "consumer.jobs.cli", *command, "--database-url", url],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        accepted: list[float] = []
        health: list[float] = []
        per_cpu: dict[bool, list[float]] = {False: [], True: []}
        asyncio.run(_round(base, clients, 1.0, ops, False))  # warm-up
        for _ in range(rounds):
            for probe, into in ((False, accepted), (True, health)):
                cpu = cpu_seconds(proc.pid)
                rate = asyncio.run(_round(base, clients, seconds, ops, probe))
                into.append(rate)
                # The server's own CPU per request: what a core would serve unloaded.
                per_cpu[probe].append(rate * seconds / max(1e-9, cpu_seconds(proc.pid) - cpu))
        print(
            f"inbound, one process, {clients} connections: accepted signed callbacks "
            f"{statistics.median(accepted):.0f}/s (rounds {[round(x) for x in accepted]}); "
            f"GET /healthz {statistics.median(health):.0f}/s (rounds {[round(x) for x in health]})"
        )
        print(
            f"per second of the server's own CPU: callbacks {statistics.median(per_cpu[False]):.0f}"
            f", healthz {statistics.median(per_cpu[True]):.0f} (PostgreSQL's time not counted)"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench replies", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--replies", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.05)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-inbound", action="store_true")
    args = parser.parse_args(argv)
    admin = sa.create_engine(args.database_url)
    schema = f"bench_replies_{uuid.uuid4().hex[:8]}"
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = _schema_url(args.database_url, schema)
    try:
        if not args.skip_latency:
            latency(url, args.replies, args.gap)
        if not args.skip_inbound:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                inbound(url, args.clients, args.seconds, args.rounds, Path(tmp))
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    return 0
