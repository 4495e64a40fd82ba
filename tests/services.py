"""Private PostgreSQL and Redis servers for tests that stop, restart or cut off a server.

The shared servers (PostgreSQL on 5432, Redis on 6379) serve every engineer's tests at once,
so a test that restarts a server must never touch them: it starts its own on a free port with
the classes here, and the ``with`` block (or ``close()``) removes it with its data.

- :class:`PrivateRedis`: ``redis-server`` as a child process (``--daemonize no``) on a free
  port, in a temporary directory. ``stop()`` / ``start()`` restart it on the same port, so
  clients configured with its URL reconnect to the new server. ``persistent=True`` turns on
  the append-only file with ``appendfsync always``: every acknowledged write survives a stop
  (even ``stop(kill=True)``, a SIGKILL), which is what a production Redis backing an outbox
  relay is expected to do.
- :class:`PrivatePostgres`: ``initdb`` into a temporary directory and ``pg_ctl`` on a free
  port (TCP on 127.0.0.1 and a private Unix socket directory). PostgreSQL refuses to run as
  root, so when the test runs as root the binaries run as the ``postgres`` OS user, which
  owns the temporary directory. ``fsync=off``: the OS does not crash in these tests, and the
  data files survive a server restart either way.

It also holds :func:`wait_for`, the suite's one helper for polling an observable condition.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")

PG_BIN_DIRS = ("/usr/lib/postgresql/15/bin", "/usr/local/bin", "/usr/lib/postgresql/16/bin")


def free_port() -> int:
    """A TCP port that nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_for(
    condition: Callable[[], T],
    what: str = "condition",
    timeout: float = 30.0,
    interval: float = 0.05,
    *,
    ignore: tuple[type[BaseException], ...] = (),
    diagnose: Callable[[], str] | None = None,
) -> T:
    """Poll ``condition()`` until it returns a truthy value, and return that value.

    The condition is always asked at least once, and the deadline is looked at only after
    each answer (a slow last answer still counts). An exception of a type in ``ignore``
    counts as "not yet" (a server restarting, an app not listening yet); any other exception
    propagates at once. On timeout: ``AssertionError`` naming ``what``, with the last value
    or the last ignored exception, and the text of ``diagnose()`` if given.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except ignore as exc:
            last = f"last error: {exc!r}"
        else:
            if value:
                return value
            last = f"last value: {value!r}"
        if time.monotonic() > deadline:
            message = f"timed out after {timeout}s waiting for {what} ({last})"
            if diagnose is not None:
                message += f"\n{diagnose()}"
            raise AssertionError(message)
        time.sleep(interval)


def start_worker_app(target: str, env: Mapping[str, str], log: Path) -> subprocess.Popen[str]:
    """``outbox-worker run TARGET`` (``module:build``) as a process of its own, from the
    project's root, with ``env`` added to this one's; its stderr is appended to ``log`` (a
    file, not a pipe: a full pipe would stall the worker)."""
    with log.open("a") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "consumer.jobs.cli", "run", target],
            cwd=Path(__file__).resolve().parent.parent,
            env={**os.environ, "OUTBOX_LOG_LEVEL": "warning", **env},
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )


# -- Redis -----------------------------------------------------------------------------------


class PrivateRedis:
    """A ``redis-server`` child process on a free port; restartable on the same port."""

    def __init__(
        self, *, persistent: bool = False, port: int | None = None, password: str | None = None
    ) -> None:
        self.port = port or free_port()
        self.persistent = persistent
        self.password = password  # ``requirepass``: clients must AUTH
        self.directory = tempfile.mkdtemp(prefix="private-redis-")
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.directory, "redis.log")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        command = [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "no",
            "--save",
            "",
            "--dir",
            self.directory,
            "--logfile",
            self.log_path,
        ]
        if self.password:
            command += ["--requirepass", self.password]
        if self.persistent:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            command += ["--appendonly", "no"]
        return command

    def start(self, timeout: float = 60.0) -> PrivateRedis:
        if self.process is not None and self.process.poll() is None:
            return self
        self.process = subprocess.Popen(
            self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(self._ping, f"private Redis on port {self.port} to answer PING", timeout)
        return self

    def _ping(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self.log()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                if self.password:
                    sock.sendall(f"AUTH {self.password}\r\n".encode())
                    if not sock.recv(64).startswith(b"+OK"):
                        return False
                sock.sendall(b"PING\r\n")
                # A server still loading its AOF answers -LOADING: not ready yet.
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, *, kill: bool = False, timeout: float = 15.0) -> None:
        """Stop the server: SIGTERM (clean shutdown) or, with ``kill``, SIGKILL (a crash)."""
        process = self.process
        if process is None or process.poll() is not None:
            self.process = None
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        process.wait(timeout)
        self.process = None
        wait_for(
            lambda: not _port_answers(self.port), f"port {self.port} to close after stop", timeout
        )

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        try:
            self.stop(kill=True)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- PostgreSQL ------------------------------------------------------------------------------


def pg_binary(name: str) -> str:
    for directory in PG_BIN_DIRS:
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"PostgreSQL binary {name!r} not found (looked in {PG_BIN_DIRS})")
    return found


class PrivatePostgres:
    """A PostgreSQL cluster of its own: ``initdb`` in a temp dir, ``pg_ctl`` on a free port.

    ``url`` is a SQLAlchemy URL (psycopg 3, database ``postgres``, user ``postgres``, trust).
    ``restart()`` keeps the port and the data; ``stop(mode="immediate")`` is a crash (the
    server recovers from its WAL on the next start).
    """

    def __init__(self, *, port: int | None = None, settings: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.settings = tuple(settings)
        self.directory = tempfile.mkdtemp(prefix="private-pg-")
        self.data = os.path.join(self.directory, "data")
        self.socket_dir = os.path.join(self.directory, "sock")
        self.log_path = os.path.join(self.directory, "postgres.log")
        os.makedirs(self.socket_dir)
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.directory, "postgres", "postgres")
            shutil.chown(self.socket_dir, "postgres", "postgres")
        self._initialised = False

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def url_for_schema(self, schema: str) -> str:
        return f"{self.url}?options=-csearch_path%3D{schema}"

    def _run(self, *command: str, timeout: float = 60.0) -> str:
        argv = list(command)
        if self._as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            cwd=self.directory,
            check=False,
        )
        output = done.stdout.decode("utf-8", "replace")
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {output}")
        return output

    def _options(self) -> str:
        options = [
            f"-p {self.port}",
            f"-k {self.socket_dir}",
            "-c listen_addresses=127.0.0.1",
            "-c fsync=off",
            "-c full_page_writes=off",
            "-c max_connections=200",
        ]
        options += [f"-c {setting}" for setting in self.settings]
        return " ".join(options)

    def start(self, timeout: float = 60.0) -> PrivatePostgres:
        if not self._initialised:
            self._run(
                pg_binary("initdb"),
                "-D",
                self.data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            )
            self._initialised = True
        self._run(
            pg_binary("pg_ctl"),
            "-D",
            self.data,
            "-l",
            self.log_path,
            "-o",
            self._options(),
            "-w",
            "-t",
            str(int(timeout)),
            "start",
            timeout=timeout + 10,
        )
        return self

    def stop(self, mode: str = "fast", timeout: float = 60.0) -> None:
        """``fast`` disconnects clients and shuts down cleanly; ``immediate`` is a crash."""
        if not self.running():
            return
        self._run(
            pg_binary("pg_ctl"),
            "-D",
            self.data,
            "-m",
            mode,
            "-w",
            "-t",
            str(int(timeout)),
            "stop",
            timeout=timeout + 10,
        )

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def running(self) -> bool:
        return self._initialised and os.path.exists(os.path.join(self.data, "postmaster.pid"))

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- NATS ------------------------------------------------------------------------------------


class PrivateNats:
    """``nats-server -js`` as a child process on a free port, its JetStream store (file
    storage) in a temporary directory. :meth:`kill` (SIGKILL) and :meth:`start` again keep the
    port and the store, so clients configured with :attr:`url` find the same streams there;
    ``empty=True`` on :meth:`start` wipes the store first (a server that came back empty)."""

    def __init__(self, *, port: int | None = None) -> None:
        self.port = port or free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="private-nats-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, *, empty: bool = False, timeout: float = 60.0) -> PrivateNats:
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        store = self.directory / "store"
        if empty:
            shutil.rmtree(store, ignore_errors=True)
        command = [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(store)]
        with (self.directory / "nats.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._answers, f"private NATS on port {self.port}", timeout)
        return self

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self.process.returncode}: {self.log}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                return sock.recv(16).startswith(b"INFO")
        except OSError:
            return False

    @property
    def log(self) -> str:
        path = self.directory / "nats.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients, as a crashed server or host."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(15)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
