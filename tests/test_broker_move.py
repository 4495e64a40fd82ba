"""Moving a table's relay from one broker to the other (issue 53: "moving a table's relay
from NATS to Redis blocks it for good. It logs a false 'Redis lost stream entries', then
'batch refused: the Redis marker is behind the receipts' about 50 times a second").

The receipts of the rows published before the move are the other broker's (JetStream
sequences such as ``57``, or Redis entry ids such as ``1733600000000-0``); each broker's
check of lost entries now reads only its own. On PostgreSQL and SQLite, both ways: the rows
written after the move are published to the new broker at once, each once, with no data
loss reported and no batch refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from outbox import Outbox
from relay.config import RelayConfig
from relay.relay import Relay
from tests.broker_support import BrokerKit, kit_for

TOPIC = "quote.moved"


@pytest.fixture
def kits(request: pytest.FixtureRequest, stream_prefix: str) -> Iterator[dict[str, BrokerKit]]:
    redis = kit_for(request, "redis", stream_prefix)
    nats = kit_for(request, "nats", stream_prefix)
    yield {"redis": next(redis), "nats": next(nats)}
    for kit in (redis, nats):
        next(kit, None)  # its clean-up


def _emit(outbox: Outbox, first: int, count: int) -> None:
    with outbox.transaction() as tx:
        for n in range(first, first + count):
            tx.emit(TOPIC, key=f"quote-{n % 3}", payload={"n": n})


def _drain(outbox: Outbox, kit: BrokerKit) -> int:
    relay = Relay(outbox, kit.make(), RelayConfig(batch_size=7))
    try:
        published = 0
        for _ in range(20):
            count = relay.run_once()
            published += count
            if not count:
                break
        return published
    finally:
        relay.store.close()


@pytest.mark.parametrize(("before", "after"), [("nats", "redis"), ("redis", "nats")])
def test_a_table_moves_between_brokers_and_goes_on(
    db_url: str,
    kits: dict[str, BrokerKit],
    before: str,
    after: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    outbox = Outbox(db_url)
    outbox.create_schema()
    _emit(outbox, 0, 20)
    assert _drain(outbox, kits[before]) == 20
    _emit(outbox, 20, 20)  # written after the move
    with caplog.at_level(logging.WARNING, logger="outbox"):
        assert _drain(outbox, kits[after]) == 20
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "lost" in m or "refused" in m], said
    stream = kits[after].stream(TOPIC)
    numbers = [int(json.loads(f["data"])["n"]) for f in kits[after].read(stream)]
    assert sorted(numbers) == list(range(20, 40))  # each once, none of before's
    outbox.engine.dispose()
