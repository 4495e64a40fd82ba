"""``outbox-relay demo --chaos``: the connector simulator service and the worker processes,
and the killing (see :mod:`relay.demo` for the whole demo).

:class:`Chaos` starts ``outbox-simulator serve`` (through ``python -m relay.demo_app
simulator``) with a fault plan that answers some sends late and some slowly, and
``--workers`` worker processes (``outbox-worker run relay.demo_app:build_worker``) that send
each quote's email through it. Every 1-2 s it SIGKILLs a worker, one with a call in flight
when there is one (its receipt still PENDING), and starts another; its report counts the
emails the simulator sent against the quotes approved, the duplicate effects (0), the
receipts and the kills. Every child is stopped (SIGTERM, then SIGKILL) and reaped at close.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import IO, Any

import httpx
from sqlalchemy import func, select

from consumer.jobs.schema import jobs, operations
from consumer.jobs.store import Store
from relay.demo_app import PARENT_PID_VARIABLE, SIMULATOR_URL_VARIABLE

#: The simulator's fault plan under ``--chaos``: some sends are answered late (the email is
#: sent, the answer comes 0.8 s later) and some slowly (0.4 s before the email is sent), so a
#: kill often lands while a call is in flight, after or before the provider acted.
CHAOS_FAULTS: dict[str, Any] = {
    "faults": [
        {"kind": "late", "probability": 0.3, "delay": 0.8},
        {"kind": "slow", "probability": 0.15, "delay": 0.4},
    ]
}
#: Seconds a child process gets to stop after SIGTERM before it is SIGKILLed.
STOP_TIMEOUT = 10.0
WORKER_TARGET = "relay.demo_app:build_worker"


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first stdout line of ``proc`` (empty if none came within ``timeout``)."""
    line: list[str] = []
    reader = threading.Thread(
        target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""), daemon=True
    )
    reader.start()
    reader.join(timeout)
    return line[0].strip() if line else ""


def _drain(stream: IO[str] | None) -> None:
    """Read a child's stdout to its end, so a chatty child never blocks on a full pipe."""
    if stream is not None:
        for _ in stream:
            pass


