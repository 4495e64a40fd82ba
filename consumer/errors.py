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


class UndecodableEntry(ConsumerError, ValueError):
    """A stream entry is not an event this consumer can read: a required field (``id``,
    ``type``, ``data``) is missing or empty, ``data`` is not JSON, the identity does not fit
    the inbox, or the bytes are not UTF-8. ``field`` names the problem. The consumer
    dead-letters such an entry at once (reason ``undecodable``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"undecodable entry {field}: {problem}")
        self.field = field
        self.problem = problem


class DeadLetterNotFound(ConsumerError, LookupError):
    """``replay`` was given a dead-letter record id that does not exist."""


class AlreadyReplayed(ConsumerError):
    """``replay`` was given a dead-letter record that was re-injected before."""


# -- job store (consumer/jobs/: store, worker, operations) -------------------------------


class JobError(ConsumerError, ValueError):
    """A job-store call was given bad input (an empty tenant or action, a negative ttl, a
    ``now`` that is not a time, ...); ``field`` names the argument. Nothing was written."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid {field}: {problem}")
        self.field = field
        self.problem = problem


class JobNotFound(ConsumerError, LookupError):
    """No job has the given id or (tenant, action)."""


class IllegalTransition(ConsumerError):
    """The job's current state does not allow the requested move (``resume`` of a DONE job,
    ``cancel`` of a finished one, ...). ``current`` and ``target`` name the two states; the
    allowed moves live in one table, ``consumer.jobs.states.TRANSITIONS``."""

    def __init__(self, job: str, current: str, target: str) -> None:
        super().__init__(f"job {job}: illegal transition {current} -> {target}")
        self.job = job
        self.current = current
        self.target = target


class JobFailure(ConsumerError):
    """Raised by a job handler to say how its attempt failed (the Worker records it).
    Any other exception from a handler counts as a :class:`TransientFailure`."""

    kind = "transient"

    def __init__(self, message: str = "", *, provider: str | None = None) -> None:
        super().__init__(message or type(self).__name__)
        self.provider = provider


class TransientFailure(JobFailure):
    """Worth retrying later (timeouts, 5xx, rate limits): backoff with full jitter, bounded by
    the attempt budget and the maximum recovery window."""

    kind = "transient"


class PermanentFailure(JobFailure):
    """Retrying cannot help (a validation error from the provider): WAITING_REVIEW at once."""

    kind = "permanent"


class AuthFailure(JobFailure):
    """The provider refused our credentials: retried a small bounded number of times, then
    NEEDS_ATTENTION (an operator must fix the credentials, then ``resume``)."""

    kind = "auth"


class OperationError(ConsumerError):
    """An operation intent cannot proceed: the same operation id was dispatched with a
    different request (digest mismatch), or the provider is not registered."""


class ProviderTimeout(TransientFailure):
    """A provider did not answer in time: the request may or may not have taken effect. The
    operation's receipt becomes UNKNOWN (never FAILED) and is reconciled before any resend."""


class OperationUnresolved(ConsumerError):
    """An operation's earlier outcome is unknown and its provider offers neither a lookup nor
    an idempotency key: the job was moved to WAITING_REVIEW and the handler must stop."""
