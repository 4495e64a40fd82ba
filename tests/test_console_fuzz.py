"""The console's JSON API fuzzed from its own OpenAPI description (``GET /api/openapi.json``)
with schemathesis (issue 41): for every operation, generated paths, queries and bodies,
with the token and without, must be answered 2xx or 4xx, never 5xx, and the description
must name every API route. Bounded: MAX_EXAMPLES per operation, derandomized (the same
cases every run), on SQLite with a small world, so the file takes seconds, not minutes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from starlette.routing import Route
from starlette.testclient import TestClient

from outbox.console.app import Console
from outbox.console.schema import create_audit_table
from tests.console_support import World

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow

TOKEN = "fuzz-token-" + "x" * 20
MAX_EXAMPLES = {"bearer": 20, "anonymous": 5}
"""Examples per operation (the anonymous run checks only that nothing gets in or breaks)."""


@pytest.fixture
def console(sqlite_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[Console]:
    world = World(sqlite_url, redis_client, stream_prefix)
    create_audit_table(world.engine)
    world.through_consumer(1)
    world.dead_letter(2)
    world.send(1, outcome="timeout")  # a job in review with an UNKNOWN receipt
    yield Console(world.engine, world.client, TOKEN)
    world.close()


def test_the_description_names_every_api_route(console: Console) -> None:
    with TestClient(console.app) as api:
        described = set(api.get("/api/openapi.json").json()["paths"])
    app = console.app.app  # under the gate
    routes = {
        r.path.replace("{target:path}", "{}").replace("{target}", "{}").replace("{kind}", "{}")
        for r in app.routes
        if isinstance(r, Route) and r.path.startswith("/api/") and r.path != "/api/openapi.json"
    }
    normal = {p.split("{")[0] + "{}" + p.split("}")[1] if "{" in p else p for p in described}
    assert routes == normal


@pytest.mark.parametrize("who", ["bearer", "anonymous"])
def test_no_generated_request_is_a_server_error(console: Console, who: str) -> None:
    token = who == "bearer"
    schema = schemathesis.openapi.from_asgi("/api/openapi.json", console.app)
    headers = {"Authorization": f"Bearer {TOKEN}"} if token else {}
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES[who],
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            response = case.call(headers=headers)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}")
            assert response.status_code < 500
            if not token:
                # 429: generated wrong tokens are throttled like any others
                assert response.status_code in (400, 401, 404, 405, 413, 429), case.formatted_path

        run()
    assert not failures, failures
