"""The job driver's statements of retention (``consumer.jobs.retention`` decides what is old
and counts what went): finished jobs with their history, and gone workers' liveness rows,
purged in bounded batches. A mixin of :class:`consumer.jobs.driver.JobDriver`; the purge of
finished jobs and the retention's indexes differ between the databases (their reasons are
beside the SQL below and in ``driver_pg``/``driver_sqlite``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from sqlalchemy import Index, text
from sqlalchemy.engine import Connection

from consumer.jobs.schema import (
    ATTEMPTS_TABLE,
    DELIVERIES_TABLE,
    JOBS_TABLE,
    OPERATIONS_TABLE,
    REPLIES_TABLE,
    STEPS_TABLE,
    WORKERS_TABLE,
)
from consumer.jobs.states import CANCELLED, DONE, LEASED

__all__ = ["JOB_DUE", "PG_JOB_PURGE", "SQLITE_JOB_FINISHED", "RetentionStatements"]

# A job some open job waits for (``after=``: consumer.jobs.steps) stays: its dependents read
# its result when they run (one probe of the steps' primary key per finished job).
_OPEN_CHILD = f"""
  AND NOT EXISTS (SELECT 1 FROM {STEPS_TABLE} s JOIN {JOBS_TABLE} c ON c.id = s.child_id
                  WHERE s.parent_id = j.id AND c.state NOT IN ('{DONE}', '{CANCELLED}'))"""

# SQLite: the batch, oldest first (its planner walks ix_outbox_jobs_finished for it).
SQLITE_JOB_FINISHED = f"""
SELECT j.id FROM {JOBS_TABLE} j
WHERE j.state IN ('{DONE}', '{CANCELLED}') AND j.updated_at < :cutoff
  AND NOT EXISTS (SELECT 1 FROM {OPERATIONS_TABLE} o
                  WHERE o.job_id = j.id AND o.state IN ('PENDING', 'UNKNOWN')){_OPEN_CHILD}
ORDER BY j.updated_at"""

# PostgreSQL: one statement per batch, whose only sensible plan is a walk of the index
# whatever the statistics say (this server runs without autovacuum). A plain ``ORDER BY
# updated_at LIMIT n`` is cheap only while the planner believes many rows match; on a
# never-analyzed table it estimated a few hundred and read all 20,000 due rows through a
# bitmap scan and a sort, per batch (tests/test_retention.py). So:
# - ``walk``: a recursive walk of ix_outbox_jobs_finished (the partial index on
#   (updated_at, id) of DONE/CANCELLED rows), one ``ORDER BY ... LIMIT 1`` probe per row,
#   each starting after the previous row: every plan of a LIMIT 1 probe stops at one row.
#   A job with an open receipt (PENDING, UNKNOWN: its effect is not settled) is stepped
#   over and stays.
# - ``doomed``: those rows by primary key, locked with SKIP LOCKED (two workers purging at
#   once take different rows), the open-receipt check repeated under the lock. No state
#   filter here: DONE and CANCELLED are terminal, and a state filter matches the partial
#   index's predicate, which let the planner read all 20,000 finished rows through it (a
#   bitmap scan, 19,000 removed by the id filter) instead of 1,000 primary-key probes.
# - its attempts and operations go by their job_id indexes (= ANY of an array: an index
#   probe per id, never a hash join over the table) in the same statement.
_NEXT_FINISHED = f"""
        SELECT j.id, j.updated_at FROM {JOBS_TABLE} j
        WHERE j.state IN ('{DONE}', '{CANCELLED}') AND j.updated_at < :cutoff
          AND NOT EXISTS (SELECT 1 FROM {OPERATIONS_TABLE} o
                          WHERE o.job_id = j.id AND o.state IN ('PENDING', 'UNKNOWN'))
          {_OPEN_CHILD}"""

PG_JOB_PURGE = f"""
WITH RECURSIVE walk(id, updated_at, n) AS (
    (SELECT f.id, f.updated_at, 1 FROM ({_NEXT_FINISHED}
        ORDER BY j.updated_at, j.id LIMIT 1) f)
    UNION ALL
    SELECT nxt.id, nxt.updated_at, w.n + 1 FROM walk w CROSS JOIN LATERAL ({_NEXT_FINISHED}
          AND (j.updated_at, j.id) > (w.updated_at, w.id)
        ORDER BY j.updated_at, j.id LIMIT 1) nxt
    WHERE w.n < :limit),
doomed AS MATERIALIZED (
    SELECT j.id FROM {JOBS_TABLE} j
    WHERE j.id = ANY(ARRAY(SELECT id FROM walk))
      AND NOT EXISTS (SELECT 1 FROM {OPERATIONS_TABLE} o
                      WHERE o.job_id = j.id AND o.state IN ('PENDING', 'UNKNOWN'))
    FOR UPDATE OF j SKIP LOCKED),
