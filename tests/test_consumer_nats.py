"""The consumer on NATS JetStream (issue 40): ``Consumer(db_url, "nats://...", group=...,
topics=..., stream=...)`` reads the streams the relay writes through a durable pull
consumer per group, deduplicates by business identity in the inbox as on Redis, shares a
group's messages among its processes, redelivers what a failed handler left unacknowledged
and ends a poison message in the dead letters (the database record and a copy on the
dead-letter subject)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from consumer import Consumer, ConsumerConfig
from outbox import Outbox
from outbox.nats_client import (
    DEAD_LETTER_MAX_BYTES,
    DEAD_LETTER_MAX_MSGS,
    DEAD_LETTERS,
    NatsClient,
    jetstream_name,
)
from relay import Relay, RelayConfig

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from broker_support import BrokerKit, nats_kit
    from services import wait_for
except ImportError:  # pragma: no cover
    from tests.broker_support import BrokerKit, nats_kit  # noqa: F401
    from tests.services import wait_for


@pytest.fixture
def outbox(pg_url: str) -> Iterator[Outbox]:
    o = Outbox(pg_url)
    o.create_schema()
    yield o
    o.engine.dispose()


def publish(outbox: Outbox, kit: BrokerKit) -> Relay:
    relay = Relay(outbox, kit.make(), RelayConfig(publish_deadline=0.5, clock_margin=0.2))
    for _ in range(3):
        relay.run_once()
    relay.store.close()
    return relay


def consumer_for(pg_url: str, kit: BrokerKit, group: str = "billing", **config: Any) -> Consumer:
    settings: dict[str, Any] = {"block_ms": 100}
    settings.update(config)
    return Consumer(
        pg_url,
        kit.url,
        group=group,
        topics=["t"],
        stream=kit.template,
        config=ConsumerConfig(**settings),
    )


def test_a_group_handles_each_event_once_and_a_republished_one_is_a_duplicate(
    outbox: Outbox, pg_url: str, nats_kit: BrokerKit
) -> None:
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i % 3}", payload={"i": i}) for i in range(9)]
    publish(outbox, nats_kit)
    seen: list[str] = []
    first = consumer_for(pg_url, nats_kit)
    second = consumer_for(pg_url, nats_kit)  # the same group: they share the messages
    for c in (first, second):
        c.add_handler("t", lambda event, tx: seen.append(event.id))
    wait_for(
        lambda: sum(c.run_once(block=False) for c in (first, second)) >= 0 and len(seen) >= 9,
        "the nine events handled",
        timeout=30,
    )
    assert sorted(seen) == sorted(ids)
    # Each key's events in order (one stream, read in sequence).
    for k in range(3):
        mine = [i for n, i in enumerate(ids) if n % 3 == k]
        assert [i for i in seen if i in mine] == mine
    # The same events again, as a republish past JetStream's duplicate window sends them
    # (under ids of their own): the inbox finds them duplicates, nothing is handled twice.
    stream = nats_kit.stream("t")
    again = [
        (stream, json.dumps(entry).encode(), {"Nats-Msg-Id": f"{entry['id']}~again"})
        for entry in nats_kit.read(stream)
    ]
    client = NatsClient(nats_kit.url)
    try:
        client.run(lambda js: client.publish_many(again))
    finally:
        client.close()
    acknowledged = 0
    for _ in range(5):
        acknowledged += first.run_once(block=False) + second.run_once(block=False)
    assert acknowledged == 9  # taken, found duplicates, acknowledged
    assert sorted(seen) == sorted(ids)
    # Another group reads everything again, for itself.
    other: list[str] = []
    audit = consumer_for(pg_url, nats_kit, group="audit")
    audit.add_handler("t", lambda event, tx: other.append(event.id))
    wait_for(
        lambda: audit.run_once(block=False) >= 0 and len(set(other)) >= 9,
        "the other group's nine events",
        timeout=30,
    )
    assert sorted(set(other)) == sorted(ids) and len(other) == len(set(other))
    lag = first.reader.lag(nats_kit.stream("t"))
    assert lag == (0, 0)


def test_a_failing_handler_is_redelivered_then_dead_lettered(
    outbox: Outbox, pg_url: str, nats_kit: BrokerKit
) -> None:
    with outbox.transaction() as tx:
        poison = tx.emit("t", key="p", payload={"bad": True})
        good = tx.emit("t", key="g", payload={"bad": False})
    publish(outbox, nats_kit)
    handled: list[str] = []
    attempts: list[int] = []
    consumer = consumer_for(pg_url, nats_kit, claim_idle_ms=200, max_deliveries=3)

    fixed = [False]

    @consumer.handler("t")
    def handle(event: Any, tx: Any) -> None:
        if event.data["bad"] and not fixed[0]:
            attempts.append(event.deliveries)
            raise RuntimeError("cannot handle this one")
        handled.append(event.id)

    wait_for(
        lambda: consumer.run_once() >= 0 and bool(consumer.dead_letters()),
        "the poison event dead-lettered",
        timeout=60,
    )
    assert handled == [good]
    # Redelivered by JetStream and counted (a batch runs a failed handler again alone, so a
    # delivery may show twice), stopped at the third.
    assert sorted(set(attempts)) == [1, 2, 3]
    [record] = consumer.dead_letters()
    assert record["event_id"] == poison
    copies = nats_kit.read(nats_kit.stream("t") + ".dead-letter")
    assert [c["id"] for c in copies] == [poison]
    assert copies[0]["dl.group"] == "billing" and copies[0]["dl.deliveries"] == "3"
    # Settled: nothing comes back.
    for _ in range(3):
        assert consumer.run_once(block=False) == 0
    # Fixed, then replayed from the command line: a new message, handled once.
    fixed[0] = True
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    argv = [sys.executable, "-c", "import sys, consumer.cli; sys.exit(consumer.cli.main())"]
    argv += ["replay"]
    argv += [str(record["id"]), "--database-url", pg_url, "--broker-url", nats_kit.url]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replayed dead-letter record" in result.stdout
    wait_for(
        lambda: consumer.run_once() >= 0 and poison in handled, "the replayed event", timeout=30
    )
    assert handled == [good, poison]


def _dead_letter_one(outbox: Outbox, pg_url: str, nats_kit: BrokerKit) -> tuple[str, Any]:
    """One event whose handler always fails, consumed until it is dead-lettered: its id and
    the consumer (``max_deliveries=1``), for the caller to stop."""
    with outbox.transaction() as tx:
        poison = tx.emit("t", key="p", payload={})
    publish(outbox, nats_kit)
    consumer = consumer_for(pg_url, nats_kit, max_deliveries=1)

    @consumer.handler("t")
    def handle(event: Any, tx: Any) -> None:
        raise RuntimeError("always fails")

    wait_for(
        lambda: consumer.run_once() >= 0 and bool(consumer.dead_letters()),
        "the poison event dead-lettered",
        timeout=60,
    )
    return poison, consumer


def test_the_dead_letter_stream_has_its_own_limits_and_never_drops_a_dead_letter(
    outbox: Outbox, pg_url: str, nats_kit: BrokerKit
) -> None:
    """The consumer creates the dead-letter stream with its own definition, not the
    server's defaults: file storage, no max age, bounded bytes and count with discard=new
    (a full stream refuses a copy rather than drop the oldest one)."""
    poison, consumer = _dead_letter_one(outbox, pg_url, nats_kit)
    subject = nats_kit.stream("t") + ".dead-letter"
    assert [c["id"] for c in nats_kit.read(subject)] == [poison]

    async def info(js: Any) -> Any:
        return await js.stream_info(jetstream_name(subject))

    client = NatsClient(nats_kit.url)
    try:
        found = client.run(info).config
    finally:
        client.close()
    api = client.nats.js.api
    assert found.description == DEAD_LETTERS
    assert found.subjects == [subject]
    assert found.storage == api.StorageType.FILE
    assert found.discard == api.DiscardPolicy.NEW
    assert found.max_bytes == DEAD_LETTER_MAX_BYTES
    assert found.max_msgs == DEAD_LETTER_MAX_MSGS
    assert not found.max_age  # kept until someone removes them, as their database records
    consumer.stop()


def test_a_full_dead_letter_stream_refuses_the_copy_loudly_and_the_entry_is_settled(
    outbox: Outbox, pg_url: str, nats_kit: BrokerKit, caplog: pytest.LogCaptureFixture
) -> None:
    """discard=new: a full dead-letter stream refuses the next copy instead of dropping the
    oldest dead letter; the consumer logs the refusal as an error and settles the entry
    (its database record is the durable one), as on Redis, instead of retrying forever."""
    subject = nats_kit.stream("t") + ".dead-letter"

    async def full(js: Any) -> None:
        api = client.nats.js.api
        config = api.StreamConfig(
            name=jetstream_name(subject),
            subjects=[subject],
            max_msgs=1,
            discard=api.DiscardPolicy.NEW,
        )
        await js.add_stream(config)
        await js.publish(subject, b'{"id": "older"}')

    client = NatsClient(nats_kit.url)
    try:
        client.run(full)
    finally:
        client.close()
    with caplog.at_level("ERROR", logger="outbox.consumer"):
        poison, consumer = _dead_letter_one(outbox, pg_url, nats_kit)
        assert consumer.run_once(block=False) == 0
    assert [r["event_id"] for r in consumer.dead_letters()] == [poison]
    assert [c["id"] for c in nats_kit.read(subject)] == ["older"]  # the older one kept
    assert any(r.getMessage() == "dead-letter copy refused" for r in caplog.records)
    assert consumer.reader.lag(nats_kit.stream("t")) == (0, 0)  # settled, not retried
    consumer.stop()
