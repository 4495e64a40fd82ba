"""PostgreSQL's job driver: the fair batch claim and the batch finish as one statement each
(``consumer.jobs.queries``), ``FOR UPDATE SKIP LOCKED``, DDL serialised by an advisory lock,
wake-ups by LISTEN/NOTIFY, and the dispatch path's statements sent as text built once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import cached_property, partial
from typing import Any, cast

import psycopg
from psycopg import sql as psycopg_sql
from sqlalchemy import (
    ColumnElement,
    Index,
    event,
    func,
    literal_column,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.schema import CreateIndex

from consumer.jobs import queries as q
from consumer.jobs.driver_base import READY_CHANNEL_SQL, JobDriver, ReadyListener
from consumer.jobs.driver_operations import check_operation_columns
from consumer.jobs.driver_retention import PG_JOB_PURGE
from consumer.jobs.record_text import RecordStatements
from consumer.jobs.schema import jobs, operations, provider_limits
from consumer.jobs.states import LEASED
from consumer.jobs.upgrades import create_tables
from outbox.dialect import EPOCH_SQL, POSTGRESQL, insert_or_ignore
from outbox.outage import is_cut, retry_lost


def no_jit(dbapi_connection: Any, _record: Any) -> None:
    """A ``connect`` listener for the store's own engine (``consumer.jobs.driver.engine_for``):
    ``jit = off`` for the session, once per connection, instead of a ``SET LOCAL`` round trip
    in every claim's transaction (``queries.PG_CLAIM_SETTINGS`` has the reason)."""
    with dbapi_connection.cursor() as cursor:
        cursor.execute("SET jit = off")
    dbapi_connection.commit()


