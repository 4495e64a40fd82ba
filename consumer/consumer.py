"""Consumers: read the relay's streams in consumer groups and deduplicate by business
identity in an inbox table, in the same transaction as the handler's work.

One batch (``run_once``), in this order:

1. Acknowledge what a previous batch committed but could not acknowledge (Redis was down).
2. Claim a dead peer's pending entries at once (XCLAIM): every consumer keeps a heartbeat key
   in Redis with a short TTL (``heartbeat_ttl_ms``, refreshed every
   ``heartbeat_interval_ms`` by a thread of its own, so a long batch does not look like
   death); a peer whose key is gone and that has not touched the group for as long is dead.
   Checked every ``heartbeat_interval_ms``. Live peers' entries are never taken early.
3. Claim back entries left pending longer than ``claim_idle_ms`` by any consumer of the
   group (XAUTOCLAIM): this one's own entries whose handler failed (that idle time is the
   retry delay), and the fallback for a peer that hangs while its heartbeat thread lives.
   Delivery counts come from XPENDING. A stream whose scan found nothing is scanned again
   after half of ``claim_idle_ms`` (at most 1 s), not on every batch: a small batch then
   costs one Redis round trip less, and an entry is claimed back at most that much later.
4. Read new entries (XREADGROUP ``>``), up to ``batch_size`` in all. The read blocks (up to
   ``block_ms``) only when nothing was claimed, and returns as soon as an entry arrives.
5. Decode; an undecodable entry (missing fields, bad JSON, and data that can never be
   stored: non-finite numbers, ``\\u0000``) is dead-lettered at once, an entry of a type
   without a handler is dead-lettered or skipped (``unknown_types``), an entry delivered
   more than ``max_deliveries`` times (its handler keeps killing processes) is
   dead-lettered.
6. ONE database transaction for the batch: the inbox rows of the batch in one statement
   (insert-or-skip, RETURNING the new identities); handlers run for new identities only,
   first all together with no savepoint, the writes they deferred (``consumer.bulk``) and
   their ORM objects flushed at the end; if one raises, the transaction is rolled back and
   the batch runs again with one savepoint per entry, so the failing entry rolls back its
   own work (and its inbox row) and the others commit. A
   failing entry at its ``max_deliveries``-th delivery is dead-lettered; before that it stays
   pending and is claimed back after ``claim_idle_ms``. Dead-letter records are written in
   the same transaction.
7. Commit, then copy dead letters to the dead-letter stream and XACK. A crash between
   commit and XACK redelivers entries whose identity is in the inbox: duplicates, skipped.

A handler may therefore run more than once for one entry (redelivery, the per-entry retry
of step 6); only its committed database work counts, which is why effects on the outside
world belong in jobs, not in handlers.

The parts: :mod:`consumer.config` (the settings), :mod:`consumer.reading` (steps 2 to 4, and
the heartbeat), :mod:`consumer.handling` (steps 5 and 6); here, the loop, step 1 and step 7.
Why it is built so, and how to use it: docs/how-to/consume.md (batches, the deduplication
window, crash recovery, dead letters).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import redis as redislib
from redis.cluster import RedisCluster
from sqlalchemy import MetaData
from sqlalchemy.engine import URL, Engine

from consumer import inbox as q
from consumer.config import DEFAULT_RETENTION_SECONDS, ConsumerConfig
from consumer.event import ConsumedEvent
from consumer.handling import BatchProcessor, ConsumerTx, Outcome
from consumer.nats_reading import NatsReader
from consumer.reading import CLUSTER_BLOCK_SLICE_MS, Entry, StreamReader
from consumer.retention import dead_letter_duty
from consumer.source import Source
from outbox.db import make_engine
from outbox.duty import Duty, weakly
from outbox.errors import ConfigError
from outbox.hooks import NO_HOOKS, Hooks, call_hook
from outbox.lifecycle import GracefulStop, incarnation_name
from outbox.logs import fields
from outbox.maintenance import PeriodicVacuum
from outbox.nats_client import broker_kind
from outbox.outage import Streak, report_failure
from outbox.redis_client import is_cluster_url, redis_client
from outbox.validate import check_name

log = logging.getLogger("outbox.consumer")

Handler = Callable[[ConsumedEvent, "ConsumerTx"], Any]
BatchHandler = Callable[[list[ConsumedEvent], "ConsumerTx"], Any]
F = TypeVar("F", bound=Callable[..., Any])


def _check_name(setting: str, value: object) -> str:
    name = check_name(setting, value, ConfigError)
    assert name is not None
    return name


class Consumer:
    """Reads streams in a consumer group and hands each new business identity to its handler
    once, in the transaction that records the identity in the inbox.

    ``database``: URL, Engine, or None (the SQLite file default). ``redis``: URL, a
    ``redislib.Redis`` client, or None (the embedded server); a Redis Cluster is a
    ``redis+cluster://`` URL naming any node, or a ``RedisCluster`` client (streams are then
    read slot by slot). ``group``: the consumer group (and the inbox's deduplication scope).
    Either ``topics`` (streams named by the ``stream`` template, default ``outbox.{topic}``)
    or ``streams`` (names). ``start``: where a group that does not exist yet begins: ``"0"``
    (default, nothing published before is missed) or ``"$"`` (only new entries).
    """

    def __init__(
        self,
        database: str | URL | Engine | None = None,
        redis: str | redislib.Redis | RedisCluster | None = None,
        *,
        group: str,
        topics: Sequence[str] | None = None,
        streams: Sequence[str] | None = None,
        stream: str = "outbox.{topic}",
        start: str = "0",
        config: ConsumerConfig | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        self.config = config if config is not None else ConsumerConfig()
        if not isinstance(self.config, ConsumerConfig):
            raise ConfigError("config", "must be a ConsumerConfig")
        self.group = _check_name("group", group)
        self.streams = self._resolve_streams(topics, streams, stream)
        if not isinstance(start, str) or not start:
            raise ConfigError("start", "must be '0', '$' or a stream entry id")
        self.start = start
        self.hooks = hooks if hooks is not None else NO_HOOKS
        if not isinstance(self.hooks, Hooks):
            raise ConfigError("hooks", "must be an outbox.hooks.Hooks")
        self._database = database
        self.engine = self._make_engine(database)
        self._redis_spec = redis
        self._redis: Any = None
        self._redis_lock = threading.Lock()
        if not (redis is None or isinstance(redis, str) or _is_redis_client(redis)):
            raise ConfigError(
                "redis", f"expected a redis URL or a redislib.Redis, got {type(redis).__name__}"
            )
        self.broker = _broker_of(redis, start)
        if self.broker == "redis" and isinstance(redis, str) and not is_cluster_url(redis):
            # Validates the URL now; the client is made on first use (a cluster client reads
            # the slot map when it is made, so it is not made here).
            redis_client(redis)
        self.tables = q.build_inbox_schema(self.config.schema)
        self.inbox = q.inbox_for(self.engine, self.tables)
        # Without autovacuum on the server, the consumer vacuums its inbox itself (every
        # inserted row is deleted by retention later: dead tuples all day). outbox.maintenance.
        self.vacuum = PeriodicVacuum.for_engine(
            self.engine, [self.inbox.inbox_table_quoted], what="inbox"
        )
        self.retention = dead_letter_duty(
            self.inbox,
            self.config.dead_letter_retention_seconds,
            interval=self.config.purge_interval_seconds,
            batch=self.config.purge_batch,
        )
        self.name = incarnation_name(self.config.name_prefix)
        self._handlers: dict[str, tuple[Callable[..., Any], bool]] = {}
        self._stop = threading.Event()
        self._schema_ready = False
        self._carry: list[Entry] = []  # a batch whose transaction failed: retried first
        self._unacked: Outcome | None = None  # committed but not yet acknowledged
        self._beating = False  # a heartbeat thread keeps the key fresh (inside run())
        # The batch loop's periodic duties (outbox.duty), besides the background vacuum and
        # dead-letter retention above: lag and stale consumers, and the inbox's retention,
        # one bounded batch per round on the loop's path (a full batch: again at once).
        # Each part calls back through weak references (outbox.duty.weakly): a consumer its
        # user drops is freed at once, with its connections, not when the cyclic collector runs.
        self._maintenance = Duty(
            "consumer maintenance",
            self.config.maintenance_interval_seconds,
            weakly(self._maintain_streams),
        )
        self._inbox_purge = Duty(
            "inbox purge",
            self.config.purge_interval_seconds,
            weakly(self._purge_round),
            retry_failed=True,
            again_in=weakly(self._purge_again_in),
        )
        # Redis (consumer.reading) and the database (consumer.handling), each its own part.
        self.reader: Source = self._source(redis)
        self.processor = BatchProcessor(
            group=self.group,
            config=self.config,
            inbox=self.inbox,
            handlers=self._handlers,
            dead_letter_stream_for=weakly(self.dead_letter_stream_for),
        )

    # -- construction helpers ---------------------------------------------------------------

    def _source(self, broker: Any) -> Source:
        """Where the batches come from: JetStream durable pull consumers for a ``nats://``
        URL (:mod:`consumer.nats_reading`), Redis consumer groups otherwise."""
        options: dict[str, Any] = {
            "group": self.group,
            "name": self.name,
            "streams": self.streams,
            "start": self.start,
            "config": self.config,
            "stop": self._stop,
        }
        if self.broker == "nats":
            return NatsReader(str(broker), **options)
        return StreamReader(weakly(self._redis_client), **options)

    @staticmethod
    def _resolve_streams(
        topics: Sequence[str] | None, streams: Sequence[str] | None, template: str
    ) -> list[str]:
        if (topics is None) == (streams is None):
            raise ConfigError("topics", "give exactly one of topics=[...] or streams=[...]")
        names = topics if topics is not None else streams
        setting = "topics" if topics is not None else "streams"
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            raise ConfigError(setting, "must be a list of names, not a single string")
        names = list(names)
        if not names:
            raise ConfigError(setting, "must not be empty")
        for name in names:
            _check_name(setting, name)
        if streams is not None:
            return list(dict.fromkeys(names))
        if not isinstance(template, str) or not template:
            raise ConfigError("stream", "must be a non-empty template")
        try:
            resolved = [template.format(topic=topic) for topic in names]
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                "stream",
                f"{template!r} may use only {{topic}} ({exc}); give streams=[...] for "
                "tenant or partition streams",
            ) from None
        return list(dict.fromkeys(resolved))

    @staticmethod
    def _make_engine(database: str | URL | Engine | None) -> Engine:
        if isinstance(database, Engine):
            return database
        if database is None or isinstance(database, (str, URL)):
            return make_engine(database)
        raise ConfigError("database", f"expected a URL or an Engine, got {type(database).__name__}")

    def with_overrides(
        self,
        *,
        database: str | URL | Engine | None = None,
        redis: str | redislib.Redis | RedisCluster | None = None,
        group: str | None = None,
        config: ConsumerConfig | None = None,
        hooks: Hooks | None = None,
        streams: Sequence[str] | None = None,
    ) -> Consumer:
        """A copy with some settings replaced and the same handlers (what the CLI's flags do;
        ``streams``: other stream names, as ``outbox.testing`` puts them under its prefix)."""
        clone = Consumer(
            database if database is not None else self._database_for_copy(),
            redis if redis is not None else self._redis_spec_for_copy(),
            group=group if group is not None else self.group,
            streams=list(streams) if streams is not None else self.streams,
            start=self.start,
            config=config if config is not None else self.config,
            hooks=hooks if hooks is not None else self.hooks,
        )
        clone._handlers.update(self._handlers)  # the clone's processor shares its dict
        return clone

    def _database_for_copy(self) -> str | URL | Engine | None:
        return self.engine if self._database is None else self._database

    def _redis_spec_for_copy(self) -> str | redislib.Redis | RedisCluster | None:
        return self._redis if self._redis is not None else self._redis_spec

    # -- public face ------------------------------------------------------------------------

    @property
    def redis(self) -> redislib.Redis:
        """The Redis client (made on first use: the embedded server starts only if needed).

        On a Redis Cluster this is a ``RedisCluster``, which has the same single-key commands
        the consumer uses (typed as ``redis.Redis`` for that reason)."""
        with self._redis_lock:  # the heartbeat thread may ask first
            if self._redis is None:
                spec = self._redis_spec
                if _is_redis_client(spec):
                    self._redis = spec
                elif isinstance(spec, str) and is_cluster_url(spec):
                    self._redis = redis_client(spec, cluster=True)
                else:
                    self._redis = redis_client(spec if isinstance(spec, str) else None)
            client: redislib.Redis = self._redis
            return client

    @property
    def cluster(self) -> bool:
        """Whether the streams live on a Redis Cluster (read slot by slot)."""
        return isinstance(self.redis, RedisCluster)

    @property
    def metadata(self) -> MetaData:
        """The MetaData of the inbox and dead-letter tables (for Alembic users)."""
        return self.tables.metadata

    def handler(self, event_type: str, *, batch: bool = False) -> Callable[[F], F]:
        """Register ``fn(event, tx)`` for ``event_type``; with ``batch=True`` the function
        gets ``fn(events, tx)`` with all new events of that type in the batch (one
        executemany for all of them is how a consumer reaches tens of thousands per second).
        """

        def register(fn: F) -> F:
            self.add_handler(event_type, fn, batch=batch)
            return fn

        return register

    def add_handler(self, event_type: str, fn: Callable[..., Any], *, batch: bool = False) -> None:
        _check_name("event_type", event_type)
        if not callable(fn):
            raise ConfigError("handler", f"{fn!r} is not callable")
        if event_type in self._handlers:
            raise ConfigError("event_type", f"{event_type!r} already has a handler")
        self._handlers[event_type] = (fn, bool(batch))

    @property
    def event_types(self) -> list[str]:
        return sorted(self._handlers)

    def create_schema(self) -> None:
        """Create the inbox and dead-letter tables if missing (idempotent)."""
        self.inbox.schema_create()
        self._schema_ready = True

    def dead_letter_stream_for(self, stream: str) -> str:
        """The dead-letter stream of ``stream``. On a Redis Cluster it shares the source
        stream's slot: when the template's name would land elsewhere (the stream has no hash
        tag), the source stream becomes its tag (``{outbox.quote}.dead-letter``)."""
        name = self.config.dead_letter_stream.format(stream=stream, group=self.group)
        return self.reader.dead_letter_name(name, stream)

    def stop(self) -> None:
        """Ask ``run()`` to finish the batch in hand and return."""
        self._stop.set()

    def run(self, stop: threading.Event | GracefulStop | None = None) -> None:
        """Run batches until ``stop()``, the given stop event, or SIGTERM/SIGINT (when no
        stop event is given and this is the main thread). Infrastructure errors (Redis or the
        database down) are logged and retried with backoff; this never returns because of
        them. On stop, the batch in hand is finished, committed and acknowledged.

        ConfigError at once, before anything starts, when no handler is registered: a
        mistake in the application that no retry mends (each batch failed with it, logged and
        retried for ever)."""
        self._check_handlers()
        graceful = GracefulStop().install() if stop is None else None
        event = stop.event if isinstance(stop, GracefulStop) else stop

        def stopping() -> bool:
            return (
                self._stop.is_set()
                or (event is not None and event.is_set())
                or (graceful is not None and graceful.stopped)
            )

        log.info(
            "consumer started",
            extra=fields(group=self.group, consumer=self.name, streams=self.streams),
        )
        beating = threading.Event()
        heart = threading.Thread(
            target=self.reader.heartbeat_loop, args=(beating,), name=f"{self.name}-heartbeat"
        )
        heart.daemon = True
        heart.start()
        self._beating = True
        try:
            self._run_batches(stopping)
        finally:
            beating.set()
            heart.join(timeout=5)
            self._beating = False
        # Whatever committed but is not acknowledged yet: one last try (harmless if it fails:
        # the entries come back as duplicates).
        if self._unacked is not None:
            try:
                self._acknowledge(self._unacked)
            except Exception as exc:
                report_failure(log, "final acknowledge failed; the entries come again", exc)
        # Gone: a peer may take whatever this consumer still has pending at once.
        self.reader.forget()
        log.info("consumer stopped", extra=fields(group=self.group, consumer=self.name))

    def _run_batches(self, stopping: Callable[[], bool]) -> None:
        attempt = 0
        # An outage is a line when it starts, one a minute while it lasts, one when it ends.
        streak = Streak(log, "consumer batch")
        while not stopping():
            try:
                self.run_once()
                attempt = 0
                streak.succeeded()
            except Exception as exc:
                delay = self.config.backoff.delay(attempt)
                attempt += 1
                streak.failed(
                    exc,
                    # A refusal of Redis (NOGROUP after a flush, ...) is no bug either.
                    expected=(redislib.RedisError,),
                    group=self.group,
                    attempt=attempt,
                    retry_in_seconds=round(delay, 3),
                )
                deadline = time.monotonic() + delay
                while not stopping() and time.monotonic() < deadline:
                    self._stop.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def run_once(self, *, block: bool = True, now: float | None = None) -> int:
        """One batch. Returns how many entries it acknowledged (handled, duplicates, dead
        letters, skipped). Raises on infrastructure errors (``run`` retries them); the batch
        is kept and retried first by the next call.

        ``now`` (unix seconds, for tests that control time): the batch runs as if it were
        then, so entries pending for ``claim_idle_ms`` by that clock are claimed back.
        Redis measures idle times on its own clock, so how far ``now`` is ahead of this
        host's comes off ``claim_idle_ms``."""
        ahead_ms = 0 if now is None else max(0, int((now - time.time()) * 1000))
        self._prepare()
        if not self._beating:
            self.reader.heartbeat.maybe_run()
        if self._unacked is not None:
            self._acknowledge(self._unacked)
            self._unacked = None
        if self._carry:
            entries, self._carry = self._carry, []
        else:
            entries = self.reader.claim(self.config.batch_size, ahead_ms=ahead_ms)
            room = self.config.batch_size - len(entries)
            if room > 0:
                entries += self.reader.read(room, block=block and not entries)
        count = 0
        if entries:
            try:
                outcome = self.processor.process(entries)
            except BaseException:
                self._carry = entries
                raise
            self._unacked = outcome
            self._acknowledge(outcome)
            self._unacked = None
            self._report(outcome)
            count = outcome.count
        self._maintain()
        self._hook("consumer_cycle_ok", time.time())
        return count

    def purge_inbox(self, *, now: datetime | None = None, max_batches: int = 10) -> int:
        """Delete this group's inbox rows older than the retention (the dedup window), in
        bounded batches; ``now`` defaults to the database clock. Returns rows deleted."""
        return self.inbox.inbox_purge(
            self.group,
            self.config.inbox_retention_seconds,
            batch=self.config.purge_batch,
            max_batches=max_batches,
            now=now,
        )

    def dead_letters(
        self, *, include_replayed: bool = False, limit: int = 100
    ) -> list[dict[str, Any]]:
        """This group's NEEDS_ATTENTION records (oldest first)."""
        return self.inbox.dead_letter_list(
            group=self.group, include_replayed=include_replayed, limit=limit
        )

    # -- setup ------------------------------------------------------------------------------

    def _prepare(self) -> None:
        if not self._schema_ready and self.config.create_schema:
            self.create_schema()
        if not self.reader.ready:
            self._check_handlers()
            self.reader.create_groups()

    def _check_handlers(self) -> None:
        if not self._handlers:
            raise ConfigError("handlers", "register at least one handler before running")

    def heartbeat_key(self, consumer: str) -> str:
        """The Redis key that says ``consumer`` of this group is alive (it expires after
        ``heartbeat_ttl_ms`` unless refreshed)."""
        return self.reader.heartbeat_key(consumer)

    # -- after commit -----------------------------------------------------------------------

    def _acknowledge(self, outcome: Outcome) -> None:
        self.reader.acknowledge(outcome, self.dead_letter_stream_for, self.group)
        for dead in outcome.dead:
            log.error(
                "entry dead-lettered",
                extra=fields(
                    group=self.group,
                    stream=dead.entry.stream,
                    entry_id=dead.entry.entry_id,
                    reason=dead.reason,
                    error=dead.error[:500],
                    record_id=outcome.dead_ids.get((dead.entry.stream, dead.entry.entry_id)),
                ),
            )

    def _report(self, outcome: Outcome) -> None:
        for stream_name, count in outcome.handled.items():
            self._hook("consumer_handled", self.group, stream_name, count)
        if outcome.duplicates:
            self._hook("consumer_duplicate", self.group, outcome.duplicates)
        dead_by_stream: dict[str, int] = {}
        for dead in outcome.first_dead():  # not those counted when first dead-lettered
            dead_by_stream[dead.entry.stream] = dead_by_stream.get(dead.entry.stream, 0) + 1
        for stream_name, count in dead_by_stream.items():
            self._hook("consumer_dead_lettered", self.group, stream_name, count)

    def _hook(self, name: str, *args: Any) -> None:
        call_hook(self.hooks, name, *args)

    # -- maintenance ------------------------------------------------------------------------

    def _maintain(self) -> None:
        now = time.monotonic()
        self._maintenance.maybe_run(now)
        if self.vacuum is not None:
            self.vacuum.maybe_start()  # background, when due and autovacuum is off
        self.retention.maybe_start()  # dead letters (consumer.retention): background, when due
        self._inbox_purge.maybe_run(now)

    def _maintain_streams(self) -> None:
        for name in self.streams:
            self._report_lag(name)
            if self.config.stale_consumer_ms is not None:
                self._remove_stale_consumers(name)

    def _purge_again_in(self, removed: int) -> float | None:
        """A full batch of the inbox purge: the next round at once."""
        return 0.0 if removed >= self.config.purge_batch else None

    def _redis_client(self) -> redislib.Redis:
        return self.redis

    def _purge_round(self) -> int:
        # One bounded batch per round, on the batch loop's path: entries arriving meanwhile
        # wait for one DELETE of purge_batch rows, not for a whole backlog.
        removed = self.purge_inbox(max_batches=1)
        if removed:
            log.info("inbox purged", extra=fields(group=self.group, rows=removed))
        return removed

    def _report_lag(self, stream: str) -> None:
        found = self.reader.lag(stream)
        if found is not None:
            self._hook("consumer_lag", self.group, stream, found[0], found[1])

    def _remove_stale_consumers(self, stream: str) -> None:
        assert self.config.stale_consumer_ms is not None
        self.reader.remove_stale(stream, self.config.stale_consumer_ms)


def _broker_of(url: object, start: str) -> str:
    """``redis`` or ``nats`` (a ``nats://`` URL), checking what only one of them takes."""
    kind = broker_kind(url) if isinstance(url, str) else "redis"
    if kind == "nats" and start not in ("0", "$"):
        raise ConfigError("start", "a NATS consumer group starts at '0' or '$'")
    return kind


def _is_redis_client(value: object) -> bool:
    return isinstance(value, (redislib.Redis, RedisCluster))


__all__ = [
    "CLUSTER_BLOCK_SLICE_MS",
    "DEFAULT_RETENTION_SECONDS",
    "ConsumedEvent",
    "Consumer",
    "ConsumerConfig",
    "ConsumerTx",
]
