"""An order key's line as operators see it (issue 56), on PostgreSQL and SQLite: the console's
``/keys`` page and ``/api/keys`` (``outbox.console.lines``), linked from a job's trace, and
``outbox-worker jobs keys KEY``, the spelling beside the other job commands (``outbox-worker
keys KEY`` stays)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from consumer import Store
from consumer.jobs.cli import main
from outbox.console.app import Console

TOKEN = "test-token-" + "x" * 20
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def _line(store: Store) -> list[int]:
    ids = [store.enqueue("acme", f"send-{i}", order_key="invoice/42").job_id for i in range(4)]
    lease = store.claim_batch("w", 5)[0]
    store.wait_external(lease, reason="customer reply")
    return ids


def test_the_console_shows_a_keys_line(db_url: str) -> None:
    store = Store(db_url)
    ids = _line(store)
    with TestClient(Console(store.engine, None, TOKEN).app) as api:
        answer = api.get("/api/keys", params={"key": "invoice/42", "limit": 2}, headers=BEARER)
        assert answer.status_code == 200, answer.text
        line = answer.json()
        assert line["head"]["id"] == ids[0] and line["head"]["state"] == "WAITING_EXTERNAL"
        assert line["holding"] is True and line["held_count"] == 3
        assert [j["id"] for j in line["held"]] == ids[1:3]
        page = api.get("/keys", params={"key": "invoice/42"}, headers=BEARER)
        assert page.status_code == 200
        assert "WAITING_EXTERNAL (customer reply); 3 job(s) HELD behind it" in page.text
        assert f'<a href="/trace?q={ids[3]}">{ids[3]}</a>' in page.text
        assert "<td>customer reply</td>" in page.text
        trace = api.get("/trace", params={"q": str(ids[2])}, headers=BEARER)
        assert '<a href="/keys?key=invoice/42">its line</a>' in trace.text
        for params, status in (
            ({"key": "no-such-key"}, 404),
            ({}, 400),
            ({"key": "invoice/42", "limit": "0"}, 400),
            ({"key": "x" * 300}, 400),
        ):
            assert api.get("/api/keys", params=params, headers=BEARER).status_code == status
        assert api.get("/api/keys", params={"key": "invoice/42"}).status_code == 401
    store.cancel(ids[0], reason="obsolete")
    with TestClient(Console(store.engine, None, TOKEN).app) as api:
        line = api.get("/api/keys", params={"key": "invoice/42"}, headers=BEARER).json()
    assert line["head"]["id"] == ids[1] and line["held_count"] == 2
    store.dispose()


def test_outbox_worker_jobs_keys_is_outbox_worker_keys(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = Store(db_url)
    ids = _line(store)
    store.dispose()
    outputs = []
    for argv in (["jobs", "keys", "invoice/42"], ["keys", "invoice/42"]):
        assert main([*argv, "--json", "--database-url", db_url]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and outputs[0]["head"]["id"] == ids[0]
    assert main(["jobs", "keys", "invoice/42", "--limit", "1", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert f"1. job {ids[1]} (acme/send-1) HELD" in out and "... and 2 more" in out
    assert main(["jobs", "keys", "no-such-key", "--database-url", db_url]) == 1
    assert main(["jobs", "keys", "a", "b", "--database-url", db_url]) == 2
    cancel = ["jobs", "cancel", str(ids[3]), "--reason", "x", "--limit", "3"]
    assert main([*cancel, "--database-url", db_url]) == 2  # --limit is for graph and keys
    assert Store(db_url).get("acme", "send-3").state == "HELD"
