"""The job store's SQL that is not a plain compare-and-set: the fair batch claim and the
batch finish (PostgreSQL and SQLite variants side by side). Plain moves are SQLAlchemy Core
in ``consumer.jobs.store``; every statement here names its reason.

``{now}`` in these templates is replaced by ``:now`` when the caller passes a time, or by the
database clock (``outbox.dialect.EPOCH_SQL``) otherwise. ``consumer.jobs.driver`` runs them.
"""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import TextClause, text
from sqlalchemy.sql.selectable import TextualSelect

from consumer.jobs.schema import ATTEMPTS_TABLE, JOBS_TABLE, jobs
from consumer.jobs.states import DONE, LEASED, READY
from outbox.dialect import EPOCH_SQL, POSTGRESQL, SQLITE

# What a claim returns, in this order (a Lease is built from it).
LEASE_COLUMNS = (
    "id",
    "tenant",
    "action",
    "kind",
    "subject",
    "subject_version",
    "payload",
    "provider",
    "attempts",
    "lease_epoch",
    "lease_owner",
    "lease_expires_at",
    "timer_scheduled_for",
    "timer_reason",
    "timer_subject_version",
    "timer_cancellation_condition",
    "trace_context",
)

# Fairness, step 1: the tenants that have READY rows, found by a loose index scan over
# ix_outbox_jobs_ready (one index probe per tenant, whatever each tenant's backlog: tenant A's
# 10,000 rows cost one probe, like tenant B's 10). The scan starts after :cursor (the tenant
# this store served first last time) and wraps around, so successive claims rotate over the
# tenants: round robin. Bounded by :max_tenants probes per direction.
_TENANT_SCAN = f"""
scan(tenant, wrapped, depth) AS (
    SELECT (SELECT tenant FROM {JOBS_TABLE} WHERE state = '{READY}' AND tenant > :cursor
            ORDER BY tenant LIMIT 1), 0, 1
  UNION ALL
    SELECT (SELECT tenant FROM {JOBS_TABLE} WHERE state = '{READY}'
            ORDER BY tenant LIMIT 1), 1, 1
  UNION ALL
    SELECT (SELECT n.tenant FROM {JOBS_TABLE} n WHERE n.state = '{READY}' AND n.tenant > s.tenant
            ORDER BY n.tenant LIMIT 1), s.wrapped, s.depth + 1
    FROM scan s
    WHERE s.tenant IS NOT NULL AND s.depth < :max_tenants
      AND (s.wrapped = 0 OR s.tenant < :cursor)
),
tenants AS (
    SELECT tenant, wrapped FROM scan
    WHERE tenant IS NOT NULL AND (wrapped = 0 OR tenant <= :cursor)
)"""


def _returning(prefix: str = "") -> str:
    return ", ".join(f"{prefix}{name}" for name in LEASE_COLUMNS)


def _typed(sql: str) -> TextualSelect:
    return text(sql).columns(*[jobs.c[name] for name in LEASE_COLUMNS])


@lru_cache(maxsize=8)
def pg_claim_batch(now_given: bool) -> TextualSelect:
    """Claim up to :limit READY rows in one statement (one short transaction).

    Step 2: each tenant found gets an equal share, ceil(:limit / tenants), taken in
    (priority desc, id) order with FOR UPDATE SKIP LOCKED, so concurrent claimers never
    wait on each other nor take the same row. The outer ORDER BY/LIMIT keeps the rotation
    order when the shares add up to more than :limit (rows locked but not taken are released
    at commit, a moment later). Step 3: the UPDATE leases them and bumps each epoch.

    Why this shape holds whatever the planner statistics say (issue 10): every scan of
    outbox_jobs is an ``ORDER BY ... LIMIT`` whose equality on the index's leading column
    (``tenant``) comes from the outer row, so the planner estimates it without knowing the
    tenant (a handful of rows) and the ordered index scan, which stops after the share, wins
    over a bitmap scan and sort; the tenant scan's probes are ``LIMIT 1``. Checked by
    tests/test_query_plans.py on 100,000 READY rows (1 and 10 tenants) with no statistics and
    with stale ones (ANALYZE while empty): a claim of 100 reads at most ~300 rows.
    """
    now = ":now" if now_given else EPOCH_SQL[POSTGRESQL]
    return _typed(
        f"""
WITH RECURSIVE {_TENANT_SCAN},
share AS (
    SELECT greatest(1, ceil(CAST(:limit AS double precision) / nullif(count(*), 0)))::int AS per
    FROM tenants
),
picked AS (
    SELECT p.id FROM tenants t CROSS JOIN share
    CROSS JOIN LATERAL (
        SELECT j.id FROM {JOBS_TABLE} j
        WHERE j.tenant = t.tenant AND j.state = '{READY}'
          AND (j.run_after IS NULL OR j.run_after <= {now})
        ORDER BY j.priority DESC, j.id
        LIMIT share.per
        FOR UPDATE SKIP LOCKED
    ) p
    ORDER BY t.wrapped, t.tenant
    LIMIT :limit
)
UPDATE {JOBS_TABLE} AS j
SET state = '{LEASED}', lease_owner = :worker, lease_epoch = j.lease_epoch + 1,
    lease_expires_at = {now} + :ttl, attempts = j.attempts + 1, updated_at = {now}
FROM picked WHERE j.id = picked.id
RETURNING {_returning("j.")}
"""
    )


