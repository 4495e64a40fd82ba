"""The whole loop as real processes, for the chaos matrix and the end-to-end figures.

``Loop`` starts, on servers of its own (a private PostgreSQL cluster shared by the runs of
one session, one database per run; a private ``redis-server`` per run, with AOF when asked;
with ``LoopSettings(broker="nats")`` a private ``nats-server -js`` per run is the broker the
relays and consumers use, the Redis staying for the harness only):

- the provider: ``outbox-simulator serve`` (the connector simulator, effects in SQLite);
- 2 relays (``outbox-relay run``), 2 consumers (``outbox-consumer run
  bench.loop_app:consumer``), 2 workers (``outbox-worker run bench.loop_app:worker``);
- writers (``python -m bench.loop_app write``) approving quotes at a steady rate.

Every process logs to a file in the run's directory (``Loop.logs()`` gives their tails). A
sampler thread records, twice a second, the committed quotes, the effects at the provider
and the relay's backlog, from which the throughput and backlog over time are drawn.

The books (:meth:`Loop.books`, after :meth:`Loop.stop_load` and :meth:`Loop.settle`) are
kept from the database and the provider, never from what the processes say about
themselves: a quote is committed iff its row says ``approved``; an effect is a row at the
provider, whose request body names its quote.

``python -m bench loop [--rate R] [--duration S]`` runs the loop with no fault and prints
the books (a smoke test of the harness).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.services lives in the checkout, beside bench/
    sys.path.insert(0, str(ROOT))

from tests.services import PrivatePostgres, PrivateRedis, free_port, wait_for  # noqa: E402

STREAM = "outbox.quote.approved"
POISON_STREAM = "outbox.poison.route"
GROUP = "billing"
SAMPLE_EVERY = 0.5


@dataclass
class LoopSettings:
    """What one run starts. ``env`` is added to every pipeline process's environment."""

    rate: float = 100.0
    writers: int = 1
    relays: int = 2
    consumers: int = 2
    workers: int = 2
    redis_aof: bool = False
    broker: str = "redis"  # or "nats": a private nats-server -js carries the streams
    rollback: float = 0.10
    duplicates: float = 0.05
    poison: float = 0.0
    provider_timeout: float = 2.0
    env: dict[str, str] = field(default_factory=dict)
    relay_args: tuple[str, ...] = ()


@dataclass
class Sample:
    at: float  # monotonic seconds since the loop started
    committed: int | None
    effects: int | None
    outbox_pending: int | None


