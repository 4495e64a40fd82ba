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

from consumer.jobs.order_ddl import CONCURRENCY_RELEASE_FUNCTION, ORDER_RELEASE_FUNCTION
from consumer.jobs.schema import ATTEMPTS_TABLE, JOBS_TABLE, PAUSED_QUEUES_TABLE, jobs
from consumer.jobs.schema import PG_TENANT_ROOM_SQL as PG_TENANT_ROOM_SQL  # the DDL lives there
from consumer.jobs.schema import TENANT_ROOM_FUNCTION as TENANT_ROOM_FUNCTION
from consumer.jobs.states import CANCELLED, DONE, LEASED, READY
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
    "queue",
    "created_at",
    "replies_received",
    "replies_consumed",
    "children",
)

_JSON_LIST = {
    POSTGRESQL: "SELECT value FROM json_array_elements_text(CAST(:{name} AS json))",
    SQLITE: "SELECT value FROM json_each(:{name})",
}


def _queues_sql(dialect: str, all_queues: bool) -> str:
    """The queues a claim takes from, less the paused ones (a handful of rows).

    Given queues travel as ONE JSON text parameter (``:queues``). All queues: the distinct
    queues that have READY rows, found by a loose index scan over ``ix_outbox_jobs_ready``
    (one probe per queue, whatever its backlog)."""
    paused = f"SELECT queue FROM {PAUSED_QUEUES_TABLE}"
    if not all_queues:
        given = _JSON_LIST[dialect].format(name="queues")
        return f"""
queues(queue) AS (
    SELECT value FROM ({given}) g WHERE value NOT IN ({paused})
),"""
    return f"""
qscan(queue, depth) AS (
    SELECT (SELECT queue FROM {JOBS_TABLE} WHERE state = '{READY}' ORDER BY queue LIMIT 1), 1
  UNION ALL
    SELECT (SELECT n.queue FROM {JOBS_TABLE} n WHERE n.state = '{READY}' AND n.queue > s.queue
            ORDER BY n.queue LIMIT 1), s.depth + 1
    FROM qscan s WHERE s.queue IS NOT NULL AND s.depth < :max_tenants
),
queues(queue) AS (
    SELECT queue FROM qscan WHERE queue IS NOT NULL AND queue NOT IN ({paused})
),"""


# Fairness, step 1: the (queue, tenant) pairs that have READY rows, found by a loose index scan
# over ix_outbox_jobs_ready (queue, tenant, ...): for each queue, one index probe per tenant,
# whatever each tenant's backlog (tenant A's 10,000 rows cost one probe, like tenant B's 10).
# The scan starts after :cursor (the tenant this store served first last time) and wraps
# around, so successive claims rotate over the tenants of each queue: round robin within a
# queue. Bounded by :max_tenants probes per queue and direction.
_TENANT_SCAN = f"""
scan(queue, tenant, wrapped, depth) AS (
    SELECT q.queue, (SELECT tenant FROM {JOBS_TABLE} WHERE state = '{READY}' AND queue = q.queue
                     AND tenant > :cursor ORDER BY tenant LIMIT 1), 0, 1
    FROM queues q
  UNION ALL
    SELECT q.queue, (SELECT tenant FROM {JOBS_TABLE} WHERE state = '{READY}' AND queue = q.queue
                     ORDER BY tenant LIMIT 1), 1, 1
    FROM queues q
  UNION ALL
    SELECT s.queue, (SELECT n.tenant FROM {JOBS_TABLE} n WHERE n.state = '{READY}'
                     AND n.queue = s.queue AND n.tenant > s.tenant ORDER BY n.tenant LIMIT 1),
           s.wrapped, s.depth + 1
    FROM scan s
    WHERE s.tenant IS NOT NULL AND s.depth < :max_tenants
      AND (s.wrapped = 0 OR s.tenant < :cursor)
),
tenants AS (
    SELECT queue, tenant, wrapped FROM scan
    WHERE tenant IS NOT NULL AND (wrapped = 0 OR tenant <= :cursor)
)"""

SEPARATORS = "-:/.#_"
"""What may follow a handler's name in an action it routes (``Worker.route``)."""


