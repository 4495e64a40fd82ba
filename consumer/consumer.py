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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeVar

import redis as redislib
from redis.cluster import RedisCluster
from sqlalchemy import MetaData, Table
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from consumer import inbox as q
from consumer.bulk import bulk_insert, defer_writes, discard_deferred, flush_deferred
from consumer.errors import UndecodableEntry
from consumer.event import ConsumedEvent, decode_entry, text_fields
from consumer.retention import dead_letter_duty
from outbox import tracing
from outbox.backoff import Backoff
from outbox.db import make_engine
from outbox.errors import ConfigError
from outbox.hooks import NO_HOOKS, Hooks, call_hook
from outbox.lifecycle import GracefulStop, incarnation_name
from outbox.logs import fields
from outbox.maintenance import PeriodicVacuum
from outbox.outage import is_outage
from outbox.redis_client import in_slot_of, is_cluster_url, redis_client, slot_of
from outbox.retention import DEFAULT_DEAD_LETTER_RETENTION, check_seconds
from outbox.schema import check_identifier
from outbox.validate import check_name

log = logging.getLogger("outbox.consumer")

Handler = Callable[[ConsumedEvent, "ConsumerTx"], Any]
BatchHandler = Callable[[list[ConsumedEvent], "ConsumerTx"], Any]
F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0

CLUSTER_BLOCK_SLICE_MS = 50
"""On a Redis Cluster with streams in several slots, the longest a blocking read waits on one
slot while entries may arrive in another: the latency it can add to an entry."""


def _positive_int(name: str, value: object, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(
            name, f"must be {'non-negative' if allow_zero else 'positive'}, got {value}"
        )


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a number, got {type(value).__name__}")
    if not value > 0:
        raise ConfigError(name, f"must be positive, got {value}")


@dataclass(frozen=True)
class ConsumerConfig:
    """How a consumer reads, retries and gives up. Validated at construction.

    - ``batch_size``: entries per batch (XREADGROUP COUNT) and per database transaction.
    - ``block_ms``: how long a read waits for new entries; also bounds how long SIGTERM
      waits. Keep it below the Redis client's socket timeout (10 s by default).
    - ``claim_idle_ms``: an entry pending this long is claimed back: a failed handler's
      retry delay, and the fallback for a peer that hangs with its heartbeat alive.
    - ``heartbeat_ttl_ms``: the TTL of this consumer's heartbeat key; a peer whose key is
      gone (and idle as long) is dead, and its pending entries are claimed at once. This
      bounds recovery from a killed consumer: about ``heartbeat_ttl_ms`` +
      ``heartbeat_interval_ms``.
    - ``heartbeat_interval_ms``: how often the key is refreshed and dead peers looked for
      (below ``heartbeat_ttl_ms``).
    - ``max_deliveries``: deliveries after which a failing entry is dead-lettered.
    - ``inbox_retention_seconds``: the deduplication window: inbox rows older than this are
      purged, after which a redelivered identity would be handled again. Default 7 days.
    - ``dead_letter_stream``: template of the dead-letter stream (``{stream}``, ``{group}``).
    - ``unknown_types``: ``"dead_letter"`` (default: nothing is dropped silently) or
      ``"skip"`` (acknowledge and log, for streams that carry types this group ignores).
    - ``name_prefix``: the consumer name is ``<prefix>-<host>-<pid>-<random>``, fresh per
      process, so a restart never inherits a dead incarnation's pending entries by name.
    - ``stale_consumer_ms``: consumers of the group idle this long with nothing pending are
      removed (XGROUP DELCONSUMER); None keeps them.
    - ``purge_interval_seconds`` / ``purge_batch``: how often inbox retention runs, and how
      many rows one cycle deletes at most (a full batch purges again the next cycle).
    - ``dead_letter_retention_seconds``: replayed dead letters go this long after their
      replay (default 30 days, 0 never; ``consumer.retention``); unreplayed ones stay.
    - ``maintenance_interval_seconds``: how often lag is reported and stale consumers swept.
    - ``schema``: database schema of the consumer tables (None: the default search path).
    - ``create_schema``: create the tables on first use (idempotent).
    """

    batch_size: int = 500
    block_ms: int = 1000
    claim_idle_ms: int = 30_000
    heartbeat_ttl_ms: int = 3_000
    heartbeat_interval_ms: int = 1_000
    max_deliveries: int = 5
    inbox_retention_seconds: float = DEFAULT_RETENTION_SECONDS
    dead_letter_stream: str = "{stream}.dead-letter"
    unknown_types: Literal["dead_letter", "skip"] = "dead_letter"
    name_prefix: str = "consumer"
    stale_consumer_ms: int | None = 3_600_000
    purge_interval_seconds: float = 60.0
    purge_batch: int = 1000
    dead_letter_retention_seconds: float = DEFAULT_DEAD_LETTER_RETENTION
    maintenance_interval_seconds: float = 5.0
    schema: str | None = None
    create_schema: bool = True
    backoff: Backoff = field(default_factory=lambda: Backoff(0.2, 10.0))

    def __post_init__(self) -> None:
        _positive_int("batch_size", self.batch_size)
        _positive_int("block_ms", self.block_ms)
        _positive_int("claim_idle_ms", self.claim_idle_ms, allow_zero=True)
        _positive_int("heartbeat_ttl_ms", self.heartbeat_ttl_ms)
        _positive_int("heartbeat_interval_ms", self.heartbeat_interval_ms)
        if self.heartbeat_interval_ms >= self.heartbeat_ttl_ms:
            raise ConfigError(
                "heartbeat_interval_ms",
                f"must be below heartbeat_ttl_ms ({self.heartbeat_ttl_ms}), got "
                f"{self.heartbeat_interval_ms}: the key would expire between two beats",
            )
        _positive_int("max_deliveries", self.max_deliveries)
        _positive_number("inbox_retention_seconds", self.inbox_retention_seconds)
        _positive_number("purge_interval_seconds", self.purge_interval_seconds)
        _positive_int("purge_batch", self.purge_batch)
        check_seconds("dead_letter_retention_seconds", self.dead_letter_retention_seconds)
        _positive_number("maintenance_interval_seconds", self.maintenance_interval_seconds)
        if self.stale_consumer_ms is not None:
            _positive_int("stale_consumer_ms", self.stale_consumer_ms)
        if self.unknown_types not in ("dead_letter", "skip"):
            raise ConfigError(
                "unknown_types", f"must be 'dead_letter' or 'skip', got {self.unknown_types!r}"
            )
        if not isinstance(self.name_prefix, str) or not self.name_prefix.strip():
            raise ConfigError("name_prefix", "must be a non-empty string")
        if not isinstance(self.dead_letter_stream, str) or not self.dead_letter_stream:
            raise ConfigError("dead_letter_stream", "must be a non-empty template")
        try:
            self.dead_letter_stream.format(stream="s", group="g")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                "dead_letter_stream",
                f"{self.dead_letter_stream!r}: use only {{stream}} and {{group}} ({exc})",
            ) from None
        if not isinstance(self.backoff, Backoff):
            raise ConfigError("backoff", "must be an outbox.backoff.Backoff")
        check_identifier("schema", self.schema, optional=True)


