"""The operator console (issue 22): the trace and its verdict for each case, on PostgreSQL
and SQLite, the JSON API's reads and audited actions, who gets in (401/403, read-only,
CSRF), and escaping. Real pipeline pieces: an outbox, a relay publishing to Redis, a
consumer group making jobs, operation intents (tests/console_support.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from starlette.testclient import TestClient

from consumer.jobs.operations import Operations
from outbox.console.app import Console
from outbox.console.auth import COOKIE
from outbox.console.queries import Tables, present_tables
from outbox.console.schema import audit, create_audit_table, purge_audit
from outbox.console.trace import VERDICTS, Trace, collect
from tests.console_support import World
from tests.services import wait_for

TOKEN = "test-token-" + "x" * 20
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def world(db_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[World]:
    w = World(db_url, redis_client, stream_prefix)
    create_audit_table(w.engine)
    yield w
    w.close()


@pytest.fixture
def console(world: World) -> Console:
    return Console(world.engine, world.client, TOKEN)


@pytest.fixture
def api(console: Console) -> Iterator[TestClient]:
    with TestClient(console.app) as client:
        yield client


def trace(world: World, q: str) -> Trace:
    tables = Tables.build()
    with world.engine.connect() as conn:
        return collect(conn, tables, q, present_tables(world.engine, tables), world.client)


def audit_rows(world: World) -> list[dict[str, Any]]:
    with world.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.select(audit).order_by(audit.c.id))]


# -- the trace, one verdict at a time (both databases) -----------------------------------------


def test_sent_found_by_identity_key_event_job_and_operation(world: World) -> None:
    event_id = world.through_consumer(1)
    lease, receipt = world.send(1)
    assert receipt is not None and receipt.state == "ACCEPTED"
    for q in ("studio:send-quote-001", "quote-001", event_id, str(lease.job_id), "1:email"):
        t = trace(world, q)
        assert t.verdict == "sent", (q, t.because)
        assert [e["event_id"] for e in t.events] == [event_id]
        assert [j["id"] for j in t.jobs] == [lease.job_id]
        assert [r["operation_id"] for r in t.receipts] == [f"{lease.job_id}:email"]
    t = trace(world, "studio:send-quote-001")
    assert t.events[0]["state"] == "published"
    (entry,) = t.stream_entries
    assert entry["state"] == "present"
    assert entry["fields"]["id"] == event_id
    assert entry["fields"]["type"] == "quote.approved"
    assert entry["fields"]["subject"] == "quote-001"
    assert json.loads(entry["fields"]["data"]) == {"quote": 1, "total": 101}
    assert [(i["group_name"], i["event_id"]) for i in t.inbox] == [("billing", event_id)]
    outcomes = [h["outcome"] for h in t.jobs[0]["history"]]
    assert outcomes[-1] == "done"


def test_unknown_receipt_decides_before_the_review_state(world: World) -> None:
    world.through_consumer(2)
    _, receipt = world.send(2, "timeout")
    assert receipt is not None and receipt.state == "UNKNOWN"
    t = trace(world, "quote-002")
    assert t.jobs[0]["state"] == "WAITING_REVIEW"  # the job says "needs review" ...
    assert t.verdict == "unknown"  # ... the receipt decides first


def test_pending_receipt_in_flight_then_past_its_deadline(world: World) -> None:
    world.through_consumer(3)
    lease = world.claim(3)
    ops = Operations(world.store, {"mail": world.provider}, default_timeout=1.0)

    class WorkerDied(BaseException):
        """The worker process ends mid-call: nothing records the receipt."""

    def die(*args: Any, **kwargs: Any) -> str:
        raise WorkerDied()

    world.provider.send = die  # type: ignore[method-assign]
    with pytest.raises(WorkerDied):
        ops.dispatch(lease, "email", "mail", {"quote": 3})
    t = trace(world, "quote-003")
    assert t.receipts[0]["state"] == "PENDING"
    if t.clock < t.receipts[0]["call_deadline"]:
        assert t.verdict == "in progress", t.because
    wait_for(lambda: trace(world, "quote-003").verdict == "unknown", "the deadline to pass")


def test_waiting_external_and_a_timer(world: World) -> None:
    world.through_consumer(4)
    lease = world.claim(4)
    world.store.wait_external(lease, reason="customer must sign")
    t = trace(world, "studio:send-quote-004")
    assert (t.verdict, t.jobs[0]["state"]) == ("waiting", "WAITING_EXTERNAL")
    world.through_consumer(5)
    lease = world.claim(5)
    world.store.schedule(lease, t.clock + 3600, "remind tomorrow")
    t = trace(world, "quote-005")
    assert t.jobs[0]["timer_scheduled_for"] is not None
    assert t.verdict == "waiting", t.because


def test_needs_review_and_needs_attention(world: World) -> None:
    world.through_consumer(6)
    world.store.wait_review(world.claim(6), reason="the address looks wrong")
    assert trace(world, "quote-006").verdict == "needs review"
    world.dead_letter(7)
    t = trace(world, "studio:send-quote-007")
    assert t.jobs == [] and t.dead_letters[0]["state"] == "needs_attention"
    assert t.verdict == "needs review"


def test_in_progress_ready_and_leased(world: World) -> None:
    world.through_consumer(8)
    assert trace(world, "quote-008").verdict == "in progress"
    world.claim(8)
    t = trace(world, "quote-008")
    assert (t.verdict, t.jobs[0]["state"]) == ("in progress", "LEASED")


def test_not_sent_cancelled_and_settled(world: World, api: TestClient) -> None:
    world.through_consumer(9)
    job_id = trace(world, "quote-009").jobs[0]["id"]
    world.store.cancel(job_id, reason="customer withdrew")
    assert trace(world, "quote-009").verdict == "not sent"
    world.through_consumer(10)
    lease, _ = world.send(10, "timeout")
    answer = api.post(
        f"/api/receipts/{lease.job_id}:email/settle",
        headers=BEARER,
        json={"not_sent": True, "reason": "the provider has no such message"},
    )
    assert answer.status_code == 200, answer.text
    assert trace(world, "quote-010").verdict == "not sent"


def test_not_published_yet_pending_and_quarantined(world: World) -> None:
    world.approve(11)
    t = trace(world, "quote-011")
    assert (t.verdict, t.events[0]["state"]) == ("not published yet", "pending")
    assert t.stream_entries == []
    event_id = world.quarantine(12)
    t = trace(world, event_id)
    assert (t.verdict, t.events[0]["state"]) == ("not published yet", "quarantined")
    assert "WRONGTYPE" in t.events[0]["last_error"]


def test_not_found(world: World) -> None:
    world.through_consumer(13)
    for q in ("quote-999", "studio:send-quote-999", "424242", "no:such-operation"):
        t = trace(world, q)
        assert (t.verdict, t.found) == ("not found", False), q
    assert set(VERDICTS) >= {"sent", "unknown", "not found"}


def test_published_but_not_consumed_is_in_progress(world: World) -> None:
    world.approve(14)
    world.publish()
    t = trace(world, "quote-014")
    assert (
        t.verdict == "in progress" and t.inbox == [] and t.stream_entries[0]["state"] == "present"
    )


# -- who gets in ----------------------------------------------------------------------------


def test_every_page_and_api_call_needs_the_token(world: World, api: TestClient) -> None:
    world.through_consumer(20)
    reads = ["/api/overview", "/api/trace?q=quote-020", "/api/events", "/api/jobs"]
    reads += ["/api/receipts", "/api/dead-letters", "/api/audit", "/api/queues"]
    pages = ["/", "/trace?q=quote-020", "/events", "/jobs", "/receipts", "/dead-letters", "/audit"]
    pages += ["/queues"]
    for path in reads + pages:
        assert api.get(path).status_code == 401, path
        assert api.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert api.get(path, cookies={COOKIE: "forged.cookie"}).status_code == 401
    for path in reads:
        assert api.get(path, headers=BEARER).status_code == 200, path
    job_id = trace(world, "quote-020").jobs[0]["id"]
    answer = api.post(f"/api/jobs/{job_id}/cancel", json={"reason": "x"})
    assert answer.status_code == 401
    assert api.post("/api/queues/default/pause", json={"reason": "x"}).status_code == 401
    assert api.get("/login?token=wrong", follow_redirects=False).status_code == 401
    assert audit_rows(world) == []


def test_login_cookie_and_csrf(world: World, api: TestClient) -> None:
    world.through_consumer(21)
    job_id = trace(world, "quote-021").jobs[0]["id"]
    signed_in = api.get(f"/login?token={TOKEN}", follow_redirects=False)
    assert signed_in.status_code == 303 and signed_in.headers["location"] == "/"
    cookie = signed_in.headers["set-cookie"]
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
    for path in ("/", "/jobs", "/trace?q=quote-021", "/api/jobs"):
        assert api.get(path).status_code == 200, path  # the cookie is enough to read
    refused = api.post(f"/api/jobs/{job_id}/cancel", json={"reason": "no csrf"})
    assert refused.status_code == 403
    refused = api.post(
        f"/jobs/{job_id}/cancel",
        data={"reason": "forged csrf", "csrf": "0" * 64},
        follow_redirects=False,
    )
    assert refused.status_code == 403
    assert trace(world, "quote-021").jobs[0]["state"] == "READY"
    page = api.get("/trace?q=quote-021").text
    csrf = page.split('name="csrf" value="')[1].split('"')[0]
    done = api.post(
        f"/jobs/{job_id}/cancel",
        data={"reason": "duplicate quote", "csrf": csrf, "back": "/trace?q=quote-021"},
        follow_redirects=False,
    )
    assert done.status_code == 303 and done.headers["location"].startswith("/trace?q=quote-021")
    assert trace(world, "quote-021").jobs[0]["state"] == "CANCELLED"
    (row,) = audit_rows(world)
    assert (row["action"], row["via"], row["reason"]) == ("cancel", "cookie", "duplicate quote")
    # A bearer request needs no CSRF token.
    world.through_consumer(22)
    other = trace(world, "quote-022").jobs[0]["id"]
    answer = api.post(f"/api/jobs/{other}/cancel", headers=BEARER, json={"reason": "api"})
    assert answer.status_code == 200


def test_read_only_refuses_every_action(world: World) -> None:
    world.through_consumer(23)
    lease, _ = world.send(23, "timeout")
    event_id = world.quarantine(24)
    console = Console(world.engine, world.client, TOKEN, read_only=True)
    with TestClient(console.app) as api:
        posts = [
            (f"/api/events/{event_id}/requeue", {}),
            (f"/api/jobs/{lease.job_id}/resume", {}),
            (f"/api/jobs/{lease.job_id}/cancel", {}),
            (f"/api/receipts/{lease.job_id}:email/settle", {"accepted": "msg-1"}),
            ("/api/dead-letters/1/replay", {}),
            ("/api/bulk/requeue", {"filters": {"state": "quarantined"}, "confirm": True}),
            ("/api/queues/default/pause", {}),
            ("/api/queues/default/resume", {}),
        ]
        for path, body in posts:
            answer = api.post(path, headers=BEARER, json={**body, "reason": "try"})
            assert answer.status_code == 403, path
        assert api.get("/api/overview", headers=BEARER).status_code == 200
        assert "Read-only" in api.get("/", headers=BEARER).text
        assert "/pause" not in api.get("/queues", headers=BEARER).text  # no buttons
    assert world.store.paused_queues() == []
    assert trace(world, event_id).events[0]["state"] == "quarantined"
    assert audit_rows(world) == []


# -- actions and their audit ------------------------------------------------------------------


def test_every_action_is_audited_with_before_and_after(world: World, api: TestClient) -> None:
    event_id = world.quarantine(30)
    world.dead_letter(31)
    world.through_consumer(32)
    lease, _ = world.send(32, "timeout")
    world.through_consumer(33)
    review = world.claim(33)
    world.store.wait_review(review, reason="check")
    world.through_consumer(34)
    cancel_id = trace(world, "quote-034").jobs[0]["id"]
    dl_id = trace(world, "quote-031").dead_letters[0]["id"]

    world.client.delete(world.stream_template.format(topic="quote.poison"))  # the fix
    calls = [
        (f"/api/events/{event_id}/requeue", {}),
        (f"/api/dead-letters/{dl_id}/replay", {}),
        (f"/api/receipts/{lease.job_id}:email/settle", {"accepted": "msg-77"}),
        (f"/api/jobs/{review.job_id}/resume", {}),
        (f"/api/jobs/{cancel_id}/cancel", {}),
    ]
    for path, body in calls:
        answer = api.post(
            path, headers=BEARER, json={**body, "reason": f"ticket {path}", "by": "ann"}
        )
        assert answer.status_code == 200, (path, answer.text)
        assert answer.json()["audit_id"] > 0
    rows = audit_rows(world)
    assert [r["action"] for r in rows] == ["requeue", "replay", "settle", "resume", "cancel"]
    for row, (path, _) in zip(rows, calls, strict=True):
        assert (row["actor"], row["via"], row["outcome"]) == ("ann", "bearer", "ok")
        assert row["reason"] == f"ticket {path}" and row["at"] > 0
        assert row["client"]
    states = [(json.loads(r["before"])["state"], json.loads(r["after"])["state"]) for r in rows]
    assert states == [
        ("quarantined", "pending"),
        ("needs_attention", "replayed"),
        ("UNKNOWN", "ACCEPTED"),
        ("WAITING_REVIEW", "READY"),
        ("READY", "CANCELLED"),
    ]
    # The library's own records say who decided.
    receipt = trace(world, f"{lease.job_id}:email").receipts[0]
    assert (receipt["settled_by"], receipt["provider_ref"]) == ("ann", "msg-77")
    assert trace(world, "quote-032").verdict == "sent"
    # The audit shows in the trace and on its page.
    t = trace(world, "quote-032")
    assert [a["action"] for a in t.audit] == ["settle"]
    listed = api.get("/api/audit", headers=BEARER).json()["rows"]
    assert [r["action"] for r in listed] == ["cancel", "resume", "settle", "replay", "requeue"]
    assert "ticket" in api.get("/audit", headers=BEARER).text
    # The replayed entry is handled now that the handler works: one job, no duplicate.
    world.consume()
    assert len(trace(world, "quote-031").jobs) == 1
    # The requeued event is published after the fix.
    world.publish()
    assert trace(world, event_id).events[0]["state"] == "published"


def test_refusals_are_audited_and_a_reason_is_required(world: World, api: TestClient) -> None:
    world.through_consumer(40)
    job_id = trace(world, "quote-040").jobs[0]["id"]
    missing = api.post(f"/api/jobs/{job_id}/cancel", headers=BEARER, json={})
    assert missing.status_code == 400 and "reason" in missing.json()["error"]
    blank = api.post(f"/api/jobs/{job_id}/cancel", headers=BEARER, json={"reason": "  "})
    assert blank.status_code == 400
    assert audit_rows(world) == []
    wrong = api.post(f"/api/jobs/{job_id}/resume", headers=BEARER, json={"reason": "try"})
    assert wrong.status_code == 409  # READY cannot be resumed
    gone = api.post("/api/jobs/99999/cancel", headers=BEARER, json={"reason": "try"})
    assert gone.status_code == 404
    no_event = api.post("/api/events/nope/requeue", headers=BEARER, json={"reason": "try"})
    assert no_event.status_code == 404
    settle = api.post(f"/api/receipts/{job_id}:email/settle", headers=BEARER, json={"reason": "x"})
    assert settle.status_code == 400
    outcomes = [(r["action"], r["outcome"].split(":")[0]) for r in audit_rows(world)]
    assert outcomes == [("resume", "refused"), ("cancel", "refused"), ("requeue", "refused")]


def test_queues_are_listed_paused_and_resumed_each_audited(world: World, api: TestClient) -> None:
    """Issue 27's operator actions in the console: the queue list (READY, oldest READY age,
    LEASED, paused) and pause/resume per queue, each with a reason and an audit row, a
    refusal audited too; the browser's forms need the CSRF token."""
    store = world.store
    store.enqueue_many([{"tenant": "t", "action": f"m-{i}", "queue": "mail"} for i in range(3)])
    store.enqueue_many([{"tenant": "t", "action": f"d-{i}"} for i in range(2)])
    assert len(store.claim_batch("w", 1, queues=["default"])) == 1
    rows = api.get("/api/queues", headers=BEARER).json()["rows"]
    assert [(r["queue"], r["ready"], r["leased"], r["paused"]) for r in rows] == [
        ("default", 1, 1, False),
        ("mail", 3, 0, False),
    ]
    assert all(r["oldest_ready_age_seconds"] >= 0 for r in rows)

    def post(path: str, **body: Any) -> Any:
        return api.post(path, headers=BEARER, json=body)

    assert post("/api/queues/mail/pause").status_code == 400  # no reason: not audited
    assert audit_rows(world) == []
    paused = post("/api/queues/mail/pause", reason="provider outage INC-7", by="ann")
    assert paused.status_code == 200, paused.text
    assert paused.json()["before"]["paused"] is False and paused.json()["after"]["paused"]
    assert store.paused_queues() == ["mail"]
    assert store.claim_batch("w", 10, queues=["mail"]) == []  # no worker claims from it
    again = post("/api/queues/mail/pause", reason="twice")
    assert again.status_code == 409 and "already" in again.json()["error"]
    assert post("/api/queues/reports/pause", reason="before its first job").status_code == 200
    listed = {r["queue"]: r for r in api.get("/api/queues", headers=BEARER).json()["rows"]}
    assert listed["mail"]["paused"] and listed["reports"] == {
        "queue": "reports",
        "ready": 0,
        "oldest_ready_age_seconds": 0.0,
        "paused": True,
        "leased": 0,
    }
    assert post("/api/queues/mail/resume", reason="INC-7 over").status_code == 200
    refused = post("/api/queues/mail/resume", reason="twice")
    assert refused.status_code == 409 and "not paused" in refused.json()["error"]
    assert post(f"/api/queues/{'x' * 201}/pause", reason="too long").status_code == 400
    assert store.paused_queues() == ["reports"]
    assert len(store.claim_batch("w", 10, queues=["mail"])) == 3  # claimed again
    rows = audit_rows(world)
    assert [(r["action"], r["target_kind"], r["target_id"], r["outcome"][:7]) for r in rows] == [
        ("pause", "queue", "mail", "ok"),
        ("pause", "queue", "mail", "refused"),
        ("pause", "queue", "reports", "ok"),
        ("resume", "queue", "mail", "ok"),
        ("resume", "queue", "mail", "refused"),
    ]
    assert (rows[0]["actor"], rows[0]["reason"]) == ("ann", "provider outage INC-7")
    assert json.loads(rows[3]["before"])["paused"] and not json.loads(rows[3]["after"])["paused"]
    # The page: one form per queue (no JavaScript), CSRF required for a cookie session.
    api.get(f"/login?token={TOKEN}")
    page = api.get("/queues").text
    assert 'action="/queues/reports/resume"' in page and 'action="/queues/mail/pause"' in page
    forged = api.post(
        "/queues/mail/pause", data={"reason": "x", "csrf": "0" * 64}, follow_redirects=False
    )
    assert forged.status_code == 403
    csrf = page.split('name="csrf" value="')[1].split('"')[0]
    done = api.post(
        "/queues/mail/pause",
        data={"reason": "from the page", "csrf": csrf, "back": "/queues"},
        follow_redirects=False,
    )
    assert done.status_code == 303 and done.headers["location"].startswith("/queues?notice=")
    assert store.paused_queues() == ["mail", "reports"]
    assert "paused" in api.get(done.headers["location"]).text
    assert audit_rows(world)[-1]["via"] == "cookie"


