"""Job states and the one table of allowed moves between them.

Every state change the store makes is checked against :data:`TRANSITIONS` (the SQL of each
move also filters on the allowed source states, so a race cannot sneak past the check):

- ``READY``: eligible to be claimed once ``run_after`` (NULL = at once) has passed.
- ``LEASED``: held by one worker until ``lease_expires_at``; ``lease_epoch`` fences it.
- ``WAITING_EXTERNAL``: waiting for a reply from outside (a provider callback, a customer);
  no worker holds it. ``resume`` (the reply) or a timer makes it READY again.
- ``WAITING_REVIEW``: a person must decide (a permanent failure, an unreconcilable
  operation). ``resume`` (the decision) or ``cancel`` ends the wait.
- ``NEEDS_ATTENTION``: the attempts or the recovery window are spent, or credentials were
  refused repeatedly; an operator fixes the cause, then ``resume``.
- ``WAITING_PARENTS``: enqueued ``after`` other jobs (``consumer.jobs.steps``) that are not
  all DONE; never claimed. The finish of its last parent makes it READY, in the same
  transaction; a failed parent sends it to WAITING_REVIEW (or CANCELLED, as asked).
- ``HELD``: a job of an order key (``order_key``) behind an earlier job of that key that
  has not finished (``consumer.jobs.order_keys``); no claim sees it. The move that ends the
  earlier job's hold makes it READY, in the same transaction; an operator may cancel it.
- ``DONE`` and ``CANCELLED``: terminal. ``CANCELLED`` is the extra state this store adds:
  a timer whose subject changed or whose cancellation condition holds, or an operator's
  ``cancel``, ends the job without acting.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from consumer.errors import IllegalTransition

READY: Final = "READY"
LEASED: Final = "LEASED"
WAITING_EXTERNAL: Final = "WAITING_EXTERNAL"
WAITING_REVIEW: Final = "WAITING_REVIEW"
NEEDS_ATTENTION: Final = "NEEDS_ATTENTION"
DONE: Final = "DONE"
CANCELLED: Final = "CANCELLED"
WAITING_PARENTS: Final = "WAITING_PARENTS"
HELD: Final = "HELD"

STATES: Final = (
    *(READY, LEASED, WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION, DONE, CANCELLED),
    WAITING_PARENTS,
    HELD,
)
WAITING: Final = (WAITING_EXTERNAL, WAITING_REVIEW)
TERMINAL: Final = (DONE, CANCELLED)

TRANSITIONS: Final[dict[str, frozenset[str]]] = {
    # claim; cancel by an operator; an operator may also park a job for review.
    READY: frozenset({LEASED, CANCELLED, WAITING_REVIEW}),
    # The lease holder's moves (finish, fail, wait, schedule, cancel), recovery of an
    # expired lease (READY or NEEDS_ATTENTION), and a new claim of an expired lease (LEASED
    # again, with the next epoch).
    LEASED: frozenset(
        {LEASED, DONE, READY, WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION, CANCELLED}
    ),
    # A reply or a timer makes it eligible; the wait may also end in review or cancellation.
    WAITING_EXTERNAL: frozenset({READY, WAITING_REVIEW, CANCELLED}),
    # An operator's decision: retry (READY) or give up (CANCELLED).
    WAITING_REVIEW: frozenset({READY, CANCELLED}),
    NEEDS_ATTENTION: frozenset({READY, CANCELLED}),
    # Its last parent's finish (READY), a failed parent (review), a cancelled one.
    WAITING_PARENTS: frozenset({READY, WAITING_REVIEW, CANCELLED}),
    # Its order key's line reaches it (READY), or an operator gives it up.
    HELD: frozenset({READY, CANCELLED}),
    DONE: frozenset(),
    CANCELLED: frozenset(),
}


class Outcome(StrEnum):
    """How one run of a job ended, as the worker records it and its hooks report it (a
    ``str``: the hooks' ``outcome`` label is its value)."""

    DONE = "done"  # the handler returned: the job is finished (in the next statement)
    CONFLICT = "conflict"  # the lease was lost: another worker holds the job now
    THROTTLED = "throttled"  # the provider's limit handed the job back until its time
    NO_HANDLER = "no_handler"  # nothing routes its action: failed permanently
    CANCELLED = "cancelled"  # cancelled by the handler, or by a request while it ran
    WAITING_EXTERNAL = "waiting_external"
    WAITING_REVIEW = "waiting_review"
    DEFERRED = "deferred"
    SCHEDULED = "scheduled"
    FAILED_READY = "failed_ready"  # a failure with a retry to come
    FAILED_NEEDS_ATTENTION = "failed_needs_attention"
    FAILED_WAITING_REVIEW = "failed_waiting_review"
    FAILED_CANCELLED = "failed_cancelled"

    @classmethod
    def failed(cls, state: str) -> Outcome:
        """The outcome of a failure that left the job in ``state``."""
        return cls("failed_" + state.lower())


def sources(target: str) -> tuple[str, ...]:
    """The states from which ``target`` may be reached (for the SQL's state filter)."""
    return tuple(state for state in STATES if target in TRANSITIONS[state])


def check_transition(job: str, current: str, target: str) -> None:
    """Raise :class:`IllegalTransition` unless ``current -> target`` is allowed."""
    if target not in TRANSITIONS.get(current, frozenset()):
        raise IllegalTransition(job, current, target)