@dataclass
class ConsumerTx:
    """The transaction a handler runs in: ``session`` is the one the inbox row is written in
    (inside a savepoint of the batch's transaction). Never commit or roll it back yourself:
    raise to roll back your entry, return to keep its work.

    Writes made the natural way are batched for you: ``Store.enqueue(..., session=
    tx.session)`` is buffered and written in one statement with the rest of the batch's
    (``consumer.bulk``'s deferred writes), and ``tx.session.add(obj)`` ORM objects are
    flushed together (SQLAlchemy's insertmanyvalues) at the end of the handlers."""

    session: Session
    group: str

    @property
    def connection(self) -> Connection:
        """The session's Connection, for Core statements."""
        return self.session.connection()

    def insert_many(
        self,
        table: Table,
        rows: Sequence[Mapping[str, Any]],
        *,
        conflict: Sequence[str] | None = None,
        returning: str | None = None,
    ) -> list[Any]:
        """Insert ``rows`` into ``table`` in ONE statement in this transaction (binary
        ``unnest`` arrays on PostgreSQL): the fast path for a batch handler that creates a
        job per event. ``conflict`` columns skip colliding rows; ``returning`` names a
        column to return for the inserted rows."""
        return bulk_insert(self.connection, table, rows, conflict=conflict, returning=returning)


@dataclass
class _Entry:
    stream: str
    entry_id: str
    raw: Mapping[Any, Any] | None
    deliveries: int


@dataclass
class _Dead:
    entry: _Entry
    reason: str
    error: str
    event: ConsumedEvent | None = None


