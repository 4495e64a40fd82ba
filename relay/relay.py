"""The relay loop: claim, publish, record; reconcile orphaned intents; retention.

One cycle (:meth:`Relay.run_once`):

1. Keep a fair share of partitions (PostgreSQL; SQLite: the single relay lock).
2. Reconcile intents without receipts whose publish window has passed: read that window of
   their streams, record receipts for the events found there, clear the intent of the rest.
   At start, every ``redis_check_interval`` and after a batch refused for a marker behind:
   check Redis's persistence and whether it lost entries (:meth:`Relay.check_redis`).
3. Claim a batch (one statement that also writes the intent), build the entries, and XADD
   them in one pipelined round trip, in ``seq`` order.
4. Record receipts (one statement), back off transient per-entry failures and quarantine
   permanent ones (one statement each, only when there are any).

``run`` overlaps the three round trips where the store offers a second connection
(PostgreSQL; see :mod:`relay.pipeline`): it claims the next batch while a sender thread
publishes the current one and a recorder thread writes the previous one's receipts;
``run_once`` does one cycle in order, for tests and ``--once``.

A connection failure of the database or of Redis raises out of ``run_once``; ``run`` logs
it, waits with exponential backoff and full jitter, and carries on; it never exits because
a service is down. SIGTERM or SIGINT, :meth:`Relay.stop` (or the ``stop`` argument) ends
``run`` after the batches in hand have been published and their receipts recorded.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from outbox import tracing
from outbox.backoff import Backoff
from outbox.core import Outbox
from outbox.db import make_engine
from outbox.hooks import NO_HOOKS, Hooks, call_hook
from outbox.lifecycle import GracefulStop, incarnation_name
from outbox.logs import fields
from outbox.schema import OutboxSchema, build_schema
from relay.config import RelayConfig
from relay.errors import ConfigError, PermanentPublishError, RoutingError
from relay.pipeline import Outcome, Recorder, Sender, record_outcome
from relay.publisher import (
    INFRASTRUCTURE_ERRORS,
    FencedOut,
    HeldBack,
    MarkerBehind,
    Prepared,
    RedisStreamPublisher,
    TransientError,
)
from relay.records import Orphan, Record, entry_id_key
from relay.redis_health import Persistence, check_persistence, holds_entry, stream_last_id
from relay.republish import republish, since_argument
from relay.store import Store, open_store

log = logging.getLogger("outbox.relay")


def infrastructure_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "a service is unavailable": wait and retry, never exit."""
    import psycopg

    return (
        *INFRASTRUCTURE_ERRORS,
        redis.RedisError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        OperationalError,
        DBAPIError,
        ConnectionError,
    )


REDIS_CHECK_BACKOFF = Backoff(0.5, 30.0)
"""After a failed check of Redis, the next one waits 0.5 s, 1 s, 2 s ... up to 30 s (never
longer than ``redis_check_interval``)."""


@dataclass
class RelayStats:
    """Counters for progress lines and the live view (this process only)."""

    published: int = 0
    quarantined: int = 0
    retried: int = 0
    reconciled_found: int = 0
    reconciled_missing: int = 0
    data_loss_detected: int = 0
    republished: int = 0
    cycles: int = 0
    errors: int = 0
    last_error: str | None = None
    started: float = field(default_factory=time.time)


