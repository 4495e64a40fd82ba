"""A graph of steps as operators see it (issue 57), on PostgreSQL and SQLite:
``Store.step_graph`` (``consumer.jobs.step_graph``) walks every job joined to one by steps,
places each at its level and counts the progress; ``outbox-worker jobs graph`` prints it and
the console shows it at ``/graph`` and ``/api/graph`` (``outbox.console.lines``), linked from
each job of the trace page."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
from starlette.testclient import TestClient

import consumer.jobs.cli
from consumer import Store
from consumer.errors import JobError, JobNotFound
from outbox.console.app import Console

TOKEN = "test-token-" + "x" * 20
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def _flow(store: Store) -> dict[str, int]:
    """quote -> reply -> (deposit, reminder) -> booking; and a job outside the graph."""
    store.enqueue_many(
        [
            {"tenant": "acme", "action": "quote"},
            {"tenant": "acme", "action": "reply", "after": [("acme", "quote")]},
            {"tenant": "acme", "action": "deposit", "after": [("acme", "reply")]},
            {"tenant": "acme", "action": "reminder", "after": [("acme", "reply")]},
            {
                "tenant": "acme",
                "action": "booking",
                "after": [("acme", "deposit"), ("acme", "reply")],
            },
            {"tenant": "acme", "action": "unrelated"},
        ]
    )
    for action in ("quote", "reply"):
        epoch = store.claim("acme", action, "w")
        store.finish("acme", action, "w", epoch, result={"step": action})
    store.claim("acme", "deposit", "w")  # running
    return {
        a: store.get("acme", a).id for a in ("quote", "reply", "deposit", "reminder", "booking")
    }


def test_the_graph_of_any_of_its_jobs_is_the_whole_graph(db_url: str) -> None:
    store = Store(db_url)
    ids = _flow(store)
    for action in ("quote", "booking", "reminder"):
        graph = store.step_graph("acme", action)
        assert graph.root == ids[action] and not graph.truncated
        assert [(j["action"], j["level"]) for j in graph.jobs] == [
            ("quote", 0),
            ("reply", 1),
            ("deposit", 2),
            ("reminder", 2),
            ("booking", 3),
        ]
    by_action = {j["action"]: j for j in graph.jobs}
    assert by_action["booking"]["parents"] == [ids["reply"], ids["deposit"]]
    assert by_action["booking"]["parents_pending"] == 1
    assert by_action["reply"]["children"] == [ids["deposit"], ids["reminder"], ids["booking"]]
    assert graph.progress() == {
        "total": 5,
        "done": 2,
        "cancelled": 0,
        "finished": 2,
        "running": 1,
        "ready": 1,
        "waiting": 1,
        "stuck": 0,
        "other": 0,
    }
    assert graph.summary() == "2 of 5 steps done, 1 running, 1 ready, 1 waiting for parents"
    edges = graph.as_dict()["edges"]
    assert {"parent": ids["quote"], "child": ids["reply"], "released": True} in edges
    assert {"parent": ids["deposit"], "child": ids["booking"], "released": False} in edges
    lone = store.step_graph("acme", "unrelated")
    assert [j["action"] for j in lone.jobs] == ["unrelated"] and lone.edges == []
    with pytest.raises(JobNotFound):
        store.step_graph("acme", "nobody")
    with pytest.raises(JobError):
        store.step_graph("acme", "quote", limit=0)
    store.dispose()


def test_a_graph_larger_than_the_limit_is_cut_and_says_so(db_url: str) -> None:
    store = Store(db_url)
    chain = [{"tenant": "t", "action": "s-0"}]
    chain += [
        {"tenant": "t", "action": f"s-{i}", "after": [("t", f"s-{i - 1}")]} for i in range(1, 30)
    ]
    store.enqueue_many(chain)
    graph = store.step_graph("t", "s-10", limit=5)
    assert graph.truncated and len(graph.jobs) == 5
    assert {j["action"] for j in graph.jobs} == {"s-8", "s-9", "s-10", "s-11", "s-12"}
    assert graph.summary().endswith("(the first of a larger graph)")
    whole = store.step_graph("t", "s-10")
    assert not whole.truncated and [j["level"] for j in whole.jobs] == list(range(30))
    store.dispose()


def test_outbox_worker_jobs_graph_prints_the_progress_and_the_levels(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    ids = _flow(store)
    store.dispose()
    out = io.StringIO()
    with redirect_stdout(out):
        code = consumer.jobs.cli.main(
            ["jobs", "graph", "acme", "deposit", "--database-url", sqlite_url]
        )
    assert code == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "2 of 5 steps done, 1 running, 1 ready, 1 waiting for parents"
    assert lines[1] == f"  #{ids['quote']} acme/quote DONE"
    assert lines[3] == f"*     #{ids['deposit']} acme/deposit LEASED after acme/reply"
    assert lines[5] == (
        f"        #{ids['booking']} acme/booking WAITING_PARENTS after acme/reply, acme/deposit"
    )
    out = io.StringIO()
    with redirect_stdout(out):
        code = consumer.jobs.cli.main(
            ["jobs", "graph", str(ids["booking"]), "--json", "--database-url", sqlite_url]
        )
    shown = json.loads(out.getvalue())
    assert code == 0 and shown["root"] == ids["booking"] and shown["progress"]["total"] == 5
    assert shown["counts"] == {"DONE": 2, "LEASED": 1, "READY": 1, "WAITING_PARENTS": 1}
    args = ["jobs", "graph", "acme", "nobody", "--database-url", sqlite_url]
    assert consumer.jobs.cli.main(args) == 1


def test_the_console_shows_the_graph_and_links_it_from_the_trace(db_url: str) -> None:
    store = Store(db_url)
    ids = _flow(store)
    with TestClient(Console(store.engine, None, TOKEN).app) as api:
        answer = api.get("/api/graph", params={"job": ids["reminder"]}, headers=BEARER)
        assert answer.status_code == 200, answer.text
        graph = answer.json()
        assert graph["root"] == ids["reminder"] and graph["progress"]["done"] == 2
        assert graph["jobs"][0]["action"] == "quote"
        page = api.get("/graph", params={"job": ids["booking"]}, headers=BEARER)
        assert page.status_code == 200
        assert "2 of 5 steps done, 1 running, 1 ready, 1 waiting for parents" in page.text
        assert f'<a href="/graph?job={ids["deposit"]}">acme/deposit</a>' in page.text
        assert "1 parent(s) not DONE" in page.text
        trace = api.get("/trace", params={"q": str(ids["reply"])}, headers=BEARER)
        assert f'<a href="/graph?job={ids["reply"]}">' in trace.text
        assert "after <a" in trace.text and "before <a" in trace.text
        for params, status in (
            ({"job": "999999"}, 404),
            ({"job": "x"}, 400),
            ({}, 400),
            ({"job": ids["quote"], "limit": "0"}, 400),
        ):
            assert api.get("/api/graph", params=params, headers=BEARER).status_code == status
        assert api.get("/api/graph", params={"job": ids["quote"]}).status_code == 401
        assert api.get("/graph", params={"job": "999999"}, headers=BEARER).status_code == 400
    store.dispose()
