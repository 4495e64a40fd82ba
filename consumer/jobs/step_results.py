"""Results: what a handler returned, stored as its job's ``result`` by the finish, read by the
job's dependents (``JobContext.results``) and awaited by callers (``Store.result`` /
``Store.aresult``).

- **The cap.** A result is JSON of at most :data:`MAX_RESULT_BYTES` bytes (UTF-8, compact
  separators). A larger one is never truncated: the run fails permanently
  (:class:`~consumer.errors.ResultTooLarge`; the job goes to WAITING_REVIEW with that
  reason), and ``Store.finish(..., result=...)`` raises it, for a value that is not JSON too.
  A handler that returns a receipt (``return job.dispatch(...)``) stores its dict; one that
  returns an object that is not JSON stores no result (a warning says so): its effect
  happened, and such handlers were written before results.
- **Waiting** polls the job's row with a short interval that grows from 5 ms to 250 ms (no
  LISTEN: a finish sends no notification). DONE returns the result (None when the handler
  returned nothing); NEEDS_ATTENTION and CANCELLED raise
  :class:`~consumer.errors.ResultUnavailable`; a job still open after ``timeout`` raises
  :class:`~consumer.errors.ResultTimeout`; an unknown job ``JobNotFound``. A job in
  WAITING_REVIEW is waited for: a person decides whether it runs again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from consumer.errors import JobError, JobNotFound, ResultTimeout, ResultTooLarge, ResultUnavailable
from consumer.jobs.base import StoreBase
from consumer.jobs.checks import job_key
from consumer.jobs.receipts import Receipt
from consumer.jobs.schema import job_steps, jobs
from consumer.jobs.states import CANCELLED, DONE, NEEDS_ATTENTION
from consumer.jobs.step_graph import MAX_GRAPH_JOBS, StepGraph, walk_graph
from outbox.logs import fields

__all__ = ["MAX_RESULT_BYTES", "ResultMethods", "checked_result", "parent_results", "run_result"]

log = logging.getLogger("outbox.worker")

MAX_RESULT_BYTES = 65_536
"""The largest result a job may store: 64 KiB of JSON. Larger data belongs in the
application's own tables (or object storage); the result then names where it is."""

_FIRST_POLL = 0.005
_LAST_POLL = 0.25


def checked_result(value: Any) -> Any:
    """``value`` if it is JSON within :data:`MAX_RESULT_BYTES`; else ``ResultTooLarge``."""
    try:
        encoded = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ResultTooLarge(f"is not JSON-serialisable ({exc})") from None
    if "\\u0000" in encoded:  # PostgreSQL's jsonb refuses NUL: refused on both databases
        raise ResultTooLarge("must not contain NUL characters")
    size = len(encoded.encode())
    if size > MAX_RESULT_BYTES:
        raise ResultTooLarge(f"is {size} bytes of JSON, over the cap of {MAX_RESULT_BYTES}")
    return value


def run_result(value: Any) -> Any:
    """What a handler returned, as its job's result: a :class:`Receipt` (``return
    job.dispatch(...)``) as its dict; a value that is not JSON at all (an object of the
    application's) is not stored, with a warning: such handlers predate results, and their
    effect happened. Over the cap: ``ResultTooLarge`` (the run fails)."""
    if isinstance(value, Receipt):
        value = value.as_dict()
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        log.warning(
            "a handler's return value is not JSON: no result stored",
            extra=fields(type=type(value).__name__, error=str(exc)[:200]),
        )
        return None
    return checked_result(value)


def parent_results(conn: Connection, job_id: int) -> dict[tuple[str, str], Any]:
    """Each parent's ``(tenant, action)`` and result (None until it is DONE with one)."""
    rows = conn.execute(
        select(jobs.c.tenant, jobs.c.action, jobs.c.result)
        .join(job_steps, job_steps.c.parent_id == jobs.c.id)
        .where(job_steps.c.child_id == job_id)
    ).all()
    return {(r.tenant, r.action): r.result for r in rows}


def _timeout(timeout: float | None) -> float:
    if timeout is None:
        return math.inf
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise JobError("timeout", f"must be a non-negative number of seconds, got {timeout!r}")
    return float(timeout)


