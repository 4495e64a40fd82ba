"""The console's view of conversations (issue 38), on PostgreSQL and SQLite: delivery
callbacks in the verdict (``sent, delivered`` / ``sent, bounced``), replies in the job's
story, and the cancel button on a LEASED job (a request, audited; the run ends it; an
ACCEPTED receipt stays and the trace says so)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from starlette.testclient import TestClient

from consumer import JobCancelled
from consumer.jobs.context import JobContext
from outbox.console.app import Console
from outbox.console.queries import Tables, present_tables
from outbox.console.schema import audit, create_audit_table
from outbox.console.trace import VERDICTS, Trace, collect
from tests.console_support import World

TOKEN = "test-token-" + "y" * 20
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def world(db_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[World]:
    w = World(db_url, redis_client, stream_prefix)
    create_audit_table(w.engine)
    yield w
    w.close()


@pytest.fixture
def api(world: World) -> Iterator[TestClient]:
    with TestClient(Console(world.engine, world.client, TOKEN).app) as client:
        yield client


def trace(world: World, q: str) -> Trace:
    tables = Tables.build()
    with world.engine.connect() as conn:
        return collect(conn, tables, q, present_tables(world.engine, tables), world.client)


def audit_rows(world: World) -> list[dict[str, Any]]:
    with world.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.select(audit).order_by(audit.c.id))]


def test_delivery_callbacks_decide_the_verdict(world: World, api: TestClient) -> None:
    assert {"sent, delivered", "sent, bounced"} <= set(VERDICTS)
    world.through_consumer(50)
    lease, _ = world.send(50)
    op = f"{lease.job_id}:email"
    assert trace(world, "quote-050").verdict == "sent"
    world.ops.record_delivery(op, "delivered", ref="msg-1", event_id="ses-1")
    t = trace(world, "quote-050")
    assert t.verdict == "sent, delivered", t.because
    assert [d["event_id"] for d in t.deliveries] == ["ses-1"]
    assert t.receipts[0]["delivery_status"] == "delivered"

    world.through_consumer(51)
    lease, _ = world.send(51)
    world.ops.record_delivery(f"{lease.job_id}:email", "bounced", event_id="ses-2", detail="550")
    world.ops.record_delivery(f"{lease.job_id}:email", "delivered", event_id="ses-3")  # late
    t = trace(world, "quote-051")
    assert t.verdict == "sent, bounced" and "bounced" in t.because
    page = api.get("/trace", params={"q": "quote-051"}, headers=BEARER).text
    assert "sent, bounced" in page and "ses-2" in page
    answer = api.get("/api/trace", params={"q": "quote-051"}, headers=BEARER).json()
    assert answer["verdict"] == "sent, bounced"
    # The bounce is a reply in the finished job's story: kept, visible, moving nothing.
    [job] = t.jobs
    assert job["state"] == "DONE"
    assert [r["reply_id"] for r in job["replies"]] == ["delivery:ses-2"]


def test_replies_are_in_the_jobs_story(world: World, api: TestClient) -> None:
    world.through_consumer(52)
    ctx = JobContext(world.store, world.claim(52))
    ctx.wait_external("the customer's answer")
    assert trace(world, "quote-052").verdict == "waiting"
    world.store.reply(ctx.job_id, payload={"answer": "accepted"}, reply_id="m-1", source="mail")
    [job] = trace(world, "quote-052").jobs
    assert job["state"] == "READY"
    assert [(r["reply_id"], r["source"], r["consumed_at"]) for r in job["replies"]] == [
        ("m-1", "mail", None)
    ]
    assert "reply" in [h["outcome"] for h in job["history"]]
    assert "m-1" in api.get("/trace", params={"q": "quote-052"}, headers=BEARER).text


def test_the_cancel_button_on_a_leased_job_records_an_audited_request(
    world: World, api: TestClient
) -> None:
    world.through_consumer(53)
    lease = world.claim(53)
    page = api.get("/trace", params={"q": "quote-053"}, headers=BEARER).text
    assert f"/jobs/{lease.job_id}/cancel" in page  # the button is offered on LEASED jobs

    answer = api.post(
        f"/api/jobs/{lease.job_id}/cancel", headers=BEARER, json={"reason": "quote withdrawn"}
    )

    assert answer.status_code == 200, answer.text
    assert answer.json()["result"] == {"state": "LEASED", "requested": True}
    [row] = audit_rows(world)
    assert (row["action"], row["outcome"], row["reason"]) == ("cancel", "ok", "quote withdrawn")
    t = trace(world, "quote-053")
    assert t.verdict == "in progress" and "cancel was requested" in t.because
    assert "Cancel requested" in api.get("/trace", params={"q": "quote-053"}, headers=BEARER).text
    ctx = JobContext(world.store, lease, world.ops)
    with pytest.raises(JobCancelled):
        ctx.dispatch("email", "mail", {"quote": 53})
    world.store.finish_batch([lease])  # the run returned: the job ends CANCELLED
    t = trace(world, "quote-053")
    assert (t.verdict, t.jobs[0]["state"]) == ("not sent", "CANCELLED")
    assert world.provider.sent == []


def test_a_cancelled_job_that_sent_its_email_says_so(world: World, api: TestClient) -> None:
    world.through_consumer(54)
    lease = world.claim(54)
    receipt = world.ops.dispatch(lease, "email", "mail", {"quote": 54})
    api.post(f"/api/jobs/{lease.job_id}/cancel", headers=BEARER, json={"reason": "too late"})
    world.store.finish(lease)
    t = trace(world, "quote-054")
    assert t.jobs[0]["state"] == "CANCELLED"
    assert t.verdict == "sent", t.because  # the receipt decides: the email went
    assert "cannot recall" in t.because and receipt.operation_id in t.because
