"""Publishing to a Redis Cluster with the single-node guarantees, slot by slot.

A Redis Cluster runs a script only on keys of one hash slot. The single-node design (one
atomic ``EVAL`` of :data:`relay.publisher.PUBLISH_LUA` per batch: the fence check, the XADDs
in ``seq`` order, the in-batch hold-back of a failing key) therefore runs once per slot:

- the batch is grouped by the slot of each entry's stream, order kept within each group;
- each group is one ``EVAL`` whose fence key lives in that slot (:func:`slot_fence`: the
  batch's fence name plus the stream's hash tag), so the fence check stays atomic with the
  XADDs it guards, and a reconciler fences exactly the slots of the streams it reads;
- the calls for the slots of one master are pipelined on one connection to that master,
  every master's calls are sent before any reply is read (one round trip per batch, as on
  one node), and with ``wait_replicas`` a ``WAIT n timeout`` follows on each of those
  connections before the replies count as published.

Per-key order is per stream, and a stream lives in one slot, so nothing is needed across
slots; the in-batch hold-back applies among the entries of one slot (one key's events that
go to streams in different slots are ordered per stream, as always).

Redirections are transient and safe to retry, because a refused script added nothing:
``MOVED`` (the slot map changed: resharding finished, a replica was promoted) refreshes the
slot map and resends that slot's call at once, up to :data:`MOVED_RETRIES` times; ``ASK`` and
``TRYAGAIN`` (the slot is being migrated: the fence key never exists, so the script cannot
run on either side until the migration of that slot ends), ``CLUSTERDOWN`` and
``MASTERDOWN`` make that slot's entries :class:`~relay.publisher.TransientError` (retried
with the per-record backoff). A connection error or timeout on any master raises, as on one
node: any prefix of any slot's share may be in its stream, and the relay's intent/receipt
protocol reconciles before publishing again; the slot map is refreshed before the next
batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from relay.publisher import (
    _EVAL,
    _SCRIPT,
    FencedOut,
    HeldBack,
    Prepared,
    TransientError,
    _bulk,
    classify_reply,
)

log = logging.getLogger("outbox.relay")

MOVED_RETRIES = 3
SLOTS = 16384

# Whole-call refusals that mean "not now" on a cluster (redis-py strips the reply's code
# from the message and says it with the exception class instead).
TRANSIENT_CLASSES: tuple[type[Exception], ...] = (
    AskError,  # MovedError is a subclass; handled before this is consulted
    TryAgainError,
    ClusterDownError,
    MasterDownError,
    BusyLoadingError,
    ReadOnlyError,
)


class ReplicasNotConfirmed(redis.exceptions.ConnectionError):
    """``WAIT`` returned fewer replicas than asked within its timeout: the batch may be in
    the stream on the master only, and a failover now could lose it. Raised like a
    connection error, so the batch's intents are kept and reconciled, never assumed."""


def hash_tag(name: str) -> str | None:
    """The hash tag of a key (the text between the first ``{`` and the next ``}``, when
    non-empty), which alone decides its slot; None when the whole name does."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:
        return None
    return name[start + 1 : end]


def template_has_hash_tag(template: str) -> bool:
    """Whether a stream template (``str.format`` syntax, ``{{``/``}}`` literal braces) gives
    its streams a hash tag that contains a placeholder, so the streams of a topic (or of a
    partition) share one slot and a batch needs few script calls."""
    samples = {"topic": "\x01t", "tenant": "\x01n", "partition": "\x017"}
    try:
        rendered = template.format(**samples)
    except (KeyError, IndexError, ValueError):
        return False
    tag = hash_tag(rendered)
    return tag is not None and "\x01" in tag


_slot_tags: dict[int, str] = {}


def _tag_for_slot(slot: int) -> str:
    """A short text whose slot is ``slot`` (found once by counting; ~16k CRCs at most)."""
    tag = _slot_tags.get(slot)
    if tag is not None:
        return tag
    i = 0
    while True:
        candidate = f"s{i:x}"
        found = key_slot(candidate.encode())
        _slot_tags.setdefault(found, candidate)
        if found == slot:
            return candidate
        i += 1


def slot_fence(fence: str, stream: str) -> str:
    """The fence key of intent ``fence`` for the slot of ``stream``: ``fence`` plus the
    stream's hash tag (the whole stream name when it has none), so it lives in the stream's
    slot. A stream name whose braces would make that tag differ (``a}b``) gets a tag
    computed for its slot instead."""
    slot = key_slot(stream.encode())
    tag = hash_tag(stream)
    candidate = f"{fence}:{{{tag if tag is not None else stream}}}"
    if key_slot(candidate.encode()) == slot:
        return candidate
    return f"{fence}:{{{_tag_for_slot(slot)}}}"


def refresh_slots(client: Any) -> None:
    """Reload the cluster's slot map (after MOVED, a failover or a connection error)."""
    try:
        client.nodes_manager.initialize()
    except redis.RedisError:
        log.debug("slot map refresh failed; the next call tries again", exc_info=True)


