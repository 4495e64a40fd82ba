"""Inbound secrets per tenant (issue 53: "one inbound secret for every tenant: a signed reply
by job id reaches another tenant's job"), on PostgreSQL and SQLite.

- A request signed with tenant A's secret and naming A in ``X-Outbox-Tenant`` reaches A's
  jobs and operations; the same request aimed at B's job (by id or by ``{tenant, action}``)
  or B's operation is a 404 that says no more than a job that does not exist, and changes
  nothing.
- A's secret does not sign for B (401), nor does it sign an unscoped request; the shared
  secret still signs unscoped requests.
- Rotation: each of a tenant's secrets verifies; one dropped no longer does.
- ``outbox-worker inbound serve --tenant-secrets FILE`` takes them as a real process, and a
  file that is not a JSON object of secrets is exit 2 naming the flag.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from consumer.jobs.context import JobContext
from consumer.jobs.inbound import InboundApp, sign
from consumer.jobs.inbound_scope import TENANT_HEADER
from consumer.jobs.operations import Operations
from consumer.jobs.states import READY, WAITING_EXTERNAL
from consumer.jobs.store import Store
from outbox.errors import ConfigError
from outbox.testing import FakeProvider
from tests.services import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
SHARED = "the-operators-shared-secret"
STUDIO = ["studio-secret-new-0123456789", "studio-secret-old-0123456789"]
GALLERY = "gallery-secret-0123456789"


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def _app(store: Store, studio: list[str] = STUDIO) -> TestClient:
    tenants = {"studio": studio, "gallery": GALLERY}
    return TestClient(InboundApp(store, SHARED, tenant_secrets=tenants))


def post(
    client: TestClient, path: str, data: Any, secret: str, tenant: str | None = None
) -> httpx.Response:
    body = json.dumps(data).encode()
    headers = {"Content-Type": "application/json", **sign(secret, body)}
    if tenant is not None:
        headers[TENANT_HEADER] = tenant
    return client.post(path, content=body, headers=headers)


def waiting(store: Store, tenant: str, action: str) -> int:
    job = store.enqueue(tenant, action).job_id
    lease = store.claim_next("w")
    assert lease is not None and lease.job_id == job
    JobContext(store, lease).wait_external("the customer", until=10**10)
    return job


def test_a_tenants_secret_reaches_its_jobs_only(store: Store) -> None:
    ours = waiting(store, "studio", "send-quote-1")
    theirs = waiting(store, "gallery", "send-quote-1")
    with _app(store) as client:
        reply = {"reply_id": "r1", "payload": "yes"}
        for job in (theirs, {"tenant": "gallery", "action": "send-quote-1"}, 10**12):
            refused = post(client, "/replies", {**reply, "job": job}, STUDIO[0], "studio")
            assert (refused.status_code, refused.json()) == (404, {"error": "no such job"})
        assert store.get(theirs).state == WAITING_EXTERNAL  # nothing reached it
        for n, secret in enumerate(STUDIO):  # a rotation: both verify
            answer = post(
                client, "/replies", {**reply, "job": ours, "reply_id": f"r{n}"}, secret, "studio"
            )
            assert answer.status_code == 200, answer.text
        assert store.get(ours).state == READY
        by_name = {"tenant": "studio", "action": "send-quote-9"}  # not enqueued yet: kept
        kept = post(client, "/replies", {**reply, "job": by_name}, STUDIO[0], "studio")
        assert kept.status_code == 202 and kept.json()["kept"] is True
        # The gallery's own secret reaches the gallery's job; the shared one, unscoped, too.
        mine = post(client, "/replies", {**reply, "job": theirs}, GALLERY, "gallery")
        assert mine.status_code == 200, mine.text


def test_a_secret_signs_for_its_own_tenant_only(store: Store) -> None:
    job = waiting(store, "gallery", "send-quote-2")
    data = {"job": job, "reply_id": "r1", "payload": "yes"}
    with _app(store) as client:
        assert post(client, "/replies", data, STUDIO[0], "gallery").status_code == 401
        assert post(client, "/replies", data, STUDIO[0]).status_code == 401  # unscoped
        assert post(client, "/replies", data, STUDIO[0], "nobody").status_code == 401
        assert post(client, "/replies", data, SHARED, "gallery").status_code == 401
        assert store.get(job).state == WAITING_EXTERNAL
        assert post(client, "/replies", data, SHARED).status_code == 200  # the operator's
    with _app(store, studio=STUDIO[:1]) as rotated:  # the old secret dropped
        other = waiting(store, "studio", "send-quote-3")
        old = post(rotated, "/replies", {**data, "job": other}, STUDIO[1], "studio")
        assert old.status_code == 401


def test_a_delivery_callback_reaches_its_tenants_operations_only(store: Store) -> None:
    mail = FakeProvider("mail")
    try:
        ops = Operations(store, {"mail": mail})
        store.enqueue("gallery", "send-quote-4")
        lease = store.claim_next("w")
        assert lease is not None
        op = JobContext(store, lease, ops).dispatch("email", "mail", {"to": "a"}).operation_id
        bounce = {"operation_id": op, "status": "bounced", "event_id": "e1"}
        with _app(store) as client:
            for target in (op, "999999999:email", "not-a-job:email"):
                refused = post(
                    client, "/deliveries", {**bounce, "operation_id": target}, STUDIO[0], "studio"
                )
                assert (refused.status_code, refused.json()) == (404, {"error": "no such job"})
            receipt = ops.receipt(op)
            assert receipt is not None and receipt.delivery_status is None
            mine = post(client, "/deliveries", bounce, GALLERY, "gallery")
            assert mine.status_code == 200 and mine.json()["delivery_status"] == "bounced"
    finally:
        mail.close()


@pytest.mark.parametrize(
    "tenants",
    [{"studio": "short"}, {"studio": []}, {"": GALLERY}, {"a\x00b": GALLERY}, {"s": [GALLERY, 7]}],
)
def test_bad_tenant_secrets_are_a_config_error(store: Store, tenants: Any) -> None:
    with pytest.raises(ConfigError):
        InboundApp(store, None, tenant_secrets=tenants)


def test_no_secret_at_all_is_a_config_error(store: Store) -> None:
    with pytest.raises(ConfigError, match="tenant_secrets"):
        InboundApp(store, None)


@pytest.mark.slow  # a server process
def test_inbound_serve_takes_tenant_secrets(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    secrets = tmp_path / "tenants.json"
    secrets.write_text(json.dumps({"studio": STUDIO, "gallery": GALLERY}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    command = [sys.executable, "-m", "consumer.jobs.cli", "inbound", "serve", "--port", str(port)]
    command += ["--database-url", db_url, "--tenant-secrets", str(secrets)]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        ours = waiting(store, "studio", "send-quote-5")
        theirs = waiting(store, "gallery", "send-quote-5")
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(base), "the inbound endpoint", 60)

        def send(job: int) -> int:
            body = json.dumps({"job": job, "reply_id": "r1", "payload": 1}).encode()
            headers = {**sign(STUDIO[1], body), TENANT_HEADER: "studio"}
            return httpx.post(f"{base}/replies", content=body, headers=headers).status_code

        assert send(theirs) == 404 and send(ours) == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        store.dispose()
    assert proc.returncode == 0, output
    bad = tmp_path / "bad.json"
    bad.write_text('["not", "an", "object"]')
    command[-1] = str(bad)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--tenant-secrets" in done.stderr, done.stderr


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
