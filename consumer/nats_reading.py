"""The consumer's side of NATS JetStream: a :class:`consumer.source.Source` over durable
pull consumers.

A consumer group is one **durable pull consumer per stream** (its name is the group's, its
filter the outbox stream's subject, in the JetStream stream the relay writes:
:func:`outbox.nats_client.jetstream_name`); every process of the group fetches from it, so
JetStream shares the messages among them. A message is acknowledged once its outcome is
committed (handled, a duplicate, dead-lettered); one that is not (a failed handler, a
process that died) comes again after ``claim_idle_ms`` (the consumer's ``ack_wait``), with
its delivery count, so a poison message reaches ``max_deliveries`` and the dead letters.
JetStream's own ``max_deliver`` is set above that as a backstop (it only ever stops a
message the consumer could not even fetch). The dead-letter copy is published to the
dead-letter subject (``{stream}.dead-letter``), in a JetStream stream of its own.

Nothing here needs a heartbeat: JetStream redelivers what a dead process held once its
``ack_wait`` passes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from consumer.config import ConsumerConfig
from consumer.event import text_fields
from consumer.reading import Entry
from outbox.duty import Duty
from outbox.logs import fields
from outbox.nats_client import (
    NatsClient,
    add_stream,
    dead_letter_stream_config,
    jetstream_name,
    stream_config,
)

log = logging.getLogger("outbox.consumer")

_MAX_DELIVER_SLACK = 3
"""JetStream's ``max_deliver`` is ``max_deliveries`` plus this: our dead letters come first."""


def durable_name(group: str) -> str:
    """The durable consumer of ``group`` (the characters a name cannot hold made ``_``)."""
    return jetstream_name(group)


