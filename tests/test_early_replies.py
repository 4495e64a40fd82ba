"""Replies to a job that does not exist yet (issue 59), on PostgreSQL and SQLite: kept,
deduplicated, seen by the job's first run whichever way it is enqueued, answered 202 by the
inbound endpoint, and swept by retention when the job never comes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from consumer.consumer import ConsumerTx
from consumer.errors import JobNotFound
from consumer.jobs.checks import job_values
from consumer.jobs.context import JobContext
from consumer.jobs.enqueues import enqueue_one
from consumer.jobs.inbound import InboundApp, sign
from consumer.jobs.operations import Operations
from consumer.jobs.retention import JobRetention, JobRetentionConfig
from consumer.jobs.schema import early_replies
from consumer.jobs.states import DONE, READY
from consumer.jobs.store import Lease, Store
from outbox.testing import FakeProvider

SECRET = "early-replies-shared-secret"


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def claim(store: Store) -> Lease:
    lease = store.claim_next("w", ttl=30)
    assert lease is not None
    return lease


def kept_rows(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(early_replies)).scalar_one())


def test_a_reply_before_the_job_is_kept_and_its_first_run_sees_it(store: Store) -> None:
    first = store.reply("studio", "quote-201", payload={"answer": "yes"}, reply_id="mail-1")
    again = store.reply(("studio", "quote-201"), payload={"answer": "yes"}, reply_id="mail-1")
    second = store.reply("studio", "quote-201", payload="and soon", reply_id="mail-2", source="m")

    assert (first.kept, first.duplicate, first.job_id, first.state) == (True, False, None, None)
    assert (again.kept, again.duplicate) == (True, True)
    assert (second.kept, second.duplicate) == (True, False)
    assert kept_rows(store) == 2

    job = store.enqueue("studio", "quote-201").job_id
    assert kept_rows(store) == 0  # moved into the job by its enqueue
    ctx = JobContext(store, claim(store))
    assert [(r.reply_id, r.payload, r.source) for r in ctx.replies] == [
        ("mail-1", {"answer": "yes"}, None),
        ("mail-2", "and soon", "m"),
    ]
    store.finish_batch([ctx.lease])
    assert store.get(job).state == DONE
    assert all(r.consumed_at is not None for r in store.replies(job))
    # Once the job exists, the same reply_id is a duplicate of the moved reply.
    late = store.reply("studio", "quote-201", payload="x", reply_id="mail-1")
    assert (late.duplicate, late.kept, late.job_id) == (True, False, job)


def test_replies_kept_for_jobs_enqueued_many_at_once_or_in_a_session(store: Store) -> None:
    store.reply("studio", "q-2", payload=2, reply_id="r2")
    store.reply("studio", "q-4", payload=4, reply_id="r4")
    results = store.enqueue_many([{"tenant": "studio", "action": f"q-{n}"} for n in range(1, 6)])
    store.reply("studio", "q-6", payload=6, reply_id="r6")
    with store.engine.begin() as conn:
        six = store.enqueue("studio", "q-6", session=conn).job_id
    assert kept_rows(store) == 0
    seen = {}
    for _ in range(6):
        ctx = JobContext(store, claim(store))
        seen[ctx.lease.action] = [r.payload for r in ctx.replies]
        store.finish_batch([ctx.lease])
    assert seen == {"q-1": [], "q-2": [2], "q-3": [], "q-4": [4], "q-5": [], "q-6": [6]}
    assert [len(store.replies(r.job_id)) for r in results] == [0, 1, 0, 1, 0]
    assert len(store.replies(six)) == 1


def test_a_run_moves_counted_replies_its_enqueue_left_behind(store: Store) -> None:
    """PostgreSQL's enqueue outside a transaction counts the kept replies in its INSERT and
    moves them right after: a run claimed in between moves them itself."""
    store.reply("studio", "q-9", payload="early", reply_id="r9")
    with store.driver.begin() as conn:  # the INSERT alone, as before the move
        result, waiting = enqueue_one(
            store.driver, conn, job_values("studio", "q-9"), adopting=False
        )
    assert waiting and kept_rows(store) == 1
    ctx = JobContext(store, claim(store))
    assert [r.payload for r in ctx.replies] == ["early"]
    assert kept_rows(store) == 0
    assert [r.reply_id for r in store.replies(result.job_id)] == ["r9"]


def test_a_reply_that_raced_its_enqueue_is_moved_by_the_sweep(store: Store) -> None:
    """A reply that saw no job and was kept after the job's INSERT counted nothing: the
    retention sweep moves it into the job (here: a kept row written behind the store)."""
    job = store.enqueue("studio", "q-raced").job_id
    with store.engine.begin() as conn:
        conn.execute(
            early_replies.insert().values(
                tenant="studio", action="q-raced", reply_id="late", payload=1, received_at=1.0
            )
        )
    retention = JobRetention(store, JobRetentionConfig())
    assert retention.purge_early(100) == 0  # moved, not deleted: it is 1970's but its job came
    assert [r.reply_id for r in store.replies(job)] == ["late"]
    assert store.get(job).state == READY
    assert [r.reply_id for r in JobContext(store, claim(store)).replies] == ["late"]


def test_kept_replies_whose_job_never_came_are_swept_after_the_window(store: Store) -> None:
    store.reply("studio", "never", payload=1, reply_id="r1", now=1_000.0)
    store.reply("studio", "recent", payload=1, reply_id="r1", now=1_000_000.0)
    retention = JobRetention(store, JobRetentionConfig(early_retention_seconds=3600))
    assert retention.count_early(now=1_000_000.0) == 1
    assert retention.purge_early(100, now=1_000_000.0) == 1
    assert kept_rows(store) == 1
    assert "outbox_kept_replies" in [t.table for t in retention.targets()]
    assert JobRetention(store, JobRetentionConfig(early_retention_seconds=0)).targets() != []
    forever = JobRetention(store, JobRetentionConfig(early_retention_seconds=0))
    assert "outbox_kept_replies" not in [t.table for t in forever.targets()]


def test_a_consumer_handler_keeps_a_reply_with_its_entry_and_a_rollback_drops_it(
    store: Store,
) -> None:
    """``ConsumerTx.reply`` before the job exists: kept in the handler's transaction, so a
    handler that fails keeps nothing (its entry comes again), one that succeeds keeps it."""
    with pytest.raises(KeyError), Session(store.engine) as session, session.begin():
        tx = ConsumerTx(session=session, group="billing")
        assert tx.reply("studio", "quote-30", payload="yes", reply_id="evt-1").kept
        raise KeyError("the handler failed")
    assert kept_rows(store) == 0
    with Session(store.engine) as session, session.begin():
        tx = ConsumerTx(session=session, group="billing")
        tx.reply("studio", "quote-30", payload="yes", reply_id="evt-1", source="event")
        # The job created by the same handler, after the reply: its first run sees it.
        store.enqueue("studio", "quote-30", session=session)
    assert [r.payload for r in JobContext(store, claim(store)).replies] == ["yes"]


def test_the_keep_costs_an_enqueue_no_statement_and_an_enqueue_of_many_one(pg_url: str) -> None:
    """Issue 59's cost on the hot paths, counted: an enqueue counts the kept replies inside
    its own INSERT (still one statement when there are none), an enqueue of many asks the
    keep in its INSERT's RETURNING (no statement of its own, issue 54), and moves a kept
    reply in the same transaction."""
    store = Store(pg_url)
    statements: list[str] = []

    def record(*args: object) -> None:
        statements.append(str(args[2]).split()[0].upper())

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        store.enqueue("studio", "warm-up")  # the pool's first connection: its own set-up
        statements.clear()
        store.enqueue("studio", "one")
        assert statements == ["INSERT"]
        statements.clear()
        store.enqueue_many([{"tenant": "studio", "action": f"many-{n}"} for n in range(800)])
        # The rows go as binary arrays on psycopg's own cursor (unseen here), and the keep is
        # asked in that INSERT: SQLAlchemy runs nothing for the 800 jobs.
        assert statements == []
        store.reply("studio", "many-later", payload=2, reply_id="r2")
        statements.clear()
        store.enqueue_many([{"tenant": "studio", "action": a} for a in ("many-later", "more")])
        assert statements[0] == "SELECT" and "DELETE" in statements  # the move: only then
        assert [r.reply_id for r in store.replies("studio", "many-later")] == ["r2"]
        store.reply("studio", "later", payload=1, reply_id="r1")
        statements.clear()
        store.enqueue("studio", "later")  # a kept reply: moved right after, in one transaction
        assert statements[0] == "INSERT" and "DELETE" in statements
        assert [r.reply_id for r in store.replies("studio", "later")] == ["r1"]
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
        store.dispose()


def test_a_job_id_that_does_not_exist_is_still_not_found(store: Store) -> None:
    with pytest.raises(JobNotFound):
        store.reply(10**9, payload=1, reply_id="r1")
    assert kept_rows(store) == 0


def test_the_inbound_endpoint_answers_202_kept_for_a_job_not_enqueued(store: Store) -> None:
    client = TestClient(InboundApp(store, secret=SECRET))

    def post(data: object) -> tuple[int, dict[str, object]]:
        body = json.dumps(data).encode()
        answer = client.post("/replies", content=body, headers=sign(SECRET, body))
        return answer.status_code, answer.json()

    reply = {"job": {"tenant": "studio", "action": "send-quote-201"}, "reply_id": "m1"}
    status, body = post({**reply, "payload": {"answer": "yes"}})
    assert status == 202
    assert body == {
        "job_id": None,
        "reply_id": "m1",
        "duplicate": False,
        "resumed": False,
        "state": None,
        "kept": True,
    }
    status, body = post({**reply, "payload": {"answer": "yes"}})
    assert (status, body["duplicate"], body["kept"]) == (202, True, True)
    job = store.enqueue("studio", "send-quote-201").job_id
    status, body = post({**reply, "reply_id": "m2", "payload": "later"})
    assert (status, body["job_id"], body["kept"], body["state"]) == (200, job, False, READY)
    assert [r.payload for r in JobContext(store, claim(store)).replies] == [
        {"answer": "yes"},
        "later",
    ]
    status, body = post({"job": 10**9, "reply_id": "m3", "payload": 1})
    assert status == 404


def test_a_callback_before_its_receipt_is_answered_202_kept(store: Store) -> None:
    """The same for a delivery callback: kept until its receipt is ACCEPTED (then applied),
    and the endpoint says so; one for an ACCEPTED receipt is applied: 200, not kept."""
    mail = FakeProvider("mail")
    ops = Operations(store, {"mail": mail})
    client = TestClient(InboundApp(store, secret=SECRET, operations=ops))
    try:
        body = json.dumps({"operation_id": "77:email", "status": "bounced", "event_id": "b-77"})
        early = client.post("/deliveries", content=body, headers=sign(SECRET, body.encode()))
        assert early.status_code == 202, early.text
        assert (early.json()["kept"], early.json()["applied"]) == (True, False)
        store.enqueue("studio", "send-1")
        lease = claim(store)
        op = JobContext(store, lease, ops).dispatch("email", "mail", {"to": "a"}).operation_id
        body = json.dumps({"operation_id": op, "status": "delivered", "event_id": "d-1"})
        applied = client.post("/deliveries", content=body, headers=sign(SECRET, body.encode()))
        assert applied.status_code == 200, applied.text
        assert (applied.json()["kept"], applied.json()["delivery_status"]) == (False, "delivered")
    finally:
        mail.close()
