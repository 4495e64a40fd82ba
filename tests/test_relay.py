"""The relay against real PostgreSQL, SQLite and Redis: entries, order, failures, receipts.
(What holds on every broker is in the broker contract suite, tests/test_brokers.py.)

Contract tests take ``outbox_db_url`` (PostgreSQL, SQLite and MariaDB); PostgreSQL-only
behaviour takes ``pg_url``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from outbox import Outbox
from outbox.backoff import Backoff
from relay import (
    ConfigError,
    RedisStreamPublisher,
    Relay,
    RelayConfig,
)
from tests.services import wait_for

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from cluster_support import RedisTarget, target_for
    from services import PrivateRedis
except ImportError:  # pragma: no cover
    from tests.cluster_support import RedisTarget, target_for
    from tests.services import PrivateRedis


def fast_config(**overrides: Any) -> RelayConfig:
    values: dict[str, Any] = {
        "publish_deadline": 0.5,
        "clock_margin": 0.2,
        "record_backoff": Backoff(0.05, 0.2),
        "rebalance_interval": 0.1,
    }
    values.update(overrides)
    return RelayConfig(**values)


def entries(client: redis.Redis, stream: str) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode() for k, v in fields.items()} for _id, fields in client.xrange(stream)
    ]


def rows(outbox: Outbox) -> list[dict[str, Any]]:
    with outbox.engine.connect() as conn:
        result = conn.execute(
            sa.text(
                'SELECT seq, event_id, "key", state, attempts, last_error, claimed_by, stream, '
                "stream_id FROM outbox_events ORDER BY seq"
            )
        )
        return [dict(r._mapping) for r in result]


def drain(relay: Relay, rounds: int = 20) -> int:
    total = 0
    for _ in range(rounds):
        total += relay.run_once()
    return total


# The cluster case runs in the whole suite (CI), not in the fast tier: the cluster costs seconds
# to start on each xdist worker.
@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.slow)])
def target(request: pytest.FixtureRequest, stream_prefix: str) -> Iterator[RedisTarget]:
    """Where this module's tests publish: every test that talks to Redis runs on the shared
    Redis and on the session's Redis Cluster (issue 13: the same tests on both)."""
    yield from target_for(request, str(request.param), stream_prefix)


@pytest.fixture
def redis_client(target: RedisTarget) -> Iterator[Any]:
    client = target.connect()
    yield client
    client.close()


@pytest.fixture
def outbox(outbox_db_url: str) -> Iterator[Outbox]:
    o = Outbox(outbox_db_url)
    o.create_schema()
    yield o
    o.engine.dispose()


def sql_now(outbox: Outbox, ago: str = "") -> str:
    """The database clock in raw SQL, ``ago`` ("2 days") earlier."""
    dialect = outbox.engine.dialect.name
    if dialect == "postgresql":
        return f"now() - interval '{ago}'" if ago else "now()"
    if dialect in ("mysql", "mariadb"):
        return (
            f"UTC_TIMESTAMP(6) - INTERVAL {ago.upper().rstrip('S')}" if ago else "UTC_TIMESTAMP(6)"
        )
    return (
        f"strftime('%Y-%m-%d %H:%M:%f', 'now', '-{ago}')"
        if ago
        else ("strftime('%Y-%m-%d %H:%M:%f', 'now')")
    )


def make_relay(outbox: Outbox, client: redis.Redis, prefix: str, **config: Any) -> Relay:
    publisher = RedisStreamPublisher(client, f"{prefix}.{{topic}}")
    return Relay(outbox, publisher, fast_config(**config))


# -- entries ----------------------------------------------------------------------------------


def test_stream_template_placeholders_and_validation(
    outbox: Outbox, redis_client: redis.Redis, stream_prefix: str
) -> None:
    with pytest.raises(ConfigError, match="unknown placeholder"):
        RedisStreamPublisher(redis_client, "outbox.{topik}")
    with pytest.raises(ConfigError):
        RedisStreamPublisher(redis_client, "outbox.{topic")
    with pytest.raises(ConfigError):
        RedisStreamPublisher(redis_client, "")
    with pytest.raises(ConfigError):
        RelayConfig(batch_size=0)
    publisher = RedisStreamPublisher(
        redis_client, stream_prefix + ".{{{tenant}}}.{topic}.{partition}", partitions=4
    )
    with outbox.transaction() as tx:
        tx.emit("a", key="k1", payload=1, tenant="t1")
        no_tenant = tx.emit("a", key="k2", payload=2)
    relay = Relay(outbox, publisher, fast_config())
    assert relay.run_once() == 1
    streams = {k.decode() for k in redis_client.scan_iter(match=f"{stream_prefix}*")}
    assert len(streams) == 1 and streams.pop().startswith(stream_prefix + ".{t1}.a.")
    by_id = {r["event_id"]: r for r in rows(outbox)}
    assert by_id[no_tenant]["state"] == "quarantined"
    assert "{tenant}" in by_id[no_tenant]["last_error"]


