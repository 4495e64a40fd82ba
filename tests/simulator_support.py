"""The connector simulator (``outbox-simulator serve``) as a real child process for tests.

``SimulatorProcess(data_path)`` starts ``python -m consumer.jobs.simulator serve --port 0``
(the first start takes a free port; a restart binds the same one again), reads the URL from
its first stdout line, and talks to it over HTTP: ``effects()``, ``faults(...)``,
``configure(...)``. ``restart()`` / ``kill()`` / ``stop()`` drive the process itself.

Use it as a context manager or through a fixture in the test module::

    @pytest.fixture
    def simulator(tmp_path):
        with SimulatorProcess(tmp_path / "sim.db") as sim:
            yield sim
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from tests.services import wait_for

ROOT = Path(__file__).resolve().parent.parent


class SimulatorProcess:
    """``outbox-simulator serve`` in a child process, on a port of its own."""

    def __init__(
        self,
        data: str | os.PathLike[str],
        *,
        idempotency: bool = True,
        lookup: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.data = str(data)
        self.idempotency = idempotency
        self.lookup = lookup
        self.env = env
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self._drainer: threading.Thread | None = None
        self.client = httpx.Client(timeout=10.0)

    # -- the process ----------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "consumer.jobs.simulator",
            "serve",
            "--port",
            str(self.port),
            "--data",
            self.data,
            "--log-level",
            "warning",
        ]
        if not self.idempotency:
            cmd.append("--no-idempotency")
        if not self.lookup:
            cmd.append("--no-lookup")
        return cmd

    def start(self, timeout: float = 60.0) -> SimulatorProcess:
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(
            self.command(),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self._first_line(timeout)
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError(f"simulator did not start: {line!r}\n{self.log()}")
        self.url = line.split()[-1]
        self.port = int(self.url.rsplit(":", 1)[1])
        # drain the rest of the output so a chatty child never blocks on a full pipe
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        return self

    def _first_line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(
            target=lambda: result.append(self.proc.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(timeout)
        if not result:
            self.proc.kill()
            raise TimeoutError(f"simulator printed nothing within {timeout:.0f} s")
        self.output.append(result[0])
        return result[0].strip()

    def _drain(self) -> None:
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        for line in proc.stdout:
            self.output.append(line)

    def log(self) -> str:
        return "".join(self.output)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait; the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc = None
            if self._drainer is not None:
                self._drainer.join(timeout)  # log() is then the whole output

    def kill(self) -> None:
        """SIGKILL: no chance to flush anything."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(15)
            self.proc = None

    def restart(self, *, kill: bool = False) -> None:
        """Stop (or kill) and start again on the same port and data file."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.client.close()
        self.client = httpx.Client(timeout=10.0)
        # The port is free again as soon as the old process is gone.
        wait_for(self.start, "the simulator to start again", 60, 0.1, ignore=(RuntimeError,))

    def close(self) -> None:
        try:
            if self.proc is not None:
                self.stop()
        finally:
            self.client.close()

    def __enter__(self) -> SimulatorProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- its HTTP API ---------------------------------------------------------------------------
    @property
    def send_url(self) -> str:
        return f"{self.url}/send"

    @property
    def lookup_url(self) -> str:
        return f"{self.url}/lookup/{{operation_id}}"

    def effects(self, operation_id: str | None = None) -> list[dict[str, Any]]:
        params = {"operation_id": operation_id} if operation_id is not None else None
        response = self.client.get(f"{self.url}/effects", params=params)
        response.raise_for_status()
        return list(response.json()["effects"])

    def faults(self, *rules: dict[str, Any], seed: int | None = None) -> list[dict[str, Any]]:
        """Replace the fault plan (no rules: clear it)."""
        body: dict[str, Any] = {"faults": list(rules)}
        if seed is not None:
            body["seed"] = seed
        response = self.client.post(f"{self.url}/faults", json=body)
        response.raise_for_status()
        return list(response.json()["faults"])

    def configure(self, **settings: Any) -> dict[str, Any]:
        response = self.client.post(f"{self.url}/config", json=settings)
        response.raise_for_status()
        return dict(response.json())

    def arrivals(self) -> list[dict[str, Any]]:
        """When each send reached the simulator (``GET /arrivals``), in order."""
        response = self.client.get(f"{self.url}/arrivals")
        response.raise_for_status()
        return list(response.json()["arrivals"])

    def stats(self) -> dict[str, int]:
        """Requests counted since this simulator process started (sends, lookups, ...)."""
        response = self.client.get(f"{self.url}/stats")
        response.raise_for_status()
        return dict(response.json())

    def health(self) -> dict[str, Any]:
        response = self.client.get(f"{self.url}/health")
        response.raise_for_status()
        return dict(response.json())

    def wait_for_effects(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Poll ``/effects`` until at least ``count`` effects exist (an observable condition,
        not a sleep). 60 s: the first effect waits for a worker process to start and claim,
        which took over 20 s on a 2-core machine at load 20-30."""

        def enough() -> list[dict[str, Any]]:
            effects = self.effects()
            return effects if len(effects) >= count else []

        return wait_for(enough, f"{count} effects", timeout=timeout)


# -- a worker app for ``outbox-worker run tests.simulator_support:build_http_worker`` ------------


def build_http_worker() -> Any:
    """A Worker whose ``email`` handler dispatches one operation through an HttpProvider to
    the simulator at ``$SIM_URL``. ``SIM_LOOKUP`` / ``SIM_IDEMPOTENCY`` (``1``/``0``) choose
    the provider's capabilities, ``SIM_TIMEOUT`` its call timeout, ``JOBS_TTL`` the lease."""
    from consumer import HttpProvider, JobContext, Worker

    url = os.environ["SIM_URL"]
    provider = HttpProvider(
        "mail",
        f"{url}/send",
        lookup_url=f"{url}/lookup/{{operation_id}}"
        if os.environ.get("SIM_LOOKUP", "1") == "1"
        else None,
        idempotency_header="Idempotency-Key"
        if os.environ.get("SIM_IDEMPOTENCY", "1") == "1"
        else None,
        timeout=float(os.environ.get("SIM_TIMEOUT", "2")),
    )
    worker = Worker(
        providers={"mail": provider},
        batch_size=1,
        ttl=float(os.environ.get("JOBS_TTL", "1")),
        recover_interval=0.2,
        reconcile_interval=0.3,
        poll_interval=0.05,
    )

    @worker.handler("email")
    def email(job: JobContext) -> None:
        job.dispatch("send", "mail", {"to": job.subject, "template": "quote-approved"})

    return worker


def max_per_window(times: list[float], window: float = 1.0) -> int:
    """The most arrivals in any half-open window [t, t + window) starting at an arrival."""
    times = sorted(times)
    best = 0
    end = 0
    for start, t in enumerate(times):
        while end < len(times) and times[end] < t + window:
            end += 1
        best = max(best, end - start)
    return best
