"""Errors of the consumer side (inbox, job store, workers): a short tree in one module."""

from __future__ import annotations

from outbox.errors import OutboxError


class ConsumerError(OutboxError):
    """Base of the consumer side's errors."""


class Conflict(ConsumerError):
    """A lease holder's transition lost: its epoch is stale (another worker claimed the job
    since), the lease is not held, or the job is not in a state that holder may move.

    Raised by every compare-and-set on (job, epoch) that matched no row.
    """
