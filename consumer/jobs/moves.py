"""The moves of a job after its claim: the lease holder's (fenced compare-and-set on
``(job, epoch)``) and the operators' (from the states ``TRANSITIONS`` allows).

Part of :class:`consumer.jobs.store.Store` (see its module docstring for the contract).
:class:`LeaseMoves` holds the holder's moves one job at a time, and ``schedule`` and
``cancel``, which are the holder's or an operator's; it inherits the batched ones
(``consumer.jobs.batch_moves``) and the operators' own (``consumer.jobs.operator_moves``).
"""

from __future__ import annotations

import math
import random
from typing import Any

from sqlalchemy import ColumnElement, case
from sqlalchemy.engine import Connection

from consumer.errors import Conflict, JobError, JobNotFound
from consumer.jobs import cancels, order_keys
from consumer.jobs import replies as talk
from consumer.jobs.batch_moves import BatchMoves
from consumer.jobs.checks import (
    NO_TIMER,
    Time,
    error_text,
    job_key,
    valid_holder,
    valid_json,
    valid_name,
    valid_time,
    valid_ttl,
    valid_version,
)
from consumer.jobs.operator_moves import OperatorMoves
from consumer.jobs.rows import Lease
from consumer.jobs.schema import jobs
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING,
    WAITING_EXTERNAL,
    WAITING_REVIEW,
    check_transition,
)
from consumer.jobs.step_results import checked_result
from consumer.jobs.steps import settle_children


