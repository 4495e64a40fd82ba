"""The contract suite for brokers (issue 40): every guarantee of the relay, through the
:class:`relay.broker.Broker` seam, on the shared Redis, the session's Redis Cluster and the
shared NATS JetStream (``broker_kit``, tests/broker_support.py). A broker is added by
adding it to that fixture; every case here must then pass on it.

What each case proves:

- committed events reach their streams once, each key's in commit order, with receipts;
- (moved from tests/test_relay.py) the entries are CloudEvents: the same attributes on
  every broker, what a NATS consumer is handed included (body, ``Nats-Msg-Id``, subject);
- an intent without a receipt (a relay that died between the publish and the receipt) is
  reconciled by finding the event in the stream, also once the broker's own duplicate
  window has closed, so nothing is published twice;
- a record the broker refuses is quarantined, and the other keys go on;
- a stream the broker lost is detected by the relay's health check and published again
  from the outbox's retention;
- a relay whose broker is killed and started again (on a private server: ``restartable_kit``)
  goes on by itself: what was committed meanwhile is published once, in key order, with no
  restart of the relay (issue 53);
- (moved from tests/test_relay.py, where they named Redis) a rolled-back transaction
  publishes nothing, a refused record holds back its key until it is fixed and requeued, a
  stored payload that is not JSON is quarantined, a late commit is
  published after it commits and never overtaken by its key's later event, two relays share
  the partitions and publish everything once in key order, a relay runs, stops and runs
  again, a relay its user dropped lets go of its partitions at once, an event requeued
  below the claim floor goes out on the next cycle, and a transient refusal backs off and
  holds back only its key (a test double of the seam refuses; the real broker carries
  every entry that goes out), a refused stream holds back its key's events in other
  streams, and the rows held behind a key are all swept once it recovers.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.backoff import Backoff
from relay import Relay, RelayConfig
from relay.broker import Broker, broker_for, broker_kind
from relay.errors import ConfigError
from relay.seam import HeldBack, TransientError

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from broker_support import BrokerKit, Restartable, broker_kit, nats_kit, restartable_kit
    from cluster_support import redis_cluster
    from services import wait_for
except ImportError:  # pragma: no cover
    from tests.broker_support import (  # noqa: F401
        BrokerKit,
        Restartable,
        broker_kit,
        nats_kit,
        restartable_kit,
    )
    from tests.cluster_support import redis_cluster  # noqa: F401
    from tests.services import wait_for


def fast_config(**overrides: Any) -> RelayConfig:
    values: dict[str, Any] = {
        "publish_deadline": 0.5,
        "clock_margin": 0.2,
        "record_backoff": Backoff(0.05, 0.2),
        "rebalance_interval": 0.1,
    }
    values.update(overrides)
    return RelayConfig(**values)


@pytest.fixture(params=["pg", "mysql"])
def relay_db_url(request: pytest.FixtureRequest) -> str:
    """The database of the relay's contract: PostgreSQL, and MariaDB (issue 58; SQLite runs
    one relay at a time and has its own cases below)."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture
def outbox(relay_db_url: str) -> Iterator[Outbox]:
    o = Outbox(relay_db_url)
    o.create_schema()
    yield o
    o.engine.dispose()


def rows(outbox: Outbox) -> list[dict[str, Any]]:
    with outbox.engine.connect() as conn:
        result = conn.execute(
            sa.text(
                'SELECT seq, event_id, "key", state, attempts, last_error, claimed_by, stream, '
                "stream_id "
                "FROM outbox_events ORDER BY seq"
            )
        )
        return [dict(r._mapping) for r in result]


def drain(relay: Relay, rounds: int = 10) -> int:
    return sum(relay.run_once() for _ in range(rounds))


def relay_on(outbox: Outbox, broker: Broker, **config: Any) -> Relay:
    return Relay(outbox, broker, fast_config(**config))


def test_the_scheme_picks_the_broker() -> None:
    assert broker_kind(None) == "redis"
    assert broker_kind("redis://127.0.0.1:6379/0") == "redis"
    assert broker_kind("rediss://example:6380") == "redis"
    assert broker_kind("redis+cluster://127.0.0.1:7000") == "redis"
    assert broker_kind("nats://127.0.0.1:4222") == "nats"
    with pytest.raises(ConfigError, match=r"broker_url.*kafka"):
        broker_for("kafka://127.0.0.1:9092")
    with pytest.raises(ConfigError, match="redis_cluster"):
        broker_for("nats://127.0.0.1:4222", cluster=True)