class NatsReader:
    """Reads one consumer's messages of ``streams`` in ``group`` (see the module
    docstring). ``start``: ``"0"`` (a new group reads what the stream holds) or ``"$"``
    (only new messages)."""

    def __init__(
        self,
        url: str,
        *,
        group: str,
        name: str,
        streams: Sequence[str],
        start: str,
        config: ConsumerConfig,
        stop: threading.Event,
    ) -> None:
        self.client = NatsClient(url, name=name)
        self.group = group
        self.name = name
        self.streams = list(streams)
        self.start = start
        self.config = config
        self._stop = stop
        self.ready = False
        self.heartbeat = Duty("consumer heartbeat", 3600.0, lambda: None)
        self._subs: dict[str, Any] = {}
        self._bound = 0  # the client's connection the subscriptions are bound to
        self._held: dict[tuple[str, str], Any] = {}  # (stream, entry id) -> the message
        self._dl_ready: set[str] = set()
        self._turn = 0

    # -- the group --------------------------------------------------------------------------

    def create_groups(self) -> None:
        self.client.run(self._create_all, timeout=max(self.client.timeout, 30.0))
        self.ready = True

    async def _create_all(self, js: Any) -> None:
        for stream in self.streams:
            await self._create(js, stream)
        self._bound = self.client.connections

    async def _bind(self, js: Any) -> None:
        """The subscriptions again, on the connection made after one was lost: those of the
        lost one fetch nothing ever again (the consumer took no message after a NATS
        restart, issue 53). The streams and the group are made again if the server came
        back without them."""
        await self._create_all(js)
        log.warning(
            "NATS connection back; the group's subscriptions renewed",
            extra=fields(group=self.group, streams=len(self.streams)),
        )

    async def _create(self, js: Any, stream: str) -> None:
        nats = self.client.nats
        api = nats.js.api
        name = jetstream_name(stream)
        try:
            await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            # Nobody has published yet: the stream the relay would create (its one
            # definition, marked provisional so that the first relay sets its own limits),
            # so the group exists from the start and the first message is not missed.
            # A relay that created it meanwhile wins: its stream is read as it is.
            await add_stream(js, stream_config(name, [stream], provisional=True))
        durable = durable_name(self.group)
        config = api.ConsumerConfig(
            durable_name=durable,
            filter_subject=stream,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=max(self.config.claim_idle_ms, 50) / 1000,
            max_deliver=self.config.max_deliveries + _MAX_DELIVER_SLACK,
            deliver_policy=api.DeliverPolicy.ALL if self.start == "0" else api.DeliverPolicy.NEW,
            max_ack_pending=-1,
        )
        try:
            await js.consumer_info(name, durable)
        except nats.js.errors.NotFoundError:
            await js.add_consumer(name, config)
            log.info(
                "consumer group created",
                extra=fields(group=self.group, stream=stream, jetstream_stream=name),
            )
        self._subs[stream] = await js.pull_subscribe_bind(durable, stream=name)

    # -- liveness: nothing to keep (JetStream redelivers after ack_wait) -----------------------

    def heartbeat_key(self, consumer: str) -> str:
        return f"{self.group}:{consumer}"

    def heartbeat_loop(self, done: threading.Event) -> None:
        done.wait()

    def forget(self) -> None:
        self.client.close()

    # -- reading ----------------------------------------------------------------------------

    def claim(self, room: int, *, ahead_ms: int = 0) -> list[Entry]:
        """Nothing to claim: JetStream redelivers a message not acknowledged within
        ``claim_idle_ms``; :meth:`read` gets it with its delivery count."""
        return []

    def read(self, room: int, *, block: bool) -> list[Entry]:
        """Up to ``room`` messages, the streams in turn; waits up to ``block_ms`` for one when
        ``block`` (spread over the streams)."""
        wait = self.config.block_ms / 1000 if block else 0.05
        return self.client.run(
            lambda js: self._fetch(js, room, max(0.05, wait / max(1, len(self.streams)))),
            timeout=wait + self.client.timeout,
        )

    async def _fetch(self, js: Any, room: int, wait: float) -> list[Entry]:
        if self._bound != self.client.connections:
            await self._bind(js)
        errors = self.client.nats.errors
        js_errors = self.client.nats.js.errors
        entries: list[Entry] = []
        order = self.streams[self._turn :] + self.streams[: self._turn]
        self._turn = (self._turn + 1) % max(1, len(self.streams))
        for stream in order:
            if len(entries) >= room:
                break
            try:
                msgs = await self._subs[stream].fetch(room - len(entries), timeout=wait)
            except (js_errors.FetchTimeoutError, errors.TimeoutError, TimeoutError):
                continue  # nothing new in this stream within the wait
            for msg in msgs:
                entry_id = str(msg.metadata.sequence.stream)
                try:
                    raw: dict[str, str] | None = json.loads(msg.data)
                except ValueError:
                    raw = {"data": msg.data.decode(errors="replace")}
                self._held[(stream, entry_id)] = msg
                entries.append(Entry(stream, entry_id, raw, int(msg.metadata.num_delivered)))
        return entries

    # -- after commit -----------------------------------------------------------------------

    def acknowledge(
        self, outcome: Any, dead_letter_stream_for: Callable[[str], str], group: str
    ) -> None:
        """Publish the dead-letter copies, then acknowledge every settled message."""
        self.client.run(lambda js: self._settle(js, outcome, dead_letter_stream_for, group))

    async def _settle(
        self,
        js: Any,
        outcome: Any,
        dead_letter_stream_for: Callable[[str], str],
        group: str,
    ) -> None:
        nats_errors = self.client.nats.js.errors
        for dead in outcome.first_dead():  # not copied again when met again
            copy = text_fields(dead.entry.raw)
            copy.update(
                {
                    "dl.group": group,
                    "dl.stream": dead.entry.stream,
                    "dl.entry_id": dead.entry.entry_id,
                    "dl.reason": dead.reason,
                    "dl.error": dead.error[:2000],
                    "dl.deliveries": str(dead.entry.deliveries),
                    "dl.record_id": str(
                        outcome.dead_ids.get((dead.entry.stream, dead.entry.entry_id), "")
                    ),
                }
            )
            subject = dead_letter_stream_for(dead.entry.stream)
            await self._dead_letter_stream(js, subject, dead.entry.stream)
            try:
                await js.publish(subject, json.dumps(copy).encode(), stream=jetstream_name(subject))
            except nats_errors.APIError as exc:
                if not exc.err_code:
                    raise  # no JetStream answered: the batch is acknowledged again later
                # JetStream refused it (the dead-letter stream full with discard=new, a 503
                # that stays until an operator acts): the database record is the durable
                # one; say so loudly and go on, as on Redis.
                log.error(
                    "dead-letter copy refused",
                    extra=fields(group=group, stream=subject, error=str(exc)),
                )
        for stream, ids in outcome.acks.items():
            for entry_id in ids:
                msg = self._held.pop((stream, entry_id), None)
                if msg is not None:
                    await self.client.ack(msg)  # on the current connection

    async def _dead_letter_stream(self, js: Any, subject: str, stream: str) -> None:
        """Create the dead-letter stream of ``subject`` unless it exists: its own definition
        (:func:`outbox.nats_client.dead_letter_stream_config`), as replicated as ``stream``."""
        if subject in self._dl_ready:
            return
        nats = self.client.nats
        name = jetstream_name(subject)
        try:
            await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            try:
                source = await js.stream_info(jetstream_name(stream))
                replicas = source.config.num_replicas or 1
            except nats.js.errors.NotFoundError:
                replicas = 1  # the stream was deleted since this batch was read
            await add_stream(js, dead_letter_stream_config(name, [subject], replicas=replicas))
        self._dl_ready.add(subject)

    def dead_letter_name(self, name: str, stream: str) -> str:
        return name

    def remove_stale(self, stream: str, stale_ms: int) -> None:
        """Nothing to remove: JetStream keeps no per-process consumer for a pull group."""

    def lag(self, stream: str) -> tuple[int | None, int] | None:
        """(messages not delivered yet, delivered and not acknowledged) of this group."""

        async def info(js: Any) -> Any:
            return await js.consumer_info(jetstream_name(stream), durable_name(self.group))

        found = self.client.run(info)
        return int(found.num_pending), int(found.num_ack_pending)


__all__ = ["NatsReader", "durable_name"]
