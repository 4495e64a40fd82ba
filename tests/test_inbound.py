"""The signed inbound endpoint (issue 38), on PostgreSQL and SQLite: good, bad, stale and
replayed signatures, an oversized body, a provider's own webhook scheme, and
``outbox-worker inbound serve`` as a real process (a signed reply, then SIGTERM: exit 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from consumer.jobs.context import JobContext
from consumer.jobs.http import HttpProvider
from consumer.jobs.inbound import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    InboundApp,
    Webhook,
    sign,
)
from consumer.jobs.operations import Operations
from consumer.jobs.states import READY, WAITING_EXTERNAL
from consumer.jobs.store import Store
from outbox.testing import FakeProvider
from tests.services import free_port, wait_for
from tests.simulator_support import SimulatorProcess

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow

SECRET = "s3cret-shared-with-the-sender"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


@pytest.fixture
def client(store: Store) -> Iterator[TestClient]:
    app = InboundApp(store, [SECRET, "the-previous-secret-still-valid"], max_body=4096)
    with TestClient(app) as c:
        yield c


def post(
    client: TestClient, path: str, data: Any, *, secret: str = SECRET, at: float | None = None
) -> httpx.Response:
    body = json.dumps(data).encode()
    headers = {"Content-Type": "application/json", **sign(secret, body, timestamp=at)}
    return client.post(path, content=body, headers=headers)


def waiting_job(store: Store) -> int:
    job = store.enqueue("studio", "send-quote-17").job_id
    lease = store.claim_next("w")
    assert lease is not None
    JobContext(store, lease).wait_external("the customer", until=10**10)
    return job


def test_a_signed_reply_wakes_the_job_and_a_replay_changes_nothing(
    client: TestClient, store: Store
) -> None:
    job = waiting_job(store)
    reply = {"job": job, "reply_id": "mail-1", "payload": {"answer": "accepted"}, "source": "mail"}
    first = post(client, "/replies", reply)
    assert first.status_code == 200, first.text
    assert first.json() == {
        "job_id": job,
        "reply_id": "mail-1",
        "duplicate": False,
        "resumed": True,
        "state": READY,
        "kept": False,
    }
    body = json.dumps(reply).encode()
    headers = sign(SECRET, body)
    replayed = [client.post("/replies", content=body, headers=headers) for _ in range(2)]
    assert [r.json()["duplicate"] for r in replayed] == [True, True]  # idempotent on reply_id
    assert len(store.replies(job)) == 1
    by_identity = {"job": {"tenant": "studio", "action": "send-quote-17"}, "reply_id": "m2"}
    assert post(client, "/replies", {**by_identity, "payload": None}).status_code == 200
    assert post(client, "/replies", reply, secret="the-previous-secret-still-valid").json()[
        "duplicate"
    ]


def test_bad_and_stale_signatures_get_401_without_a_reason(
    client: TestClient, store: Store
) -> None:
    job = waiting_job(store)
    reply = {"job": job, "reply_id": "r1", "payload": "accepted"}
    body = json.dumps(reply).encode()
    good = sign(SECRET, body)
    refused = [
        post(client, "/replies", reply, secret="not-the-secret-at-all!!"),  # bad key
        post(client, "/replies", reply, at=time.time() - 301),  # stale: a replay
        post(client, "/replies", reply, at=time.time() + 301),  # from the future
        client.post("/replies", content=body),  # unsigned
        client.post("/replies", content=body + b" ", headers=good),  # body changed
        client.post("/replies", content=body, headers={**good, SIGNATURE_HEADER: "v1=" + "0" * 64}),
        client.post("/replies", content=body, headers={**good, TIMESTAMP_HEADER: "soon"}),
        post(client, "/deliveries", {"operation_id": "1:x"}, secret="not-the-secret-at-all!!"),
    ]
    assert [r.status_code for r in refused] == [401] * len(refused)
    assert {r.text for r in refused} == {'{"error":"unauthorized"}'}  # never why
    assert store.get(job).state == WAITING_EXTERNAL and store.replies(job) == []
    assert post(client, "/replies", reply, at=time.time() - 290).status_code == 200


def test_an_oversized_body_is_refused_before_it_is_read(client: TestClient, store: Store) -> None:
    job = waiting_job(store)
    big = {"job": job, "reply_id": "r1", "payload": "x" * 5000}
    assert post(client, "/replies", big).status_code == 413

    def chunks() -> Iterator[bytes]:  # no declared length: counted while streaming
        for _ in range(10):
            yield b"x" * 1000

    assert client.post("/replies", content=chunks(), headers=sign(SECRET, b"")).status_code == 413
    assert store.replies(job) == []


def test_authenticated_bad_input_names_the_field(client: TestClient, store: Store) -> None:
    job = waiting_job(store)
    cases: list[tuple[Any, int, str | None]] = [
        ({"job": job, "payload": 1}, 400, "reply_id"),
        ({"job": "seventeen", "reply_id": "r", "payload": 1}, 400, "job"),
        ({"job": job, "reply_id": "r"}, 400, "payload"),
        ([1, 2], 400, "body"),
        ({"job": 10**9, "reply_id": "r", "payload": 1}, 404, None),
    ]
    for data, status, field in cases:
        answer = post(client, "/replies", data)
        assert answer.status_code == status, (data, answer.text)
        assert answer.json().get("field") == field
    not_json = b"{nope"
    assert (
        client.post("/replies", content=not_json, headers=sign(SECRET, not_json)).json()["field"]
        == "body"
    )
    assert client.get("/healthz").json() == {"ok": True}
    assert client.get("/replies").status_code == 405


def test_delivery_callbacks_out_of_order_and_twice(client: TestClient, store: Store) -> None:
    mail = FakeProvider("mail")
    try:
        ops = Operations(store, {"mail": mail})
        store.enqueue("studio", "send-quote-17")
        lease = store.claim_next("w")
        assert lease is not None
        op = JobContext(store, lease, ops).dispatch("email", "mail", {"to": "a"}).operation_id
        opened = {"operation_id": op, "status": "opened", "event_id": "e2"}
        delivered = {"operation_id": op, "status": "delivered", "event_id": "e1", "ref": "m-1"}
        answers = [post(client, "/deliveries", x).json() for x in (opened, delivered, opened)]
        assert [a["duplicate"] for a in answers] == [False, False, True]
        assert [a["delivery_status"] for a in answers] == ["opened", "opened", "opened"]
        receipt = ops.receipt(op)
        assert receipt is not None and receipt.delivery_status == "opened"
        bad = post(client, "/deliveries", {**opened, "status": "lost", "event_id": "e3"})
        assert (bad.status_code, bad.json()["field"]) == (400, "status")
    finally:
        mail.close()


def test_a_provider_webhook_with_its_own_scheme(store: Store) -> None:
    def verified(headers: Mapping[str, str], body: bytes) -> bool:
        return headers.get("x-provider-token") == "provider-signed-this"

    def parse(body: bytes) -> list[dict[str, Any]]:
        event = json.loads(body)
        return [
            {
                "operation_id": event["MessageID"],
                "status": {"Bounce": "bounced"}[event["RecordType"]],
                "event_id": f"pm-{event['ID']}",
                "detail": event.get("Description"),
            }
        ]

    app = InboundApp(store, SECRET, webhooks={"postmark": Webhook(verified, parse)})
    body = json.dumps(
        {"RecordType": "Bounce", "ID": 42, "MessageID": "5:email", "Description": "hard"}
    ).encode()
    with TestClient(app) as client:
        ok = client.post(
            "/webhooks/postmark", content=body, headers={"X-Provider-Token": "provider-signed-this"}
        )
        assert ok.status_code == 200, ok.text
        [kept] = ok.json()["deliveries"]
        assert (kept["event_id"], kept["applied"]) == ("pm-42", False)  # no such receipt yet
        assert client.post("/webhooks/postmark", content=body).status_code == 401
        assert client.post("/webhooks/other", content=body).status_code == 404


def start_inbound(db_url: str, secret_file: Path) -> tuple[subprocess.Popen[str], int]:
    """``outbox-worker inbound serve`` as a child process answering /healthz, and its port
    (another free one when a parallel test took the first between its choice and the bind)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    for _ in range(3):
        port = free_port()
        command = ["inbound", "serve", "--port", str(port), "--secret-file", str(secret_file)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "consumer.jobs.cli", *command, "--database-url", db_url],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def up(proc: subprocess.Popen[str] = proc, port: int = port) -> bool:
            if proc.poll() is not None:
                return True  # it exited: seen below
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the inbound endpoint", timeout=60)
        if proc.poll() is None:
            return proc, port
        output = proc.communicate()[0]
        assert "address already in use" in output, output
    raise AssertionError("no free port three times")


