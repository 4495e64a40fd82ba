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
import errno
import logging
import os
import signal
import socket
import sqlite3
import sys
import threading
from typing import TYPE_CHECKING, Any

# The semantics (effects, the fault plan, what a send does) live in consumer.jobs.simulation,
# shared with outbox.testing's in-process fake provider; the HTTP server is
# consumer.jobs.simulator_server; this module is the command line (names of both re-exported).
from consumer.jobs.simulation import (
    FAULT_KINDS,
    MAX_HANG_SECONDS,
    REFUSALS,
    STAT_NAMES,
    Effects,
    Fault,
    Refusal,
    Simulator,
    SimulatorConfig,
)
from consumer.jobs.simulator_server import (
    Handler,
    SimulatorServer,
    capacity_setting,
    seconds_setting,
    serve,
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
        latency=seconds_setting("latency", args.latency),
        jitter=seconds_setting("jitter", args.jitter),
        capacity=capacity_setting(args.capacity),
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
    return CallbackSender(
        args.callback_url, secret, delay=seconds_setting("delay", args.callback_delay)
    )


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