def route_filter(dialect: str, alias: str = "j") -> str:
    """The jobs a worker's handlers can run, as ``Worker.route`` decides: the kind is a
    handler's name; or, for a job without kind, the action is a name, or starts with a name
    followed by one of :data:`SEPARATORS`.

    PostgreSQL: ``:route_names`` (text[]) and ``:route_patterns`` (text[], one LIKE pattern
    per name and separator, :func:`route_patterns`): two array comparisons, a filter on the
    rows of the claim's ordered index walk whose cost the planner sees as small. (A subquery
    over the names per row made the planner cost the claim past ``jit_above_cost`` on a few
    thousand analysed rows: 400 ms of JIT compilation per claim, a worker 10x slower.)
    SQLite (case-insensitive LIKE): ``:routes``, one JSON text parameter, and substr().

    Jobs of a queue that this worker cannot run are walked over by each of its claims of
    that queue (give each service its own queue when such jobs pile up)."""
    j = alias
    if dialect == POSTGRESQL:
        return f"""
          AND ({j}.kind = ANY(CAST(:route_names AS text[]))
               OR ({j}.kind IS NULL AND ({j}.action = ANY(CAST(:route_names AS text[]))
                   OR {j}.action LIKE ANY(CAST(:route_patterns AS text[])))))"""
    names = _JSON_LIST[dialect].format(name="routes")
    separators = ", ".join(f"'{c}'" for c in SEPARATORS)
    return f"""
          AND ({j}.kind IN ({names})
               OR ({j}.kind IS NULL AND ({j}.action IN ({names})
                   OR EXISTS (SELECT 1 FROM ({names}) r
                              WHERE substr({j}.action, 1, length(r.value)) = r.value
                                AND substr({j}.action, length(r.value) + 1, 1)
                                    IN ({separators})))))"""


@lru_cache(maxsize=64)
def route_patterns(names: tuple[str, ...]) -> list[str]:
    """PostgreSQL LIKE patterns (backslash escapes) matching an action that starts with a
    handler's name followed by a separator (``send-quote-%``, ``send-quote:%``, ...,
    ``send-quote\\_%``); ``%``, ``_`` and the backslash in a name match only themselves."""

    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")

    return [escape(name) + escape(sep) + "%" for name in names for sep in SEPARATORS]


def _returning(prefix: str = "") -> str:
    return ", ".join(f"{prefix}{name}" for name in LEASE_COLUMNS)


def _typed(sql: str) -> TextualSelect:
    return text(sql).columns(*[jobs.c[name] for name in LEASE_COLUMNS])


PG_CLAIM_SETTINGS = "SET LOCAL jit = off"
"""Sent before the claim, in its transaction. With fresh statistics on a large backlog the
planner costs the claim (a loose scan, then a lateral walk per tenant) past
``jit_above_cost``, and JIT compilation then took ~270 ms per claim of 100 jobs whose
execution takes a few ms (tests/test_query_plans.py). The claim is OLTP: it never gains from
JIT. On the store's own engine its sessions run without JIT already
(``driver_pg.no_jit``, set once per connection) and the claim sends nothing; on a user's
engine this is one extra short statement per claim, rather than a setting on their sessions."""


