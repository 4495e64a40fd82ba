"""``outbox-console serve`` as a real process for the browser, CLI and benchmark runs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

import httpx

from tests.services import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent


class ConsoleProcess:
    def __init__(
        self,
        database_url: str,
        redis_url: str,
        *,
        token: str | None = None,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.port = free_port()
        self.host = host
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        environment = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        environment.update(env or {})
        if token is not None:
            environment["OUTBOX_CONSOLE_TOKEN"] = token
        self.args = [
            sys.executable,
            "-m",
            "outbox.console.cli",
            "serve",
            "--database-url",
            database_url,
            "--redis-url",
            redis_url,
            "--host",
            host,
            "--port",
            str(self.port),
            *(extra or []),
        ]
        self.env = environment
        self.proc: subprocess.Popen[str] | None = None
        # stderr goes to a file: a pipe nobody reads could fill and stall the server.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop)

    def start(self) -> ConsoleProcess:
        self.proc = subprocess.Popen(
            self.args,
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.first_line = self.proc.stdout.readline() if self.proc.stdout else ""

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"outbox-console exited: {self.stderr()}")
            try:
                return httpx.get(self.url + "/login", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(answers, "the console to answer", timeout=60)
        return self

    def stderr(self) -> str:
        if self.log.closed:
            return ""
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> tuple[int, str]:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        try:
            return self.proc.returncode, self.stderr()
        finally:
            self.log.close()

    def __enter__(self) -> ConsoleProcess:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