class LeaseMoves(BatchMoves, OperatorMoves):
    """Renew, finish, release, defer, fail, wait, schedule, cancel, resume, park."""

    # -- the lease holder's moves (compare-and-set on (job, epoch)) ----------------------

    def renew(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        ttl: float = 30,
        now: Time | None = None,
    ) -> float:
        """Extend the lease to at least ``now + ttl``, never shorter than it is: a heartbeat
        landing just after a dispatch extended the lease to its provider call's deadline must
        not pull it back (the lease would expire mid-call). Returns the lease's expiry.
        ``Conflict`` if fenced."""
        seconds = valid_ttl(ttl)
        when = valid_time("now", now)
        where, label, who, epoch_ = valid_holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            until = clock + seconds
            # One fenced UPDATE, max(current, until) in SQL on both databases (like
            # JobDriver.job_lease_extend), so no concurrent extension is lost in between.
            longest = case((jobs.c.lease_expires_at < until, until), else_=jobs.c.lease_expires_at)
            job_id = self._cas(
                conn, where, label, who, epoch_, LEASED, {"lease_expires_at": longest}, clock
            )
            row = self.driver.job_get(conn, jobs.c.id == job_id)
        expires = None if row is None else row.lease_expires_at
        return until if expires is None else max(until, float(expires))

    def finish(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        now: Time | None = None,
        result: Any = None,
    ) -> None:
        """LEASED -> DONE. ``Conflict`` if ``epoch`` is stale or the lease is not held.
        ``result`` (JSON, ``consumer.jobs.step_results`` caps it; default: a Lease's own
        ``result``) is stored by the same statement; dependents whose last parent this was
        become READY in its transaction."""
        when = valid_time("now", now)
        if result is None and isinstance(job, Lease):
            result = job.result
        values = {} if result is None else {"result": checked_result(result)}
        where, label, who, epoch_ = valid_holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            self._move(
                conn,
                where,
                label,
                who,
                epoch_,
                DONE,
                values,
                "done",
                None,
                when,
                consume=talk.watermark(job),
            )

    def release(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        now: Time | None = None,
    ) -> None:
        """LEASED -> READY without counting a failure: a draining worker hands back a job it
        claimed but did not start (the claim is not counted as an attempt)."""
        self._hand_back(job, action, worker, epoch, None, "released", None, now, seen=False)

    def defer(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        until: Time,
        reason: str | None = None,
        now: Time | None = None,
    ) -> None:
        """LEASED -> READY at ``until`` without counting a failure: the job cannot act yet
        (an earlier provider call may still be in flight until its deadline)."""
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        at = valid_time("until", until)
        if at is None:
            raise JobError("until", "is required")
        self._hand_back(job, action, worker, epoch, at, "deferred", reason, now)

    def _hand_back(
        self,
        job: Any,
        action: str | None,
        worker: str | None,
        epoch: int | None,
        run_after: float | None,
        outcome: str,
        note: str | None,
        now: Time | None,
        *,
        seen: bool = True,
    ) -> None:
        when = valid_time("now", now)
        where, label, who, epoch_ = valid_holder(job, action, worker, epoch)
        values: dict[str, Any] = {"attempts": jobs.c.attempts - 1}
        if run_after is not None:
            values["run_after"] = run_after
        with self.driver.begin() as conn:
            self._move(
                conn,
                where,
                label,
                who,
                epoch_,
                READY,
                values,
                outcome,
                note,
                when,
                clear_timer=False,
                consume=talk.watermark(job) if seen else None,
            )

    # complexity: fail's fenced moves: retry, dead, provider pause, each with its reason
    def fail(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        error: str | BaseException = "",
        kind: str = "transient",
        provider: str | None = None,
        now: Time | None = None,
        rng: random.Random | None = None,
        retry_after: float | None = None,
    ) -> str:
        """Record a failed attempt; returns the job's new state (see ``consumer.jobs.retry``):
        transient -> READY after a jittered backoff (NEEDS_ATTENTION when spent), permanent
        -> WAITING_REVIEW, auth -> READY then NEEDS_ATTENTION after a few. ``retry_after``
        (seconds, a provider's ``Retry-After``) is the shortest delay before the retry."""
        if kind not in ("transient", "permanent", "auth"):
            raise JobError("kind", f"must be transient, permanent or auth, got {kind!r}")
        if retry_after is not None and (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, (int, float))
            or not math.isfinite(retry_after)
            or retry_after < 0
        ):
            raise JobError("retry_after", f"must be a non-negative number, got {retry_after!r}")
        valid_name("provider", provider, optional=True)
        text_error = error_text(error)
        when = valid_time("now", now)
        where, label, who, epoch_ = valid_holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            row = self.driver.job_lock_held(conn, where, who, epoch_)
            if row is None:
                self._diagnose(conn, where, label, who, epoch_)
            assert row is not None
            clock = self._clock(conn, when)
            auth_failures = row.auth_failures + 1 if kind == "auth" else 0
            started = row.first_failed_at if row.first_failed_at is not None else clock
            decision = self.config.retry.decide(
                kind,
                attempts=int(row.attempts),
                auth_failures=auth_failures,
                elapsed=max(0.0, clock - started),
                provider=provider or row.provider,
                rng=rng if rng is not None else self.rng,
            )
            values: dict[str, Any] = {
                "auth_failures": auth_failures,
                "first_failed_at": started,
                "last_error": text_error,
            }
            if decision.state == READY:
                values["run_after"] = clock + max(decision.delay, retry_after or 0.0)
            else:
                values["wait_reason"] = decision.reason
            outcome = {READY: "retry"}.get(decision.state, decision.state.lower())
            self._move(
                conn, where, label, who, epoch_, decision.state, values, outcome, text_error, clock
            )
        return decision.state

    def wait_external(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        reason: str | None = None,
        until: Time | None = None,
        now: Time | None = None,
    ) -> None:
        """LEASED -> WAITING_EXTERNAL: the worker is released; ``resume`` (the reply) or the
        timer at ``until`` (if given) makes the job READY again."""
        self._wait(job, action, worker, epoch, WAITING_EXTERNAL, reason, until, now)

    def wait_review(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        reason: str | None = None,
        until: Time | None = None,
        now: Time | None = None,
    ) -> None:
        """LEASED -> WAITING_REVIEW: a person must decide (``resume`` or ``cancel``)."""
        self._wait(job, action, worker, epoch, WAITING_REVIEW, reason, until, now)

    def _wait(
        self,
        job: Any,
        action: str | None,
        worker: str | None,
        epoch: int | None,
        state: str,
        reason: str | None,
        until: Time | None,
        now: Time | None,
    ) -> None:
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        when = valid_time("now", now)
        wake = valid_time("until", until)
        where, label, who, epoch_ = valid_holder(job, action, worker, epoch)
        with self.driver.begin() as conn:
            reached = self._move(
                conn,
                where,
                label,
                who,
                epoch_,
                state,
                {"wait_reason": reason, "run_after": wake},
                state.lower(),
                reason,
                when,
                consume=talk.watermark(job),
            )
            row = self.driver.job_get(conn, where) if reached == WAITING_EXTERNAL else None
            if row is not None and row.replies_received > row.replies_consumed:
                # A reply came while the run was under way (it did not see it): the wait for
                # a reply is over before it began.
                clock = self._clock(conn, when)
                job_id = self.driver.job_update_from(
                    conn,
                    where,
                    (WAITING_EXTERNAL,),
                    {"state": READY, "run_after": None, "wait_reason": None, "updated_at": clock},
                )
                if job_id is not None:
                    note = "a reply came during the run"
                    self.driver.attempt_insert(conn, job_id, None, None, "resumed", note, clock)
                    self.driver.job_ready_notify(conn)

    def schedule(
        self,
        job: Any,
        scheduled_for: Time,
        reason: str,
        subject_version: str | int | None = None,
        cancellation_condition: Any = None,
        *,
        now: Time | None = None,
    ) -> None:
        """Set a business timer on ``job``: at ``scheduled_for`` it becomes eligible, and its
        handler re-reads the subject (``Lease.timer``): a changed version or a holding
        cancellation condition means cancel or re-plan instead of acting.

        ``job`` is a :class:`Lease` (the holder re-plans: LEASED -> READY, fenced by its
        epoch) or a job id / ``(tenant, action)`` for a job that is READY (stays READY,
        delayed) or waiting (stays waiting; the timer wakes it).
        """
        at = valid_time("scheduled_for", scheduled_for)
        if at is None:
            raise JobError("scheduled_for", "is required")
        if not isinstance(reason, str) or not reason:
            raise JobError("reason", "must be a non-empty string")
        version = valid_version("subject_version", subject_version)
        valid_json("cancellation_condition", cancellation_condition)
        when = valid_time("now", now)
        timer_values = {
            "run_after": at,
            "timer_scheduled_for": at,
            "timer_reason": reason,
            "timer_subject_version": version,
            "timer_cancellation_condition": cancellation_condition,
        }
        if isinstance(job, Lease):
            with self.driver.begin() as conn:
                self._move(
                    conn,
                    jobs.c.id == job.job_id,
                    str(job.job_id),
                    job.worker,
                    job.epoch,
                    READY,
                    {**timer_values, "wait_reason": None},
                    "scheduled",
                    reason,
                    when,
                    clear_timer=False,
                    consume=talk.watermark(job),
                )
            return
        where, label = job_key(job, None)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            moved = self.driver.job_update_from(
                conn, where, (READY, *WAITING), {**timer_values, "updated_at": clock}
            )
            if moved is not None:  # a timer: a head with hold="run" lets its line pass
                order_keys.release(conn, [moved], ended=False, now=clock)
            if moved is None:
                state = self._state(conn, where, label)
                # A timer on a leased, finished or attention-needing job is not ours to set.
                if state == LEASED:
                    raise Conflict(f"job {label} is leased: its holder schedules it")
                check_transition(label, state, READY)
                raise Conflict(f"job {label} changed meanwhile")  # pragma: no cover

    def cancel(
        self,
        job: Any,
        action: str | None = None,
        worker: str | None = None,
        epoch: int | None = None,
        *,
        reason: str | None = None,
        now: Time | None = None,
    ) -> str:
        """-> CANCELLED. Given a lease (or worker and epoch) it is the holder's fenced move;
        otherwise an operator's, allowed from READY, waiting states and NEEDS_ATTENTION.

        A LEASED job (an operator's cancel) is not moved under its holder: a cancel request
        is recorded (``cancel_requested_at``, ``cancel_reason``, a ``cancel_requested`` row in
        its history). Its holder sees it (``JobContext.cancelled``; a worker cancels an
        ``async def`` handler's task, and ``dispatch`` starts no new effect), and the run's
        end, whatever it is, moves the job to CANCELLED. An effect whose intent was written
        before keeps its receipt: a cancel cannot recall an email.

        Returns the job's state after the call: CANCELLED, or LEASED when a request was
        recorded."""
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        when = valid_time("now", now)
        if isinstance(job, Lease) or worker is not None or epoch is not None:
            where, label, who, epoch_ = valid_holder(job, action, worker, epoch)
            with self.driver.begin() as conn:
                self._move(
                    conn,
                    where,
                    label,
                    who,
                    epoch_,
                    CANCELLED,
                    {"wait_reason": reason},
                    "cancelled",
                    reason,
                    when,
                )
            return CANCELLED
        where, label = job_key(job, action)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            return cancels.operator_cancel(
                self.driver, conn, where, label, cancels.identity_of(job, action), reason, clock
            )

    def _move(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        label: str,
        worker: str,
        epoch: int,
        target: str,
        values: dict[str, Any],
        outcome: str,
        note: str | None,
        when: float | None,
        *,
        clear_timer: bool = True,
        consume: int | None = None,
    ) -> str:
        """The holder's move LEASED -> ``target``, ended lease, history row; the replies the
        run saw consumed up to ``consume`` (``consumer.jobs.replies``). A cancel requested
        during the run makes it CANCELLED instead. Returns the state reached."""
        check_transition(label, LEASED, target)
        clock = self._clock(conn, when)
        moved = {**values, "state": target, "lease_owner": None, "lease_expires_at": None}
        if clear_timer:
            moved.update(NO_TIMER)
        if target == CANCELLED:
            job_id = self._cas(conn, where, label, worker, epoch, target, moved, clock)
        else:
            # Its own end first, fenced on "no cancel request": a request that commits while
            # this waits for the row makes it match nothing (PostgreSQL re-reads the row), and
            # the cancelled end below takes it. Never the other order: a request committed
            # between the two statements would be overwritten by a DONE.
            found = self.driver.job_update_fenced(
                conn,
                where & jobs.c.cancel_requested_at.is_(None),
                worker,
                epoch,
                {**moved, "updated_at": clock},
            )
            if found is None:
                ended = self.driver.job_update_fenced(
                    conn,
                    where & jobs.c.cancel_requested_at.is_not(None),
                    worker,
                    epoch,
                    {**cancels.ENDED_BY_CANCEL, **NO_TIMER, "updated_at": clock},
                )
                if ended is not None:
                    note = f"cancel requested; the run ended {outcome}"
                    self.driver.attempt_insert(conn, ended, epoch, worker, "cancelled", note, clock)
                    settle_children(self.driver, conn, [ended], clock)
                    order_keys.release(conn, [ended], ended=True, now=clock)
                    return CANCELLED
                self._diagnose(conn, where, label, worker, epoch)
            assert found is not None
            job_id = found
        self.driver.attempt_insert(conn, job_id, epoch, worker, outcome, note, clock)
        if consume is not None:  # the callers pass it for the ends that consume
            talk.consume(self.driver, conn, job_id, consume, clock)
        if target in _PARENT_ENDS:  # its dependents learn it in the same transaction
            settle_children(self.driver, conn, [job_id], clock)
        if order_keys.releases(target, values.get("timer_scheduled_for") is not None):
            order_keys.release(conn, [job_id], ended=target in (CANCELLED, DONE), now=clock)
        return target

    def _cas(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        label: str,
        worker: str,
        epoch: int,
        target: str,
        values: dict[str, Any],
        clock: float,
    ) -> int:
        # The fence: one UPDATE matching (job, epoch, owner, LEASED); no row = Conflict.
        job_id = self.driver.job_update_fenced(
            conn, where, worker, epoch, {**values, "updated_at": clock}
        )
        if job_id is None:
            self._diagnose(conn, where, label, worker, epoch)
        assert job_id is not None
        return job_id

    def _diagnose(
        self, conn: Connection, where: ColumnElement[bool], label: str, worker: str, epoch: int
    ) -> None:
        row = self.driver.job_lease_state(conn, where)
        if row is None:
            raise JobNotFound(f"no job {label}")
        raise Conflict(
            f"job {label}: {worker} with epoch {epoch} is fenced out "
            f"(state {row.state}, epoch {row.lease_epoch}, owner {row.lease_owner})"
        )


_PARENT_ENDS = (DONE, CANCELLED, NEEDS_ATTENTION, WAITING_REVIEW)
