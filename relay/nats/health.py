"""The relay's check of its JetStream streams: did one lose messages the receipts name?

A JetStream stream loses acknowledged messages when it is deleted, purged, restored from
an older backup, or kept in memory by a server that restarted. The relay compares, for each
outbox stream among its latest receipts, the highest receipt's sequence with the stream:

- the stream is gone, or ends before that sequence: lost;
- the message at that sequence is gone (purged or deleted) while the stream's ``max_age``
  says it should still be there: lost.

A loss is logged with the ``outbox-relay republish`` command (and republished at once with
``auto_republish``), counted in ``outbox_relay_redis_data_loss`` as on Redis, and the
stream is created again so new events flow; the same loss is not reported again while the
receipts still end at it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from outbox.logs import fields
from outbox.nats_client import jetstream_name
from relay.config import RelayConfig
from relay.records import RelayStats
from relay.republish import republish, since_argument
from relay.store import Store

log = logging.getLogger("outbox.relay")


class NatsCheck:
    """One relay's check of its JetStream streams (see the module docstring);
    ``persistence`` is the storage of the streams checked last (``file``, ``memory``)."""

    def __init__(
        self,
        store: Store,
        broker: Any,  # the NatsBroker that builds this check
        config: RelayConfig,
        stats: RelayStats,
        hook: Callable[..., None],
    ) -> None:
        self.store = store
        self.broker = broker
        self.config = config
        self.stats = stats
        self.hook = hook
        self.persistence: str | None = None
        self._reported: dict[str, int] = {}  # outbox stream -> the receipt reported lost

    def check(self) -> bool:
        lost = False
        for stream, entry_id in self.store.receipt_latest():
            if not (entry_id.isascii() and entry_id.isdigit()):
                continue  # not a sequence: a receipt of another broker (a Redis entry id)
            seq = int(entry_id)
            name = jetstream_name(stream)
            if self._reported.get(stream) == seq:
                continue  # reported already; the stream was created again since
            self.broker.known[name] = max(self.broker.known.get(name, 0), seq)
            problem = self.broker.client.run(lambda js, n=name, s=seq: self._look(js, n, s))
            if problem is not None:
                self._lost(stream, seq, problem)
                lost = True
        return lost

    async def _look(self, js: Any, name: str, seq: int) -> str | None:
        """Why stream ``name`` no longer holds sequence ``seq`` (None: it does, or it was
        trimmed by its own age limit)."""
        errors = self.broker.client.nats.js.errors
        try:
            info = await js.stream_info(name)
        except errors.NotFoundError:
            return "the stream is gone"
        storage = str(getattr(info.config.storage, "value", info.config.storage))
        if storage != self.persistence:
            if storage == "memory":
                log.warning(
                    "JetStream stream kept in memory: a server restart loses its messages",
                    extra=fields(stream=name),
                )
            self.persistence = storage
        if info.state.last_seq < seq:
            return f"the stream ends at {info.state.last_seq}"
        try:
            msg = await js.get_msg(name, seq)
        except errors.NotFoundError:
            max_age = float(info.config.max_age or 0)
            if max_age and info.state.first_seq > seq and info.state.messages:
                first = await js.get_msg(name, info.state.first_seq)
                if first.time is not None and time.time() - _epoch(first.time) >= max_age / 2:
                    return None  # trimmed by age, as configured
            return f"the message at {seq} is gone (the stream starts at {info.state.first_seq})"
        del msg
        return None

    def _lost(self, stream: str, seq: int, problem: str) -> None:
        since = self.store.outbox_oldest_published_since(None)
        command = (
            f"outbox-relay republish --since {since_argument(since)}"
            if since is not None
            else "none: no retained published event"
        )
        log.error(
            "JetStream lost messages the relay had published (the stream was deleted, "
            "purged or restored from behind); run the republish command",
            extra=fields(
                stream=stream,
                jetstream_stream=jetstream_name(stream),
                latest_receipt=seq,
                problem=problem,
                republish=command,
                auto_republish=self.config.auto_republish,
            ),
        )
        self.stats.data_loss_detected += 1
        self.hook("relay_redis_data_loss", time.time())
        self.broker.recreate(stream)
        self._reported[stream] = seq
        if self.config.auto_republish and since is not None:
            result = republish(
                self.store, self.broker, since=since, batch_size=self.config.batch_size
            )
            self.stats.republished += result.republished
            log.info(
                "auto-republish done",
                extra=fields(
                    republished=result.republished,
                    failed=result.failed,
                    since=since_argument(since),
                    errors=result.errors[:3],
                ),
            )


def _epoch(value: Any) -> float:
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    from datetime import datetime

    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


__all__ = ["NatsCheck"]
