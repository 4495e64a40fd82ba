"""The console in a real browser (Debian's chromium driven by Playwright): sign in, find a
quote that was sent and one whose receipt is UNKNOWN by their business identity, settle the
UNKNOWN one through the page's form, requeue a quarantined event, pause and resume a job
queue, no console errors on any page, and a payload holding a script tag stays inert. The
flow runs with JavaScript turned off (the pages need none); the checks for errors and for the
inert script run with it on.

Screenshots of the overview and a trace go to ``OUTBOX_CONSOLE_SCREENSHOTS`` (a directory;
the docs keep theirs in docs/images/), else the test's temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from playwright.sync_api import Browser, Page, sync_playwright

from tests.console_process import ConsoleProcess
from tests.console_support import World

CHROMIUM = "/usr/bin/chromium"
TOKEN = "browser-token-" + "y" * 24
SCRIPT = "<script>window.__pwned = 1</script>"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert os.path.exists(CHROMIUM), "Debian's chromium is missing (apt-get install chromium)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def world(pg_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[World]:
    w = World(pg_url, redis_client, stream_prefix)
    yield w
    w.close()


def _watch(page: Page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def _shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("OUTBOX_CONSOLE_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def test_operator_flow_in_a_browser(
    browser: Browser, world: World, pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    world.through_consumer(1)
    world.send(1)  # quote 1: sent (ACCEPTED receipt)
    world.through_consumer(2)
    lease, _ = world.send(2, "timeout")  # quote 2: the provider may have sent it (UNKNOWN)
    for n in (3, 4):
        world.through_consumer(n)
    world.send(3, "timeout")
    poisoned = world.quarantine(5)
    world.through_consumer(6, payload={"quote": 6, "note": SCRIPT})
    shots = _shots(tmp_path)
    with ConsoleProcess(pg_url, redis_url, token=TOKEN) as console:
        context = browser.new_context(
            java_script_enabled=False, viewport={"width": 1400, "height": 900}
        )
        page = context.new_page()
        errors = _watch(page)
        # Sign in through the form.
        assert page.goto(console.url + "/").status == 401
        assert errors == [
            "Failed to load resource: the server responded with a status of 401 (Unauthorized)"
        ]
        errors.clear()  # that one was asked for: a page before signing in
        page.fill("input[name=token]", TOKEN)
        page.click("button:has-text('Sign in')")
        assert page.url == console.url + "/"
        assert page.inner_text("h1") == "Overview"
        page.screenshot(path=str(shots / "console-overview.png"), full_page=True)
        # Find the sent quote by its business identity.
        page.fill("nav input[name=q]", "studio:send-quote-001")
        page.click("nav button:has-text('Trace')")
        assert page.inner_text("#verdict") == "sent"
        # And the UNKNOWN one.
        page.fill("nav input[name=q]", "studio:send-quote-002")
        page.click("nav button:has-text('Trace')")
        assert page.inner_text("#verdict") == "unknown"
        page.screenshot(path=str(shots / "console-trace.png"), full_page=True)
        # Settle it through the page's form: the provider's log shows msg-2 was sent.
        form = page.locator("form.settle")
        form.locator("input[name=accepted]").fill("msg-2")
        form.locator("input[name=reason]").fill("provider log shows msg-2 delivered")
        form.locator("button:has-text('Settle')").click()
        assert "settle" in page.inner_text(".notice")
        assert page.inner_text("#verdict") == "sent"
        assert "provider log shows msg-2 delivered" in page.inner_text("body")
        receipt = world.ops.receipt(f"{lease.job_id}:email")
        assert receipt is not None and (receipt.state, receipt.provider_ref) == (
            "ACCEPTED",
            "msg-2",
        )
        # Requeue the quarantined event from the events list, after the fix.
        world.client.delete(world.stream_template.format(topic="quote.poison"))
        page.goto(console.url + "/events?state=quarantined")
        row = page.locator("tr", has_text=poisoned)
        row.locator("input[name=reason]").fill("stream key fixed")
        row.locator("button:has-text('Requeue')").click()
        assert "requeue" in page.inner_text(".notice")
        world.publish()
        page.goto(console.url + f"/trace?q={poisoned}")
        assert page.inner_text("#verdict") == "in progress"  # published, no consumer yet
        # Pause the default queue from the queues page (no worker claims from it), resume it.
        page.goto(console.url + "/queues")
        row = page.locator("tr", has_text="default")
        row.locator("input[name=reason]").fill("mail provider outage")
        row.locator("button:has-text('Pause')").click()
        assert "pause default" in page.inner_text(".notice")
        assert world.store.paused_queues() == ["default"]
        row = page.locator("tr", has_text="default")
        assert "paused" in row.inner_text()
        row.locator("input[name=reason]").fill("outage over")
        row.locator("button:has-text('Resume')").click()
        assert world.store.paused_queues() == []
        page.goto(console.url + "/audit")
        audit = page.inner_text("table")
        assert "settle" in audit and "requeue" in audit and "stream key fixed" in audit
        assert "mail provider outage" in audit and "outage over" in audit
        assert errors == []
        context.close()

        # JavaScript on: no page logs an error, and the payload's script never runs.
        context = browser.new_context()
        page = context.new_page()
        errors = _watch(page)
        page.goto(console.url + f"/login?token={TOKEN}")
        visited: list[Any] = []
        for path in ("/", "/trace?q=quote-006", "/events", "/jobs", "/receipts", "/queues"):
            visited.append(page.goto(console.url + path).status)
        visited.append(page.goto(console.url + "/dead-letters").status)
        visited.append(page.goto(console.url + "/audit").status)
        visited.append(page.goto(console.url + "/jobs?state=WAITING_REVIEW&preview=cancel").status)
        assert visited == [200] * 9
        page.goto(console.url + "/trace?q=quote-006")
        assert page.evaluate("window.__pwned") is None
        assert SCRIPT in page.inner_text("body") or "__pwned" in page.inner_text("body")
        assert page.locator("script").count() == 0
        assert errors == []
        context.close()


def test_a_graph_of_steps_and_a_keys_line_in_a_browser(
    browser: Browser, pg_url: str, redis_url: str
) -> None:
    """Issues 57 and 56: from a job's trace to its graph (the progress, each job by level,
    its parents as links) and to its order key's line, by the links, JavaScript off; then
    the same pages with it on log no error."""
    from consumer import Store

    store = Store(pg_url)
    store.enqueue_many(
        [
            {"tenant": "acme", "action": "quote", "order_key": "invoice-7"},
            {"tenant": "acme", "action": "reply", "after": [("acme", "quote")]},
            {"tenant": "acme", "action": "book", "after": [("acme", "reply")]},
            {"tenant": "acme", "action": "remind", "order_key": "invoice-7"},
        ]
    )
    epoch = store.claim("acme", "quote", "w")
    store.finish("acme", "quote", "w", epoch, result={"quote": 7})
    reply = store.get("acme", "reply").id
    store.dispose()
    with ConsoleProcess(pg_url, redis_url, token=TOKEN) as console:
        context = browser.new_context(java_script_enabled=False)
        page = context.new_page()
        errors = _watch(page)
        page.goto(console.url + f"/login?token={TOKEN}")
        page.goto(console.url + f"/trace?q={reply}")
        page.click("text=The whole graph and its progress")
        assert page.url == console.url + f"/graph?job={reply}"
        assert page.inner_text("p.progress") == "1 of 3 steps done, 1 ready, 1 waiting for parents."
        rows = page.locator("tbody tr").all_inner_texts()
        assert [r.split("\t")[3] for r in rows] == ["quote", "reply", "book"]
        page.click("tbody tr >> nth=2 >> text=acme/reply")  # book's parent: its own graph
        assert page.url == console.url + f"/graph?job={reply}"
        page.click("tbody tr >> nth=0 >> a >> nth=0")  # quote's trace
        page.click("text=its line")
        assert page.url == console.url + "/keys?key=invoice-7"
        line = page.inner_text("p.progress")  # quote finished: remind runs next
        assert "(acme/remind) is READY; 0 job(s) HELD behind it" in line
        assert errors == []
        context.close()
        context = browser.new_context()
        page = context.new_page()
        errors = _watch(page)
        page.goto(console.url + f"/login?token={TOKEN}")
        for path in (f"/graph?job={reply}", "/keys?key=invoice-7"):
            assert page.goto(console.url + path).status == 200
        assert errors == []
        context.close()
