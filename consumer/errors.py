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
    ``type``, ``data``) is missing or empty, ``data`` is not JSON or holds what no backend
    can store (NaN, Infinity, a number that overflows to infinity such as ``1e999999``, a
    ``\\u0000`` that PostgreSQL's jsonb refuses), the identity does not fit the inbox, or
    the bytes are not UTF-8. ``field`` names the problem. Such an entry can never succeed,
    so the consumer dead-letters it at once (reason ``undecodable``) instead of retrying it."""

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


class StepGraphError(JobError):
    """``after=`` at enqueue named a graph the store refuses; ``field`` is ``after``.
    Nothing was written (not one job of the call)."""

    def __init__(self, problem: str) -> None:
        super().__init__("after", problem)


class DependencyCycle(StepGraphError):
    """The jobs of one enqueue depend on each other in a circle (``cycle`` names them, as
    ``tenant/action``, the first repeated at the end)."""

    def __init__(self, cycle: list[str]) -> None:
        super().__init__("a cycle: " + " -> ".join(cycle))
        self.cycle = cycle


class UnknownParent(StepGraphError):
    """A parent named in ``after=`` is neither an existing job nor a job of the same call."""

    def __init__(self, parents: list[str]) -> None:
        super().__init__("unknown parent job " + ", ".join(parents))
        self.parents = parents


class ResultTooLarge(JobError):
    """A handler's return value (the job's result) is not JSON, or its JSON is larger than
    ``consumer.jobs.steps.MAX_RESULT_BYTES``: never truncated; the run fails permanently."""

    def __init__(self, problem: str) -> None:
        super().__init__("result", problem)


class ResultUnavailable(ConsumerError):
    """``Store.result`` / ``aresult``: the job ended without a result (``state``
    NEEDS_ATTENTION or CANCELLED; ``reason`` says why), or it did not end in time
    (:class:`ResultTimeout`)."""

    def __init__(self, job: str, state: str, reason: str | None) -> None:
        super().__init__(f"job {job} is {state}" + (f": {reason}" if reason else ""))
        self.job = job
        self.state = state
        self.reason = reason


class ResultTimeout(ResultUnavailable, TimeoutError):
    """The job did not finish within ``timeout`` seconds (``state`` is its state then)."""


class InvalidSchedule(JobError):
    """A schedule definition was refused before anything was stored: an invalid cron
    expression, an unknown time zone, an empty name, an unknown ``missed`` policy...;
    ``field`` names the argument (``cron``, ``tz``, ``name``, ...)."""


class ScheduleNotFound(ConsumerError, LookupError):
    """No schedule has the given name (``pause_schedule``, ``resume_schedule``,
    ``remove_schedule``)."""


class IllegalTransition(ConsumerError):
    """The job's current state does not allow the requested move (``resume`` of a DONE job,
    ``cancel`` of a finished one, ...). ``current`` and ``target`` name the two states; the
    allowed moves live in one table, ``consumer.jobs.states.TRANSITIONS``."""

    def __init__(self, job: str, current: str, target: str) -> None:
        super().__init__(f"job {job}: illegal transition {current} -> {target}")
        self.job = job
        self.current = current
        self.target = target


class JobCancelled(ConsumerError):
    """The job was cancelled while it ran (``Store.cancel`` on a LEASED job): ``dispatch``
    refuses to start a new effect. Not a failure: the run ends and the job is CANCELLED. An
    effect whose intent was written before the cancel keeps its receipt."""


class JobFailure(ConsumerError):
    """Raised by a job handler to say how its attempt failed (the Worker records it).
    Any other exception from a handler counts as a :class:`TransientFailure`."""

    kind = "transient"
    #: True when the provider certainly did not act on the request (a connection refused
    #: before anything was sent, HTTP 401/403/429/503): the receipt is NOT_SENT, never
    #: FAILED, and a retry (or a resume after the credentials are fixed) sends.
    not_sent = False

    def __init__(
        self,
        message: str = "",
        *,
        provider: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
        not_sent: bool | None = None,
    ) -> None:
        super().__init__(message or type(self).__name__)
        self.provider = provider
        self.status = status  # the provider's HTTP status, when there was one
        self.retry_after = retry_after  # seconds the provider asked us to wait (Retry-After)
        if not_sent is not None:
            self.not_sent = not_sent


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


class ProviderUnavailable(TransientFailure):
    """The provider did not act: the connection was refused before anything was sent, or it
    answered 429 (rate limited) or 503 (unavailable). ``not_sent`` is True, ``status`` is the
    HTTP status (None for a connect error) and ``retry_after`` the seconds it asked for
    (``Retry-After``), which the retry policy honours."""

    not_sent = True


class ProviderOutcomeUnknown(ProviderTimeout):
    """The provider answered in a way that does not say whether it acted (a 5xx other than
    503, a 2xx without a readable reference): as ambiguous as a timeout, the receipt is
    UNKNOWN and is reconciled before any resend. ``status`` is the HTTP status."""


class OperationUnresolved(ConsumerError):
    """An operation's earlier outcome is unknown and its provider offers neither a lookup nor
    an idempotency key: the job was moved to WAITING_REVIEW and the handler must stop."""


class OperationInFlight(OperationUnresolved):
    """An earlier attempt's provider call may still be in flight (its call deadline has not
    passed): nothing was looked up nor sent, and the job was handed back, READY again at
    ``deadline`` (unix seconds). The handler must stop, as for any unresolved operation."""

    def __init__(self, message: str, deadline: float) -> None:
        super().__init__(message)
        self.deadline = deadline


class ProviderThrottled(OperationUnresolved):
    """The provider is paused (it answered 429/503 with ``Retry-After``) or at its limit
    (``rate_limit``, or as many calls in flight as it serves): nothing was sent, no intent
    was written, and the job was handed back READY again at ``until`` (unix seconds, database
    clock) without counting a failure. The handler must stop, as for any unresolved
    operation; the worker's slot is free for other providers' jobs meanwhile."""

    def __init__(self, message: str, provider: str, until: float) -> None:
        super().__init__(message)
        self.provider = provider
        self.until = until