# -- per-key order and failures -----------------------------------------------------------------


def refuse_writes(client: redis.Redis) -> None:
    """Put a private Redis at maxmemory: every XADD gets a real OOM reply."""
    client.config_set("maxmemory", 1)
    client.config_set("maxmemory-policy", "noeviction")


def test_records_refused_at_maxmemory_retry_at_once_when_redis_accepts_again(
    outbox: Outbox, stream_prefix: str
) -> None:
    """OOM is a whole-Redis condition: once the same Redis accepts an entry again, the rows
    it refused earlier end their backoff (here 30 s) and go out at once, in key order (the
    chaos matrix's "Redis at maxmemory" row waited up to the 60 s backoff ceiling)."""
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        with outbox.transaction() as tx:
            a1 = tx.emit("t", key="A", payload=1)
            a2 = tx.emit("t", key="A", payload=2)
        refuse_writes(client)
        relay = make_relay(outbox, client, stream_prefix, record_backoff=Backoff(30.0, 30.0))
        assert relay.run_once() == 0
        assert {r["event_id"]: r for r in rows(outbox)}[a1]["attempts"] == 1
        client.config_set("maxmemory", 0)
        with outbox.transaction() as tx:
            b1 = tx.emit("t", key="B", payload=1)
        published = relay.run_once()  # B goes out: this Redis accepts again
        published += drain(relay, 5)
        got = [e["id"] for e in entries(client, f"{stream_prefix}.t")]
        assert published == 3 and sorted(got) == sorted([b1, a1, a2])
        assert [i for i in got if i != b1] == [a1, a2]
        client.close()


# -- intents and reconciliation -------------------------------------------------------------


def test_intent_without_receipt_is_reconciled_not_duplicated(
    outbox: Outbox, redis_client: redis.Redis, stream_prefix: str
) -> None:
    with outbox.transaction() as tx:
        sent = tx.emit("t", key="A", payload={"n": 1})
        unsent = tx.emit("t", key="B", payload={"n": 1})
        later = tx.emit("t", key="A", payload={"n": 2})
    stream = f"{stream_prefix}.t"
    # Made first, with a 2-s publish window: the orphans must still block their keys at the
    # first run_once on a loaded machine (0.5 s ran out there before it, on MariaDB).
    relay = make_relay(outbox, redis_client, stream_prefix, publish_deadline=2.0)
    # A relay "died" after claiming both and XADDing one: write its intent by hand and put
    # the entry it sent in the stream.
    now = sql_now(outbox)
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE outbox_events SET claimed_by = 'relay-dead', claim_epoch = 7, "
                f"claimed_at = {now} WHERE event_id IN (:a, :b)"
            ),
            {"a": sent, "b": unsent},
        )
    redis_client.xadd(stream, {"id": sent, "type": "t", "subject": "A"})
    relay.run_once()
    # The orphaned intents block their keys until the publish window has passed.
    assert [e["id"] for e in entries(redis_client, stream)] == [sent]
    wait_for(
        lambda: relay.run_once() >= 0 and len(entries(redis_client, stream)) >= 3,
        "the three events in the stream",
        timeout=10,
    )
    got = [e["id"] for e in entries(redis_client, stream)]
    assert sorted(got) == sorted([sent, unsent, later])  # nothing twice
    assert got.index(sent) < got.index(later)
    assert relay.stats.reconciled_found == 1 and relay.stats.reconciled_missing == 1
    assert all(r["state"] == "published" for r in rows(outbox))


@pytest.mark.slow  # a private Redis stopped and restarted (9-10 s under load)
def test_redis_down_keeps_intents_and_recovers_without_duplicates(
    outbox: Outbox, redis_client: redis.Redis, stream_prefix: str
) -> None:
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i % 3}", payload={"i": i}) for i in range(9)]
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    broken = Relay(outbox, RedisStreamPublisher(dead, f"{stream_prefix}.{{topic}}"), fast_config())
    with pytest.raises(redis.ConnectionError):
        broken.run_once()
    broken.store.close()
    assert all(r["attempts"] == 1 and r["state"] == "pending" for r in rows(outbox))
    relay = make_relay(outbox, redis_client, stream_prefix)
    stream = f"{stream_prefix}.t"
    wait_for(
        lambda: relay.run_once() >= 0 and len(entries(redis_client, stream)) >= 9,
        "the nine events in the stream",
        timeout=10,
    )
    got = [e["id"] for e in entries(redis_client, stream)]
    assert sorted(got) == sorted(ids)
    for k in range(3):
        mine = [i for n, i in enumerate(ids) if n % 3 == k]
        assert [i for i in got if i in mine] == mine


