"""The connector simulator's HTTP server: :class:`SimulatorServer` and its
:class:`Handler`, one keep-alive connection each, the routes and the misbehaving (waits,
resets) that ``outbox-simulator`` (``consumer.jobs.simulator``, whose docstring lists the
endpoints and fault kinds) serves. The semantics (effects, the fault plan, what a send does)
live in ``consumer.jobs.simulation``; this module is the HTTP front end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from consumer.jobs.simulation import (
    MAX_BODY_BYTES,
    Fault,
    Simulator,
    SimulatorConfig,
    wait_before_acting,
)
from outbox.errors import ConfigError
from outbox.logs import fields

if TYPE_CHECKING:
    from consumer.jobs.callbacks import CallbackSender

__all__ = ["Handler", "SimulatorServer", "capacity_setting", "seconds_setting", "serve"]

log = logging.getLogger("outbox.simulator")  # the service's one logger (its CLI logs there too)


class Handler(BaseHTTPRequestHandler):
    """One HTTP/1.1 connection (keep-alive) of the simulator."""

    protocol_version = "HTTP/1.1"
    server_version = "outbox-simulator"
    # Headers and body go out in two writes: with Nagle on, the body waits for the client's
    # delayed ACK (~40 ms per answer on loopback, measured: 21 calls/s instead of hundreds).
    disable_nagle_algorithm = True
    server: SimulatorServer

    # -- plumbing -------------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ConfigError("body", f"larger than {MAX_BODY_BYTES} bytes")
        return self.rfile.read(length) if length > 0 else b""

    def _json_body(self) -> Any:
        raw = self._body()
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise ConfigError("body", "is not JSON") from None

    def _flag(self, header: str, default: bool) -> bool:
        value = self.headers.get(header)
        if value is None:
            return default
        return value.strip().lower() not in ("0", "off", "false", "no")

    @property
    def sim(self) -> Simulator:
        return self.server.simulator

    # complexity: the simulator's routes, one branch each (a test service)
    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        query = parse_qs(url.query)
        try:
            if method == "POST" and path == "/send":
                self._send()
            elif method == "GET" and path.startswith("/lookup/"):
                self._lookup(unquote(path[len("/lookup/") :]))
            elif path == "/effects" and method == "GET":
                operation = query.get("operation_id", [None])[0]
                self._reply(200, {"effects": self.sim.effects.list(operation)})
            elif path == "/effects" and method == "DELETE":
                self.sim.effects.clear()
                self._reply(200, {"effects": []})
            elif path == "/config" and method in ("GET", "POST"):
                if method == "POST":
                    self._configure(self._json_body())
                self._reply(200, self._config())
            elif path == "/faults" and method in ("GET", "POST", "DELETE"):
                if method == "POST":
                    self.sim.set_faults(self._json_body())
                elif method == "DELETE":
                    self.sim.set_faults({"faults": []})
                self._reply(200, {"faults": self.sim.faults()})
            elif path == "/arrivals" and method == "GET":
                self._reply(200, {"arrivals": self.server.arrivals()})
            elif path == "/stats" and method == "GET":
                self._reply(200, self.sim.stats())
            elif path == "/health" and method == "GET":
                self._reply(200, {"ok": True, "effects": self.sim.effects.count()})
            else:
                self._body()  # keep the connection usable
                self._reply(404, {"error": f"no route {method} {path}"})
        except ConfigError as exc:
            self._reply(400, {"error": str(exc)})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- endpoints ------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        config = self.sim.config
        return {
            "idempotency": config.idempotency,
            "lookup": config.lookup,
            "latency": config.latency,
            "jitter": config.jitter,
            "capacity": config.capacity,
        }

    def _configure(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise ConfigError("config", "must be an object")
        for name in ("idempotency", "lookup"):
            if name in raw:
                if not isinstance(raw[name], bool):
                    raise ConfigError(name, "must be true or false")
                setattr(self.sim.config, name, raw[name])
        for name in ("latency", "jitter"):
            if name in raw:
                setattr(self.sim.config, name, seconds_setting(name, raw[name]))
        if "capacity" in raw:
            self.server.set_capacity(capacity_setting(raw["capacity"]))
        unknown = set(raw) - {"idempotency", "lookup", "latency", "jitter", "capacity"}
        if unknown:
            raise ConfigError("config", f"unknown settings {sorted(unknown)}")

    # complexity: the simulator's send rules per fault kind (a test service)
    def _send(self) -> None:
        arrived = time.time()  # before the body: the request has reached the provider
        raw = self._body()
        try:
            request = json.loads(raw)
        except ValueError:
            self._reply(400, {"error": "the request body is not JSON"})
            return
        body = json.dumps(request, sort_keys=True, separators=(",", ":"))
        operation_id = self.headers.get("Operation-Id")
        key = self.headers.get("Idempotency-Key")
        header = self.headers.get("X-Sim-Fault")
        fault, refusal = self.sim.begin_send(
            operation_id, Fault.from_header(header) if header else None
        )
        self.server.arrived(arrived, operation_id, fault.kind if fault is not None else None)
        if refusal is not None:
            self._reply(refusal.status, refusal.body, refusal.headers)
            return
        if self._wait(wait_before_acting(fault)):
            return
        idempotent = self._flag("X-Sim-Idempotency", self.sim.config.idempotency)
        headers = {k.lower(): v for k, v in self.headers.items()}
        # The provider's own pace: ``capacity`` sends served at once (the others queue, as
        # at a real provider that is too slow), each taking ``latency`` (± ``jitter``).
        with self.server.serving():
            if self._wait(self.server.latency()):
                return
            answer = self.sim.act(fault, operation_id, key, body, headers, idempotent=idempotent)
        callbacks = self.server.callbacks
        made = answer.body.get("id") if isinstance(answer.body, dict) else None
        if callbacks is not None and made and not answer.body.get("replayed"):
            callbacks.effect(operation_id, str(made), request)  # its webhook, later
        if answer.reset:
            self._reset()
        elif answer.hang:
            self._wait(answer.delay)
            self.close_connection = True
        elif not (answer.delay and self._wait(answer.delay)):
            self._reply(answer.status, answer.body)

    def _lookup(self, operation_id: str) -> None:
        self.server.arrived(time.time(), operation_id, None, "lookup")
        enabled = self._flag("X-Sim-Lookup", self.sim.config.lookup)
        found = self.sim.lookup(operation_id, enabled=enabled)
        if not enabled:
            self._reply(404, {"error": "lookup is off"})
        elif found is None:
            self._reply(404, {"error": "no effect for this operation id"})
        else:
            self._reply(200, found)

    # -- misbehaving ----------------------------------------------------------------------------
    def _wait(self, seconds: float) -> bool:
        """Wait ``seconds`` without answering; True when the client went away meanwhile
        (or the server is stopping), so there is nobody left to answer."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.sim.stopping.is_set() or self._client_gone(min(left, 0.2)):
                self.close_connection = True
                return True

    def _client_gone(self, timeout: float) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], timeout)
            if not readable:
                return False
            if self.connection.recv(1, socket.MSG_PEEK) == b"":
                return True
            time.sleep(timeout)  # the client sent more bytes (pipelining): still there
            return False
        except (OSError, ValueError):
            return True

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()


class SimulatorServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], simulator: Simulator) -> None:
        self.simulator = simulator
        self.callbacks: CallbackSender | None = None  # --callback-url: signed webhooks
        self._arrivals: deque[tuple[float, str | None, str | None, str]] = deque(maxlen=200_000)
        self._capacity: threading.Semaphore | None = None
        self._random = random.Random()
        self.set_capacity(simulator.config.capacity)
        super().__init__(address, Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-request (a worker SIGKILLed mid-send) is what this
        # service exists to simulate: one line at debug, not a traceback in the log.
        exc = sys.exception()
        if isinstance(exc, ConnectionError | TimeoutError):
            log.debug("client went away", extra=fields(client=str(client_address), error=repr(exc)))
            return
        super().handle_error(request, client_address)

    def arrived(
        self, when: float, operation_id: str | None, fault: str | None, kind: str = "send"
    ) -> None:
        """A call reached the provider (``GET /arrivals``: when, for which operation, the
        fault it met, a send or a lookup)."""
        self._arrivals.append((when, operation_id, fault, kind))

    def arrivals(self) -> list[dict[str, Any]]:
        return [
            {"time": t, "operation_id": op, "fault": fault, "kind": kind}
            for t, op, fault, kind in list(self._arrivals)
        ]

    def set_capacity(self, capacity: int | None) -> None:
        self.simulator.config.capacity = capacity
        self._capacity = None if capacity is None else threading.Semaphore(capacity)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """One of the ``capacity`` sends served at once (waits its turn)."""
        gate = self._capacity
        if gate is None:
            yield
            return
        with gate:
            yield

    def latency(self) -> float:
        config = self.simulator.config
        if not config.latency:
            return 0.0
        spread = config.latency * config.jitter
        return max(0.0, config.latency + self._random.uniform(-spread, spread))


def serve(
    host: str, port: int, data: str, config: SimulatorConfig | None = None
) -> SimulatorServer:
    """A bound simulator server (call ``serve_forever()``; tests may run it in a thread)."""
    return SimulatorServer((host, port), Simulator(data, config))


def seconds_setting(name: str, value: Any) -> float:
    """A ``latency``, ``jitter`` or delay setting: a number from 0 to 3600 (seconds; the
    jitter a fraction)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 3600:
        raise ConfigError(name, f"must be a number from 0 to 3600, got {value!r}")
    return float(value)


def capacity_setting(value: Any) -> int | None:
    """Sends served at once: a positive integer, or None for no limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("capacity", f"must be a positive integer or null, got {value!r}")
    return value