class Proc:
    """One pipeline process: its command line, its log file, restartable."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log
        self.popen: subprocess.Popen[bytes] | None = None
        self.kills = 0
        self.killed = False  # this run ended by the harness (a fault), not by itself
        self.noted = False  # this run's own exit is recorded (Loop.note_self_exits)

    def start(self) -> Proc:
        self.killed = self.noted = False
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to finish anything."""
        if self.alive():
            assert self.popen is not None
            self.popen.kill()
            self.popen.wait(15)
            self.kills += 1
            self.killed = True

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after ``timeout``; the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(15)
        return self.popen.returncode

    def restart(self) -> None:
        self.kill()
        self.start()

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Simulator:
    """``outbox-simulator serve`` on a free port (the provider of the loop)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self.client = httpx.Client(timeout=30.0)

    def start(self) -> Simulator:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consumer.jobs.simulator",
                "serve",
                "--port",
                "0",
                "--data",
                str(self.directory / "effects.db"),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=open(self.directory / "simulator.log", "ab"),  # noqa: SIM115
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError(f"simulator did not start: {line!r}")
        self.url = line.split()[-1]
        return self

    def count(self) -> int:
        return int(self.client.get(f"{self.url}/health").json()["effects"])

    def effects(self, operation_id: str | None = None) -> list[dict[str, Any]]:
        params = {"operation_id": operation_id} if operation_id is not None else None
        response = self.client.get(f"{self.url}/effects", params=params)
        response.raise_for_status()
        return list(response.json()["effects"])

    def faults(self, *rules: dict[str, Any], seed: int | None = None) -> None:
        body: dict[str, Any] = {"faults": list(rules)}
        if seed is not None:
            body["seed"] = seed
        self.client.post(f"{self.url}/faults", json=body).raise_for_status()

    def fault_plan(self) -> list[dict[str, Any]]:
        return list(self.client.get(f"{self.url}/faults").json()["faults"])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.client.close()


class PrivateNats:
    """A ``nats-server -js`` child process on a free port, its store in a directory of its
    own (file storage), removed at :meth:`close`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.directory = tempfile.mkdtemp(prefix="private-nats-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> PrivateNats:
        command = [
            shutil.which("nats-server") or "nats-server",
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-sd",
            self.directory,
        ]
        with open(os.path.join(self.directory, "nats.log"), "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._answers, f"private NATS on port {self.port}", timeout)
        return self

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self.process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                return sock.recv(16).startswith(b"INFO")
        except OSError:
            return False

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def private_postgres() -> PrivatePostgres:
    """A private cluster for a session of runs (max_connections 200, autovacuum on)."""
    return PrivatePostgres(settings=("autovacuum=on",)).start()


class Loop:
    """One run of the whole pipeline in database ``name`` of ``pg``."""

    def __init__(self, pg: PrivatePostgres, name: str, settings: LoopSettings) -> None:
        self.pg = pg
        self.name = name
        self.settings = settings
        self.directory = Path(tempfile.mkdtemp(prefix=f"loop-{name}-"))
        self.url = pg.url.rsplit("/", 1)[0] + f"/{name}"
        self.redis = PrivateRedis(persistent=settings.redis_aof)
        if settings.broker not in ("redis", "nats"):
            raise ValueError(f"unknown broker {settings.broker!r}")
        self.nats = PrivateNats() if settings.broker == "nats" else None
        self.simulator = Simulator(self.directory)
        self.procs: dict[str, list[Proc]] = {"relay": [], "consumer": [], "worker": []}
        self.writers: list[Proc] = []
        self.samples: list[Sample] = []
        self.marks: dict[str, float] = {}
        self.self_exits: list[str] = []  # pipeline processes that ended by themselves
        self.started = time.monotonic()
        self.wall_started = time.time()
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self.engine: Engine | None = None
        self._admin = create_engine(pg.url, isolation_level="AUTOCOMMIT")

    # -- start and stop ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OUTBOX_DATABASE_URL": self.url,
            "OUTBOX_REDIS_URL": self.redis.url,
            **({"OUTBOX_BROKER_URL": self.nats.url} if self.nats is not None else {}),
            "OUTBOX_LOG_LEVEL": "warning",
            "LOOP_PROVIDER_URL": self.simulator.url,
            "LOOP_PROVIDER_TIMEOUT": str(self.settings.provider_timeout),
            **self.settings.env,
        }

    def start(self, *, load: bool = True) -> Loop:
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}"'))
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        self.redis.start()
        if self.nats is not None:
            self.nats.start()
        self.simulator.start()
        self.engine = create_engine(self.url, pool_size=2, pool_pre_ping=True)
        self._create_schema()
        # The relay's poison: the stream key of topic poison.route is a plain string, so
        # every XADD to it answers WRONGTYPE (a permanent per-record failure).
        self.redis_client().set(POISON_STREAM, "not a stream")
        env = self.env()
        py = sys.executable
        relay_cmd = [py, "-m", "relay.cli", "run", *self.settings.relay_args]
        for role, count, argv in (
            ("relay", self.settings.relays, relay_cmd),
            (
                "consumer",
                self.settings.consumers,
                [py, "-m", "consumer.cli", "run", "bench.loop_app:consumer"],
            ),
            (
                "worker",
                self.settings.workers,
                [py, "-m", "consumer.jobs.cli", "run", "bench.loop_app:worker"],
            ),
        ):
            for index in range(count):
                name = f"{role}-{index}"
                # PGAPPNAME names the process's sessions in pg_stat_activity, so the CPU
                # of PostgreSQL's backends can be laid at each kind of process's door.
                proc_env = {**env, "PGAPPNAME": name}
                self.procs[role].append(
                    Proc(name, argv, proc_env, self.directory / f"{name}.log").start()
                )
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True)
        self._sampler.start()
        self.wait_ready()
        if load:
            self.start_load()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every consumer has joined the group: the processes have imported their
        code and connected (a Python process takes a second or two of CPU to start)."""
        deadline = time.monotonic() + timeout
        client = self.redis_client()
        try:
            while time.monotonic() < deadline:
                # One durable consumer per group on JetStream, not one per process.
                if self.nats is not None and self.nats_group() is not None:
                    break
                with contextlib.suppress(Exception):
                    consumers = client.xinfo_consumers(STREAM, GROUP)
                    if len(consumers) >= self.settings.consumers:
                        break
                for proc in self.all_procs():
                    if not proc.alive():
                        raise RuntimeError(f"{proc.name} exited at start:\n{proc.tail()}")
                time.sleep(0.2)
        finally:
            client.close()
        time.sleep(1.0)  # the workers and relays started at the same time; leave them a second
        self.mark("ready")

    def _create_schema(self) -> None:
        from bench.loop_app import QUOTES_DDL
        from consumer.consumer import Consumer
        from consumer.jobs.store import Store
        from outbox.core import Outbox

        assert self.engine is not None
        with self.engine.begin() as conn:
            conn.execute(text(QUOTES_DDL))
        Outbox(self.engine).create_schema()
        Store(self.engine).create_schema()
        Consumer(
            self.engine, self.redis.url, group=GROUP, topics=["quote.approved"]
        ).create_schema()

    def start_writers(
        self, rate: float, count: int = 1, *, poison: float | None = None, tag: str = "writer"
    ) -> list[Proc]:
        """``count`` writer processes sharing ``rate`` approvals per second."""
        started = []
        for _ in range(count):
            argv = [
                sys.executable,
                "-m",
                "bench.loop_app",
                "write",
                "--rate",
                str(rate / count),
                "--rollback",
                str(self.settings.rollback),
                "--duplicates",
                str(self.settings.duplicates),
                "--poison",
                str(self.settings.poison if poison is None else poison),
            ]
            name = f"{tag}-{sum(1 for w in self.writers if w.name.startswith(tag))}"
            env = {**self.env(), "PGAPPNAME": name}
            proc = Proc(name, argv, env, self.directory / f"{name}.log").start()
            self.writers.append(proc)
            started.append(proc)
        return started

    def start_load(self) -> None:
        """The steady load: ``settings.writers`` writers at ``settings.rate`` in all."""
        self.start_writers(self.settings.rate, self.settings.writers)
        self.mark("load_started")

    def stop_load(self) -> None:
        for writer in self.writers:
            writer.stop()
        self.mark("load_stopped")

    def close(self, *, keep: bool = False) -> None:
        self._stop_sampling.set()
        for writer in self.writers:
            writer.stop(5)
        for role in ("relay", "consumer", "worker"):
            for proc in self.procs[role]:
                proc.stop(10)
        self.simulator.close()
        self.redis.close()
        if self.nats is not None:
            self.nats.close()
        if self.engine is not None:
            self.engine.dispose()
        with contextlib.suppress(Exception), self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self._admin.dispose()
        if keep:
            print(f"logs kept in {self.directory}", file=sys.stderr)
        else:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Loop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for faults -----------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.started

    def mark(self, name: str) -> float:
        self.marks[name] = self.now()
        return self.marks[name]

    def redis_client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis.url, socket_timeout=5)

    def all_procs(self) -> list[Proc]:
        return [p for role in ("relay", "consumer", "worker") for p in self.procs[role]]

    def ensure_running(self) -> None:
        """Restart any pipeline process that died: a fault's casualty, or one that exited by
        itself, which :meth:`self_exits` records first (issue 53: a process outlives its
        connections, so none may)."""
        self.note_self_exits()
        for proc in self.all_procs():
            if not proc.alive():
                proc.start()

    def note_self_exits(self) -> None:
        """Record each pipeline process that ended without the harness killing it (its
        exit code and last log line) in :attr:`self_exits`, once per run of it."""
        for proc in self.all_procs():
            popen = proc.popen
            if popen is None or proc.alive() or proc.killed or proc.noted:
                continue
            proc.noted = True
            last = proc.tail(300).strip().splitlines()[-1:] or [""]
            self.self_exits.append(f"{proc.name} exited {popen.returncode}: {last[0][:200]}")

    def logs(self, chars: int = 1200) -> str:
        parts = []
        for proc in [*self.all_procs(), *self.writers]:
            tail = proc.tail(chars).strip()
            if tail:
                parts.append(f"--- {proc.name} (pid {proc.pid}) ---\n{tail}")
        return "\n".join(parts)

    # -- sampling ---------------------------------------------------------------------------
    def _sample_loop(self) -> None:
        while not self._stop_sampling.wait(SAMPLE_EVERY):
            self.samples.append(self._sample())

    def _sample(self) -> Sample:
        committed: int | None = None
        pending: int | None = None
        effects: int | None = None
        with contextlib.suppress(Exception):
            assert self.engine is not None
            with self.engine.connect() as conn:
                conn.execute(text("SET statement_timeout = 2000"))
                committed = int(
                    conn.execute(
                        text("SELECT count(*) FROM loop_quotes WHERE state = 'approved'")
                    ).scalar_one()
                )
                pending = int(
                    conn.execute(
                        text("SELECT count(*) FROM outbox_events WHERE state = 'pending'")
                    ).scalar_one()
                )
        with contextlib.suppress(Exception):
            effects = self.simulator.count()
        return Sample(self.now(), committed, effects, pending)

    # -- settling and the books -------------------------------------------------------------
    def open_work(self) -> dict[str, int]:
        """What is still in flight: committed quotes without an effect, the relay's pending
        rows, entries pending or unread in the consumer group, jobs not finished."""
        from consumer.jobs.schema import JOBS_TABLE

        assert self.engine is not None
        with self.engine.connect() as conn:
            committed = int(
                conn.execute(
                    text("SELECT count(*) FROM loop_quotes WHERE state = 'approved'")
                ).scalar_one()
            )
            outbox_pending = int(
                conn.execute(
                    text("SELECT count(*) FROM outbox_events WHERE state = 'pending'")
                ).scalar_one()
            )
            open_jobs = int(
                conn.execute(
                    text(
                        f"SELECT count(*) FROM {JOBS_TABLE} "
                        "WHERE state NOT IN ('DONE', 'CANCELLED')"
                    )
                ).scalar_one()
            )
        group_pending, group_lag = self.group_backlog()
        effect_quotes = {e["body"].get("quote") for e in self.simulator.effects()}
        return {
            "without_effect": max(0, committed - len(effect_quotes)),
            "outbox_pending": outbox_pending,
            "group_pending": group_pending,
            "group_lag": group_lag,
            "open_jobs": open_jobs,
        }

    def stream_messages(self) -> int | None:
        """How many messages the broker holds in the quotes' stream (None: no answer)."""
        if self.nats is None:
            client = self.redis_client()
            try:
                return int(client.xlen(STREAM))
            except Exception:
                return None
            finally:
                client.close()
        from outbox.nats_client import NatsClient, jetstream_name

        nats_client = NatsClient(self.nats.url)

        async def info(js: Any) -> Any:
            return await js.stream_info(jetstream_name(STREAM))

        try:
            return int(nats_client.run(info).state.messages)
        except Exception:
            return None
        finally:
            nats_client.close()

    def nats_group(self) -> Any:
        """The group's durable JetStream consumer's info (None: not there, or no answer)."""
        from outbox.nats_client import NatsClient, jetstream_name

        assert self.nats is not None
        client = NatsClient(self.nats.url)

        async def info(js: Any) -> Any:
            return await js.consumer_info(jetstream_name(STREAM), jetstream_name(GROUP))

        try:
            return client.run(info)
        except Exception:
            return None
        finally:
            client.close()

    def group_backlog(self) -> tuple[int, int]:
        if self.nats is not None:
            found = self.nats_group()
            if found is None:
                return -1, -1
            return int(found.num_ack_pending), int(found.num_pending)
        client = self.redis_client()
        try:
            for group in client.xinfo_groups(STREAM):
                if group["name"] in (GROUP, GROUP.encode()):
                    return int(group["pending"]), int(group.get("lag") or 0)
        except Exception:
            return -1, -1
        finally:
            client.close()
        return 0, 0

    def settle(self, timeout: float = 120.0) -> bool:
        """Wait (load stopped, every process running) until nothing is in flight."""
        deadline = time.monotonic() + timeout
        self.ensure_running()
        while time.monotonic() < deadline:
            try:
                work = self.open_work()
            except Exception:
                work = {"error": 1}
            if not any(work.values()):
                self.mark("settled")
                return True
            time.sleep(0.5)
            self.ensure_running()
        return False

    def books(self) -> dict[str, Any]:
        """The books of the run: see the module's docstring."""
        from consumer.inbox import DEAD_LETTER_TABLE
        from consumer.jobs.schema import JOBS_TABLE, OPERATIONS_TABLE

        assert self.engine is not None
        with self.engine.connect() as conn:
            states = dict(
                conn.execute(
                    text("SELECT id, state FROM loop_quotes WHERE state = 'approved'")
                ).all()
            )
            outbox = dict(
                conn.execute(text("SELECT state, count(*) FROM outbox_events GROUP BY state")).all()
            )
            jobs = dict(
                conn.execute(text(f"SELECT state, count(*) FROM {JOBS_TABLE} GROUP BY state")).all()
            )
            receipts = dict(
                conn.execute(
                    text(f"SELECT state, count(*) FROM {OPERATIONS_TABLE} GROUP BY state")
                ).all()
            )
            dead_letters = int(
                conn.execute(text(f"SELECT count(*) FROM {DEAD_LETTER_TABLE}")).scalar_one()
            )
        committed = set(states)
        effects = self.simulator.effects()
        per_quote = Counter(e["body"].get("quote") for e in effects)
        latencies = sorted(
            e["time"] - e["body"]["t"] for e in effects if isinstance(e["body"].get("t"), float)
        )
        group_pending, group_lag = self.group_backlog()
        lost = sorted(q for q in committed if per_quote[q] == 0)
        return {
            "committed": len(committed),
            "effects": len(effects),
            "lost": len(lost),
            "lost_sample": lost[:10],
            "duplicated_effects": sum(n - 1 for n in per_quote.values() if n > 1),
            "effects_of_uncommitted": sum(n for q, n in per_quote.items() if q not in committed),
            "jobs": sum(jobs.values()),
            "jobs_by_state": jobs,
            "extra_jobs": sum(jobs.values()) - len(committed),
            "outbox": outbox,
            "group_pending": group_pending,
            "group_lag": group_lag,
            "broker": self.settings.broker,
            "stream_messages": self.stream_messages(),
            "open_jobs": sum(n for s, n in jobs.items() if s not in ("DONE", "CANCELLED")),
            "receipts": receipts,
            "unknown_receipts": receipts.get("UNKNOWN", 0) + receipts.get("PENDING", 0),
            "dead_letters": dead_letters,
            "latency_p50": _quantile(latencies, 0.50),
            "latency_p99": _quantile(latencies, 0.99),
            "latency_max": latencies[-1] if latencies else None,
        }

    def slowest(self, since: float | None = None, count: int = 3) -> list[dict[str, Any]]:
        """Where the slowest quotes (committed after unix time ``since``) spent their time:
        commit -> published (relay) -> handled (consumer inbox) -> job created -> first
        dispatch (worker claim) -> effect (provider), with the job's claims and calls."""
        effects = [
            e
            for e in self.simulator.effects()
            if isinstance(e["body"].get("t"), float) and (since is None or e["body"]["t"] >= since)
        ]
        effects.sort(key=lambda e: e["time"] - e["body"]["t"], reverse=True)
        found = []
        assert self.engine is not None
        with self.engine.connect() as conn:
            for effect in effects[:count]:
                quote = effect["body"]["quote"]
                committed = float(effect["body"]["t"])
                row = conn.execute(
                    text(
                        "SELECT (SELECT extract(epoch FROM min(published_at)) FROM outbox_events"
                        "        WHERE identity = :identity),"
                        "       (SELECT extract(epoch FROM min(processed_at)) FROM consumer_inbox"
                        "        WHERE identity = :identity),"
                        "       j.created_at, j.lease_epoch, o.created_at, o.attempts"
                        "  FROM outbox_jobs j LEFT JOIN outbox_operations o ON o.job_id = j.id"
                        " WHERE j.action = :action"
                    ),
                    {"identity": f"quote-{quote}", "action": f"send-quote-{quote}"},
                ).first()
                if row is None:
                    continue
                published, handled, job_created, claims, intent, calls = row

                def after(a: Any, b: Any) -> float | None:
                    return None if a is None or b is None else round(float(a) - float(b), 3)

                found.append(
                    {
                        "quote": quote,
                        "total": round(effect["time"] - committed, 3),
                        "relay": after(published, committed),
                        "consumer": after(handled, published),
                        "to_job": after(job_created, handled),
                        "worker_claim": after(intent, job_created),
                        "provider": after(effect["time"], intent),
                        "claims": claims,
                        "calls": calls,
                    }
                )
        return found

    def effect_latencies(self, since: float | None = None) -> list[float]:
        """commit -> effect seconds of the effects made after unix time ``since``."""
        return sorted(
            e["time"] - e["body"]["t"]
            for e in self.simulator.effects()
            if isinstance(e["body"].get("t"), float) and (since is None or e["time"] >= since)
        )