def test_committed_events_are_published_once_in_key_order(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i % 3}", payload={"i": i}) for i in range(30)]
    relay = relay_on(outbox, broker_kit.make())
    assert drain(relay, 5) == 30
    got = broker_kit.ids(broker_kit.stream("t"))
    assert sorted(got) == sorted(ids)  # each once
    for k in range(3):
        mine = [i for n, i in enumerate(ids) if n % 3 == k]
        assert [i for i in got if i in mine] == mine
    published = rows(outbox)
    assert all(r["state"] == "published" and r["stream_id"] for r in published)
    assert {r["stream"] for r in published} == {broker_kit.stream("t")}
    relay.store.close()


def nats_delivered(stream: str) -> list[Any]:
    """The messages of ``stream`` as a JetStream consumer is handed them (a pull
    subscription on the subject, from the start): each with its subject, headers, body and
    stream sequence."""
    from broker_support import _nats_run
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from outbox.nats_client import jetstream_name

    async def fetch(js: Any) -> list[Any]:
        info = await js.stream_info(jetstream_name(stream))
        sub = await js.pull_subscribe(
            stream,
            stream=jetstream_name(stream),
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
        )
        out: list[Any] = []
        try:
            while len(out) < info.state.messages:
                out += await sub.fetch(info.state.messages - len(out), timeout=10.0)
        finally:
            await sub.unsubscribe()
        return out

    result: list[Any] = _nats_run(fetch, timeout=30.0)
    return result


