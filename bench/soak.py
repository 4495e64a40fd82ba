"""``python -m bench soak``: the whole loop for half an hour with every retention window
shortened, as real processes started through the CLIs, to see whether every table stays flat
and the loop keeps its speed (issue 25's soak).

On servers of its own, so the WAL it measures is its own: a PostgreSQL cluster with the
server's stock settings (autovacuum on, ``fsync`` and ``full_page_writes`` on) and a
``redis-server``:

- ``outbox-relay init-db`` (or, with ``--partitioned``, ``Outbox.create_schema(partitioned=)``),
  ``outbox-consumer init-db``, ``outbox-worker init-db`` and the console's audit table;
- ``outbox-relay run``, ``outbox-consumer run bench.soak_app:consumer`` and
  ``outbox-worker run bench.soak_app:worker``, each with its metrics server on, the
  project's defaults except the retention windows, given as ``OUTBOX_*`` variables:
  outbox and stream retention ``--window`` x 3/4 (90 s), redelivery margin ``--window``/4
  (30 s), inbox window and job retention ``--window`` (120 s: the least the safety rule of
  ``consumer/jobs/retention.py`` accepts with those), worker grace, dead-letter and audit
  retention ``--window``. Every duty keeps its default interval (retention every 60 s);
- ``--writers`` writers (``python -m bench.soak_app write``) committing ``--rate`` quotes/s
  in all, one ``outbox.transaction()`` + ``tx.emit`` each, each commit's time logged; the
  worker's job dispatches the quote through a provider whose effect is a line with the
  effect's time, so commit -> effect latency is measured end to end.

Every ``--every`` seconds it samples, per table (outbox, inbox, jobs, attempts, operations,
dead letters, workers, audit), the row count, ``pg_total_relation_size`` (summed over the
partitions) and the dead tuples; the relay's claims/s (its published counter), the jobs
finished/s (the worker's counter), the commit -> effect p50/p99 of the effects in the
interval, the WAL written per committed event, CPU seconds per event of each process and
the load average. At the end: ``bench/reports/soak-LABEL.csv`` and ``.json`` (summary: the first
5 minutes after a minute of warm-up vs the last 5, flatness), and a chart (``--chart``, default
``docs/images/soak-LABEL.png``).

    python -m bench soak --rate 300 --minutes 30 --label delete
    python -m bench soak --rate 300 --minutes 30 --partitioned 60 --label partitioned
    python -m bench soak --plot bench/reports/soak-delete.csv bench/reports/soak-partitioned.csv \
        --chart docs/images/soak-compare.png
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.services lives in the checkout, beside bench/
    sys.path.insert(0, str(ROOT))

from bench.procstat import cpu_seconds, postgres_cpu  # noqa: E402
from tests.services import PrivatePostgres, PrivateRedis, free_port  # noqa: E402

TABLES = {
    "outbox": "outbox_events",
    "inbox": "consumer_inbox",
    "jobs": "outbox_jobs",
    "attempts": "outbox_job_attempts",
    "operations": "outbox_operations",
    "dead_letters": "consumer_dead_letters",
    "workers": "outbox_workers",
    "audit": "outbox_audit",
}
# The server's stock settings where tests.services.PrivatePostgres departs from them for speed.
PG_STOCK = ("fsync=on", "full_page_writes=on")
STREAM = "outbox.quote.approved"
WARMUP_S = 60.0  # left out of "the first 5 minutes" (see summarize)
BIN = Path(sys.executable).parent


def windows(window: float) -> dict[str, str]:
    """The ``OUTBOX_*`` retention settings of every process (module docstring)."""
    short = window * 3 / 4
    return {
        "OUTBOX_RETENTION": f"{short:g}",
        "OUTBOX_STREAM_RETENTION": f"{short:g}",
        "OUTBOX_REDELIVERY_MARGIN": f"{window / 4:g}",
        "OUTBOX_INBOX_WINDOW": f"{window:g}",
        "OUTBOX_JOB_RETENTION": f"{window:g}",
        "OUTBOX_WORKER_GRACE": f"{window:g}",
        "OUTBOX_DEAD_LETTER_RETENTION": f"{window:g}",
        "OUTBOX_AUDIT_RETENTION": f"{window:g}",
    }


def _scrape(port: int) -> dict[str, float]:
    """A metrics server's samples, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            body = answer.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
            outcome = sample.labels.get("outcome")
            if outcome is not None:
                key = f"{sample.name}:{outcome}"
                values[key] = values.get(key, 0.0) + float(sample.value)
    return values


