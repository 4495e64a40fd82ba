"""The Redis broker (:class:`relay.broker.Broker`): entry format, pipelined XADD, lookups.

The entry format is :mod:`outbox.codec`'s (one flat hash per event, CloudEvents attribute
names); routing is :mod:`relay.routing`'s; trimming by time is :mod:`relay.redis.trim`'s;
this module sends entries to their streams.

The hot path packs one ``EVAL`` of :data:`PUBLISH_LUA` per batch into one buffer and sends
it on one connection (one round trip per batch). On a Redis Cluster the same script runs
once per hash slot of the batch's streams, with its fence and marker keys in that slot
(:mod:`relay.redis.cluster`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from outbox.codec import EntryEncoder
from outbox.errors import ConfigError
from outbox.logs import fields as log_fields
from outbox.validate import check_number
from relay.records import Record, entry_id_key
from relay.redis.cluster import publish_by_slot, set_fences_by_slot, template_has_hash_tag
from relay.redis.replies import TRANSIENT_REPLIES as TRANSIENT_REPLIES
from relay.redis.replies import ReplicasNotConfirmed as ReplicasNotConfirmed
from relay.redis.replies import bulk
from relay.redis.replies import classify_reply as classify_reply
from relay.redis.replies import send_fences as send_fences
from relay.redis.replies import wait_command as wait_command
from relay.redis.trim import DEFAULT_STREAM_RETENTION as DEFAULT_STREAM_RETENTION
from relay.redis.trim import StreamTrim as StreamTrim
from relay.routing import StreamTemplate as StreamTemplate
from relay.routing import headers_of
from relay.seam import FencedOut as FencedOut
from relay.seam import HeldBack as HeldBack
from relay.seam import MarkerBehind as MarkerBehind
from relay.seam import Prepared as Prepared
from relay.seam import TransientError as TransientError

if TYPE_CHECKING:
    from relay.config import RelayConfig
    from relay.records import RelayStats
    from relay.seam import BrokerCheck
    from relay.store import Store

log = logging.getLogger("outbox.relay")

INFRASTRUCTURE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
)


def marker_key(stream_template: str) -> str:
    """The key that holds the highest entry id the relays of ``stream_template`` added. It
    contains the template, so a Cluster hash tag in the template puts it in that slot."""
    return f"outbox:marker:{stream_template}"


# One batch, atomically, in order. KEYS[1]: the batch's fence key; KEYS[2]: the marker key;
# KEYS[3..]: the distinct streams. ARGV: entry count, MAXLEN (0: none), the highest entry id
# the relay knows Redis holds ("0": none known), one MINID per stream ("0": no trim), then per
# entry: stream index, key group, field count, fields.
# - If the fence key exists (a reconciler has taken this intent over) the batch is refused
#   whole ("FENCED").
# - The marker holds the highest entry id any batch added. If it is missing or older than the
#   id the relay knows, Redis has lost acknowledged entries (flushed, restarted empty or from
#   an older snapshot, failed over to a replica behind it): the batch is refused whole
#   ("LOST") before a new entry can hide the gap, and the relay runs its data-loss check.
# - An entry whose key already failed in this batch is not attempted ("HELD"); an error
#   reply is "!<message>".
PUBLISH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 'FENCED'
end
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if not am or not bm then
    return true
  end
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  if am ~= bm then
    return am < bm
  end
  return as < bs
end
local marker = redis.call('GET', KEYS[2])
local expected = ARGV[3]
if expected ~= '0' and (not marker or older(marker, expected)) then
  return 'LOST'
end
local n = tonumber(ARGV[1])
local maxlen = tonumber(ARGV[2])
local nstreams = #KEYS - 2
local out = {}
local failed = {}
local last = nil
local i = 4 + nstreams
for e = 1, n do
  local k = tonumber(ARGV[i])
  local g = ARGV[i + 1]
  local nf = tonumber(ARGV[i + 2])
  i = i + 3
  if failed[g] then
    out[e] = 'HELD'
  else
    local ok
    local minid = ARGV[k + 1]
    if maxlen > 0 then
      ok = redis.pcall('XADD', KEYS[k], 'MAXLEN', '~', maxlen, '*', unpack(ARGV, i, i + nf - 1))
    elseif minid ~= '0' then
      ok = redis.pcall('XADD', KEYS[k], 'MINID', '~', minid, '*', unpack(ARGV, i, i + nf - 1))
    else
      ok = redis.pcall('XADD', KEYS[k], '*', unpack(ARGV, i, i + nf - 1))
    end
    if type(ok) == 'table' and ok.err then
      failed[g] = true
      out[e] = '!' .. ok.err
    else
      out[e] = ok
      if not last or older(last, ok) then
        last = ok
      end
    end
  end
  i = i + nf
end
if last and (not marker or older(marker, last)) then
  redis.call('SET', KEYS[2], last)
end
return out
"""
_RAISE_MARKER_LUA = """
local m = redis.call('GET', KEYS[1])
local function key(id)
  local ms, seq = string.match(id or '', '^(%d+)-(%d+)$')
  return tonumber(ms or -1), tonumber(seq or -1)
end
local mm, ms = key(m)
local am, as = key(ARGV[1])
if not m or mm < am or (mm == am and ms < as) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""
_EVAL = bulk(b"EVAL")
_SCRIPT = bulk(PUBLISH_LUA.encode())


class RedisStreamPublisher:
    """XADD outbox records to Redis Streams, one pipelined round trip per batch.

    ``stream_template`` routes each event (see the module doc); ``stream_retention``
    (seconds, default one day; None or 0: never) trims entries older than that with ``MINID
    ~``, never one a consumer group still has pending or has not read
    (:class:`relay.redis.trim.StreamTrim`); ``maxlen`` replaces it with count-based trimming
    (``MAXLEN ~ n``; it trims history that a reconciliation or a lagging group could need, so
    keep it far above a few minutes of traffic); ``source`` is the CloudEvents ``source``
    attribute; ``partitions`` is the modulus of ``{partition}``.

    Before each batch the publish script compares the marker key (:func:`marker_key`) with
    :attr:`known_last_id` and refuses the batch when Redis holds less than that
    (:class:`MarkerBehind`): a Redis that lost acknowledged entries is seen before a new
    entry could hide the gap.
    """

    def __init__(
        self,
        redis_client: Any,
        stream_template: str = "outbox.{topic}",
        maxlen: int | None = None,
        *,
        source: str = "outbox",
        partitions: int = 16,
        stream_retention: float | None = DEFAULT_STREAM_RETENTION,
        trim_floor_ttl: float = 10.0,
    ) -> None:
        if redis_client is None:
            raise ConfigError("redis_client", "a redis.Redis client is required")
        if maxlen is not None:
            check_number("maxlen", maxlen, ConfigError, integer=True)
        if not isinstance(source, str) or not source:
            raise ConfigError("source", "must be a non-empty string")
        self.client = redis_client
        self.template = StreamTemplate.parse(stream_template, partitions)
        self.maxlen = maxlen
        self.source = source
        self._encoder = EntryEncoder(source)
        self._topic_streams: dict[str, str] = {}
        self._cluster = isinstance(redis_client, RedisCluster)
        self._known_by_slot: dict[int, str] = {}  # cluster: the marker check, per slot
        self._slot_stream: dict[int, str] = {}  # cluster: a stream of each slot seen
        if self._cluster and not template_has_hash_tag(stream_template):
            log.warning(
                "the stream template has no hash tag: on Redis Cluster every stream lands "
                "in a slot of its own and a batch takes one script call per stream; "
                "write the topic (or partition) as a tag, e.g. outbox.{{{topic}}}",
                extra=log_fields(stream=stream_template),
            )
        self.trim = StreamTrim(redis_client, stream_retention, trim_floor_ttl)
        self.marker_key = marker_key(self.template.template)
        self.known_last_id: str | None = None
        self.known_last_stream: str | None = None
        """The highest entry id this publisher knows Redis holds (its own receipts, or the
        relay's latest receipts at start); None: no check before a batch."""

    @property
    def cluster(self) -> bool:
        """Whether the client is a Redis Cluster client (scripts run per hash slot)."""
        return self._cluster

    @property
    def stream_template(self) -> str:
        return self.template.template

    # -- building ---------------------------------------------------------------------------

    def stream_for(self, record: Record) -> str:
        """The stream of ``record`` (raises RoutingError)."""
        if self.template.fields == {"topic"}:
            name = self._topic_streams.get(record.topic)
            if name is None:
                name = self.template.render(record.topic, None, 0)
                if len(self._topic_streams) < 10_000:
                    self._topic_streams[record.topic] = name
            return name
        return self.template.render(record.topic, record.tenant, record.key_hash)

    def entry(self, record: Record) -> dict[str, str]:
        """The stream entry of ``record`` as a dict (for tests, tools and the cluster path)."""
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
        """Route and pack one record's fields (raises RoutingError or PermanentPublishError)."""
        stream = self.stream_for(record)
        packed, count = self._encoder.pack(
            event_id=record.event_id,
            topic=record.topic,
            key=record.key,
            time=record.time,
            data=record.payload,
            tenant=record.tenant,
            identity=record.identity,
            headers=headers_of(record),
        )
        return Prepared(record, stream, packed, count)

    # -- sending ----------------------------------------------------------------------------

    def publish(
        self,
        prepared: Sequence[Prepared],
        fence: str | None = None,
        *,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
    ) -> list[str | Exception]:
        """XADD every prepared record in one round trip; one result per record, in order.

        A result is the new entry id, or the exception the server replied for that entry
        (:class:`PermanentPublishError`, :class:`TransientError`, :class:`HeldBack` for an
        entry not attempted because an earlier entry of its key failed in this batch,
        :class:`FencedOut`, :class:`MarkerBehind`): such an entry was not added. A
        connection failure or timeout raises instead, and then any prefix of the batch may
        have been added (the caller reconciles before publishing again).

        On a single Redis server the batch is one ``EVAL`` of :data:`PUBLISH_LUA`: atomic, in
        ``seq`` order, and a failing entry holds back the later entries of its key (per-key
        order even when one key's events go to several streams and one of them fails). With
        ``fence`` (a key name) the batch is refused whole, every result :class:`FencedOut`,
        if that key exists: see :meth:`set_fences`. On a Redis Cluster the same holds per
        hash slot (:func:`relay.redis.cluster.publish_by_slot`; each slot has its own fence key,
        :meth:`fence_for`, and marker key, :meth:`marker_for`).

        ``wait_replicas``: after the script, ``WAIT wait_replicas`` (``wait_timeout``
        seconds) on the same connection; fewer confirmations raise
        :class:`ReplicasNotConfirmed` (a connection error: the caller reconciles).
        """
        if not prepared:
            return []
        timeout_ms = max(1, int(wait_timeout * 1000))
        fence_key = fence or "outbox:fence:-"
        if self._cluster:
            return publish_by_slot(
                self, prepared, fence_key, wait_replicas=wait_replicas, wait_timeout_ms=timeout_ms
            )
        parts = [self.script_call(prepared, fence_key, self.marker_key, self.known_last_id)]
        if wait_replicas:
            parts.append(wait_command(wait_replicas, timeout_ms))
        pool = self.client.connection_pool
        conn = pool.get_connection()
        refused: Exception | None = None
        try:
            conn.send_packed_command(parts, check_health=True)
            try:
                replies = conn.read_response()
            except ResponseError as exc:
                # The whole call was refused (OOM at start, BUSY, ...): nothing was added.
                refused = classify_reply(exc)
            if wait_replicas:
                acked = int(conn.read_response())
                if acked < wait_replicas:
                    raise ReplicasNotConfirmed(
                        f"WAIT {wait_replicas}: {acked} replica(s) confirmed the batch "
                        f"within {timeout_ms} ms"
                    )
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        if refused is not None:
            return [refused for _ in prepared]
        return self.script_results(replies, prepared, fence_key)

    def script_call(
        self,
        prepared: Sequence[Prepared],
        fence_key: str,
        marker_key: str,
        expected: str | None,
    ) -> bytes:
        """One ``EVAL`` of :data:`PUBLISH_LUA` for ``prepared`` (on a cluster: all in one
        slot, with ``fence_key`` and ``marker_key`` in that slot; ``expected``: the highest
        entry id known to be there), packed in the wire protocol."""
        streams: dict[str, int] = {}
        groups: dict[str, int] = {}
        body: list[bytes] = []
        for p in prepared:
            index = streams.setdefault(p.stream, len(streams) + 3)
            group = groups.setdefault(p.record.key, len(groups) + 1)
            body.append(b"$%d\r\n%d\r\n" % (len(str(index)), index))
            body.append(b"$%d\r\n%d\r\n" % (len(str(group)), group))
            body.append(b"$%d\r\n%d\r\n" % (len(str(p.nfields)), p.nfields))
            body.append(p.fields)
        minids = self.trim.minids(list(streams)) if self.maxlen is None else {}
        head = [
            b"*%d\r\n"
            % (5 + 2 * len(streams) + 3 + 3 * len(prepared) + sum(p.nfields for p in prepared)),
            _EVAL,
            _SCRIPT,
            bulk(str(len(streams) + 2).encode()),
            bulk(fence_key.encode()),
            bulk(marker_key.encode()),
        ]
        head.extend(bulk(name.encode()) for name in streams)
        head.append(bulk(str(len(prepared)).encode()))
        head.append(bulk(str(self.maxlen or 0).encode()))
        head.append(bulk((expected or "0").encode()))
        head.extend(bulk(minids.get(name, "0").encode()) for name in streams)
        return b"".join(head) + b"".join(body)

    def script_results(
        self, replies: Any, prepared: Sequence[Prepared], fence_key: str
    ) -> list[str | Exception]:
        """The per-entry results of one :meth:`script_call`'s reply; remembers the highest
        entry id added (:meth:`saw_entry`)."""
        if not isinstance(replies, list):
            refusal: Exception
            if replies in (b"LOST", "LOST"):
                refusal = MarkerBehind(
                    f"Redis holds less than this relay's receipts (the marker is missing or "
                    f"older than {self.known_last_id})"
                )
            else:
                refusal = FencedOut(f"fenced out by a reconciling relay ({fence_key})")
            return [refusal for _ in prepared]
        results: list[str | Exception] = []
        last: tuple[str, str] | None = None
        for p, reply in zip(prepared, replies, strict=True):
            text_reply = reply.decode() if isinstance(reply, bytes) else str(reply)
            if text_reply.startswith("!"):
                results.append(classify_reply(ResponseError(text_reply[1:])))
            elif text_reply == "HELD":
                results.append(HeldBack("an earlier event of this key failed in this batch"))
            else:
                results.append(text_reply)
                if last is None or entry_id_key(last[1]) < entry_id_key(text_reply):
                    last = (p.stream, text_reply)
        if last is not None:
            self.saw_entry(*last)
        return results

    def known_in_slot(self, slot: int) -> str | None:
        """Cluster: the highest entry id this publisher added in ``slot`` (the marker of
        that slot must hold at least this much; None: no check yet)."""
        return self._known_by_slot.get(slot)

    def saw_in_slot(self, slot: int, entry_ids: Sequence[str], streams: Sequence[str]) -> None:
        """Cluster: remember the highest of ``entry_ids``, just added in ``slot``, and the
        stream that holds it (``streams``: the stream of each entry id)."""
        best = self._known_by_slot.get(slot)
        for entry_id, name in zip(entry_ids, streams, strict=True):
            if best is None or entry_id_key(best) < entry_id_key(entry_id):
                best = entry_id
                self._slot_stream[slot] = name
        if best is not None:
            self._known_by_slot[slot] = best

    def marker_checks(self) -> list[tuple[str, str]]:
        """What the data-loss check compares with the markers: (highest entry id known to
        be in Redis, a stream it guards) once on one server, once per slot on a cluster (a
        master that lost its data loses only its slots' entries and marker)."""
        checks: dict[int, tuple[str, str]] = {}
        if self.known_last_id is not None and self.known_last_stream is not None:
            checks[-1] = (self.known_last_id, self.known_last_stream)
        if self._cluster:
            from outbox.redis_client import slot_of

            if self.known_last_stream is not None:
                checks.pop(-1, None)
                slot = slot_of(self.known_last_stream)
                checks[slot] = (self.known_last_id or "0-0", self.known_last_stream)
            for slot, entry_id in self._known_by_slot.items():
                stream = self._slot_stream.get(slot)
                if stream is not None:
                    old = checks.get(slot)
                    if old is None or entry_id_key(old[0]) < entry_id_key(entry_id):
                        checks[slot] = (entry_id, stream)
        return list(checks.values())

    def fence_for(self, fence: str, stream: str) -> str:
        """The key that fences intent ``fence`` for entries of ``stream``: ``fence`` itself on
        one server; on a cluster a key in ``stream``'s slot
        (:func:`outbox.redis_client.in_slot_of`), where the script that checks it runs."""
        if not self._cluster:
            return fence
        from outbox.redis_client import in_slot_of

        return in_slot_of(fence, stream)

    def marker_for(self, stream: str | None) -> str:
        """The marker key that guards ``stream``: :attr:`marker_key` on one server; on a
        cluster one per slot (in ``stream``'s slot), checked by that slot's script against
        the highest id this relay added in that slot."""
        if not self._cluster or stream is None:
            return self.marker_key
        from outbox.redis_client import in_slot_of

        return in_slot_of(self.marker_key, stream)

    def saw_entry(self, stream: str, entry_id: str) -> None:
        """Remember ``entry_id`` of ``stream`` as held by Redis: the highest one is checked
        against the marker before every batch (see :class:`MarkerBehind`)."""
        known = self.known_last_id
        if known is None or entry_id_key(known) < entry_id_key(entry_id):
            self.known_last_id = entry_id
            self.known_last_stream = stream

    # -- reconciliation ---------------------------------------------------------------------

    # complexity: the reconcile scan's cases per stream entry (owner: nats, issue 40)
    def find_published(
        self, stream: str, event_ids: Iterable[str], start_ms: int, end_ms: int | None
    ) -> dict[str, str]:
        """Which of ``event_ids`` are in ``stream`` between the two Redis-clock times
        (milliseconds; ``None``: the end of the stream); returns event id -> entry id.
        Reads the range in pages of 1,000 entries."""
        wanted = set(event_ids)
        found: dict[str, str] = {}
        start = f"{max(0, start_ms)}-0"
        end = "+" if end_ms is None else f"{max(0, end_ms)}-18446744073709551615"
        while wanted:
            try:
                page = self.client.xrange(stream, min=start, max=end, count=1000)
            except ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                return found  # not a stream: nothing of ours can be in it
            if not page:
                break
            for entry_id, fields in page:
                event_id = fields.get(b"id") if isinstance(fields, dict) else None
                if event_id is None and isinstance(fields, dict):
                    event_id = fields.get("id")
                if isinstance(event_id, bytes):
                    event_id = event_id.decode()
                if event_id in wanted:
                    wanted.discard(event_id)
                    found[event_id] = (
                        entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    )
            if len(page) < 1000:
                break
            last = page[-1][0]
            last = last.decode() if isinstance(last, bytes) else str(last)
            start = "(" + last
        return found

    def set_fences(
        self,
        keys: Sequence[str],
        ttl_seconds: int = 7 * 24 * 3600,
        *,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
    ) -> None:
        """Fence intents before reconciling them: a batch that checks one of these keys is
        refused, so after this call nothing more can be added for those intents, and what
        the stream holds for them is final.

        ``wait_replicas``: ``WAIT`` after the fences on each connection that set them.
        Replication is in order, so a confirmed fence means the replicas also hold every
        entry the stream had before it: what the reconciliation then finds there survives a
        failover (else :class:`ReplicasNotConfirmed`, and the reconciliation waits)."""
        if not keys:
            return
        if self._cluster:
            set_fences_by_slot(self, keys, ttl_seconds, wait_replicas, wait_timeout)
            return
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            send_fences(conn, keys, ttl_seconds, wait_replicas, wait_timeout)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def ping(self) -> None:
        self.client.ping()

    def server_of(self, stream: str) -> int | None:
        """Where a refusal of ``stream``'s entries came from: its slot on a cluster (one
        master may be at maxmemory while the others accept), the one server otherwise."""
        if not self._cluster:
            return None
        from outbox.redis_client import slot_of

        return slot_of(stream)

    def describe(self) -> dict[str, Any]:
        return {"broker": "redis", "redis_cluster": self._cluster}

    def health_check(
        self,
        store: Store,
        config: RelayConfig,
        stats: RelayStats,
        hook: Callable[..., None],
    ) -> BrokerCheck:
        """Redis's persistence and the data-loss markers (:mod:`relay.redis.data_loss`)."""
        from relay.redis.data_loss import RedisCheck

        return RedisCheck(store, self, config, stats, hook)

    def close(self) -> None:
        self.client.close()

    def raise_marker(self, entry_id: str, stream: str | None = None) -> None:
        """Set the marker (of ``stream``'s slot on a cluster; default: the stream of the
        latest known entry) to ``entry_id`` unless it already holds a later id."""
        key = self.marker_for(stream or self.known_last_stream)
        self.client.eval(_RAISE_MARKER_LUA, 1, key, entry_id)
        if self._cluster and (stream or self.known_last_stream):
            from outbox.redis_client import slot_of

            self._known_by_slot[slot_of(stream or self.known_last_stream or "")] = entry_id
