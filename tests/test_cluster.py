"""Redis Cluster as a first-class target (issue 13), on a real 3+3 cluster.

The cluster comes from ``tests/cluster_support.py``: ``redis_cluster`` is shared by the
session (keys under each test's ``stream_prefix``), ``private_cluster`` is a test's own when
it kills a master or moves slots. The guarantee tests that run on one Redis run here through
the ``redis_target`` parameter where they live (test_relay_faults, test_consumer); this file
holds what only a cluster has: slots, fences per slot, redirections, failover, resharding.
"""

from __future__ import annotations

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from outbox.errors import ConfigError
from outbox.redis_client import is_cluster_url, redis_client
from relay.cluster import (
    ReplicasNotConfirmed,
    hash_tag,
    publish_by_slot,
    slot_fence,
    template_has_hash_tag,
)
from relay.publisher import (
    FencedOut,
    HeldBack,
    PermanentPublishError,
    Prepared,
    RedisStreamPublisher,
)
from relay.records import Record

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from cluster_support import PrivateCluster, private_cluster, redis_cluster
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.cluster_support import PrivateCluster, private_cluster, redis_cluster  # noqa: F401


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
    assert fence.startswith("outbox:fence:relay-h-1-abcd:42:")


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
    results = publish_by_slot(cluster_client, batch, "outbox:fence:r:1", None, wait_replicas=1)
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
    publisher.set_fences([slot_fence("outbox:fence:r:2", fenced_stream)])
    results = publish_by_slot(cluster_client, batch, "outbox:fence:r:2", None)
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
    results = publish_by_slot(cluster_client, batch, None, None)
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
            publish_by_slot(client, batch, None, None, wait_replicas=1, wait_timeout_ms=50)
        assert isinstance(ReplicasNotConfirmed("x"), redis.ConnectionError)
        client.close()


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
    private_cluster.wait_healthy()
    batch = prepare_batch(publisher, [topic], 5)
    results = publish_by_slot(client, batch, None, None)
    assert all(isinstance(r, str) for r in results), results
    assert private_cluster.master_of(stream).port == target.port
    assert target.client().xlen(stream) == 5
    client.close()