class Relay:
    """Republishes committed outbox events to Redis Streams.

    ``outbox_or_engine``: an :class:`outbox.Outbox` (its engine and table), an Engine or a
    database URL (then the default table, or ``schema``). ``publisher``: a
    :class:`RedisStreamPublisher`. ``hooks`` observe it (metrics).
    """

    def __init__(
        self,
        outbox_or_engine: Outbox | Engine | str | URL,
        publisher: RedisStreamPublisher,
        config: RelayConfig | None = None,
        *,
        hooks: Hooks | None = None,
        schema: OutboxSchema | None = None,
        name: str | None = None,
    ) -> None:
        if isinstance(outbox_or_engine, Outbox):
            self.engine = outbox_or_engine.engine
            self.schema = schema or outbox_or_engine.schema
        elif isinstance(outbox_or_engine, Engine):
            self.engine = outbox_or_engine
            self.schema = schema or build_schema()
        elif isinstance(outbox_or_engine, (str, URL)):
            self.engine = make_engine(outbox_or_engine)
            self.schema = schema or build_schema()
        else:
            raise ConfigError(
                "outbox_or_engine",
                f"expected an Outbox, an Engine or a URL, got {type(outbox_or_engine).__name__}",
            )
        if not isinstance(publisher, RedisStreamPublisher):
            raise ConfigError("publisher", "must be a RedisStreamPublisher")
        self.config = config or RelayConfig()
        if not isinstance(self.config, RelayConfig):
            raise ConfigError("config", "must be a RelayConfig")
        self.publisher = publisher
        self.hooks = hooks or NO_HOOKS
        self.name = name or incarnation_name(self.config.name_prefix)
        self.stats = RelayStats()
        self.store: Store = open_store(self.engine, self.schema, self.config)
        self._epoch = 0
        self._sweep_due = True
        self._last_sweep = 0.0
        self._last_orphan_check = -1e9
        self._last_retention = -1e9
        self._last_vacuum = time.monotonic()
        self._vacuum: threading.Thread | None = None
        self._infra = infrastructure_errors()
        self._recorder: Recorder | None = None
        self._redis_suspect = False
        # Rows refused by a whole-Redis condition (OOM at maxmemory, LOADING, ...), by where
        # they went (the slot on a cluster): once that Redis accepts entries again their
        # backoff ends at once instead of running up to record_backoff's ceiling.
        self._refused: dict[int | None, set[int]] = {}
        self._held: dict[int, frozenset[str]] = {}  # epoch -> keys failed, not yet recorded
        self._seen_at_claim: dict[int, int] = {}  # epoch -> recorder's epoch at its claim
        self._sender: Sender | None = None
        self.on_progress: Callable[[Relay], None] | None = None
        self._stopping = threading.Event()
        self._last_redis_check = -math.inf
        self._redis_check_failures = 0
        self._marker_behind = False
        self.persistence: Persistence | None = None

    # -- hooks ------------------------------------------------------------------------------

    def _hook(self, method: str, *args: Any) -> None:
        call_hook(self.hooks, method, *args)

    # -- one cycle --------------------------------------------------------------------------

    def run_once(self) -> int:
        """One claim-publish-record cycle (plus due reconciliation); how many it published.

        Raises the infrastructure error if the database or Redis is unavailable.
        """
        published, batch = self._cycle()
        if batch is not None:
            published += self._publish(*batch)
        return published

    def _cycle(
        self, quiesce: Callable[[], None] | None = None
    ) -> tuple[int, tuple[list[Record], int, float, float] | None]:
        """Maintenance and the claim: rebalance, reconcile, claim. Returns how many events
        reconciliation found published, and the claimed batch (records, epoch, cycle start,
        claim start) if any. ``quiesce`` waits until every batch already claimed is
        published and its outcome written (pipelined ``run``)."""
        started = time.monotonic()
        self.store.connect()
        if quiesce is not None and self.store.rebalance_due():
            # Partitions are given back only with every receipt written, so the next owner
            # does not take this relay's last batch for an orphan.
            quiesce()
        if self.store.rebalance():
            self._sweep_due = True
            self._last_orphan_check = -1e9
        published = 0
        if started - self._last_orphan_check >= 0.5:
            self._last_orphan_check = started
            published += self._reconcile()
            if self.store.retry_ready():
                self._sweep_due = True
        if (
            self._marker_behind
            or started - self._last_redis_check >= self.config.redis_check_interval
        ):
            if quiesce is not None:
                quiesce()  # a repair must not race the batches in hand
            try:
                self.check_redis()
                self._last_redis_check = started
                self._redis_check_failures = 0
            except self._infra as exc:
                # Checked again after a backoff (an idle relay with Redis down would log this
                # every cycle otherwise); the claim goes on (a publish to a Redis that is down
                # fails and keeps its intents, as always).
                retry_in = min(
                    self.config.redis_check_interval,
                    REDIS_CHECK_BACKOFF.cap(self._redis_check_failures),
                )
                self._redis_check_failures += 1
                self._last_redis_check = started - self.config.redis_check_interval + retry_in
                log.warning(
                    "cannot check Redis now",
                    extra=fields(
                        error=f"{type(exc).__name__}: {exc}"[:300],
                        attempt=self._redis_check_failures,
                        retry_in_seconds=round(retry_in, 3),
                    ),
                )
        sweep = self._sweep_due or started - self._last_sweep >= self.config.sweep_interval
        if self._redis_suspect:
            # The last batch failed on Redis: check it answers before claiming (and counting
            # an attempt on) another batch.
            self.publisher.ping()
            self._redis_suspect = False
        if sweep and quiesce is not None:
            # A sweep exists to pick up rows that waited behind a key whose head has just
            # been published; it must see that receipt, or it skips the waiting rows while
            # the key's later rows above the claim start go out before them.
            quiesce()
        if sweep:
            self._sweep_due = False
            self._last_sweep = started
        self._epoch += 1
        epoch = self._epoch
        claim_started = time.monotonic()
        if self._recorder is not None:
            if self._recorder.error is not None:
                error, self._recorder.error = self._recorder.error, None
                raise error
            self._seen_at_claim[epoch] = self._recorder.recorded_epoch
        records = self.store.claim(self.config.batch_size, self.name, epoch, sweep)
        if any(r.attempts for r in records):
            # Retried heads: once published, the rows waiting behind them (some below the
            # claim start) are claimable. The next claim must be a sweep, and (pipelined) it
            # waits for this batch's receipts, so no later row of those keys goes first.
            self._sweep_due = True
        self.stats.cycles += 1
        self._hook("relay_cycle_ok", time.time())
        if not records:
            self._seen_at_claim.pop(epoch, None)
            return published, None
        return published, (records, epoch, started, claim_started)

    def _publish(self, records: list[Record], epoch: int, started: float, claimed_at: float) -> int:
        outcome = Outcome(self.name, epoch)
        # Keys whose failure in an earlier batch is not yet committed: the claim could not
        # see it, so hold them back here.
        held: set[str] = self._unrecorded_failures(claimed_by_epoch=epoch)
        quarantined_topics: dict[str, int] = {}
        prepared: list[Prepared] = []
        for record in records:
            if record.key in held:
                outcome.release.append(record.seq)
                continue
            try:
                if not self.store.payload_is_json:
                    _check_json(record.payload)
                prepared.append(self.publisher.prepare(record))
            except (RoutingError, PermanentPublishError) as exc:
                outcome.quarantine.append((record.seq, str(exc)))
                quarantined_topics[record.topic] = quarantined_topics.get(record.topic, 0) + 1
                held.add(record.key)
        # The intent is committed; the entries must reach Redis within the deadline, or not
        # at all (another replica may reconcile this intent once the window has passed).
        if time.monotonic() - claimed_at > self.config.publish_deadline:
            log.warning("publish deadline passed before sending; leaving the batch to retry")
            # Counted as an attempt (available at once): the rows then hold back their keys
            # until they are published, wherever the claim floor is.
            outcome.failed.extend(
                (p.record.seq, 0.0, "publish deadline passed before sending", False)
                for p in prepared
            )
            self._record(outcome, held | {p.record.key for p in prepared})
            return 0
        try:
            with tracing.publishing(prepared):  # one span, linked to every event's trace
                results = self.publisher.publish(
                    prepared,
                    fence_key(self.name, epoch),
                    wait_replicas=self.config.wait_replicas,
                    wait_timeout=self.config.wait_timeout,
                )
        except Exception as exc:
            # Any prefix of the batch may be in the stream: keep the intents (they are
            # reconciled before the next attempt) and count the attempt on every record.
            error = f"{type(exc).__name__}: {exc}"
            for p in prepared:
                delay = max(
                    self.config.reconcile_after,
                    self.config.record_backoff.delay(p.record.attempts),
                )
                outcome.failed.append((p.record.seq, delay, error, True))
                held.add(p.record.key)
            self._record(outcome, held)
            self._hook("relay_publish_error", "transient", None)
            self._redis_suspect = True
            raise
        if results and all(isinstance(r, MarkerBehind) for r in results):
            # Redis holds less than our receipts: nothing was added. Give the batch back
            # (no attempt counted) and let the next cycle check and report the loss.
            log.warning(
                "batch refused: the Redis marker is behind the receipts", extra=fields(epoch=epoch)
            )
            outcome.release.extend(p.record.seq for p in prepared)
            self._marker_behind = True
            self._record(outcome, held | {p.record.key for p in prepared})
            return 0
        if results and all(isinstance(r, FencedOut) for r in results):
            # Another relay took this batch over (our claim was older than its window):
            # nothing was added; give back whatever it has not resolved yet.
            log.warning("batch fenced out by a reconciling relay", extra=fields(epoch=epoch))
            outcome.failed.extend(
                (p.record.seq, 0.0, "fenced out by a reconciling relay", False) for p in prepared
            )
            self._record(outcome, held | {p.record.key for p in prepared})
            return 0
        by_topic: dict[str, list[float]] = {}
        refused_now: list[tuple[int | None, int]] = []
        now = time.time()
        for p, result in zip(prepared, results, strict=True):
            record = p.record
            if isinstance(result, HeldBack):
                outcome.release.append(record.seq)
                held.add(record.key)
                continue
            # On a cluster a batch is one script per slot: one slot's share can be refused
            # whole (nothing of it added) while the others go out.
            if isinstance(result, MarkerBehind):
                outcome.release.append(record.seq)
                held.add(record.key)
                self._marker_behind = True
                continue
            if isinstance(result, FencedOut):
                outcome.failed.append((record.seq, 0.0, str(result), False))
                held.add(record.key)
                continue
            if isinstance(result, str):
                outcome.receipts.append((record.seq, p.stream, result))
                by_topic.setdefault(record.topic, []).append(now - record.created_epoch)
            elif isinstance(result, TransientError):
                delay = self.config.record_backoff.delay(record.attempts)
                outcome.failed.append((record.seq, delay, str(result), False))
                held.add(record.key)
                refused_now.append((self._server_of(p.stream), record.seq))
                self._hook("relay_publish_error", "transient", record.topic)
            else:
                outcome.quarantine.append((record.seq, str(result)))
                quarantined_topics[record.topic] = quarantined_topics.get(record.topic, 0) + 1
                held.add(record.key)
                self._hook("relay_publish_error", "permanent", record.topic)
        self._record(outcome, held)
        if self._refused and outcome.receipts:
            self._retry_refused({self._server_of(stream) for _seq, stream, _id in outcome.receipts})
        for where, seq in refused_now:  # after the retry above: not this batch's own
            refused = self._refused.setdefault(where, set())
            if len(refused) < _MAX_REFUSED_TRACKED:
                refused.add(seq)
        if outcome.failed or outcome.quarantine or any(r.attempts for r in records):
            # Rows behind a failing or recovered key sit below the claim floor.
            self._sweep_due = True
        for topic, latencies in by_topic.items():
            self._hook("relay_published", topic, len(latencies), latencies)
        for topic, count in quarantined_topics.items():
            self._hook("relay_quarantined", topic, count)
            log.error(
                "quarantined records",
                extra=fields(topic=topic, count=count, error=outcome.quarantine[0][1][:300]),
            )
        self.stats.published += len(outcome.receipts)
        self.stats.quarantined += len(outcome.quarantine)
        self.stats.retried += len(outcome.failed)
        self._hook("relay_batch", time.monotonic() - started, len(records))
        return len(outcome.receipts)

    def _server_of(self, stream: str) -> int | None:
        """Where a refusal of ``stream``'s entries came from: its slot on a cluster (one
        master may be at maxmemory while the others accept), the one server otherwise."""
        if not self.publisher.cluster:
            return None
        from outbox.redis_client import slot_of

        return slot_of(stream)

    def _retry_refused(self, accepting: set[int | None]) -> None:
        """The Redis behind ``accepting`` takes entries again: end the backoff of the rows
        it refused earlier (they are swept at once, in key order, behind their heads)."""
        seqs: list[int] = []
        for where in accepting:
            seqs.extend(self._refused.pop(where, ()))
        if not seqs:
            return
        try:
            retried = self.store.retry_now(seqs)
        except self._infra as exc:
            log.warning(
                "cannot end the backoff of refused records now; they retry on their own",
                extra=fields(error=f"{type(exc).__name__}: {exc}"[:300]),
            )
            return
        if retried:
            self._sweep_due = True
            log.info(
                "Redis accepts entries again: refused records retry now",
                extra=fields(records=retried),
            )

    def _record(self, outcome: Outcome, held: set[str]) -> None:
        """Write the outcome now (run_once), or hand it to the recorder thread (run)."""
        if self._recorder is None:
            record_outcome(self.store, outcome)
            return
        outcome.failed_keys = frozenset(held)
        if held:
            self._held[outcome.epoch] = outcome.failed_keys
        self._recorder.submit(outcome)

    def _unrecorded_failures(self, claimed_by_epoch: int) -> set[str]:
        """Keys that failed in batches whose outcome was not committed before this batch's
        claim started (see :class:`Recorder`)."""
        seen = self._seen_at_claim.pop(claimed_by_epoch, 0)
        if not self._held:
            return set()
        for old in [e for e in self._held if e <= seen]:
            del self._held[old]
        keys: set[str] = set()
        for failed in self._held.values():
            keys |= failed
        return keys

    def _reconcile(self) -> int:
        """Resolve intents without receipts whose publish window has passed."""
        orphans = self.store.orphans(self.config.batch_size)
        if not orphans:
            return 0
        margin = self.config.clock_margin
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
                stream = self.publisher.stream_for(record)
            except RoutingError:
                missing.append(orphan)  # never routable, so never published
                continue
            groups.setdefault(stream, []).append(orphan)
        # Fence first: once the fences are set no batch of these intents can still be added
        # (the publish script checks its fence atomically), so what the stream holds is final.
        # On a cluster each stream's slot has its own fence key for an intent. With
        # wait_replicas the fences are confirmed by the replicas, and with them every entry
        # before them: what is found below survives a failover.
        self.publisher.set_fences(
            sorted(
                {
                    self.publisher.fence_for(fence_key(o.claimed_by, o.claim_epoch), stream)
                    for stream, members in groups.items()
                    for o in members
                }
            ),
            wait_replicas=self.config.wait_replicas,
            wait_timeout=self.config.wait_timeout,
        )
        found: list[tuple[Orphan, str, str]] = []
        for stream, members in groups.items():
            # An entry of an intent was added after its claim committed: search from the
            # earliest claim (less the clock margin) to the end of the stream.
            start = min(o.claimed_epoch_s for o in members) - margin
            try:
                hits = self.publisher.find_published(
                    stream, [o.event_id for o in members], int(start * 1000), None
                )
            except redis.ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                hits = {}  # not a stream: nothing of ours can be in it
            for orphan in members:
                entry_id = hits.get(orphan.event_id)
                if entry_id is None:
                    missing.append(orphan)
                else:
                    found.append((orphan, stream, entry_id))
        self.store.resolve_orphans(found, missing)
        self.stats.reconciled_found += len(found)
        self.stats.reconciled_missing += len(missing)
        self._sweep_due = True
        self._hook("relay_reconciled", len(found), len(missing))
        log.info(
            "reconciled intents without receipts",
            extra=fields(found_in_stream=len(found), to_republish=len(missing)),
        )
        return len(found)

    # -- Redis's persistence and lost data -------------------------------------------------

    def check_redis(self) -> bool:
        """Check Redis's persistence (log, hook) and whether it lost acknowledged entries;
        True if it did (then the loss was reported, the marker re-armed and, with
        ``auto_republish``, the lost window published again). Runs at start, every
        ``redis_check_interval`` and after a batch was refused for a marker behind."""
        self._marker_behind = False
        report = check_persistence(self.publisher.client)
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
        self._hook("relay_redis_persistence", report.mode)
        receipts = self.store.latest_receipts()
        if self.publisher.known_last_id is None and receipts:
            self.publisher.saw_entry(*max(receipts, key=lambda r: entry_id_key(r[1])))
        if self.publisher.cluster:
            # Every slot's recent receipts, whichever relay wrote them: a slot this relay has
            # not published to yet is checked too, and its first batch there is refused
            # (not written above a gap) if that slot's master came back empty meanwhile.
            from outbox.redis_client import slot_of

            for stream, entry_id in receipts:
                self.publisher.saw_in_slot(slot_of(stream), [entry_id], [stream])
        return self._check_data_loss()

    def _check_data_loss(self) -> bool:
        """Compare each marker with what this relay knows Redis holds (one on a server, one
        per slot on a cluster); True if any lost entries (each loss reported)."""
        lost = False
        for known, stream in self.publisher.marker_checks():
            lost = self._check_data_loss_of(known, stream) or lost
        return lost

    def _check_data_loss_of(self, known: str, stream: str) -> bool:
        publisher = self.publisher
        client = publisher.client
        raw = client.get(publisher.marker_for(stream))
        marker = raw.decode() if isinstance(raw, bytes) else raw
        intact = stream_last_id(client, stream)
        marker_ok = marker is not None and entry_id_key(marker) >= entry_id_key(known)
        stream_ok = intact is not None and entry_id_key(intact) >= entry_id_key(known)
        # A marker or a stream at or past our receipt is not enough: after an empty restart
        # a relay that knew nothing of this slot may have written first and re-armed both,
        # above the gap. The receipt's entry itself must still be there (or deleted on
        # purpose: trimmed).
        if (marker_ok or stream_ok) and holds_entry(client, stream, known) is not False:
            if not marker_ok:
                # Only the marker is missing or behind (deleted, or first written by this
                # version). Nothing was lost.
                publisher.raise_marker(known, stream)
            return False
        # Redis holds less than the receipts: it lost acknowledged entries. Everything
        # published after the last id it still has may be gone.
        # The last entry Redis still holds from before the loss: marker and stream head if
        # they are behind our receipt, else (re-armed above the gap) the stream's last entry
        # below it. None: nothing survived; every retained event is republished.
        good = [
            i for i in (marker, intact) if i is not None and entry_id_key(i) < entry_id_key(known)
        ]
        below = client.xrevrange(stream, max=f"({known}", min="-", count=1)
        if below:
            raw_id = below[0][0]
            good.append(raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id))
        last_good = max(good, key=entry_id_key) if good else None
        published_after = (
            None
            if last_good is None
            else entry_id_key(last_good)[0] / 1000.0
            - self.config.clock_margin
            - self.config.publish_deadline
        )
        since = self.store.oldest_published_since(published_after)
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
        self._hook("relay_redis_data_loss", time.time())
        # Re-arm the marker so new events flow again (the lost ones wait for republish).
        publisher.raise_marker(known, stream)
        if self.config.auto_republish and since is not None:
            result = republish(
                self.store, publisher, since=since, batch_size=self.config.batch_size
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
        return True

    def delete_expired(self) -> int:
        """Delete published rows older than the retention, in bounded batches."""
        if self.config.retention_seconds <= 0:
            return 0
        total = 0
        for _ in range(20):
            deleted = self.store.delete_published(
                self.config.retention_seconds, self.config.retention_batch
            )
            total += deleted
            if deleted < self.config.retention_batch:
                break
        if total:
            log.info("retention deleted published rows", extra=fields(deleted=total))
        return total

    # -- the loop ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run()`` to finish the batches in hand, record their receipts and return
        (from any thread; before ``run()`` starts, it makes ``run()`` return at once)."""
        self._stopping.set()

    def run(self, stop: GracefulStop | threading.Event | None = None) -> None:
        """Run until SIGTERM/SIGINT, :meth:`stop`, or ``stop`` (an event a caller shares
        between runners) is set. Never exits on an outage."""
        if stop is None:
            graceful = GracefulStop()
            graceful.event = self._stopping  # SIGTERM/SIGINT set the relay's own flag
            graceful.install()
            external = None
        elif isinstance(stop, GracefulStop):
            external = stop.event
        elif isinstance(stop, threading.Event):
            external = stop
        else:
            raise ConfigError("stop", "must be a GracefulStop or a threading.Event")
        event = _EitherEvent(self._stopping, external)
        try:
            self._run(event)
        finally:
            self._stopping.clear()

    def _run(self, event: _EitherEvent) -> None:
        cfg = self.config
        log.info(
            "relay started",
            extra=fields(
                relay=self.name,
                database=self.engine.url.render_as_string(hide_password=True),
                stream=self.publisher.stream_template,
                batch_size=cfg.batch_size,
                partitions=self.store.partitions,
                listen=cfg.listen and self.store.supports_notify,
                retention_seconds=cfg.retention_seconds,
                redis_cluster=self.publisher.cluster,
                wait_replicas=cfg.wait_replicas,
            ),
        )
        receipts = self.store.receipt_store()
        if receipts is not None:
            self._recorder = Recorder(receipts)
            self._sender = Sender(self._publish)

        def quiesce() -> None:
            if self._sender is not None:
                self._sender.wait_idle()
            if self._recorder is not None:
                self._recorder.wait_idle()

        pipelined = self._sender is not None
        interval = cfg.poll_interval
        busy_until = 0.0  # until then (monotonic), empty cycles keep the short poll interval
        outage_attempt = 0
        last_progress = time.monotonic()
        published_at_progress = 0
        try:
            while not event.is_set():
                try:
                    if self._sender is not None and self._sender.error is not None:
                        error, self._sender.error = self._sender.error, None
                        raise error
                    published, batch = self._cycle(quiesce if pipelined else None)
                    claimed = 0
                    if batch is not None:
                        claimed = len(batch[0])
                        if self._sender is not None:
                            self._sender.submit(batch)
                        else:
                            published += self._publish(*batch)
                    published = max(published, claimed)
                    now = time.monotonic()
                    if now - self._last_retention >= cfg.retention_interval and (
                        0 in self.store.owned
                    ):
                        self._last_retention = now
                        self.delete_expired()
                    if (
                        cfg.vacuum_interval > 0
                        and now - self._last_vacuum >= cfg.vacuum_interval
                        and 0 in self.store.owned
                    ):
                        self._last_vacuum = now
                        self._start_vacuum(self.store)
                    if outage_attempt:
                        log.info("recovered", extra=fields(after_attempts=outage_attempt))
                    outage_attempt = 0
                except Exception as exc:
                    # Outages are expected; anything else is a bug, logged with its
                    # traceback. Neither ends the loop.
                    outage_attempt += 1
                    self.stats.errors += 1
                    self.stats.last_error = f"{type(exc).__name__}: {exc}"
                    delay = cfg.outage_backoff.delay(outage_attempt)
                    log.warning(
                        "database or Redis unavailable; retrying"
                        if isinstance(exc, self._infra)
                        else "unexpected error; retrying",
                        exc_info=not isinstance(exc, self._infra),
                        extra=fields(
                            error=self.stats.last_error[:500],
                            attempt=outage_attempt,
                            retry_in_seconds=round(delay, 3),
                        ),
                    )
                    self._hook("relay_publish_error", type(exc).__name__, None)
                    if pipelined:
                        # Outcomes not written keep their intents; dropping the partitions
                        # (closing the claim connection) makes the next owner, maybe this
                        # relay again, mark and reconcile them before claiming.
                        quiesce()
                        if self._sender is not None:
                            self._sender.error = None
                        if self._recorder is not None:
                            self._recorder.error = None
                        self._held.clear()
                        self._seen_at_claim.clear()
                    self.store.close()
                    event.wait(delay)
                    continue
                now = time.monotonic()
                if now - last_progress >= cfg.progress_interval:
                    self._log_progress(now - last_progress, published_at_progress)
                    last_progress = now
                    published_at_progress = self.stats.published
                if self.on_progress is not None:
                    try:
                        self.on_progress(self)
                    except Exception:
                        log.debug("progress callback failed", exc_info=True)
                if published >= cfg.batch_size:
                    interval = cfg.poll_interval
                    continue
                if published:
                    interval = cfg.poll_interval
                    busy_until = now + BUSY_WINDOW
                elif now >= busy_until:  # a second without work: back off toward idle
                    interval = min(cfg.max_poll_interval, interval * 2)
                if event.is_set():
                    break
                # Wake on a NOTIFY, a stop request, or the polling interval.
                if self.store.supports_notify and cfg.listen:
                    if self.store.wait_for_notify(min(interval, 0.25)) == 2:
                        self._sweep_due = True
                else:
                    event.wait(interval)
        finally:
            if self._sender is not None:
                self._sender.close()  # the batches in hand are published first
                self._sender = None
            if self._recorder is not None:
                self._recorder.close()  # and get their receipts
                self._recorder = None
                self._held.clear()
            self.store.close()
            log.info(
                "relay stopped",
                extra=fields(relay=self.name, published=self.stats.published),
            )

    def _start_vacuum(self, store: Store) -> None:
        """Vacuum in the background (a database without autovacuum only); one at a time."""
        if self._vacuum is not None and self._vacuum.is_alive():
            return

        def vacuum() -> None:
            try:
                took = store.vacuum_if_no_autovacuum()
            except Exception as exc:
                log.warning(
                    "vacuum failed", extra=fields(error=f"{type(exc).__name__}: {exc}"[:300])
                )
                return
            if took is not None:
                log.info(
                    "vacuumed the outbox table (autovacuum is off)",
                    extra=fields(seconds=round(took, 3)),
                )

        self._vacuum = threading.Thread(target=vacuum, name="relay-vacuum", daemon=True)
        self._vacuum.start()

    def _log_progress(self, elapsed: float, before: int) -> None:
        try:
            backlog, oldest = self.store.backlog()
        except self._infra:
            backlog, oldest = -1, None
        log.info(
            "progress",
            extra=fields(
                published=self.stats.published,
                rate_per_second=round((self.stats.published - before) / max(elapsed, 1e-9), 1),
                backlog=backlog,
                oldest_unpublished_age_seconds=None if oldest is None else round(oldest, 3),
                quarantined=self.stats.quarantined,
                partitions=sorted(self.store.owned),
            ),
        )


BUSY_WINDOW = 1.0
"""Seconds after a cycle that found work during which an empty cycle keeps the short
``poll_interval`` (events arriving in bursts are found within milliseconds); only after a
whole window without work does the wait double toward ``max_poll_interval``."""

_MAX_REFUSED_TRACKED = 100_000  # per server; beyond it the record backoff alone applies


class _EitherEvent:
    """The relay's own stop flag, or a caller's stop event: whichever is set first. Waits
    wake on the relay's flag at once and look at the caller's every 0.1 s."""

    def __init__(self, own: threading.Event, external: threading.Event | None) -> None:
        self.own = own
        self.external = external

    def is_set(self) -> bool:
        return self.own.is_set() or (self.external is not None and self.external.is_set())

    def wait(self, seconds: float) -> bool:
        if self.external is None:
            return self.own.wait(seconds)
        deadline = time.monotonic() + seconds
        while not self.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.own.wait(min(remaining, 0.1))
        return True


def fence_key(owner: str, epoch: int) -> str:
    """The Redis key that fences the intent ``(owner, epoch)`` (see ``set_fences``)."""
    return f"outbox:fence:{owner}:{epoch}"


def _check_json(payload: str) -> None:
    try:
        json.loads(payload)
    except (TypeError, ValueError) as exc:
        raise PermanentPublishError(f"stored payload is not valid JSON: {exc}") from None
