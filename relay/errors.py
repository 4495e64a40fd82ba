"""The relay's errors: a short tree, each documented by its docstring.

Infrastructure failures (a database or Redis that does not answer) are never raised out of
:meth:`relay.Relay.run`: the loop logs them and retries with backoff. They surface from
:meth:`relay.Relay.run_once` so a caller stepping the loop sees them.
"""

from __future__ import annotations

from outbox.errors import ConfigError, OutboxError

__all__ = ["ConfigError", "PermanentPublishError", "RelayError", "RoutingError"]


class RelayError(OutboxError):
    """Base of the relay's own errors (``ConfigError`` covers bad settings)."""


class RoutingError(RelayError):
    """One record cannot be routed to a stream: the template needs a value the event lacks
    (``{tenant}`` on an event without a tenant), or the name it makes is not acceptable.
    The record is quarantined with this message."""


class PermanentPublishError(RelayError):
    """Redis refused one record for a reason that retrying will not fix (``WRONGTYPE``, a
    malformed stored payload). The record is quarantined with this message."""
