"""Publishing one claimed batch (steps 3 and 4 of the cycle in :mod:`relay.relay`): build
its entries, XADD them in one pipelined round trip, sort the results into an outcome
(receipts, backoffs, quarantines, releases) and write it, or hand it to the recorder thread.

:class:`BatchPublisher` also keeps what publishing must remember between batches:

- the keys that failed in a batch whose outcome is not committed yet (pipelined ``run``:
  the next claim cannot see that failure, so those keys are held back here; see
  :mod:`relay.pipeline`);
- the rows a whole Redis refused (OOM at maxmemory, LOADING, ...), by where they went (the
  slot on a cluster): once that Redis accepts entries again their backoff ends at once;
- whether the last batch failed on Redis (the next cycle pings it before claiming) and
  whether a marker was found behind (the next cycle checks Redis for lost entries).

Why a batch is given back instead of published late, and how fences make a takeover
safe: ``docs/explanation/fencing.md``; the order of a key's rows:
``docs/explanation/claims-and-order.md``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox import tracing
from outbox.logs import fields
from outbox.outage import report_failure
from relay.config import RelayConfig
from relay.errors import PermanentPublishError, RoutingError
from relay.pipeline import Outcome, Recorder, record_outcome
from relay.reconcile import fence_key
from relay.records import Record, RelayStats
from relay.seam import (
    Broker,
    FencedOut,
    HeldBack,
    MarkerBehind,
    Prepared,
    TransientError,
)
from relay.store import Store

log = logging.getLogger("outbox.relay")

_MAX_REFUSED_TRACKED = 100_000  # per server; beyond it the record backoff alone applies


@dataclass
class _Batch:
    """One claimed batch on its way through ``Relay._publish``: its outcome, the keys held
    back (failed here or in a batch not recorded yet), its entries, and what to report."""

    outcome: Outcome
    held: set[str]
    prepared: list[Prepared] = field(default_factory=list)
    quarantined: dict[str, int] = field(default_factory=dict)  # records per topic
    latencies: dict[str, list[float]] = field(default_factory=dict)  # per topic, published

    def quarantine(self, record: Record, error: str) -> None:
        self.outcome.quarantine.append((record.seq, error))
        self.quarantined[record.topic] = self.quarantined.get(record.topic, 0) + 1
        self.held.add(record.key)

    @property
    def prepared_keys(self) -> set[str]:
        return {p.record.key for p in self.prepared}


class BatchPublisher:
    """Publishes the batches one relay claims (see the module docstring). ``want_sweep``
    asks the relay's next claim to be a sweep; ``infra``: the errors that mean a service is
    unavailable."""

    def __init__(
        self,
        name: str,
        store: Store,
        publisher: Broker,
        config: RelayConfig,
        *,
        stats: RelayStats,
        hook: Callable[..., None],
        want_sweep: Callable[[], None],
        infra: tuple[type[BaseException], ...],
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self.rng = rng  # the retry backoff's jitter (None: the random module)
        self.store = store
        self.publisher = publisher
        self.config = config
        self.stats = stats
        self._hook = hook
        self._want_sweep = want_sweep
        self._infra = infra
        self.recorder: Recorder | None = None  # pipelined run: outcomes written by a thread
        self.redis_suspect = False  # the last batch failed on Redis
        self.marker_behind = False  # a batch was refused for a marker behind
        self._refused: dict[int | None, set[int]] = {}  # by server (slot): seqs refused
        self.held: dict[int, frozenset[str]] = {}  # epoch -> keys failed, not yet recorded
        self.seen_at_claim: dict[int, int] = {}  # epoch -> recorder's epoch at its claim

    def publish(self, records: list[Record], epoch: int, started: float, claimed_at: float) -> int:
        """Publish one claimed batch and write (or hand over) its outcome; how many it
        published. The steps: prepare the entries, give the batch back if its deadline has
        passed, send, give it back if Redis refused all of it, sort the results, record."""
        # Keys whose failure in an earlier batch is not yet committed: the claim could not
        # see it, so hold them back here.
        batch = _Batch(Outcome(self.name, epoch), self._unrecorded_failures(claimed_by_epoch=epoch))
        self._prepare(batch, records)
        # The intent is committed; the entries must reach Redis within the deadline, or not
        # at all (another replica may reconcile this intent once the window has passed).
        if time.monotonic() - claimed_at > self.config.publish_deadline:
            log.warning("publish deadline passed before sending; leaving the batch to retry")
            # Counted as an attempt (available at once): the rows then hold back their keys
            # until they are published, wherever the claim floor is.
            self._give_back(batch, "publish deadline passed before sending")
            return 0
        results = self._send(batch)
        if self._refused_whole(batch, results):
            return 0
        refused_now = self._sort_results(batch, results)
        self.record(batch.outcome, batch.held)
        self._after_published(batch, records, refused_now)
        self._hook("relay_batch", time.monotonic() - started, len(records))
        return len(batch.outcome.receipts)

    def _prepare(self, batch: _Batch, records: list[Record]) -> None:
        """The entries of ``records``; a record whose key is held back is released, one that
        can never be published (no route, a payload that is not JSON) is quarantined."""
        for record in records:
            if record.key in batch.held:
                batch.outcome.release.append(record.seq)
                continue
            try:
                if not self.store.payload_is_json:
                    _check_json(record.payload)
                batch.prepared.append(self.publisher.prepare(record))
            except (RoutingError, PermanentPublishError) as exc:
                batch.quarantine(record, str(exc))

    def _give_back(self, batch: _Batch, error: str) -> None:
        """Nothing of the batch was added: every prepared record is retried at once, its
        attempt counted."""
        batch.outcome.failed.extend((p.record.seq, 0.0, error, False) for p in batch.prepared)
        self.record(batch.outcome, batch.held | batch.prepared_keys)

    def _send(self, batch: _Batch) -> list[Any]:
        """The batch in one pipelined round trip; on an error (Redis down, a timeout), the
        attempt is counted on every record and the error raised."""
        try:
            with tracing.publishing(batch.prepared):  # one span, linked to every event's trace
                return self.publisher.publish(
                    batch.prepared,
                    fence_key(self.name, batch.outcome.epoch),
                    wait_replicas=self.config.wait_replicas,
                    wait_timeout=self.config.wait_timeout,
                )
        except Exception as exc:
            # Any prefix of the batch may be in the stream: keep the intents (they are
            # reconciled before the next attempt) and count the attempt on every record.
            error = f"{type(exc).__name__}: {exc}"
            for p in batch.prepared:
                delay = max(
                    self.config.reconcile_after,
                    self.config.record_backoff.delay(p.record.attempts, self.rng),
                )
                batch.outcome.failed.append((p.record.seq, delay, error, True))
                batch.held.add(p.record.key)
            self.record(batch.outcome, batch.held)
            self._hook("relay_publish_error", "transient", None)
            self.redis_suspect = True
            raise

    def _refused_whole(self, batch: _Batch, results: list[Any]) -> bool:
        """Whether Redis added nothing because the marker is behind or the batch was fenced
        out; then the batch is given back."""
        epoch = batch.outcome.epoch
        if results and all(isinstance(r, MarkerBehind) for r in results):
            # Redis holds less than our receipts: nothing was added. Give the batch back
            # (no attempt counted) and let the next cycle check and report the loss.
            log.warning(
                "batch refused: the Redis marker is behind the receipts", extra=fields(epoch=epoch)
            )
            batch.outcome.release.extend(p.record.seq for p in batch.prepared)
            self.marker_behind = True
            self.record(batch.outcome, batch.held | batch.prepared_keys)
            return True
        if results and all(isinstance(r, FencedOut) for r in results):
            # Another relay took this batch over (our claim was older than its window):
            # nothing was added; give back whatever it has not resolved yet.
            log.warning("batch fenced out by a reconciling relay", extra=fields(epoch=epoch))
            self._give_back(batch, "fenced out by a reconciling relay")
            return True
        return False

    def _sort_results(self, batch: _Batch, results: list[Any]) -> list[tuple[int | None, int]]:
        """Each record's result into the outcome: a receipt, a release, a backoff or a
        quarantine. Returns the records refused by a whole Redis (by where they went)."""
        refused_now: list[tuple[int | None, int]] = []
        outcome = batch.outcome
        now = time.time()
        for p, result in zip(batch.prepared, results, strict=True):
            record = p.record
            if isinstance(result, str):
                outcome.receipts.append((record.seq, p.stream, result))
                batch.latencies.setdefault(record.topic, []).append(now - record.created_epoch)
                continue
            batch.held.add(record.key)
            if isinstance(result, HeldBack | MarkerBehind):
                # On a cluster a batch is one script per slot: one slot's share can be
                # refused whole (nothing of it added) while the others go out.
                outcome.release.append(record.seq)
                self.marker_behind = self.marker_behind or isinstance(result, MarkerBehind)
            elif isinstance(result, FencedOut):
                outcome.failed.append((record.seq, 0.0, str(result), False))
            elif isinstance(result, TransientError):
                delay = self.config.record_backoff.delay(record.attempts, self.rng)
                outcome.failed.append((record.seq, delay, str(result), False))
                refused_now.append((self._server_of(p.stream), record.seq))
                self._hook("relay_publish_error", "transient", record.topic)
            else:
                batch.quarantine(record, str(result))
                self._hook("relay_publish_error", "permanent", record.topic)
        return refused_now

    def _after_published(
        self, batch: _Batch, records: list[Record], refused_now: list[tuple[int | None, int]]
    ) -> None:
        """With the outcome recorded: end the backoff of rows a now-accepting Redis refused
        earlier, remember this batch's refused ones, ask for a sweep, report."""
        outcome = batch.outcome
        if self._refused and outcome.receipts:
            self._retry_refused({self._server_of(stream) for _seq, stream, _id in outcome.receipts})
        for where, seq in refused_now:  # after the retry above: not this batch's own
            refused = self._refused.setdefault(where, set())
            if len(refused) < _MAX_REFUSED_TRACKED:
                refused.add(seq)
        if outcome.failed or outcome.quarantine or any(r.attempts for r in records):
            # Rows behind a failing or recovered key sit below the claim floor.
            self._want_sweep()
        for topic, latencies in batch.latencies.items():
            self._hook("relay_published", topic, len(latencies), latencies)
        for topic, count in batch.quarantined.items():
            self._hook("relay_quarantined", topic, count)
            log.error(
                "quarantined records",
                extra=fields(topic=topic, count=count, error=outcome.quarantine[0][1][:300]),
            )
        self.stats.published += len(outcome.receipts)
        self.stats.quarantined += len(outcome.quarantine)
        self.stats.retried += len(outcome.failed)

    def _server_of(self, stream: str) -> int | None:
        """Where a refusal of ``stream``'s entries came from (a Redis Cluster's slot: one
        master may be at maxmemory while the others accept; None: one server)."""
        return self.publisher.server_of(stream)

    def _retry_refused(self, accepting: set[int | None]) -> None:
        """The Redis behind ``accepting`` takes entries again: end the backoff of the rows
        it refused earlier (they are swept at once, in key order, behind their heads)."""
        seqs: list[int] = []
        for where in accepting:
            seqs.extend(self._refused.pop(where, ()))
        if not seqs:
            return
        try:
            retried = self.store.outbox_retry_now(seqs)
        except self._infra as exc:
            report_failure(
                log, "cannot end the backoff of refused records now; they retry on their own", exc
            )
            return
        if retried:
            self._want_sweep()
            log.info(
                "Redis accepts entries again: refused records retry now",
                extra=fields(records=retried),
            )

    def record(self, outcome: Outcome, held: set[str]) -> None:
        """Write the outcome now (run_once), or hand it to the recorder thread (run)."""
        if self.recorder is None:
            record_outcome(self.store, outcome)
            return
        outcome.failed_keys = frozenset(held)
        if held:
            self.held[outcome.epoch] = outcome.failed_keys
        self.recorder.submit(outcome)

    def _unrecorded_failures(self, claimed_by_epoch: int) -> set[str]:
        """Keys that failed in batches whose outcome was not committed before this batch's
        claim started (see :class:`Recorder`)."""
        seen = self.seen_at_claim.pop(claimed_by_epoch, 0)
        if not self.held:
            return set()
        for old in [e for e in self.held if e <= seen]:
            del self.held[old]
        keys: set[str] = set()
        for failed in self.held.values():
            keys |= failed
        return keys


def _check_json(payload: str) -> None:
    try:
        json.loads(payload)
    except (TypeError, ValueError) as exc:
        raise PermanentPublishError(f"stored payload is not valid JSON: {exc}") from None


__all__ = ["BatchPublisher"]
