"""One definition of an outbox stream on NATS JetStream (issue 40, review finding): the
relay and the consumer create a stream with :func:`outbox.nats_client.stream_config`, so
whichever process comes first, the stream is the relay's. A consumer that starts before
any relay creates the stream with the relay's defaults, marked provisional; the first
relay to meet it sets its own settings on it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from consumer import Consumer, ConsumerConfig
from outbox import Outbox
from outbox.nats_client import PROVISIONAL, NatsClient, add_stream, jetstream_name, stream_config
from relay import Relay, RelayConfig
from relay.nats.broker import NatsBroker

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from broker_support import BrokerKit, nats_kit
except ImportError:  # pragma: no cover
    from tests.broker_support import BrokerKit, nats_kit  # noqa: F401


@pytest.fixture
def outbox(pg_url: str) -> Iterator[Outbox]:
    o = Outbox(pg_url)
    o.create_schema()
    yield o
    o.engine.dispose()


def on_nats(kit: BrokerKit, step: Any) -> Any:
    client = NatsClient(kit.url)
    try:
        return client.run(step)
    finally:
        client.close()


def config_of(kit: BrokerKit, stream: str) -> dict[str, Any]:
    """The JetStream stream's configuration, without what names it."""

    async def info(js: Any) -> Any:
        return await js.stream_info(jetstream_name(stream))

    found = on_nats(kit, info).config.as_dict()
    for key in ("name", "subjects"):
        found.pop(key, None)
    return dict(found)


def start_consumer(pg_url: str, kit: BrokerKit, topic: str) -> None:
    consumer = Consumer(
        pg_url,
        kit.url,
        group="billing",
        topics=[topic],
        stream=kit.template,
        config=ConsumerConfig(block_ms=50),
    )
    consumer.add_handler(topic, lambda event, tx: None)
    consumer.run_once(block=False)  # creates the group, and so the stream
    consumer.stop()


def relay_once(outbox: Outbox, kit: BrokerKit, topic: str, **options: Any) -> None:
    with outbox.transaction() as tx:
        tx.emit(topic, key="k", payload={})
    relay = Relay(
        outbox,
        kit.make(**options),
        RelayConfig(publish_deadline=0.5, clock_margin=0.2),
    )
    assert sum(relay.run_once() for _ in range(3)) >= 1
    relay.store.close()


def test_a_consumer_before_any_relay_creates_the_relays_stream(
    outbox: Outbox, pg_url: str, nats_kit: BrokerKit
) -> None:
    """With the relay's defaults: the stream the consumer created is the one a relay
    creates (but for the provisional mark, which the relay's first publish removes)."""
    relay_once(outbox, nats_kit, "first")  # a relay alone: its own stream
    relays = config_of(nats_kit, nats_kit.stream("first"))

    start_consumer(pg_url, nats_kit, "early")
    early = config_of(nats_kit, nats_kit.stream("early"))
    assert early.pop("description") == PROVISIONAL
    assert early == {k: v for k, v in relays.items() if k != "description"}

    relay_once(outbox, nats_kit, "early")
    assert config_of(nats_kit, nats_kit.stream("early")) == relays


def test_the_first_relay_sets_its_own_settings_on_a_consumers_stream(
    outbox: Outbox, pg_url: str, nats_kit: BrokerKit
) -> None:
    """A relay with settings of its own (window, retention, length, message size) meets a
    stream a consumer created: the stream ends with the configuration that relay gives a
    stream it creates itself, and the group the consumer made goes on reading it."""
    options = {
        "duplicate_window": 30.0,
        "stream_retention": 3600.0,
        "maxlen": 5000,
        "max_message_bytes": 65536,
    }
    relay_once(outbox, nats_kit, "first", **options)
    relays = config_of(nats_kit, nats_kit.stream("first"))
    assert relays["duplicate_window"] == 30 * 10**9 and relays["max_msgs"] == 5000

    start_consumer(pg_url, nats_kit, "early")
    relay_once(outbox, nats_kit, "early", **options)
    assert config_of(nats_kit, nats_kit.stream("early")) == relays

    async def consumers(js: Any) -> list[str]:
        infos = await js.consumers_info(jetstream_name(nats_kit.stream("early")))
        return [i.name for i in infos]

    assert on_nats(nats_kit, consumers) == ["billing"]


def test_a_stream_created_at_once_by_a_relay_and_a_consumer_is_the_relays(
    nats_kit: BrokerKit,
) -> None:
    """The relay and a consumer both found no stream and both create it: whichever add
    comes second finds the other's (JetStream: stream name already in use) and goes on with
    it, the relay setting its own settings on a consumer's; neither fails, and no event is
    quarantined for it."""
    broker = nats_kit.make(duplicate_window=30.0)
    assert isinstance(broker, NatsBroker)

    # The consumer came first: the relay's create meets its stream and adopts it.
    first = nats_kit.stream("first")
    provisional = stream_config(jetstream_name(first), [first], provisional=True)
    on_nats(nats_kit, lambda js: add_stream(js, provisional))
    info = broker.client.run(lambda js: broker._create(js, jetstream_name(first), first))
    assert info.config.description != PROVISIONAL
    assert info.config.duplicate_window == 30.0
    assert config_of(nats_kit, first)["duplicate_window"] == 30 * 10**9

    # The relay came first: the consumer's create reads the relay's stream as it is.
    second = nats_kit.stream("second")
    broker.client.run(lambda js: broker._create(js, jetstream_name(second), second))
    relays = config_of(nats_kit, second)
    late = stream_config(jetstream_name(second), [second], provisional=True)
    found = on_nats(nats_kit, lambda js: add_stream(js, late))
    assert found.config.description != PROVISIONAL
    assert config_of(nats_kit, second) == relays
