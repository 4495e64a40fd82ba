"""Reconciliation: resolve the intents that have no receipt once their publish window has
passed (step 2 of the cycle in :mod:`relay.relay`).

An intent is written with the claim; a relay that died, or lost its connection, between
the claim and the receipt leaves it behind. Whoever owns the partition then fences the
intent (no batch of it can still be added: the publish script checks its fence), reads the
window of its streams, records receipts for the events found there and clears the intent of
the others, which are published again. Why this is exactly-once in the stream:
``docs/explanation/reconciliation.md`` and ``docs/explanation/fencing.md``.
"""

from __future__ import annotations

from relay.config import RelayConfig
from relay.errors import RoutingError
from relay.records import Orphan, Record
from relay.seam import Broker
from relay.store import Store

Found = tuple[Orphan, str, str]
"""An orphan found in its stream: the orphan, the stream, the entry id."""


def fence_key(owner: str, epoch: int) -> str:
    """The name of the fence of the intent ``(owner, epoch)`` (see ``Broker.set_fences``)."""
    return f"outbox:fence:{owner}:{epoch}"


def reconcile_orphans(
    store: Store, publisher: Broker, config: RelayConfig
) -> tuple[list[Found], list[Orphan]] | None:
    """Resolve up to ``batch_size`` intents without receipts whose window has passed: the
    events found in their streams (receipts recorded) and those missing (intents cleared,
    published again). None when there was none."""
    orphans = store.orphan_list(config.batch_size)
    if not orphans:
        return None
    groups, missing = _by_stream(publisher, orphans)
    # Fence first: once the fences are set no batch of these intents can still be added
    # (the publish script checks its fence atomically), so what the stream holds is final.
    # On a cluster each stream's slot has its own fence key for an intent. With
    # wait_replicas the fences are confirmed by the replicas, and with them every entry
    # before them: what is found below survives a failover.
    publisher.set_fences(
        sorted(
            {
                publisher.fence_for(fence_key(o.claimed_by, o.claim_epoch), stream)
                for stream, members in groups.items()
                for o in members
            }
        ),
        wait_replicas=config.wait_replicas,
        wait_timeout=config.wait_timeout,
    )
    found: list[Found] = []
    for stream, members in groups.items():
        hits = _find(publisher, stream, members, config.clock_margin)
        for orphan in members:
            entry_id = hits.get(orphan.event_id)
            if entry_id is None:
                missing.append(orphan)
            else:
                found.append((orphan, stream, entry_id))
    store.orphan_resolve(found, missing)
    return found, missing


def _by_stream(
    publisher: Broker, orphans: list[Orphan]
) -> tuple[dict[str, list[Orphan]], list[Orphan]]:
    """The orphans by the stream they were routed to, and those never routable (so never
    published)."""
    groups: dict[str, list[Orphan]] = {}
    missing: list[Orphan] = []
    for orphan in orphans:
        record = Record(
            orphan.seq,
            orphan.event_id,
            orphan.topic,
            orphan.key,
            orphan.key_hash,
            orphan.tenant,
            "",
            "",
            None,
            "",
            0.0,
            0,
        )
        try:
            stream = publisher.stream_for(record)
        except RoutingError:
            missing.append(orphan)
            continue
        groups.setdefault(stream, []).append(orphan)
    return groups, missing


def _find(publisher: Broker, stream: str, members: list[Orphan], margin: float) -> dict[str, str]:
    """Entry ids of ``members``' events found in ``stream``, by event id."""
    # An entry of an intent was added after its claim committed: search from the earliest
    # claim (less the clock margin) to the end of the stream.
    start = min(o.claimed_epoch_s for o in members) - margin
    return publisher.find_published(stream, [o.event_id for o in members], int(start * 1000), None)


__all__ = ["fence_key", "reconcile_orphans"]
