"""The seam between the relay's loop and a broker: the protocol and its neutral results.

The loop (:mod:`relay.relay`, :mod:`relay.loop`, :mod:`relay.batch`, :mod:`relay.reconcile`,
:mod:`relay.republish`) speaks only to a :class:`Broker` and reads only the neutral results
below; what a broker does to keep each guarantee is its own business:

- Redis Streams and Redis Cluster: :mod:`relay.redis` (a Lua script per batch, fence keys,
  a data-loss marker);
- NATS JetStream: :mod:`relay.nats` (``Nats-Msg-Id``, one JetStream stream per outbox stream
  name, reconciliation by reading the stream).

:func:`relay.broker.broker_for` is the one place that reads a URL's scheme. How to add a
broker, and what a Kafka one would need: ``docs/how-to/brokers.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from outbox.errors import BrokerUnavailable as BrokerUnavailable
from relay.records import Record

if TYPE_CHECKING:
    from relay.config import RelayConfig
    from relay.records import RelayStats
    from relay.store import Store


# -- neutral results: one per entry of a batch ------------------------------------------------
#
# A receipt is a string: where the broker put the entry (a Redis entry id, a JetStream
# stream sequence). Anything else is one of these exceptions; the entry was not added.


class TransientError(Exception):
    """A per-entry refusal that retrying may fix (out of memory, busy, ...)."""


class FencedOut(Exception):
    """The batch's intent was taken over by a reconciling relay: nothing was added."""


class HeldBack(Exception):
    """An entry not attempted because an earlier entry of its key failed in the batch."""


class MarkerBehind(Exception):
    """The broker holds less than this relay's receipts (it lost acknowledged entries):
    nothing was added; the relay runs its data-loss check."""


@dataclass(frozen=True)
class Prepared:
    """One record ready to send: its stream and its encoding in the broker's format
    (``fields``; ``nfields``: how many field/value items it packs, 0 for an opaque body)."""

    record: Record
    stream: str
    fields: bytes
    nfields: int


class BrokerCheck(Protocol):
    """A broker's health check, run at start, every ``redis_check_interval`` and after a
    batch refused with :class:`MarkerBehind`: its persistence, and whether it lost entries
    the relay had published (then reported, and republished with ``auto_republish``)."""

    persistence: Any

    def check(self) -> bool:
        """True if the broker lost acknowledged entries (reported and handled)."""
        ...


@runtime_checkable
class Broker(Protocol):
    """What the relay's loop needs from a broker; nothing else is called on it."""

    @property
    def stream_template(self) -> str:
        """The outbox stream-name template (``outbox.{topic}``), for logs."""
        ...

    def stream_for(self, record: Record) -> str:
        """The outbox stream ``record`` goes to (raises :class:`relay.errors.RoutingError`)."""
        ...

    def prepare(self, record: Record) -> Prepared:
        """Route and encode one record (raises ``RoutingError`` or ``PermanentPublishError``:
        it can never be published; the relay quarantines it)."""
        ...

    def publish(
        self,
        prepared: Sequence[Prepared],
        fence: str | None = None,
        *,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
    ) -> list[str | Exception]:
        """Send a batch, in order; one result per entry (a receipt string, or one of the
        exceptions of this module, or ``PermanentPublishError``). A later entry of a key
        whose entry failed is not added (:class:`HeldBack`). A connection failure raises:
        any prefix may have been added, and the relay reconciles before sending again.
        ``fence``: the intent's fence (:func:`relay.reconcile.fence_key`)."""
        ...

    def fence_for(self, fence: str, stream: str) -> str:
        """The name of ``fence`` for entries of ``stream`` (one per slot on a cluster)."""
        ...

    def set_fences(
        self,
        keys: Sequence[str],
        ttl_seconds: int = 7 * 24 * 3600,
        *,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
    ) -> None:
        """Fence intents before they are reconciled: afterwards no batch of theirs is added,
        so what :meth:`find_published` sees is final."""
        ...

    def find_published(
        self, stream: str, event_ids: Iterable[str], start_ms: int, end_ms: int | None
    ) -> dict[str, str]:
        """Which of ``event_ids`` ``stream`` holds, added between the two times (unix
        milliseconds; None: now): event id -> receipt. Reads the stream: never trusts a
        deduplication window."""
        ...

    def ping(self) -> None:
        """Raise the broker's connection error if it does not answer."""
        ...

    def server_of(self, stream: str) -> int | None:
        """Which server refuses or accepts ``stream``'s entries (a Redis Cluster's slot;
        None: one server for all), so a server accepting again ends the backoff of its
        refused rows."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the relay logs at start about its broker (kind, cluster, ...)."""
        ...

    def health_check(
        self,
        store: Store,
        config: RelayConfig,
        stats: RelayStats,
        hook: Callable[..., None],
    ) -> BrokerCheck | None:
        """The broker's check of persistence and lost data (None: the broker has none)."""
        ...

    def close(self) -> None:
        """Release the broker's connections."""
        ...


__all__ = [
    "Broker",
    "BrokerCheck",
    "BrokerUnavailable",
    "FencedOut",
    "HeldBack",
    "MarkerBehind",
    "Prepared",
    "TransientError",
]