def test_entries_are_cloudevents_with_their_receipts(
    any_outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """(Moved from tests/test_relay.py.) What a reader of the broker sees, in CloudEvents
    attribute names (docs/reference/stream-format.md): a flat hash of strings per event (on
    NATS, the message body as one JSON object of them, ``Nats-Msg-Id`` the event id, on
    the stream name as its subject), the extensions only when set, and each row's receipt
    naming its entry (a Redis entry id, a JetStream sequence)."""
    outbox = any_outbox
    with outbox.transaction() as tx:
        first = tx.emit(
            "quote.approved",
            key="quote-017",
            payload={"total": 120, "lines": [1, 2]},
            tenant="studio",
            identity="studio:send-quote-017",
            headers={"traceparent": "00-4bf92f3577b34da6-00f067aa0ba902b7-01", "origin": "web"},
        )
        second = tx.emit("quote.approved", key="quote-018", payload={"total": 5})
    relay = relay_on(outbox, broker_kit.make())
    assert relay.run_once() == 2
    assert relay.run_once() == 0
    relay.store.close()
    stream = broker_kit.stream("quote.approved")
    got = broker_kit.read(stream)
    assert [e["id"] for e in got] == [first, second]
    assert all(isinstance(v, str) for e in got for v in e.values())  # a flat hash of strings
    e = got[0]
    assert e["specversion"] == "1.0"
    assert e["source"] == "outbox"
    assert e["type"] == "quote.approved"
    assert e["subject"] == "quote-017"
    assert e["partitionkey"] == "quote-017"
    assert e["datacontenttype"] == "application/json"
    assert json.loads(e["data"]) == {"total": 120, "lines": [1, 2]}
    assert e["tenant"] == "studio"
    assert e["identity"] == "studio:send-quote-017"
    assert e["traceparent"] == "00-4bf92f3577b34da6-00f067aa0ba902b7-01"
    assert e["header.origin"] == "web"
    stamp = datetime.fromisoformat(e["time"].replace("Z", "+00:00"))
    assert abs(stamp.timestamp() - time.time()) < 60
    assert "tenant" not in got[1] and "traceparent" not in got[1]
    assert got[1]["identity"] == second
    receipts = {r["event_id"]: r for r in rows(outbox)}
    for r in receipts.values():
        assert r["state"] == "published"
        assert r["stream"] == stream
    if broker_kit.name == "nats":
        delivered = nats_delivered(stream)
        assert [json.loads(m.data) for m in delivered] == got
        for m in delivered:
            event_id = json.loads(m.data)["id"]
            assert m.subject == stream
            assert m.headers["Nats-Msg-Id"] == event_id
            assert receipts[event_id]["stream_id"] == str(m.metadata.sequence.stream)
    else:
        client = broker_kit._redis()
        try:
            by_entry = {i.decode(): f[b"id"].decode() for i, f in client.xrange(stream)}
        finally:
            client.close()
        assert {v: k for k, v in by_entry.items()} == {
            event_id: r["stream_id"] for event_id, r in receipts.items()
        }


def nats_stored_at(stream: str) -> float:
    """When JetStream stored the last message of ``stream`` (Unix seconds, its clock)."""
    from broker_support import _nats_run

    from outbox.nats_client import jetstream_name

    async def stored(js: Any) -> float:
        info = await js.stream_info(jetstream_name(stream))
        msg = await js.get_msg(jetstream_name(stream), info.state.last_seq)
        return float(msg.time.timestamp())

    result: float = _nats_run(stored)
    return result


def test_an_intent_without_a_receipt_is_found_in_the_stream_past_the_duplicate_window(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """A relay publishes a batch and dies before its receipts commit (its recording is cut
    off here); on NATS its streams forget message ids 0.3 s after they stored them. Another
    relay, once the window has closed, reconciles by reading the stream: nothing is
    published twice."""
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i % 4}", payload={"i": i}) for i in range(12)]
    options = {"duplicate_window": 0.3} if broker_kit.name == "nats" else {}
    dying = relay_on(outbox, broker_kit.make(**options))
    dying._batches.record = lambda outcome, held: None  # type: ignore[method-assign]
    dying.run_once()
    dying.store.close()
    stream = broker_kit.stream("t")
    assert sorted(broker_kit.ids(stream)) == sorted(ids)
    assert all(r["state"] == "pending" and r["stream_id"] is None for r in rows(outbox))
    if broker_kit.name == "nats":
        # JetStream forgets a message id ``duplicate_window`` after it stored the message (by
        # its own clock, read back from the stream): from then on only reading finds it.
        forgotten = nats_stored_at(stream) + options["duplicate_window"]
        wait_for(lambda: time.time() > forgotten, "JetStream's duplicate window to close")
    # The relay reconciles an intent only once its publish window has passed: the wait
    # below covers it (Redis has no duplicate window to wait for).
    relay = relay_on(outbox, broker_kit.make(**options))
    wait_for(
        lambda: drain(relay, 1) >= 0 and all(r["state"] == "published" for r in rows(outbox)),
        "the orphaned intents reconciled",
        timeout=60,
    )
    assert relay.stats.reconciled_found == 12 and relay.stats.reconciled_missing == 0
    assert sorted(broker_kit.ids(stream)) == sorted(ids)  # nothing twice
    relay.store.close()


def test_a_record_the_broker_refuses_is_quarantined_and_other_keys_go_on(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """The broker refuses every entry of one stream (Redis: a key of another type at the
    stream's name; NATS: a stream that takes no message over 64 bytes); its records are
    quarantined with the server's reason, the other stream's events are published."""
    poisoned = broker_kit.stream("poison")
    refuse(broker_kit, poisoned)
    with outbox.transaction() as tx:
        bad = tx.emit("poison", key="p", payload={"pad": "x" * 200})
        good = [tx.emit("t", key=f"g{i}", payload={"i": i}) for i in range(3)]
    relay = relay_on(outbox, broker_kit.make())
    drain(relay, 5)
    by_id = {r["event_id"]: r for r in rows(outbox)}
    assert by_id[bad]["state"] == "quarantined"
    assert by_id[bad]["last_error"]
    assert all(by_id[g]["state"] == "published" for g in good)
    assert sorted(broker_kit.ids(broker_kit.stream("t"))) == sorted(good)
    relay.store.close()


def refuse(kit: BrokerKit, stream: str) -> None:
    if kit.name == "nats":
        from broker_support import _nats_run
        from nats.js.api import StreamConfig

        from outbox.nats_client import jetstream_name

        config = StreamConfig(name=jetstream_name(stream), subjects=[stream], max_msg_size=64)
        _nats_run(lambda js: js.add_stream(config))
        return
    client = kit._redis()
    try:
        client.set(stream, "not a stream")
    finally:
        client.close()


def cure(kit: BrokerKit, stream: str) -> None:
    """Undo :func:`refuse`: the stream takes the entries again."""
    if kit.name == "nats":
        from broker_support import _nats_run

        from outbox.nats_client import jetstream_name

        _nats_run(lambda js: js.delete_stream(jetstream_name(stream)))
        return
    client = kit._redis()
    try:
        client.delete(stream)
    finally:
        client.close()


def test_a_refused_record_holds_back_its_key_and_after_the_fix_goes_out_first(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """(Moved from tests/test_relay.py.) The broker refuses a record: it is quarantined, the
    later event of its key waits (in another stream), other keys go on. The operator fixes
    the stream and requeues it: both go out, in order, and the status says so."""
    from relay import requeue, status

    poisoned = broker_kit.stream("poison")
    refuse(broker_kit, poisoned)
    with outbox.transaction() as tx:
        p1 = tx.emit("poison", key="K", payload={"n": 1, "pad": "x" * 200})
        other = tx.emit("fine", key="other", payload={})
    relay = relay_on(outbox, broker_kit.make())
    relay.run_once()
    with outbox.transaction() as tx:
        k2 = tx.emit("fine", key="K", payload={"n": 2})  # same key, healthy stream: waits
        other2 = tx.emit("fine", key="other", payload={})
    drain(relay, 3)
    by_id = {r["event_id"]: r for r in rows(outbox)}
    assert by_id[p1]["state"] == "quarantined"
    reason = "bytes" if broker_kit.name == "nats" else "WRONGTYPE"  # the broker's own words
    assert reason in by_id[p1]["last_error"]
    assert by_id[k2]["state"] == "pending"
    assert by_id[other]["state"] == by_id[other2]["state"] == "published"
    report = status(outbox.engine, outbox.schema)
    assert report["quarantined"] == 1 and report["pending"] == 1
    assert report["topics"]["poison"]["quarantined"] == 1
    assert report["topics"]["poison"]["max_attempts"] == 1
    # The fix, then requeue: both go out, in order.
    cure(broker_kit, poisoned)
    result = requeue(outbox.engine, outbox.schema, [p1, "no-such-id"])
    assert result.requeued == [p1] and result.unknown == ["no-such-id"]
    wait_for(
        lambda: drain(relay, 1) >= 0 and all(r["state"] == "published" for r in rows(outbox)),
        "the requeued record and its key's later event published",
        timeout=30,
    )
    assert broker_kit.ids(poisoned) == [p1]
    fine = broker_kit.ids(broker_kit.stream("fine"))
    assert fine.index(k2) > fine.index(other)
    relay.store.close()


def test_a_lost_stream_is_detected_and_published_again(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i % 2}", payload={"i": i}) for i in range(6)]
    relay = relay_on(outbox, broker_kit.make(), auto_republish=True)
    drain(relay, 3)
    stream = broker_kit.stream("t")
    assert sorted(broker_kit.ids(stream)) == sorted(ids)
    broker_kit.lose(stream)
    assert broker_kit.ids(stream) == []
    assert relay.check_redis() is True
    assert relay.stats.data_loss_detected == 1
    assert sorted(broker_kit.ids(stream)) == sorted(ids)  # republished, in key order
    # New events flow again, and the same loss is not reported twice.
    with outbox.transaction() as tx:
        later = tx.emit("t", key="k0", payload={"later": True})
    drain(relay, 3)
    assert broker_kit.ids(stream)[-1] == later
    assert relay.check_redis() is False
    relay.store.close()


@pytest.mark.slow  # a process of its own (the fast tier stays under 2 minutes)
@pytest.mark.parametrize("how", ["--broker-url", "OUTBOX_BROKER_URL", "--redis-url"])
def test_the_relay_command_takes_the_broker_url(
    outbox: Outbox, relay_db_url: str, broker_kit: BrokerKit, how: str
) -> None:
    """``outbox-relay run --once`` on each broker, given by ``--broker-url``, by
    ``OUTBOX_BROKER_URL``, or by the older ``--redis-url`` (a Redis-only name that still
    takes any broker URL, as its alias)."""
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i}", payload={"i": i}) for i in range(5)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    argv = [sys.executable, "-m", "relay", "run", "--once", "--database-url", relay_db_url]
    argv += ["--stream", broker_kit.template]
    if broker_kit.cluster:
        argv.append("--redis-cluster")
    if how.startswith("--"):
        argv += [how, broker_kit.url]
    else:
        env[how] = broker_kit.url
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"published": 5}
    assert sorted(broker_kit.ids(broker_kit.stream("t"))) == sorted(ids)


def test_the_console_trace_shows_the_stream_and_the_receipt(
    outbox: Outbox, relay_db_url: str, broker_kit: BrokerKit
) -> None:
    """``outbox-console trace EVENT --json --broker-url URL``: the published event's stream
    entry read back from the broker, under its stream name and receipt (a Redis entry id,
    a JetStream sequence), with its fields."""
    with outbox.transaction() as tx:
        event_id = tx.emit("t", key="k", payload={"n": 1})
    relay = relay_on(outbox, broker_kit.make())
    drain(relay, 2)
    relay.store.close()
    [row] = rows(outbox)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    argv = [sys.executable, "-m", "outbox.console.cli", "trace", event_id, "--json"]
    argv += ["--database-url", relay_db_url, "--broker-url", broker_kit.url]
    if broker_kit.cluster:
        argv.append("--redis-cluster")
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    [entry] = json.loads(result.stdout)["stream_entries"]
    assert entry["state"] == "present"
    assert (entry["stream"], entry["id"]) == (broker_kit.stream("t"), row["stream_id"])
    assert entry["fields"]["id"] == event_id


def test_a_batch_after_the_loss_is_held_until_the_loss_is_reported(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """The stream is lost between two batches: the next batch is not written over the gap
    (Redis: the marker is behind; NATS: the stream is missing), the relay's check reports
    the loss at once, republishes the lost window and the new event follows, in key order."""
    with outbox.transaction() as tx:
        old = [tx.emit("t", key="k", payload={"i": i}) for i in range(3)]
    relay = relay_on(outbox, broker_kit.make(), auto_republish=True)
    drain(relay, 3)
    stream = broker_kit.stream("t")
    broker_kit.lose(stream)
    with outbox.transaction() as tx:
        new = tx.emit("t", key="k", payload={"i": 3})
    wait_for(
        lambda: drain(relay, 1) >= 0 and new in broker_kit.ids(stream),
        "the new event published after the loss was handled",
        timeout=60,
    )
    assert relay.stats.data_loss_detected == 1
    assert broker_kit.ids(stream) == [*old, new]
    relay.store.close()


@pytest.mark.slow  # a process of its own (the fast tier stays under 2 minutes)
def test_republish_command_on_each_broker(
    outbox: Outbox, relay_db_url: str, broker_kit: BrokerKit
) -> None:
    """``outbox-relay republish --broker-url URL --from-seq 0`` after the broker lost the
    stream: every retained event is in it again, in order."""
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i % 2}", payload={"i": i}) for i in range(4)]
    relay = relay_on(outbox, broker_kit.make())
    drain(relay, 3)
    relay.store.close()
    stream = broker_kit.stream("t")
    broker_kit.lose(stream)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    argv = [sys.executable, "-m", "relay", "republish", "--from-seq", "0"]
    argv += ["--database-url", relay_db_url, "--broker-url", broker_kit.url]
    if broker_kit.cluster:
        argv.append("--redis-cluster")
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert broker_kit.ids(stream) == ids


# -- moved from tests/test_relay.py (they named Redis; what they prove is the broker's too) --


def published_count(outbox: Outbox) -> int:
    return sum(1 for r in rows(outbox) if r["state"] == "published")


@pytest.mark.parametrize("database", ["pg", "sqlite", "mysql"])
def test_a_rolled_back_transaction_publishes_nothing(
    request: pytest.FixtureRequest, broker_kit: BrokerKit, database: str
) -> None:
    outbox = Outbox(str(request.getfixturevalue(f"{database}_url")))
    outbox.create_schema()
    with pytest.raises(RuntimeError), outbox.transaction() as tx:
        tx.emit("quote.approved", key="quote-1", payload={})
        raise RuntimeError("domain failure")
    relay = relay_on(outbox, broker_kit.make())
    assert drain(relay, 3) == 0
    assert broker_kit.read(broker_kit.stream("quote.approved")) == []
    relay.store.close()
    outbox.engine.dispose()


def test_a_stored_payload_that_is_not_json_is_quarantined(
    sqlite_url: str, broker_kit: BrokerKit
) -> None:
    outbox = Outbox(sqlite_url)
    outbox.create_schema()
    with outbox.engine.begin() as conn:  # a hand-written row, bypassing validation
        conn.execute(
            sa.text(
                "INSERT INTO outbox_events (event_id, topic, key, key_hash, identity, payload) "
                "VALUES ('hand-1', 't', 'K', 1, 'hand-1', '{not json')"
            )
        )
    with outbox.transaction() as tx:
        good = tx.emit("t", key="J", payload={})
    relay = relay_on(outbox, broker_kit.make())
    drain(relay, 2)
    by_id = {r["event_id"]: r for r in rows(outbox)}
    assert by_id["hand-1"]["state"] == "quarantined"
    assert "not valid JSON" in by_id["hand-1"]["last_error"]
    assert broker_kit.ids(broker_kit.stream("t")) == [good]
    relay.store.close()
    outbox.engine.dispose()


def test_a_late_commit_is_published_after_it_commits_and_not_overtaken(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    relay = relay_on(outbox, broker_kit.make(), sweep_interval=3600.0)
    stream = broker_kit.stream("t")
    with outbox.engine.connect() as held:
        tx = held.begin()
        late = outbox.emit(held, "t", key="K", payload={"n": 1})  # smaller seq, held open
        before: list[str] = []
        # Other keys keep committing and flowing across several relay cycles (long enough
        # for the claim floor to be sampled and advanced where it safely can).
        deadline = time.monotonic() + 1.6
        while time.monotonic() < deadline:
            with outbox.transaction() as other:
                before.append(other.emit("t", key=f"o{len(before)}", payload={}))
            wait_for(
                lambda: relay.run_once() >= 0 and published_count(outbox) >= len(before),
                "the other keys' events to flow past the open transaction",
            )
        assert late not in broker_kit.ids(stream)
        tx.commit()
    with outbox.transaction() as tx2:
        after = tx2.emit("t", key="K", payload={"n": 2})
    drain(relay, 4)
    got = broker_kit.ids(stream)
    assert late in got and after in got
    assert got.index(late) < got.index(after)
    assert sorted(got) == sorted([*before, late, after])
    relay.store.close()


def test_two_relays_share_the_partitions_and_publish_everything_once_in_key_order(
    relay_db_url: str, outbox: Outbox, broker_kit: BrokerKit
) -> None:
    keys = [f"key-{i}" for i in range(20)]
    expected: dict[str, list[str]] = {k: [] for k in keys}
    stop = threading.Event()
    relays = [relay_on(Outbox(relay_db_url), broker_kit.make(), batch_size=50) for _ in range(2)]
    threads = [threading.Thread(target=r.run, args=(stop,)) for r in relays]
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: all(r.store.partitions_owned for r in relays),
            "both relays owning partitions",
            timeout=20,
        )
        for n in range(20):
            with outbox.transaction() as tx:
                for k in keys[n % 4 :: 4]:
                    expected[k].append(tx.emit("t", key=k, payload={"n": n}))
        total = sum(len(v) for v in expected.values())
        wait_for(lambda: published_count(outbox) >= total, "every event published", timeout=60)
        owned = [set(r.store.partitions_owned) for r in relays]  # before the stop frees them
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    got = broker_kit.read(broker_kit.stream("t"))
    assert len(got) == total
    assert len({e["id"] for e in got}) == total
    for k in keys:
        assert [e["id"] for e in got if e["subject"] == k] == expected[k]
    assert not (owned[0] & owned[1])
    # Each relay that still owns partitions published its share. (On a loaded MariaDB CI run
    # one relay's membership lapsed mid-run and the other took every partition, by design:
    # the events were still published once each, in key order, as checked above.)
    still = [r for r, mine in zip(relays, owned, strict=True) if mine]
    assert still and all(r.stats.published > 0 for r in still)


def test_a_relay_runs_until_stopped_and_runs_again(outbox: Outbox, broker_kit: BrokerKit) -> None:
    """One lifecycle: ``run()`` returns after ``stop()`` with its batches recorded; the same
    relay can run again, and a caller's stop event still works."""
    relay = relay_on(outbox, broker_kit.make())
    with outbox.transaction() as tx:
        tx.emit("t", key="k", payload={"n": 1})
    thread = threading.Thread(target=relay.run)
    thread.start()
    wait_for(lambda: relay.stats.published >= 1, "the first event published", timeout=20)
    relay.stop()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert [r["state"] for r in rows(outbox)] == ["published"]
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,))
    thread.start()
    with outbox.transaction() as tx:
        tx.emit("t", key="k", payload={"n": 2})
    wait_for(lambda: relay.stats.published >= 2, "the second event published", timeout=20)
    stop.set()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert [r["state"] for r in rows(outbox)] == ["published", "published"]


