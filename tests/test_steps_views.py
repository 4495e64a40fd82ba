"""Steps as operators see them (issue 57): the console's trace API shows each job's parents
and children with their states, and its result; ``outbox-worker jobs show TENANT ACTION`` prints
the same, as text or JSON."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

from starlette.testclient import TestClient

import consumer.jobs.cli
from consumer import Store
from outbox.console.app import Console
from outbox.console.queries import Tables, present_tables
from outbox.console.render import print_trace
from outbox.console.trace import collect

TOKEN = "test-token-" + "x" * 20


def _diamond(store: Store) -> None:
    store.enqueue_many(
        [
            {"tenant": "t", "action": "a"},
            {"tenant": "t", "action": "b", "after": [("t", "a")]},
            {"tenant": "t", "action": "c", "after": [("t", "a")]},
            {"tenant": "t", "action": "d", "after": [("t", "b"), ("t", "c")]},
        ]
    )
    epoch = store.claim("t", "a", "w")
    store.finish("t", "a", "w", epoch, result={"quote": 42})


def test_the_trace_shows_parents_children_and_the_result(db_url: str) -> None:
    store = Store(db_url)
    _diamond(store)
    ids = {x: store.get("t", x).id for x in "abcd"}
    with TestClient(Console(store.engine, None, TOKEN).app) as api:
        answer = api.get(
            "/api/trace", params={"q": str(ids["a"])}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert answer.status_code == 200, answer.text
    [job] = [j for j in answer.json()["jobs"] if j["id"] == ids["a"]]
    assert job["result"] == {"quote": 42} and job["parents"] == []
    assert job["children"] == [
        {"id": ids["b"], "tenant": "t", "action": "b", "state": "READY"},
        {"id": ids["c"], "tenant": "t", "action": "c", "state": "READY"},
    ]
    tables = Tables.build()
    with store.engine.connect() as conn:
        trace = collect(conn, tables, str(ids["d"]), present_tables(store.engine, tables))
    [d] = trace.jobs
    assert [p["action"] for p in d["parents"]] == ["b", "c"] and d["children"] == []
    assert {p["state"] for p in d["parents"]} == {"READY"}
    out = io.StringIO()
    print_trace(trace, out)
    assert "parent" in out.getvalue() and "WAITING_PARENTS" in out.getvalue()
    store.dispose()


def test_outbox_worker_job_prints_the_graph(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    _diamond(store)
    store.dispose()
    out = io.StringIO()
    with redirect_stdout(out):
        code = consumer.jobs.cli.main(
            ["jobs", "show", "t", "b", "--json", "--database-url", sqlite_url]
        )
    assert code == 0
    shown = json.loads(out.getvalue())
    assert shown["state"] == "READY" and shown["parents_pending"] == 0
    assert [p["action"] for p in shown["parents"]] == ["a"]
    assert [(c["action"], c["state"]) for c in shown["children"]] == [("d", "WAITING_PARENTS")]
    out = io.StringIO()
    with redirect_stdout(out):
        assert consumer.jobs.cli.main(["jobs", "show", "t", "a", "--database-url", sqlite_url]) == 0
    text = out.getvalue()
    assert 'result: {"quote": 42}' in text and "t/b READY" in text and "parents: none" in text
    assert (
        consumer.jobs.cli.main(["jobs", "show", "t", "nobody", "--database-url", sqlite_url]) == 1
    )
