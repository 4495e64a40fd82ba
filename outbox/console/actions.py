"""The console's actions: each one existing operation of the library, audited.

| action  | target       | the library's operation                         |
|---------|--------------|-------------------------------------------------|
| requeue | event        | ``relay.admin.requeue`` (``outbox-relay requeue``) |
| replay  | dead letter  | ``consumer.admin.replay_dead_letter`` (``outbox-consumer replay``) |
| resume  | job          | ``Store.resume``                                |
| cancel  | job          | ``Store.cancel``                                |
| settle  | receipt      | ``Operations.settle`` (``outbox-worker settle``) |
| pause   | queue        | ``Store.pause_queue`` (``outbox-worker queues pause``) |
| resume  | queue        | ``Store.resume_queue`` (``outbox-worker queues resume``) |

Each asks for a reason and writes one ``outbox_audit`` row (``outbox.console.schema``): who,
what, when, the reason, the target before and after, and the outcome. A refused action
(unknown id, a state that does not allow it: pausing a paused queue, resuming a running
one) is audited too, with the refusal as its outcome,
and raises :class:`ActionRefused` (the API answers 404 or 409).

An action and its audit row commit together or not at all (issue 53): the library operation
runs in the audit's transaction (the job store's calls joined to it,
``JobDriver.joined``; the requeue and the replay given it), in a savepoint a refusal rolls
back, and the audit row is written in the same transaction. What the audit row holds (the
reason, the operator's name, the client) is checked first (``outbox.validate.check_text``:
no NUL, no lone surrogate, bounded): bad text is a 400 before anything is written. A replay
publishes its entry before that commit (a broker is no part of the transaction): a commit
that fails after it leaves the entry published and the record NEEDS_ATTENTION, as a crash
there always did.

Bulk actions take a list's filter: :func:`bulk_preview` counts what it matches (at most
:data:`BULK_CAP`), :func:`bulk_apply` runs the one operation on each match, oldest first.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection, Engine

from consumer.admin import replay_dead_letter
from consumer.errors import (
    AlreadyReplayed,
    Conflict,
    DeadLetterNotFound,
    IllegalTransition,
    JobError,
    JobNotFound,
    OperationError,
)
from consumer.inbox import NEEDS_ATTENTION as DL_NEEDS_ATTENTION
from consumer.inbox import inbox_for
from consumer.jobs.driver import jobs_supported
from consumer.jobs.operations import Operations
from consumer.jobs.schema import db_epoch, jobs, operations
from consumer.jobs.states import STATES as JOB_STATES
from consumer.jobs.store import Store
from outbox.console import queries
from outbox.console.queries import Tables
from outbox.console.schema import audit
from outbox.schema import QUARANTINED, OutboxSchema
from outbox.validate import INT64_MAX, check_name, int_problem, text_problem
from relay.admin import requeue

ACTIONS = ("requeue", "replay", "resume", "cancel", "settle", "pause")
BULK_CAP = 1000
"""A bulk action takes at most this many records (run it again for the next ones)."""
MAX_REASON = 2000


class ActionError(Exception):
    """An action the console cannot take. ``status``: the HTTP status the API answers."""

    status = 400


class ActionRefused(ActionError):
    """The target does not exist (404) or its state does not allow the action (409)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Actor:
    """Who acts: the name the operator gave, how they signed in, from where."""

    name: str = "console"
    via: str = "bearer"
    client: str | None = None


@dataclass(frozen=True)
class Outcome:
    """What one action did: the target before and after, and its audit row's id."""

    action: str
    target_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    audit_id: int
    result: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "target_id": self.target_id,
            "before": self.before,
            "after": self.after,
            "audit_id": self.audit_id,
            "result": self.result,
        }


def check_reason(reason: Any) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise ActionError("reason: every action needs a reason (a non-empty text)")
    problem = text_problem(reason, limit=MAX_REASON)
    if problem is not None:
        raise ActionError(f"reason: {problem} (at most {MAX_REASON} characters, no NUL)")
    return reason.strip()


def check_actor(actor: Actor) -> Actor:
    """The actor as the audit row holds it: a name of text it can store (else a 400 before
    anything is written), the client address made printable."""
    problem = text_problem(actor.name, limit=200)
    if problem is not None:
        raise ActionError(f"by: {problem}")
    client = actor.client
    if client is not None and text_problem(client, limit=200) is not None:
        client = ascii(client)[1:-1][:200]
    return Actor(actor.name, actor.via, client)


_JOB_KINDS = ("job", "receipt", "queue", "schedule")
"""The targets that live in the job store (PostgreSQL and SQLite only)."""