def test_a_relay_dropped_by_its_user_lets_go_of_its_partitions_at_once(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """A relay holds nothing that points back at it (its duties and helpers call it through
    weak references), so dropping it frees it at once, with its partitions: a new relay in
    the same process publishes on its first cycle, whether or not the cyclic garbage
    collector has run (it is off here)."""
    gc.disable()
    try:
        first = relay_on(outbox, broker_kit.make())
        first.run_once()
        gone = weakref.ref(first)
        del first
        assert gone() is None
        with outbox.transaction() as tx:
            tx.emit("t", key="k", payload={"n": 1})
        assert relay_on(outbox, broker_kit.make()).run_once() == 1
    finally:
        gc.enable()


@pytest.fixture(params=["pg", "sqlite", "mysql"])
def any_outbox(request: pytest.FixtureRequest) -> Iterator[Outbox]:
    """An outbox on PostgreSQL (which claims above a floor), on SQLite and on MariaDB
    (without one)."""
    o = Outbox(str(request.getfixturevalue(f"{request.param}_url")))
    o.create_schema()
    yield o
    o.engine.dispose()


def test_a_requeued_event_below_the_claim_floor_goes_out_on_the_next_cycle(
    any_outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """(Moved from tests/test_relay.py.) A relay driven by ``run_once`` (a user's own loop,
    ``outbox.testing``) never LISTENs for the sweep a requeue asks for. Once the claim floor
    has passed the quarantined row, only a sweep reaches it: the cycle that finds nothing to
    claim checks for rows whose backoff is over or that were requeued, and sweeps at once,
    not after ``sweep_interval``."""
    from relay import requeue

    outbox = any_outbox
    poison_stream = broker_kit.stream("poison")
    refuse(broker_kit, poison_stream)
    with outbox.transaction() as tx:
        poisoned = tx.emit("poison", key="P", payload={"pad": "x" * 200})
    relay = relay_on(outbox, broker_kit.make())
    drain(relay, 2)
    assert {r["event_id"]: r for r in rows(outbox)}[poisoned]["state"] == "quarantined"
    # Later events until the claim floor (PostgreSQL's; SQLite claims without one) has
    # passed the quarantined row: from then on only a sweep reaches it.
    seq = {r["event_id"]: r for r in rows(outbox)}[poisoned]["seq"]
    written = 0

    def floor_passed() -> bool:
        nonlocal written
        with outbox.transaction() as tx:
            tx.emit("fine", key=f"k{written}", payload={"n": written})
        written += 1
        drain(relay, 2)
        return getattr(relay.store, "_low", math.inf) > seq

    wait_for(floor_passed, "the claim floor to pass the quarantined row", timeout=30)
    cure(broker_kit, poison_stream)
    assert requeue(outbox.engine, outbox.schema, [poisoned]).requeued == [poisoned]
    while relay.run_once():
        pass
    assert {r["event_id"]: r for r in rows(outbox)}[poisoned]["state"] == "published"
    assert broker_kit.ids(poison_stream) == [poisoned]
    relay.store.close()


class RefuseWrites:
    """A test double at the :class:`relay.broker.Broker` seam: while ``refusing``, the
    broker refuses every entry as a transient failure (what Redis says at maxmemory: the
    real reply is tested on Redis in tests/test_relay.py), and a later entry of a key whose
    entry failed is held back, as the seam asks; otherwise the real broker carries every
    entry. It replaces ``publish`` on the real broker, so all else is the broker's own."""

    def __init__(self, broker: Broker) -> None:
        self.refusing = True
        self.real = broker.publish
        broker.publish = self.publish  # type: ignore[method-assign]

    def publish(self, prepared: Any, fence: str | None = None, **options: Any) -> Any:
        if not self.refusing:
            return self.real(prepared, fence, **options)
        failed: set[str] = set()
        results: list[str | Exception] = []
        for entry in prepared:
            key = entry.record.key
            if key in failed:
                results.append(HeldBack("an earlier event of this key failed in this batch"))
            else:
                failed.add(key)
                results.append(TransientError("OOM: the test's broker refuses writes"))
        return results


def test_transient_failure_backs_off_and_holds_back_only_its_key(
    any_outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """(Moved from tests/test_relay.py.) The broker refuses writes for a while (transient):
    every record of the batch counts an attempt and backs off; once it accepts writes again
    each key's events go out in order, and the failures did not block a key written
    afterwards."""
    outbox = any_outbox
    with outbox.transaction() as tx:
        a1 = tx.emit("t", key="A", payload=1)
        a2 = tx.emit("t", key="A", payload=2)
    broker = broker_kit.make()
    refusal = RefuseWrites(broker)
    relay = relay_on(outbox, broker, record_backoff=Backoff(0.4, 0.4))
    assert relay.run_once() == 0
    by_id = {r["event_id"]: r for r in rows(outbox)}
    assert by_id[a1]["attempts"] == 1 and by_id[a1]["state"] == "pending"
    assert "OOM" in by_id[a1]["last_error"]
    assert by_id[a2]["attempts"] == 0  # held back behind a1, not attempted
    assert broker_kit.ids(broker_kit.stream("t")) == []
    refusal.refusing = False
    with outbox.transaction() as tx:
        b1 = tx.emit("t", key="B", payload=1)
        a3 = tx.emit("t", key="A", payload=3)
    relay.run_once()  # B flows whether or not a1's (jittered) backoff is over
    first = broker_kit.ids(broker_kit.stream("t"))
    assert b1 in first
    assert [i for i in first if i != b1] == [a1, a2, a3][: len(first) - 1]
    wait_for(
        lambda: relay.run_once() >= 0 and len(broker_kit.ids(broker_kit.stream("t"))) >= 4,
        "the four events in the stream",
        timeout=10,
    )
    got = broker_kit.ids(broker_kit.stream("t"))
    assert sorted(got) == sorted([b1, a1, a2, a3])
    assert [i for i in got if i != b1] == [a1, a2, a3]
    relay.store.close()


def one_slot(kit: BrokerKit) -> tuple[str, Any]:
    """A template that puts all of a test's streams in one slot on a cluster (a hash tag on
    the prefix, as the README advises for a key written to several topics), and the stream
    name of a topic under it. Elsewhere the kit's own template."""
    template = kit.template if kit.name == "nats" else "{{" + kit.prefix + "}}.{topic}"

    def stream(topic: str) -> str:
        return template.replace("{{", "{").replace("}}", "}").replace("{topic}", topic)

    return template, stream


def test_failure_of_one_stream_holds_back_the_key_in_other_streams(
    any_outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """(Moved from tests/test_relay.py.) One key's events go to two streams; the first is
    refused permanently in the same batch: the second is held back (pending), not published
    out of order. On a cluster the hold-back spans the streams of one slot (one script): the
    template's hash tag puts both streams there."""
    outbox = any_outbox
    template, stream = one_slot(broker_kit)
    refuse(broker_kit, stream("bad"))
    with outbox.transaction() as tx:
        first = tx.emit("bad", key="K", payload={"pad": "x" * 200})
        second = tx.emit("good", key="K", payload=2)
        other = tx.emit("good", key="L", payload=3)
    relay = relay_on(outbox, broker_kit.make(stream_template=template))
    relay.run_once()
    by_id = {r["event_id"]: r for r in rows(outbox)}
    assert by_id[first]["state"] == "quarantined"
    assert by_id[second]["state"] == "pending" and by_id[second]["claimed_by"] is None
    assert broker_kit.ids(stream("good")) == [other]
    relay.store.close()


def test_rows_held_behind_a_key_are_all_swept_after_it_recovers(
    outbox: Outbox, broker_kit: BrokerKit
) -> None:
    """(Moved from tests/test_relay.py.) Many rows wait behind one key while others flow
    past them (the claim floor moves beyond); once the key recovers, the sweep walks back
    over all of them, batch after batch, in order. (Both streams in one slot on a cluster:
    the hash tag.)"""
    from relay import requeue

    template, stream = one_slot(broker_kit)
    bad, good = stream("bad"), stream("good")
    refuse(broker_kit, bad)
    with outbox.transaction() as tx:
        head = tx.emit("bad", key="K", payload={"pad": "x" * 200})
        waiting = [tx.emit("good", key="K", payload=n) for n in range(1, 12)]
    relay = relay_on(
        outbox,
        broker_kit.make(stream_template=template),
        batch_size=3,
        sweep_interval=3600.0,
    )
    deadline = time.monotonic() + 1.5
    others: list[str] = []
    while time.monotonic() < deadline:  # other keys flow; the floor passes K's rows
        with outbox.transaction() as tx:
            others.append(tx.emit("good", key=f"o{len(others)}", payload={}))
        wait_for(
            lambda: relay.run_once() >= 0 and len(broker_kit.ids(good)) >= len(others),
            "the other keys' events to flow past K's",
        )
    drain(relay, 20)
    assert not set(waiting) & set(broker_kit.ids(good))
    cure(broker_kit, bad)
    requeue(outbox.engine, outbox.schema, [head])
    wait_for(
        lambda: relay.run_once() >= 0 and set(waiting) <= set(broker_kit.ids(good)),
        "K's waiting rows published",
        timeout=20,
        interval=0.01,
    )
    got = broker_kit.ids(good)
    assert [i for i in got if i in waiting] == waiting
    assert set(others) <= set(got)
    assert broker_kit.ids(bad) == [head]
    relay.store.close()


@pytest.mark.slow
def test_a_relay_goes_on_by_itself_after_its_broker_restarts(
    outbox: Outbox, restartable_kit: Restartable
) -> None:
    kit = restartable_kit.kit
    relay = relay_on(outbox, kit.make(), outage_backoff=Backoff(0.05, 0.5))
    thread = threading.Thread(target=relay.run, name="relay")
    thread.start()
    ids: list[str] = []
    try:
        for round_ in range(3):
            with outbox.transaction() as tx:
                ids += [
                    tx.emit("t", key=f"k{i % 3}", payload={"r": round_, "i": i}) for i in range(10)
                ]
            want = len(ids)
            wait_for(lambda w=want: relay.stats.published >= w, f"{want} published", timeout=60)
            if round_ < 2:
                restartable_kit.restart()  # the next round is committed while it comes back
        assert thread.is_alive()  # no exit, no restart by hand
    finally:
        relay.stop()
        thread.join(timeout=30)
    got = kit.ids(kit.stream("t"))
    assert sorted(got) == sorted(ids)  # each once
    for k in range(3):
        mine = [i for n, i in enumerate(ids) if n % 3 == k]
        assert [i for i in got if i in mine] == mine
    assert all(r["state"] == "published" for r in rows(outbox))
