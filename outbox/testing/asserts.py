"""Assertions that read well in a failing test: each says what it expected and shows what it
found instead (the matching rows, and the totals around them).

Mixed into :class:`outbox.testing.Pipeline`; every one reads the database (or the fake
providers) as it is now, so call them after ``drain()``:

- :meth:`Assertions.assert_emitted`: events in the outbox, by topic, key, identity or tenant;
- :meth:`Assertions.assert_jobs` and :meth:`Assertions.assert_receipts`: jobs and operation
  receipts by state (exactly the states named, every other state empty);
- :meth:`Assertions.assert_effects`: the effects the fake providers made for one business
  identity (a job's ``action``, or ``tenant:action``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from consumer.jobs.schema import jobs, operations

if TYPE_CHECKING:
    from consumer import Store
    from outbox.core import Outbox
    from outbox.testing.fake import FakeProvider

_SHOWN = 20  # rows a failure message lists at most


@dataclass(frozen=True)
class Effect:
    """One effect a fake provider made, with the job it was made for."""

    provider: str
    ref: str
    operation_id: str | None
    job_id: int | None
    tenant: str | None
    action: str | None
    body: Any
    time: float

    @property
    def identity(self) -> str:
        """``tenant:action`` of its job (``?`` for an effect no job of this store made)."""
        return f"{self.tenant}:{self.action}" if self.action is not None else "?"

    def __str__(self) -> str:
        return (
            f"{self.provider} effect {self.ref} for {self.identity} "
            f"(operation {self.operation_id}, body {json.dumps(self.body, sort_keys=True)})"
        )


class Assertions:
    """The assertions of a pipeline (module docstring)."""

    engine: Engine
    store: Store
    outbox: Outbox
    fakes: list[FakeProvider]
    failures: list[str]

    def _failed(self, lines: list[str]) -> AssertionError:
        """An assertion's error, with the handler failures the drains met (the usual reason
        a job or an effect is missing)."""
        seen = getattr(self, "failures", [])
        if seen:
            lines = [*lines, f"handler failures during drain() ({len(seen)}):"]
            lines += [f"  {f}" for f in seen[-_SHOWN:]]
        return AssertionError("\n".join(lines))

    # -- events -----------------------------------------------------------------------------

    def events(
        self,
        topic: str | None = None,
        *,
        key: str | None = None,
        identity: str | None = None,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]:
        """The events in the outbox (emitted and committed), oldest first, filtered."""
        table = self.outbox.table
        query = sa.select(
            table.c.seq,
            table.c.event_id,
            table.c.topic,
            table.c.key,
            table.c.identity,
            table.c.tenant,
            table.c.payload,
            table.c.state,
        ).order_by(table.c.seq)
        for column, value in (("topic", topic), ("key", key), ("identity", identity)):
            if value is not None:
                query = query.where(table.c[column] == value)
        if tenant is not None:
            query = query.where(table.c.tenant == tenant)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [{**row, "payload": _json(row["payload"])} for row in (dict(r) for r in rows)]

    def assert_emitted(
        self,
        topic: str,
        count: int = 1,
        *,
        key: str | None = None,
        identity: str | None = None,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]:
        """Exactly ``count`` events of ``topic`` (with that key, identity, tenant) were
        emitted and committed; returns them."""
        found = self.events(topic, key=key, identity=identity, tenant=tenant)
        if len(found) != count:
            every = self.events()
            by_topic: dict[str, int] = {}
            for event in every:
                by_topic[event["topic"]] = by_topic.get(event["topic"], 0) + 1
            wanted = _described(topic=topic, key=key, identity=identity, tenant=tenant)
            lines = [f"expected {count} event(s) {wanted}, found {len(found)}"]
            lines += [f"  {_event_line(e)}" for e in found[:_SHOWN]]
            others = [e for e in every if e not in found and e["topic"] == topic]
            if others:
                lines.append(f"other {topic} events:")
                lines += [f"  {_event_line(e)}" for e in others[:_SHOWN]]
            lines.append(f"the outbox holds {len(every)} event(s) by topic: {by_topic}")
            raise self._failed(lines)
        return found

    # -- jobs and receipts ------------------------------------------------------------------

    def job_rows(self, *, action: str | None = None, tenant: str | None = None) -> list[Any]:
        """The job rows (id, tenant, action, state, attempts, run_after, last_error,
        wait_reason), by id; ``action`` matches the action or its prefix before a separator
        (``send-quote`` matches ``send-quote-17``)."""
        query = sa.select(
            jobs.c.id,
            jobs.c.tenant,
            jobs.c.action,
            jobs.c.state,
            jobs.c.attempts,
            jobs.c.run_after,
            jobs.c.last_error,
            jobs.c.wait_reason,
        ).order_by(jobs.c.id)
        if tenant is not None:
            query = query.where(jobs.c.tenant == tenant)
        with self.engine.connect() as conn:
            rows = list(conn.execute(query))
        if action is not None:
            rows = [r for r in rows if _action_matches(r.action, action)]
        return rows

    def assert_jobs(
        self, *, action: str | None = None, tenant: str | None = None, **states: int
    ) -> None:
        """Jobs by state, exactly: ``assert_jobs(DONE=1)`` means one DONE job and no job in
        any other state (of ``action`` / ``tenant`` when given)."""
        rows = self.job_rows(action=action, tenant=tenant)
        found = _tally(r.state for r in rows)
        wanted = {state.upper(): n for state, n in states.items() if n}
        if found != wanted:
            scope = _described(action=action, tenant=tenant)
            lines = [f"expected jobs {wanted}{' ' + scope if scope else ''}, found {found}:"]
            lines += [f"  {_job_line(r)}" for r in rows[:_SHOWN]]
            if len(rows) > _SHOWN:
                lines.append(f"  ... and {len(rows) - _SHOWN} more")
            raise self._failed(lines)

    def receipt_rows(self) -> list[Any]:
        """The operation receipts with their job's tenant and action, by creation."""
        query = (
            sa.select(
                operations.c.operation_id,
                operations.c.provider,
                operations.c.state,
                operations.c.provider_ref,
                operations.c.attempts,
                operations.c.last_error,
                operations.c.settled_by,
                jobs.c.tenant,
                jobs.c.action,
            )
            .select_from(operations.outerjoin(jobs, jobs.c.id == operations.c.job_id))
            .order_by(operations.c.created_at, operations.c.operation_id)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def receipt_counts(self) -> dict[str, int]:
        """Receipts by state (states with none left out)."""
        return _tally(r.state for r in self.receipt_rows())

    def assert_receipts(self, **states: int) -> None:
        """Receipts by state, exactly: ``assert_receipts(ACCEPTED=1)``."""
        rows = self.receipt_rows()
        found = _tally(r.state for r in rows)
        wanted = {state.upper(): n for state, n in states.items() if n}
        if found != wanted:
            lines = [f"expected receipts {wanted}, found {found}:"]
            lines += [f"  {_receipt_line(r)}" for r in rows[:_SHOWN]]
            raise self._failed(lines)

    # -- effects ----------------------------------------------------------------------------

    def effects(self, identity: str | None = None) -> list[Effect]:
        """The effects the pipeline's fake providers made, in order, each with its job; with
        ``identity``, only those of jobs whose action (or ``tenant:action``) it is."""
        made: list[Effect] = []
        for fake in self.fakes:
            for raw in fake.effects:
                made.append(self._effect(fake.name, raw))
        made.sort(key=lambda e: e.time)
        if identity is None:
            return made
        return [e for e in made if identity in (e.action, e.identity)]

    def _effect(self, provider: str, raw: Mapping[str, Any]) -> Effect:
        operation_id = raw.get("operation_id")
        job_id: int | None = None
        tenant = action = None
        if isinstance(operation_id, str) and operation_id.partition(":")[0].isdigit():
            job_id = int(operation_id.partition(":")[0])
            with self.engine.connect() as conn:
                row = conn.execute(
                    sa.select(jobs.c.tenant, jobs.c.action).where(jobs.c.id == job_id)
                ).first()
            if row is not None:
                tenant, action = row.tenant, row.action
        return Effect(
            provider=provider,
            ref=str(raw["id"]),
            operation_id=operation_id,
            job_id=job_id,
            tenant=tenant,
            action=action,
            body=raw.get("body"),
            time=float(raw.get("time") or 0.0),
        )

    def assert_effects(self, identity: str, count: int = 1) -> list[Effect]:
        """Exactly ``count`` customer-visible effects were made for the business identity
        ``identity`` (a job's action, or ``tenant:action``), whatever the retries, timeouts
        and kills; returns them."""
        every = self.effects()
        found = [e for e in every if identity in (e.action, e.identity)]
        if len(found) != count:
            lines = [f"expected {count} effect(s) for {identity!r}, found {len(found)}"]
            lines += [f"  {e}" for e in found[:_SHOWN]]
            per = _tally(e.identity for e in every)
            lines.append(f"effects by identity: {per if per else 'none at all'}")
            if not self.fakes:
                lines.append("(only fake providers record effects: pipeline.fake_provider())")
            raise self._failed(lines)
        return found


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _tally(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return dict(sorted(counts.items()))


def _described(**fields: str | None) -> str:
    return " ".join(f"{name}={value!r}" for name, value in fields.items() if value is not None)


def _action_matches(action: str, wanted: str) -> bool:
    return action == wanted or (
        action.startswith(wanted) and len(action) > len(wanted) and action[len(wanted)] in "-:/.#_"
    )


def _event_line(event: Mapping[str, Any]) -> str:
    payload = json.dumps(event["payload"], sort_keys=True, default=str)
    if len(payload) > 120:
        payload = payload[:117] + "..."
    return (
        f"#{event['seq']} {event['topic']} key={event['key']} identity={event['identity']}"
        f" tenant={event['tenant']} {event['state']} {payload}"
    )


def _job_line(row: Any) -> str:
    line = f"#{row.id} {row.tenant}/{row.action} {row.state} attempts={row.attempts}"
    if row.wait_reason:
        line += f" reason={row.wait_reason!r}"
    if row.last_error:
        line += f" last_error={str(row.last_error)[:200]!r}"
    return line


def _receipt_line(row: Any) -> str:
    line = (
        f"{row.operation_id} ({row.tenant}/{row.action}) {row.provider} {row.state}"
        f" ref={row.provider_ref} attempts={row.attempts}"
    )
    if row.last_error:
        line += f" last_error={str(row.last_error)[:200]!r}"
    if row.settled_by:
        line += f" settled_by={row.settled_by}"
    return line
