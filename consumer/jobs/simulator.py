"""``outbox-simulator``: a connector simulator, an HTTP service standing in for a provider.

It is a **simulator**, made to script the failures that make external effects hard (a
provider that accepts and then hangs, answers late, fails after acting, rate-limits, refuses
credentials), not a promise about how any real provider behaves: read your provider's
documentation for what its idempotency keys, lookups and status codes really mean.

```
outbox-simulator serve --port P --data FILE [--host 127.0.0.1]
                       [--no-idempotency] [--no-lookup] [--log-level LEVEL]
                       [--latency SECONDS] [--jitter FRACTION] [--capacity N]
```

Flags default to ``OUTBOX_SIMULATOR_PORT``, ``OUTBOX_SIMULATOR_DATA``,
``OUTBOX_SIMULATOR_HOST``, ``OUTBOX_SIMULATOR_IDEMPOTENCY`` / ``OUTBOX_SIMULATOR_LOOKUP``
(``0`` turns one off) and ``OUTBOX_LOG_LEVEL``. ``--port 0`` takes a free port. The first
line on stdout is ``listening on http://HOST:PORT``. Exit codes: 0 after SIGTERM/SIGINT,
1 on failure (the port is taken, the data file cannot be opened), 2 on bad usage.

Every effect is a row in the SQLite file ``--data`` (committed before the answer is
written), so effects survive the simulator's own restart and ``kill -9``.

Endpoints (JSON in, JSON out):

``POST /send``
    Makes an effect: ``201 {"id": REF, "operation_id": ..., "replayed": false}``. With
    idempotency on and an ``Idempotency-Key`` header, the same key with the same body
    answers ``200`` with the first effect's ``id`` and ``"replayed": true`` (no new
    effect); the same key with another body answers ``409``. The operation id comes from
    the ``Operation-Id`` header.
``GET /lookup/{operation_id}``
    ``200 {"id": REF, ...}`` for the first effect made for that operation id; ``404`` when
    there is none or when lookup is off.
``GET /effects``
    ``{"effects": [{"seq", "id", "operation_id", "idempotency_key", "body", "headers",
    "time"}, ...]}`` (``headers``: the request's, names in lower case)
    in the order they were made (``?operation_id=`` filters). ``DELETE /effects`` forgets
    them all.
``GET /config`` / ``POST /config``
    The capabilities of this run: ``{"idempotency": bool, "lookup": bool, "latency":
    SECONDS, "jitter": FRACTION, "capacity": N | null}``. ``latency`` (± ``jitter``) is
    what every send takes before it acts; ``capacity`` sends are served at once and the
    others queue, as at a real provider that is too slow (their wait counts against the
    client's timeout).
``GET /faults`` / ``POST /faults`` / ``DELETE /faults``
    The fault plan: ``{"faults": [RULE, ...], "seed": N}`` replaces it. A rule is
    ``{"kind": K, "count": N}`` (the next N sends), ``{"kind": K, "probability": P}``
    (each send with probability P, 0..1) or ``{"kind": K}`` (every send), optionally with
    ``"operation_id"`` (only that operation), ``"status"``, ``"delay"`` (seconds) and
    ``"retry_after"``. The first rule that matches a send applies.
``GET /arrivals``
    ``{"arrivals": [{"time", "operation_id", "fault", "kind"}, ...]}``: when each call
    reached it (its headers read, before any latency or capacity queue), ``kind``
    ``send`` or ``lookup``, and the fault a send met, to measure a client's rate (every
    call counts) and pauses.
``GET /stats``
    Requests since this process started: ``sends``, ``effects`` made, ``replays``,
    ``conflicts``, ``faults`` met, ``lookups``, ``lookups_found`` (not persisted).
``GET /health``
    ``{"ok": true, "effects": N}``.

Per request, the headers ``X-Sim-Fault: KIND[;delay=S][;status=N][;retry_after=V]``,
``X-Sim-Idempotency: on|off`` and ``X-Sim-Lookup: on|off`` override the plan and the
configuration for that request only.

Fault kinds (what a send meets):

==================  =====================================================================
``slow``            waits ``delay`` seconds, then acts and answers normally
``late``            acts, then answers ``delay`` seconds later (accept, answer late)
``hang``            acts, then never answers (until the client goes away or ``delay``)
``reset``           acts, then resets the connection without an answer
``error_before``    answers ``status`` (500) without acting
``error_after``     acts, then answers ``status`` (500): the client cannot know it acted
``rate_limit``      answers 429 with ``Retry-After: retry_after`` (1) without acting
``unavailable``     answers 503 with ``Retry-After: retry_after`` (1) without acting
``unauthorized``    answers 401 without acting (``forbidden``: 403)
``bad_request``     answers 400 without acting (``unprocessable``: 422)
==================  =====================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import random
import select
import signal
import socket
import sqlite3
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

# The semantics (effects, the fault plan, what a send does) live in consumer.jobs.simulation,
# shared with outbox.testing's in-process fake provider; this module is the HTTP front end.
from consumer.jobs.simulation import (
    FAULT_KINDS,
    MAX_BODY_BYTES,
    MAX_HANG_SECONDS,
    REFUSALS,
    STAT_NAMES,
    Effects,
    Fault,
    Refusal,
    Simulator,
    SimulatorConfig,
    wait_before_acting,
)
from outbox.cli import LOGGING, Flag, Parser, add_flags, run_main
from outbox.errors import ConfigError
from outbox.logs import fields, setup_logging

if TYPE_CHECKING:
    from consumer.jobs.callbacks import CallbackSender

__all__ = ["FAULT_KINDS", "MAX_HANG_SECONDS", "REFUSALS", "STAT_NAMES", "Effects", "Fault"]
__all__ += ["Handler", "Refusal", "Simulator", "SimulatorConfig", "SimulatorServer", "main"]
__all__ += ["serve"]

log = logging.getLogger("outbox.simulator")


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
                setattr(self.sim.config, name, _seconds(name, raw[name]))
        if "capacity" in raw:
            self.server.set_capacity(_capacity(raw["capacity"]))
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


# -- command line ---------------------------------------------------------------------------


PROG = "outbox-simulator"


def build_parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="A connector simulator: an HTTP service standing in for a provider, with "
        "scriptable faults. A simulator, not a promise about real providers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve", help="serve the simulator until SIGTERM")
    add_flags(
        run,
        Flag(
            "--port",
            int,
            "port, 0 for a free one",
            default=8025,
            env="OUTBOX_SIMULATOR_PORT",
            metavar="PORT",
        ),
        Flag("--host", help="bind address", default="127.0.0.1", env="OUTBOX_SIMULATOR_HOST"),
        Flag(
            "--data",
            help="SQLite file of the effects",
            default="simulator.db",
            env="OUTBOX_SIMULATOR_DATA",
            metavar="FILE",
        ),
        Flag(
            "--no-idempotency",
            bool,
            "ignore Idempotency-Key",
            env="OUTBOX_SIMULATOR_IDEMPOTENCY",
            env_negates=True,
        ),
        Flag(
            "--no-lookup",
            bool,
            "answer every lookup 404",
            env="OUTBOX_SIMULATOR_LOOKUP",
            env_negates=True,
        ),
        Flag(
            "--latency",
            float,
            "seconds every send takes before it acts",
            default=0.0,
            env="OUTBOX_SIMULATOR_LATENCY",
            metavar="SECONDS",
        ),
        Flag(
            "--jitter",
            float,
            "the latency varies by up to this fraction either way (0.5: half)",
            default=0.0,
            env="OUTBOX_SIMULATOR_JITTER",
            metavar="FRACTION",
        ),
        Flag(
            "--capacity",
            int,
            "sends served at once, the others queue (default: no limit)",
            env="OUTBOX_SIMULATOR_CAPACITY",
            metavar="N",
        ),
        Flag(
            "--callback-url",
            help="send each effect's signed delivery callback to URL/deliveries "
            "(consumer.jobs.inbound; consumer.jobs.callbacks)",
            env="OUTBOX_SIMULATOR_CALLBACK_URL",
            metavar="URL",
        ),
        Flag(
            "--callback-secret-file",
            help="file whose first line is the callbacks' secret; OUTBOX_INBOUND_SECRET wins",
            env="OUTBOX_SIMULATOR_CALLBACK_SECRET_FILE",
            metavar="FILE",
        ),
        Flag(
            "--callback-delay",
            float,
            "seconds between an effect and its callback",
            default=0.5,
            env="OUTBOX_SIMULATOR_CALLBACK_DELAY",
            metavar="SECONDS",
        ),
        *LOGGING,
    )
    run.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, build_parser(), argv)


def _serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    port, host, data = args.port, args.host, args.data
    if not 0 <= port <= 65535:
        raise ConfigError("port", f"{port} is not a TCP port")
    config = SimulatorConfig(
        idempotency=not args.no_idempotency,
        lookup=not args.no_lookup,
        latency=_seconds("latency", args.latency),
        jitter=_seconds("jitter", args.jitter),
        capacity=_capacity(args.capacity),
    )
    try:
        server = serve(host, port, data, config)
    except OSError as exc:
        print(f"{PROG}: {_start_problem(exc, host, port)}", file=sys.stderr)
        return 1
    except sqlite3.Error as exc:
        print(f"{PROG}: cannot open the effects file {data!r}: {exc}", file=sys.stderr)
        return 1
    bound_host, bound_port = server.server_address[:2]
    if args.callback_url:
        server.callbacks = _callbacks(args)

    def _stop(signum: int, _frame: Any) -> None:
        server.simulator.stopping.set()
        # shutdown() waits for serve_forever to return: never call it from its own thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"listening on http://{bound_host!s}:{bound_port}", flush=True)
    log.info(
        "outbox-simulator serving",
        extra=fields(
            url=f"http://{bound_host!s}:{bound_port}",
            data=data,
            idempotency=config.idempotency,
            lookup=config.lookup,
        ),
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        server.simulator.effects.close()
        if server.callbacks is not None:
            server.callbacks.close()
    return 0


def _callbacks(args: argparse.Namespace) -> CallbackSender:
    from outbox.extras import require

    for extra in ("http", "inbound"):  # it sends with httpx, signs as consumer.jobs.inbound
        require(extra, "outbox-simulator --callback-url")
    from consumer.jobs.callbacks import CallbackSender, read_secret  # only with --callback-url

    secret = os.environ.get("OUTBOX_INBOUND_SECRET") or read_secret(args.callback_secret_file)
    return CallbackSender(args.callback_url, secret, delay=_seconds("delay", args.callback_delay))


def _start_problem(exc: OSError, host: str, port: int) -> str:
    """Why the simulator cannot start, in words (not ``[Errno 98] Address already in use``)."""
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: the port is in use (another simulator?); --port 0 picks a free one"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine"
    if exc.errno in (errno.EACCES, errno.EPERM) and port < 1024:
        return f"{where}: ports below 1024 need privileges; use --port 8025 or another"
    if isinstance(exc, socket.gaierror):
        return f"{where}: cannot resolve {host!r} ({exc.strerror})"
    return f"{where}: {exc.strerror or exc}"


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 3600:
        raise ConfigError(name, f"must be a number from 0 to 3600, got {value!r}")
    return float(value)


def _capacity(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("capacity", f"must be a positive integer or null, got {value!r}")
    return value


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