def script_call(prepared: Sequence[Prepared], fence_key: str, maxlen: int | None) -> bytes:
    """One ``EVAL`` of :data:`~relay.publisher.PUBLISH_LUA` for ``prepared`` (all in one slot
    on a cluster), packed as the wire protocol (KEYS: the fence, then the distinct streams;
    ARGV: count, MAXLEN, then per entry its stream index, key group, field count, fields)."""
    streams: dict[str, int] = {}
    groups: dict[str, int] = {}
    body: list[bytes] = []
    for p in prepared:
        index = streams.setdefault(p.stream, len(streams) + 2)
        group = groups.setdefault(p.record.key, len(groups) + 1)
        body.append(_bulk(b"%d" % index))
        body.append(_bulk(b"%d" % group))
        body.append(_bulk(b"%d" % p.nfields))
        body.append(p.fields)
    head = [
        b"*%d\r\n" % (4 + len(streams) + 2 + 3 * len(prepared) + sum(p.nfields for p in prepared)),
        _EVAL,
        _SCRIPT,
        _bulk(b"%d" % (len(streams) + 1)),
        _bulk(fence_key.encode()),
    ]
    head.extend(_bulk(name.encode()) for name in streams)
    head.append(_bulk(b"%d" % len(prepared)))
    head.append(_bulk(b"%d" % (maxlen or 0)))
    return b"".join(head) + b"".join(body)


def script_results(reply: Any, count: int, fence_key: str) -> list[str | Exception]:
    """The per-entry results of one :func:`script_call`'s reply."""
    if not isinstance(reply, list):
        fenced = FencedOut(f"fenced out by a reconciling relay ({fence_key})")
        return [fenced] * count
    results: list[str | Exception] = []
    for item in reply:
        text = item.decode() if isinstance(item, bytes) else str(item)
        if text.startswith("!"):
            results.append(classify_reply(ResponseError(text[1:])))
        elif text == "HELD":
            results.append(HeldBack("an earlier event of this key failed in this batch"))
        else:
            results.append(text)
    return results


def classify_call_error(exc: ResponseError) -> Exception:
    """A whole script call refused on a cluster node: transient or permanent."""
    if isinstance(exc, TRANSIENT_CLASSES):
        code = getattr(exc, "status_code", None) or type(exc).__name__
        return TransientError(f"{code} {exc}")
    return classify_reply(exc)


def publish_by_slot(
    client: Any,
    prepared: Sequence[Prepared],
    fence: str | None,
    maxlen: int | None,
    *,
    wait_replicas: int = 0,
    wait_timeout_ms: int = 1000,
) -> list[str | Exception]:
    """Publish ``prepared`` through the RedisCluster ``client``: one atomic script call per
    slot, pipelined per master, replies read after every master has its calls (see the
    module doc). Returns one result per entry, in order, like
    :meth:`RedisStreamPublisher.publish`; raises on a connection error or timeout, and
    :class:`ReplicasNotConfirmed` when ``WAIT`` falls short."""
    base = fence or "outbox:fence:-"
    by_slot: dict[int, list[int]] = {}
    for i, p in enumerate(prepared):
        by_slot.setdefault(key_slot(p.stream.encode()), []).append(i)
    results: list[str | Exception | None] = [None] * len(prepared)
    fences = {slot: slot_fence(base, prepared[idx[0]].stream) for slot, idx in by_slot.items()}
    todo = list(by_slot)
    for attempt in range(MOVED_RETRIES + 1):
        if attempt:
            refresh_slots(client)
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for slot in todo:
            try:
                node = client.nodes_manager.get_node_from_slot(slot)
            except RedisClusterException as exc:  # slot not covered: a failover under way
                error: Exception = TransientError(f"CLUSTERDOWN slot {slot}: {exc}")
                for i in by_slot[slot]:
                    results[i] = error
                continue
            by_node.setdefault(node.name, (node, []))[1].append(slot)
        moved: list[int] = []
        sent: list[tuple[Any, Any, list[int]]] = []
        try:
            for node, slots in by_node.values():
                pool = client.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
                sent.append((pool, conn, slots))
                parts = [
                    script_call([prepared[i] for i in by_slot[slot]], fences[slot], maxlen)
                    for slot in slots
                ]
                if wait_replicas:
                    parts.append(_wait_command(wait_replicas, wait_timeout_ms))
                conn.send_packed_command(parts, check_health=True)
            for _pool, conn, slots in sent:
                for slot in slots:
                    members = by_slot[slot]
                    try:
                        reply = conn.read_response()
                    except MovedError:
                        moved.append(slot)  # refused whole: nothing was added
                        continue
                    except ResponseError as exc:
                        error = classify_call_error(exc)
                        for i in members:
                            results[i] = error
                        continue
                    for i, result in zip(
                        members, script_results(reply, len(members), fences[slot]), strict=True
                    ):
                        results[i] = result
                if wait_replicas:
                    acked = int(conn.read_response())
                    if acked < wait_replicas:
                        raise ReplicasNotConfirmed(
                            f"WAIT {wait_replicas}: {acked} replica(s) confirmed within "
                            f"{wait_timeout_ms} ms on {conn.host}:{conn.port}"
                        )
        except BaseException:
            # Unread replies would be read as the next command's: drop these connections.
            for _pool, conn, _slots in sent:
                conn.disconnect()
            refresh_slots(client)
            raise
        finally:
            for pool, conn, _slots in sent:
                pool.release(conn)
        if not moved:
            break
        todo = moved
    else:
        error = TransientError("MOVED: the slot map kept changing; retrying later")
        for slot in todo:
            for i in by_slot[slot]:
                results[i] = error
    return [r if r is not None else TransientError("not sent") for r in results]


def _wait_command(replicas: int, timeout_ms: int) -> bytes:
    return b"*3\r\n" + _bulk(b"WAIT") + _bulk(b"%d" % replicas) + _bulk(b"%d" % timeout_ms)
