"""A database outage in the relay's and the consumer's retry loops (issue 41, item 20): a
line when it starts, at most one a minute while it lasts, one when it ends; not a line per
retry. A private PostgreSQL is stopped under a running loop and started again."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from consumer import Consumer
from consumer.consumer import ConsumerConfig, ConsumerTx
from consumer.event import ConsumedEvent, encode_entry
from outbox import Outbox
from outbox.backoff import Backoff
from outbox.hooks import Hooks
from relay import RedisStreamPublisher, Relay, RelayConfig
from tests.services import PrivatePostgres, wait_for

FAST = Backoff(0.02, 0.1)  # many retries in a short outage


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    with PrivatePostgres() as server:
        yield server


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every warning or error logged, in order."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(180)
def test_the_relay_logs_a_database_outage_as_a_run(
    pg: PrivatePostgres,
    redis_client: redis.Redis,
    stream_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    outbox = Outbox(pg.url)
    outbox.create_schema()
    publisher = RedisStreamPublisher(redis_client, f"{stream_prefix}.{{topic}}")
    relay = Relay(outbox, publisher, RelayConfig(poll_interval=0.02, outage_backoff=FAST))
    runner = threading.Thread(target=relay.run, args=(threading.Event(),), daemon=True)
    with caplog.at_level(logging.INFO, logger="outbox"):
        runner.start()
        try:
            wait_for(lambda: relay.stats.cycles > 0, "the relay's first cycle", timeout=60)
            pg.stop("fast")
            wait_for(lambda: relay.stats.errors >= 10, "retries during the outage", timeout=60)
            pg.start()
            back = relay.stats.cycles
            # Two cycles after it is back: the turn that recovered has ended.
            wait_for(lambda: relay.stats.cycles >= back + 2, "the relay to recover", timeout=60)
        finally:
            relay.stop()
            runner.join(30)
    assert relay.stats.errors >= 10
    # Under a minute of outage: the start and the end, not a line per retry.
    lines = _warnings(caplog)
    assert [line for line in lines if line.startswith("relay cycle")] == [
        "relay cycle failed",
        "relay cycle recovered",
    ]
    assert len(lines) == len(set(lines)), lines  # nothing else logged per retry either
    outbox.engine.dispose()


@pytest.mark.timeout(180)
def test_the_consumer_logs_a_database_outage_as_a_run(
    pg: PrivatePostgres,
    redis_url: str,
    redis_client: redis.Redis,
    stream_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream = f"{stream_prefix}.outbox.quote.approved"
    handled: list[str] = []
    cycles: list[float] = []

    class Cycles(Hooks):
        def consumer_cycle_ok(self, timestamp: float) -> None:
            cycles.append(timestamp)

    consumer = Consumer(
        pg.url,
        redis_url,
        group="billing",
        topics=["quote.approved"],
        stream=f"{stream_prefix}.outbox.{{topic}}",
        config=ConsumerConfig(block_ms=20, backoff=FAST),
        hooks=Cycles(),
    )

    @consumer.handler("quote.approved")
    def approved(event: ConsumedEvent, tx: ConsumerTx) -> None:
        handled.append(event.id)

    consumer.create_schema()
    attempts: list[int] = []
    process = consumer.processor.process

    def counted(entries: Any) -> Any:  # how many batches the loop tried: the real ones
        attempts.append(len(entries))
        return process(entries)

    consumer.processor.process = counted  # type: ignore[method-assign]
    stop = threading.Event()
    runner = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    with caplog.at_level(logging.INFO, logger="outbox"):
        runner.start()
        try:
            pg.stop("fast")
            # An entry while the database is down: its batch fails and is retried.
            fields = encode_entry("quote.approved", {"n": 1}, event_id="evt-1", identity="q-17")
            redis_client.xadd(stream, fields)  # type: ignore[arg-type]
            wait_for(lambda: len(attempts) >= 10, "retries during the outage", timeout=60)
            pg.start()
            wait_for(lambda: handled == ["evt-1"], "the entry handled", timeout=60)
            back = len(cycles)
            # Two cycles after it is back: the batch that recovered has ended.
            wait_for(lambda: len(cycles) >= back + 2, "the consumer to recover", timeout=60)
        finally:
            stop.set()
            runner.join(30)
    # Under a minute of outage: the start and the end, not a line per retry.
    lines = _warnings(caplog)
    assert [line for line in lines if line.startswith("consumer batch")] == [
        "consumer batch failed",
        "consumer batch recovered",
    ]
    assert len(lines) == len(set(lines)), lines  # nothing else logged per retry either
    consumer.engine.dispose()
