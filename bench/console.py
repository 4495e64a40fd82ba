"""``python -m bench console``: the console's server time on a large database, and its memory.

Fills a fresh PostgreSQL schema with ``--events`` outbox rows (published, a few pending and
quarantined) and their inbox rows, ``--jobs`` jobs (mostly DONE, some READY, WAITING_REVIEW,
CANCELLED) and ``--receipts`` receipts (ACCEPTED, a few UNKNOWN) with two history rows each,
all by ``INSERT ... SELECT generate_series`` (seconds, not minutes). No ANALYZE: the project's
servers run without autovacuum, so the plans must not need statistics.

Then starts ``outbox-console serve`` and reads the ``Server-Timing`` header (the server's own
time for reads and rendering) of the overview, a trace page by identity, and list pages deep
in each list, first WITHOUT the lookup indexes (the baseline: what the parts' own indexes
give) and then after ``outbox-console init-db`` created them, and prints medians, p95s and
the ratio.

``--rss SECONDS``: instead, a loop of requests (every page, the API, traces) against the
console for that long, printing its RSS (``/proc/PID/status``) each minute.

    python -m bench console                       # 1M events, 1M jobs, 100k receipts
    python -m bench console --rss 600             # ten minutes of use, RSS each minute
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
import uuid

import httpx
import sqlalchemy as sa

PG = os.environ.get("OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("OUTBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
TOKEN = "bench-console-" + "b" * 24
TENANTS = 50


def fill(url: str, events: int, jobs: int, receipts: int) -> None:
    """The parts' tables (their own create_schema), then rows by generate_series."""
    from consumer.inbox import build_inbox_schema, create_inbox_schema
    from consumer.jobs.store import Store
    from outbox import Outbox
    from outbox.console.schema import create_audit_table

    outbox = Outbox(url)
    outbox.create_schema()
    engine = outbox.engine
    Store(engine).create_schema()
    create_inbox_schema(engine, build_inbox_schema())
    create_audit_table(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_events (event_id, topic, key, key_hash, tenant, identity, "
                "payload, created_at, available_at, attempts, state, stream, stream_id, "
                "published_at) "
                "SELECT 'ev-' || g, CASE WHEN g % 10 = 0 THEN 'quote.sent' "
                "ELSE 'quote.approved' END, 'quote-' || g, g % 1000, "
                f"'tenant-' || (g % {TENANTS}), "
                f"'tenant-' || (g % {TENANTS}) || '\\:send-quote-' || g, "
                "jsonb_build_object('quote', g, 'total', g % 5000), "
                "now() - (:n - g) * interval '1 millisecond', now(), "
                "CASE WHEN g % 20000 = 7 THEN 3 ELSE 0 END, "
                "CASE WHEN g > :n - 500 THEN 'pending' WHEN g % 20000 = 7 THEN 'quarantined' "
                "ELSE 'published' END, "
                "CASE WHEN g > :n - 500 OR g % 20000 = 7 THEN NULL ELSE 'outbox.quote.approved' "
                "END, CASE WHEN g > :n - 500 OR g % 20000 = 7 THEN NULL "
                "ELSE (1700000000000 + g) || '-0' END, "
                "CASE WHEN g > :n - 500 OR g % 20000 = 7 THEN NULL ELSE now() END "
                "FROM generate_series(1, :n) g"
            ),
            {"n": events},
        )
        conn.execute(
            sa.text(
                "INSERT INTO consumer_inbox (group_name, identity, event_id, topic, stream, "
                "entry_id, processed_at) "
                f"SELECT 'billing', 'tenant-' || (g % {TENANTS}) || '\\:send-quote-' || g, "
                "'ev-' || g, 'quote.approved', 'outbox.quote.approved', "
                "(1700000000000 + g) || '-0', now() "
                "FROM generate_series(1, :n) g WHERE g <= :n - 500 AND g % 20000 <> 7"
            ),
            {"n": events},
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_jobs (tenant, action, subject, state, priority, attempts, "
                "auth_failures, lease_epoch, wait_reason, created_at, updated_at) "
                f"SELECT 'tenant-' || (g % {TENANTS}), 'send-quote-' || g, 'quote-' || g, "
                "CASE WHEN g % 100 = 0 THEN 'READY' WHEN g % 1000 = 1 THEN 'CANCELLED' "
                "WHEN g % 500 = 2 THEN 'WAITING_REVIEW' ELSE 'DONE' END, 0, 1, 0, 1, "
                "CASE WHEN g % 500 = 2 THEN 'the provider did not answer' END, "
                "extract(epoch from now()) - (:n - g) * 0.001, "
                "extract(epoch from now()) - (:n - g) * 0.001 "
                "FROM generate_series(1, :n) g"
            ),
            {"n": jobs},
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_operations (operation_id, job_id, provider, request_digest, "
                "state, provider_ref, attempts, call_deadline, created_at, updated_at) "
                "SELECT g || '\\:email', g, 'mail', repeat('0', 64), "
                "CASE WHEN g % 1000 = 2 THEN 'UNKNOWN' ELSE 'ACCEPTED' END, "
                "CASE WHEN g % 1000 = 2 THEN NULL ELSE 'msg-' || g END, 1, "
                "extract(epoch from now()) - 60, extract(epoch from now()) - (:n - g) * 0.01, "
                "extract(epoch from now()) - (:n - g) * 0.01 "
                "FROM generate_series(1, :n) g"
            ),
            {"n": receipts},
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_job_attempts (job_id, epoch, worker, outcome, error, at) "
                "SELECT g, 1, 'worker-a', CASE WHEN k = 1 THEN 'retry' ELSE 'done' END, NULL, "
                "extract(epoch from now()) - (:n - g) * 0.01 + k "
                "FROM generate_series(1, :n) g, generate_series(1, 2) k"
            ),
            {"n": receipts},
        )
    # VACUUM (no ANALYZE: still no statistics), as the workers' and the relay's periodic
    # vacuum does on a server without autovacuum: it sets the visibility map, so counts
    # through an index read the index alone.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("outbox_events", "consumer_inbox", "outbox_jobs", "outbox_operations"):
            conn.execute(sa.text(f"VACUUM {table}"))
    engine.dispose()


