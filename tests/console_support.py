"""A small world for the console's tests: quotes approved in the outbox, published by a real
relay to real Redis, consumed by a real consumer group that enqueues one job per quote
(``subject`` = the event key, as the README's handler does), and jobs whose external effect
goes through real operation intents with an in-process provider (the external party: it
accepts, or times out after acting, as a real provider can).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from consumer import Consumer
from consumer.consumer import ConsumerConfig
from consumer.errors import ProviderTimeout
from consumer.jobs.operations import Operations, Receipt
from consumer.jobs.store import Lease, Store
from outbox import Outbox
from relay import RedisStreamPublisher, Relay, RelayConfig

TENANT = "studio"
TOPIC = "quote.approved"


@dataclass
class Provider:
    """A mail provider in the test's process. ``outcome``: ``accept`` returns a ref,
    ``timeout`` acts and then loses the answer (the receipt becomes UNKNOWN)."""

    name: str = "mail"
    supports_lookup: bool = False
    supports_idempotency: bool = False
    outcome: str = "accept"
    sent: list[str] = field(default_factory=list)

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        self.sent.append(operation_id)
        if self.outcome == "timeout":
            raise ProviderTimeout("the provider did not answer in time")
        return f"msg-{len(self.sent)}"

    def lookup(self, operation_id: str) -> str | None:  # pragma: no cover - no lookup
        return None


class World:
    def __init__(self, db_url: str, client: redis.Redis, prefix: str) -> None:
        self.outbox = Outbox(db_url)
        self.outbox.create_schema()
        self.engine = self.outbox.engine
        self.client = client
        self.prefix = prefix
        self.stream_template = f"{prefix}.{{topic}}"
        self.store = Store(self.engine)
        self.provider = Provider()
        self.ops = Operations(self.store, {"mail": self.provider}, default_timeout=30)
        self.relay = Relay(
            self.outbox,
            RedisStreamPublisher(client, self.stream_template),
            RelayConfig(batch_size=100),
        )
        self.consumer = Consumer(
            self.engine,
            client,
            group="billing",
            topics=[TOPIC],
            stream=self.stream_template,
            # One failed delivery dead-letters an entry (the tests' poison quotes).
            config=ConsumerConfig(block_ms=50, batch_size=100, max_deliveries=1),
        )
        self.consumer.create_schema()
        store = self.store
        self.failing: set[str] = set()
        failing = self.failing

        @self.consumer.handler(TOPIC)
        def on_quote(event: Any, tx: Any) -> None:
            if event.identity in failing:
                raise RuntimeError(f"cannot handle {event.identity}")
            store.enqueue(
                event.tenant,
                f"send-{event.subject}",
                subject=event.subject,
                payload=event.data,
                session=tx.session,
            )

    # -- the pipeline, step by step -------------------------------------------------------

    def approve(self, n: int, payload: dict[str, Any] | None = None, topic: str = TOPIC) -> str:
        """Approve quote n: its event in one transaction; returns the event id."""
        with self.outbox.transaction() as tx:
            return tx.emit(
                topic,
                key=f"quote-{n:03d}",
                payload=payload if payload is not None else {"quote": n, "total": 100 + n},
                tenant=TENANT,
                identity=f"{TENANT}:send-quote-{n:03d}",
            )

    def publish(self) -> None:
        while self.relay.run_once():
            pass

    def consume(self) -> None:
        while self.consumer.run_once():
            pass

    def claim(self, n: int) -> Lease:
        """Claim quote n's job (the only READY one: each test moves its quotes one by one)."""
        lease = self.store.claim_next("worker-a", ttl=60)
        assert lease is not None and lease.action == f"send-quote-{n:03d}", lease
        return lease

    def send(self, n: int, outcome: str = "accept") -> tuple[Lease, Receipt | None]:
        """Run quote n's job: dispatch the email; ``accept`` then finish the job, ``timeout``
        leaves the receipt UNKNOWN (the job is handed to a person: WAITING_REVIEW)."""
        lease = self.claim(n)
        self.provider.outcome = outcome
        try:
            receipt = self.ops.dispatch(lease, "email", "mail", {"quote": n})
        except ProviderTimeout:
            self.store.wait_review(lease, reason="the provider did not answer")
            return lease, self.ops.receipt(f"{lease.job_id}:email")
        self.store.finish(lease)
        return lease, receipt

    def through_consumer(self, n: int, payload: dict[str, Any] | None = None) -> str:
        event_id = self.approve(n, payload)
        self.publish()
        self.consume()
        return event_id

    def dead_letter(self, n: int) -> str:
        """Quote n's event, dead-lettered by the group (its handler fails once)."""
        self.failing.add(f"{TENANT}:send-quote-{n:03d}")
        event_id = self.through_consumer(n)
        self.failing.clear()
        return event_id

    def quarantine(self, n: int, topic: str = "quote.poison") -> str:
        """An event the relay quarantines at once: its stream key holds a string (WRONGTYPE)."""
        self.client.set(self.stream_template.format(topic=topic), "not a stream")
        event_id = self.approve(n, topic=topic)
        self.publish()
        return event_id

    def close(self) -> None:
        self.store.dispose()
