"""Consumer contract suite (the ``make`` fixture on PostgreSQL, SQLite and MariaDB through
``outbox_db_url``; real Redis): exactly one effect per business identity. Entries are written
with XADD in the relay's stream format, so these tests do not depend on the relay."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select

from consumer import Consumer
from consumer.admin import replay_dead_letter
from consumer.consumer import ConsumerConfig, ConsumerTx
from consumer.errors import AlreadyReplayed, DeadLetterNotFound, UndecodableEntry
from consumer.event import ConsumedEvent, decode_entry, encode_entry
from outbox.backoff import Backoff
from outbox.errors import ConfigError
from outbox.hooks import Hooks

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from cluster_support import RedisTarget, target_for
    from services import wait_for
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.cluster_support import RedisTarget, target_for
    from tests.services import wait_for

TOPIC = "quote.approved"

md = MetaData()
jobs = Table(
    "test_jobs",
    md,
    Column("id", Integer, primary_key=True, autoincrement=True),
    # Deliberately NOT unique: a duplicate effect must show up as a second row.
    Column("identity", String(200), nullable=False),
    Column("event_id", String(64), nullable=False),
)


class RecordingHooks(Hooks):
    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[Any, ...]]] = {}

    def _add(self, name: str, *args: Any) -> None:
        self.calls.setdefault(name, []).append(args)

    def consumer_handled(self, group: str, stream: str, count: int) -> None:
        self._add("handled", group, stream, count)

    def consumer_duplicate(self, group: str, count: int) -> None:
        self._add("duplicate", group, count)

    def consumer_dead_lettered(self, group: str, stream: str, count: int) -> None:
        self._add("dead", group, stream, count)

    def consumer_lag(self, group: str, stream: str, lag: int | None, pending: int) -> None:
        self._add("lag", group, stream, lag, pending)

    def consumer_cycle_ok(self, timestamp: float) -> None:
        self._add("cycle", timestamp)

    def total(self, name: str) -> int:
        return sum(int(args[-1]) for args in self.calls.get(name, []))


def publish(
    client: redis.Redis,
    stream: str,
    identity: str | None,
    event_id: str,
    *,
    topic: str = TOPIC,
    data: Any = None,
) -> str:
    fields = encode_entry(
        topic,
        data if data is not None else {"n": event_id},
        event_id=event_id,
        subject="quote-017",
        tenant="studio",
        identity=identity,
        headers={"traceid": "abc"},
        time="2025-01-02T03:04:05.678Z",
    )
    return client.xadd(stream, fields).decode()  # type: ignore[arg-type,union-attr]


def job_identities(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [row[0] for row in conn.execute(select(jobs.c.identity).order_by(jobs.c.id))]


def drain(consumer: Consumer) -> int:
    total = 0
    while (n := consumer.run_once(block=False)) > 0:
        total += n
    return total


# The cluster case runs in the whole suite (CI), not in the fast tier: the cluster costs seconds
# to start on each xdist worker.
@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.slow)])
def target(request: pytest.FixtureRequest, stream_prefix: str) -> Iterator[RedisTarget]:
    """Where this module's tests read: every test that talks to Redis runs on the shared
    Redis and on the session's Redis Cluster (issue 13: the same tests on both)."""
    yield from target_for(request, str(request.param), stream_prefix)


@pytest.fixture
def redis_url(target: RedisTarget) -> str:
    return target.consumer_url


@pytest.fixture
def redis_client(target: RedisTarget) -> Iterator[Any]:
    client = target.connect()
    yield client
    client.close()


@pytest.fixture
def stream(stream_prefix: str) -> str:
    return f"{stream_prefix}.outbox.{TOPIC}"


@pytest.fixture
def make(
    outbox_db_url: str, redis_url: str, stream_prefix: str, redis_client: redis.Redis
) -> Iterator[Callable[..., Consumer]]:
    db_url = outbox_db_url  # the inbox runs on PostgreSQL, SQLite and MariaDB
    made: list[Consumer] = []

    def factory(
        *, group: str = "billing", handler: Callable[..., Any] | None = None, **config: Any
    ) -> Consumer:
        settings: dict[str, Any] = {"block_ms": 50}
        settings.update(config)
        consumer = Consumer(
            db_url,
            redis_url,
            group=group,
            topics=[TOPIC],
            stream=f"{stream_prefix}.outbox.{{topic}}",
            config=ConsumerConfig(**settings),
            hooks=RecordingHooks(),
        )
        md.create_all(consumer.engine, checkfirst=True)

        def default(event: ConsumedEvent, tx: ConsumerTx) -> None:
            tx.session.execute(insert(jobs).values(identity=event.identity, event_id=event.id))

        consumer.add_handler(TOPIC, handler or default)
        made.append(consumer)
        return consumer

    yield factory
    for consumer in made:
        consumer.engine.dispose()


# -- deduplication -----------------------------------------------------------------------------


