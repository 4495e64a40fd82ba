"""The relay's configuration: one frozen object, validated at construction.

The command line maps flags and ``OUTBOX_*`` environment variables into it; nothing in the
relay reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outbox.backoff import Backoff
from outbox.errors import ConfigError
from outbox.validate import check_number

DEFAULT_BATCH_SIZE = 500
DEFAULT_RETENTION_SECONDS = 24 * 3600.0
DEFAULT_PARTITIONS = 16
DEFAULT_POLL_INTERVAL = 0.005
"""Seconds before the next claim after a cycle that found work (each idle cycle doubles the
wait, up to ``max_poll_interval``). Short, because the outbox table has no NOTIFY trigger by
default (issue 25: NOTIFY's commit lock halved 8 concurrent writers): while events flow,
the relay finds each within a few milliseconds of its commit, for one claim statement per
poll. The pace follows the flow (``relay.loop``): a cycle that finds fewer than ``FEW``
events doubles the wait, up to 10 x this (50 ms) while work trickles in, and one that finds
more halves it; once the flow stops, a second without work backs it off to
``max_poll_interval``."""


def _positive(name: str, value: float, *, integer: bool = False, zero: bool = False) -> None:
    check_number(name, value, ConfigError, integer=integer, zero=zero)


@dataclass(frozen=True)
class RelayConfig:
    """How one relay process claims, publishes and cleans up.

    - ``batch_size``: rows claimed and published per cycle (one claim statement, one XADD
      pipeline, one receipt statement).
    - ``partitions``: PostgreSQL only. Keys are split into this many partitions by
      ``key_hash % partitions``; each partition is owned by one replica at a time (see
      :mod:`relay.store`). Every replica of one outbox must use the same number.
    - ``poll_interval`` / ``max_poll_interval``: adaptive polling. After a cycle that found
      a few events (4 or more) the relay polls again ``poll_interval`` (5 ms) after that
      cycle began; a cycle that found fewer doubles the wait up to 4 x ``poll_interval``
      while work flows; a second without work doubles it up to ``max_poll_interval`` (1 s).
    - ``listen``: PostgreSQL: LISTEN on a table that has the NOTIFY trigger (``init-db
      --notify``), so a commit wakes the relay at once; the polling goes on beside it.
    - ``retention_seconds`` / ``retention_batch`` / ``retention_interval``: published rows
      older than ``retention_seconds`` are deleted, in batches of ``retention_batch`` rows,
      every ``retention_interval`` seconds. ``0`` disables retention. Quarantined rows are
      never deleted.
    - ``publish_deadline`` / ``clock_margin``: a claimed batch must reach Redis within
      ``publish_deadline`` seconds of its claim, or the relay does not send it (it is left
      for reconciliation). Together with ``clock_margin`` (allowed disagreement between the
      database and Redis clocks, and network delay) it bounds where an orphaned intent's
      entry can be in the stream, and how long another replica waits before reconciling it.
    - ``record_backoff``: per-record retry delays after transient failures (full jitter).
    - ``outage_backoff``: the loop's own waits while the database or Redis is down.
    - ``vacuum_interval``: PostgreSQL, only when the server runs without autovacuum
      (``autovacuum = off``): the relay owning partition 0 vacuums the table this often, on
      its own connection, so the dead tuples that receipts leave do not pile up. ``0``
      never. With autovacuum on, the table's own autovacuum settings do this job.
    - ``progress_interval``: seconds between structured progress log lines.
    - ``rebalance_interval``: seconds between partition ownership checks.
    - ``redis_check_interval``: seconds between the checks of Redis's persistence and of
      the marker that reveals lost entries (also run at start, and at once when a batch is
      refused because the marker is behind; see :mod:`relay.redis.health`).
    - ``auto_republish``: when Redis lost entries, republish the lost window by itself
      (``outbox-relay republish``'s work) before publishing anything new; otherwise log the
      command to run and raise ``OutboxRedisDataLoss``.
    - ``name_prefix``: the relay's name (its intents' ``claimed_by``) is
      ``<prefix>-<host>-<pid>-<random>``, fresh per process.
    - ``wait_replicas`` / ``wait_timeout``: after each batch's script, ``WAIT
      wait_replicas`` on the connection that ran it (on a cluster: on each master's), and
      only then record receipts; the reconciliation's fences are confirmed the same way
      before it trusts what it finds. Redis replicates asynchronously, so without it a
      failover to a replica that had not yet received an acknowledged batch loses it. A
      batch not confirmed within ``wait_timeout`` seconds is treated like a connection
      error: its intents are kept and reconciled against the stream, never assumed
      published. ``0`` (default): no waiting.
    - ``sweep_interval``: PostgreSQL: the longest time between claims that scan pending
      rows from the very first one. Ordinary claims start near where the last one ended (see
      :mod:`relay.store`); a sweep also runs at once after a failure, a reconciliation, a
      partition take-over, or a ``requeue`` (which notifies the relays).
    """

    batch_size: int = DEFAULT_BATCH_SIZE
    partitions: int = DEFAULT_PARTITIONS
    poll_interval: float = DEFAULT_POLL_INTERVAL
    max_poll_interval: float = 1.0
    listen: bool = True
    retention_seconds: float = DEFAULT_RETENTION_SECONDS
    retention_batch: int = 1000
    retention_interval: float = 60.0
    publish_deadline: float = 2.0
    clock_margin: float = 1.0
    record_backoff: Backoff = field(default_factory=lambda: Backoff(0.25, 60.0))
    outage_backoff: Backoff = field(default_factory=lambda: Backoff(0.2, 10.0))
    vacuum_interval: float = 30.0
    progress_interval: float = 10.0
    rebalance_interval: float = 1.0
    sweep_interval: float = 30.0
    redis_check_interval: float = 60.0
    auto_republish: bool = False
    name_prefix: str = "relay"
    wait_replicas: int = 0
    wait_timeout: float = 1.0

    def __post_init__(self) -> None:
        _positive("batch_size", self.batch_size, integer=True)
        if self.batch_size > 10_000:
            raise ConfigError("batch_size", f"must be at most 10000, got {self.batch_size}")
        _positive("partitions", self.partitions, integer=True)
        if self.partitions > 4096:
            raise ConfigError("partitions", f"must be at most 4096, got {self.partitions}")
        _positive("poll_interval", self.poll_interval)
        _positive("max_poll_interval", self.max_poll_interval)
        if self.max_poll_interval < self.poll_interval:
            raise ConfigError("max_poll_interval", "must be at least poll_interval")
        _positive("retention_seconds", self.retention_seconds, zero=True)
        _positive("retention_batch", self.retention_batch, integer=True)
        _positive("retention_interval", self.retention_interval)
        _positive("publish_deadline", self.publish_deadline)
        _positive("clock_margin", self.clock_margin, zero=True)
        _positive("vacuum_interval", self.vacuum_interval, zero=True)
        _positive("progress_interval", self.progress_interval)
        _positive("rebalance_interval", self.rebalance_interval)
        _positive("sweep_interval", self.sweep_interval)
        _positive("wait_replicas", self.wait_replicas, integer=True, zero=True)
        _positive("wait_timeout", self.wait_timeout)
        _positive("redis_check_interval", self.redis_check_interval)
        if not isinstance(self.auto_republish, bool):
            raise ConfigError("auto_republish", "must be a bool")
        for name in ("record_backoff", "outage_backoff"):
            if not isinstance(getattr(self, name), Backoff):
                raise ConfigError(name, "must be an outbox.backoff.Backoff")
        if not isinstance(self.listen, bool):
            raise ConfigError("listen", "must be a bool")

    @property
    def reconcile_after(self) -> float:
        """Seconds after a claim when its intent may be reconciled by anyone."""
        return self.publish_deadline + self.clock_margin
