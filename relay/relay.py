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

The parts: :mod:`relay.batch` (publishing one claimed batch, steps 3 and 4),
:mod:`relay.reconcile` (step 2's intents), the broker's health check (on Redis
:mod:`relay.redis.data_loss`), ``run``'s loop (:mod:`relay.loop`, :class:`Relay`'s base
class); here, the cycle and the duties the loop runs. The broker is a
:class:`relay.broker.Broker`: nothing here knows which one.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import URL, Engine

from outbox.backoff import Backoff
from outbox.core import Outbox
from outbox.db import make_engine
from outbox.duty import Duty, Interval, weakly
from outbox.hooks import NO_HOOKS, Hooks, call_hook
from outbox.lifecycle import incarnation_name
from outbox.logs import fields
from outbox.outage import report_failure, service_errors
from outbox.schema import OutboxSchema, build_schema
from relay.batch import BatchPublisher
from relay.config import RelayConfig
from relay.errors import ConfigError
from relay.loop import RelayLoop
from relay.partitions import PartitionUpkeep
from relay.pipeline import Sender
from relay.reconcile import fence_key, reconcile_orphans
from relay.records import Record, RelayStats
from relay.seam import Broker, BrokerCheck
from relay.store import Store, store_for

log = logging.getLogger("outbox.relay")


def infrastructure_errors() -> tuple[type[BaseException], ...]:
    """Every error of the database or Redis (``outbox.outage.service_errors``): what the
    relay's side duties and its command's start wait out and retry, never exit on. Which of
    them are outages (one log line) and which are refusals or bugs (a traceback) is
    ``outbox.outage.is_outage``'s to say."""
    return (OSError, *service_errors())


RECONCILE_INTERVAL = 0.5
"""Seconds between two looks for orphaned intents (and at once after a rebalance)."""

RETENTION_BATCHES_PER_ROUND = 20
"""DELETE batches of ``retention_batch`` rows in one retention round; a round that uses all of
them is due again at once, so retention keeps up with any write rate."""

REDIS_CHECK_BACKOFF = Backoff(0.5, 30.0)
"""After a failed check of Redis, the next one waits 0.5 s, 1 s, 2 s ... up to 30 s (never
longer than ``redis_check_interval``)."""


