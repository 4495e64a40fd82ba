"""Publishing to a Redis Cluster with the single-node guarantees, slot by slot.

A Redis Cluster runs a script only on keys of one hash slot. The single-node design (one
atomic ``EVAL`` of :data:`relay.publisher.PUBLISH_LUA` per batch: the fence check, the XADDs
in ``seq`` order, the in-batch hold-back of a failing key) therefore runs once per slot:

- the batch is grouped by the slot of each entry's stream, order kept within each group;
- each group is one ``EVAL`` whose fence key lives in that slot (:func:`slot_fence`: the
  batch's fence name behind the stream's hash tag), so the fence check stays atomic with
  the XADDs it guards, and a reconciler fences exactly the slots of the streams it reads;
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
from redis.exceptions import (
    MovedError,
    RedisClusterException,
    ResponseError,
)

from outbox.redis_client import hash_tag, in_slot_of, slot_of
from relay.replies import (
    Prepared,
    ReplicasNotConfirmed,
    TransientError,
    classify_reply,
    send_fences,
    wait_command,
)

# The publisher imports this module, never the reverse (no import cycle): the functions
# below take the RedisStreamPublisher they serve as ``Any``.
RedisStreamPublisher = Any

log = logging.getLogger("outbox.relay")

MOVED_RETRIES = 3


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


def slot_fence(fence: str, stream: str) -> str:
    """The fence key of intent ``fence`` for the slot of ``stream`` (``{<stream's tag>}``
    in front of ``fence``, see :func:`outbox.redis_client.in_slot_of`): the script that
    publishes to ``stream`` checks it atomically, and a reconciler sets it per slot."""
    return in_slot_of(fence, stream)


def refresh_slots(client: Any) -> None:
    """Reload the cluster's slot map (after MOVED, a failover or a connection error)."""
    try:
        client.nodes_manager.initialize()
    except redis.RedisError:
        log.debug("slot map refresh failed; the next call tries again", exc_info=True)


def publish_by_slot(
    publisher: RedisStreamPublisher,
    prepared: Sequence[Prepared],
    fence: str,
    *,
    wait_replicas: int = 0,
    wait_timeout_ms: int = 1000,
) -> list[str | Exception]:
    """Publish ``prepared`` through the publisher's RedisCluster client: one atomic
    :meth:`~RedisStreamPublisher.script_call` per slot (fence ``fence`` in that slot),
    pipelined per master, replies read after every master has its calls (see the module
    doc). Returns one result per entry, in order, like :meth:`RedisStreamPublisher.publish`;
    raises on a connection error or timeout, and :class:`ReplicasNotConfirmed` when ``WAIT``
    falls short."""
    client = publisher.client
    by_slot: dict[int, list[int]] = {}
    for i, p in enumerate(prepared):
        by_slot.setdefault(slot_of(p.stream), []).append(i)
    results: list[str | Exception | None] = [None] * len(prepared)
    fences = {slot: slot_fence(fence, prepared[idx[0]].stream) for slot, idx in by_slot.items()}
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
        replies: dict[int, Any] = {}
        sent: list[tuple[Any, Any, list[int]]] = []
        try:
            for node, slots in by_node.values():
                pool = client.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
                sent.append((pool, conn, slots))
                parts = [
                    publisher.script_call(
                        [prepared[i] for i in by_slot[slot]],
                        fences[slot],
                        publisher.marker_for(prepared[by_slot[slot][0]].stream),
                        publisher.known_in_slot(slot),
                    )
                    for slot in slots
                ]
                if wait_replicas:
                    parts.append(wait_command(wait_replicas, wait_timeout_ms))
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
                        error = classify_reply(exc)
                        for i in members:
                            results[i] = error
                        continue
                    replies[slot] = reply
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
        # Only now (every WAIT confirmed) do the entries count as added.
        for slot, reply in replies.items():
            members = by_slot[slot]
            entries = [prepared[i] for i in members]
            slot_results = publisher.script_results(reply, entries, fences[slot])
            for i, result in zip(members, slot_results, strict=True):
                results[i] = result
            added = [(r, e.stream) for r, e in zip(slot_results, entries, strict=True)]
            publisher.saw_in_slot(
                slot,
                [r for r, _ in added if isinstance(r, str)],
                [name for r, name in added if isinstance(r, str)],
            )
        if not moved:
            break
        todo = moved
    else:
        error = TransientError("MOVED: the slot map kept changing; retrying later")
        for slot in todo:
            for i in by_slot[slot]:
                results[i] = error
    return [r if r is not None else TransientError("not sent") for r in results]


def set_fences_by_slot(
    publisher: RedisStreamPublisher,
    keys: Sequence[str],
    ttl_seconds: int,
    wait_replicas: int,
    wait_timeout: float,
) -> None:
    """:meth:`RedisStreamPublisher.set_fences` on a cluster: the fences of each master on
    one connection to it, with ``WAIT`` there. A MOVED or ASK (the slot map changed)
    refreshes the map and raises: the reconciliation runs again on the next cycle."""
    client = publisher.client
    by_node: dict[str, tuple[Any, list[str]]] = {}
    for key in keys:
        node = client.nodes_manager.get_node_from_slot(slot_of(key))
        by_node.setdefault(node.name, (node, []))[1].append(key)
    for node, node_keys in by_node.values():
        pool = client.get_redis_connection(node).connection_pool
        conn = pool.get_connection()
        try:
            send_fences(conn, node_keys, ttl_seconds, wait_replicas, wait_timeout)
        except BaseException:
            conn.disconnect()
            refresh_slots(client)
            raise
        finally:
            pool.release(conn)
