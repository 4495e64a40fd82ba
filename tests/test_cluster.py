"""Redis Cluster as a first-class target (issue 13), on a real 3+3 cluster.

The cluster comes from ``tests/cluster_support.py``: ``redis_cluster`` is shared by the
session (keys under each test's ``stream_prefix``), ``private_cluster`` is a test's own when
it kills a master or moves slots. The guarantee tests that run on one Redis run here through
the ``redis_target`` parameter where they live (test_relay_faults, test_consumer); this file
holds what only a cluster has: slots, fences per slot, redirections, failover, resharding.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from redis.cluster import RedisCluster
from redis.crc import key_slot

from consumer import Consumer, ConsumerConfig
from consumer.event import ConsumedEvent, encode_entry
from outbox import Outbox
from outbox.backoff import Backoff
from outbox.db import make_engine
from outbox.errors import ConfigError
from outbox.hooks import Hooks
from outbox.redis_client import hash_tag, is_cluster_url, redis_client
from relay.admin import status
from relay.config import RelayConfig
from relay.errors import PermanentPublishError
from relay.records import Record
from relay.redis.cluster import slot_fence, template_has_hash_tag
from relay.redis.publisher import (
    FencedOut,
    HeldBack,
    Prepared,
    RedisStreamPublisher,
    ReplicasNotConfirmed,
)
from relay.relay import Relay, fence_key

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from cluster_support import PrivateCluster
    from services import PrivateRedis, wait_for
    from test_relay_faults import (
        WriterFactory,
        Writers,
        assert_clean,
        committed_versions,
        create_domain,
        judge,
        make_keys,
        pending_count,
        read_streams,
        relay_command,
        relays,
        topic_of,
        wait_drained,
        writers_factory,  # noqa: F401 (a fixture)
    )
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.cluster_support import PrivateCluster


def record(seq: int, topic: str, key: str) -> Record:
    return Record(
        seq=seq,
        event_id=f"ev-{seq:06d}",
        topic=topic,
        key=key,
        key_hash=seq,
        tenant=None,
        identity=f"id-{seq}",
        payload=f'{{"n": {seq}}}',
        headers=None,
        time="2026-01-01T00:00:00.000000Z",
        created_epoch=0.0,
        attempts=0,
    )


def prepare_batch(
    publisher: RedisStreamPublisher, topics: list[str], count: int, keys: int = 7
) -> list[Prepared]:
    return [
        publisher.prepare(record(i, topics[i % len(topics)], f"k{i % keys}")) for i in range(count)
    ]


# -- names and slots ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stream",
    ["outbox.{quote.approved}", "outbox.quote.approved", "a}b", "x{}y", "{a}{b}", "p.{t}.3"],
)
def test_slot_fence_lives_in_the_slot_of_its_stream(stream: str) -> None:
    fence = slot_fence("outbox:fence:relay-h-1-abcd:42", stream)
    assert key_slot(fence.encode()) == key_slot(stream.encode())
    assert fence.endswith("outbox:fence:relay-h-1-abcd:42")


def test_hash_tags_of_names_and_templates() -> None:
    assert hash_tag("outbox.{quote}") == "quote"
    assert hash_tag("outbox.quote") is None
    assert hash_tag("x{}y{z}") is None  # an empty first tag: the whole name decides
    assert template_has_hash_tag("outbox.{{{topic}}}")
    assert template_has_hash_tag("outbox.{{{topic}.{partition}}}")
    assert not template_has_hash_tag("outbox.{topic}")
    assert not template_has_hash_tag("{{fixed}}.{topic}")  # one slot for everything: no tag of ours


def test_cluster_urls(redis_cluster: PrivateCluster) -> None:
    assert is_cluster_url(redis_cluster.cluster_url)
    with pytest.raises(ConfigError) as refused:
        redis_client(redis_cluster.cluster_url)
    assert refused.value.setting == "redis_url"
    for url in (redis_cluster.url, redis_cluster.cluster_url):
        client = redis_client(url, cluster=True)
        assert isinstance(client, RedisCluster)
        assert client.ping()
        client.close()
    with pytest.raises(ConfigError):
        redis_client("unix:///tmp/x.sock", cluster=True)
    with pytest.raises(ConfigError):
        redis_client(None, cluster=True)


# -- one script per slot -----------------------------------------------------------------------


@pytest.fixture
def cluster_client(redis_cluster: PrivateCluster) -> RedisCluster:
    return redis_client(redis_cluster.url, cluster=True)


def test_batch_is_published_per_slot_in_order(
    cluster_client: RedisCluster, stream_prefix: str
) -> None:
    publisher = RedisStreamPublisher(cluster_client, f"{stream_prefix}.{{{{{{topic}}}}}}")
    topics = [f"{stream_prefix}-t{i}" for i in range(6)]
    slots = {key_slot(publisher.stream_for(record(0, t, "k")).encode()) for t in topics}
    assert len(slots) == 6
    batch = prepare_batch(publisher, topics, 300)
    results = publisher.publish(batch, "outbox:fence:r:1", wait_replicas=1)
    assert all(isinstance(r, str) for r in results), results[:3]
    for topic in topics:
        stream = publisher.stream_for(record(0, topic, "k"))
        ids = [f[b"id"].decode() for _eid, f in cluster_client.xrange(stream)]
        assert ids == sorted(ids) and len(ids) == 50  # seq order within each stream


def test_fence_refuses_only_the_slots_it_was_set_in(
    cluster_client: RedisCluster, stream_prefix: str
) -> None:
    publisher = RedisStreamPublisher(cluster_client, f"{stream_prefix}.{{{{{{topic}}}}}}")
    topics = [f"{stream_prefix}-a", f"{stream_prefix}-b"]
    fenced_stream = publisher.stream_for(record(0, topics[0], "k"))
    batch = prepare_batch(publisher, topics, 20)
    # What a reconciler does for an orphaned intent: fence the slots of the streams it reads.
    publisher.set_fences([publisher.fence_for("outbox:fence:r:2", fenced_stream)])
    results = publisher.publish(batch, "outbox:fence:r:2")
    for p, result in zip(batch, results, strict=True):
        if p.stream == fenced_stream:
            assert isinstance(result, FencedOut)
        else:
            assert isinstance(result, str)
    assert cluster_client.xlen(fenced_stream) == 0


def test_failing_entry_holds_back_its_key_within_the_slot(
    cluster_client: RedisCluster, stream_prefix: str
) -> None:
    publisher = RedisStreamPublisher(cluster_client, f"{stream_prefix}.{{{{{{topic}}}}}}")
    good, bad = f"{stream_prefix}-good", f"{stream_prefix}-bad"
    cluster_client.set(publisher.stream_for(record(0, bad, "k")), "not a stream")
    batch = [
        publisher.prepare(record(1, bad, "k1")),
        publisher.prepare(record(2, bad, "k1")),
        publisher.prepare(record(3, good, "k2")),
    ]
    results = publisher.publish(batch)
    assert isinstance(results[0], PermanentPublishError)
    assert isinstance(results[1], HeldBack)
    assert isinstance(results[2], str)


def test_wait_without_replicas_is_not_a_receipt(stream_prefix: str) -> None:
    """Two masters and no replica: ``WAIT 1`` confirms nothing, and the batch is reported like a
    connection error (reconciled later, never assumed published)."""
    with PrivateCluster(masters=3, replicas_per_master=0) as cluster:
        client = redis_client(cluster.url, cluster=True)
        publisher = RedisStreamPublisher(client, f"{stream_prefix}.{{{{{{topic}}}}}}")
        batch = prepare_batch(publisher, [f"{stream_prefix}-x", f"{stream_prefix}-y"], 10)
        with pytest.raises(ReplicasNotConfirmed):
            publisher.publish(batch, wait_replicas=1, wait_timeout=0.05)
        assert isinstance(ReplicasNotConfirmed("x"), redis.ConnectionError)
        client.close()


@pytest.mark.slow  # a private 6-node cluster (~9 s under load)
def test_moved_slot_is_retried_with_a_fresh_slot_map(
    private_cluster: PrivateCluster, stream_prefix: str
) -> None:
    client = redis_client(private_cluster.url, cluster=True)
    publisher = RedisStreamPublisher(client, f"{stream_prefix}.{{{{{{topic}}}}}}")
    topic = f"{stream_prefix}-moving"
    stream = publisher.stream_for(record(0, topic, "k"))
    source = private_cluster.master_of(stream)
    target = next(m for m in private_cluster.masters() if m.port != source.port)
    # Move the (empty) slot by hand: the client's map is now stale, and the first call to
    # the old owner is answered MOVED.
    slot = key_slot(stream.encode())
    target_id = next(n["id"] for n in private_cluster.topology() if n["port"] == target.port)
    for node in (target, *private_cluster.masters()):
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    # The replicas take no SETSLOT: they learn the new owner by gossip, and only from a claim
    # with a higher config epoch than the old owner's. Give the target the highest (as
    # redis-cli's resharding does), or a replica of the old owner may keep the old map (CI
    # saw the cluster never become healthy).
    target.client().execute_command("CLUSTER", "BUMPEPOCH")
    private_cluster.wait_healthy()
    batch = prepare_batch(publisher, [topic], 5)
    results = publisher.publish(batch)
    assert all(isinstance(r, str) for r in results), results
    assert private_cluster.master_of(stream).port == target.port
    assert target.client().xlen(stream) == 5
    client.close()


# -- the relay on a cluster ------------------------------------------------------------------


class LostReply(RedisStreamPublisher):
    """Publishes, then loses the reply once (a connection cut after the server ran the
    scripts): the relay is left with intents and no receipts, as after a crash."""

    lose = True

    def publish(self, prepared: Any, fence: str | None = None, **kwargs: Any) -> Any:
        results = super().publish(prepared, fence, **kwargs)
        if self.lose:
            self.lose = False
            raise redis.ConnectionError("reply lost after the scripts ran")
        return results


def emit_events(outbox: Outbox, topics: list[str], count: int) -> list[str]:
    ids: list[str] = []
    with outbox.transaction() as tx:
        for i in range(count):
            ids.append(
                tx.emit(topics[i % len(topics)], key=f"key-{i % 11}", payload={"n": i}, tenant="t")
            )
    return ids


def stream_ids(client: Any, streams: list[str]) -> list[str]:
    out: list[str] = []
    for stream in streams:
        out.extend(f[b"id"].decode() for _eid, f in client.xrange(stream))
    return out


def test_relay_reconciles_a_lost_reply_slot_by_slot_without_duplicates(
    pg_url: str, cluster_client: RedisCluster, stream_prefix: str
) -> None:
    outbox = Outbox(pg_url)
    outbox.create_schema()
    topics = [f"topic-{i}" for i in range(5)]
    ids = emit_events(outbox, topics, 200)
    publisher = LostReply(cluster_client, f"{stream_prefix}.{{{{{{topic}}}}}}")
    streams = [publisher.stream_for(record(0, t, "k")) for t in topics]
    config = RelayConfig(publish_deadline=0.2, clock_margin=0.1, record_backoff=Backoff(0.05, 0.2))
    relay = Relay(outbox, publisher, config)
    with pytest.raises(redis.ConnectionError):
        relay.run_once()
    assert sorted(stream_ids(cluster_client, streams)) == sorted(ids)  # published, no receipt
    wait_for(  # reconciles once the lost batch's publish window has passed
        lambda: relay.run_once() >= 0 and relay.stats.reconciled_found >= 200,
        "the lost batch reconciled",
        timeout=20,
    )
    assert relay.stats.reconciled_found == 200
    assert sorted(stream_ids(cluster_client, streams)) == sorted(ids)  # nothing twice
    assert status(outbox.engine, outbox.schema)["pending"] == 0
    # The reconciler fenced the lost intent in every slot it read.
    fence = fence_key(relay.name, 1)
    for stream in streams:
        assert cluster_client.exists(publisher.fence_for(fence, stream))
    outbox.engine.dispose()


def test_relay_with_wait_replicas_on_the_cluster(
    pg_url: str, cluster_client: RedisCluster, stream_prefix: str
) -> None:
    outbox = Outbox(pg_url)
    outbox.create_schema()
    topics = [f"topic-{i}" for i in range(4)]
    ids = emit_events(outbox, topics, 300)
    publisher = RedisStreamPublisher(cluster_client, f"{stream_prefix}.{{{{{{topic}}}}}}")
    relay = Relay(outbox, publisher, RelayConfig(wait_replicas=1, batch_size=100))
    while relay.run_once():
        pass
    streams = [publisher.stream_for(record(0, t, "k")) for t in topics]
    assert sorted(stream_ids(cluster_client, streams)) == sorted(ids)
    outbox.engine.dispose()


def test_wait_replicas_unconfirmed_on_one_server_is_reconciled_not_assumed(
    sqlite_url: str, stream_prefix: str
) -> None:
    """One Redis without a replica: ``WAIT 1`` never confirms. The batch is in the stream,
    but the relay records no receipt for it; the reconciliation finds it there and records
    it, and nothing is published twice."""
    outbox = Outbox(sqlite_url)
    outbox.create_schema()
    ids = emit_events(outbox, ["quote.approved"], 20)
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        publisher = RedisStreamPublisher(client, f"{stream_prefix}.{{topic}}")
        config = RelayConfig(
            wait_replicas=1, wait_timeout=0.05, publish_deadline=0.2, clock_margin=0.1
        )
        relay = Relay(outbox, publisher, config)
        with pytest.raises(ReplicasNotConfirmed):
            relay.run_once()
        assert status(outbox.engine, outbox.schema)["pending"] == 20  # no receipt assumed

        # Nor does the reconciliation trust what it finds while no replica confirms it.
        def reconciliation_refused() -> bool:
            try:
                relay.run_once()
            except ReplicasNotConfirmed:
                return True
            return False

        # Once the intents are past reconcile_after, the reconciliation runs and refuses.
        wait_for(reconciliation_refused, "the reconciliation to refuse, unconfirmed", 20)
        assert relay.stats.reconciled_found == 0
        relay.store.close()
        # An operator drops the requirement (no replica here): the batch is found, once.
        relay = Relay(outbox, publisher, dataclasses.replace(config, wait_replicas=0))
        wait_for(
            lambda: relay.run_once() >= 0 and relay.stats.reconciled_found >= 20,
            "the batch reconciled",
            timeout=20,
        )
        assert relay.stats.reconciled_found == 20
        assert status(outbox.engine, outbox.schema)["pending"] == 0
        got = [f[b"id"].decode() for _e, f in client.xrange(f"{stream_prefix}.quote.approved")]
        assert got == ids
        client.close()
    outbox.engine.dispose()


def test_unconfigured_values_of_wait_replicas_are_refused() -> None:
    with pytest.raises(ConfigError):
        RelayConfig(wait_replicas=-1)
    with pytest.raises(ConfigError):
        RelayConfig(wait_timeout=0)


# -- consumers on a cluster ------------------------------------------------------------------


class LagHooks(Hooks):
    def __init__(self) -> None:
        self.lag: dict[str, tuple[int | None, int]] = {}

    def consumer_lag(self, group: str, stream: str, lag: int | None, pending: int) -> None:
        self.lag[stream] = (lag, pending)


def make_consumer(
    db: str, url: str, streams: list[str], hooks: Hooks | None = None, **config: Any
) -> Consumer:
    settings: dict[str, Any] = {"block_ms": 50, "maintenance_interval_seconds": 0.01}
    settings.update(config)
    consumer = Consumer(
        db,
        url,
        group="billing",
        streams=streams,
        config=ConsumerConfig(**settings),
        hooks=hooks,
    )
    effects_md.create_all(consumer.engine, checkfirst=True)
    return consumer


effects_md = sa.MetaData()
effects = sa.Table(
    "cluster_effects",
    effects_md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("identity", sa.String(200), nullable=False),  # not unique: duplicates show
)


def handle_into_effects(consumer: Consumer, topic: str, fail: str | None = None) -> None:
    def handler(event: ConsumedEvent, tx: Any) -> None:
        if event.identity == fail:
            raise RuntimeError("poison")
        tx.session.execute(sa.insert(effects).values(identity=event.identity))

    consumer.add_handler(topic, handler)


def effect_identities(consumer: Consumer) -> list[str]:
    with consumer.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(sa.select(effects.c.identity)))


def xadd_event(client: Any, stream: str, identity: str, event_id: str) -> None:
    client.xadd(
        stream, encode_entry("quote.approved", {"n": 1}, event_id=event_id, identity=identity)
    )


def drain_consumer(consumer: Consumer) -> int:
    total = 0
    while (n := consumer.run_once(block=False)) > 0:
        total += n
    return total


def test_consumer_reads_streams_of_several_slots_and_deduplicates(
    db_url: str, redis_cluster: PrivateCluster, cluster_client: RedisCluster, stream_prefix: str
) -> None:
    streams = [f"{stream_prefix}.{{quote-{i}}}" for i in range(4)]
    assert len({key_slot(s.encode()) for s in streams}) == 4
    hooks = LagHooks()
    consumer = make_consumer(db_url, redis_cluster.cluster_url, streams, hooks)
    handle_into_effects(consumer, "quote.approved")
    assert consumer.run_once(block=True) == 0  # creates the groups; blocks slot by slot
    for n, stream in enumerate(streams):
        for copy in range(3):  # the same business identity three times, in every stream
            xadd_event(cluster_client, stream, "studio:send-1", f"evt-{n}-{copy}")
        xadd_event(cluster_client, stream, f"studio:only-{n}", f"evt-{n}-x")
    assert drain_consumer(consumer) == 16
    assert effect_identities(consumer) == sorted(
        ["studio:send-1"] + [f"studio:only-{n}" for n in range(4)]
    )
    for stream in streams:
        assert cluster_client.xpending(stream, "billing")["pending"] == 0
    consumer.run_once(block=False)
    assert set(hooks.lag) == set(streams)  # group lag per stream, read from each slot's master
    assert all(lag == (0, 0) for lag in hooks.lag.values())
    consumer.engine.dispose()


def test_consumer_claims_back_and_dead_letters_on_the_cluster(
    db_url: str, redis_cluster: PrivateCluster, cluster_client: RedisCluster, stream_prefix: str
) -> None:
    # Streams without a hash tag: the dead-letter stream is tagged with its source stream.
    streams = [f"{stream_prefix}.quote.approved", f"{stream_prefix}.quote.sent"]
    consumer = make_consumer(
        db_url, redis_cluster.cluster_url, streams, claim_idle_ms=0, max_deliveries=2
    )
    handle_into_effects(consumer, "quote.approved", fail="studio:poison")
    consumer.run_once(block=False)  # creates the groups
    xadd_event(cluster_client, streams[1], "studio:a", "evt-a")
    # A consumer reads the entry and dies before acknowledging it: XAUTOCLAIM takes it over.
    got = cluster_client.xreadgroup("billing", "ghost", {streams[1]: ">"}, count=10)
    assert len(got[0][1]) == 1
    xadd_event(cluster_client, streams[0], "studio:poison", "evt-p")
    drain_consumer(consumer)
    assert effect_identities(consumer) == ["studio:a"]
    dead_stream = consumer.dead_letter_stream_for(streams[0])
    assert dead_stream == "{" + streams[0] + "}.dead-letter"
    assert key_slot(dead_stream.encode()) == key_slot(streams[0].encode())
    dead = cluster_client.xrange(dead_stream)
    assert [f[b"id"] for _e, f in dead] == [b"evt-p"]
    for stream in streams:
        assert cluster_client.xpending(stream, "billing")["pending"] == 0
    consumer.engine.dispose()


# -- faults under load: failover and resharding ----------------------------------------------


def fault_setup(pg_url: str, cluster: PrivateCluster, prefix: str) -> tuple[list[str], str]:
    keys = make_keys(200)
    create_domain(pg_url, keys)
    # Hash-tagged streams (prefix.{fault.even}, prefix.{fault.odd}): one slot per topic.
    return keys, f"{prefix}.{{{{{{topic}}}}}}"


def judge_cluster(
    pg_url: str, cluster: PrivateCluster, prefix: str, writers: Writers, what: str
) -> None:
    client = cluster.client()
    versions = committed_versions(pg_url)
    verdict = judge(read_streams(client, prefix), versions, writers.stats.confirmed)
    client.close()
    print(f"\n{what}: {verdict.entries} entries, {verdict.expected} committed")
    assert_clean(verdict, what)


@pytest.mark.slow
def test_master_killed_mid_load_with_wait_replicas_loses_nothing(
    pg_url: str,
    private_cluster: PrivateCluster,
    stream_prefix: str,
    tmp_path: Path,
    writers_factory: WriterFactory,
) -> None:
    """SIGKILL the master of a stream's slot while two relays publish with
    ``--wait-replicas 1``: its replica is promoted, the old master comes back as the new
    master's replica, and every committed event is in its stream once, in per-key order."""
    keys, template = fault_setup(pg_url, private_cluster, stream_prefix)
    victim_stream = f"{stream_prefix}.{{{topic_of(keys[0])}}}"
    command = relay_command(
        pg_url,
        private_cluster.url,
        template,
        100,
        "--redis-cluster",
        "--wait-replicas",
        "1",
        "--wait-timeout",
        "0.5",
    )
    engine = make_engine(pg_url, pool_size=2)
    client = private_cluster.client()
    with relays(command, tmp_path) as procs:
        procs.spawn()
        procs.spawn()
        writers = writers_factory(pg_url, keys, 6000, threads=4, per_tx=2, rate=800)
        wait_for(
            lambda: client.exists(victim_stream) and client.xlen(victim_stream) > 500,
            "the relays to start publishing",
            timeout=60,  # relay processes starting on a loaded machine
            interval=0.1,
            diagnose=procs.tail,
        )
        victim = private_cluster.kill_master_of(victim_stream)
        # The replica takes over after the node timeout; the old master then rejoins as
        # its replica (without it WAIT 1 could never be satisfied for that slot again).
        private_cluster.wait_failover(victim, victim_stream)
        private_cluster.restart(victim)
        private_cluster.wait_healthy()
        writers.join(60)
        expected = sum(committed_versions(pg_url).values())
        wait_drained(engine, client, stream_prefix, lambda: expected, 90, procs)
        codes = procs.terminate_all()
    assert codes == [0, 0], procs.tail()
    judge_cluster(
        pg_url, private_cluster, stream_prefix, writers, "master killed, replica promoted"
    )
    assert pending_count(engine) == (0, 0)
    engine.dispose()
    client.close()