def _stop_processes(procs: list[subprocess.Popen[Any]], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM each, wait for all up to ``timeout``, SIGKILL what is left; all reaped."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Chaos:
    """``--chaos``: the simulator service and the worker processes, and the killing.

    Children run in sessions of their own: a Ctrl-C reaches only the demo, which then stops
    them in order (workers first, they need the simulator to finish the calls in hand).
    """

    def __init__(
        self,
        store: Store,
        database_url: str,
        workers: int,
        first_quote: int,
        directory: str,
        provider_latency: float = 0.0,
    ) -> None:
        self.store = store
        self.provider_latency = provider_latency
        self.database_url = database_url
        self.workers = workers
        self.first_quote = first_quote  # this run's quotes have larger ids
        self.directory = directory  # the demo's files: simulator.db, demo-chaos.log
        self.log_path = os.path.join(self.directory, "demo-chaos.log")
        self.url = ""
        self.simulator: subprocess.Popen[str] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.kills = 0
        self.kills_in_flight = 0
        self.restarts = 0
        self._log: IO[str] | None = None
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._working: set[int] = set()  # pids of workers seen holding a lease
        self._http = httpx.Client(timeout=10.0)
        self._baseline = 0  # the simulator's last effect before this run
        self._first_job = 0  # the last job before this run

    # -- the processes ----------------------------------------------------------------------
    def start(self) -> None:
        self._log = open(self.log_path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self.simulator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relay.demo_app",  # outbox-simulator serve, stopped if the demo is gone
                "simulator",
                "--port",
                "0",
                "--data",
                os.path.join(self.directory, "simulator.db"),
                "--log-level",
                "warning",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
            env={**os.environ, PARENT_PID_VARIABLE: str(os.getpid())},
        )
        line = _first_line(self.simulator, 30.0)
        if not line.startswith("listening on "):
            raise RuntimeError(f"the simulator did not start ({line!r}; see {self.log_path})")
        self.url = line.split()[-1]
        threading.Thread(target=_drain, args=(self.simulator.stdout,), daemon=True).start()
        self._http.post(f"{self.url}/faults", json=CHAOS_FAULTS).raise_for_status()
        if self.provider_latency:  # a real provider's pace (--provider-latency)
            latency = {"latency": self.provider_latency, "jitter": 0.5}
            self._http.post(f"{self.url}/config", json=latency).raise_for_status()
        self._baseline = max((int(e["seq"]) for e in self._effects()), default=0)
        with self.store.driver.connect() as conn:
            self._first_job = int(conn.execute(select(func.max(jobs.c.id))).scalar() or 0)
        with self._lock:
            self.procs = [self._spawn() for _ in range(self.workers)]

    def _spawn(self) -> subprocess.Popen[bytes]:
        # Only what the worker needs: the user's OUTBOX_* settings (a metrics port, a
        # concurrency) are the demo's, not its workers'.
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update(
            {
                "OUTBOX_DATABASE_URL": self.database_url,
                "OUTBOX_LOG_LEVEL": "warning",
                SIMULATOR_URL_VARIABLE: self.url,
                PARENT_PID_VARIABLE: str(os.getpid()),
            }
        )
        return subprocess.Popen(
            [sys.executable, "-m", "consumer.jobs.cli", "run", WORKER_TARGET],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            start_new_session=True,
        )

    def keep_alive(self) -> None:
        """Start a worker in place of any that exited by itself."""
        with self._lock:
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    self.procs[i] = self._spawn()
                    self.restarts += 1

    def _busy(self) -> tuple[subprocess.Popen[bytes] | None, subprocess.Popen[bytes] | None]:
        """(a live worker with a provider call in flight, a live worker holding a lease).

        In flight: it holds the lease of a job whose receipt is still PENDING (the intent is
        written, the answer not yet recorded)."""
        with self.store.driver.connect() as conn:
            rows = conn.execute(
                select(jobs.c.lease_owner, operations.c.state)
                .select_from(jobs)
                .outerjoin(operations, operations.c.job_id == jobs.c.id)
                .where(jobs.c.state == "LEASED")
            ).all()
        sending = holding = None
        with self._lock:
            for owner, receipt in rows:
                for proc in self.procs:
                    # worker names are worker-HOST-PID-RANDOM (outbox.lifecycle)
                    if proc.poll() is None and f"-{proc.pid}-" in str(owner):
                        self._working.add(proc.pid)
                        holding = holding or proc
                        if receipt == "PENDING":
                            sending = sending or proc
        return sending, holding

    def run(self, stop: threading.Event) -> None:
        """Every 1-2 s, SIGKILL a worker in the middle of a send (or, when no call is in
        flight for a second, one holding a lease; an idle one is spared) and start another
        in its place, until ``stop``. Only when another worker is at work (has taken a job
        since it started): replacements take a moment to start, and on a slow machine the
        kills space out rather than leave nobody sending."""
        while not stop.wait(self._rng.uniform(0.5, 1.0)):
            try:
                self.keep_alive()
                sending = holding = None
                search_until = time.monotonic() + 1.0
                while sending is None and time.monotonic() < search_until:
                    sending, holding = self._busy()
                    if sending is None and stop.wait(0.02):
                        return
                victim = sending or holding
                if victim is None or not self._others_working(victim):
                    continue
                with self._lock:
                    if stop.is_set() or victim not in self.procs:
                        continue
                    index = self.procs.index(victim)
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    self.kills += 1
                    self.kills_in_flight += sending is not None
                    self.procs[index] = self._spawn()
            except Exception as exc:  # keep the demo going; show the problem
                print(f"\nchaos: {type(exc).__name__}: {exc}", file=sys.stderr)
                stop.wait(1.0)

    def _others_working(self, victim: subprocess.Popen[bytes]) -> bool:
        """Whether another live worker than ``victim`` has been seen holding a lease."""
        with self._lock:
            return any(
                p is not victim and p.poll() is None and p.pid in self._working for p in self.procs
            )

    def stop_workers(self) -> None:
        with self._lock:
            procs, self.procs = self.procs, []
        _stop_processes(procs)

    def close(self) -> None:
        """Stop and reap every child (workers first), release the log and the client."""
        try:
            self.stop_workers()
        finally:
            try:
                if self.simulator is not None:
                    _stop_processes([self.simulator])
            finally:
                self._http.close()
                if self._log is not None:
                    self._log.close()

    # -- what happened ------------------------------------------------------------------------
    def _effects(self) -> list[dict[str, Any]]:
        response = self._http.get(f"{self.url}/effects")
        response.raise_for_status()
        return list(response.json()["effects"])

    def report(self) -> dict[str, int]:
        """Emails sent for this run's quotes, duplicates (more than one email for a quote),
        receipts of this run by state, kills."""
        per_quote: Counter[int] = Counter()
        for effect in self._effects():
            body = effect.get("body")
            quote = body.get("quote") if isinstance(body, dict) else None
            this_run = int(effect["seq"]) > self._baseline
            if this_run and isinstance(quote, int) and quote > self.first_quote:
                per_quote[quote] += 1
        with self.store.driver.connect() as conn:
            rows = conn.execute(
                select(operations.c.state, func.count())
                .where(operations.c.job_id > self._first_job)
                .group_by(operations.c.state)
            ).all()
        receipts = {str(state): int(n) for state, n in rows}
        with self._lock:  # not in the middle of a kill and its replacement
            workers = sum(proc.poll() is None for proc in self.procs)
        return {
            "emails": sum(per_quote.values()),
            "quotes_emailed": len(per_quote),
            "duplicates": sum(n - 1 for n in per_quote.values()),
            "accepted": receipts.get("ACCEPTED", 0),
            "pending": receipts.get("PENDING", 0),
            "unknown": receipts.get("UNKNOWN", 0),
            "kills": self.kills,
            "kills_in_flight": self.kills_in_flight,
            "workers": workers,
        }

    def view(self, approved: int) -> list[str]:
        try:
            r = self.report()
        except Exception as exc:
            return [f"  chaos: {type(exc).__name__}: {exc}"]
        return [
            f"  chaos: {r['workers']} worker processes, {r['kills']} SIGKILLed so far "
            f"({r['kills_in_flight']} mid-send), each replaced",
            f"  emails sent (simulator):     {r['emails']} for {approved} quotes approved",
            f"  duplicate effects:           {r['duplicates']}",
            f"  receipts:                    {r['accepted']} ACCEPTED, {r['unknown']} UNKNOWN, "
            f"{r['pending']} PENDING (in flight)",
        ]


__all__ = ["CHAOS_FAULTS", "STOP_TIMEOUT", "WORKER_TARGET", "Chaos"]