@dataclass
class _Outcome:
    acks: dict[str, list[str]] = field(default_factory=dict)
    handled: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    dead: list[_Dead] = field(default_factory=list)
    dead_ids: dict[tuple[str, str], int] = field(default_factory=dict)

    def ack(self, entry: _Entry) -> None:
        self.acks.setdefault(entry.stream, []).append(entry.entry_id)

    def copy(self) -> _Outcome:
        return _Outcome(
            acks={stream: list(ids) for stream, ids in self.acks.items()},
            handled=dict(self.handled),
            duplicates=self.duplicates,
            dead=list(self.dead),
            dead_ids=dict(self.dead_ids),
        )

    @property
    def count(self) -> int:
        return sum(len(ids) for ids in self.acks.values())


class _HandlersFailed(Exception):
    """The optimistic pass over a batch's handlers (no savepoint) raised ``error``: the
    transaction is rolled back and the batch runs again, a savepoint per entry. ``only``:
    the entry's key when the pass had one entry (it is not run a second time)."""

    def __init__(self, error: Exception, only: str | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.only = only


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
        if isinstance(redis, str) and not is_cluster_url(redis):
            # Validates the URL now; the client is made on first use (a cluster client reads
            # the slot map when it is made, so it is not made here).
            redis_client(redis)
        self.tables = q.build_inbox_schema(self.config.schema)
        self.inbox = q.inbox_for(self.engine, self.tables)
        # Without autovacuum on the server, the consumer vacuums its inbox itself (every
        # inserted row is deleted by retention later: dead tuples all day). outbox.maintenance.
        self.vacuum = PeriodicVacuum.for_engine(self.engine, [self.inbox.hot_table], what="inbox")
        self.retention = dead_letter_duty(
            self.inbox,
            self.config.dead_letter_retention_seconds,
            interval=self.config.purge_interval_seconds,
            batch=self.config.purge_batch,
        )
        self.name = incarnation_name(self.config.name_prefix)
        self._handlers: dict[str, tuple[Callable[..., Any], bool]] = {}
        self._stop = threading.Event()
        self._ready = False
        self._schema_ready = False
        self._cursors: dict[str, str] = {}
        self._next_autoclaim: dict[str, float] = {}  # per stream: its last scan was empty
        self._carry: list[_Entry] = []  # a batch whose transaction failed: retried first
        self._unacked: _Outcome | None = None  # committed but not yet acknowledged
        self._next_maintenance = 0.0
        self._next_beat = 0.0
        self._next_liveness_check = 0.0
        self._beating = False  # a heartbeat thread keeps the key fresh (inside run())
        self._next_purge = 0.0
        self._groups: list[list[str]] | None = None  # streams per XREADGROUP (slots)
        self._block_turn = 0
        self._ahead_ms = 0  # run_once(now=): how far the caller's clock is ahead of ours

    # -- construction helpers ---------------------------------------------------------------

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
    ) -> Consumer:
        """A copy with some settings replaced and the same handlers (what the CLI's flags do)."""
        clone = Consumer(
            database if database is not None else self._database_for_copy(),
            redis if redis is not None else self._redis_spec_for_copy(),
            group=group if group is not None else self.group,
            streams=self.streams,
            start=self.start,
            config=config if config is not None else self.config,
            hooks=hooks if hooks is not None else self.hooks,
        )
        clone._handlers = dict(self._handlers)
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
        if isinstance(self._redis, RedisCluster):
            return in_slot_of(name, stream)
        return name

    def stop(self) -> None:
        """Ask ``run()`` to finish the batch in hand and return."""
        self._stop.set()

    def run(self, stop: threading.Event | GracefulStop | None = None) -> None:
        """Run batches until ``stop()``, the given stop event, or SIGTERM/SIGINT (when no
        stop event is given and this is the main thread). Infrastructure errors (Redis or the
        database down) are logged and retried with backoff; this never returns because of
        them. On stop, the batch in hand is finished, committed and acknowledged."""
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
            target=self._heartbeat_loop, args=(beating,), name=f"{self.name}-heartbeat"
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
                log.warning("final acknowledge failed", extra=fields(error=str(exc)))
        # Gone: a peer may take whatever this consumer still has pending at once.
        try:
            self.redis.delete(self.heartbeat_key(self.name))
        except redislib.RedisError as exc:
            log.warning("heartbeat key not removed", extra=fields(error=str(exc)))
        log.info("consumer stopped", extra=fields(group=self.group, consumer=self.name))

    def _run_batches(self, stopping: Callable[[], bool]) -> None:
        attempt = 0
        while not stopping():
            try:
                self.run_once()
                attempt = 0
            except Exception as exc:
                delay = self.config.backoff.delay(attempt)
                attempt += 1
                log.warning(
                    "consumer batch failed, retrying",
                    # An outage is one line (the error names it); anything else is a bug.
                    exc_info=not (is_outage(exc) or isinstance(exc, redislib.RedisError)),
                    extra=fields(
                        group=self.group,
                        error=f"{type(exc).__name__}: {exc}",
                        attempt=attempt,
                        retry_in_seconds=round(delay, 3),
                    ),
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
        self._ahead_ms = 0 if now is None else max(0, int((now - time.time()) * 1000))
        self._prepare()
        if not self._beating and time.monotonic() >= self._next_beat:
            self._beat()
        if self._unacked is not None:
            self._acknowledge(self._unacked)
            self._unacked = None
        if self._carry:
            entries, self._carry = self._carry, []
        else:
            entries = self._claim(self.config.batch_size)
            room = self.config.batch_size - len(entries)
            if room > 0:
                entries += self._read(room, block=block and not entries)
        count = 0
        if entries:
            try:
                outcome = self._process(entries)
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
        if not self._ready:
            if not self._handlers:
                raise ConfigError("handlers", "register at least one handler before running")
            for name in self.streams:
                self._create_group(name)
            self._ready = True

    def _create_group(self, stream: str) -> None:
        try:
            # MKSTREAM: a stream nobody has published to yet is created empty, so the group
            # exists from the start and the first entry published is not missed.
            self.redis.xgroup_create(stream, self.group, id=self.start, mkstream=True)
            log.info(
                "consumer group created",
                extra=fields(group=self.group, stream=stream, start=self.start),
            )
        except redislib.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _on_nogroup(self, exc: redislib.ResponseError) -> None:
        # The stream (with its group) was deleted under us: create them again next time.
        if "NOGROUP" in str(exc):
            self._ready = False
            self._cursors.clear()
            self._next_autoclaim.clear()

    # -- liveness ---------------------------------------------------------------------------

    def heartbeat_key(self, consumer: str) -> str:
        """The Redis key that says ``consumer`` of this group is alive (it expires after
        ``heartbeat_ttl_ms`` unless refreshed)."""
        return f"outbox:consumer-alive:{self.group}:{consumer}"

    def _beat(self) -> None:
        self._next_beat = time.monotonic() + self.config.heartbeat_interval_ms / 1000
        self.redis.set(
            self.heartbeat_key(self.name),
            str(int(time.time() * 1000)),
            px=self.config.heartbeat_ttl_ms,
        )

    def _heartbeat_loop(self, done: threading.Event) -> None:
        """Inside ``run()``: keep the key fresh whatever the batch loop is doing (a long
        batch, a database outage), so only a dead process loses it."""
        failing = False
        while True:
            try:
                self._beat()
                failing = False
            except Exception as exc:
                if not failing:  # once per outage, not once per beat
                    log.warning("heartbeat failed", extra=fields(group=self.group, error=str(exc)))
                failing = True
            if done.wait(self.config.heartbeat_interval_ms / 1000):
                return

    def _claim_from_dead(self, room: int) -> list[_Entry]:
        """Claim the pending entries of peers whose heartbeat key is gone, at most every
        ``heartbeat_interval_ms``.

        A peer is dead when its key is gone AND it has not touched the group (XINFO
        CONSUMERS ``idle``) for ``heartbeat_ttl_ms``: the second condition spares a peer
        that has just started. XCLAIM's ``min-idle-time`` (one heartbeat interval) makes the
        claim a compare-and-set: of two survivors claiming together, one gets each entry.
        """
        now = time.monotonic()
        if now < self._next_liveness_check:
            return []
        self._next_liveness_check = now + self.config.heartbeat_interval_ms / 1000
        claimed: list[_Entry] = []
        for stream in self.streams:
            if room - len(claimed) <= 0:
                break
            try:
                infos = self.redis.xinfo_consumers(stream, self.group)
            except redislib.ResponseError as exc:
                self._on_nogroup(exc)
                raise
            suspects = [
                _text(info.get("name"))
                for info in infos
                if _text(info.get("name")) != self.name
                and int(info.get("pending") or 0) > 0
                and int(info.get("idle") or 0) >= self.config.heartbeat_ttl_ms
            ]
            if not suspects:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for name in suspects:
                pipe.exists(self.heartbeat_key(name))
            alive = pipe.execute()
            for name, present in zip(suspects, alive, strict=True):
                if present or room - len(claimed) <= 0:
                    continue
                claimed += self._take_over(stream, name, room - len(claimed))
        return claimed

    def _take_over(self, stream: str, dead: str, room: int) -> list[_Entry]:
        pending = self.redis.xpending_range(
            stream, self.group, min="-", max="+", count=room, consumername=dead
        )
        if not pending:
            return []
        deliveries = {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        reply: Any = self.redis.xclaim(
            stream,
            self.group,
            self.name,
            min_idle_time=self.config.heartbeat_interval_ms,
            message_ids=list(deliveries),
        )
        entries = [
            # XCLAIM counts this delivery too.
            _Entry(stream, _text(eid), raw, deliveries.get(_text(eid), 0) + 1)
            for eid, raw in reply
        ]
        log.warning(
            "claimed a dead consumer's pending entries",
            extra=fields(group=self.group, stream=stream, dead=dead, count=len(entries)),
        )
        return entries

    # -- reading ----------------------------------------------------------------------------

    def _claim(self, room: int) -> list[_Entry]:
        claimed = self._claim_from_dead(room)
        taken = {(entry.stream, entry.entry_id) for entry in claimed}
        now = time.monotonic() + self._ahead_ms / 1000
        for name in self.streams:
            if room - len(claimed) <= 0:
                break
            if now < self._next_autoclaim.get(name, 0.0):
                continue
            try:
                reply = self.redis.xautoclaim(
                    name,
                    self.group,
                    self.name,
                    min_idle_time=max(0, self.config.claim_idle_ms - self._ahead_ms),
                    start_id=self._cursors.get(name, "0-0"),
                    count=room - len(claimed),
                )
            except redislib.ResponseError as exc:
                self._on_nogroup(exc)
                raise
            self._cursors[name] = _text(reply[0])
            entries = [(_text(eid), raw) for eid, raw in reply[1]]
            if not entries and self._cursors[name] == "0-0":
                # The whole pending list was scanned and nothing was idle long enough.
                self._next_autoclaim[name] = now + self._autoclaim_pause
            entries = [(eid, raw) for eid, raw in entries if (name, eid) not in taken]
            if not entries:
                continue
            # XAUTOCLAIM does not say how often an entry was delivered; XPENDING does.
            pipe = self.redis.pipeline(transaction=False)
            for eid, _raw in entries:
                pipe.xpending_range(name, self.group, min=eid, max=eid, count=1)
            counts = pipe.execute()
            for (eid, raw), info in zip(entries, counts, strict=True):
                deliveries = int(info[0]["times_delivered"]) if info else 1
                claimed.append(_Entry(name, eid, raw, deliveries))
            log.info(
                "claimed pending entries",
                extra=fields(group=self.group, stream=name, count=len(entries)),
            )
        return claimed

    @property
    def _autoclaim_pause(self) -> float:
        return min(self.config.claim_idle_ms / 2, 1000) / 1000

    def _read(self, room: int, *, block: bool) -> list[_Entry]:
        groups = self._slot_groups()
        if len(groups) == 1:
            return self._read_streams(groups[0], room, self.config.block_ms if block else None)
        # A Redis Cluster reads the streams of one slot per XREADGROUP, and one blocking read
        # can wait on one slot only: an entry arriving in another slot would wait for that
        # block to end. So: every slot without blocking; when all were empty, block on one
        # slot (in turn) for at most CLUSTER_BLOCK_SLICE_MS, and again, until block_ms is
        # spent. An entry in any slot waits at most one slice (a few reads a second per slot
        # while the consumer is idle, instead of up to block_ms of added latency).
        deadline = time.monotonic() + (self.config.block_ms / 1000 if block else 0.0)
        while True:
            entries: list[_Entry] = []
            for names in groups:
                if room - len(entries) <= 0:
                    break
                entries.extend(self._read_streams(names, room - len(entries), None))
            left_ms = int((deadline - time.monotonic()) * 1000)
            if entries or left_ms <= 0 or self._stop.is_set():
                return entries
            self._block_turn = (self._block_turn + 1) % len(groups)
            slice_ms = max(1, min(left_ms, CLUSTER_BLOCK_SLICE_MS))
            entries = self._read_streams(groups[self._block_turn], room, slice_ms)
            if entries:
                return entries

    def _slot_groups(self) -> list[list[str]]:
        """The streams grouped so that one XREADGROUP may name each group: all of them on one
        server; per hash slot on a cluster (a command may not span slots there)."""
        if self._groups is None:
            if self.cluster:
                by_slot: dict[int, list[str]] = {}
                for name in self.streams:
                    by_slot.setdefault(slot_of(name), []).append(name)
                self._groups = list(by_slot.values())
            else:
                self._groups = [list(self.streams)]
        return self._groups

    def _read_streams(self, names: list[str], room: int, block_ms: int | None) -> list[_Entry]:
        try:
            reply: Any = self.redis.xreadgroup(
                self.group,
                self.name,
                {name: ">" for name in names},
                count=room,
                block=block_ms,
            )
        except redislib.ResponseError as exc:
            self._on_nogroup(exc)
            raise
        entries: list[_Entry] = []
        for stream_name, items in reply or []:
            name = _text(stream_name)
            entries.extend(_Entry(name, _text(eid), raw, 1) for eid, raw in items)
        return entries

    # -- processing -------------------------------------------------------------------------

    def _process(self, entries: list[_Entry]) -> _Outcome:
        outcome = _Outcome()
        events: list[tuple[_Entry, ConsumedEvent]] = []
        for entry in entries:
            if not entry.raw:
                # Deleted (trimmed) while pending: nothing left to handle.
                log.warning(
                    "pending entry no longer exists",
                    extra=fields(group=self.group, stream=entry.stream, entry_id=entry.entry_id),
                )
                outcome.ack(entry)
                continue
            try:
                event = decode_entry(entry.stream, entry.entry_id, entry.raw, entry.deliveries)
            except UndecodableEntry as exc:
                outcome.dead.append(_Dead(entry, q.UNDECODABLE, str(exc)))
                continue
            if event.type not in self._handlers:
                if self.config.unknown_types == "skip":
                    log.info(
                        "no handler for event type, skipped",
                        extra=fields(group=self.group, type=event.type, entry_id=entry.entry_id),
                    )
                    outcome.ack(entry)
                else:
                    error = f"no handler for event type {event.type!r} in group {self.group!r}"
                    outcome.dead.append(_Dead(entry, q.UNKNOWN_TYPE, error, event))
                continue
            events.append((entry, event))

        # Optimistic: the handlers run without a savepoint. If one raises, the transaction
        # is rolled back and the batch runs again with a savepoint per entry.
        decoded = outcome.copy()
        try:
            self._transact(events, outcome, None)
        except _HandlersFailed as failed:
            outcome = decoded
            self._transact(events, outcome, failed)
        for dead in outcome.dead:
            outcome.ack(dead.entry)
        return outcome

    def _transact(
        self,
        events: list[tuple[_Entry, ConsumedEvent]],
        outcome: _Outcome,
        failed: _HandlersFailed | None,
    ) -> None:
        session = self.inbox.session()
        defer_writes(session)
        try:
            with session.begin():
                conn = session.connection()
                self._deduplicate_and_handle(session, conn, events, outcome, failed)
                if outcome.dead:
                    outcome.dead_ids = self.inbox.dead_letter_insert(
                        conn, [self._dead_row(d) for d in outcome.dead]
                    )
        finally:
            session.close()

    def _deduplicate_and_handle(
        self,
        session: Session,
        conn: Connection,
        events: list[tuple[_Entry, ConsumedEvent]],
        outcome: _Outcome,
        failed: _HandlersFailed | None,
    ) -> None:
        if not events:
            return
        # The first entry of an identity in the batch is the candidate; later ones in the
        # same batch wait for its outcome.
        first: dict[str, tuple[_Entry, ConsumedEvent]] = {}
        later: list[tuple[_Entry, ConsumedEvent]] = []
        for pair in events:
            if pair[1].identity in first:
                later.append(pair)
            else:
                first[pair[1].identity] = pair
        # Entries delivered too often are suspected of killing their consumers: do not run
        # them again (unless already handled: then they are mere duplicates).
        worn = {i: p for i, p in first.items() if p[1].deliveries > self.config.max_deliveries}
        if worn:
            seen = self.inbox.inbox_seen(conn, self.group, list(worn))
            for identity, (entry, event) in worn.items():
                del first[identity]
                if identity in seen:
                    outcome.duplicates += 1
                    tracing.duplicate(event, self.group)
                    outcome.ack(entry)
                else:
                    error = (
                        f"delivered {entry.deliveries} times, more than max_deliveries="
                        f"{self.config.max_deliveries} (its consumers died or failed)"
                    )
                    outcome.dead.append(_Dead(entry, q.POISON, error, event))
        rows = [
            {
                "group_name": self.group,
                "identity": identity,
                "event_id": event.id,
                "topic": event.type,
                "stream": entry.stream,
                "entry_id": entry.entry_id,
            }
            for identity, (entry, event) in sorted(first.items())
        ]
        new = self.inbox.inbox_insert(conn, rows)
        fresh: list[tuple[_Entry, ConsumedEvent]] = []
        for identity, (entry, event) in first.items():
            if identity in new:
                fresh.append((entry, event))
            else:
                outcome.duplicates += 1
                tracing.duplicate(event, self.group)
                outcome.ack(entry)
        failures = self._handle(session, [event for _entry, event in fresh], failed)
        failed_identities: set[str] = set()
        for entry, event in fresh:
            exc = failures.get(_key(event))
            if exc is None:
                outcome.ack(entry)
                outcome.handled[entry.stream] = outcome.handled.get(entry.stream, 0) + 1
                continue
            failed_identities.add(event.identity)
            self.inbox.inbox_delete(conn, self.group, [event.identity])
            error = f"{type(exc).__name__}: {exc}"
            if entry.deliveries >= self.config.max_deliveries:
                outcome.dead.append(_Dead(entry, q.POISON, error, event))
                log.error(
                    "handler failed, dead-lettered",
                    extra=fields(
                        group=self.group,
                        stream=entry.stream,
                        entry_id=entry.entry_id,
                        deliveries=entry.deliveries,
                        error=error,
                    ),
                )
            else:
                log.warning(
                    "handler failed, will retry",
                    extra=fields(
                        group=self.group,
                        stream=entry.stream,
                        entry_id=entry.entry_id,
                        deliveries=entry.deliveries,
                        error=error,
                    ),
                )
        for entry, event in later:
            if event.identity in failed_identities:
                continue  # its twin failed: stays pending, claimed back and retried later
            outcome.duplicates += 1
            tracing.duplicate(event, self.group)
            outcome.ack(entry)

    def _handle(
        self, session: Session, events: list[ConsumedEvent], failed: _HandlersFailed | None
    ) -> dict[str, BaseException]:
        """Run the handlers of ``events``; return the failures by entry key.

        First pass (``failed`` is None), optimistic: all of them together, with no savepoint,
        their deferred writes (``consumer.bulk``: ``Store.enqueue(..., session=tx.session)``)
        and ORM objects (``tx.session.add``: insertmanyvalues) flushed once at the end. If a
        handler or that flush raises, :class:`_HandlersFailed` rolls the whole transaction
        back and the batch runs again (``failed`` given): each entry in a savepoint of its
        own, so only the failing ones lose their work. Savepoints are paid when a handler
        fails, never on the happy path. A batch whose one handler failed is not run again.
        """
        if not events:
            return {}
        tx = ConsumerTx(session=session, group=self.group)
        if failed is None:
            try:
                self._run(session, events, tx)
            except Exception as exc:
                raise _HandlersFailed(exc, _key(events[0]) if len(events) == 1 else None) from exc
            return {}
        if len(events) == 1 and failed.only == _key(events[0]):
            return {failed.only: failed.error}
        failures: dict[str, BaseException] = {}
        for event in events:
            failure = self._attempt(session, [event], tx)
            if failure is not None:
                failures[_key(event)] = failure
        return failures

    def _attempt(
        self, session: Session, events: list[ConsumedEvent], tx: ConsumerTx
    ) -> Exception | None:
        """Run ``events``' handlers and write what they buffered, in one savepoint: None if
        it was released, else the exception that rolled it back."""
        savepoint = session.begin_nested()
        try:
            self._run(session, events, tx)
        except Exception as exc:
            savepoint.rollback()  # raises if the connection itself is gone: batch retried
            return exc
        savepoint.commit()
        return None

    def _run(self, session: Session, events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        """Call ``events``' handlers, then write what they deferred and their ORM objects; if
        anything raises, what they buffered is dropped and the exception goes on."""
        try:
            self._call(events, tx)
            flush_deferred(session)
            session.flush()
        except Exception:
            discard_deferred(session)
            raise

    def _call(self, events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        batch: dict[str, list[ConsumedEvent]] = {}
        for event in events:
            fn, is_batch = self._handlers[event.type]
            if is_batch:
                batch.setdefault(event.type, []).append(event)
            else:
                with tracing.consuming(event, self.group):  # the event's trace goes on
                    fn(event, tx)
        for event_type, group in batch.items():
            with tracing.consuming_batch(group, self.group):
                self._handlers[event_type][0](group, tx)

    def _dead_row(self, dead: _Dead) -> dict[str, Any]:
        entry, event = dead.entry, dead.event
        raw = text_fields(entry.raw)
        return {
            "group_name": self.group,
            "stream": entry.stream,
            "entry_id": entry.entry_id,
            "event_id": event.id if event else raw.get("id"),
            "topic": event.type if event else raw.get("type"),
            "identity": event.identity if event else None,
            "reason": dead.reason,
            "error": dead.error,
            "deliveries": entry.deliveries,
            "payload": q.encode_fields(raw),
            "dead_letter_stream": self.dead_letter_stream_for(entry.stream),
        }

    # -- after commit -----------------------------------------------------------------------

    def _acknowledge(self, outcome: _Outcome) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for dead in outcome.dead:
            fields_ = text_fields(dead.entry.raw)
            fields_.update(
                {
                    "dl.group": self.group,
                    "dl.stream": dead.entry.stream,
                    "dl.entry_id": dead.entry.entry_id,
                    "dl.reason": dead.reason,
                    "dl.error": dead.error[: q.MAX_ERROR_CHARS],
                    "dl.deliveries": str(dead.entry.deliveries),
                    "dl.record_id": str(
                        outcome.dead_ids.get((dead.entry.stream, dead.entry.entry_id), "")
                    ),
                }
            )
            pipe.xadd(self.dead_letter_stream_for(dead.entry.stream), fields_)  # type: ignore[arg-type]
        for stream_name, ids in outcome.acks.items():
            pipe.xack(stream_name, self.group, *ids)
        results = pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, (redislib.ConnectionError, redislib.TimeoutError)):
                raise result
            if isinstance(result, Exception):
                # A permanent refusal (say, the dead-letter key holds another type): the
                # database record is the durable one; say so loudly and go on.
                log.error(
                    "dead-letter copy or ack refused",
                    extra=fields(group=self.group, error=str(result)),
                )
        if outcome.dead:
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

    def _report(self, outcome: _Outcome) -> None:
        for stream_name, count in outcome.handled.items():
            self._hook("consumer_handled", self.group, stream_name, count)
        if outcome.duplicates:
            self._hook("consumer_duplicate", self.group, outcome.duplicates)
        dead_by_stream: dict[str, int] = {}
        for dead in outcome.dead:
            dead_by_stream[dead.entry.stream] = dead_by_stream.get(dead.entry.stream, 0) + 1
        for stream_name, count in dead_by_stream.items():
            self._hook("consumer_dead_lettered", self.group, stream_name, count)

    def _hook(self, name: str, *args: Any) -> None:
        call_hook(self.hooks, name, *args)

    # -- maintenance ------------------------------------------------------------------------

    def _maintain(self) -> None:
        now = time.monotonic()
        if now >= self._next_maintenance:
            self._next_maintenance = now + self.config.maintenance_interval_seconds
            for name in self.streams:
                self._report_lag(name)
                if self.config.stale_consumer_ms is not None:
                    self._remove_stale_consumers(name)
        if self.vacuum is not None:
            self.vacuum.maybe_start()  # background, when due and autovacuum is off
        self.retention.maybe_start()  # dead letters (consumer.retention): background, when due
        if now >= self._next_purge:
            # One bounded batch per cycle, on the batch loop's path: entries arriving meanwhile
            # wait for one DELETE of purge_batch rows, not for a whole backlog. A full batch
            # means more are due: the next cycle purges again instead of waiting the interval.
            removed = self.purge_inbox(max_batches=1)
            full = removed >= self.config.purge_batch
            self._next_purge = now + (0.0 if full else self.config.purge_interval_seconds)
            if removed:
                log.info("inbox purged", extra=fields(group=self.group, rows=removed))

    def _report_lag(self, stream: str) -> None:
        for info in self.redis.xinfo_groups(stream):
            if _text(info.get("name")) == self.group:
                lag = info.get("lag")
                self._hook(
                    "consumer_lag",
                    self.group,
                    stream,
                    int(lag) if lag is not None else None,
                    int(info.get("pending") or 0),
                )

    def _remove_stale_consumers(self, stream: str) -> None:
        assert self.config.stale_consumer_ms is not None
        for info in self.redis.xinfo_consumers(stream, self.group):
            name = _text(info.get("name"))
            if name == self.name or int(info.get("pending") or 0) > 0:
                continue  # a consumer with pending entries keeps them until they are claimed
            if int(info.get("idle") or 0) > self.config.stale_consumer_ms:
                self.redis.xgroup_delconsumer(stream, self.group, name)
                log.info(
                    "stale consumer removed",
                    extra=fields(group=self.group, stream=stream, consumer=name),
                )


def _key(event: ConsumedEvent) -> str:
    return event.entry_id + "\x00" + event.stream


def _is_redis_client(value: object) -> bool:
    return isinstance(value, (redislib.Redis, RedisCluster))


__all__ = ["ConsumedEvent", "Consumer", "ConsumerConfig", "ConsumerTx"]