class ResultMethods(StoreBase):
    """``Store.result``, ``Store.aresult`` and the graph's reads (parents, children)."""

    def result(self, tenant: str, action: str, *, timeout: float | None = 30.0) -> Any:
        """Wait for the job ``(tenant, action)`` to finish and return its result (module
        docstring). ``timeout`` in seconds (None: no limit)."""
        limit = _timeout(timeout)
        deadline = time.monotonic() + limit
        pause = _FIRST_POLL
        while True:
            state, value, reason = self._result_state(tenant, action)
            if state == DONE:
                return value
            self._raise_ended(tenant, action, state, reason)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResultTimeout(f"{tenant}/{action}", state, f"not finished after {limit} s")
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, _LAST_POLL)

    async def aresult(self, tenant: str, action: str, *, timeout: float | None = 30.0) -> Any:
        """:meth:`result` for asyncio: each read runs in a thread, the waits on the loop."""
        limit = _timeout(timeout)
        deadline = time.monotonic() + limit
        pause = _FIRST_POLL
        while True:
            state, value, reason = await asyncio.to_thread(self._result_state, tenant, action)
            if state == DONE:
                return value
            self._raise_ended(tenant, action, state, reason)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResultTimeout(f"{tenant}/{action}", state, f"not finished after {limit} s")
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 1.5, _LAST_POLL)

    @staticmethod
    def _raise_ended(tenant: str, action: str, state: str, reason: str | None) -> None:
        if state in (NEEDS_ATTENTION, CANCELLED):
            raise ResultUnavailable(f"{tenant}/{action}", state, reason)

    def _result_state(self, tenant: str, action: str) -> tuple[str, Any, str | None]:
        where, label = job_key(tenant, action)
        with self.driver.connect() as conn:
            row = conn.execute(
                select(jobs.c.state, jobs.c.result, jobs.c.wait_reason, jobs.c.last_error).where(
                    where
                )
            ).first()
        if row is None:
            raise JobNotFound(f"no job {label}")
        return str(row.state), row.result, row.wait_reason or row.last_error

    def results_of_parents(self, job_id: int) -> dict[tuple[str, str], Any]:
        """The results of the job's parents, by ``(tenant, action)`` (``JobContext.results``)."""
        with self.driver.connect() as conn:
            return parent_results(conn, job_id)

    def graph(self, job: Any, action: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """The job's parents and children: ``{"parents": [...], "children": [...]}``, each
        ``{"id", "tenant", "action", "state"}`` (the console and the CLI show them)."""
        where, label = job_key(job, action)
        with self.driver.connect() as conn:
            job_id = conn.execute(select(jobs.c.id).where(where)).scalar()
            if job_id is None:
                raise JobNotFound(f"no job {label}")
            found: dict[str, list[dict[str, Any]]] = {}
            for name, mine, theirs in (
                ("parents", job_steps.c.child_id, job_steps.c.parent_id),
                ("children", job_steps.c.parent_id, job_steps.c.child_id),
            ):
                rows = conn.execute(
                    select(jobs.c.id, jobs.c.tenant, jobs.c.action, jobs.c.state)
                    .join(job_steps, theirs == jobs.c.id)
                    .where(mine == job_id)
                    .order_by(jobs.c.id)
                ).all()
                found[name] = [
                    {"id": int(r.id), "tenant": r.tenant, "action": r.action, "state": r.state}
                    for r in rows
                ]
        return found

    def step_graph(
        self, job: Any, action: str | None = None, *, limit: int = MAX_GRAPH_JOBS
    ) -> StepGraph:
        """The job's whole graph of steps, each job at its level, and its progress
        (``consumer.jobs.step_graph``): at most ``limit`` jobs read."""
        where, label = job_key(job, action)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise JobError("limit", f"must be a positive integer, got {limit!r}")
        with self.driver.connect() as conn:
            job_id = conn.execute(select(jobs.c.id).where(where)).scalar()
            if job_id is None:
                raise JobNotFound(f"no job {label}")
            return walk_graph(conn, int(job_id), limit)