class Relay(RelayLoop):
    """Republishes committed outbox events to Redis Streams.

    ``outbox_or_engine``: an :class:`outbox.Outbox` (its engine and table), an Engine or a
    database URL (then the default table, or ``schema``). ``publisher``: a
    :class:`relay.broker.Broker` (``relay.broker.broker_for(url)``). ``hooks`` observe it
    (metrics). ``rng`` (a ``random.Random``) draws the jitter of the per-record retry
    backoff (default: the ``random`` module; ``outbox.testing`` passes a seeded one).
    """

    def __init__(
        self,
        outbox_or_engine: Outbox | Engine | str | URL,
        publisher: Broker,
        config: RelayConfig | None = None,
        *,
        hooks: Hooks | None = None,
        schema: OutboxSchema | None = None,
        name: str | None = None,
        rng: random.Random | None = None,
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
        if not isinstance(publisher, Broker):
            raise ConfigError("publisher", "must be a relay.broker.Broker (see broker_for)")
        self.config = config or RelayConfig()
        if not isinstance(self.config, RelayConfig):
            raise ConfigError("config", "must be a RelayConfig")
        self.publisher = publisher
        self.hooks = hooks or NO_HOOKS
        self.name = name or incarnation_name(self.config.name_prefix)
        self.stats = RelayStats()
        self.store: Store = store_for(self.engine, self.schema, self.config)
        self._epoch = 0
        cfg = self.config
        # When the next claim is a sweep: every sweep_interval, and at once when asked.
        self._sweep = Interval(cfg.sweep_interval)
        # The relay's periodic duties (outbox.duty), each with its interval: reconciliation
        # of orphaned intents and the check of Redis on the cycle's path, retention and
        # vacuum after it (the owner of partition 0 only).
        self.reconciliation = Duty("reconcile", RECONCILE_INTERVAL, weakly(self._reconcile))
        self.redis_check = Duty(
            "Redis check", cfg.redis_check_interval, weakly(self.check_redis), retry_failed=True
        )
        self.retention = Duty(
            "outbox retention",
            cfg.retention_interval,
            weakly(self.delete_expired),
            again_in=weakly(self._retention_again_in),
        )
        # A partitioned table (outbox.partitions): partitions made ahead and dropped whole,
        # instead of the DELETE above (relay.partitions).
        self.partition_upkeep = PartitionUpkeep(self.engine, self.schema, cfg.retention_seconds)
        self.partition_duty = Duty(
            "outbox partitions", self.partition_upkeep.interval, self.partition_upkeep.run_once
        )
        self.vacuum = (
            Duty("outbox vacuum", cfg.vacuum_interval, weakly(self._start_vacuum), first="later")
            if cfg.vacuum_interval > 0
            else None
        )
        self._vacuum: threading.Thread | None = None
        self._infra = infrastructure_errors()
        self._sender: Sender | None = None
        self.on_progress: Callable[[Relay], None] | None = None
        self._stopping = threading.Event()
        self._redis_check_failures = 0
        # The publish of one claimed batch and the memory it keeps (relay.batch), and the
        # check of Redis's persistence and lost entries (on Redis: relay.redis.data_loss).
        self._batches = BatchPublisher(
            self.name,
            self.store,
            self.publisher,
            self.config,
            stats=self.stats,
            hook=weakly(self._hook),
            want_sweep=weakly(self._want_sweep),
            infra=self._infra,
            rng=rng,
        )
        self._redis_check: BrokerCheck | None = self.publisher.health_check(
            self.store, self.config, self.stats, weakly(self._hook)
        )

    def _want_sweep(self) -> None:
        """The next claim is a sweep: rows wait below the claim floor."""
        self._sweep.make_due()

    # -- hooks ------------------------------------------------------------------------------

    def _hook(self, method: str, *args: Any) -> None:
        call_hook(self.hooks, method, *args)

    # -- one cycle --------------------------------------------------------------------------

    def run_once(self, *, now: float | None = None) -> int:
        """One claim-publish-record cycle (plus due reconciliation); how many it published.

        ``now`` (unix seconds, a clock the caller moves: ``outbox.testing``'s) is the time the
        cycle's intervals are measured on: the reconciliation of orphaned intents, the check
        of Redis and the sweep below the claim floor are due by it, so a test that advances
        its clock past them gets them on its next cycle. The rows' own times (``available_at``
        of a backoff, a claim's age) stay on the database clock. A cycle that finds nothing
        new sweeps at once when a row below the claim floor is claimable again (requeued, or
        its backoff over), so a caller's own loop need not LISTEN. Raises the infrastructure
        error if the database or Redis is unavailable.
        """
        published, batch = self._cycle(now=now)
        if batch is None and self.store.outbox_retry_ready():
            # Nothing above the claim floor, but a row below it is claimable again (its
            # backoff is over, or it was requeued). ``run`` learns of a requeue by LISTEN;
            # a caller's own loop does not listen, and would wait for ``sweep_interval``.
            self._sweep.done(time.monotonic() if now is None else now)
            batch = self._claim(True, time.monotonic())
        if batch is not None:
            published += self._publish(*batch)
        return published

    def _cycle(
        self, quiesce: Callable[[], None] | None = None, *, now: float | None = None
    ) -> tuple[int, tuple[list[Record], int, float, float] | None]:
        """Maintenance and the claim: rebalance, reconcile, claim. Returns how many events
        reconciliation found published, and the claimed batch (records, epoch, cycle start,
        claim start) if any. ``quiesce`` waits until every batch already claimed is
        published and its outcome written (pipelined ``run``); ``now``: see ``run_once``."""
        started = time.monotonic()
        at = started if now is None else now  # what the intervals are measured on
        self.store.connect()
        if quiesce is not None and not self.store.partitions_owned:
            # A new session (the old one, and its partitions, are gone): the partitions it
            # takes may hold batches still in hand, which must not be taken for orphans.
            quiesce()
        # Partitions are given back only with every receipt written, so the next owner does
        # not take this relay's last batch for an orphan. (Not before every rebalance: that
        # stalled the claim once a second for a publish and a receipt round trip.)
        if self.store.partition_rebalance(before_release=quiesce or (lambda: None)):
            self._sweep.make_due()
            self.reconciliation.make_due()
        published = 0
        if self.reconciliation.due(at):
            published += self.reconciliation.run_now(at)
            if self.store.outbox_retry_ready():
                self._sweep.make_due()
        if self._batches.marker_behind or self.redis_check.due(at):
            self._check_redis_in_cycle(at, quiesce)
        sweep = self._sweep.due(at)
        if self._batches.redis_suspect:
            # The last batch failed on Redis: check it answers before claiming (and counting
            # an attempt on) another batch.
            self.publisher.ping()
            self._batches.redis_suspect = False
        if sweep:
            if quiesce is not None:
                # A sweep exists to pick up rows that waited behind a key whose head has
                # just been published; it must see that receipt, or it skips the waiting
                # rows while the key's later rows above the claim start go out before them.
                quiesce()
            self._sweep.done(at)
        batch = self._claim(sweep, started)
        return published, batch

    def _check_redis_in_cycle(self, started: float, quiesce: Callable[[], None] | None) -> None:
        """:meth:`check_redis` when due; when Redis cannot be checked, again after a backoff
        (an idle relay with Redis down would log this every cycle otherwise). The claim goes
        on either way (a publish to a Redis that is down fails and keeps its intents)."""
        if quiesce is not None:
            quiesce()  # a repair must not race the batches in hand
        try:
            self.redis_check.run_now(started)
            self._redis_check_failures = 0
        except self._infra as exc:
            retry_in = min(
                self.config.redis_check_interval,
                REDIS_CHECK_BACKOFF.cap(self._redis_check_failures),
            )
            self._redis_check_failures += 1
            self.redis_check.interval.done(started, again_in=retry_in)
            report_failure(
                log,
                "cannot check Redis now",
                exc,
                attempt=self._redis_check_failures,
                retry_in_seconds=round(retry_in, 3),
            )

    def _claim(self, sweep: bool, started: float) -> tuple[list[Record], int, float, float] | None:
        """Claim the next batch under a new epoch (the claim writes its intent); None when
        nothing was claimable. Raises what the recorder thread failed on, first."""
        self._epoch += 1
        epoch = self._epoch
        claim_started = time.monotonic()
        if self._batches.recorder is not None:
            if self._batches.recorder.error is not None:
                error, self._batches.recorder.error = self._batches.recorder.error, None
                raise error
            self._batches.seen_at_claim[epoch] = self._batches.recorder.recorded_epoch
        records = self.store.outbox_claim(self.config.batch_size, self.name, epoch, sweep)
        if any(r.attempts for r in records):
            # Retried heads: once published, the rows waiting behind them (some below the
            # claim start) are claimable. The next claim must be a sweep, and (pipelined) it
            # waits for this batch's receipts, so no later row of those keys goes first.
            self._sweep.make_due()
        self.stats.cycles += 1
        self._hook("relay_cycle_ok", time.time())
        if not records:
            self._batches.seen_at_claim.pop(epoch, None)
            return None
        return records, epoch, started, claim_started

    def _publish(self, records: list[Record], epoch: int, started: float, claimed_at: float) -> int:
        return self._batches.publish(records, epoch, started, claimed_at)

    def _reconcile(self) -> int:
        """Resolve intents without receipts whose publish window has passed
        (:mod:`relay.reconcile`); how many were found published."""
        resolved = reconcile_orphans(self.store, self.publisher, self.config)
        if resolved is None:
            return 0
        found, missing = resolved
        self.stats.reconciled_found += len(found)
        self.stats.reconciled_missing += len(missing)
        self._sweep.make_due()
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
        ``redis_check_interval`` and after a batch was refused for a marker behind
        (on Redis :mod:`relay.redis.data_loss`)."""
        self._batches.marker_behind = False
        return self._redis_check is not None and self._redis_check.check()

    check_broker = check_redis

    @property
    def persistence(self) -> Any:
        """The broker's persistence as the last check found it (None before the first)."""
        return None if self._redis_check is None else self._redis_check.persistence

    def delete_expired(self) -> int:
        """Delete published rows older than the retention, in bounded batches (none from a
        partitioned table: its partition duty drops whole partitions)."""
        if self.config.retention_seconds <= 0 or self.partition_upkeep.partitioned:
            return 0
        total = 0
        for _ in range(RETENTION_BATCHES_PER_ROUND):
            deleted = self.store.outbox_delete_published(
                self.config.retention_seconds, self.config.retention_batch
            )
            total += deleted
            if deleted < self.config.retention_batch:
                break
        if total:
            log.info("retention deleted published rows", extra=fields(deleted=total))
        return total

    def _retention_again_in(self, deleted: int) -> float | None:
        """A round that hit its cap (every batch full) is behind: the next one at once, not
        after ``retention_interval`` (at 20 batches of 1,000 a minute, an outbox written
        faster than 333 events/s grew without end)."""
        full = RETENTION_BATCHES_PER_ROUND * self.config.retention_batch
        return 0.0 if deleted >= full else None

    def _start_vacuum(self) -> None:
        """Vacuum in the background (a database without autovacuum only); one at a time."""
        if self._vacuum is not None and self._vacuum.is_alive():
            return
        store = self.store

        def vacuum() -> None:
            try:
                took = store.outbox_vacuum_if_no_autovacuum()
            except Exception as exc:
                report_failure(log, "vacuum failed; again at the next interval", exc)
                return
            if took is not None:
                log.info(
                    "vacuumed the outbox table (autovacuum is off)",
                    extra=fields(seconds=round(took, 3)),
                )

        self._vacuum = threading.Thread(target=vacuum, name="relay-vacuum", daemon=True)
        self._vacuum.start()


__all__ = ["REDIS_CHECK_BACKOFF", "Relay", "RelayStats", "fence_key", "infrastructure_errors"]
