"""How a consumer reads, retries and gives up: :class:`ConsumerConfig`, validated when it is
made (``consumer.consumer`` re-exports it). What each setting does in the batch loop is
told in the :mod:`consumer.consumer` docstring; the retention windows, with how they relate,
in ``docs/explanation/retention.md``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from outbox.backoff import Backoff
from outbox.errors import ConfigError
from outbox.event import DEFAULT_MAX_PAYLOAD_BYTES
from outbox.retention import DEFAULT_DEAD_LETTER_RETENTION, check_seconds
from outbox.schema import check_identifier
from outbox.validate import check_number

DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0
"""The inbox's deduplication window by default: seven days."""


def _positive_int(name: str, value: object, *, allow_zero: bool = False) -> None:
    check_number(name, value, ConfigError, integer=True, zero=allow_zero)


def _positive_number(name: str, value: object) -> None:
    check_number(name, value, ConfigError)


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
    - ``max_entry_bytes``: an entry larger than this (field names and values) is
      dead-lettered at once as ``too_large``, without its data, and never reaches a handler
      or a job: emit's 1 MiB payload cap plus 64 KiB for the envelope, by default.
    - ``schema``: database schema of the consumer tables (None: the default search path).
    - ``create_schema``: create the tables on first use (idempotent).
    - ``backoff``: the waits between batches that failed (the database or the broker
      away): 0.2 s doubling to 2 s at most, so a consumer takes up again within about 2 s
      of the service's return, however long the outage was.
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
    max_entry_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES + 64 * 1024
    schema: str | None = None
    create_schema: bool = True
    # At most 2 s: the documented recovery after an outage (it was 10 s, and after Redis
    # came back empty the consumer handled nothing for ~14 s, issue 53).
    backoff: Backoff = field(default_factory=lambda: Backoff(0.2, 2.0))

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
        _positive_int("max_entry_bytes", self.max_entry_bytes)
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


__all__ = ["DEFAULT_RETENTION_SECONDS", "ConsumerConfig"]
