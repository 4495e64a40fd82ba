"""The console on MySQL/MariaDB (issue 58): the outbox's and the inbox's pages, the trace, the
overview, the lookup indexes and the audited actions read and write a MariaDB database (real
relay, real Redis, real consumer group). The job store does not run there: the jobs' pages
are empty and their actions are refused, never a server error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from starlette.testclient import TestClient

from consumer import Consumer
from consumer.consumer import ConsumerConfig
from outbox import Outbox
from outbox.console.app import Console
from outbox.console.queries import Tables, present_tables
from outbox.console.schema import (
    audit,
    create_audit_table,
    create_lookup_indexes,
    missing_lookup_indexes,
    purge_audit,
)
from outbox.console.trace import Trace, collect
from relay import RedisStreamPublisher, Relay, RelayConfig

TOKEN = "mysql-token-" + "m" * 24
BEARER = {"Authorization": f"Bearer {TOKEN}"}
TOPIC = "quote.approved"


class MysqlWorld:
    """Quotes approved in a MariaDB outbox, a relay to Redis, a consumer group whose inbox
    is in the same MariaDB database (its handler fails for the quotes in ``failing``)."""

    def __init__(self, url: str, client: redis.Redis, prefix: str) -> None:
        self.outbox = Outbox(url)
        self.outbox.create_schema()
        self.engine = self.outbox.engine
        assert self.engine.dialect.name == "mysql"
        create_audit_table(self.engine)
        self.client = client
        self.template = f"{prefix}.{{topic}}"
        self.relay = Relay(
            self.outbox, RedisStreamPublisher(client, self.template), RelayConfig(batch_size=100)
        )
        self.consumer = Consumer(
            self.engine,
            client,
            group="billing",
            topics=[TOPIC],
            stream=self.template,
            config=ConsumerConfig(block_ms=50, batch_size=100, max_deliveries=1),
        )
        self.consumer.create_schema()
        self.failing: set[str] = set()

        @self.consumer.handler(TOPIC)
        def on_quote(event: Any, tx: Any) -> None:
            if event.subject in self.failing:
                raise RuntimeError(f"cannot handle {event.subject}")

    def approve(self, n: int, topic: str = TOPIC, payload: Any = None) -> str:
        with self.outbox.transaction() as tx:
            return tx.emit(
                topic,
                key=f"quote-{n:03d}",
                payload=payload if payload is not None else {"quote": n},
                tenant="studio",
                identity=f"studio:send-quote-{n:03d}",
            )

    def publish(self) -> None:
        while self.relay.run_once():
            pass

    def consume(self) -> None:
        while self.consumer.run_once():
            pass

    def quarantine(self, n: int, topic: str = "quote.poison") -> str:
        self.client.set(self.template.format(topic=topic), "not a stream")
        event_id = self.approve(n, topic=topic)
        self.publish()
        return event_id

    def trace(self, q: str) -> Trace:
        tables = Tables.build()
        with self.engine.connect() as conn:
            return collect(conn, tables, q, present_tables(self.engine, tables), self.client)

    def audit_rows(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(audit).order_by(audit.c.id))
            return [dict(r._mapping) for r in rows]


@pytest.fixture
def world(mysql_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[MysqlWorld]:
    w = MysqlWorld(mysql_url, redis_client, stream_prefix)
    yield w
    w.relay.store.close()
    w.engine.dispose()


@pytest.fixture
def api(world: MysqlWorld) -> Iterator[TestClient]:
    with TestClient(Console(world.engine, world.client, TOKEN).app) as client:
        yield client


def test_every_page_answers_and_the_trace_follows_an_event_to_the_inbox(
    world: MysqlWorld, api: TestClient
) -> None:
    consumed = world.approve(1, payload={"quote": 1, "note": "<script>alert(1)</script>"})
    world.publish()
    world.consume()
    world.failing.add("quote-002")
    world.approve(2)
    world.publish()
    world.consume()
    world.approve(3)
    world.publish()  # published, not consumed yet
    poison = world.quarantine(5)
    pending = world.approve(4)

    verdicts = {q: world.trace(q) for q in ("quote-001", "quote-002", "quote-003")}
    verdicts.update({q: world.trace(q) for q in (pending, poison, "quote-999")})
    assert (verdicts["quote-001"].verdict, verdicts["quote-001"].because) == (
        "in progress",
        "consumed; the jobs are not in this database, so the trace ends here",
    )
    assert [i["event_id"] for i in verdicts["quote-001"].inbox] == [consumed]
    assert verdicts["quote-001"].stream_entries[0]["fields"]["id"] == consumed
    assert verdicts["quote-002"].verdict == "needs review"
    assert verdicts["quote-002"].dead_letters[0]["error"] == "RuntimeError: cannot handle quote-002"
    assert "no consumer" in verdicts["quote-003"].because
    assert (verdicts[pending].verdict, verdicts[pending].events[0]["state"]) == (
        "not published yet",
        "pending",
    )
    assert verdicts[poison].events[0]["state"] == "quarantined"
    assert "WRONGTYPE" in verdicts[poison].events[0]["last_error"]
    assert verdicts["quote-999"].verdict == "not found"

    pages = ["/", "/trace?q=quote-001", "/events", "/jobs", "/receipts", "/dead-letters"]
    pages += ["/audit", "/queues", "/schedules", "/events?state=quarantined&preview=requeue"]
    for path in pages:
        answer = api.get(path, headers=BEARER)
        assert answer.status_code == 200, (path, answer.text[:300])
        assert "<script>" not in answer.text, path
    assert "&lt;script&gt;" in api.get("/trace?q=quote-001", headers=BEARER).text
    for path in ("/api/jobs", "/api/receipts", "/api/queues", "/api/schedules"):
        assert api.get(path, headers=BEARER).json()["rows"] == [], path

    overview = api.get("/api/overview", headers=BEARER).json()
    assert overview["events"]["pending"] == 1 and overview["events"]["quarantined"] == 1
    assert overview["events"]["oldest_unpublished_age_seconds"] >= 0
    assert [q["event_id"] for q in overview["quarantined"]] == [poison]
    assert overview["dead_letters"] == {"billing": 1}
    assert "outbox_jobs" in overview["missing_tables"]
    assert "outbox_events" not in overview["missing_tables"]
    dead = api.get("/api/dead-letters", headers=BEARER).json()["rows"]
    assert [d["identity"] for d in dead] == ["studio:send-quote-002"]


def test_the_events_list_pages_by_keyset_and_filters_with_and_without_lookup_indexes(
    world: MysqlWorld, api: TestClient
) -> None:
    ids = [world.approve(n) for n in range(10, 23)]
    world.approve(30, topic="quote.other")

    def walk(query: str) -> list[str]:
        seen: list[str] = []
        url = f"/api/events?limit=5&{query}"
        while url:
            page = api.get(url, headers=BEARER).json()
            seen += [r["event_id"] for r in page["rows"]]
            cursor = page["next_cursor"]
            url = f"/api/events?limit=5&{query}&cursor={cursor}" if cursor else ""
        return seen

    assert walk(f"topic={TOPIC}") == ids[::-1]  # newest first, every row once
    assert walk("key=quote-012&state=pending") == [ids[2]]
    missing = missing_lookup_indexes(world.engine)
    assert set(missing) >= {"ix_outbox_events_identity_seq", "ix_outbox_events_topic_seq"}
    assert sorted(create_lookup_indexes(world.engine)) == sorted(missing)
    assert missing_lookup_indexes(world.engine) == []
    assert create_lookup_indexes(world.engine) == []  # nothing left to make
    assert walk(f"topic={TOPIC}") == ids[::-1]
    assert [e["event_id"] for e in world.trace("studio:send-quote-015").events] == [ids[5]]
    assert api.get("/api/events?state=BOGUS", headers=BEARER).status_code == 400


def test_the_outbox_and_inbox_actions_are_audited_and_the_job_actions_refused(
    world: MysqlWorld, api: TestClient
) -> None:
    poison = [world.quarantine(n) for n in (40, 41, 42)]
    world.failing.add("quote-043")
    world.approve(43)
    world.publish()
    world.consume()
    world.failing.clear()

    def post(path: str, **body: Any) -> Any:
        return api.post(path, headers=BEARER, json={"reason": "ticket 7", "by": "ann", **body})

    world.client.delete(world.template.format(topic="quote.poison"))  # the fix
    done = post(f"/api/events/{poison[0]}/requeue")
    assert done.status_code == 200, done.text
    assert (done.json()["before"]["state"], done.json()["after"]["state"]) == (
        "quarantined",
        "pending",
    )
    assert post(f"/api/events/{poison[0]}/requeue").status_code == 409  # pending now
    body = {"filters": {"state": "quarantined", "topic": "quote.poison"}}
    preview = post("/api/bulk/requeue", **body).json()
    assert (preview["count"], preview["confirmed"]) == (2, False)
    assert sorted(post("/api/bulk/requeue", **body, confirm=True).json()["done"]) == sorted(
        poison[1:]
    )
    dl_id = api.get("/api/dead-letters", headers=BEARER).json()["rows"][0]["id"]
    replayed = post(f"/api/dead-letters/{dl_id}/replay")
    assert replayed.json()["after"]["state"] == "replayed", replayed.text
    world.consume()
    assert world.trace("quote-043").inbox  # handled this time
    world.publish()
    assert [world.trace(i).events[0]["state"] for i in poison] == ["published"] * 3

    rows = world.audit_rows()
    assert [(r["action"], r["outcome"][:7]) for r in rows] == [
        ("requeue", "ok"),
        ("requeue", "refused"),
        ("requeue", "ok"),
        ("requeue", "ok"),
        ("replay", "ok"),
    ]
    assert all(r["actor"] == "ann" and r["reason"] == "ticket 7" for r in rows)
    assert json.loads(rows[0]["before"])["state"] == "quarantined"

    for path, extra in (
        ("/api/jobs/1/cancel", {}),
        ("/api/jobs/1/resume", {}),
        ("/api/receipts/1:email/settle", {"accepted": "msg-1"}),
        ("/api/queues/default/pause", {}),
        ("/api/schedules/nightly/resume", {}),
    ):
        refused = post(path, **extra)
        assert refused.status_code == 404, (path, refused.text)
        assert "job store is not in this database" in refused.json()["error"]
    assert len(world.audit_rows()) == len(rows)  # a refused kind of target is not audited

    with world.engine.begin() as conn:
        conn.execute(
            sa.update(audit).where(audit.c.id == rows[0]["id"]).values(at=audit.c.at - 7200)
        )
    assert purge_audit(world.engine, 3600, 100) == 1
    assert len(world.audit_rows()) == len(rows) - 1


def test_read_only_refuses_every_action_on_mysql(world: MysqlWorld) -> None:
    poison = world.quarantine(50)
    console = Console(world.engine, world.client, TOKEN, read_only=True)
    with TestClient(console.app) as api:
        for path in (f"/api/events/{poison}/requeue", "/api/jobs/1/cancel"):
            answer = api.post(path, headers=BEARER, json={"reason": "try"})
            assert answer.status_code == 403, path
        assert "Read-only" in api.get("/", headers=BEARER).text
    assert world.trace(poison).events[0]["state"] == "quarantined"
    assert world.audit_rows() == []