# -- retention ---------------------------------------------------------------------------------


def test_retention_deletes_only_old_published_rows(
    outbox: Outbox, redis_client: redis.Redis, stream_prefix: str
) -> None:
    with outbox.transaction() as tx:
        old = tx.emit("t", key="a", payload={})
        recent = tx.emit("t", key="b", payload={})
        quarantined = tx.emit("t", key="c", payload={})
        pending = tx.emit("t", key="d", payload={})
    long_ago = sql_now(outbox, "2 days")
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_events SET state = 'published', published_at = "
                f"{long_ago}, created_at = {long_ago} WHERE event_id = :old"
            ),
            {"old": old},
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_events SET state = 'published', published_at = created_at "
                "WHERE event_id = :r"
            ),
            {"r": recent},
        )
        conn.execute(
            sa.text(
                f"UPDATE outbox_events SET state = 'quarantined', created_at = {long_ago} "
                "WHERE event_id = :q"
            ),
            {"q": quarantined},
        )
    relay = make_relay(outbox, redis_client, stream_prefix, retention_seconds=3600.0)
    relay.store.connect()
    relay.store.partition_rebalance()
    assert relay.delete_expired() == 1
    left = {r["event_id"] for r in rows(outbox)}
    assert left == {recent, quarantined, pending}
    relay.store.close()


# -- PostgreSQL: late commits, replicas ---------------------------------------------------------


def test_a_fenced_batch_adds_nothing(
    outbox: Outbox, redis_client: redis.Redis, stream_prefix: str
) -> None:
    """A relay whose intent another relay is reconciling (it set the fence first) is refused
    whole by Redis, so a reconciliation's reading of the stream is final."""
    with outbox.transaction() as tx:
        tx.emit("t", key="A", payload=1)
        tx.emit("t", key="B", payload=2)
    zombie = make_relay(outbox, redis_client, stream_prefix)
    zombie.store.connect()
    zombie.store.partition_rebalance()
    records = zombie.store.outbox_claim(10, zombie.name, 1, True)
    assert len(records) == 2
    prepared = [zombie.publisher.prepare(r) for r in records]
    # The fence of the batch's slot (the batch's fence name itself on one server).
    key = zombie.publisher.fence_for(f"outbox:fence:{zombie.name}:1", f"{stream_prefix}.t")
    try:
        zombie.publisher.set_fences([key])
        results = zombie.publisher.publish(prepared, f"outbox:fence:{zombie.name}:1")
        assert all(type(r).__name__ == "FencedOut" for r in results)
        assert redis_client.exists(f"{stream_prefix}.t") == 0
        other = zombie.publisher.publish(prepared, f"outbox:fence:{zombie.name}:2")
        assert all(isinstance(r, str) for r in other)
    finally:
        redis_client.delete(key)
        zombie.store.close()


def test_retention_that_falls_behind_runs_again_at_once(
    outbox: Outbox, redis_client: redis.Redis, stream_prefix: str
) -> None:
    """A retention round deletes at most RETENTION_BATCHES_PER_ROUND batches; one that used
    them all is due again at once, not after ``retention_interval``. Before, the outbox of a
    350 events/s soak grew 1,000 rows a minute: 20 batches of 1,000 a minute is 333/s."""
    from relay.relay import RETENTION_BATCHES_PER_ROUND

    batch = 2
    full_round = RETENTION_BATCHES_PER_ROUND * batch
    with outbox.transaction() as tx:
        for n in range(full_round + 3):
            tx.emit("t", key=f"k{n}", payload={})
    long_ago = sql_now(outbox, "2 days")
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE outbox_events SET state = 'published', published_at = {long_ago}, "
                f"created_at = {long_ago}"
            )
        )
    relay = make_relay(
        outbox, redis_client, stream_prefix, retention_seconds=3600.0, retention_batch=batch
    )
    relay.store.connect()
    relay.store.partition_rebalance()
    now = time.monotonic()
    assert relay.retention.run_now(now) == full_round  # the round's cap
    assert relay.retention.due(now)  # behind: at once, not retention_interval (60 s) later
    assert relay.retention.run_now(now) == 3
    assert not relay.retention.due(now)  # caught up: the interval again
    assert rows(outbox) == []
    relay.store.close()
