"""The consumer's side of Redis: its group, its heartbeat, and what one batch takes from the
streams (steps 2 to 4 of the batch in the :mod:`consumer.consumer` docstring).

:class:`StreamReader` owns everything the consumer reads from Redis and the state that
reading keeps between batches (XAUTOCLAIM cursors, which streams were found empty, the
streams grouped by slot on a cluster):

- :meth:`StreamReader.claim`: a dead peer's pending entries at once (its heartbeat key is
  gone), then entries pending longer than ``claim_idle_ms`` (XAUTOCLAIM, delivery counts
  from XPENDING);
- :meth:`StreamReader.read`: new entries (XREADGROUP ``>``), slot by slot on a cluster;
- :meth:`StreamReader.beat` and :meth:`StreamReader.heartbeat_loop`: the key that says this
  consumer is alive.

How claims keep order and why a dead peer's entries are taken at once is explained in
``docs/explanation/claims-and-order.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis as redislib
from redis.cluster import RedisCluster

from consumer.config import ConsumerConfig
from consumer.event import text_fields
from consumer.inbox import MAX_ERROR_CHARS
from outbox.duty import Duty, Interval
from outbox.logs import fields
from outbox.outage import Streak, report_failure
from outbox.redis_client import in_slot_of, slot_of

log = logging.getLogger("outbox.consumer")

CLUSTER_BLOCK_SLICE_MS = 50
"""On a Redis Cluster with streams in several slots, the longest a blocking read waits on one
slot while entries may arrive in another: the latency it can add to an entry."""


@dataclass
class Entry:
    """One stream entry as read or claimed: ``raw`` is None when it was trimmed meanwhile;
    ``deliveries`` counts this delivery."""

    stream: str
    entry_id: str
    raw: Mapping[Any, Any] | None
    deliveries: int


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StreamReader:
    """Reads and claims one consumer's entries of ``streams`` in ``group`` (see the module
    docstring). ``client`` returns the Redis client (the consumer makes it on first use);
    ``stop`` ends a cluster's sliced blocking read early."""

    def __init__(
        self,
        client: Callable[[], redislib.Redis],
        *,
        group: str,
        name: str,
        streams: Sequence[str],
        start: str,
        config: ConsumerConfig,
        stop: threading.Event,
    ) -> None:
        self._client = client
        self.group = group
        self.name = name
        self.streams = list(streams)
        self.start = start
        self.config = config
        self._stop = stop
        self.ready = False  # the groups exist (made again after a NOGROUP)
        # Liveness (outbox.duty): this consumer's heartbeat, and the look for dead peers.
        seconds = config.heartbeat_interval_ms / 1000
        self.heartbeat = Duty("consumer heartbeat", seconds, self._set_heartbeat_key)
        self.dead_peer_check = Interval(seconds)
        self._cursors: dict[str, str] = {}
        self._next_autoclaim: dict[str, float] = {}  # per stream: its last scan was empty
        self._groups: list[list[str]] | None = None  # streams per XREADGROUP (slots)
        self._block_turn = 0

    @property
    def redis(self) -> redislib.Redis:
        return self._client()

    # -- the group --------------------------------------------------------------------------

    def create_groups(self) -> None:
        for name in self.streams:
            self._create_group(name)
        self.ready = True

    def _create_group(self, stream: str) -> None:
        try:
            # MKSTREAM: a stream nobody has published to yet is created empty, so the group
            # exists from the start and the first entry published is not missed.
            self.redis.xgroup_create(stream, self.group, id=self.start, mkstream=True)
            log.info(
                "consumer group created",
                extra=fields(group=self.group, stream=stream, start=self.start),
            )
        except redislib.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def on_nogroup(self, exc: redislib.ResponseError) -> None:
        # The stream (with its group) was deleted under us: create them again next time.
        if "NOGROUP" in str(exc):
            self.ready = False
            self._cursors.clear()
            self._next_autoclaim.clear()

    # -- liveness ---------------------------------------------------------------------------

    def heartbeat_key(self, consumer: str) -> str:
        """The Redis key that says ``consumer`` of this group is alive (it expires after
        ``heartbeat_ttl_ms`` unless refreshed)."""
        return f"outbox:consumer-alive:{self.group}:{consumer}"

    def beat(self) -> None:
        """Refresh the heartbeat key now (the next beat is due an interval later)."""
        self.heartbeat.run_now()

    def _set_heartbeat_key(self) -> None:
        self.redis.set(
            self.heartbeat_key(self.name),
            str(int(time.time() * 1000)),
            px=self.config.heartbeat_ttl_ms,
        )

    def heartbeat_loop(self, done: threading.Event) -> None:
        """Inside ``Consumer.run()``: keep the key fresh whatever the batch loop is doing (a
        long batch, a database outage), so only a dead process loses it."""
        streak = Streak(log, "heartbeat")  # a line at the start, each minute, the end
        while True:
            try:
                self.beat()
                streak.succeeded()
            except Exception as exc:
                streak.failed(exc, group=self.group)
            if done.wait(self.config.heartbeat_interval_ms / 1000):
                return

    # -- claims -----------------------------------------------------------------------------

    def claim(self, room: int, *, ahead_ms: int = 0) -> list[Entry]:
        """Up to ``room`` entries claimed back: a dead peer's, then those pending longer than
        ``claim_idle_ms`` (less ``ahead_ms``: how far the caller's clock is ahead)."""
        claimed = self._claim_from_dead(room)
        taken = {(entry.stream, entry.entry_id) for entry in claimed}
        now = time.monotonic() + ahead_ms / 1000
        for name in self.streams:
            if room - len(claimed) <= 0:
                break
            if now < self._next_autoclaim.get(name, 0.0):
                continue
            claimed += self._autoclaim(name, room - len(claimed), taken, now, ahead_ms)
        return claimed

    def _autoclaim(
        self, name: str, room: int, taken: set[tuple[str, str]], now: float, ahead_ms: int
    ) -> list[Entry]:
        try:
            reply = self.redis.xautoclaim(
                name,
                self.group,
                self.name,
                min_idle_time=max(0, self.config.claim_idle_ms - ahead_ms),
                start_id=self._cursors.get(name, "0-0"),
                count=room,
            )
        except redislib.ResponseError as exc:
            self.on_nogroup(exc)
            raise
        self._cursors[name] = text(reply[0])
        entries = [(text(eid), raw) for eid, raw in reply[1]]
        if not entries and self._cursors[name] == "0-0":
            # The whole pending list was scanned and nothing was idle long enough.
            self._next_autoclaim[name] = now + self._autoclaim_pause
        entries = [(eid, raw) for eid, raw in entries if (name, eid) not in taken]
        if not entries:
            return []
        # XAUTOCLAIM does not say how often an entry was delivered; XPENDING does.
        pipe = self.redis.pipeline(transaction=False)
        for eid, _raw in entries:
            pipe.xpending_range(name, self.group, min=eid, max=eid, count=1)
        counts = pipe.execute()
        claimed = [
            Entry(name, eid, raw, int(info[0]["times_delivered"]) if info else 1)
            for (eid, raw), info in zip(entries, counts, strict=True)
        ]
        log.info(
            "claimed pending entries",
            extra=fields(group=self.group, stream=name, count=len(entries)),
        )
        return claimed

    @property
    def _autoclaim_pause(self) -> float:
        return min(self.config.claim_idle_ms / 2, 1000) / 1000

    def _claim_from_dead(self, room: int) -> list[Entry]:
        """Claim the pending entries of peers whose heartbeat key is gone, at most every
        ``heartbeat_interval_ms``.

        A peer is dead when its key is gone AND it has not touched the group (XINFO
        CONSUMERS ``idle``) for ``heartbeat_ttl_ms``: the second condition spares a peer
        that has just started. XCLAIM's ``min-idle-time`` (one heartbeat interval) makes the
        claim a compare-and-set: of two survivors claiming together, one gets each entry.
        """
        if not self.dead_peer_check.due():
            return []
        self.dead_peer_check.done()
        claimed: list[Entry] = []
        for stream in self.streams:
            if room - len(claimed) <= 0:
                break
            for name in self._dead_peers(stream):
                if room - len(claimed) <= 0:
                    break
                claimed += self._take_over(stream, name, room - len(claimed))
        return claimed

    def _dead_peers(self, stream: str) -> list[str]:
        """The peers of ``stream``'s group with entries pending, idle for a heartbeat TTL,
        whose heartbeat key is gone."""
        try:
            infos = self.redis.xinfo_consumers(stream, self.group)
        except redislib.ResponseError as exc:
            self.on_nogroup(exc)
            raise
        suspects = [
            text(info.get("name"))
            for info in infos
            if text(info.get("name")) != self.name
            and int(info.get("pending") or 0) > 0
            and int(info.get("idle") or 0) >= self.config.heartbeat_ttl_ms
        ]
        if not suspects:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for name in suspects:
            pipe.exists(self.heartbeat_key(name))
        alive = pipe.execute()
        return [name for name, present in zip(suspects, alive, strict=True) if not present]

    def _take_over(self, stream: str, dead: str, room: int) -> list[Entry]:
        pending = self.redis.xpending_range(
            stream, self.group, min="-", max="+", count=room, consumername=dead
        )
        if not pending:
            return []
        deliveries = {text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        reply: Any = self.redis.xclaim(
            stream,
            self.group,
            self.name,
            min_idle_time=self.config.heartbeat_interval_ms,
            message_ids=list(deliveries),
        )
        entries = [
            # XCLAIM counts this delivery too.
            Entry(stream, text(eid), raw, deliveries.get(text(eid), 0) + 1)
            for eid, raw in reply
        ]
        log.warning(
            "claimed a dead consumer's pending entries",
            extra=fields(group=self.group, stream=stream, dead=dead, count=len(entries)),
        )
        return entries

    # -- new entries ------------------------------------------------------------------------

    def read(self, room: int, *, block: bool) -> list[Entry]:
        """Up to ``room`` new entries; waits up to ``block_ms`` for one when ``block``."""
        groups = self.slot_groups()
        if len(groups) == 1:
            return self._read_streams(groups[0], room, self.config.block_ms if block else None)
        # A Redis Cluster reads the streams of one slot per XREADGROUP, and one blocking read
        # can wait on one slot only: an entry arriving in another slot would wait for that
        # block to end. So: every slot without blocking; when all were empty, block on one
        # slot (in turn) for at most CLUSTER_BLOCK_SLICE_MS, and again, until block_ms is
        # spent. An entry in any slot waits at most one slice (a few reads a second per slot
        # while the consumer is idle, instead of up to block_ms of added latency).
        deadline = time.monotonic() + (self.config.block_ms / 1000 if block else 0.0)
        while True:
            entries: list[Entry] = []
            for names in groups:
                if room - len(entries) <= 0:
                    break
                entries.extend(self._read_streams(names, room - len(entries), None))
            left_ms = int((deadline - time.monotonic()) * 1000)
            if entries or left_ms <= 0 or self._stop.is_set():
                return entries
            self._block_turn = (self._block_turn + 1) % len(groups)
            slice_ms = max(1, min(left_ms, CLUSTER_BLOCK_SLICE_MS))
            entries = self._read_streams(groups[self._block_turn], room, slice_ms)
            if entries:
                return entries

    def slot_groups(self) -> list[list[str]]:
        """The streams grouped so that one XREADGROUP may name each group: all of them on one
        server; per hash slot on a cluster (a command may not span slots there)."""
        if self._groups is None:
            if isinstance(self.redis, RedisCluster):
                by_slot: dict[int, list[str]] = {}
                for name in self.streams:
                    by_slot.setdefault(slot_of(name), []).append(name)
                self._groups = list(by_slot.values())
            else:
                self._groups = [list(self.streams)]
        return self._groups

    def _read_streams(self, names: list[str], room: int, block_ms: int | None) -> list[Entry]:
        try:
            reply: Any = self.redis.xreadgroup(
                self.group,
                self.name,
                {name: ">" for name in names},
                count=room,
                block=block_ms,
            )
        except redislib.ResponseError as exc:
            self.on_nogroup(exc)
            raise
        entries: list[Entry] = []
        for stream_name, items in reply or []:
            name = text(stream_name)
            entries.extend(Entry(name, text(eid), raw, 1) for eid, raw in items)
        return entries

    # -- after commit, and upkeep ----------------------------------------------------------

    def acknowledge(
        self, outcome: Any, dead_letter_stream_for: Callable[[str], str], group: str
    ) -> None:
        """XADD the dead-letter copies and XACK every settled entry, in one pipeline."""
        pipe = self.redis.pipeline(transaction=False)
        for dead in outcome.first_dead():  # not copied again after an XGROUP DESTROY
            fields_ = text_fields(dead.entry.raw)
            fields_.update(
                {
                    "dl.group": group,
                    "dl.stream": dead.entry.stream,
                    "dl.entry_id": dead.entry.entry_id,
                    "dl.reason": dead.reason,
                    "dl.error": dead.error[:MAX_ERROR_CHARS],
                    "dl.deliveries": str(dead.entry.deliveries),
                    "dl.record_id": str(
                        outcome.dead_ids.get((dead.entry.stream, dead.entry.entry_id), "")
                    ),
                }
            )
            pipe.xadd(dead_letter_stream_for(dead.entry.stream), fields_)  # type: ignore[arg-type]
        for stream_name, ids in outcome.acks.items():
            pipe.xack(stream_name, group, *ids)
        results = pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, (redislib.ConnectionError, redislib.TimeoutError)):
                raise result
            if isinstance(result, Exception):
                # A permanent refusal (say, the dead-letter key holds another type): the
                # database record is the durable one; say so loudly and go on.
                log.error(
                    "dead-letter copy or ack refused",
                    extra=fields(group=group, error=str(result)),
                )

    def dead_letter_name(self, name: str, stream: str) -> str:
        """On a Redis Cluster the dead-letter stream shares the source stream's slot."""
        if isinstance(self.redis, RedisCluster):
            return in_slot_of(name, stream)
        return name

    def lag(self, stream: str) -> tuple[int | None, int] | None:
        """(entries not delivered to the group yet, delivered and not acknowledged)."""
        for info in self.redis.xinfo_groups(stream):
            if text(info.get("name")) == self.group:
                lag = info.get("lag")
                return (int(lag) if lag is not None else None), int(info.get("pending") or 0)
        return None

    def remove_stale(self, stream: str, stale_ms: int) -> None:
        """Remove the group's consumers idle longer than ``stale_ms`` with nothing pending."""
        for info in self.redis.xinfo_consumers(stream, self.group):
            name = text(info.get("name"))
            if name == self.name or int(info.get("pending") or 0) > 0:
                continue  # a consumer with pending entries keeps them until they are claimed
            if int(info.get("idle") or 0) > stale_ms:
                self.redis.xgroup_delconsumer(stream, self.group, name)
                log.info(
                    "stale consumer removed",
                    extra=fields(group=self.group, stream=stream, consumer=name),
                )

    def forget(self) -> None:
        """At stop: remove the heartbeat key, so a peer may take this consumer's pending
        entries at once."""
        try:
            self.redis.delete(self.heartbeat_key(self.name))
        except redislib.RedisError as exc:
            report_failure(log, "heartbeat key not removed; it expires by itself", exc)


__all__ = ["CLUSTER_BLOCK_SLICE_MS", "Entry", "StreamReader"]