def test_same_identity_published_three_times_creates_one_job(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make()
    for n in range(3):
        publish(redis_client, stream, "studio:send-quote-017", f"evt-{n}")
    publish(redis_client, stream, "studio:send-quote-018", "evt-x")
    assert drain(consumer) == 4
    # And once more in a later batch: still a duplicate.
    publish(redis_client, stream, "studio:send-quote-017", "evt-3")
    assert drain(consumer) == 1
    assert sorted(job_identities(consumer.engine)) == [
        "studio:send-quote-017",
        "studio:send-quote-018",
    ]
    hooks = consumer.hooks
    assert isinstance(hooks, RecordingHooks)
    assert hooks.total("handled") == 2
    assert hooks.total("duplicate") == 3
    assert redis_client.xpending(stream, "billing")["pending"] == 0


def test_identity_defaults_to_event_id(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make()
    publish(redis_client, stream, None, "evt-1")
    publish(redis_client, stream, None, "evt-1")  # the relay republished the same event
    publish(redis_client, stream, None, "evt-2")
    assert drain(consumer) == 3
    assert sorted(job_identities(consumer.engine)) == ["evt-1", "evt-2"]


def test_entry_of_a_dead_consumer_is_claimed_back_and_handled_once(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make(claim_idle_ms=0)
    consumer.run_once(block=False)  # creates the group
    publish(redis_client, stream, "studio:a", "evt-a")
    # A consumer reads the entry and dies before acknowledging it.
    got = redis_client.xreadgroup("billing", "ghost", {stream: ">"}, count=10)
    assert len(got[0][1]) == 1  # type: ignore[index]
    assert consumer.run_once(block=False) == 1  # XAUTOCLAIM takes it over
    assert job_identities(consumer.engine) == ["studio:a"]
    assert redis_client.xpending(stream, "billing")["pending"] == 0


def test_an_empty_idle_scan_waits_half_the_claim_idle_time_before_the_next(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    """XAUTOCLAIM is not paid on every batch: once a scan of the pending list finds nothing
    idle, the next waits min(claim_idle_ms / 2, 1 s). A due entry is still claimed back."""
    consumer = make(claim_idle_ms=600)
    calls: list[float] = []
    real = consumer.redis.xautoclaim

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        return real(*args, **kwargs)

    consumer.redis.xautoclaim = counting  # type: ignore[method-assign]
    consumer.run_once(block=False)  # creates the group; the first scan finds nothing
    # Batches for 0.15 s counted from that scan, not from the end of the first batch (a
    # loaded machine may spend a while finishing it): well inside the 0.3 s pause.
    while time.monotonic() - calls[0] < 0.15:
        consumer.run_once(block=False)
    assert len(calls) == 1
    publish(redis_client, stream, "studio:a", "evt-a")
    got = redis_client.xreadgroup("billing", "ghost", {stream: ">"}, count=10)
    assert len(got[0][1]) == 1  # type: ignore[index]
    wait_for(lambda: consumer.run_once(block=False) == 1, "the idle entry claimed", timeout=20)
    assert len(calls) >= 2 and calls[1] - calls[0] >= 0.3
    assert job_identities(consumer.engine) == ["studio:a"]
    assert redis_client.xpending(stream, "billing")["pending"] == 0


def test_a_dead_peer_is_found_by_its_heartbeat_and_a_live_one_keeps_its_entries(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    # The idle claim is out of the picture (an hour): only liveness can move entries.
    def fails(event: ConsumedEvent, tx: ConsumerTx) -> None:
        raise RuntimeError("stays pending")

    live = make(handler=fails, claim_idle_ms=3_600_000)
    survivor = make(claim_idle_ms=3_600_000, heartbeat_ttl_ms=200, heartbeat_interval_ms=50)
    live.run_once(block=False)  # the group exists, and live's heartbeat key
    publish(redis_client, stream, "studio:a", "evt-a")
    assert live.run_once(block=False) == 0  # its handler failed: pending to live
    assert redis_client.exists(live.heartbeat_key(live.name))

    def live_idle_ms() -> int:
        infos = redis_client.xinfo_consumers(stream, "billing")
        return next(int(i["idle"]) for i in infos if i["name"].decode() == live.name)

    # Idle longer than the survivor's TTL, but its key is there: alive, nothing taken.
    wait_for(lambda: live_idle_ms() >= 300, "live idle past the survivor's ttl", timeout=20)
    survivor.reader.dead_peer_check.make_due()
    assert survivor.run_once(block=False) == 0
    assert job_identities(survivor.engine) == []
    [owner] = redis_client.xpending(stream, "billing")["consumers"]
    assert owner["name"].decode() == live.name

    # Its key expires (the process was killed): the survivor takes the entry at once.
    redis_client.delete(live.heartbeat_key(live.name))
    wait_for(lambda: survivor.run_once(block=False) == 1, "the survivor takes over", timeout=20)
    assert job_identities(survivor.engine) == ["studio:a"]
    assert redis_client.xpending(stream, "billing")["pending"] == 0


def test_run_keeps_a_heartbeat_and_removes_it_on_stop(
    make: Callable[..., Consumer], redis_client: redis.Redis
) -> None:
    import threading

    consumer = make(heartbeat_ttl_ms=2000, heartbeat_interval_ms=100)
    key = consumer.heartbeat_key(consumer.name)
    runner = threading.Thread(target=consumer.run, args=(threading.Event(),))
    runner.start()
    try:
        wait_for(lambda: bool(redis_client.exists(key)), "heartbeat key", timeout=20)
        assert 0 < redis_client.pttl(key) <= 2000
    finally:
        consumer.stop()
        runner.join(10)
    assert not runner.is_alive()
    assert not redis_client.exists(key)


class CrashBeforeAck(Consumer):
    """Dies (as far as Redis knows) between commit and XACK, once."""

    crashed = False

    def _acknowledge(self, outcome: Any) -> None:
        if not self.crashed:
            self.crashed = True
            raise redis.ConnectionError("simulated crash after commit")
        super()._acknowledge(outcome)


def test_entry_delivered_twice_after_commit_creates_one_job(
    db_url: str, redis_url: str, stream_prefix: str, redis_client: redis.Redis, stream: str
) -> None:
    config = ConsumerConfig(block_ms=50, claim_idle_ms=0)
    template = f"{stream_prefix}.outbox.{{topic}}"
    first = CrashBeforeAck(
        db_url, redis_url, group="billing", topics=[TOPIC], stream=template, config=config
    )
    second = Consumer(
        db_url,
        redis_url,
        group="billing",
        topics=[TOPIC],
        stream=template,
        config=config,
        hooks=RecordingHooks(),
    )
    md.create_all(first.engine, checkfirst=True)
    for c in (first, second):
        c.add_handler(
            TOPIC,
            lambda e, tx: tx.session.execute(
                insert(jobs).values(identity=e.identity, event_id=e.id)
            ),
        )
    publish(redis_client, stream, "studio:a", "evt-a")
    with pytest.raises(redis.ConnectionError):
        first.run_once(block=False)  # committed the job, never acknowledged
    assert redis_client.xpending(stream, "billing")["pending"] == 1
    # Another consumer claims the entry back: a second delivery of the same entry.
    assert second.run_once(block=False) == 1
    assert job_identities(second.engine) == ["studio:a"]
    assert isinstance(second.hooks, RecordingHooks)
    assert second.hooks.total("duplicate") == 1
    assert redis_client.xpending(stream, "billing")["pending"] == 0
    for c in (first, second):
        c.engine.dispose()


def test_duplicates_inside_one_batch_and_batch_handlers(
    db_url: str, redis_url: str, stream_prefix: str, redis_client: redis.Redis, stream: str
) -> None:
    consumer = Consumer(
        db_url,
        redis_url,
        group="billing",
        streams=[stream],
        config=ConsumerConfig(block_ms=50),
    )
    md.create_all(consumer.engine, checkfirst=True)
    batches: list[int] = []

    @consumer.handler(TOPIC, batch=True)
    def many(events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        batches.append(len(events))
        inserted = tx.insert_many(
            jobs, [{"identity": e.identity, "event_id": e.id} for e in events], returning="id"
        )
        assert len(inserted) == len(events)

    for n in range(50):
        publish(redis_client, stream, f"id-{n % 20}", f"evt-{n}")
    assert drain(consumer) == 50
    assert sorted(job_identities(consumer.engine)) == sorted(f"id-{n}" for n in range(20))
    assert batches == [20]  # one call for the batch's 20 new identities


# -- failures and dead letters -----------------------------------------------------------------


def test_failing_handler_rolls_back_only_its_entry_then_dead_letters(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    calls: list[str] = []

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        calls.append(event.identity)
        tx.session.execute(insert(jobs).values(identity=event.identity, event_id=event.id))
        if event.identity == "bad":
            raise ValueError("cannot price quote 17")

    consumer = make(handler=handler, claim_idle_ms=0, max_deliveries=3)
    for name in ("a", "b", "bad", "c", "d"):
        publish(redis_client, stream, name, f"evt-{name}")
    assert consumer.run_once(block=False) == 4
    # The others committed; the bad one's row (written before it raised) did not.
    assert sorted(job_identities(consumer.engine)) == ["a", "b", "c", "d"]
    assert redis_client.xpending(stream, "billing")["pending"] == 1
    # Claimed back (idle 0) and retried until its third delivery, then dead-lettered.
    wait_for(
        lambda: consumer.run_once(block=False) >= 0 and bool(consumer.dead_letters()),
        "dead letter",
        timeout=20,
    )
    records = consumer.dead_letters()
    assert len(records) == 1
    record = records[0]
    assert record["reason"] == "poison"
    assert record["deliveries"] == 3
    assert record["error"] == "ValueError: cannot price quote 17"
    assert record["identity"] == "bad" and record["event_id"] == "evt-bad"
    assert record["group_name"] == "billing" and record["stream"] == stream
    assert json.loads(record["payload"])["identity"] == "bad"
    dead = redis_client.xrange(consumer.dead_letter_stream_for(stream))
    assert len(dead) == 1
    fields = {k.decode(): v.decode() for k, v in dead[0][1].items()}
    assert fields["dl.reason"] == "poison"
    assert fields["dl.entry_id"] == record["entry_id"]
    assert fields["dl.record_id"] == str(record["id"])
    assert fields["id"] == "evt-bad"
    assert redis_client.xpending(stream, "billing")["pending"] == 0
    assert sorted(job_identities(consumer.engine)) == ["a", "b", "c", "d"]
    assert isinstance(consumer.hooks, RecordingHooks)
    assert consumer.hooks.total("dead") == 1


def test_malformed_entries_are_dead_lettered_and_never_crash(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make()
    consumer.run_once(block=False)
    good = encode_entry(TOPIC, {"ok": True}, event_id="evt-good", identity="good")
    bad_entries: list[dict[Any, Any]] = [
        {"foo": "bar"},  # nothing of an event
        {**good, "id": "evt-nojson", "identity": "nojson", "data": "{not json"},
        {k: v for k, v in good.items() if k != "type"} | {"id": "evt-notype"},
        {**good, "id": "evt-long", "identity": "x" * 500},
        {**good, "id": b"\xff\xfe", "identity": "binary"},
        {**good, "id": "evt-unknown", "identity": "unknown", "type": "quote.rejected"},
    ]
    for fields in bad_entries[:3]:
        redis_client.xadd(stream, fields)
    redis_client.xadd(stream, good)  # type: ignore[arg-type]
    for fields in bad_entries[3:]:
        redis_client.xadd(stream, fields)
    assert drain(consumer) == 7
    assert job_identities(consumer.engine) == ["good"]
    records = consumer.dead_letters()
    reasons = [(r["reason"], r["event_id"]) for r in records]
    assert reasons == [
        ("undecodable", None),
        ("undecodable", "evt-nojson"),
        ("undecodable", "evt-notype"),
        ("undecodable", "evt-long"),
        ("undecodable", "\ufffd\ufffd"),
        ("unknown_type", "evt-unknown"),
    ]
    assert "data: is not JSON" in records[1]["error"]
    assert "type" in records[2]["error"]
    assert "identity" in records[3]["error"]
    assert "quote.rejected" in records[5]["error"]
    assert len(redis_client.xrange(consumer.dead_letter_stream_for(stream))) == 6
    assert redis_client.xpending(stream, "billing")["pending"] == 0


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ('{"total": 1e999999}', "not storable"),  # overflows to inf
        ('{"total": NaN}', "not storable"),
        ('{"total": -Infinity}', "not storable"),
        ('{"note": "a\\u0000b"}', "NUL"),  # jsonb refuses U+0000
    ],
)
def test_data_that_can_never_be_stored_is_dead_lettered_at_decoding(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str, data: str, problem: str
) -> None:
    calls: list[str] = []

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        calls.append(event.identity)

    consumer = make(handler=handler, max_deliveries=5)
    fields = encode_entry(TOPIC, {"ok": True}, event_id="evt-bad", identity="bad")
    redis_client.xadd(stream, {**fields, "data": data})
    publish(redis_client, stream, "good", "evt-good")
    assert drain(consumer) == 2
    # First delivery, not the fifth: the handler never saw it, and nothing is pending.
    assert calls == ["good"]
    [record] = consumer.dead_letters()
    assert record["reason"] == "undecodable" and record["deliveries"] == 1
    assert record["event_id"] == "evt-bad"
    assert "data" in record["error"] and problem in record["error"]
    assert redis_client.xpending(stream, "billing")["pending"] == 0


class CountingWriter:
    """A library's buffer in the consumer's deferred-writes hook (consumer.bulk)."""

    def __init__(self, flushes: list[list[str]]) -> None:
        self.rows: list[str] = []
        self.flushes = flushes

    def flush(self, conn: sa.Connection) -> None:
        if self.rows:
            conn.execute(insert(jobs), [{"identity": i, "event_id": "-"} for i in self.rows])
            self.flushes.append(self.rows)
        self.rows = []


def test_deferred_writes_are_flushed_once_per_batch_and_dropped_with_a_failing_entry(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    from consumer.bulk import deferred_writes

    flushes: list[list[str]] = []

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        writers = deferred_writes(tx.session)
        assert writers is not None  # the consumer marks its batch session
        writer = writers.setdefault("bench", CountingWriter(flushes))
        assert isinstance(writer, CountingWriter)
        writer.rows.append(event.identity)
        if event.identity == "bad":
            raise ValueError("after buffering")

    consumer = make(handler=handler)
    for name in ("a", "b", "c"):
        publish(redis_client, stream, name, f"evt-{name}")
    assert consumer.run_once(block=False) == 3
    assert flushes == [["a", "b", "c"]]  # one write for the batch
    for name in ("d", "bad", "e"):
        publish(redis_client, stream, name, f"evt-{name}")
    flushes.clear()
    assert consumer.run_once(block=False) == 2
    # The batch failed as a whole, then ran entry by entry: the failing entry's buffered row
    # went with its savepoint, the others were written.
    assert flushes == [["d"], ["e"]]
    assert sorted(job_identities(consumer.engine)) == ["a", "b", "c", "d", "e"]
    assert redis_client.xpending(stream, "billing")["pending"] == 1


def test_savepoints_are_paid_only_when_a_handler_fails(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    """The happy path runs the batch's handlers with no savepoint; a failure rolls the batch
    back and runs it again, a savepoint per entry. A batch of one failing entry is not run a
    second time: its handler runs once per delivery."""
    calls: list[str] = []

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        calls.append(event.identity)
        tx.session.execute(insert(jobs).values(identity=event.identity, event_id=event.id))
        if event.identity.startswith("bad"):
            raise ValueError("refused")

    consumer = make(handler=handler)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement.split()[0].upper())

    sa.event.listen(consumer.engine, "before_cursor_execute", record)
    for name in ("a", "b"):
        publish(redis_client, stream, name, f"evt-{name}")
    assert consumer.run_once(block=False) == 2
    assert "SAVEPOINT" not in statements and calls == ["a", "b"]

    statements.clear()
    calls.clear()
    for name in ("c", "bad-1", "d"):
        publish(redis_client, stream, name, f"evt-{name}")
    assert consumer.run_once(block=False) == 2
    assert statements.count("SAVEPOINT") == 3  # the second pass: one per entry
    assert calls == ["c", "bad-1", "c", "bad-1", "d"]  # the first pass stopped at bad-1

    calls.clear()
    publish(redis_client, stream, "bad-2", "evt-bad-2")
    assert consumer.run_once(block=False) == 0
    assert calls == ["bad-2"]
    assert sorted(job_identities(consumer.engine)) == ["a", "b", "c", "d"]
    assert redis_client.xpending(stream, "billing")["pending"] == 2


def test_orm_objects_added_by_handlers_commit_with_their_entry(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    from sqlalchemy.orm import registry

    mapper = registry()

    class Job:
        def __init__(self, identity: str, event_id: str) -> None:
            self.identity = identity
            self.event_id = event_id

    mapper.map_imperatively(Job, jobs)

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        tx.session.add(Job(event.identity, event.id))
        if event.identity == "bad":
            raise ValueError("after add")

    consumer = make(handler=handler)
    for name in ("a", "bad", "b"):
        publish(redis_client, stream, name, f"evt-{name}")
    assert consumer.run_once(block=False) == 2
    assert sorted(job_identities(consumer.engine)) == ["a", "b"]
    mapper.dispose()


def test_unknown_types_can_be_skipped(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make(unknown_types="skip")
    publish(redis_client, stream, "x", "evt-x", topic="quote.rejected")
    publish(redis_client, stream, "y", "evt-y")
    assert drain(consumer) == 2
    assert job_identities(consumer.engine) == ["y"]
    assert consumer.dead_letters() == []
    assert redis_client.xpending(stream, "billing")["pending"] == 0


def test_entry_delivered_more_than_max_is_dead_lettered_without_running(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    calls: list[str] = []

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        calls.append(event.identity)

    consumer = make(handler=handler, claim_idle_ms=0, max_deliveries=2)
    consumer.run_once(block=False)
    publish(redis_client, stream, "killer", "evt-k")
    # Two consumers in a row took it and died (an entry that kills its process).
    redis_client.xreadgroup("billing", "ghost-1", {stream: ">"})
    redis_client.xautoclaim(stream, "billing", "ghost-2", 0, "0-0")
    assert consumer.run_once(block=False) == 1  # third delivery > max_deliveries
    assert calls == []
    [record] = consumer.dead_letters()
    assert record["reason"] == "poison" and record["deliveries"] == 3


def test_replay_reinjects_after_a_fix(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    broken = {"on": True}

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        if broken["on"]:
            raise RuntimeError("bug")
        tx.session.execute(insert(jobs).values(identity=event.identity, event_id=event.id))

    consumer = make(handler=handler, max_deliveries=1)
    publish(redis_client, stream, "q-1", "evt-1")
    assert drain(consumer) == 1
    [record] = consumer.dead_letters()
    broken["on"] = False  # the fix
    new_id = replay_dead_letter(consumer.inbox, redis_client, record["id"])
    assert drain(consumer) == 1
    assert job_identities(consumer.engine) == ["q-1"]
    assert consumer.dead_letters() == []
    [replayed] = consumer.dead_letters(include_replayed=True)
    assert replayed["state"] == "replayed" and replayed["replayed_entry_id"] == new_id
    with pytest.raises(AlreadyReplayed):
        replay_dead_letter(consumer.inbox, redis_client, record["id"])
    with pytest.raises(DeadLetterNotFound):
        replay_dead_letter(consumer.inbox, redis_client, 424242)


def _settle_all(consumer: Consumer, client: redis.Redis, stream: str) -> None:
    """Run batches (claiming back at once) until nothing is pending in the group."""
    wait_for(
        lambda: (
            consumer.run_once(block=False) >= 0
            and client.xpending(stream, "billing")["pending"] == 0
        ),
        "nothing pending",
        timeout=30,
    )


def test_one_identity_three_entries_a_later_one_is_handled_when_the_first_fails(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    """The first entry of an identity fails for good: the second is handled in its own
    right (not left pending untried and dead-lettered as "its consumers died"), the third
    is then a duplicate of a handled identity, and so is the first when it comes back."""

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        tx.session.execute(insert(jobs).values(identity=event.identity, event_id=event.id))
        if event.id == "evt-0":
            raise ValueError("cannot price quote 17")

    consumer = make(handler=handler, claim_idle_ms=0, max_deliveries=3)
    for n in range(3):
        publish(redis_client, stream, "studio:send-quote-017", f"evt-{n}")
    _settle_all(consumer, redis_client, stream)
    with consumer.engine.connect() as conn:
        assert conn.execute(select(jobs.c.event_id)).scalars().all() == ["evt-1"]
        inbox = consumer.inbox.tables.inbox
        assert conn.execute(select(inbox.c.event_id)).scalars().all() == ["evt-1"]
    assert consumer.dead_letters() == []


def test_one_identity_three_entries_all_failing_are_each_dead_lettered_for_their_own_error(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    """Every entry of the identity fails: each is dead-lettered for its own error at its
    own max_deliveries-th delivery; none is acked as a duplicate of an identity never
    handled."""

    def handler(event: ConsumedEvent, tx: ConsumerTx) -> None:
        raise ValueError(f"cannot price {event.id}")

    consumer = make(handler=handler, claim_idle_ms=0, max_deliveries=3)
    for n in range(3):
        publish(redis_client, stream, "studio:send-quote-017", f"evt-{n}")
    _settle_all(consumer, redis_client, stream)
    records = consumer.dead_letters()
    assert [(r["event_id"], r["reason"], r["deliveries"], r["error"]) for r in records] == [
        (f"evt-{n}", "poison", 3, f"ValueError: cannot price evt-{n}") for n in range(3)
    ]
    assert len(redis_client.xrange(consumer.dead_letter_stream_for(stream))) == 3
    assert isinstance(consumer.hooks, RecordingHooks)
    assert consumer.hooks.total("duplicate") == 0 and consumer.hooks.total("dead") == 3


# -- groups, streams, retention ----------------------------------------------------------------


def test_group_starts_at_the_beginning_unless_dollar(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    publish(redis_client, stream, "early", "evt-early")  # before any consumer exists
    from_start = make(group="from-start")
    from_now = Consumer(
        from_start.engine,
        redis_client,
        group="from-now",
        streams=[stream],
        start="$",
        config=ConsumerConfig(block_ms=50),
    )
    from_now.add_handler(
        TOPIC,
        lambda e, tx: tx.session.execute(
            insert(jobs).values(identity="now:" + e.identity, event_id=e.id)
        ),
    )
    assert drain(from_now) == 0
    assert drain(from_start) == 1
    publish(redis_client, stream, "late", "evt-late")
    assert drain(from_now) == 1
    assert drain(from_start) == 1
    assert sorted(job_identities(from_start.engine)) == ["early", "late", "now:late"]


def test_stream_that_does_not_exist_yet(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make()
    assert consumer.run_once(block=False) == 0
    assert redis_client.exists(stream)  # MKSTREAM: the group is there for the first entry
    publish(redis_client, stream, "first", "evt-1")
    assert drain(consumer) == 1
    # The stream is deleted under the consumer: it recreates stream and group and goes on.
    redis_client.delete(stream)
    with pytest.raises(redis.ResponseError):
        consumer.run_once(block=False)
    assert consumer.run_once(block=False) == 0
    publish(redis_client, stream, "second", "evt-2")
    assert drain(consumer) == 1
    assert job_identities(consumer.engine) == ["first", "second"]


def test_inbox_retention_is_the_dedup_window(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make(inbox_retention_seconds=3600, purge_batch=2)
    for n in range(5):
        publish(redis_client, stream, f"id-{n}", f"evt-{n}")
    drain(consumer)
    with consumer.engine.connect() as conn:
        clock = conn.execute(select(func.max(consumer.tables.inbox.c.processed_at))).scalar_one()
    assert consumer.purge_inbox(now=clock + timedelta(seconds=1800)) == 0
    assert consumer.purge_inbox(now=clock + timedelta(seconds=7200)) == 5  # 3 batches of <= 2
    publish(redis_client, stream, "id-0", "evt-again")  # outside the window: handled again
    drain(consumer)
    assert job_identities(consumer.engine).count("id-0") == 2
    assert ConsumerConfig().inbox_retention_seconds >= 7 * 24 * 3600


def test_stale_consumers_are_removed(
    make: Callable[..., Consumer], redis_client: redis.Redis, stream: str
) -> None:
    consumer = make(stale_consumer_ms=1, maintenance_interval_seconds=0.01)
    consumer.run_once(block=False)
    redis_client.xreadgroup("billing", "old-incarnation", {stream: ">"})  # nothing pending
    publish(redis_client, stream, "p", "evt-p")
    redis_client.xreadgroup("billing", "busy-incarnation", {stream: ">"})  # one pending

    def names() -> set[str]:
        return {c["name"].decode() for c in redis_client.xinfo_consumers(stream, "billing")}

    wait_for(
        lambda: consumer.run_once(block=False) >= 0 and "old-incarnation" not in names(),
        "removal",
        timeout=20,
    )
    assert "busy-incarnation" in names()  # keeps its pending entry until claimed


def test_hooks_are_called_and_guarded(
    db_url: str, redis_url: str, redis_client: redis.Redis, stream: str
) -> None:
    class Broken(RecordingHooks):
        def consumer_handled(self, group: str, stream: str, count: int) -> None:
            super().consumer_handled(group, stream, count)
            raise RuntimeError("metrics down")

    hooks = Broken()
    consumer = Consumer(
        db_url,
        redis_url,
        group="g",
        streams=[stream],
        hooks=hooks,
        config=ConsumerConfig(block_ms=50),
    )
    md.create_all(consumer.engine, checkfirst=True)
    consumer.add_handler(TOPIC, lambda e, tx: None)
    publish(redis_client, stream, "a", "evt-a")
    assert drain(consumer) == 1
    assert hooks.total("handled") == 1
    assert hooks.calls["lag"][0][:2] == ("g", stream)
    assert "cycle" in hooks.calls


# -- decoding and validation -------------------------------------------------------------------


def test_decode_entry_reads_the_relay_format() -> None:
    fields = encode_entry(
        TOPIC,
        {"total": 120},
        event_id="e1",
        subject="quote-017",
        tenant="studio",
        identity="studio:send-quote-017",
        headers={"x": "1"},
        time="2025-01-02T03:04:05Z",
    )
    fields["partitionkey"] = "7"
    fields["traceparent"] = "00-abc-def-01"
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    event = decode_entry("s", "1-0", raw, 2)
    assert (event.id, event.type, event.subject, event.tenant, event.identity) == (
        "e1",
        TOPIC,
        "quote-017",
        "studio",
        "studio:send-quote-017",
    )
    assert event.data == {"total": 120}
    assert event.headers == {"x": "1", "traceparent": "00-abc-def-01"}
    assert (event.stream, event.entry_id, event.deliveries) == ("s", "1-0", 2)
    assert event.time is not None and event.time.year == 2025
    assert event.partition_key == "7" and event.traceparent == "00-abc-def-01"
    with pytest.raises(UndecodableEntry) as info:
        decode_entry("s", "1-0", {b"id": b"x", b"type": b"t"}, 1)
    assert info.value.field == "data"


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"block_ms": -1}, "block_ms"),
        ({"max_deliveries": 0}, "max_deliveries"),
        ({"claim_idle_ms": "x"}, "claim_idle_ms"),
        ({"inbox_retention_seconds": 0}, "inbox_retention_seconds"),
        ({"heartbeat_ttl_ms": 0}, "heartbeat_ttl_ms"),
        ({"heartbeat_ttl_ms": 1000, "heartbeat_interval_ms": 1000}, "heartbeat_interval_ms"),
        ({"dead_letter_stream": "{nope}"}, "dead_letter_stream"),
        ({"unknown_types": "drop"}, "unknown_types"),
        ({"schema": "bad name"}, "schema"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        ConsumerConfig(**kwargs)
    assert info.value.setting == setting


def test_consumer_validation(sqlite_url: str) -> None:
    def build(**kwargs: Any) -> Consumer:
        settings: dict[str, Any] = {"group": "g", "topics": [TOPIC]}
        settings.update(kwargs)
        return Consumer(sqlite_url, "redis://127.0.0.1:6379/0", **settings)

    for kwargs, setting in [
        ({"group": ""}, "group"),
        ({"topics": None}, "topics"),
        ({"streams": ["s"]}, "topics"),
        ({"topics": "quote.approved"}, "topics"),
        ({"topics": []}, "topics"),
        ({"stream": "outbox.{tenant}"}, "stream"),
    ]:
        with pytest.raises(ConfigError) as info:
            build(**kwargs)
        assert info.value.setting == setting, kwargs
    with pytest.raises(ConfigError):
        Consumer(sqlite_url, "http://nope", group="g", topics=[TOPIC])
    with pytest.raises(ConfigError):
        Consumer(42, group="g", topics=[TOPIC])  # type: ignore[arg-type]
    consumer = build()
    consumer.add_handler(TOPIC, lambda e, tx: None)
    with pytest.raises(ConfigError):
        consumer.add_handler(TOPIC, lambda e, tx: None)
    with pytest.raises(ConfigError):
        build().run_once()  # no handler registered
    assert consumer.streams == ["outbox.quote.approved"]
    assert build(streams=["a", "a", "b"], topics=None).streams == ["a", "b"]


# -- jobs through the job store ----------------------------------------------------------------


def test_handler_enqueues_jobs_in_the_inbox_transaction(
    db_url: str, redis_url: str, redis_client: redis.Redis, stream: str
) -> None:
    from consumer import Store

    consumer = Consumer(
        db_url,
        redis_url,
        group="billing",
        streams=[stream],
        config=ConsumerConfig(block_ms=50, claim_idle_ms=0, max_deliveries=2),
    )
    store = Store(consumer.engine)

    @consumer.handler(TOPIC)
    def on_quote_approved(event: ConsumedEvent, tx: ConsumerTx) -> None:
        # The action is per EVENT id on purpose: without the inbox, a duplicate event of
        # the same business identity would create a second job.
        result = store.enqueue(
            event.tenant or "-",
            f"send-{event.id}",
            subject=event.subject,
            payload={"identity": event.identity},
            session=tx.session,
        )
        assert not result.duplicate
        if event.data.get("explode"):
            raise RuntimeError("after enqueue")  # the job must roll back with the inbox row

    for n in range(3):
        publish(redis_client, stream, "studio:send-quote-017", f"evt-{n}")
    publish(redis_client, stream, "studio:explodes", "evt-x", data={"explode": True})
    drain(consumer)
    wait_for(
        lambda: consumer.run_once(block=False) >= 0 and bool(consumer.dead_letters()),
        "the exploding entry dead-lettered",
        timeout=20,
    )
    with consumer.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT action, payload FROM outbox_jobs")).all()
    assert [row[0] for row in rows] == ["send-evt-0"]
    consumer.engine.dispose()


def test_batch_handler_enqueues_a_batch_of_jobs_in_one_call(
    db_url: str, redis_url: str, redis_client: redis.Redis, stream: str
) -> None:
    from consumer import Store

    consumer = Consumer(
        db_url,
        redis_url,
        group="billing",
        streams=[stream],
        config=ConsumerConfig(block_ms=50, batch_size=100),
    )
    store = Store(consumer.engine)
    batches: list[int] = []

    @consumer.handler(TOPIC, batch=True)
    def on_quotes(events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        batches.append(len(events))
        results = store.enqueue_many(
            [
                # Per EVENT id on purpose: only the inbox stands between a duplicate
                # event of one business identity and a second job.
                {"tenant": e.tenant or "-", "action": f"send-{e.id}", "subject": e.subject}
                for e in events
            ],
            session=tx.session,
        )
        assert not any(result.duplicate for result in results)

    for n in range(250):
        publish(redis_client, stream, f"studio:send-quote-{n % 200}", f"evt-{n}")
    drain(consumer)
    with consumer.engine.connect() as conn:
        actions = conn.execute(sa.text("SELECT action FROM outbox_jobs")).scalars().all()
    assert len(actions) == 200  # 250 events, 200 business identities: one job each
    assert sorted(actions) == sorted(f"send-evt-{n}" for n in range(200))
    assert sum(batches) == 200 and max(batches) > 1
    consumer.engine.dispose()


# -- outages -----------------------------------------------------------------------------------


def test_redis_outage_waits_and_recovers(db_url: str) -> None:
    import threading

    from services import PrivateRedis

    with PrivateRedis(persistent=True) as server:
        server.start()
        client = redis.Redis.from_url(server.url)
        stream = "outage.outbox.quote.approved"
        consumer = Consumer(
            db_url,
            redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=1),
            group="billing",
            streams=[stream],
            config=ConsumerConfig(block_ms=50, backoff=Backoff(0.05, 0.2)),
        )
        md.create_all(consumer.engine, checkfirst=True)
        consumer.add_handler(
            TOPIC,
            lambda e, tx: tx.session.execute(
                insert(jobs).values(identity=e.identity, event_id=e.id)
            ),
        )
        stop = threading.Event()
        runner = threading.Thread(target=consumer.run, kwargs={"stop": stop})
        runner.start()
        try:
            publish(client, stream, "before", "evt-1")
            wait_for(lambda: job_identities(consumer.engine) == ["before"], "first job", timeout=20)
            server.stop(kill=True)
            assert runner.is_alive()
            server.start()
            client = redis.Redis.from_url(server.url)
            publish(client, stream, "after", "evt-2")
            wait_for(
                lambda: job_identities(consumer.engine) == ["before", "after"],
                "recovery",
                timeout=20,
            )
            assert runner.is_alive()
        finally:
            stop.set()
            runner.join(timeout=30)
        assert not runner.is_alive()
        consumer.engine.dispose()
