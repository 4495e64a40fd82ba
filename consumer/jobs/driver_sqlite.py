"""SQLite's job driver: every write transaction takes the database's write lock up front
(``BEGIN IMMEDIATE``), so the claim picks its rows in a few statements without row locks, the
batch finish is two statements in that one transaction, and the dispatch path's statements
are text built once.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from sqlalchemy import ColumnElement, Index, func, text
from sqlalchemy.engine import Connection

from consumer.jobs import order_keys
from consumer.jobs import queries as q
from consumer.jobs.driver_base import FencedOut, JobDriver
from consumer.jobs.driver_operations import check_operation_columns
from consumer.jobs.driver_retention import SQLITE_JOB_FINISHED
from consumer.jobs.record_text import RecordStatements
from consumer.jobs.schema import (
    ATTEMPTS_TABLE,
    DELIVERIES_TABLE,
    JOBS_TABLE,
    OPERATIONS_TABLE,
    PROVIDER_LIMITS_TABLE,
    REPLIES_TABLE,
    STEPS_TABLE,
)
from consumer.jobs.states import LEASED
from outbox.dialect import EPOCH_SQL, SQLITE, db_epoch

_NOW = EPOCH_SQL[SQLITE]


class SqliteJobDriver(JobDriver):
    """SQLite: every write transaction holds the database's write lock from its start
    (``BEGIN IMMEDIATE``), so picks and moves need no row locks."""

    name = "sqlite"

    def job_ready_notify(self, conn: Connection) -> None:
        """Nothing: SQLite has no NOTIFY (a worker in the same process is woken by the local
        enqueue; others poll)."""

    def _prepare(self, conn: Connection) -> None:
        conn.execution_options(sqlite_begin="IMMEDIATE")

    # complexity: SQLite's emulation of the PostgreSQL claim scan (no SKIP LOCKED)
    def job_claim_batch(
        self, conn: Connection, params: dict[str, Any], now_given: bool
    ) -> Sequence[Any]:
        # The same rotating (queue, tenant) scan as PostgreSQL's, then each pair's share picked
        # in (priority desc, id) order, then one UPDATE ... RETURNING leasing the picked ids.
        # The write lock is held from BEGIN IMMEDIATE to commit, so the tenant limit's count
        # of LEASED jobs cannot change under this claim.
        queues, routes = params.get("queues"), params.get("routes")
        limit, limits = params.get("tenant_limit"), params.get("tenant_limits") or {}
        scan: dict[str, Any] = {k: params[k] for k in ("cursor", "max_tenants")}
        if queues is not None:
            scan["queues"] = json.dumps(list(queues))
        pairs = [(r[0], r[1]) for r in conn.execute(q.sqlite_tenants(queues is None), scan)]
        if not pairs:
            return []
        per = max(1, math.ceil(params["limit"] / len(pairs)))
        pick_sql = q.sqlite_pick(now_given, routes is not None)
        ids: list[int] = []
        for queue, tenant in pairs:
            share = per
            cap = limits.get(tenant, limit)
            if cap is not None:
                counted = {"queue": queue, "tenant": tenant, "cap": cap}
                leased = int(conn.execute(q.sqlite_leased_count(), counted).scalar_one())
                share = min(share, cap - leased)
                if share <= 0:
                    continue  # at its limit: its jobs stay READY, holding no lease
            pick: dict[str, Any] = {"queue": queue, "tenant": tenant, "per": share}
            if now_given:
                pick["now"] = params["now"]
            if routes is not None:
                pick["routes"] = json.dumps(list(routes))
            ids.extend(int(r[0]) for r in conn.execute(pick_sql, pick))
            if len(ids) >= params["limit"]:
                break
        ids = ids[: params["limit"]]
        if not ids:
            return []
        lease: dict[str, Any] = {"ids": json.dumps(ids), "worker": params["worker"]}
        lease["ttl"] = params["ttl"]
        if now_given:
            lease["now"] = params["now"]
        return conn.execute(q.sqlite_lease(now_given), lease).all()

    def job_finish_batch(
        self, conn: Connection, worker: str, leases: Sequence[tuple[int, int]], when: float | None
    ) -> list[int]:
        # Two statements for the whole batch (one per job before: ~0.5 ms of CPU a job): the
        # fenced UPDATE, then the history rows of the leases it finished, in lease order.
        clock = self.clock_read(conn, when)
        pairs = json.dumps([[int(job_id), int(epoch)] for job_id, epoch in leases])
        params = {"pairs": pairs, "worker": worker, "now": clock}
        finished = {int(r[0]) for r in conn.execute(q.sqlite_finish_batch(), params)}
        if not finished:
            return []
        done = [(job_id, epoch) for job_id, epoch in leases if job_id in finished]
        history = {"pairs": json.dumps(done), "worker": worker, "now": clock}
        conn.execute(q.sqlite_finish_history(), history)
        # The finished heads' order keys: their next jobs promoted in this transaction.
        order_keys.release(conn, [job_id for job_id, _ in done], ended=True, now=clock)
        return [job_id for job_id, _ in done]

    # -- provider limits (consumer.jobs.driver_fleet) ---------------------------------------

    def _statement_clock(self) -> ColumnElement[float]:
        # The database clock: 'now' is one value per statement, and the write lock is held
        # from BEGIN IMMEDIATE, so no reservation waits on a row's lock after reading it.
        return db_epoch()

    def _greatest(self, a: Any, b: Any) -> ColumnElement[float]:
        # SQLite's two-argument max() is PostgreSQL's greatest(), a scalar function.
        return func.max(a, b)

    def _commit_unflushed(self, conn: Connection) -> None:
        """Nothing: SQLite has no per-transaction setting for it (``PRAGMA synchronous`` is
        the connection's)."""

    # -- retention (consumer.jobs.driver_retention) -----------------------------------------

    def clock_epoch(self, conn: Connection) -> float:
        return float(conn.execute(text(f"SELECT {_NOW}")).scalar_one())

    def schema_index_ensure(self, indexes: Sequence[Index]) -> None:
        # No CONCURRENTLY here: a write transaction of its own (the write lock up front).
        with self.begin() as conn:
            for index in indexes:
                index.create(conn, checkfirst=True)

    def job_purge_finished(
        self, conn: Connection, cutoff: float, limit: int
    ) -> tuple[int, int, int]:
        # The transaction holds the write lock (BEGIN IMMEDIATE), so the rows read stay as
        # they are until the deletes below.
        ids = [
            int(row[0])
            for row in conn.execute(
                text(SQLITE_JOB_FINISHED + " LIMIT :limit"), {"cutoff": cutoff, "limit": limit}
            )
        ]
        if not ids:
            return 0, 0, 0
        params: dict[str, Any] = {f"i{n}": value for n, value in enumerate(ids)}
        marks = ", ".join(f":i{n}" for n in range(len(ids)))
        # Their replies and delivery callbacks go with them (not counted: the job's own).
        conn.execute(text(f"DELETE FROM {REPLIES_TABLE} WHERE job_id IN ({marks})"), params)
        conn.execute(  # their steps' edges (consumer.jobs.steps)
            text(
                f"DELETE FROM {STEPS_TABLE} WHERE parent_id IN ({marks}) OR child_id IN ({marks})"
            ),
            params,
        )
        conn.execute(
            text(
                f"DELETE FROM {DELIVERIES_TABLE} WHERE operation_id IN (SELECT operation_id"
                f" FROM {OPERATIONS_TABLE} WHERE job_id IN ({marks}))"
            ),
            params,
        )
        jobs_gone, attempts_gone, operations_gone = (
            int(
                conn.execute(
                    text(f"DELETE FROM {table} WHERE {column} IN ({marks})"), params
                ).rowcount
            )
            for table, column in (
                (JOBS_TABLE, "id"),
                (ATTEMPTS_TABLE, "job_id"),
                (OPERATIONS_TABLE, "job_id"),
            )
        )
        return jobs_gone, attempts_gone, operations_gone

    # -- the dispatch path: SQL text on the DBAPI connection ---------------------------------
    # Every dispatch reads the provider's pause, writes its intent and records its receipt.
    # Through SQLAlchemy (statements built and compiled anew, its transaction and result
    # machinery) they cost ~2 ms of CPU per dispatch, several times SQLite's own work; as
    # SQL text built once and run on the DBAPI connection, in a BEGIN IMMEDIATE ... COMMIT
    # of their own, a fraction of that. PostgreSQL's driver does the same with psycopg.

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction on the DBAPI connection: the write lock taken up front
        (as :meth:`begin`), committed on success, rolled back on any exception."""
        with self._lock, self._raw() as raw:
            raw.execute("BEGIN IMMEDIATE")
            try:
                yield raw
            except BaseException:
                raw.rollback()
                raise
            raw.commit()

    @contextmanager
    def _raw(self) -> Iterator[Any]:
        """A pooled DBAPI connection without SQLAlchemy's Connection around it (its set-up
        and tear-down cost more than a short statement); back to the pool, reset, after."""
        pooled = self.engine.raw_connection()
        try:
            yield pooled.driver_connection
        finally:
            pooled.close()

    def provider_pause(self, provider: str) -> tuple[float, float] | None:
        params: dict[str, Any] = {"provider": provider}
        sql = _PAUSE_SQL.format(now=_NOW)
        if self.clock is not None:
            sql, params["now"] = _PAUSE_SQL.format(now="CAST(:now AS REAL)"), self.clock()
        with self._lock, self._raw() as raw:
            row = raw.execute(sql, params).fetchone()  # autocommit: its own read
        return None if row is None or row[0] is None else (float(row[0]), float(row[1]))

    def operation_intent(
        self,
        *,
        operation_id: str,
        job_id: int,
        provider: str,
        digest: str,
        timeout: float,
        worker: str,
        epoch: int,
    ) -> str:
        params: dict[str, Any] = {
            "operation_id": operation_id,
            "job_id": job_id,
            "provider": provider,
            "digest": digest,
            "timeout": float(timeout),
        }
        insert = _INTENT_SQL.format(now=_NOW)
        if self.clock is not None:  # a clock of the caller's (a test's): bound, not read
            insert, params["now"] = _INTENT_SQL.format(now="CAST(:now AS REAL)"), self.clock()
        fence = {"job_id": job_id, "epoch": epoch, "worker": worker}
        pause = _PAUSED_SQL.format(now=_NOW if self.clock is None else "CAST(:now AS REAL)")
        try:
            with self._write() as raw:
                if raw.execute(pause, params).fetchone() is not None:
                    return "paused"  # checked under the write lock: nothing written
                created = raw.execute(insert, params).fetchone()
                if created is None:
                    return "exists"
                fence["until"] = float(created[0])
                if raw.execute(_EXTEND_SQL, fence).fetchone() is None:
                    raise FencedOut  # rolls the intent back with the transaction
        except FencedOut:
            return "fenced"
        return "created"

    def operation_record(
        self,
        operation_id: str,
        values: Mapping[str, Any],
        *,
        stamp: Sequence[str] = (),
        unless_states: Sequence[str] = (),
        if_states: Sequence[str] = (),
        if_attempts: int | None = None,
        durable: bool = True,  # SQLite: every commit is as durable as the file's settings
    ) -> bool:
        sql, params = self._records(
            operation_id, values, stamp, unless_states, if_states, if_attempts
        )
        with self._write() as raw:
            return raw.execute(sql, params).fetchone() is not None

    @cached_property
    def _records(self) -> RecordStatements:  # (consumer.jobs.record_text)
        return RecordStatements(_record_statement, states=json.dumps)


def _record_statement(
    columns: tuple[str, ...],
    stamp: tuple[str, ...],
    unless: bool,
    if_states: bool,
    if_attempts: bool,
) -> str:
    check_operation_columns([*columns, *stamp])  # names of the table: safe in the text
    sets = [f"{name} = :{name}" for name in columns]
    sets += [f"{name} = {_NOW}" for name in stamp]
    where = ["operation_id = :_operation_id"]
    if unless:
        where.append("state NOT IN (SELECT value FROM json_each(:_unless))")
    if if_states:
        where.append("state IN (SELECT value FROM json_each(:_if))")
    if if_attempts:
        where.append("attempts = :_attempts")
    return (
        f"UPDATE {OPERATIONS_TABLE} SET {', '.join(sets)}"
        f" WHERE {' AND '.join(where)} RETURNING operation_id"
    )


# An existing intent is left alone (ON CONFLICT DO NOTHING returns no row): the caller reads
# it under the job's lock. SQLite's 'now' is one value for the whole statement.
_INTENT_SQL = (
    f"INSERT INTO {OPERATIONS_TABLE} (operation_id, job_id, provider, request_digest, state,"
    " attempts, call_deadline, created_at, updated_at)"
    " VALUES (:operation_id, :job_id, :provider, :digest, 'PENDING', 1,"
    " {now} + :timeout, {now}, {now})"
    " ON CONFLICT (operation_id) DO NOTHING RETURNING call_deadline"
)

# The fenced lease extension to the call's deadline, never shorter than it is. A job with a
# cancel request is refused like a lost lease: no new intent (the caller tells JobCancelled).
_EXTEND_SQL = (
    f"UPDATE {JOBS_TABLE} SET lease_expires_at = CASE WHEN lease_expires_at < :until"
    " THEN :until ELSE lease_expires_at END"
    " WHERE id = :job_id AND lease_epoch = :epoch AND lease_owner = :worker"
    f" AND state = '{LEASED}' AND cancel_requested_at IS NULL RETURNING id"
)

# The provider's pause, if it is on (the intent's check, before every call).
_PAUSED_SQL = (
    f"SELECT 1 FROM {PROVIDER_LIMITS_TABLE} WHERE provider = :provider AND paused_until > {{now}}"
)

# The provider's pause and the clock it is compared to.
_PAUSE_SQL = f"SELECT paused_until, {{now}} FROM {PROVIDER_LIMITS_TABLE} WHERE provider = :provider"