gone_attempts AS (
    DELETE FROM {ATTEMPTS_TABLE} WHERE job_id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1),
gone_operations AS (
    DELETE FROM {OPERATIONS_TABLE} WHERE job_id = ANY(ARRAY(SELECT id FROM doomed))
    RETURNING operation_id),
gone_replies AS (
    DELETE FROM {REPLIES_TABLE} WHERE job_id = ANY(ARRAY(SELECT id FROM doomed))),
gone_steps AS (
    DELETE FROM {STEPS_TABLE} WHERE parent_id = ANY(ARRAY(SELECT id FROM doomed))
        OR child_id = ANY(ARRAY(SELECT id FROM doomed))),
gone_deliveries AS (
    DELETE FROM {DELIVERIES_TABLE}
    WHERE operation_id = ANY(ARRAY(SELECT operation_id FROM gone_operations))),
gone_jobs AS (
    DELETE FROM {JOBS_TABLE} WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1)
SELECT (SELECT count(*) FROM gone_jobs), (SELECT count(*) FROM gone_attempts),
       (SELECT count(*) FROM gone_operations)"""

# The same rows and their history, counted for --dry-run (the same SQL on SQLite).
_DUE_JOBS = f"""
SELECT j.id FROM {JOBS_TABLE} j
WHERE j.state IN ('{DONE}', '{CANCELLED}') AND j.updated_at < :cutoff
  AND NOT EXISTS (SELECT 1 FROM {OPERATIONS_TABLE} o
                  WHERE o.job_id = j.id AND o.state IN ('PENDING', 'UNKNOWN')){_OPEN_CHILD}"""

JOB_DUE = f"""
SELECT (SELECT count(*) FROM ({_DUE_JOBS}) d),
       (SELECT count(*) FROM {ATTEMPTS_TABLE} WHERE job_id IN ({_DUE_JOBS})),
       (SELECT count(*) FROM {OPERATIONS_TABLE} WHERE job_id IN ({_DUE_JOBS}))"""

# Liveness rows of workers long gone and holding no lease (the liveness tick of a running
# worker deletes most of them already; this covers a database whose workers all died).
_GONE_WORKERS = f"""
SELECT w.name FROM {WORKERS_TABLE} w
WHERE w.alive_until < :cutoff
  AND NOT EXISTS (SELECT 1 FROM {JOBS_TABLE} j
                  WHERE j.state = '{LEASED}' AND j.lease_owner = w.name)"""


class RetentionStatements(ABC):
    """Retention: the clock it reads, its indexes, finished jobs, gone workers' rows."""

    # -- where the databases differ ---------------------------------------------------------

    @abstractmethod
    def clock_epoch(self, conn: Connection) -> float:
        """The database clock in unix seconds (``outbox.dialect.EPOCH_SQL``, as text): what
        retention's cutoffs are taken from when no ``now`` is given."""

    @abstractmethod
    def schema_index_ensure(self, indexes: Sequence[Index]) -> None:
        """Create the ``indexes`` that are missing (``create_all`` adds no index to an
        existing table), each committed on its own: on its own connection."""

    @abstractmethod
    def job_purge_finished(
        self, conn: Connection, cutoff: float, limit: int
    ) -> tuple[int, int, int]:
        """Delete at most ``limit`` DONE and CANCELLED jobs last changed before ``cutoff``
        (none with an open receipt), with their attempts, operations, replies and delivery
        callbacks: how many jobs, attempts and operations went."""

    # -- the same SQL on both ---------------------------------------------------------------

    def job_purge_due(self, conn: Connection, cutoff: float) -> tuple[int, int, int]:
        """What :meth:`job_purge_finished` would delete with no limit: jobs, attempts and
        operations."""
        row = conn.execute(text(JOB_DUE), {"cutoff": cutoff}).one()
        return int(row[0]), int(row[1]), int(row[2])

    def worker_gone_count(self, conn: Connection, cutoff: float) -> int:
        """Liveness rows expired before ``cutoff`` whose worker holds no lease."""
        query = f"SELECT count(*) FROM ({_GONE_WORKERS}) g"
        return int(conn.execute(text(query), {"cutoff": cutoff}).scalar_one())

    def worker_gone_delete(self, conn: Connection, cutoff: float, limit: int) -> int:
        """Delete at most ``limit`` of :meth:`worker_gone_count`'s rows: how many went."""
        result = conn.execute(
            text(f"DELETE FROM {WORKERS_TABLE} WHERE name IN ({_GONE_WORKERS} LIMIT :limit)"),
            {"cutoff": cutoff, "limit": limit},
        )
        return int(result.rowcount)
