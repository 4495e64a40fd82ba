"""One gate per kind of input, used by every way in (issue 53). The entry points are read
from the code, not listed here, so a route, a flag or a variable is covered the day it lands:

- every route of the console (``Console.app.routes``, the query names of its OpenAPI
  description) and of the inbound endpoint (``InboundApp.app.routes``), signed where a
  signature is needed, gets a corpus of bad paths, queries, headers and bodies: no answer is
  a 5xx (nor a 503: bad input is never an outage), on PostgreSQL and SQLite;
- every ``Flag`` declaration of every command (``[project.scripts]``' parsers) that reads a
  number refuses the bad numbers: exit 2 naming the flag on the command line, a
  ``ConfigError`` (exit 2) naming the variable from the environment;
- the public methods that store text refuse NUL and lone surrogates with the store's typed
  error naming the field, never the driver's ``DataError``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from starlette.routing import Route
from starlette.testclient import TestClient

from consumer.errors import JobError
from consumer.jobs.inbound import InboundApp, Webhook, sign
from consumer.jobs.store import Store
from outbox.cli import Exit, exit_code, run_main
from outbox.cli_flags import Flag, declared_flag
from outbox.cli_reference import installed_programs
from outbox.console.app import Console
from outbox.console.openapi import openapi
from outbox.console.schema import create_audit_table
from outbox.errors import ConfigError
from tests.console_support import World

TOKEN = "test-token-" + "c" * 20
SECRET = "s" * 32

# Text as it arrives in a path or a query (percent-encoded): a superscript and fullwidth
# digits, a sign, overflow, NUL, a lone surrogate's UTF-8 (invalid), nan, inf, huge, quoting.
RAW_TEXT = [
    "%C2%B2",
    "%EF%BC%91%EF%BC%92",
    "-1",
    "1" * 40,
    "%00",
    "a%00b",
    "%ED%A0%80",
    "nan",
    "inf",
    "x" * 5000,
    "%27%20OR%201%3D1%20--",
    "..%2F..%2Fetc",
]
# Values as a JSON body carries them (json.dumps escapes the surrogate: valid JSON text).
JSON_VALUES: list[Any] = [
    "a\x00b",
    "\ud800",
    "x\udfff",
    10**30,
    -(10**30),
    -1,
    1.5,
    "\u00b2",
    "\uff11\uff12",
    "x" * 5000,
    None,
    True,
    [],
    {"a": "\ud800"},
]
BODIES = [
    b"not json",
    b"[" * 30000 + b"]" * 30000,
    b'{"a": ' * 30000 + b"1" + b"}" * 30000,
    b"NaN",
    b'{"reason": NaN}',
    b"\xff\xfe",
    b'"\\ud800"',
]


def _query_names(path: str) -> list[str]:
    """The query names the console's OpenAPI description gives ``path`` (a page takes its
    API route's: ``/jobs`` those of ``/api/jobs``); a route it does not describe gets the
    names every list and the trace read."""
    paths = openapi()["paths"]
    described = paths.get(path) or paths.get("/api" + path)
    if described is None:
        return ["q", "cursor", "limit", "state"]
    names = {
        parameter["name"]
        for operation in described.values()
        for parameter in operation.get("parameters", [])
        if parameter["in"] == "query"
    }
    return sorted(names) or ["q"]


def _fields(path: str) -> tuple[str, ...]:
    """The body fields an action route reads: every action's, and its own."""
    if "settle" in path:
        return ("reason", "by", "accepted", "not_sent", "decision")
    if "bulk" in path:
        return ("reason", "by", "filters", "confirm")
    return ("reason", "by", "back", "csrf") if not path.startswith("/api/") else ("reason", "by")


def _routes_of(app: Any) -> list[Any]:
    """The routes of the Starlette app inside an app's middleware (the console's gate)."""
    while not hasattr(app, "routes"):
        app = app.app
    return list(app.routes)


def _fill(path: str, value: str) -> str:
    """The route's path with every ``{param}`` (also ``{param:path}``) set to ``value``."""
    out, rest = "", path
    while "{" in rest:
        head, _, tail = rest.partition("{")
        out += head + value
        rest = tail.partition("}")[2]
    return out + rest