@lru_cache(maxsize=64)
def pg_claim_batch(
    now_given: bool,
    *,
    all_queues: bool = True,
    routed: bool = False,
    limited: bool = False,
    finishing: bool = False,
) -> TextualSelect:
    """Claim up to :limit READY rows in one statement (one short transaction).

    Step 2: each (queue, tenant) found gets an equal share, ceil(:limit / pairs), taken in
    (priority desc, id) order with FOR UPDATE SKIP LOCKED, so concurrent claimers never
    wait on each other nor take the same row. The outer ORDER BY/LIMIT keeps the rotation
    order when the shares add up to more than :limit (rows locked but not taken are released
    at commit, a moment later). Step 3: the UPDATE leases them and bumps each epoch.

    ``routed``: only the jobs the worker's handlers route (:func:`route_filter`).
    ``limited`` (the tenant limit, ``:tenant_limit`` and the JSON object ``:tenant_limits``
    of per-tenant overrides): a tenant's share is at most its room,
    :data:`PG_TENANT_ROOM_SQL`, computed once per tenant (a CTE with a volatile function is
    never inlined), so at most the limit of its jobs are LEASED at once in the queue, counted
    over every worker; a tenant at its limit gets no rows, its jobs stay READY with no lease.

    ``finishing``: the same statement also finishes the worker's leases in ``:ids`` and
    ``:epochs`` (:func:`pg_finish_batch`'s fenced UPDATE and history rows), so the slots
    those jobs held are claimed again in the same commit: one round trip for a freed slot's
    finish and its next job, and never more leases than slots at any moment. The rows read
    by the claim are READY and those finished LEASED: the two UPDATEs never touch one row.
    Each finished job comes back as a row of its own, after the leases: its ``id``, with
    every other column NULL (a claimed row always has its ``lease_epoch``). A tenant's room
    (``limited``) is counted before the finishes, so it errs on the side of the limit.

    Why this shape holds whatever the planner statistics say (issue 10): every scan of
    outbox_jobs is an ``ORDER BY ... LIMIT`` whose equalities on the index's leading columns
    (``queue``, ``tenant``) come from the outer row, so the planner estimates them without
    knowing the values (a handful of rows) and the ordered index scan, which stops after the
    share, wins over a bitmap scan and sort; the queue and tenant scans' probes are
    ``LIMIT 1``. Checked by tests/test_query_plans.py on 100,000 READY rows (1 and 10
    tenants) with no statistics and with stale ones (ANALYZE while empty): a claim of 100
    reads at most ~300 rows. The UPDATE takes the picked rows by primary key (``= ANY`` of
    their array): as a join, the planner (which expects ~120 picked rows) hashed them
    against a sequential scan of the whole table, finished jobs included, while the table
    was small (issue 54: 1,863 rows read per claim of 5 in a 2-minute run); on a large
    analysed table it probed the key already.
    """
    now = ":now" if now_given else EPOCH_SQL[POSTGRESQL]
    routes = route_filter(POSTGRESQL) if routed else ""
    if limited:
        cap = (
            "coalesce((CAST(:tenant_limits AS jsonb) ->> t.tenant)::int,"
            " CAST(:tenant_limit AS int))"
        )
        rooms = f""",
rooms AS (
    SELECT t.queue, t.tenant, t.wrapped,
           CASE WHEN {cap} IS NULL THEN NULL
                ELSE {TENANT_ROOM_FUNCTION}(t.queue, t.tenant, {cap}) END AS room
    FROM tenants t
)"""
        source, take = "rooms", "least(share.per, coalesce(t.room, share.per))"
    else:
        rooms, source, take = "", "tenants", "share.per"
    return _typed(
        f"""
WITH RECURSIVE {_queues_sql(POSTGRESQL, all_queues)}{_TENANT_SCAN},
share AS (
    SELECT greatest(1, ceil(CAST(:limit AS double precision) / nullif(count(*), 0)))::int AS per
    FROM tenants
){rooms},
picked AS (
    SELECT p.id FROM {source} t CROSS JOIN share
    CROSS JOIN LATERAL (
        SELECT j.id FROM {JOBS_TABLE} j
        WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = '{READY}'
          AND (j.run_after IS NULL OR j.run_after <= {now}){routes}
        ORDER BY j.priority DESC, j.id
        LIMIT {take}
        FOR UPDATE SKIP LOCKED
    ) p
    ORDER BY t.wrapped, t.tenant, t.queue
    LIMIT :limit
)
{_FINISHING.format(now=now) if finishing else ""}
UPDATE {JOBS_TABLE} AS j
SET state = '{LEASED}', lease_owner = :worker, lease_epoch = j.lease_epoch + 1,
    lease_expires_at = {now} + :ttl, attempts = j.attempts + 1, updated_at = {now}
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING {_returning("j.")}{_FINISHED if finishing else ""}
"""
    )


@lru_cache(maxsize=4)
def sqlite_tenants(all_queues: bool = False) -> TextClause:
    """SQLite: the same rotating (queue, tenant) scan; the caller holds the write lock (BEGIN
    IMMEDIATE), so no row locks are needed and the per-tenant picks run in-process."""
    return text(
        f"WITH RECURSIVE {_queues_sql(SQLITE, all_queues)}{_TENANT_SCAN} "
        "SELECT queue, tenant FROM tenants ORDER BY wrapped, tenant, queue"
    )


@lru_cache(maxsize=8)
def sqlite_pick(now_given: bool, routed: bool = False) -> TextClause:
    now = ":now" if now_given else EPOCH_SQL[SQLITE]
    routes = route_filter(SQLITE, "jobs") if routed else ""
    return text(
        f"""
SELECT id FROM {JOBS_TABLE} AS jobs
WHERE queue = :queue AND tenant = :tenant AND state = '{READY}'
  AND (run_after IS NULL OR run_after <= {now}){routes}
ORDER BY priority DESC, id LIMIT :per
"""
    )