def test_the_simulator_sends_signed_delivery_callbacks(db_url: str, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    store = Store(db_url)
    inbound, port = start_inbound(db_url, secret_file)
    simulator = SimulatorProcess(
        tmp_path / "sim.db",
        env={
            "OUTBOX_SIMULATOR_CALLBACK_URL": f"http://127.0.0.1:{port}",
            "OUTBOX_SIMULATOR_CALLBACK_DELAY": "0.05",
            "OUTBOX_INBOUND_SECRET": SECRET,
        },
    )
    try:
        simulator.start(timeout=60)
        mail = HttpProvider("mail", simulator.send_url, lookup_url=simulator.lookup_url)
        ops = Operations(store, {"mail": mail})
        sent = {}
        for n, to in enumerate(("ann@example.com", "nobody@example.invalid")):
            store.enqueue("studio", f"send-quote-{n}")
            lease = store.claim_next("w")
            assert lease is not None
            ctx = JobContext(store, lease, ops)
            sent[to] = ctx.dispatch("email", "mail", {"to": to}).operation_id
            ctx.wait_external("the customer")

        def outcome(to: str) -> str | None:
            receipt = ops.receipt(sent[to])
            return None if receipt is None else receipt.delivery_status

        wait_for(lambda: outcome("nobody@example.invalid") == "bounced", "the bounce", timeout=60)
        wait_for(lambda: outcome("ann@example.com") == "delivered", "the delivery", timeout=60)
        bounced = store.get(int(sent["nobody@example.invalid"].split(":")[0]))
        assert bounced.state == READY  # the bounce woke the job waiting for its customer
        assert store.get(int(sent["ann@example.com"].split(":")[0])).state == WAITING_EXTERNAL
        mail.close()
    finally:
        simulator.stop()
        inbound.send_signal(signal.SIGTERM)
        inbound.communicate(timeout=60)
        store.dispose()


def test_inbound_serve_runs_alone_and_drains_on_sigterm(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    try:
        job = waiting_job(store)
        secret_file = tmp_path / "secret"
        secret_file.write_text(SECRET + "\n")
        proc, port = start_inbound(db_url, secret_file)
        try:
            base = f"http://127.0.0.1:{port}"
            body = json.dumps({"job": job, "reply_id": "r1", "payload": "accepted"}).encode()
            answer = httpx.post(f"{base}/replies", content=body, headers=sign(SECRET, body))
            assert answer.status_code == 200 and answer.json()["resumed"] is True
            assert httpx.post(f"{base}/replies", content=body).status_code == 401
        finally:
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        assert store.get(job).state == READY
    finally:
        store.dispose()


def test_inbound_serve_without_a_secret_is_a_usage_error(sqlite_url: str) -> None:
    Store(sqlite_url).dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "consumer.jobs.cli",
            "inbound",
            "serve",
            "--database-url",
            sqlite_url,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "OUTBOX_INBOUND_SECRET" in done.stderr