def problems(books: dict[str, Any]) -> list[str]:
    """What is wrong with the books (empty: they balance)."""
    found = []
    if books["lost"]:
        found.append(f"{books['lost']} committed quotes without an effect {books['lost_sample']}")
    if books["duplicated_effects"]:
        found.append(f"{books['duplicated_effects']} duplicated effects")
    if books["effects_of_uncommitted"]:
        found.append(f"{books['effects_of_uncommitted']} effects of rolled-back quotes")
    if books["extra_jobs"]:
        found.append(f"{books['extra_jobs']} jobs more than committed quotes")
    if books["outbox"].get("pending"):
        found.append(f"{books['outbox']['pending']} events pending in the outbox")
    if books["group_pending"] or books["group_lag"]:
        found.append(
            f"consumer group: {books['group_pending']} pending, {books['group_lag']} unread"
        )
    if books["open_jobs"]:
        found.append(f"{books['open_jobs']} jobs not finished {books['jobs_by_state']}")
    if books["unknown_receipts"]:
        found.append(f"{books['unknown_receipts']} receipts UNKNOWN/PENDING {books['receipts']}")
    return found


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def backlog_series(samples: Sequence[Sample]) -> list[tuple[float, int]]:
    """(time, committed quotes without an effect yet), carrying the last value over gaps."""
    series = []
    committed = effects = 0
    for s in samples:
        committed = s.committed if s.committed is not None else committed
        effects = s.effects if s.effects is not None else effects
        series.append((s.at, max(0, committed - effects)))
    return series