@pytest.mark.slow
def test_slot_migrated_under_load_loses_nothing_and_duplicates_nothing(
    pg_url: str,
    private_cluster: PrivateCluster,
    stream_prefix: str,
    tmp_path: Path,
    writers_factory: WriterFactory,
) -> None:
    """Move a stream's slot to another master (IMPORTING/MIGRATING, half a second of
    TRYAGAIN/ASK, MIGRATE, the new owner announced: what ``redis-cli --cluster reshard``
    does per slot) while two relays publish and reconcile into it."""
    keys, template = fault_setup(pg_url, private_cluster, stream_prefix)
    stream = f"{stream_prefix}.{{{topic_of(keys[0])}}}"
    command = relay_command(pg_url, private_cluster.url, template, 100, "--redis-cluster")
    engine = make_engine(pg_url, pool_size=2)
    client = private_cluster.client()
    with relays(command, tmp_path) as procs:
        procs.spawn()
        procs.spawn()
        writers = writers_factory(pg_url, keys, 6000, threads=4, per_tx=2, rate=800)
        wait_for(
            lambda: client.exists(stream) and client.xlen(stream) > 500,
            "the relays to start publishing",
            timeout=60,  # relay processes starting on a loaded machine
            interval=0.1,
            diagnose=procs.tail,
        )
        source = private_cluster.master_of(stream)
        target = next(m for m in private_cluster.masters() if m.port != source.port)
        moved = private_cluster.migrate_slot(key_slot(stream.encode()), source, target)
        assert moved >= 1
        private_cluster.wait_healthy()
        assert private_cluster.master_of(stream).port == target.port
        writers.join(60)
        expected = sum(committed_versions(pg_url).values())
        wait_drained(engine, client, stream_prefix, lambda: expected, 90, procs)
        codes = procs.terminate_all()
    assert codes == [0, 0], procs.tail()
    judge_cluster(pg_url, private_cluster, stream_prefix, writers, "slot migrated under load")
    assert pending_count(engine) == (0, 0)
    engine.dispose()
    client.close()


