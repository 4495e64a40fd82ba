"""``outbox-console``: the operator console, and one identity's story in a terminal.

```
outbox-console serve [--host 127.0.0.1] [--port 8780] [--read-only] [--token-file FILE]
                     [--database-url URL] [--redis-url URL] [--redis-cluster]
outbox-console trace QUERY [--json] [--database-url URL] [--redis-url URL] [--redis-cluster]
outbox-console init-db [--database-url URL]
```

``serve`` needs a token: ``OUTBOX_CONSOLE_TOKEN``, else the first line of ``--token-file``,
else one generated now and printed once with its login URL (as Jupyter does). It creates the
audit table if missing and warns when the lookup indexes are (``init-db`` creates both).
Binding another address than 127.0.0.1 logs a warning: the token is then the only
protection. ``trace`` prints the story and exits 0 when something was found, 1 when not.

Every flag defaults to an environment variable: ``OUTBOX_DATABASE_URL``, ``OUTBOX_REDIS_URL``,
``OUTBOX_REDIS_CLUSTER=1``, ``OUTBOX_CONSOLE_HOST``, ``OUTBOX_CONSOLE_PORT``,
``OUTBOX_CONSOLE_READ_ONLY=1``, ``OUTBOX_CONSOLE_TOKEN_FILE``, ``OUTBOX_LOG_LEVEL``. With no
database URL, the SQLite file in the working directory; with no Redis URL, the embedded
server. Exit codes: 0 success, 1 failure (or not found), 2 bad usage, 130 interrupted. The
flags are declared with :mod:`outbox.cli`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from outbox.cli import DATABASE, LOGGING, REDIS, Flag, Parser, add_flags, port, run_main
from outbox.db import default_database_url, describe_url, make_engine
from outbox.errors import ConfigError
from outbox.extras import require
from outbox.logs import fields, setup_logging
from outbox.nats_client import broker_kind
from outbox.redis_client import is_cluster_url, redis_client

log = logging.getLogger("outbox.console")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8780


@dataclass(frozen=True)
class ServeConfig:
    """What ``serve`` runs with, validated at construction (``ConfigError`` names the field)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    read_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError("host", "must be a non-empty address")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ConfigError("port", f"must be an integer, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be from 0 to 65535, got {self.port}")


PROG = "outbox-console"