_REFUSALS = (
    Conflict,
    IllegalTransition,
    OperationError,
    AlreadyReplayed,
    JobNotFound,
    DeadLetterNotFound,
    ActionRefused,
)
"""What an operation raises when its target's state does not allow it: audited, 404/409."""


def _clean(text: str) -> str:
    """A text the audit can store whatever it quotes (an error naming a bad value)."""
    return text if text_problem(text, limit=len(text)) is None else ascii(text)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)  # ASCII: a surrogate or NUL is escaped, not stored


class Actions:
    """The actions on one database (and the Redis a replay writes to)."""

    def __init__(
        self, engine: Engine, outbox_schema: OutboxSchema, tables: Tables, redis: Any
    ) -> None:
        self.engine = engine
        self.outbox_schema = outbox_schema
        self.tables = tables
        self.redis = redis
        # The job store runs on PostgreSQL and SQLite only: on MySQL/MariaDB the console
        # shows and acts on the outbox and the inbox, and refuses the jobs' actions.
        self.store = Store(engine, create_schema=False) if jobs_supported(engine) else None
        self.inbox = inbox_for(engine, tables.inbox)

    def _jobs(self) -> Store:
        """The job store; refused (404: no such job here) where the database has none."""
        if self.store is None:
            raise ActionRefused(
                f"the job store is not in this database ({self.engine.dialect.name}): "
                "it runs on PostgreSQL or SQLite",
                404,
            )
        return self.store

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        """The action's transaction, with the job store's calls joined to it where there is a
        job store (its own begin: SQLite's write lock), else the engine's."""
        if self.store is None:
            with self.engine.begin() as conn:
                yield conn
            return
        driver = self.store.driver
        with driver.begin() as conn, driver.joined(conn):
            yield conn

    # -- reading a target ----------------------------------------------------------------

    def _read(self, conn: Connection, kind: str, target_id: str) -> dict[str, Any] | None:
        """The target as it stands in ``conn``'s transaction (the job store's reads joined
        to it)."""
        t = self.tables.outbox
        dl = self.tables.inbox.dead_letters
        if kind == "event":
            query = select(t).where(t.c.event_id == target_id)
        elif kind == "dead_letter":
            query = select(dl).where(dl.c.id == int(target_id))
        elif kind == "job":
            query = select(jobs).where(jobs.c.id == int(target_id))
        elif kind == "queue":
            return self._jobs().depth(target_id)[target_id].as_dict()  # any name is a queue
        elif kind == "schedule":
            found = [s for s in self._jobs().schedules() if s.name == target_id]
            return found[0].as_dict() if found else None
        else:
            query = select(operations).where(operations.c.operation_id == target_id)
        row = conn.execute(query).first()
        if row is None:
            return None
        return {k: queries.jsonable(v) for k, v in row._mapping.items()}

    # -- the audit -----------------------------------------------------------------------

    def _audit(
        self,
        conn: Connection,
        actor: Actor,
        action: str,
        kind: str,
        target_id: str,
        reason: str,
        outcome: str,
        before: Any,
        after: Any,
        bulk: str | None,
    ) -> int:
        """The audit row, in ``conn``'s transaction: the action's own."""
        now = float(conn.execute(select(db_epoch())).scalar_one())
        result = conn.execute(
            insert(audit)
            .values(
                at=now,
                actor=actor.name[:200],
                via=actor.via[:16],
                client=(actor.client or "")[:200] or None,
                action=action,
                target_kind=kind,
                target_id=target_id[:400],
                reason=reason,
                outcome=_clean(outcome)[:4000],
                before=None if before is None else _dumps(before),
                after=None if after is None else _dumps(after),
                bulk=bulk,
            )
            .returning(audit.c.id)
        )
        return int(result.scalar_one())

    def _run(
        self,
        actor: Actor,
        action: str,
        kind: str,
        target_id: str,
        reason: Any,
        operation: Callable[[Connection], Any],
        bulk: str | None = None,
    ) -> Outcome:
        why = check_reason(reason)
        who = check_actor(actor)
        if text_problem(target_id, limit=400) is not None:
            raise ActionRefused(f"no {kind.replace('_', ' ')} {ascii(target_id)[:60]}", 404)
        if kind in _JOB_KINDS:
            self._jobs()
        refused: ActionRefused | None = None
        result: Any = None
        # One transaction: the operation (a savepoint a refusal rolls back) and its audit row.
        with self._transaction() as conn:
            before = self._read(conn, kind, target_id)
            if before is None:
                outcome, after = "refused: not found", None
                refused = ActionRefused(f"no {kind.replace('_', ' ')} {target_id!r}", 404)
            else:
                try:
                    with conn.begin_nested():
                        result = operation(conn)
                    outcome = "ok"
                except _REFUSALS as exc:
                    outcome = f"refused: {exc}"
                    status = 404 if isinstance(exc, LookupError) else 409
                    refused = ActionRefused(str(exc), status)
                except JobError as exc:
                    raise ActionError(str(exc)) from None
                after = self._read(conn, kind, target_id)
            audit_id = self._audit(
                conn, who, action, kind, target_id, why, outcome, before, after, bulk
            )
        if refused is not None:
            raise refused
        return Outcome(action, target_id, before, after, audit_id, result)

    # -- the five actions ----------------------------------------------------------------

    def requeue_event(
        self, event_id: str, reason: Any, actor: Actor, bulk: str | None = None
    ) -> Outcome:
        def operation(conn: Connection) -> Any:
            result = requeue(self.engine, self.outbox_schema, [event_id], joined=conn)
            if result.not_quarantined:
                state = result.not_quarantined[event_id]
                raise ActionRefused(f"event {event_id} is {state}, not quarantined")
            if result.unknown:
                raise ActionRefused(f"no event {event_id!r}", 404)
            return {"requeued": result.requeued}

        return self._run(actor, "requeue", "event", event_id, reason, operation, bulk)

    def replay_dead_letter(
        self, entry_id: str, reason: Any, actor: Actor, bulk: str | None = None
    ) -> Outcome:
        record = _record_id(entry_id)

        def operation(conn: Connection) -> Any:
            entry = replay_dead_letter(self.inbox, self.redis, record, joined=conn)
            return {"new_entry_id": entry}

        return self._run(actor, "replay", "dead_letter", str(record), reason, operation, bulk)

    def resume_job(
        self, job_id: str, reason: Any, actor: Actor, bulk: str | None = None
    ) -> Outcome:
        ident = _job_id(job_id)
        why = reason if isinstance(reason, str) else None

        def operation(conn: Connection) -> Any:
            self._jobs().resume(ident, reason=f"console: {why} (by {actor.name})")

        return self._run(actor, "resume", "job", str(ident), reason, operation, bulk)

    def cancel_job(
        self, job_id: str, reason: Any, actor: Actor, bulk: str | None = None
    ) -> Outcome:
        ident = _job_id(job_id)
        why = reason if isinstance(reason, str) else None

        def operation(conn: Connection) -> Any:
            # A LEASED job gets a cancel request: its run ends it (``Store.cancel``).
            state = self._jobs().cancel(ident, reason=f"console: {why} (by {actor.name})")
            return {"state": state, "requested": state != "CANCELLED"}

        return self._run(actor, "cancel", "job", str(ident), reason, operation, bulk)

    def settle_receipt(
        self,
        operation_id: str,
        reason: Any,
        actor: Actor,
        *,
        accepted: Any = None,
        not_sent: Any = False,
    ) -> Outcome:
        if accepted in ("", None) and not_sent is not True:
            raise ActionError('settle: give {"accepted": REF} or {"not_sent": true}')
        if accepted not in ("", None) and not_sent is True:
            raise ActionError("settle: accepted and not_sent exclude each other")
        if accepted not in ("", None) and not isinstance(accepted, str):
            raise ActionError("accepted: the provider's reference, a text")
        ref = accepted if accepted not in ("", None) else None
        why = reason if isinstance(reason, str) else None

        def operation(conn: Connection) -> Any:
            receipt = Operations(self._jobs()).settle(
                operation_id, accepted=ref, not_sent=ref is None, reason=why, by=actor.name
            )
            return receipt.as_dict()

        return self._run(actor, "settle", "receipt", operation_id, reason, operation)

    def pause_queue(self, queue: str, reason: Any, actor: Actor) -> Outcome:
        """No worker claims from ``queue`` until it is resumed (the jobs in hand run to their
        end). A queue with no jobs yet may be paused; pausing a paused one is refused."""
        name = _queue_name(queue)

        def operation(conn: Connection) -> Any:
            if not self._jobs().pause_queue(name):
                raise ActionRefused(f"queue {name} is paused already")
            return {"paused": True}

        return self._run(actor, "pause", "queue", name, reason, operation)

    def resume_queue(self, queue: str, reason: Any, actor: Actor) -> Outcome:
        """Workers claim from ``queue`` again; resuming a queue that is not paused is
        refused."""
        name = _queue_name(queue)

        def operation(conn: Connection) -> Any:
            if not self._jobs().resume_queue(name):
                raise ActionRefused(f"queue {name} is not paused")
            return {"paused": False}

        return self._run(actor, "resume", "queue", name, reason, operation)

    def pause_schedule(self, name: str, reason: Any, actor: Actor) -> Outcome:
        """The schedule fires nothing until resumed; pausing a paused one is refused."""
        target = _schedule_name(name)

        def operation(conn: Connection) -> Any:
            if not self._jobs().pause_schedule(target):
                raise ActionRefused(f"schedule {target} is paused already")
            return {"paused": True}

        return self._run(actor, "pause", "schedule", target, reason, operation)

    def resume_schedule(self, name: str, reason: Any, actor: Actor) -> Outcome:
        """The schedule fires again from its next slot; resuming a running one is refused."""
        target = _schedule_name(name)

        def operation(conn: Connection) -> Any:
            if not self._jobs().resume_schedule(target):
                raise ActionRefused(f"schedule {target} is not paused")
            return {"paused": False}

        return self._run(actor, "resume", "schedule", target, reason, operation)

    # -- bulk ----------------------------------------------------------------------------

    # complexity: one branch per bulk action's table and filter (owner: the console)
    def bulk_targets(self, kind: str, filters: dict[str, str]) -> tuple[Any, Any, Any, Any]:
        """(table, id column, where, order) of a bulk action's filter."""
        if kind == "requeue":
            t = self.tables.outbox
            if (filters.get("state") or QUARANTINED) != QUARANTINED:
                raise ActionError("state: only quarantined events can be requeued")
            where = queries.event_filter(
                t, filters.get("topic") or None, filters.get("key") or None, QUARANTINED
            )
            return t, t.c.event_id, where, t.c.seq
        if kind in ("resume", "cancel"):
            state = filters.get("state") or None
            if state is not None and state not in JOB_STATES:
                raise ActionError(f"state: not a job state: {state!r}")
            if state is None:
                raise ActionError("state: a bulk job action needs a state filter")
            where = queries.job_filter(
                state, filters.get("tenant") or None, filters.get("action") or None
            )
            return jobs, jobs.c.id, where, jobs.c.id
        if kind == "replay":
            dl = self.tables.inbox.dead_letters
            where = queries.dead_letter_filter(dl, filters.get("group") or None, DL_NEEDS_ATTENTION)
            return dl, dl.c.id, where, dl.c.id
        raise ActionError(f"no bulk {kind!r}: one of requeue, replay, resume, cancel")

    def bulk_preview(self, kind: str, filters: dict[str, str]) -> int:
        """How many records the bulk action would take (``BULK_CAP`` + 1 means more)."""
        table, _, where, _ = self.bulk_targets(kind, filters)
        with self.engine.connect() as conn:
            return queries.count_matching(conn, table, where, BULK_CAP)

    def bulk_apply(
        self, kind: str, filters: dict[str, str], reason: Any, actor: Actor
    ) -> dict[str, Any]:
        """Run the action on each match (at most ``BULK_CAP``), each audited."""
        check_reason(reason)
        _, column, where, order = self.bulk_targets(kind, filters)
        with self.engine.connect() as conn:
            targets = queries.ids_matching(conn, column, where, order, BULK_CAP)
        tag = json.dumps({"action": kind, **filters}, sort_keys=True)[:400]
        one = {
            "requeue": self.requeue_event,
            "replay": self.replay_dead_letter,
            "resume": self.resume_job,
            "cancel": self.cancel_job,
        }[kind]
        done, refused = [], {}
        for target in targets:
            try:
                done.append(one(str(target), reason, actor, bulk=tag).target_id)
            except ActionRefused as exc:
                refused[str(target)] = str(exc)
        return {"action": kind, "filters": filters, "done": done, "refused": refused}


def _job_id(value: str) -> int:
    if int_problem(value, minimum=1, maximum=INT64_MAX) is not None:
        raise ActionRefused(f"no job {value!r} (a job id is a number in ASCII digits)", 404)
    return int(value)


def _queue_name(value: str) -> str:
    try:
        check_name("queue", value, JobError)
    except JobError as exc:
        raise ActionError(str(exc)) from None
    return value


def _schedule_name(value: str) -> str:
    try:
        check_name("schedule", value, JobError)
    except JobError as exc:
        raise ActionError(str(exc)) from None
    return value


def _record_id(value: str) -> int:
    if int_problem(value, minimum=1, maximum=INT64_MAX) is not None:
        raise ActionRefused(
            f"no dead letter {value!r} (a record id is a number in ASCII digits)", 404
        )
    return int(value)
