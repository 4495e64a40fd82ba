"""The inbound endpoint fuzzed from its own OpenAPI description (``GET /openapi.json``) with
schemathesis (issue 53: "schemathesis runs in CI on both HTTP apps, bounded"), as the
console's API is (``tests/test_console_fuzz.py``).

Generated requests go through a signing proxy, an ASGI wrapper that signs each body as a
sender would (with the shared secret, or a tenant's with ``X-Outbox-Tenant``), so they get
past authentication into the work: every answer must be a 2xx or a 4xx, never a 5xx, and
never a 503, which a sender would retry for ever. Unsigned, every answer to a signed route
is a 401 (or a 4xx for a body that is too large). The description must name every route.

Bounded: MAX_EXAMPLES per operation and way in, derandomized (the same cases every run),
on SQLite with a few jobs, so the file takes seconds; it runs with the slow tier (CI)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from consumer.jobs.inbound import InboundApp, Webhook, sign
from consumer.jobs.inbound_scope import TENANT_HEADER
from consumer.jobs.store import Store

pytestmark = pytest.mark.slow

SECRET = "fuzz-shared-secret-0123456789"
TENANT_SECRET = "fuzz-studio-secret-0123456789"
MAX_EXAMPLES = {"shared": 25, "tenant": 15, "unsigned": 5}


class Signer:
    """An ASGI wrapper that signs each request's whole body (``how``: shared, tenant, or
    unsigned), then hands it to ``app`` as read."""

    def __init__(self, app: Any, how: str) -> None:
        self.app, self.how = app, how

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.how == "unsigned":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        secret = SECRET if self.how == "shared" else TENANT_SECRET
        signed = sign(secret, body)
        if self.how == "tenant":
            signed[TENANT_HEADER] = "studio"
        names = {k.lower() for k in signed}
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in names]
        headers += [(k.lower().encode(), v.encode()) for k, v in signed.items()]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)


@pytest.fixture
def inbound(sqlite_url: str) -> Iterator[InboundApp]:
    store = Store(sqlite_url)
    for n in range(1, 4):
        store.enqueue("studio", f"send-quote-{n}")
    store.enqueue("gallery", "send-quote-1")
    hook = Webhook(verify=lambda headers, body: True)
    yield InboundApp(
        store, SECRET, tenant_secrets={"studio": TENANT_SECRET}, webhooks={"mail": hook}
    )
    store.dispose()


def test_the_description_names_every_inbound_route(inbound: InboundApp) -> None:
    with TestClient(inbound) as client:
        described = set(client.get("/openapi.json").json()["paths"])
    routes = {r.path for r in inbound.app.routes if isinstance(r, Route)} - {"/openapi.json"}
    assert routes == described


@pytest.mark.parametrize("how", ["shared", "tenant", "unsigned"])
def test_no_generated_inbound_request_is_a_server_error(inbound: InboundApp, how: str) -> None:
    app = Signer(inbound, how)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    answered: set[int] = set()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 4
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES[how],
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            response = case.call()
            answered.add(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}")
            if how == "unsigned" and case.method == "POST" and "webhooks" not in case.path:
                assert response.status_code in (401, 413), case.formatted_path

        run()
    assert not failures, failures
    if how != "unsigned":
        # Past authentication: the work answered, accepting some input and refusing some.
        assert answered & {200, 202} and answered & {400, 404}, answered