class Tail:
    """The complete ``N time`` lines appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""

    def read(self) -> list[tuple[int, float]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.rest + data
        cut = data.rfind(b"\n") + 1
        self.rest = data[cut:]
        pairs = []
        for line in data[:cut].split(b"\n"):
            if line:
                n, t = line.split()
                pairs.append((int(n), float(t)))
        return pairs


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Soak:
    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.commits: dict[int, float] = {}
        self.early_effects: dict[int, float] = {}
        self.effect_at = array("d")
        self.latency = array("d")
        self.rows: list[dict[str, Any]] = []

    # -- processes ----------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(windows(self.args.window))
        env.update(
            OUTBOX_DATABASE_URL=self.pg.url,
            OUTBOX_REDIS_URL=self.redis.url,
            OUTBOX_LOG_LEVEL="warning",
            SOAK_EFFECTS=str(self.run_dir / "effects.log"),
            PYTHONPATH=str(ROOT),
            SOAK_DISPATCH="1" if self.args.dispatch else "0",
        )
        env.update(extra)
        return env

    def spawn(self, name: str, argv: list[str], **extra: str) -> None:
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(
            argv, env=self.env(**extra), stdout=log, stderr=subprocess.STDOUT, cwd=self.run_dir
        )

    def init_db(self) -> None:
        import sqlalchemy as sa

        from outbox.console.schema import create_audit_table

        part = self.args.partitioned
        if part is None:
            subprocess.run([str(BIN / "outbox-relay"), "init-db"], env=self.env(), check=True)
        else:
            from outbox import Outbox

            box = Outbox(self.pg.url)
            box.create_schema(partitioned=int(part) if part.isdigit() else part)
            box.engine.dispose()
        subprocess.run([str(BIN / "outbox-consumer"), "init-db"], env=self.env(), check=True)
        subprocess.run([str(BIN / "outbox-worker"), "init-db"], env=self.env(), check=True)
        engine = sa.create_engine(self.pg.url)
        create_audit_table(engine)
        engine.dispose()

    def start(self) -> None:
        self.ports = {name: free_port() for name in ("relay", "consumer", "worker")}
        for name, argv in (
            ("relay", [str(BIN / "outbox-relay"), "run"]),
            ("consumer", [str(BIN / "outbox-consumer"), "run", "bench.soak_app:consumer"]),
            ("worker", [str(BIN / "outbox-worker"), "run", "bench.soak_app:worker"]),
        ):
            self.spawn(name, argv, OUTBOX_METRICS_PORT=str(self.ports[name]))
        time.sleep(3.0)  # let them connect before the first quote
        writers = self.args.writers
        for index in range(writers):
            self.spawn(
                f"writer{index}",
                [
                    *(sys.executable, "-m", "bench.soak_app", "write"),
                    *("--rate", f"{self.args.rate / writers:g}", "--writers", str(writers)),
                    *("--index", str(index)),
                    *("--commits", str(self.run_dir / f"commits{index}.log")),
                ],
            )
        # The clock starts at the first commit of every writer (a cold process takes seconds
        # to import on a loaded machine), so the first interval is not a start-up artefact.
        deadline = time.monotonic() + 120
        paths = [self.run_dir / f"commits{index}.log" for index in range(writers)]
        while time.monotonic() < deadline:
            if all(path.exists() and path.stat().st_size for path in paths):
                break
            time.sleep(0.1)

    def stop(self) -> None:
        order = [n for n in self.procs if n.startswith("writer")]
        order += ["relay", "consumer", "worker"]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            if name.startswith("writer") and proc is not None:
                _wait(proc)
        for name in order:
            proc = self.procs.get(name)
            if proc is not None:
                _wait(proc)

    # -- sampling -----------------------------------------------------------------------------
    def sample(self, engine: Any, client: Any) -> None:
        import sqlalchemy as sa

        started = self.t0
        commit_tails = [Tail(self.run_dir / f"commits{i}.log") for i in range(self.args.writers)]
        effect_tail = Tail(self.run_dir / "effects.log")
        postmaster = int((Path(self.pg.data) / "postmaster.pid").read_text().split()[0])
        with engine.connect() as conn:
            lsn = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        prev: dict[str, Any] = {"t": started, "lsn": lsn, "committed": 0}
        prev.update(self._counters(postmaster))
        committed = 0
        end = started + self.args.minutes * 60
        next_at = started + self.args.every
        while time.time() < end:
            time.sleep(max(0.0, next_at - time.time()))
            next_at += self.args.every
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: see {name}.log")
            now = time.time()
            for tail in commit_tails:
                for n, t in tail.read():
                    committed += 1
                    effect = self.early_effects.pop(n, None)
                    if effect is None:
                        self.commits[n] = t
                    else:
                        self._effect(effect, effect - t)
            latencies = []
            for n, t in effect_tail.read():
                commit = self.commits.pop(n, None)
                if commit is None:
                    self.early_effects[n] = t
                else:
                    latencies.append(t - commit)
                    self._effect(t, t - commit)
            row: dict[str, Any] = {"t": round(now - started, 1), "load1": os.getloadavg()[0]}
            with engine.connect() as conn:
                lsn = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
                wal = int(
                    conn.execute(
                        sa.text("SELECT pg_wal_lsn_diff(:a, :b)"), {"a": lsn, "b": prev["lsn"]}
                    ).scalar_one()
                )
                for short, table in TABLES.items():
                    row.update(_table_stats(conn, short, table))
                pending = conn.execute(
                    sa.text("SELECT count(*) FROM outbox_events WHERE published_at IS NULL")
                ).scalar_one()
            counters = self._counters(postmaster)
            dt = now - prev["t"]
            events = committed - prev["committed"]
            published = counters["published"] - prev["published"]
            row.update(
                committed_s=events / dt,
                claims_s=published / dt,
                jobs_s=(counters["finished"] - prev["finished"]) / dt,
                effects_s=len(latencies) / dt,
                p50_ms=_percentile(latencies, 0.50) * 1000,
                p99_ms=_percentile(latencies, 0.99) * 1000,
                wal_bytes=wal,
                wal_per_event=wal / events if events else float("nan"),
                relay_busy_ms_per_event=(
                    (counters["batch_seconds"] - prev["batch_seconds"]) * 1000 / published
                    if published
                    else float("nan")
                ),
                stream_len=client.xlen(STREAM),
                backlog=int(pending),
            )
            for role in ("relay", "consumer", "worker", "writers", "postgres", "redis"):
                used = counters[f"cpu_{role}"] - prev[f"cpu_{role}"]
                row[f"cpu_{role}_ms_per_event"] = used * 1000 / events if events else float("nan")
            self.rows.append(row)
            prev = {"t": now, "lsn": lsn, "committed": committed, **counters}
            print(
                f"{row['t']:6.0f}s load {row['load1']:4.2f} commits/s {row['committed_s']:6.0f}"
                f" claims/s {row['claims_s']:6.0f} jobs/s {row['jobs_s']:6.0f}"
                f" p50 {row['p50_ms']:6.1f} p99 {row['p99_ms']:7.1f} ms"
                f" WAL/ev {row['wal_per_event']:6.0f} B backlog {row['backlog']:6d}"
                f" rows o/i/j/a/op {row['outbox_rows']}/{row['inbox_rows']}/{row['jobs_rows']}"
                f"/{row['attempts_rows']}/{row['operations_rows']}",
                flush=True,
            )

    def _effect(self, at: float, latency: float) -> None:
        self.effect_at.append(at - self.t0)
        self.latency.append(latency)

    def _counters(self, postmaster: int) -> dict[str, float]:
        relay = _scrape(self.ports["relay"])
        worker = _scrape(self.ports["worker"])
        writers = [p for n, p in self.procs.items() if n.startswith("writer")]
        return {
            "published": relay.get("outbox_relay_published_total", 0.0),
            "batch_seconds": relay.get("outbox_relay_batch_duration_seconds_sum", 0.0),
            "finished": worker.get("outbox_worker_jobs_finished_total:done", 0.0),
            "cpu_relay": cpu_seconds(self.procs["relay"].pid),
            "cpu_consumer": cpu_seconds(self.procs["consumer"].pid),
            "cpu_worker": cpu_seconds(self.procs["worker"].pid),
            "cpu_writers": sum(cpu_seconds(p.pid) for p in writers),
            "cpu_postgres": postgres_cpu(postmaster),
            "cpu_redis": cpu_seconds(self.redis.process.pid) if self.redis.process else 0.0,
        }

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> None:
        import redis
        import sqlalchemy as sa

        with PrivatePostgres(settings=PG_STOCK) as pg, PrivateRedis() as server:
            self.pg, self.redis = pg, server
            self.init_db()
            engine = sa.create_engine(pg.url, pool_size=1)
            client = redis.Redis.from_url(server.url)
            try:
                self.start()
                self.t0 = time.time()
                self.load_start = os.getloadavg()
                self.sample(engine, client)
            finally:
                self.stop()
                client.close()
                engine.dispose()


def _table_stats(conn: Any, short: str, table: str) -> dict[str, Any]:
    import sqlalchemy as sa

    exists = conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": table}).scalar_one()
    if exists is None:
        return {f"{short}_rows": 0, f"{short}_bytes": 0, f"{short}_dead": 0}
    rows = conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
    # pg_partition_tree lists a partitioned table's tree (itself included), nothing for a
    # plain table.
    size, dead, parts = conn.execute(
        sa.text(
            "WITH tree AS (SELECT relid, isleaf FROM pg_partition_tree(:t)"
            " UNION ALL SELECT CAST(:t AS regclass), true"
            " WHERE NOT EXISTS (SELECT 1 FROM pg_partition_tree(:t)))"
            " SELECT coalesce(sum(pg_total_relation_size(p.relid)), 0),"
            " coalesce(sum(s.n_dead_tup), 0), count(*) FILTER (WHERE p.isleaf)"
            " FROM tree p LEFT JOIN pg_stat_user_tables s ON s.relid = p.relid"
        ),
        {"t": table},
    ).one()
    stats = {f"{short}_rows": int(rows), f"{short}_bytes": int(size), f"{short}_dead": int(dead)}
    if short == "outbox":
        stats["outbox_partitions"] = int(parts)
    return stats


def _wait(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def summarize(soak: Soak) -> dict[str, Any]:
    """The first 5 minutes after the warm-up vs the last 5, and whether every table is flat
    after the first windows."""
    args, rows = soak.args, soak.rows
    length = rows[-1]["t"] if rows else 0.0
    # The first 5 minutes start after a minute of warm-up: the first interval carries the
    # processes' cold start (connections, prepared statements, imports on first use), and
    # its p99 (250-800 ms in the 30-minute runs) would flatter every later window.
    warmup = min(WARMUP_S, length / 6)
    span = min(300.0, (length - warmup) / 3)

    def mean(key: str, lo: float, hi: float) -> float:
        values = [r[key] for r in rows if lo < r["t"] <= hi and r[key] == r[key]]
        return sum(values) / len(values) if values else float("nan")

    def p99(lo: float, hi: float) -> float:
        values = [
            lat for at, lat in zip(soak.effect_at, soak.latency, strict=True) if lo < at <= hi
        ]
        return _percentile(values, 0.99) * 1000

    first, last = (warmup, warmup + span), (length - span, length)
    summary: dict[str, Any] = {
        "label": args.label,
        "rate": args.rate,
        "writers": args.writers,
        "minutes": args.minutes,
        "partitioned": args.partitioned,
        "settings": windows(args.window),
        "loadavg_start": soak.load_start,
        "loadavg_end": os.getloadavg(),
        "load1": {
            "min": min(r["load1"] for r in rows),
            "mean": sum(r["load1"] for r in rows) / len(rows),
            "max": max(r["load1"] for r in rows),
        },
        "warmup_s": warmup,
        "first": {"claims_s": mean("claims_s", *first), "p99_ms": p99(*first)},
        "last": {"claims_s": mean("claims_s", *last), "p99_ms": p99(*last)},
        "p50_ms_all": _percentile(list(soak.latency), 0.50) * 1000,
        "p99_ms_all": _percentile(list(soak.latency), 0.99) * 1000,
        "effects": len(soak.latency),
    }
    summary["claims_ratio"] = summary["last"]["claims_s"] / summary["first"]["claims_s"]
    summary["p99_ratio"] = summary["last"]["p99_ms"] / summary["first"]["p99_ms"]
    # Flat: the mean over the last 5 minutes against the 5 minutes after the first windows
    # (the longest window plus a purge interval, twice over).
    settled = min(2 * (args.window + 60), length - 2 * span)
    flat: dict[str, Any] = {}
    for short in TABLES:
        for what in ("rows", "bytes", "dead"):
            early = mean(f"{short}_{what}", settled, settled + span)
            late = mean(f"{short}_{what}", *last)
            flat[f"{short}_{what}"] = {
                "after_windows": early,
                "last": late,
                "ratio": late / early if early else None,
            }
    summary["settled_at_s"] = settled
    summary["flat"] = flat
    for key in ("wal_per_event", "relay_busy_ms_per_event", "claims_s", "committed_s"):
        summary[f"{key}_mean"] = mean(key, settled, length)
    for role in ("relay", "consumer", "worker", "writers", "postgres", "redis"):
        key = f"cpu_{role}_ms_per_event"
        summary[key] = mean(key, settled, length)
    return summary


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
            )


def report(paths: list[Path]) -> str:
    """Markdown tables of the summaries (``--report``), one column per run."""
    runs = [json.loads(path.read_text()) for path in paths]

    def line(name: str, cells: list[str]) -> str:
        return f"| {name} | " + " | ".join(cells) + " |"

    def num(value: Any, digits: int = 0) -> str:
        if value is None or value != value:
            return "-"
        return f"{value:,.{digits}f}"

    out = [line("", [r["label"] for r in runs]), line("---", ["---"] * len(runs))]
    rows = [
        ("offered quotes/s", [num(r["rate"]) for r in runs]),
        ("minutes", [num(r["minutes"], 1) for r in runs]),
        (
            "load average (1 min): mean (min-max)",
            [
                f"{r['load1']['mean']:.1f} ({r['load1']['min']:.1f}-{r['load1']['max']:.1f})"
                for r in runs
            ],
        ),
        ("committed/s after the windows", [num(r["committed_s_mean"], 1) for r in runs]),
        # Reports written before the warm-up was left out started their first window at 0.
        ("warm-up left out before the first 5 min (s)", [num(r.get("warmup_s", 0)) for r in runs]),
        (
            "relay claims/s: first 5 min after the warm-up -> last 5 min",
            [
                f"{r['first']['claims_s']:.1f} -> {r['last']['claims_s']:.1f}"
                f" (x{r['claims_ratio']:.3f})"
                for r in runs
            ],
        ),
        (
            "commit -> effect p99 (ms): first 5 min after the warm-up -> last 5 min",
            [
                f"{r['first']['p99_ms']:,.0f} -> {r['last']['p99_ms']:,.0f} (x{r['p99_ratio']:.2f})"
                for r in runs
            ],
        ),
        (
            "commit -> effect p50 / p99, whole run (ms)",
            [f"{r['p50_ms_all']:,.0f} / {r['p99_ms_all']:,.0f}" for r in runs],
        ),
        ("WAL bytes per event", [num(r["wal_per_event_mean"]) for r in runs]),
        (
            "relay batch time per event (ms)",
            [num(r["relay_busy_ms_per_event_mean"], 2) for r in runs],
        ),
        ("relay CPU per event (ms)", [num(r["cpu_relay_ms_per_event"], 2) for r in runs]),
        ("PostgreSQL CPU per event (ms)", [num(r["cpu_postgres_ms_per_event"], 2) for r in runs]),
    ]
    out += [line(name, cells) for name, cells in rows]
    out += ["", "Rows and total size: mean over the 5 minutes after the first windows -> mean over"]
    out += ["the last 5 minutes.", ""]
    out += [line("table", [r["label"] for r in runs]), line("---", ["---"] * len(runs))]
    for short in TABLES:
        cells = []
        for r in runs:
            rows_, size = r["flat"][f"{short}_rows"], r["flat"][f"{short}_bytes"]
            cells.append(
                f"{num(rows_['after_windows'])} -> {num(rows_['last'])} rows,"
                f" {size['after_windows'] / 2**20:.2f} -> {size['last'] / 2**20:.2f} MiB"
            )
        out.append(line(short, cells))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__)
    parser.add_argument("--rate", type=float, default=300.0, help="quotes/s in all [300]")
    parser.add_argument("--writers", type=int, default=2, help="writer processes [2]")
    parser.add_argument("--minutes", type=float, default=30.0, help="run length [30]")
    parser.add_argument("--window", type=float, default=120.0, help="inbox/job window, s")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    parser.add_argument(
        "--partitioned", default=None, help="SECONDS|hourly|daily: the partitioned outbox"
    )
    parser.add_argument(
        "--dispatch", action="store_true", help="jobs dispatch through a provider (operations)"
    )
    parser.add_argument("--label", default=None, help="names the report files")
    parser.add_argument("--reports", default=str(ROOT / "bench" / "reports"))
    parser.add_argument("--chart", default=None, help="PNG path [docs/images/soak-LABEL.png]")
    parser.add_argument("--plot", nargs="+", default=None, help="CSVs to chart, no run")
    parser.add_argument("--report", nargs="+", default=None, help="JSON summaries: markdown")
    args = parser.parse_args(argv)
    if args.report:
        print(report([Path(p) for p in args.report]))
        return 0
    from bench.soak_chart import plot

    if args.plot:
        chart = Path(args.chart or ROOT / "docs" / "images" / "soak-compare.png")
        plot([Path(p) for p in args.plot], chart)
        print(f"chart: {chart}")
        return 0
    label = args.label or ("delete" if args.partitioned is None else "partitioned")
    args.label = label
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)
    run_dir = Path(f"/tmp/soak-{label}-{int(time.time())}")
    run_dir.mkdir(parents=True)
    print(f"soak {label}: {args.rate:g} quotes/s for {args.minutes:g} min; logs in {run_dir}")
    soak = Soak(args, run_dir)
    try:
        soak.run()
    except KeyboardInterrupt:
        print("interrupted: reporting what was sampled", flush=True)
    if not soak.rows:
        return 1
    csv_path = reports / f"soak-{label}.csv"
    write_csv(soak.rows, csv_path)
    summary = summarize(soak)
    (reports / f"soak-{label}.json").write_text(json.dumps(summary, indent=2) + "\n")
    chart = Path(args.chart or ROOT / "docs" / "images" / f"soak-{label}.png")
    plot([csv_path], chart)
    print(json.dumps({k: v for k, v in summary.items() if k != "flat"}, indent=2))
    print(f"csv: {csv_path}\nchart: {chart}")
    return 0