def _server_ms(response: httpx.Response) -> float:
    timing = response.headers.get("server-timing", "")
    assert timing.startswith("app;dur="), (response.status_code, response.text[:300])
    return float(timing.split("dur=")[1])


def _measure(client: httpx.Client, paths: list[str], rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {p: [] for p in paths}
    for path in paths:
        client.get(path)  # warm the pool and the caches once
    for _ in range(rounds):
        for path in paths:
            response = client.get(path)
            assert response.status_code in (200, 404), (path, response.status_code)
            out[path].append(_server_ms(response))
    return out


def _print(label: str, results: dict[str, list[float]]) -> dict[str, float]:
    medians = {}
    print(f"\n{label}")
    for path, values in results.items():
        values.sort()
        p95 = values[max(0, int(len(values) * 0.95) - 1)]
        medians[path] = statistics.median(values)
        print(f"  {path:60s} median {medians[path]:8.1f} ms   p95 {p95:8.1f} ms")
    return medians


def _serve(url: str) -> tuple[subprocess.Popen[bytes], str]:
    from tests.services import free_port, wait_for

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_CONSOLE_TOKEN"] = TOKEN
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbox.console.cli",
            "serve",
            "--database-url",
            url,
            "--redis-url",
            REDIS,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(base + "/login", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, "the console", timeout=60)
    return proc, base


def _paths(events: int, jobs: int) -> list[str]:
    deep_job = jobs // 2
    mid = events // 2
    return [
        "/",
        "/api/overview",
        f"/trace?q=tenant-{mid % TENANTS}:send-quote-{mid}",
        f"/api/trace?q=quote-{mid}",
        "/jobs",
        "/jobs?state=CANCELLED",
        f"/api/jobs?tenant=tenant-7&cursor={_cursor(deep_job)}",
        "/events?topic=quote.sent",
        f"/api/events?state=published&cursor={_cursor(events // 3)}",
        "/receipts?state=UNKNOWN",
    ]


def _cursor(key: int) -> str:
    from outbox.console.queries import encode_cursor

    return encode_cursor([key])


def run_times(args: argparse.Namespace, url: str) -> None:
    from outbox.console.schema import create_lookup_indexes

    paths = _paths(args.events, args.jobs)
    proc, base = _serve(url)
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=base, headers=auth, timeout=300) as c:
            # The baseline scans big tables: fewer rounds of it.
            before = _print(
                "without the lookup indexes (the parts' own indexes only)",
                _measure(c, paths, max(3, args.rounds // 5)),
            )
            started = time.perf_counter()
            engine = sa.create_engine(url)
            made = create_lookup_indexes(engine)
            engine.dispose()
            took = time.perf_counter() - started
            print(f"\ninit-db: {len(made)} lookup indexes in {took:.1f} s")
            after = _print(
                "with the lookup indexes (outbox-console init-db)", _measure(c, paths, args.rounds)
            )
        print("\nratio without / with:")
        for path in paths:
            print(f"  {path:60s} x{before[path] / max(after[path], 0.01):7.1f}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def run_rss(args: argparse.Namespace, url: str) -> None:
    from outbox.console.schema import create_lookup_indexes

    engine = sa.create_engine(url)
    create_lookup_indexes(engine)
    engine.dispose()
    paths = [*_paths(args.events, args.jobs), "/events", "/receipts", "/dead-letters", "/audit"]
    proc, base = _serve(url)
    rng = random.Random(7)
    requests = 0
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=base, headers=auth, timeout=300) as c:
            start = time.monotonic()
            print(f"RSS at start: {_rss_kb(proc.pid) / 1024:.1f} MiB")
            next_report = start + 60
            while time.monotonic() - start < args.rss:
                n = rng.randrange(1, args.events)
                path = rng.choice([*paths, f"/trace?q=quote-{n}", f"/api/trace?q=ev-{n}"])
                response = c.get(path)
                assert response.status_code in (200, 404), (path, response.status_code)
                requests += 1
                if time.monotonic() >= next_report:
                    minutes = (time.monotonic() - start) / 60
                    rss = _rss_kb(proc.pid) / 1024
                    print(f"  {minutes:5.1f} min  {requests:7d} requests  RSS {rss:7.1f} MiB")
                    next_report += 60
            rss = _rss_kb(proc.pid) / 1024
            print(f"RSS after {args.rss:.0f} s and {requests} requests: {rss:.1f} MiB")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench console", description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--receipts", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=15, help="requests per page and phase")
    parser.add_argument("--rss", type=float, default=None, help="seconds of use, then RSS")
    args = parser.parse_args(argv)
    schema = f"bench_console_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG}?options=-csearch_path%3D{schema}"
    try:
        started = time.perf_counter()
        fill(url, args.events, args.jobs, args.receipts)
        print(
            f"filled {args.events:,} events (and inbox rows), {args.jobs:,} jobs, "
            f"{args.receipts:,} receipts in {time.perf_counter() - started:.0f} s "
            f"(schema {schema}; no ANALYZE)"
        )
        if args.rss is not None:
            run_rss(args, url)
        else:
            run_times(args, url)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