@lru_cache(maxsize=2)
def sqlite_tenants() -> TextClause:
    """SQLite: the same rotating tenant scan; the caller holds the write lock (BEGIN
    IMMEDIATE), so no row locks are needed and the per-tenant picks run in-process."""
    return text(
        f"WITH RECURSIVE {_TENANT_SCAN} SELECT tenant FROM tenants ORDER BY wrapped, tenant"
    )


@lru_cache(maxsize=4)
def sqlite_pick(now_given: bool) -> TextClause:
    now = ":now" if now_given else EPOCH_SQL[SQLITE]
    return text(
        f"""
SELECT id FROM {JOBS_TABLE}
WHERE tenant = :tenant AND state = '{READY}' AND (run_after IS NULL OR run_after <= {now})
ORDER BY priority DESC, id LIMIT :per
"""
    )


@lru_cache(maxsize=4)
def sqlite_lease(now_given: bool) -> TextualSelect:
    # The ids were picked under the write lock just now; state = READY is re-checked anyway.
    now = ":now" if now_given else EPOCH_SQL[SQLITE]
    return _typed(
        f"""
UPDATE {JOBS_TABLE}
SET state = '{LEASED}', lease_owner = :worker, lease_epoch = lease_epoch + 1,
    lease_expires_at = {now} + :ttl, attempts = attempts + 1, updated_at = {now}
WHERE id IN (SELECT value FROM json_each(:ids)) AND state = '{READY}'
RETURNING {_returning()}
"""
    )


@lru_cache(maxsize=4)
def pg_finish_batch(now_given: bool) -> TextClause:
    """Finish many leases of one worker in one statement, each fenced on its own epoch.

    The ids and epochs travel as comma-separated text (psycopg would send Python lists as
    text arrays element by element, far slower). A row whose epoch moved on, or that is no
    longer LEASED by :worker, simply does not match: the caller reports it as a conflict.
    The history rows are written by the same statement.
    """
    now = ":now" if now_given else EPOCH_SQL[POSTGRESQL]
    return text(
        f"""
WITH input AS (
    SELECT * FROM unnest(string_to_array(:ids, ',')::bigint[],
                         string_to_array(:epochs, ',')::bigint[]) AS i(id, epoch)
),
done AS (
    UPDATE {JOBS_TABLE} AS j
    SET state = '{DONE}', lease_owner = NULL, lease_expires_at = NULL, updated_at = {now},
        timer_scheduled_for = NULL, timer_reason = NULL, timer_subject_version = NULL,
        timer_cancellation_condition = NULL
    FROM input i
    WHERE j.id = i.id AND j.lease_epoch = i.epoch AND j.lease_owner = :worker
      AND j.state = '{LEASED}'
    RETURNING j.id, i.epoch
)
INSERT INTO {ATTEMPTS_TABLE} (job_id, epoch, worker, outcome, at)
SELECT id, epoch, :worker, 'done', {now} FROM done
RETURNING job_id
"""
    )


@lru_cache(maxsize=1)
def pg_job_ids() -> TextClause:
    """The ids of existing jobs among (tenant, action) keys: the duplicates of a batch
    enqueue. The keys travel as ONE JSON text parameter joined against the unique index
    (a nested loop of index probes). A row-value ``(tenant, action) IN ((..), ..)`` list of
    500 pairs cost ~300 ms per batch here (planned as a filter over the whole table, growing
    with it) and made a consumer that re-reads a stream 5x slower than a fresh one."""
    return text(
        f"""
SELECT j.id, j.tenant, j.action
FROM json_to_recordset(CAST(:keys AS json)) AS k(tenant text, action text)
JOIN {JOBS_TABLE} j ON j.tenant = k.tenant AND j.action = k.action
"""
    )
