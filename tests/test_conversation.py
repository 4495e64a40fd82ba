"""The seed's conversation (issue 38) on PostgreSQL and SQLite with real Redis, through
``outbox.testing`` and its clock: the application is docs/how-to/replies.md's own module
(``conversation.py``, taken from the page, so the page and this test cannot drift apart).

A quote email is sent; the job waits for the customer up to three days with a reminder
timer that re-reads the quote; the customer's reply "accepted" comes as a domain event
through the consumer; the job finishes. A second run: the email bounces, the provider's
signed callback reaches the inbound endpoint, and the job goes to review.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from starlette.testclient import TestClient

from consumer.jobs.inbound import InboundApp, sign
from outbox.testing import Pipeline
from tests.docs_runner import python_blocks

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "how-to" / "replies.md"
SECRET = "a-secret-of-16-chars-or-more"


@pytest.fixture(scope="module")
def conversation(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    [block] = [b for b in python_blocks(PAGE) if b.title == "conversation.py"]
    path = tmp_path_factory.mktemp("page") / "conversation.py"
    path.write_text(block.source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("conversation_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def pipeline(db_url: str, redis_url: str) -> Iterator[Pipeline]:
    with Pipeline(database_url=db_url, redis_url=redis_url) as p:
        yield p


def wired(p: Pipeline, conversation: ModuleType) -> Any:
    app = conversation.Conversation(p.outbox, p.store)
    p.consumer("billing", app.consumer_handlers)
    p.worker(app.worker_handlers, providers={"mail": p.fake_provider("mail")})
    return app


def test_the_customer_accepts_after_a_reminder(pipeline: Pipeline, conversation: Any) -> None:
    p = pipeline
    app = wired(p, conversation)
    app.create(17, "ann@example.com")
    app.approve(17)
    p.drain()
    p.assert_effects("quote-17", 1)
    p.assert_jobs(WAITING_EXTERNAL=1)

    p.clock.advance(hours=23)
    p.drain()
    p.assert_effects("quote-17", 1)  # not yet

    p.clock.advance(hours=1, seconds=1)
    p.drain()
    p.assert_effects("quote-17", 2)  # the reminder, once
    p.assert_jobs(WAITING_EXTERNAL=1)

    app.answer(17, "accepted", message_id="mail-4711")
    app.answer(17, "accepted", message_id="mail-4711")  # the same message twice
    p.drain()
    p.assert_jobs(DONE=1)
    replies = p.store.replies("studio", "quote-17")
    assert [(r.reply_id, r.source) for r in replies] == [("mail-4711", "customer")]
    assert replies[0].consumed_at is not None
    p.clock.advance(days=5)
    p.drain()
    p.assert_effects("quote-17", 2)  # nothing more, ever


def test_an_answer_before_the_reminder_finishes_it_at_once(
    pipeline: Pipeline, conversation: Any
) -> None:
    p = pipeline
    app = wired(p, conversation)
    app.create(17, "ann@example.com")
    app.approve(17)
    app.answer(17, "accepted", message_id="m-1")  # before the job even ran
    p.drain()
    p.assert_jobs(DONE=1)
    p.assert_effects("quote-17", 0)  # it saw the answer first: no email was needed


def test_no_reminder_for_a_withdrawn_quote_and_review_after_three_days(
    pipeline: Pipeline, conversation: Any
) -> None:
    p = pipeline
    app = wired(p, conversation)
    for quote in (17, 18):
        app.create(quote, f"c{quote}@example.com")
        app.approve(quote)
    p.drain()
    app.withdraw(17)
    p.clock.advance(days=1, seconds=1)
    p.drain()
    p.assert_jobs(action="quote-17", CANCELLED=1)  # the reminder re-read the quote
    p.assert_effects("quote-17", 1)
    p.assert_effects("quote-18", 2)
    p.clock.advance(days=2)
    p.drain()
    job = p.store.get("studio", "quote-18")
    assert (job.state, job.wait_reason) == ("WAITING_REVIEW", "no answer in three days")


def test_a_bounced_email_sends_the_job_to_review(pipeline: Pipeline, conversation: Any) -> None:
    p = pipeline
    app = wired(p, conversation)
    app.create(18, "nobody@example.invalid")
    app.approve(18)
    p.drain()
    job = p.store.get("studio", "quote-18")
    callback = {
        "operation_id": f"{job.id}:quote",
        "status": "bounced",
        "event_id": "bounce-1",
        "detail": "550 no such user",
    }
    body = json.dumps(callback).encode()
    with TestClient(InboundApp(p.store, SECRET)) as http:
        answers = [
            http.post("/deliveries", content=body, headers=sign(SECRET, body)).json()
            for _ in range(2)  # the provider retries its webhook
        ]
    assert [(a["duplicate"], a["woke"]) for a in answers] == [(False, True), (True, False)]
    p.drain()
    job = p.store.get("studio", "quote-18")
    assert (job.state, job.wait_reason) == (
        "WAITING_REVIEW",
        "the quote email bounced: 550 no such user",
    )
    receipt = p.operations.receipt(f"{job.id}:quote")
    assert receipt is not None and receipt.delivery_status == "bounced"
    p.assert_effects("quote-18", 1)
