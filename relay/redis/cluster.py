"""Publishing to a Redis Cluster with the single-node guarantees, slot by slot.

A Redis Cluster runs a script only on keys of one hash slot. The single-node design (one
atomic ``EVAL`` of :data:`relay.redis.publisher.PUBLISH_LUA` per batch: the fence check, the XADDs
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
``MASTERDOWN`` make that slot's entries :class:`~relay.broker.TransientError` (retried
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
from relay.redis.replies import (
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
    batch = _SlotBatch(publisher, prepared, fence, wait_replicas, wait_timeout_ms)
    todo = list(batch.by_slot)
    for attempt in range(MOVED_RETRIES + 1):
        if attempt:
            refresh_slots(batch.client)
        todo = batch.send(todo)  # the slots refused with MOVED: sent again
        if not todo:
            break
    else:
        batch.fail(todo, TransientError("MOVED: the slot map kept changing; retrying later"))
    return [r if r is not None else TransientError("not sent") for r in batch.results]


class _SlotBatch:
    """One batch of :func:`publish_by_slot`: its entries by slot, and a result per entry."""

    def __init__(
        self,
        publisher: RedisStreamPublisher,
        prepared: Sequence[Prepared],
        fence: str,
        wait_replicas: int,
        wait_timeout_ms: int,
    ) -> None:
        self.publisher = publisher
        self.client = publisher.client
        self.prepared = prepared
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.by_slot: dict[int, list[int]] = {}
        for i, p in enumerate(prepared):
            self.by_slot.setdefault(slot_of(p.stream), []).append(i)
        self.fences = {
            slot: slot_fence(fence, prepared[idx[0]].stream) for slot, idx in self.by_slot.items()
        }
        self.results: list[str | Exception | None] = [None] * len(prepared)

    def fail(self, slots: Sequence[int], error: Exception) -> None:
        for slot in slots:
            for i in self.by_slot[slot]:
                self.results[i] = error

    def send(self, slots: Sequence[int]) -> list[int]:
        """One round trip for ``slots``: every master's calls sent, then every reply read;
        the entries count as added only once every ``WAIT`` confirmed. Returns the slots
        refused with MOVED (nothing of them was added)."""
        moved: list[int] = []
        replies: dict[int, Any] = {}
        sent: list[tuple[Any, Any, list[int]]] = []
        try:
            for node, node_slots in self._by_node(slots):
                pool = self.client.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
                sent.append((pool, conn, node_slots))
                conn.send_packed_command(self._calls(node_slots), check_health=True)
            for _pool, conn, node_slots in sent:
                self._read(conn, node_slots, replies, moved)
        except BaseException:
            # Unread replies would be read as the next command's: drop these connections.
            for _pool, conn, _slots in sent:
                conn.disconnect()
            refresh_slots(self.client)
            raise
        finally:
            for pool, conn, _slots in sent:
                pool.release(conn)
        for slot, reply in replies.items():
            self._added(slot, reply)
        return moved

    def _by_node(self, slots: Sequence[int]) -> list[tuple[Any, list[int]]]:
        """The masters of ``slots`` with their slots; a slot no master covers (a failover
        under way) gets a transient error."""
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for slot in slots:
            try:
                node = self.client.nodes_manager.get_node_from_slot(slot)
            except RedisClusterException as exc:
                self.fail([slot], TransientError(f"CLUSTERDOWN slot {slot}: {exc}"))
                continue
            by_node.setdefault(node.name, (node, []))[1].append(slot)
        return list(by_node.values())

    def _calls(self, slots: Sequence[int]) -> list[bytes]:
        publisher = self.publisher
        parts = [
            publisher.script_call(
                [self.prepared[i] for i in self.by_slot[slot]],
                self.fences[slot],
                publisher.marker_for(self.prepared[self.by_slot[slot][0]].stream),
                publisher.known_in_slot(slot),
            )
            for slot in slots
        ]
        if self.wait_replicas:
            parts.append(wait_command(self.wait_replicas, self.wait_timeout_ms))
        return parts

    def _read(
        self, conn: Any, slots: Sequence[int], replies: dict[int, Any], moved: list[int]
    ) -> None:
        for slot in slots:
            try:
                replies[slot] = conn.read_response()
            except MovedError:
                moved.append(slot)  # refused whole: nothing was added
            except ResponseError as exc:
                self.fail([slot], classify_reply(exc))
        if self.wait_replicas:
            acked = int(conn.read_response())
            if acked < self.wait_replicas:
                raise ReplicasNotConfirmed(
                    f"WAIT {self.wait_replicas}: {acked} replica(s) confirmed within "
                    f"{self.wait_timeout_ms} ms on {conn.host}:{conn.port}"
                )

    def _added(self, slot: int, reply: Any) -> None:
        """A slot's script reply into its entries' results (every WAIT confirmed)."""
        members = self.by_slot[slot]
        entries = [self.prepared[i] for i in members]
        slot_results = self.publisher.script_results(reply, entries, self.fences[slot])
        for i, result in zip(members, slot_results, strict=True):
            self.results[i] = result
        added = [e.stream for r, e in zip(slot_results, entries, strict=True) if isinstance(r, str)]
        self.publisher.saw_in_slot(slot, [r for r in slot_results if isinstance(r, str)], added)


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