def _server_errors(client: TestClient, requests: list[tuple[str, str, dict[str, Any]]]) -> list:
    bad = []
    for method, url, kwargs in requests:
        answer = client.request(method, url, **kwargs)
        if answer.status_code >= 500:
            bad.append(
                (method, url[:120], str(kwargs)[:120], answer.status_code, answer.text[:200])
            )
    return bad


@pytest.fixture
def world(db_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[World]:
    w = World(db_url, redis_client, stream_prefix)
    create_audit_table(w.engine)
    yield w
    w.close()


@pytest.mark.slow  # ~1,000 requests: 30-60 s on a shared 2-core machine
def test_no_console_route_answers_bad_input_with_a_server_error(world: World) -> None:
    console = Console(world.engine, world.client, TOKEN)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    json_bearer = {**bearer, "Content-Type": "application/json"}
    routes = [r for r in _routes_of(console.app) if isinstance(r, Route)]
    assert len(routes) > 40  # read from the app: a new route is in this list
    requests: list[tuple[str, str, dict[str, Any]]] = []
    for route in routes:
        for method in sorted((route.methods or {"GET"}) - {"HEAD"}):
            targets = [_fill(route.path, raw) for raw in RAW_TEXT] if "{" in route.path else []
            base = _fill(route.path, "1")
            if method == "GET":
                for url in targets:
                    requests.append((method, url, {"headers": bearer}))
                for name in _query_names(route.path):
                    for raw in RAW_TEXT:
                        requests.append((method, f"{base}?{name}={raw}", {"headers": bearer}))
                continue
            for url in targets:
                body = json.dumps({"reason": "corpus"})
                requests.append((method, url, {"headers": json_bearer, "content": body}))
            for value in JSON_VALUES:
                for field in _fields(route.path):
                    body = json.dumps({"reason": "corpus", field: value})
                    requests.append((method, base, {"headers": json_bearer, "content": body}))
            for raw_body in BODIES:
                requests.append((method, base, {"headers": json_bearer, "content": raw_body}))
            requests.append(
                (method, base, {"headers": {**bearer, "Content-Length": b"\xb2"}, "content": b"{}"})
            )
    with TestClient(console.app, raise_server_exceptions=False) as client:
        assert _server_errors(client, requests) == []


def test_no_inbound_route_answers_bad_input_with_a_server_error(world: World) -> None:
    store = Store(world.engine)
    hook = Webhook(verify=lambda headers, body: True)
    inbound = InboundApp(store, SECRET, webhooks={"mail": hook})
    routes = [r for r in inbound.app.routes if isinstance(r, Route)]
    requests: list[tuple[str, str, dict[str, Any]]] = []
    fields = ("job", "reply_id", "payload", "source", "operation_id", "status", "event_id")
    for route in routes:
        path = _fill(route.path, "mail")
        for method in sorted((route.methods or {"GET"}) - {"HEAD"}):
            if method == "GET":
                requests += [(method, _fill(route.path, raw), {}) for raw in RAW_TEXT]
                continue
            bodies = list(BODIES)
            for value in JSON_VALUES:
                for field in (*fields, "ref", "detail"):
                    good = {"job": 1, "reply_id": "r-1", "payload": {}, "source": "corpus"}
                    if "deliveries" in path or "webhooks" in path:
                        good = {"operation_id": "1:mail", "status": "bounced", "event_id": "e"}
                    bodies.append(json.dumps({**good, field: value}).encode())
            for body in bodies:  # signed: past authentication, into the work
                requests.append((method, path, {"content": body, "headers": sign(SECRET, body)}))
            # Header bytes: a latin-1 superscript two (read as "\u00b2", which isdigit() passes),
            # fullwidth digits in UTF-8, a sign, overflow, nan, empty, an exponent.
            stamps = [b"\xb2", "\uff11\uff12\uff13".encode(), b"-1", b"9" * 30, b"nan", b"", b"1e9"]
            for stamp in stamps:
                headers = {**sign(SECRET, b"{}"), "X-Outbox-Timestamp": stamp}
                requests.append((method, path, {"content": b"{}", "headers": headers}))
            requests.append(
                (method, path, {"content": b"{}", "headers": {"Content-Length": b"\xb2"}})
            )
    with TestClient(inbound, raise_server_exceptions=False) as client:
        assert _server_errors(client, requests) == []
    store.dispose()


def test_the_inbound_findings_are_4xx(world: World) -> None:
    """The issue's own cases, each with its answer: refused before or after authentication,
    never a 500 or a 503 with Retry-After (a sender would retry for ever)."""
    store = Store(world.engine)
    job = store.enqueue("studio", "send-1").job_id
    inbound = InboundApp(store, SECRET)

    def post(path: str, body: bytes, **headers: str) -> int:
        with TestClient(inbound, raise_server_exceptions=False) as client:
            return client.post(
                path, content=body, headers={**sign(SECRET, body), **headers}
            ).status_code

    assert post("/replies", b"{}", **{"X-Outbox-Timestamp": b"\xb2"}) == 401  # type: ignore[arg-type]
    deep = b"[" * 30000 + b"]" * 30000
    assert post("/replies", deep) == 400
    detail = json.dumps(
        {"operation_id": "1:m", "status": "bounced", "event_id": "e", "detail": "\ud800"}
    )
    assert post("/deliveries", detail.encode()) == 400
    reply = {"job": job, "reply_id": "r", "payload": {}}
    assert post("/replies", json.dumps({**reply, "job": 10**30}).encode()) == 400
    assert post("/replies", json.dumps({**reply, "payload": "\ud800"}).encode()) == 400
    assert post("/replies", json.dumps({**reply, "payload": "a\x00b"}).encode()) == 400
    assert post("/replies", json.dumps(reply).encode()) == 200
    store.dispose()


def test_methods_that_store_text_raise_the_typed_error(world: World) -> None:
    store = world.store
    for payload in ({"a": "\ud800"}, {"a": "x\x00"}, ["\udfff"], {"\ud800": 1}):
        with pytest.raises(JobError) as info:
            store.enqueue("studio", "send-bad", payload=payload)
        assert info.value.field == "payload"
    job = store.enqueue("studio", "send-2").job_id
    with pytest.raises(JobError) as info:
        store.reply(job, payload={"a": "\ud800"}, reply_id="r-1")
    assert info.value.field == "payload"
    with pytest.raises(JobError) as info:
        store.reply(job, payload={}, reply_id="r\ud800")
    assert info.value.field == "reply_id"
    assert store.reply(job, payload={"a": "fine"}, reply_id="r-1").duplicate is False


# -- the command lines and their variables ------------------------------------------------------

BAD_NUMBERS = [
    "-1",
    "nan",
    "inf",
    "-inf",
    "NaN",
    "1e400",
    "\uff11\uff12",
    "\u00b2",
    "1_000",
    "0x10",
    "9" * 40,
]


def _commands() -> list[tuple[str, argparse.ArgumentParser, tuple[str, ...], Flag]]:
    """Every declared flag of every command, with the subcommand path that has it."""
    found = []

    def walk(
        prog: str,
        root: argparse.ArgumentParser,
        parser: argparse.ArgumentParser,
        path: tuple[str, ...],
    ) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(prog, root, sub, (*path, name))
            flag = declared_flag(action)
            if flag is not None:
                found.append((prog, root, path, flag))

    for prog, parser in installed_programs():
        walk(prog, parser, parser, ())
    return found


COMMANDS = _commands()
NUMERIC = [c for c in COMMANDS if c[3].parser.__name__ in ("whole_number", "finite_number", "port")]


def test_every_number_flag_goes_through_the_gate() -> None:
    assert len(NUMERIC) > 50  # read from the parsers: a new flag is in this list
    for prog, _, path, flag in COMMANDS:
        # A flag declared with int or float reads through the strict gate, never int()/float().
        assert flag.parser not in (int, float), (prog, path, flag.name)


@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_a_bad_number_is_exit_2_naming_the_flag(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for prog, parser, path, flag in NUMERIC:
        argv = [*path, f"{flag.name}={bad}"]
        assert run_main(prog, parser, argv) == Exit.USAGE, (prog, argv)
        err = capsys.readouterr().err
        assert flag.name in err and "Traceback" not in err, (prog, argv, err)
        if flag.env_var:
            with pytest.raises(ConfigError) as info:
                flag.resolve({flag.env_var: bad})
            assert flag.env_var in str(info.value)
            assert exit_code(info.value) == Exit.USAGE