def test_bulk_requeue_counts_first_then_takes_the_filter(world: World, api: TestClient) -> None:
    ids = [world.quarantine(n, topic="quote.poison") for n in (50, 51, 52)]
    other = world.quarantine(53, topic="quote.other")
    body = {"filters": {"state": "quarantined", "topic": "quote.poison"}, "reason": "fixed"}
    preview = api.post("/api/bulk/requeue", headers=BEARER, json=body)
    assert preview.json() == {**preview.json(), "count": 3, "confirmed": False}
    assert all(trace(world, i).events[0]["state"] == "quarantined" for i in ids)
    page = api.get(
        "/events?state=quarantined&topic=quote.poison&preview=requeue", headers=BEARER
    ).text
    assert "Requeue: 3" in page
    done = api.post("/api/bulk/requeue", headers=BEARER, json={**body, "confirm": True})
    assert sorted(done.json()["done"]) == sorted(ids)
    assert [trace(world, i).events[0]["state"] for i in ids] == ["pending"] * 3
    assert trace(world, other).events[0]["state"] == "quarantined"
    rows = audit_rows(world)
    assert len(rows) == 3 and all(json.loads(r["bulk"])["topic"] == "quote.poison" for r in rows)


def test_purge_audit_keeps_recent_rows(world: World, api: TestClient) -> None:
    world.through_consumer(60)
    job_id = trace(world, "quote-060").jobs[0]["id"]
    api.post(f"/api/jobs/{job_id}/cancel", headers=BEARER, json={"reason": "a"})
    assert purge_audit(world.engine, 3600, 100) == 0
    with world.engine.begin() as conn:
        conn.execute(sa.update(audit).values(at=audit.c.at - 7200))
    assert purge_audit(world.engine, 3600, 100) == 1
    assert audit_rows(world) == []


