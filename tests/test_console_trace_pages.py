"""A trace pages its rows and caps its values (issue 53: "a trace loads whole rows: 8 dead
letters of 20 MB gave a 168 MB /api/trace and 970 MB of console memory"), on PostgreSQL and
SQLite.

- Long values (payloads, errors) are cut in the database to VALUE_CHARS characters, with
  their whole size and the path of their whole value beside them; ``/api/trace/value``
  answers that value whole, equal to what was written.
- A flow with more events than a page (one key, 120 events) is walked page by page through
  ``next_cursor``: every event once, in order, and the last page says it is the last. The
  HTML page links to the next.
- A bad cursor, limit, kind, id or column is a 400 (a record that is not there a 404).
- An identity collision: an event dropped as a duplicate of another event's identity reads
  "dropped as a duplicate", naming the event that took the identity (it read "in progress:
  consumed, and no job found for it yet"); traced by the identity, both events show and the
  reason names the one dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

from outbox.console.app import Console
from outbox.console.queries import encode_cursor
from outbox.console.schema import create_audit_table
from outbox.console.trace_cap import VALUE_CHARS
from tests.console_support import TENANT, TOPIC, World

TOKEN = "test-token-" + "y" * 20
BEARER = {"Authorization": f"Bearer {TOKEN}"}
BIG = 300_000  # characters of each big value: 8 of them would be 2.4 MB whole


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


def _get(api: TestClient, path: str, **params: Any) -> Any:
    answer = api.get(path, params=params or None, headers=BEARER)  # a path may hold its query
    assert answer.status_code == 200, answer.text[:500]
    return answer


def test_big_values_are_cut_in_the_trace_and_whole_on_request(
    world: World, api: TestClient
) -> None:
    text = "x" * BIG
    event_ids = []
    for n in range(1, 9):  # 8 dead letters of a big payload, as in the finding
        world.failing.add(f"{TENANT}:send-quote-{n:03d}")
        event_ids.append(world.through_consumer(n, payload={"blob": text, "n": n}))
    world.failing.clear()
    # One key for all eight: one trace finds them all.
    with world.engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE {world.outbox.table.name} SET key = 'quote-big'")
    answer = _get(api, "/api/trace", q="quote-big")
    assert len(answer.content) < 200_000  # 16 values of 300,000 characters, cut
    trace = answer.json()
    assert len(trace["events"]) == 8 and len(trace["dead_letters"]) == 8
    for event in trace["events"]:
        cut = event["payload_capped"]
        assert cut["shown"] == VALUE_CHARS and cut["chars"] >= BIG
        assert isinstance(event["payload"], str) and len(event["payload"]) == VALUE_CHARS
        whole = _get(api, cut["whole"]).json()["value"]  # the path the trace gives
        assert whole == {"blob": text, "n": whole["n"]}
    letter = trace["dead_letters"][0]
    assert letter["payload_capped"]["chars"] >= BIG
    whole_letter = _get(api, letter["payload_capped"]["whole"]).json()["value"]
    assert text in whole_letter and len(whole_letter) == letter["payload_capped"]["chars"]
    page = _get(api, "/trace", q="quote-big").text
    assert f"first {VALUE_CHARS} of" in page and "/api/trace/value?kind=event" in page
    assert len(page) < 300_000


def test_a_small_value_is_whole_and_decoded(world: World, api: TestClient) -> None:
    event_id = world.through_consumer(1, payload={"quote": 1, "note": "small"})
    trace = _get(api, "/api/trace", q=event_id).json()
    (event,) = trace["events"]
    assert event["payload"] == {"quote": 1, "note": "small"}
    assert "payload_capped" not in event
    (job,) = trace["jobs"]
    assert job["payload"] == {"quote": 1, "note": "small"}  # JSON, decoded as before


def test_a_long_flow_is_walked_page_by_page(world: World, api: TestClient) -> None:
    with world.outbox.transaction() as tx:
        for n in range(120):
            tx.emit("quote.other", key="quote-long", payload={"n": n}, identity=f"long-{n}")
    seen: list[int] = []
    sizes = []
    cursor = None
    for _ in range(10):
        params = {"q": "quote-long", "limit": "50", **({"cursor": cursor} if cursor else {})}
        trace = _get(api, "/api/trace", **params).json()
        sizes.append(len(trace["events"]))
        seen += [int(e["seq"]) for e in trace["events"]]
        cursor = trace["next_cursor"]
        if cursor is None:
            break
    assert sizes == [50, 50, 20]
    assert seen == sorted(seen) and len(set(seen)) == 120
    first = _get(api, "/trace", q="quote-long", limit="50").text
    assert 'rel="next"' in first and "cursor=" in first
    small = _get(api, "/api/trace", q="quote-long", limit="7").json()
    assert len(small["events"]) == 7 and small["next_cursor"]
    beyond = encode_cursor([10**12, 10**12])  # past the flow's end: empty, not "not found"
    assert _get(api, "/api/trace", q="quote-long", cursor=beyond).json()["events"] == []
    assert (
        api.get("/trace", params={"q": "quote-long", "cursor": beyond}, headers=BEARER).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/api/trace", {"q": "x", "cursor": "not-a-cursor"}, 400),
        ("/api/trace", {"q": "x", "limit": "0"}, 400),
        ("/api/trace", {"q": "x", "limit": "51"}, 400),
        ("/api/trace", {"q": "x", "limit": "\u00b2"}, 400),
        ("/api/trace/value", {"kind": "nope", "id": "1", "column": "payload"}, 400),
        ("/api/trace/value", {"kind": "event", "id": "1", "column": "key"}, 400),
        ("/api/trace/value", {"kind": "event", "id": "1e9", "column": "payload"}, 400),
        ("/api/trace/value", {"kind": "event", "id": "99999999", "column": "payload"}, 404),
        ("/api/trace/value", {"kind": "receipt", "id": "a\x00b", "column": "last_error"}, 400),
    ],
)
def test_bad_paging_and_value_parameters_are_4xx(
    api: TestClient, path: str, params: dict[str, str], status: int
) -> None:
    answer = api.get(path, params=params, headers=BEARER)
    assert answer.status_code == status, answer.text
    assert "error" in json.loads(answer.text)


def test_an_identity_collision_reads_dropped_as_a_duplicate(world: World, api: TestClient) -> None:
    first = world.through_consumer(1)  # identity studio:send-quote-001, its job made
    identity = f"{TENANT}:send-quote-001"
    with world.outbox.transaction() as tx:  # another fact under the same identity
        second = tx.emit(
            TOPIC, key="quote-other", payload={"n": 2}, tenant=TENANT, identity=identity
        )
    world.publish()
    world.consume()  # the group drops it: its identity is in the inbox already
    dropped = _get(api, "/api/trace", q=second).json()
    assert dropped["verdict"] == "dropped as a duplicate", dropped["because"]
    assert first in dropped["because"] and "billing" in dropped["because"]
    both = _get(api, "/api/trace", q=identity).json()
    assert {e["event_id"] for e in both["events"]} == {first, second}
    assert both["verdict"] == "in progress"  # the first event's job, READY
    assert f"event {second} carries identity" in both["because"]
    alone = _get(api, "/api/trace", q=first).json()
    assert alone["verdict"] == "in progress" and "duplicate" not in alone["because"]
    page = _get(api, "/trace", q=second).text
    assert "verdict-dropped-as-a-duplicate" in page