class PostgresJobDriver(JobDriver):
    """PostgreSQL: one statement per batch claim and batch finish, SKIP LOCKED, advisory DDL
    lock."""

    name = "postgresql"
    job_claim_finishes = True  # queries.pg_claim_batch(finishing=True)
    reply_kept_returned = True  # job_insert_many: kept replies in the INSERT's RETURNING

    @cached_property
    def _jit_off(self) -> bool:
        """The engine's sessions run without JIT already (the store built the engine)."""
        return event.contains(self.engine, "connect", no_jit)

    def schema_create(self, conn: Connection) -> None:
        # Serialised (CREATE TABLE IF NOT EXISTS races between processes starting together),
        # with the hot tables' per-table autovacuum settings (issue 10).
        create_tables(conn)

    def job_insert_counted(
        self, conn: Connection, values: Mapping[str, Any]
    ) -> tuple[int, bool, int]:
        if not self.notify:
            return super().job_insert_counted(conn, values)
        # The wake-up rides on the INSERT itself: RETURNING evaluates pg_notify only for a row
        # actually inserted (a duplicate notifies nobody), in the same round trip, delivered
        # at the caller's commit. No trigger, so nothing for migrations to carry.
        stmt = (
            insert_or_ignore(jobs, ("tenant", "action"), conn.dialect.name)
            .values(**values)
            .returning(
                jobs.c.id,
                jobs.c.replies_received,
                func.pg_notify(literal_column(READY_CHANNEL_SQL), ""),
            )
        )
        new = conn.execute(stmt).first()
        if new is not None:
            return int(new[0]), True, int(new[1])
        return super().job_insert_counted(conn, values)

    def job_ids(
        self, conn: Connection, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], int]:
        params = {"keys": json.dumps([{"tenant": t, "action": a} for t, a in keys])}
        return {
            (tenant, action): int(job_id)
            for job_id, tenant, action in conn.execute(q.pg_job_ids(), params)
        }

    def job_rows_stamped(
        self, conn: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> Sequence[Mapping[str, Any]]:
        # The clock expression, shared by every row, goes into the statement as SQL (bulk
        # insert's constant columns): no clock round trip, no copy of every row.
        stamp = rows[0]["created_at"]
        if isinstance(stamp, (int, float)) or all(
            row["created_at"] is stamp and row["updated_at"] is stamp for row in rows
        ):
            return rows
        return super().job_rows_stamped(conn, rows)

    @property
    def job_ready_channel_sql(self) -> str | None:
        # A batch of jobs notifies on its INSERT's RETURNING (bulk_insert): no statement of
        # its own, and only when a row was created.
        return READY_CHANNEL_SQL if self.notify else None

    @contextmanager
    def autocommit(self) -> Iterator[Connection]:
        # psycopg's own autocommit switch costs no round trip (SQLAlchemy's AUTOCOMMIT
        # isolation level is reset with a SET SESSION statement when the connection returns
        # to the pool): the statement is one round trip instead of three.
        with self._lock, self.engine.connect() as conn:
            raw: Any = conn.connection.dbapi_connection
            try:
                raw.autocommit = True
                yield conn
            except psycopg.Error as exc:  # a statement sent on ``raw`` itself
                raise self._raw_error(conn, raw, exc) from exc
            finally:
                # A connection cut under the statement is gone (invalidated, or broken):
                # setting its mode would raise again and hide the error being raised.
                if not (raw.closed or raw.broken):
                    raw.autocommit = False

    def _raw_error(self, conn: Connection, raw: Any, exc: psycopg.Error) -> DBAPIError:
        """What SQLAlchemy makes of a driver error for the statements it runs, for one sent
        on the DBAPI connection itself: the SQLAlchemy class of the error (the loops wait out
        a ``SQLAlchemyError``), and, when the connection was cut, the connection and every
        pooled one older than it invalidated (they are dead too after a failover), as
        SQLAlchemy does for its own statements. Without this, the driver's own error left
        the worker's loops and ended the process (issue 53)."""
        dialect = self.engine.dialect
        lost = bool(raw.closed or raw.broken) or is_cut(exc)
        if lost and not conn.invalidated:
            self.engine.pool._invalidate(conn.connection, exc)  # the pool's own soft invalidation
            conn.invalidate(exc)
        # A DBAPIError whatever the class of a psycopg error (its ``dbapi_base_err``).
        error = cast(
            DBAPIError,
            DBAPIError.instance(
                None, None, exc, psycopg.Error, connection_invalidated=lost, dialect=dialect
            ),
        )
        if lost:
            self.watch.lost(error)
        return error

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
        # ONE statement in autocommit (one round trip, one commit) instead of BEGIN, INSERT,
        # UPDATE, COMMIT: it ran on every dispatch and was the largest part of a worker's
        # cost per effect. The fenced lease extension comes first and the intent is inserted
        # only FROM its row, so a fenced dispatch writes nothing; an existing intent is left
        # alone (the caller reads it under lock, as before). A job with a cancel request gets
        # no new intent: "fenced" (the caller tells JobCancelled). The job row is locked before the
        # operation row, the order of the slow path (job_lock_held, then operation_get).
        params: dict[str, Any] = {
            "timeout": float(timeout),
            "job_id": job_id,
            "epoch": epoch,
            "worker": worker,
            "leased": LEASED,
            "operation_id": operation_id,
            "provider": provider,
            "digest": digest,
        }
        statement = self._intent_sql
        if self.clock is not None:  # a clock of the caller's (a test's): bound, not read
            statement, params["now"] = self._intent_sql_at, self.clock()
        # Again on a new connection when the connection is cut under it: a second run after
        # a first one committed finds the intent ("exists") and the caller reads it.
        paused, held, created = retry_lost(partial(self._raw_one, statement, params))
        if paused:
            return "paused"
        if not held:
            return "fenced"
        return "created" if created else "exists"

    def operation_record(
        self,
        operation_id: str,
        values: Mapping[str, Any],
        *,
        stamp: Sequence[str] = (),
        unless_states: Sequence[str] = (),
        if_states: Sequence[str] = (),
        if_attempts: int | None = None,
        durable: bool = True,
    ) -> bool:
        records = self._records if durable else self._records_unflushed
        sql, params = records(operation_id, values, stamp, unless_states, if_states, if_attempts)
        # Again on a new connection when the connection is cut under it (the receipt is a
        # fact about the provider: lost, it costs a reconciliation). It sets the same values
        # a second time; one cut after the commit answers "not recorded" if its conditions
        # no longer hold, as a change made meanwhile by another would.
        return retry_lost(partial(self._raw_one, sql, params)) is not None

    def _raw_one(self, sql: str, params: Mapping[str, Any]) -> Any:
        """One statement on the DBAPI connection in autocommit: its first row, or None."""
        with self.autocommit() as conn:
            raw: Any = conn.connection.dbapi_connection
            return raw.execute(sql, params).fetchone()

    @cached_property
    def _records(self) -> RecordStatements:  # (consumer.jobs.record_text)
        return RecordStatements(self._record_statement, states=list)

    @cached_property
    def _records_unflushed(self) -> RecordStatements:
        return RecordStatements(partial(self._record_statement, durable=False), states=list)

    def _record_statement(
        self,
        columns: tuple[str, ...],
        stamp: tuple[str, ...],
        unless: bool,
        if_states: bool,
        if_attempts: bool,
        *,
        durable: bool = True,
    ) -> str:
        prep = self.engine.dialect.identifier_preparer
        check_operation_columns([*columns, *stamp])
        sets = [f"{prep.quote(name)} = %({name})s" for name in columns]
        sets += [f"{prep.quote(name)} = {EPOCH_SQL[POSTGRESQL]}" for name in stamp]
        where = ["operation_id = %(_operation_id)s"]
        if unless:
            where.append("state <> ALL(%(_unless)s)")
        if if_states:
            where.append("state = ANY(%(_if)s)")
        if if_attempts:
            where.append("attempts = %(_attempts)s")
        if not durable:
            # synchronous_commit off for this statement's own (implicit) transaction, as the
            # relay does for its receipts: the commit does not wait on the WAL flush. A later
            # durable commit of this worker (the next intent, the job's finish) flushes the
            # WAL past it, so nothing the worker does after it rests on an unflushed receipt.
            where.append("(SELECT set_config('synchronous_commit', 'off', true)) = 'off'")
        return (
            f"UPDATE {prep.format_table(operations)} SET {', '.join(sets)}"
            f" WHERE {' AND '.join(where)} RETURNING operation_id"
        )

    @cached_property
    def _intent_sql(self) -> str:
        """The statement of :meth:`operation_intent`, built once (it runs on every dispatch)."""
        return self._intent_statement(EPOCH_SQL[POSTGRESQL])

    @cached_property
    def _intent_sql_at(self) -> str:
        """The same, at a bound ``now`` (``Store(clock=...)``) instead of the server's clock."""
        return self._intent_statement("CAST(%(now)s AS double precision)")

    def _intent_statement(self, now: str) -> str:
        # The provider's pause is read in the same statement (the check before every call,
        # without a round trip of its own): a paused provider gets no intent, no lease
        # extension; the caller hands the job back.
        prep = self.engine.dialect.identifier_preparer
        return (
            f"WITH pause AS ("
            f" SELECT 1 FROM {prep.format_table(provider_limits)}"
            f" WHERE provider = %(provider)s AND paused_until > {now}),"
            f" lease AS ("
            f" UPDATE {prep.format_table(jobs)} SET lease_expires_at = CASE"
            f" WHEN lease_expires_at < {now} + %(timeout)s THEN {now} + %(timeout)s"
            f" ELSE lease_expires_at END"
            f" WHERE id = %(job_id)s AND lease_epoch = %(epoch)s AND lease_owner = %(worker)s"
            f" AND state = %(leased)s AND cancel_requested_at IS NULL"
            f" AND NOT EXISTS (SELECT 1 FROM pause) RETURNING id),"
            f" intent AS ("
            f" INSERT INTO {prep.format_table(operations)} (operation_id, job_id, provider,"
            f" request_digest, state, attempts, call_deadline, created_at, updated_at)"
            f" SELECT %(operation_id)s, %(job_id)s, %(provider)s, %(digest)s, 'PENDING', 1,"
            f" {now} + %(timeout)s, {now}, {now} FROM lease"
            f" ON CONFLICT (operation_id) DO NOTHING RETURNING 1)"
            f" SELECT EXISTS (SELECT 1 FROM pause), EXISTS (SELECT 1 FROM lease),"
            f" EXISTS (SELECT 1 FROM intent)"
        )

    def _prepare(self, conn: Connection) -> None:
        """Nothing: PostgreSQL's transactions need no set-up before they begin."""

    def job_ready_notify(self, conn: Connection) -> None:
        if self.notify:
            conn.execute(text(f"SELECT pg_notify({READY_CHANNEL_SQL}, '')"))

    def job_ready_listener(self) -> ReadyListener | None:
        return _PgReadyListener(self.engine)

    def job_tenant_leased(self, conn: Connection, queue: str, tenant: str, cap: int) -> int:
        # The batch claims' lock first (queries.PG_TENANT_LOCK_SQL has the reason), then the
        # count in a statement of its own: READ COMMITTED gives it a snapshot taken after the
        # lock, which sees every lease committed by the claims that held it before.
        conn.execute(text(q.PG_TENANT_LOCK_SQL), {"queue": queue, "tenant": tenant})
        return super().job_tenant_leased(conn, queue, tenant, cap)

    def job_claim_scope(self) -> AbstractContextManager[Connection]:
        # One statement on the store's own engine (no SET LOCAL: its sessions run without
        # JIT): it commits on its own, one round trip instead of BEGIN, claim and COMMIT.
        return self.autocommit() if self._jit_off else self.begin()

    def job_claim_batch(
        self, conn: Connection, params: dict[str, Any], now_given: bool
    ) -> Sequence[Any]:
        queues, routes = params.get("queues"), params.get("routes")
        limit, limits = params.get("tenant_limit"), params.get("tenant_limits") or {}
        limited = limit is not None or bool(limits)
        finishing = params.get("finishing")
        statement = q.pg_claim_batch(
            now_given,
            all_queues=queues is None,
            routed=routes is not None,
            limited=limited,
            finishing=finishing is not None,
        )
        bound = {k: params[k] for k in ("cursor", "max_tenants", "limit", "worker", "ttl")}
        if finishing is not None:
            bound.update(_finish_pairs(finishing))
        if now_given:
            bound["now"] = params["now"]
        if queues is not None:
            bound["queues"] = json.dumps(list(queues))
        if routes is not None:
            bound["route_names"] = list(routes)
            bound["route_patterns"] = q.route_patterns(tuple(routes))
        if limited:
            bound["tenant_limit"] = limit
            bound["tenant_limits"] = json.dumps(dict(limits))
        if not self._jit_off:  # the user's own engine: no JIT for this transaction (its reason)
            conn.exec_driver_sql(q.PG_CLAIM_SETTINGS)
        return conn.execute(statement, bound).all()

    def job_finish_batch(
        self, conn: Connection, worker: str, leases: Sequence[tuple[int, int]], when: float | None
    ) -> list[int]:
        params: dict[str, Any] = {**_finish_pairs(leases), "worker": worker}
        if when is not None:
            params["now"] = when
        return [int(r[0]) for r in conn.execute(q.pg_finish_batch(when is not None), params)]

    # -- provider limits (consumer.jobs.driver_fleet) ---------------------------------------

    def _statement_clock(self) -> ColumnElement[float]:
        # clock_timestamp(), not now(): now() is the transaction's start, read before a wait
        # on the row's lock behind another worker's reservation.
        return func.extract("epoch", func.clock_timestamp())  # type: ignore[return-value]

    def _greatest(self, a: Any, b: Any) -> ColumnElement[float]:
        return func.greatest(a, b)

    def _commit_unflushed(self, conn: Connection) -> None:
        # Per transaction: the commit does not wait for the WAL flush.
        conn.exec_driver_sql("SET LOCAL synchronous_commit TO off")

    # -- retention (consumer.jobs.driver_retention) -----------------------------------------

    def clock_epoch(self, conn: Connection) -> float:
        return float(conn.execute(text(f"SELECT {EPOCH_SQL[POSTGRESQL]}")).scalar_one())

    def schema_index_ensure(self, indexes: Sequence[Index]) -> None:
        # CONCURRENTLY: writers are not blocked while a large table is indexed. It cannot run
        # inside a transaction block: an AUTOCOMMIT connection of its own.
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            for index in indexes:
                found = conn.execute(text("SELECT to_regclass(:n)"), {"n": index.name})
                if found.scalar() is None:  # CONCURRENTLY waits for every transaction
                    conn.execute(text(_concurrent_index_sql(conn, index)))

    def job_purge_finished(
        self, conn: Connection, cutoff: float, limit: int
    ) -> tuple[int, int, int]:
        # One statement per batch, a walk of the index whatever the statistics say
        # (driver_retention.PG_JOB_PURGE has the reasons).
        row = conn.execute(text(PG_JOB_PURGE), {"cutoff": cutoff, "limit": limit}).one()
        return int(row[0]), int(row[1]), int(row[2])


def _concurrent_index_sql(conn: Connection, index: Index) -> str:
    """``CREATE INDEX CONCURRENTLY IF NOT EXISTS`` for a metadata Index (PostgreSQL)."""
    ddl = str(CreateIndex(index, if_not_exists=True).compile(dialect=conn.dialect))
    return ddl.replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY", 1)


class _PgReadyListener:
    """LISTEN on a connection of its own (taken out of the pool for good: a LISTENing session
    must not serve transactions)."""

    def __init__(self, engine: Engine) -> None:
        raw = engine.raw_connection()
        conn: Any = raw.driver_connection
        raw.detach()
        conn.rollback()  # the pool may have begun nothing, but autocommit needs no transaction
        conn.autocommit = True
        channel = conn.execute(f"SELECT {READY_CHANNEL_SQL}").fetchone()[0]
        conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel)))
        self._conn = conn

    def wait(self, timeout: float) -> bool:
        got = False
        for _ in self._conn.notifies(timeout=timeout, stop_after=1):
            got = True
        if got:  # one wake-up is enough: drain what else is queued
            for _ in self._conn.notifies(timeout=0.0001):
                pass
        return got

    def close(self) -> None:
        self._conn.close()


def _finish_pairs(leases: Sequence[tuple[int, int]]) -> dict[str, str]:
    """(job id, epoch) pairs as a batch finish binds them (``queries.pg_finish_batch``)."""
    return {
        "ids": ",".join(str(job_id) for job_id, _ in leases),
        "epochs": ",".join(str(epoch) for _, epoch in leases),
    }
