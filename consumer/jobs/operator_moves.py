"""The operators' moves of a job: from the states ``TRANSITIONS`` allows, never under a lease
holder (resume, park, and the operator's side of a cancel).

Part of :class:`consumer.jobs.store.Store` (through :class:`consumer.jobs.moves.LeaseMoves`;
see the store's module docstring for the contract).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement
from sqlalchemy.engine import Connection

from consumer.errors import Conflict, IllegalTransition, JobError, JobNotFound
from consumer.jobs import order_keys
from consumer.jobs.base import StoreBase
from consumer.jobs.checks import NO_TIMER, Time, job_key, valid_time
from consumer.jobs.states import (
    CANCELLED,
    HELD,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING_EXTERNAL,
    WAITING_REVIEW,
    check_transition,
    sources,
)
from consumer.jobs.steps import settle_children


class OperatorMoves(StoreBase):
    """Resume and park; the operator's move and the state read its refusals explain."""

    def resume(
        self,
        job: Any,
        action: str | None = None,
        *,
        run_after: Time | None = None,
        reason: str | None = None,
        now: Time | None = None,
    ) -> None:
        """A reply or an operator's decision: WAITING_EXTERNAL, WAITING_REVIEW or
        NEEDS_ATTENTION -> READY (eligible at ``run_after``, default at once). The failure
        counters restart, so a fixed job gets its full retry budget again."""
        when = valid_time("now", now)
        after = valid_time("run_after", run_after)
        where, label = job_key(job, action)
        values = {
            "run_after": after,
            "wait_reason": None,
            "auth_failures": 0,
            "first_failed_at": None,
            "attempts": 0,
        }
        self._operator_move(
            where,
            label,
            READY,
            values,
            "resumed",
            reason,
            when,
            allowed=(WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION),
        )

    def park(
        self,
        job: Any,
        action: str | None = None,
        *,
        reason: str | None = None,
        now: Time | None = None,
    ) -> None:
        """An operator's (or the reconciliation sweep's) READY or WAITING_EXTERNAL ->
        WAITING_REVIEW: a person must decide before the job runs again."""
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        when = valid_time("now", now)
        where, label = job_key(job, action)
        # No wake-up: a READY job's run_after ("not before", a backoff or a call's deadline)
        # would read as a due timer in WAITING_REVIEW, and recovery would make it READY
        # again at once, only for the sweep to park it again, for ever.
        self._operator_move(
            where,
            label,
            WAITING_REVIEW,
            {"wait_reason": reason, "run_after": None},
            "waiting_review",
            reason,
            when,
            allowed=(READY, WAITING_EXTERNAL),
        )

    def _operator_move(
        self,
        where: ColumnElement[bool],
        label: str,
        target: str,
        values: dict[str, Any],
        outcome: str,
        note: str | None,
        when: float | None,
        allowed: tuple[str, ...] | None = None,
    ) -> None:
        from_states = tuple(s for s in (allowed or sources(target)) if s != LEASED)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            # A cancel frees its key's place unless the job was HELD (it held none): its state
            # read under the row's lock (a promotion waits for it, and takes no key lock here).
            row = self.driver.job_lock_for_claim(conn, where) if target == CANCELLED else None
            was = None if row is None else row.state
            job_id = self.driver.job_update_from(
                conn,
                where,
                from_states,
                {**values, "state": target, "updated_at": clock, **NO_TIMER},
            )
            if job_id is None:
                state = self._state(conn, where, label)
                if state == LEASED and target in (CANCELLED,):
                    raise Conflict(f"job {label} is leased: only its holder may move it")
                if state not in from_states:
                    check_transition(label, state, target)
                    raise IllegalTransition(label, state, target)
                raise Conflict(f"job {label} changed meanwhile")  # pragma: no cover
            self.driver.attempt_insert(conn, job_id, None, None, outcome, note, clock)
            if target == CANCELLED and was != HELD:  # a key's head: the next job's turn
                order_keys.release(conn, [job_id], ended=True, now=clock)
            if target == READY:
                self.driver.job_ready_notify(conn)
            else:  # cancelled or parked: its dependents follow (consumer.jobs.steps)
                settle_children(self.driver, conn, [job_id], clock)

    def _state(self, conn: Connection, where: ColumnElement[bool], label: str) -> str:
        state = self.driver.job_state(conn, where)
        if state is None:
            raise JobNotFound(f"no job {label}")
        return str(state)