# -- the command lines, end to end -------------------------------------------------------------


@pytest.mark.slow  # relay, consumer and worker processes (14-50 s under load)
def test_cli_relay_consumer_and_worker_on_the_cluster(
    pg_url: str, redis_cluster: PrivateCluster, stream_prefix: str, tmp_path: Path
) -> None:
    """``outbox-relay run --redis-cluster``, then ``outbox-consumer run --redis-cluster``,
    then ``outbox-worker run``: every business identity gets exactly one effect, duplicate
    events included, over three topics in three slots; SIGTERM ends each with exit 0."""
    outbox = Outbox(pg_url)
    outbox.create_schema()
    topics = ["quote.approved", "quote.sent", "quote.paid"]
    identities = [f"studio:q-{n}" for n in range(90)]
    with outbox.transaction() as tx:
        for n, identity in enumerate(identities):
            tx.emit(
                topics[n % 3], key=f"q-{n}", payload={"n": n}, tenant="studio", identity=identity
            )
        for n in range(0, 90, 9):  # a client retried: a second event, same business identity
            tx.emit(
                topics[n % 3],
                key=f"q-{n}",
                payload={"n": n},
                tenant="studio",
                identity=identities[n],
            )
    template = f"{stream_prefix}.{{{{{{topic}}}}}}"
    effects_file = tmp_path / "effects.txt"
    repo = Path(__file__).resolve().parent.parent
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")]),
        "CLUSTER_APP_STREAM": template,
        "CLUSTER_APP_TOPICS": ",".join(topics),
        "CLUSTER_APP_EFFECTS": str(effects_file),
        "OUTBOX_REDIS_CLUSTER": "1",  # the consumer takes it from the environment
    }
    bin_dir = Path(sys.executable).parent
    commands = {
        "relay": [
            str(bin_dir / "outbox-relay"),
            "run",
            "--redis-cluster",
            "--redis-url",
            redis_cluster.url,
            "--database-url",
            pg_url,
            "--stream",
            template,
        ],
        "consumer": [
            str(bin_dir / "outbox-consumer"),
            "run",
            "cluster_app:consumer",
            "--redis-url",
            redis_cluster.url,
            "--database-url",
            pg_url,
        ],
        "worker": [
            str(bin_dir / "outbox-worker"),
            "run",
            "cluster_app:worker",
            "--database-url",
            pg_url,
        ],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    try:
        for name, command in commands.items():
            logs[name] = tmp_path / f"{name}.log"
            with open(logs[name], "wb") as log:
                procs[name] = subprocess.Popen(
                    command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
                )

        def done() -> bool:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise AssertionError(
                        f"{name} exited {proc.returncode}: {logs[name].read_text()}"
                    )
            return effects_file.exists() and len(effects_file.read_text().split()) >= 90

        wait_for(
            done,
            "every identity's effect",
            timeout=60,
            interval=0.1,
            diagnose=lambda: str({n: p.read_text()[-1500:] for n, p in logs.items()}),
        )
        codes = {}
        for name in ("relay", "consumer", "worker"):
            procs[name].send_signal(signal.SIGTERM)
            codes[name] = procs[name].wait(30)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == {"relay": 0, "consumer": 0, "worker": 0}, codes
    effects_seen = effects_file.read_text().split()
    assert sorted(effects_seen) == sorted(identities)  # one effect each, duplicates absorbed
    client = redis_cluster.client()
    streams = [template.format(topic=t) for t in topics]
    assert len({key_slot(s.encode()) for s in streams}) == 3
    assert sum(client.xlen(s) for s in streams) == 100  # what the relay published
    client.close()
    outbox.engine.dispose()


def test_a_slot_that_lost_its_entries_is_detected_and_republished(
    pg_url: str, cluster_client: RedisCluster, stream_prefix: str
) -> None:
    """One master loses its data (here: the slot's stream and marker deleted, as a master
    restarted empty would have them): the next batch to that slot is refused (its marker is
    behind), the data-loss check of that slot reports it, and ``auto_republish`` publishes the
    lost window again (over every stream: consumers deduplicate); new events flow again."""
    outbox = Outbox(pg_url)
    outbox.create_schema()
    topics = ["lost", "kept"]
    first = emit_events(outbox, topics, 20)
    publisher = RedisStreamPublisher(cluster_client, f"{stream_prefix}.{{{{{{topic}}}}}}")
    lost_stream, kept_stream = (publisher.stream_for(record(0, t, "k")) for t in topics)
    config = RelayConfig(auto_republish=True, publish_deadline=0.2, clock_margin=0.1)
    relay = Relay(outbox, publisher, config)
    while relay.run_once():
        pass
    assert cluster_client.xlen(lost_stream) == 10 and cluster_client.xlen(kept_stream) == 10
    cluster_client.delete(lost_stream)
    cluster_client.delete(publisher.marker_for(lost_stream))
    later = emit_events(outbox, topics, 4)
    wait_for(
        lambda: relay.run_once() >= 0 and cluster_client.xlen(lost_stream) >= 12,
        "the lost stream refilled",
        timeout=20,
    )
    assert relay.stats.data_loss_detected == 1
    lost_ids = stream_ids(cluster_client, [lost_stream])
    assert sorted(set(lost_ids)) == sorted(first[0::2] + later[0::2])  # republished + new
    # Republishing is by time window over every stream (consumers deduplicate): the kept
    # stream's entries are all there, some of them twice.
    kept_ids = stream_ids(cluster_client, [kept_stream])
    assert kept_ids[:10] == first[1::2]
    assert sorted(set(kept_ids)) == sorted(first[1::2] + later[1::2])
    outbox.engine.dispose()


def test_a_relay_new_to_a_slot_does_not_write_above_a_gap_there(
    pg_url: str, cluster_client: RedisCluster, stream_prefix: str
) -> None:
    """A relay that never published to a slot still knows what the database's receipts say
    Redis holds there: after that slot lost its entries (stream and marker gone, as a master
    restarted empty would have them), its first batch there is refused and the loss reported,
    instead of a new entry re-arming the marker above the gap and hiding it."""
    outbox = Outbox(pg_url)
    outbox.create_schema()
    template = f"{stream_prefix}.{{{{{{topic}}}}}}"
    emit_events(outbox, ["lost"], 10)
    first = Relay(outbox, RedisStreamPublisher(cluster_client, template), RelayConfig())
    while first.run_once():
        pass
    emit_events(outbox, ["kept"], 10)  # the latest receipts are in another slot
    while first.run_once():
        pass
    first.store.close()
    publisher = RedisStreamPublisher(cluster_client, template)
    lost_stream, kept_stream = (publisher.stream_for(record(0, t, "k")) for t in ("lost", "kept"))
    assert key_slot(lost_stream.encode()) != key_slot(kept_stream.encode())
    config = RelayConfig(publish_deadline=0.2, clock_margin=0.1)
    second = Relay(outbox, publisher, config)  # a relay started before the loss
    assert second.run_once() == 0
    cluster_client.delete(lost_stream)
    cluster_client.delete(publisher.marker_for(lost_stream))
    emit_events(outbox, ["lost"], 2)
    for _ in range(5):
        second.run_once()
    assert second.stats.data_loss_detected == 1
    second.store.close()
    outbox.engine.dispose()


@pytest.mark.slow
def test_master_restarted_empty_without_wait_replicas_is_detected_and_republished(
    pg_url: str,
    private_cluster: PrivateCluster,
    stream_prefix: str,
    tmp_path: Path,
    writers_factory: WriterFactory,
) -> None:
    """Without ``--wait-replicas`` nothing stops a master from losing acknowledged entries:
    here it is SIGKILLed and restarted at once, empty (no AOF), before its replica could be
    promoted, and the replica resyncs from it: the slot's streams and marker are gone. The
    relays' marker check sees it, ``--auto-republish`` publishes the lost window again, and
    every committed event is in its stream at least once (consumers deduplicate the rest)."""
    keys, template = fault_setup(pg_url, private_cluster, stream_prefix)
    victim_stream = f"{stream_prefix}.{{{topic_of(keys[0])}}}"
    command = relay_command(
        pg_url,
        private_cluster.url,
        template,
        100,
        "--redis-cluster",
        "--auto-republish",
        "--redis-check-interval",
        "1",
    )
    engine = make_engine(pg_url, pool_size=2)
    client = private_cluster.client()
    with relays(command, tmp_path) as procs:
        procs.spawn()
        procs.spawn()
        writers = writers_factory(pg_url, keys, 4000, threads=4, per_tx=2, rate=800)
        wait_for(
            lambda: client.exists(victim_stream) and client.xlen(victim_stream) > 500,
            "the relays to start publishing",
            timeout=60,  # relay processes starting on a loaded machine
            interval=0.1,
            diagnose=procs.tail,
        )
        # Its replica must not be promoted meanwhile (on a loaded machine the restart can
        # take longer than the node timeout): then the loss is certain, not a race.
        master = private_cluster.master_of(victim_stream)
        for replica in private_cluster.replicas_of(master):
            replica.client().config_set("cluster-replica-no-failover", "yes")
        victim = private_cluster.kill_master_of(victim_stream)
        private_cluster.restart(victim)  # back at once, empty, still the master
        private_cluster.wait_healthy()
        writers.join(60)

        def missing_events() -> set[str]:
            return writers.stats.confirmed - {
                e.event_id for e in read_streams(client, stream_prefix)
            }

        wait_for(
            lambda: not missing_events() and pending_count(engine) == (0, 0),
            "every committed event in the streams and nothing pending",
            90,
            0.5,
            diagnose=procs.tail,
        )
        missing = missing_events()
        logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("relay-*.log")))
        codes = procs.terminate_all()
    assert codes == [0, 0], procs.tail()
    assert "Redis lost stream entries" in logs, procs.tail()
    assert "auto-republish done" in logs
    assert not missing, f"{len(missing)} committed events missing"
    engine.dispose()
    client.close()


def test_the_persistence_check_asks_every_master_and_reports_the_weakest(
    redis_cluster: PrivateCluster,
) -> None:
    """A cluster is as safe as its least safe master: with AOF on all but one, the check
    says ``none`` and names that master; with AOF on every master it says ``aof``."""
    from relay.redis.health import check_persistence

    masters = redis_cluster.masters()
    client = redis_cluster.client()
    try:
        for node in masters[1:]:
            node.client().config_set("appendonly", "yes")
        report = check_persistence(client)
        assert report.mode == "none", report
        assert masters[0].address in report.detail and "3 master(s)" in report.detail
        masters[0].client().config_set("appendonly", "yes")
        assert check_persistence(client).mode == "aof"
    finally:
        for node in masters:
            node.client().config_set("appendonly", "no")
        client.close()
