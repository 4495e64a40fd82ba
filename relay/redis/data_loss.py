"""The relay's check of its Redis: persistence, and whether Redis lost entries the relay had
published (run at start, every ``redis_check_interval`` and after a batch refused for a
marker behind; :meth:`relay.relay.Relay.check_redis`).

What is checked and why a marker key guards the streams is in :mod:`relay.redis.health`;
here is what the relay does with it: report the persistence (log, hook), compare each
marker with the latest receipt, and on a loss log the republish command, re-arm the marker
so new events flow again and, with ``auto_republish``, publish the lost window again.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

from outbox.logs import fields
from relay.config import RelayConfig
from relay.records import RelayStats, entry_id_key
from relay.redis.health import Persistence, check_persistence, holds_entry, stream_last_id
from relay.republish import republish, since_argument
from relay.store import Store

log = logging.getLogger("outbox.relay")

_ENTRY_ID = re.compile(r"[0-9]+-[0-9]+")


def is_entry_id(receipt: str) -> bool:
    """Whether a receipt is a Redis stream entry id (``ms-seq``), not another broker's."""
    return _ENTRY_ID.fullmatch(receipt) is not None


class RedisCheck:
    """Checks one relay's Redis (see the module docstring); ``persistence`` is what the last
    check found. ``hook(name, *args)`` calls the relay's hooks."""

    def __init__(
        self,
        store: Store,
        publisher: Any,  # the RedisStreamPublisher that builds this check
        config: RelayConfig,
        stats: RelayStats,
        hook: Callable[..., None],
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.config = config
        self.stats = stats
        self.hook = hook
        self.persistence: Persistence | None = None
        # Per stream (one per slot on a cluster): the receipt whose loss was reported and
        # above which the marker was re-armed. While the marker still holds it, Redis lost
        # nothing since: the same loss is not reported again at every check of an idle
        # relay (its latest receipt stays the lost entry until it publishes again).
        self._reported: dict[str, str] = {}

    def check(self) -> bool:
        """Report the persistence, then look for lost entries; True if any were lost."""
        self._report_persistence(check_persistence(self.publisher.client))
        # Only Redis's own receipts: a table moved here from NATS holds JetStream sequences
        # ("57"), which no Redis stream ever held. Read as entry ids they were "lost" at
        # once, and the marker re-armed to "57", which the publish script cannot compare,
        # refused every batch after (issue 53).
        receipts = [r for r in self.store.receipt_latest() if is_entry_id(r[1])]
        if self.publisher.known_last_id is None and receipts:
            self.publisher.saw_entry(*max(receipts, key=lambda r: entry_id_key(r[1])))
        if self.publisher.cluster:
            # Every slot's recent receipts, whichever relay wrote them: a slot this relay has
            # not published to yet is checked too, and its first batch there is refused
            # (not written above a gap) if that slot's master came back empty meanwhile.
            from outbox.redis_client import slot_of

            for stream, entry_id in receipts:
                self.publisher.saw_in_slot(slot_of(stream), [entry_id], [stream])
        lost = False
        for known, stream in self.publisher.marker_checks():
            lost = self._check_stream(known, stream) or lost
        return lost

    def _report_persistence(self, report: Persistence) -> None:
        if report.mode == "unknown":
            log.warning(
                "cannot read Redis's persistence; assuming nothing about it",
                extra=fields(mode=report.mode, detail=report.detail),
            )
        elif report.loses_acknowledged_entries:
            log.warning(
                "Redis runs without AOF: a crash loses entries the relay has acknowledged",
                extra=fields(mode=report.mode, role=report.role, detail=report.detail),
            )
        elif self.persistence is None or self.persistence.mode != report.mode:
            log.info("Redis persistence", extra=fields(mode=report.mode, detail=report.detail))
        self.persistence = report
        self.hook("relay_redis_persistence", report.mode)

    def _check_stream(self, known: str, stream: str) -> bool:
        """Whether Redis lost entries of ``stream`` up to the receipt ``known`` (one marker
        on a server, one per slot on a cluster); a loss is reported and handled."""
        client = self.publisher.client
        raw = client.get(self.publisher.marker_for(stream))
        marker = raw.decode() if isinstance(raw, bytes) else raw
        marker_ok = marker is not None and entry_id_key(marker) >= entry_id_key(known)
        if marker_ok and self._reported.get(stream) == known:
            return False  # reported already; the re-armed marker says nothing was lost since
        intact = stream_last_id(client, stream)
        stream_ok = intact is not None and entry_id_key(intact) >= entry_id_key(known)
        # A marker or a stream at or past our receipt is not enough: after an empty restart
        # a relay that knew nothing of this slot may have written first and re-armed both,
        # above the gap. The receipt's entry itself must still be there (or deleted on
        # purpose: trimmed).
        if (marker_ok or stream_ok) and holds_entry(client, stream, known) is not False:
            if not marker_ok:
                # Only the marker is missing or behind (deleted, or first written by this
                # version). Nothing was lost.
                self.publisher.raise_marker(known, stream)
            return False
        self._lost(known, stream, marker, intact)
        return True

    def _lost(self, known: str, stream: str, marker: str | None, intact: str | None) -> None:
        """Redis holds less than the receipts: it lost acknowledged entries. Everything
        published after the last id it still has may be gone."""
        after = self._published_after(known, stream, marker, intact)
        since = self.store.outbox_oldest_published_since(after)
        command = (
            f"outbox-relay republish --since {since_argument(since)}"
            if since is not None
            else "none: no retained published event is in the lost window"
        )
        log.error(
            "Redis lost stream entries the relay had published (flushed, restarted without "
            "AOF, or failed over to a replica behind it); run the republish command",
            extra=fields(
                marker=marker,
                stream=stream,
                stream_last_id=intact,
                latest_receipt=known,
                republish=command,
                auto_republish=self.config.auto_republish,
            ),
        )
        self.stats.data_loss_detected += 1
        self.hook("relay_redis_data_loss", time.time())
        # Re-arm the marker so new events flow again (the lost ones wait for republish).
        self.publisher.raise_marker(known, stream)
        self._reported[stream] = known
        if self.config.auto_republish and since is not None:
            result = republish(
                self.store, self.publisher, since=since, batch_size=self.config.batch_size
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

    def _published_after(
        self, known: str, stream: str, marker: str | None, intact: str | None
    ) -> float | None:
        """Unix seconds after which published events may be lost: from the last entry Redis
        still holds from before the loss (marker and stream head if they are behind our
        receipt, else, re-armed above the gap, the stream's last entry below it), less the
        clock margin and the publish deadline. None: nothing survived; every retained event
        is republished."""
        good = [
            i for i in (marker, intact) if i is not None and entry_id_key(i) < entry_id_key(known)
        ]
        below = self.publisher.client.xrevrange(stream, max=f"({known}", min="-", count=1)
        if below:
            raw_id = below[0][0]
            good.append(raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id))
        if not good:
            return None
        last_good = max(good, key=entry_id_key)
        return (
            entry_id_key(last_good)[0] / 1000.0
            - self.config.clock_margin
            - self.config.publish_deadline
        )


__all__ = ["RedisCheck"]
