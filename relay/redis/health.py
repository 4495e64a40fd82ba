"""What the relay checks about its Redis: whether a crash would lose acknowledged entries
(persistence), and whether it already has (data loss).

A receipt marks an event published once Redis has accepted the XADD. A Redis without AOF,
one that fails over to a replica behind it, or one flushed by mistake loses those entries,
and nothing would publish them again. The relay therefore:

- reads the persistence mode at start and every ``redis_check_interval`` (``CONFIG GET
  appendonly`` and ``save``, ``INFO replication``) and warns, in the log and in the gauge
  ``outbox_relay_redis_persistence{mode}``, when it is not AOF. A Redis that refuses CONFIG
  (managed Redis) reports ``unknown`` and the relay goes on;
- keeps a marker key holding the highest entry id a batch added (the publish script sets it
  atomically with the XADDs and refuses a batch when the marker is missing or older than the
  ids the relay knows Redis holds); when the marker is behind and the latest receipt's
  stream does not hold that receipt either, Redis lost data: see :mod:`relay.redis.data_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from relay.records import entry_id_key

MODES = ("aof", "rdb", "none", "unknown")
"""The values of the ``mode`` label of ``outbox_relay_redis_persistence``."""


@dataclass(frozen=True)
class Persistence:
    """Redis's persistence as the relay sees it. ``mode``: ``aof`` (appendonly yes),
    ``rdb`` (snapshots only: a crash loses what came after the last one), ``none`` (a
    restart comes back empty) or ``unknown`` (CONFIG refused). ``role``: ``master``,
    ``slave`` or None; ``replicas``: connected replicas (a failover to one of them may lose
    the entries replication had not carried yet)."""

    mode: str
    role: str | None
    replicas: int
    detail: str

    @property
    def loses_acknowledged_entries(self) -> bool:
        return self.mode != "aof"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _config(client: Any, name: str) -> str | None:
    reply = client.config_get(name)
    if not isinstance(reply, dict):
        return None
    for key, value in reply.items():
        if _text(key) == name:
            return _text(value)
    return None


# From the weakest to the strongest: a cluster is as safe as its least safe master.
_STRENGTH = {"none": 0, "rdb": 1, "unknown": 2, "aof": 3}


def check_persistence(client: Any) -> Persistence:
    """Read the persistence mode. Connection errors propagate (the caller's outage
    handling); a refused command (managed Redis disables CONFIG) gives ``unknown``. On a
    Redis Cluster every master is asked and the weakest answer is the cluster's (a master
    without AOF loses its slots' entries however the others run)."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        reports = [
            (node.name, _check_node(client.get_redis_connection(node)))
            for node in client.get_primaries()  # type: ignore[no-untyped-call]
        ]
        if not reports:
            return Persistence("unknown", None, 0, "the cluster named no master")
        name, weakest = min(reports, key=lambda item: _STRENGTH.get(item[1].mode, 0))
        replicas = min(report.replicas for _name, report in reports)
        return Persistence(
            weakest.mode,
            weakest.role,
            replicas,
            f"{len(reports)} master(s), the weakest {name}: {weakest.detail}",
        )
    return _check_node(client)


def _check_node(client: Any) -> Persistence:
    role: str | None = None
    replicas = 0
    try:
        info = client.info("replication")
        if isinstance(info, dict):
            role = _text(info.get("role")) if info.get("role") is not None else None
            replicas = int(info.get("connected_slaves") or 0)
    except redis.ResponseError:
        pass
    try:
        appendonly = _config(client, "appendonly")
        save = _config(client, "save")
    except redis.ResponseError as exc:
        return Persistence("unknown", role, replicas, f"CONFIG GET refused ({exc})")
    if appendonly is None or save is None:
        return Persistence("unknown", role, replicas, "CONFIG GET gave no answer")
    if appendonly.strip().lower() == "yes":
        mode, detail = "aof", "appendonly yes: acknowledged entries survive a restart"
    elif save.strip():
        mode = "rdb"
        detail = (
            f"snapshots only (save {save!r}): a crash loses the entries added after the "
            "last snapshot; run Redis with appendonly yes"
        )
    else:
        mode = "none"
        detail = "no persistence: a restart comes back empty; run Redis with appendonly yes"
    if replicas:
        detail += (
            f"; {replicas} replica(s): replication is asynchronous, a failover may lose "
            "the latest entries"
        )
    return Persistence(mode, role, replicas, detail)


def stream_last_id(client: Any, stream: str) -> str | None:
    """The stream's last generated entry id, or None when the stream does not exist."""
    try:
        info = client.xinfo_stream(stream)
    except redis.ResponseError:
        return None
    value = info.get("last-generated-id") if isinstance(info, dict) else None
    return None if value is None else _text(value)


def holds_entry(client: Any, stream: str, entry_id: str) -> bool | None:
    """Whether ``stream`` still accounts for ``entry_id``: True if it holds the entry or
    removed entries on purpose (XDEL up to it, Redis 7's ``max-deleted-entry-id``; or a
    trim: this stream has added more entries than it holds); False if the entry is gone
    otherwise (the stream is missing, or was recreated after a flush or an empty restart,
    new entries above the gap and none removed since); None if it cannot tell (a Redis
    before 7 that no longer holds the entry)."""
    if client.xrange(stream, entry_id, entry_id, count=1):
        return True
    try:
        info = client.xinfo_stream(stream)
    except redis.ResponseError:
        return False  # no such stream
    if not isinstance(info, dict):
        return None
    deleted = info.get("max-deleted-entry-id")
    added = info.get("entries-added")
    if deleted is None or added is None:
        return None
    if entry_id_key(_text(deleted)) >= entry_id_key(entry_id):
        return True
    return int(added) > int(info.get("length") or 0)