def _host_list(raw: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    if not names:
        raise ValueError("give at least one name")
    for name in names:
        if any(c.isspace() or c in "/@?#" for c in name):
            raise ValueError(f"{name!r} is not a host name or address")
    return names


def allowed_hosts(bind: str, given: tuple[str, ...] | None) -> tuple[str, ...]:
    """The Host names ``serve`` accepts: the given ones, else this machine's loopback names
    and the bind address (a wildcard bind address needs ``--allowed-hosts``)."""
    if given:
        return given
    names = ("localhost", "127.0.0.1", "::1")
    return names if bind in ("0.0.0.0", "::", "", *names) else (*names, bind)


class TokenFile:
    """The token in a file, re-read when the file changes (its mtime and size)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[float, int] | None = None
        self._token = ""

    def __call__(self) -> str:
        stat = os.stat(self.path)
        seen = (stat.st_mtime, stat.st_size)
        if seen != self._seen:
            token = read_token_file(self.path)
            self._seen, self._token = seen, token
        return self._token


def read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.readline().strip()
    except OSError as exc:
        raise ConfigError("token_file", f"cannot read {path!r}: {exc.strerror}") from None
    if len(token) < 16:
        raise ConfigError("token_file", f"{path!r}: the token needs 16 characters or more")
    return token


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="The operator console of the outbox toolkit.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the web console and its JSON API")
    add_flags(
        serve,
        Flag("--host", help="bind address", default=DEFAULT_HOST, env="OUTBOX_CONSOLE_HOST"),
        Flag("--port", port, "port", default=DEFAULT_PORT, env="OUTBOX_CONSOLE_PORT"),
        Flag(
            "--read-only",
            bool,
            "refuse every action with 403",
            env="OUTBOX_CONSOLE_READ_ONLY",
        ),
        Flag(
            "--token-file",
            help="file whose first line is the token, re-read when it changes (every session "
            "ends); OUTBOX_CONSOLE_TOKEN wins over it",
            env="OUTBOX_CONSOLE_TOKEN_FILE",
            metavar="FILE",
        ),
        Flag(
            "--allowed-hosts",
            _host_list,
            "names the Host header may carry, comma-separated (other names get 400); "
            "'*' allows any",
            env="OUTBOX_CONSOLE_ALLOWED_HOSTS",
            shown_default="localhost, 127.0.0.1, ::1 and --host",
            metavar="NAMES",
        ),
        Flag(
            "--secure-cookies",
            bool,
            "mark the session cookie Secure: TLS is terminated in front of the console",
            env="OUTBOX_CONSOLE_SECURE_COOKIES",
        ),
        Flag(
            "--trusted-proxies",
            _host_list,
            "addresses of the reverse proxies whose X-Forwarded-Proto and X-Forwarded-For "
            "are believed, comma-separated",
            env="OUTBOX_CONSOLE_TRUSTED_PROXIES",
            metavar="ADDRESSES",
        ),
    )
    serve.set_defaults(func=_serve)
    trace = sub.add_parser("trace", help="one identity's story, from commit to receipt")
    trace.add_argument("query", help="identity, event key, event id, job id or operation id")
    add_flags(trace, Flag("--json", bool, "the trace as one JSON object", env=None))
    trace.set_defaults(func=_trace)
    init = sub.add_parser("init-db", help="create the audit table and the lookup indexes")
    init.set_defaults(func=lambda args, url: _init_db(url))
    for p in (serve, trace, init):
        add_flags(p, *DATABASE, *LOGGING)
    for p in (serve, trace):
        add_flags(p, *REDIS)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, build_parser(), argv, command=_command)


def _command(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    url = args.database_url or default_database_url()
    return int(args.func(args, url))


def _redis(args: argparse.Namespace) -> Any:
    redis_url = args.redis_url
    if broker_kind(redis_url) == "nats":
        from outbox.console.nats_view import NatsConsoleView

        return NatsConsoleView(redis_url)
    cluster = bool(args.redis_cluster) or is_cluster_url(redis_url)
    if cluster:
        return redis_client(redis_url, cluster=True)
    return redis_client(redis_url)


def _redis_description(args: argparse.Namespace) -> str:
    redis_url = args.redis_url
    return "embedded" if redis_url is None else describe_url(redis_url)


def _init_db(url: str) -> int:
    from outbox.console.schema import create_audit_table, create_lookup_indexes

    engine = make_engine(url)
    try:
        create_audit_table(engine)
        made = create_lookup_indexes(engine)
    finally:
        engine.dispose()
    log.info(
        "console tables ready",
        extra=fields(database=describe_url(url), lookup_indexes_created=len(made)),
    )
    return 0


def _token(args: argparse.Namespace) -> tuple[str, bool]:
    """The token and whether it was generated now."""
    from outbox.console.auth import generate_token

    given = os.environ.get("OUTBOX_CONSOLE_TOKEN")
    if given:
        return given.strip(), False
    path = args.token_file
    if path:
        return read_token_file(path), False
    return generate_token(), True


def _serve(args: argparse.Namespace, url: str) -> int:
    require("console", "outbox-console serve")
    import uvicorn

    from outbox.console.app import Console
    from outbox.console.schema import create_audit_table, missing_lookup_indexes

    config = ServeConfig(host=args.host, port=args.port, read_only=bool(args.read_only))
    token, generated = _token(args)
    if len(token) < 16:
        raise ConfigError("OUTBOX_CONSOLE_TOKEN", "the token needs 16 characters or more")
    engine = make_engine(url)
    redis = _redis(args)
    try:
        create_audit_table(engine)
        missing = missing_lookup_indexes(engine)
        if missing:
            log.warning(
                "lookup indexes missing: lists with filters and traces scan their tables "
                "(outbox-console init-db creates them)",
                extra=fields(missing=",".join(missing)),
            )
        if config.host != DEFAULT_HOST:
            log.warning(
                "the console listens beyond this machine: the token is the only protection",
                extra=fields(host=config.host),
            )
        from_file = not os.environ.get("OUTBOX_CONSOLE_TOKEN") and args.token_file
        console = Console(
            engine,
            redis,
            TokenFile(args.token_file) if from_file else token,
            read_only=config.read_only,
            describe={"database": describe_url(url), "redis": _redis_description(args)},
            allowed_hosts=allowed_hosts(config.host, args.allowed_hosts),
            secure_cookies=bool(args.secure_cookies),
            trusted_proxies=args.trusted_proxies or (),
        )
        shown = f"[{config.host}]" if ":" in config.host else config.host
        if generated:
            print(
                f"outbox-console: sign in at http://{shown}:{config.port}/login?token={token}",
                flush=True,
            )
        else:
            print(f"outbox-console: serving http://{shown}:{config.port}/", flush=True)
        log.info(
            "outbox-console serving",
            extra=fields(
                host=config.host,
                port=config.port,
                read_only=config.read_only,
                database=describe_url(url),
            ),
        )
        # uvicorn drains on SIGTERM/SIGINT, then raises the signal again under the handler it
        # found at start: with these no-op handlers that second delivery does nothing, and a
        # drained console exits 0 (DESIGN: SIGTERM drains, exit 0).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        # proxy_headers=False: uvicorn would take X-Forwarded-For from 127.0.0.1 as the client
        # (a forged address in the throttle and the audit); the console's door honours it
        # from --trusted-proxies only.
        uvicorn.run(
            console.app,
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
        )
        return 0
    finally:
        engine.dispose()
        close = getattr(redis, "close", None)
        if callable(close):
            close()


def _trace(args: argparse.Namespace, url: str) -> int:
    from outbox.console.queries import Tables, present_tables
    from outbox.console.render import print_trace
    from outbox.console.trace import collect

    engine = make_engine(url)
    redis = _redis(args)
    try:
        tables = Tables.build()
        with engine.connect() as conn:
            trace = collect(conn, tables, args.query, present_tables(engine, tables), redis)
        if args.json:
            print(json.dumps(trace.as_dict(), indent=2, default=str))
        else:
            print_trace(trace, sys.stdout)
        return 0 if trace.found else 1
    finally:
        engine.dispose()
        close = getattr(redis, "close", None)
        if callable(close):
            close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