PG_TENANT_LOCK_SQL = f"""
SELECT pg_advisory_xact_lock(hashtext('{TENANT_ROOM_FUNCTION}'),
                             hashtext(current_schema() || '/' || :queue || '/' || :tenant))
"""
"""``Store.claim`` of one named job under a tenant limit (PostgreSQL): the same lock as
:data:`PG_TENANT_ROOM_SQL`'s, so a single claim and the batch claims of every worker decide
one (queue, tenant) at a time. Waited for, not tried: a claim of one job would otherwise be
refused merely because a batch claim was deciding the tenant that moment. It cannot deadlock:
a batch claim holding the lock takes rows with SKIP LOCKED (never waits for the row this claim
holds), and this claim waits for nothing after the lock. The count
(:func:`sqlite_leased_count`, a statement of its own) comes after it, in a fresh snapshot."""


@lru_cache(maxsize=1)
def sqlite_leased_count() -> TextClause:
    """A tenant's LEASED jobs in a queue, at most :cap read (``ix_outbox_jobs_leased_tenant``).
    SQLite: under the write lock, so the count cannot change before the claim commits;
    PostgreSQL (``Store.claim``): after :data:`PG_TENANT_LOCK_SQL`."""
    return text(
        f"SELECT count(*) FROM (SELECT 1 FROM {JOBS_TABLE} WHERE state = '{LEASED}' "
        "AND queue = :queue AND tenant = :tenant LIMIT :cap) AS leased"
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
def depth(dialect: str, one_queue: bool) -> TextClause:
    """READY jobs per queue and the age of the oldest eligible one (``run_after`` passed or
    NULL; database clock), for ``Store.depth`` and the metrics.

    Served by ``ix_outbox_jobs_ready`` (queue, ...) WHERE state = 'READY': it reads the READY
    rows only, O(ready), never the DONE history (tests/test_query_plans.py: 1,000,000 DONE
    rows). The state is a literal so that the planner matches the partial index."""
    now = EPOCH_SQL[dialect]
    eligible = "coalesce(run_after, created_at)"
    where = " AND queue = :queue" if one_queue else ""
    return text(
        f"SELECT queue, count(*) AS ready, "
        f"{now} - min(CASE WHEN {eligible} <= {now} THEN {eligible} END) AS age "
        f"FROM {JOBS_TABLE} WHERE state = '{READY}'{where} GROUP BY queue ORDER BY queue"
    )


# A finished run's job: DONE, or CANCELLED when a cancel was requested while it ran (its
# reason kept as the wait reason), and the history row that says which.
_DONE_OR_CANCELLED = f"CASE WHEN cancel_requested_at IS NULL THEN '{DONE}' ELSE '{CANCELLED}' END"
_CANCEL_REASON = "CASE WHEN cancel_requested_at IS NULL THEN wait_reason ELSE cancel_reason END"
_OUTCOME = f"CASE WHEN state = '{CANCELLED}' THEN 'cancelled' ELSE 'done' END"
_NOTE = f"CASE WHEN state = '{CANCELLED}' THEN 'cancel requested; the run ended done' END"


# The batch finish (pg_finish_batch, and a claim that finishes: pg_claim_batch's finishing):
# its input, the fenced UPDATE, and the history rows of the jobs it ended. ``{now}`` is
# filled in by the caller.
_FINISH_CTES = f"""input AS (
    SELECT * FROM unnest(string_to_array(:ids, ',')::bigint[],
                         string_to_array(:epochs, ',')::bigint[]) AS i(id, epoch)
),
done AS (
    UPDATE {JOBS_TABLE} AS f
    SET state = {_DONE_OR_CANCELLED}, wait_reason = {_CANCEL_REASON},
        lease_owner = NULL, lease_expires_at = NULL, updated_at = {{now}},
        timer_scheduled_for = NULL, timer_reason = NULL, timer_subject_version = NULL,
        timer_cancellation_condition = NULL
    FROM input i
    WHERE f.id = i.id AND f.lease_epoch = i.epoch AND f.lease_owner = :worker
      AND f.state || '' = '{LEASED}'
    RETURNING f.id, i.epoch, f.state, f.order_key, f.concurrency_key
),
lines AS (
    SELECT {ORDER_RELEASE_FUNCTION}(array_agg(id), true, {{now}})
           + {CONCURRENCY_RELEASE_FUNCTION}(array_agg(id), true, {{now}}) AS promoted
    FROM done WHERE order_key IS NOT NULL OR concurrency_key IS NOT NULL HAVING count(*) > 0
)"""
# The history rows; ``lines`` (the finished heads' order keys: their next jobs promoted,
# consumer.jobs.order_keys) is referenced so that it runs, in the same statement.
_FINISH_HISTORY = f"""INSERT INTO {ATTEMPTS_TABLE} (job_id, epoch, worker, outcome, error, at)
SELECT id, epoch, :worker, {_OUTCOME}, {_NOTE}, {{now}} FROM done
WHERE (SELECT count(*) FROM lines) >= 0
RETURNING job_id"""
_FINISHING = f""",
{_FINISH_CTES},
ended AS (
{_FINISH_HISTORY}
),
claimed AS ("""
_FINISHED = f"""
)
SELECT * FROM claimed
UNION ALL
SELECT job_id, {", ".join(["NULL"] * (len(LEASE_COLUMNS) - 1))} FROM ended"""


@lru_cache(maxsize=4)
def pg_finish_batch(now_given: bool) -> TextClause:
    """Finish many leases of one worker in one statement, each fenced on its own epoch.

    The ids and epochs travel as comma-separated text (psycopg would send Python lists as
    text arrays element by element, far slower). A row whose epoch moved on, or that is no
    longer LEASED by :worker, simply does not match: the caller reports it as a conflict.
    The history rows are written by the same statement. A job with a cancel request (issue
    38, ``consumer.jobs.cancels``) ends CANCELLED instead, in the same statement: no round
    trip of its own for what is almost never there.

    The rows are found by primary key, one probe per lease. The fence's ``state || ''`` is
    ``state``, written so that no partial index on LEASED rows matches it: every job passes
    through LEASED, so between two vacuums those indexes fill with entries of jobs long
    finished, which the statistics do not show. With ``state = 'LEASED'`` the planner
    hash-joined the batch against a scan of ``ix_outbox_jobs_leased`` instead: measured
    with a producer holding 4,000 jobs READY, 58,000 dead entries walked per finish 20 s
    after a vacuum, 11 ms a finish of 15 (0.1 ms by key), and a worker's rate halved
    until autovacuum came (tests/test_query_plans.py).
    """
    now = ":now" if now_given else EPOCH_SQL[POSTGRESQL]
    return text(f"WITH {_FINISH_CTES.format(now=now)}\n{_FINISH_HISTORY.format(now=now)}")


@lru_cache(maxsize=1)
def sqlite_finish_batch() -> TextClause:
    """SQLite: finish many leases of one worker in one UPDATE, each fenced on its own epoch
    (:meth:`consumer.jobs.driver_sqlite.SqliteJobDriver.job_finish_batch` writes their
    history rows in a second statement; SQLite has no UPDATE in a CTE).

    The ``[id, epoch]`` pairs travel as ONE JSON text parameter. ``id IN (...)`` makes the
    rows rowid look-ups (never a scan of the history); the row-value test then fences each
    row on its own epoch. A row whose epoch moved on, or that is no longer LEASED by
    :worker, does not match: the caller reports it as a conflict. A job with a cancel
    request ends CANCELLED instead (as on PostgreSQL)."""
    pairs = "SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(:pairs)"
    return text(
        f"""
UPDATE {JOBS_TABLE}
SET state = {_DONE_OR_CANCELLED}, wait_reason = {_CANCEL_REASON},
    lease_owner = NULL, lease_expires_at = NULL, updated_at = :now,
    timer_scheduled_for = NULL, timer_reason = NULL, timer_subject_version = NULL,
    timer_cancellation_condition = NULL
WHERE id IN (SELECT json_extract(value, '$[0]') FROM json_each(:pairs))
  AND (id, lease_epoch) IN ({pairs})
  AND lease_owner = :worker AND state = '{LEASED}'
RETURNING id
"""
    )


@lru_cache(maxsize=1)
def sqlite_finish_history() -> TextClause:
    """SQLite: the history rows of finished leases (``[id, epoch]`` pairs as one JSON text
    parameter, written in the order given): ``done``, or ``cancelled`` for a job whose
    cancel request ended it (its row read by rowid)."""
    return text(
        f"""
INSERT INTO {ATTEMPTS_TABLE} (job_id, epoch, worker, outcome, error, at)
SELECT p.id, p.epoch, :worker, {_OUTCOME}, {_NOTE}, :now
FROM (SELECT key, json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS epoch
      FROM json_each(:pairs)) p JOIN {JOBS_TABLE} j ON j.id = p.id
ORDER BY p.key
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