def rate_series(samples: Sequence[Sample], window: float = 2.0) -> list[tuple[float, float]]:
    """(time, effects per second over the last ``window`` seconds)."""
    points = [(s.at, s.effects) for s in samples if s.effects is not None]
    series = []
    for index, (at, count) in enumerate(points):
        back = index
        while back > 0 and at - points[back - 1][0] <= window:
            back -= 1
        if back < index:
            series.append((at, (count - points[back][1]) / (at - points[back][0])))
    return series


def steady_backlog(samples: Sequence[Sample], start: float, end: float) -> float:
    values = [b for at, b in backlog_series(samples) if start <= at <= end]
    if not values:
        return 0.0
    values.sort()
    return float(values[int(0.9 * (len(values) - 1))])


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench loop", description=__doc__)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args(argv)
    pg = private_postgres()
    try:
        loop = Loop(pg, "loop_smoke", LoopSettings(rate=args.rate)).start()
        try:
            time.sleep(args.duration)
            loop.stop_load()
            settled = loop.settle()
            books = loop.books()
            print(json.dumps(books, indent=2, default=str))
            print("settled" if settled else "NOT settled", "; ".join(problems(books)) or "books ok")
            if not settled or problems(books) or not books["committed"]:
                print(loop.logs())
        finally:
            loop.close()
    finally:
        pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
