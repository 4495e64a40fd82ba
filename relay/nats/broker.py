"""NATS JetStream as the relay's broker (:class:`relay.seam.Broker`).

The mapping: an outbox stream name (the template rendered, ``outbox.quote.approved``) is
the message's **subject**, and the JetStream **stream** that holds it is that name with the
characters a stream name cannot hold replaced (:func:`jetstream_name`:
``outbox_quote_approved``): one JetStream stream per outbox stream name, created on first
use. The body is the entry's fields as one JSON object (the same CloudEvents attributes as
a Redis entry, :mod:`outbox.codec`); the header ``Nats-Msg-Id`` is the event id. A receipt
is the stream sequence (``"42"``).

How each guarantee holds here:

- **No duplicate from a relay crash**: JetStream drops a second message with the same
  ``Nats-Msg-Id`` inside the stream's duplicate window; an intent without a receipt is
  reconciled by reading the stream from its claim time (:meth:`NatsBroker.find_published`:
  an ordered consumer over headers only), so an event published before a crash is found
  however long ago the window closed.
- **Fences**: JetStream has no conditional write a reconciler could set for another
  relay's batch. A relay sends a batch only within ``publish_deadline`` of its claim, and
  its connection never buffers across a reconnect (:mod:`outbox.nats_client`), so no
  message of an intent can arrive once its window has passed, except one already in the
  server's socket; the duplicate window (default 2 minutes, far above that) drops it.
  :meth:`NatsBroker.set_fences` therefore sends nothing. ``docs/how-to/brokers.md``.
- **Per-key order**: a batch is sent in ``seq`` order on one connection (the server
  stores a connection's messages to one stream in the order they came). What the server
  would refuse for one message (too large for the server or the stream, a subject it
  cannot take) is refused in :meth:`NatsBroker.prepare`, before anything of the batch is
  sent, and quarantined; a refusal the server still gives holds back that key's later
  entries the relay has not sent yet only (see the note at :meth:`NatsBroker.publish`).
- **Data loss** (a stream deleted, purged or restored from behind the receipts):
  :mod:`relay.nats.health`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from outbox.codec import EntryEncoder
from outbox.errors import ConfigError
from outbox.logs import fields
from outbox.nats_client import (
    DEFAULT_DUPLICATE_WINDOW,
    DEFAULT_STREAM_RETENTION,
    DEFAULT_TIMEOUT,
    EXPECTED_STREAM,
    MSG_ID,
    NatsClient,
    StreamSettings,
    add_stream,
    adopt_config,
    event_id_of,
    is_subject,
    jetstream_name,
    stream_config,
)
from outbox.validate import check_number
from relay.errors import PermanentPublishError, RoutingError
from relay.records import Record
from relay.routing import StreamTemplate, headers_of
from relay.seam import MarkerBehind, Prepared, TransientError

if TYPE_CHECKING:
    from relay.config import RelayConfig
    from relay.records import RelayStats
    from relay.seam import BrokerCheck
    from relay.store import Store

log = logging.getLogger("outbox.relay")
# JetStream error codes (nats-server's errors.json) that retrying may fix: storage or
# memory limits with discard new, a stream or cluster without quorum right now.
_TRANSIENT_CODES = {10023, 10047, 10077, 10074, 10008}
_NOT_FOUND = 10059  # stream not found
_encode = json.JSONEncoder(separators=(",", ":")).encode
"""``json.dumps(..., separators=(",", ":"))`` without building an encoder per message."""


class NatsBroker:
    """Publishes outbox records to NATS JetStream (see the module docstring).

    ``url``: ``nats://host:port``; ``stream_template``, ``source``, ``partitions``: as on
    Redis. ``stream_retention`` (seconds; None or 0: keep until limits) is each stream's
    ``max_age``, ``maxlen`` its ``max_msgs``; ``duplicate_window`` (seconds) its duplicate
    window; ``storage`` ``file`` (default) or ``memory``; ``replicas`` its replica count (a
    publish is acknowledged once a quorum stored it); ``max_message_bytes`` its
    ``max_msg_size`` (None: the server's ``max_payload``). These apply when the relay
    creates a stream (:func:`outbox.nats_client.stream_config`, the one definition the
    consumer uses too) and when it meets a stream a consumer created before any relay
    (:func:`outbox.nats_client.adopt_config`: all but the storage, which JetStream cannot
    change); a stream another relay created keeps its own configuration. ``timeout``:
    seconds a call may take.
    """

    def __init__(
        self,
        url: str,
        stream_template: str = "outbox.{topic}",
        maxlen: int | None = None,
        *,
        source: str = "outbox",
        partitions: int = 16,
        stream_retention: float | None = DEFAULT_STREAM_RETENTION,
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        storage: str = "file",
        replicas: int = 1,
        max_message_bytes: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        client: NatsClient | None = None,
    ) -> None:
        if maxlen is not None:
            check_number("maxlen", maxlen, ConfigError, integer=True)
        if stream_retention is not None:
            check_number("stream_retention", stream_retention, ConfigError, zero=True)
        check_number("duplicate_window", duplicate_window, ConfigError)
        check_number("replicas", replicas, ConfigError, integer=True)
        if max_message_bytes is not None:
            check_number("max_message_bytes", max_message_bytes, ConfigError, integer=True)
        if storage not in ("file", "memory"):
            raise ConfigError("storage", f"{storage!r}: use file or memory")
        if not isinstance(source, str) or not source:
            raise ConfigError("source", "must be a non-empty string")
        self.template = StreamTemplate.parse(stream_template, partitions)
        self.client = client or NatsClient(url, timeout=timeout)
        self.url = url
        self.maxlen = maxlen
        self.stream_retention = float(stream_retention or 0.0)
        self.duplicate_window = float(duplicate_window)
        self.storage = storage
        self.replicas = int(replicas)
        self.max_message_bytes = max_message_bytes
        self.settings = StreamSettings(
            storage=storage,
            replicas=self.replicas,
            duplicate_window=self.duplicate_window,
            retention=self.stream_retention,
            maxlen=maxlen,
            max_message_bytes=max_message_bytes,
        )
        self.source = source
        self._encoder = EntryEncoder(source)
        self._ready: dict[str, int] = {}  # JetStream stream -> its max_msg_size (-1: none)
        self._max_payload: int | None = None
        self.known: dict[str, int] = {}
        """JetStream stream -> the highest sequence this relay knows it holds (its own
        receipts, or the relay's latest ones at start): a stream found holding less is a
        stream that lost data, and a batch is not added to it (:class:`MarkerBehind`)."""

    # -- the seam ---------------------------------------------------------------------------

    @property
    def stream_template(self) -> str:
        return self.template.template

    def stream_for(self, record: Record) -> str:
        return self.template.render(record.topic, record.tenant, record.key_hash)

    def entry(self, record: Record) -> dict[str, str]:
        """The message's fields (the body is these as one JSON object)."""
        return self._encoder.fields(
            event_id=record.event_id,
            topic=record.topic,
            data=record.payload,
            key=record.key,
            time=record.time,
            tenant=record.tenant,
            identity=record.identity,
            headers=headers_of(record),
        )

    def prepare(self, record: Record) -> Prepared:
        """Route and encode one record; a subject NATS cannot take or a message larger than
        the server or the stream accepts is refused here (quarantined), before the batch
        is sent, so it never holds back the rest of its key in the stream."""
        stream = self.stream_for(record)
        if not is_subject(stream):
            raise RoutingError(
                f"{stream!r} is not a NATS subject (dot-separated tokens, no spaces, * or >)"
            )
        body = _encode(self.entry(record)).encode()
        name = jetstream_name(stream)
        if name not in self._ready and name not in self.known:
            # A stream met for the first time: its own limit first (an operator may have
            # made it); a refusal of the stream itself is publish's to report.
            self._ensure(name, stream)
        limit = self._limit_for(stream)
        size = len(body) + len(MSG_ID) + len(record.event_id) + 16  # the header block
        if size > limit and name in self._ready:
            # The stream's limit as read before: an operator may have raised it (or removed
            # the stream) since, then requeued what it refused. Read it again.
            del self._ready[name]
            self._ensure(name, stream)
            limit = self._limit_for(stream)
        if size > limit:
            raise PermanentPublishError(
                f"the message is {size} bytes, over the {limit} bytes NATS accepts for {stream}"
            )
        return Prepared(record, stream, body, 0)

    def publish(
        self,
        prepared: Sequence[Prepared],
        fence: str | None = None,
        *,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
    ) -> list[str | Exception]:
        """Send the batch in order on one connection and wait for every acknowledgement;
        one result per entry: the stream sequence, or why it was not added. A message
        JetStream reports as a duplicate is in the stream already: its sequence is the
        receipt. The acknowledgement comes after the stream's replicas stored it, so
        ``wait_replicas`` asks nothing more here. A lost connection or a timeout raises
        :class:`BrokerUnavailable`: any prefix may be in the streams, reconciled later.

        Per-key order: the server answers for each message on its own, after the batch
        has been sent, so an entry refused by the server does not hold back the later
        entries of its key already on the wire; :meth:`prepare` refuses what the server
        would (size, subject), which leaves the server's own limits (a stream full with
        discard-new, no quorum) to refuse one message and accept a later one."""
        del fence, wait_replicas, wait_timeout  # see the module docstring
        if not prepared:
            return []
        results: list[str | Exception | None] = [None] * len(prepared)
        to_send: list[int] = []
        for i, p in enumerate(prepared):
            name = jetstream_name(p.stream)
            refusal = self._ensure(name, p.stream)
            if refusal is not None:
                results[i] = refusal
            else:
                to_send.append(i)
        if to_send:
            acks = self.client.run(lambda js: self._send(js, [prepared[i] for i in to_send]))
            for i, ack in zip(to_send, acks, strict=True):
                results[i] = ack
        for p, result in zip(prepared, results, strict=True):
            if isinstance(result, str):
                name = jetstream_name(p.stream)
                self.known[name] = max(self.known.get(name, 0), int(result))
        return [r if r is not None else TransientError("not sent") for r in results]

    async def _send(self, js: Any, batch: Sequence[Prepared]) -> list[str | Exception]:
        replies = await self.client.publish_many(
            [
                (
                    p.stream,
                    p.fields,
                    {MSG_ID: p.record.event_id, EXPECTED_STREAM: jetstream_name(p.stream)},
                )
                for p in batch
            ]
        )
        out: list[str | Exception] = []
        for p, reply in zip(batch, replies, strict=True):
            error = reply.get("error")
            if error is not None:
                out.append(self._classify(error, p.stream))
            elif reply.get("duplicate") and not await self._holds(
                js, jetstream_name(p.stream), int(reply["seq"])
            ):
                # JetStream remembers the id, but the message it names is gone (purged):
                # a republish must store it again, under an id of its own.
                again = await self.client.publish_many(
                    [
                        (
                            p.stream,
                            p.fields,
                            {
                                MSG_ID: f"{p.record.event_id}~{time.time_ns()}",
                                EXPECTED_STREAM: jetstream_name(p.stream),
                            },
                        )
                    ]
                )
                error = again[0].get("error")
                out.append(self._classify(error, p.stream) if error else str(again[0]["seq"]))
            else:
                out.append(str(reply["seq"]))
        return out

    async def _holds(self, js: Any, name: str, seq: int) -> bool:
        try:
            await js.get_msg(name, seq)
        except self.client.nats.js.errors.NotFoundError:
            return False
        return True

    def _classify(self, error: dict[str, Any], stream: str) -> Exception:
        code = int(error.get("code") or 0)
        err_code = int(error.get("err_code") or 0)
        description = str(error.get("description") or "")
        if code == 503:
            # No stream takes the subject (deleted, or its server lost it): not created
            # again here, where it would hide the loss; the data-loss check reports it.
            self._ready.pop(jetstream_name(stream), None)
            return MarkerBehind(f"JetStream stream {jetstream_name(stream)} is missing")
        text = f"JetStream refused the message ({err_code or code}): {description}"
        if err_code in _TRANSIENT_CODES or code >= 500:
            return TransientError(text)
        return PermanentPublishError(text)

    def fence_for(self, fence: str, stream: str) -> str:
        return fence

    def set_fences(
        self,
        keys: Sequence[str],
        ttl_seconds: int = 7 * 24 * 3600,
        *,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
    ) -> None:
        """Nothing to send: JetStream has no conditional write for another relay's batch;
        the publish deadline and the duplicate window stand in (module docstring)."""

    def find_published(
        self, stream: str, event_ids: Iterable[str], start_ms: int, end_ms: int | None
    ) -> dict[str, str]:
        """Read ``stream``'s messages stored from ``start_ms`` (headers only, an ordered
        ephemeral consumer) and return event id -> sequence for ``event_ids``. Reads the
        stream itself: a message older than the duplicate window is found too."""
        wanted = set(event_ids)
        if not wanted:
            return {}
        name = jetstream_name(stream)
        return self.client.run(
            lambda js: self._scan(js, name, stream, wanted, start_ms, end_ms),
            timeout=max(self.client.timeout, 30.0),
        )

    async def _scan(
        self,
        js: Any,
        name: str,
        subject: str,
        wanted: set[str],
        start_ms: int,
        end_ms: int | None,
    ) -> dict[str, str]:
        api = self.client.nats.js.api
        errors = self.client.nats.js.errors
        try:
            info = await js.stream_info(name)
        except errors.NotFoundError:
            return {}
        if info.state.messages == 0:
            return {}
        last = info.state.last_seq
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            headers_only=True,
            filter_subject=subject,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        if start_ms > 0:
            config.deliver_policy = api.DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.fromtimestamp(start_ms / 1000.0, UTC).isoformat()
        else:
            config.deliver_policy = api.DeliverPolicy.ALL
        sub = await js.pull_subscribe(subject, stream=name, config=config)
        try:
            return await self._read_ids(sub, wanted, last, None if end_ms is None else end_ms / 1e3)
        finally:
            await sub.unsubscribe()

    async def _read_ids(
        self, sub: Any, wanted: set[str], last: int, end_s: float | None
    ) -> dict[str, str]:
        """Page through ``sub`` until ``wanted`` are all found, the stream's last sequence
        (as it was when the scan began) or ``end_s`` is reached."""
        timeouts = (
            self.client.nats.js.errors.FetchTimeoutError,
            self.client.nats.errors.TimeoutError,
        )
        found: dict[str, str] = {}
        while wanted:
            try:
                msgs = await sub.fetch(1000, timeout=1.0)
            except timeouts:
                break  # nothing (more) stored from the start time
            for msg in msgs:
                meta = msg.metadata
                if end_s is not None and meta.timestamp.timestamp() > end_s:
                    return found
                event_id = event_id_of((msg.headers or {}).get(MSG_ID))
                if event_id in wanted:
                    wanted.discard(event_id)
                    found[event_id] = str(meta.sequence.stream)
                if meta.sequence.stream >= last or meta.num_pending == 0:
                    return found
            if not msgs:
                break
        return found

    def ping(self) -> None:
        self.client.ping()

    def server_of(self, stream: str) -> int | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"broker": "nats", "duplicate_window_seconds": self.duplicate_window}

    def health_check(
        self,
        store: Store,
        config: RelayConfig,
        stats: RelayStats,
        hook: Callable[..., None],
    ) -> BrokerCheck:
        """Whether streams lost messages the receipts name (:mod:`relay.nats.health`)."""
        from relay.nats.health import NatsCheck

        return NatsCheck(store, self, config, stats, hook)

    def close(self) -> None:
        self.client.close()

    # -- streams ----------------------------------------------------------------------------

    def _limit_for(self, stream: str) -> int:
        if self._max_payload is None:
            self._max_payload = self.client.max_payload
        limit = self._max_payload
        stream_limit = self._ready.get(jetstream_name(stream), -1)
        if stream_limit > 0:
            limit = min(limit, stream_limit)
        elif self.max_message_bytes:
            limit = min(limit, self.max_message_bytes)
        return limit

    def _ensure(self, name: str, subject: str) -> Exception | None:
        """Create ``name`` (subjects: ``subject``) unless it exists; None when the batch may
        go there, else why not (a stream gone or behind the receipts: lost data)."""
        if name in self._ready:
            return None
        info = self.client.run(lambda js: self._info(js, name))
        known = self.known.get(name, 0)
        if info is None:
            if known > 0:
                return MarkerBehind(
                    f"JetStream stream {name} is missing; the receipts name sequence {known}"
                )
            try:
                info = self.client.run(lambda js: self._create(js, name, subject))
            except RoutingError as exc:
                return PermanentPublishError(str(exc))
        elif info.state.last_seq < known:
            return MarkerBehind(
                f"JetStream stream {name} ends at {info.state.last_seq}, before the "
                f"receipts' sequence {known}"
            )
        else:
            info = self.client.run(lambda js: self._adopt(js, info))
        subjects = list(info.config.subjects or [])
        if subject not in subjects:
            subjects.append(subject)
            self.client.run(lambda js: self._add_subject(js, info.config, subjects))
        self._ready[name] = int(info.config.max_msg_size or -1)
        return None

    async def _info(self, js: Any, name: str) -> Any:
        try:
            return await js.stream_info(name)
        except self.client.nats.js.errors.NotFoundError:
            return None

    async def _adopt(self, js: Any, info: Any) -> Any:
        """A stream a consumer created before any relay takes this relay's settings."""
        config = adopt_config(info.config, self.settings)
        if config is None:
            return info
        storage = str(getattr(info.config.storage, "value", info.config.storage))
        if storage != self.storage:
            log.warning(
                "a consumer created the stream with another storage; JetStream keeps it",
                extra=fields(jetstream_stream=info.config.name, storage=storage),
            )
        return await js.update_stream(config)

    async def _create(self, js: Any, name: str, subject: str) -> Any:
        config = stream_config(name, [subject], self.settings)
        try:
            info = await add_stream(js, config)  # a consumer's, if one created it meanwhile
        except self.client.nats.js.errors.BadRequestError as exc:
            raise RoutingError(f"JetStream refused the stream {name}: {exc.description}") from exc
        return await self._adopt(js, info)

    async def _add_subject(self, js: Any, config: Any, subjects: list[str]) -> None:
        config.subjects = subjects
        await js.update_stream(config)

    def recreate(self, stream: str) -> None:
        """After a reported loss: create the stream again if it is gone, and trust what it
        holds now (new batches flow; the lost ones wait for republish)."""
        name = jetstream_name(stream)
        self.known.pop(name, None)
        self._ready.pop(name, None)
        self._ensure(name, stream)
        info = self.client.run(lambda js: self._info(js, name))
        if info is not None:
            self.known[name] = int(info.state.last_seq)


__all__ = [
    "DEFAULT_DUPLICATE_WINDOW",
    "DEFAULT_STREAM_RETENTION",
    "NatsBroker",
    "is_subject",
    "jetstream_name",
]