# -- lists, escaping, secrets -----------------------------------------------------------------


def test_lists_page_by_keyset_through_every_row(world: World, api: TestClient) -> None:
    for n in range(70, 83):
        world.approve(n)
    world.publish()
    world.consume()
    seen: list[int] = []
    url = "/api/jobs?limit=5&tenant=studio"
    while url:
        page = api.get(url, headers=BEARER).json()
        seen += [r["id"] for r in page["rows"]]
        cursor = page["next_cursor"]
        url = f"/api/jobs?limit=5&tenant=studio&cursor={cursor}" if cursor else ""
    assert len(seen) == 13 and seen == sorted(seen, reverse=True)
    events = api.get("/api/events?limit=100&topic=quote.approved", headers=BEARER).json()
    assert len(events["rows"]) == 13 and events["next_cursor"] is None
    html = api.get("/jobs?limit=5", headers=BEARER).text
    assert 'rel="next"' in html
    for bad in ("/api/jobs?state=BOGUS", "/api/jobs?cursor=zzz", "/api/events?limit=0"):
        assert api.get(bad, headers=BEARER).status_code == 400, bad


def test_a_script_in_a_payload_is_shown_as_text(world: World, api: TestClient) -> None:
    evil = "<script>alert(1)</script>"
    world.through_consumer(90, payload={"quote": 90, "note": evil})
    for path in ("/trace?q=quote-090", "/events", "/jobs"):
        html = api.get(path, headers=BEARER).text
        assert "<script>" not in html, path
    assert (
        "&lt;script&gt;alert(1)&lt;/script&gt;"
        in api.get("/trace?q=quote-090", headers=BEARER).text
    )
    answer = api.get("/", headers=BEARER)
    assert "script-src" not in answer.headers["content-security-policy"]
    assert "default-src 'none'" in answer.headers["content-security-policy"]


def test_no_password_is_shown(world: World) -> None:
    console = Console(
        world.engine,
        world.client,
        TOKEN,
        describe={"database": "postgresql+psycopg://ann:***@db/app", "redis": "redis://:***@r"},
    )
    with TestClient(console.app) as api:
        html = api.get("/", headers=BEARER).text
    assert "***" in html and "secret" not in html
