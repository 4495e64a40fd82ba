"""The job store's tables, as SQLAlchemy metadata (Alembic users can include ``metadata``),
and how they are made: :func:`create_schema` creates what is missing and brings an older
table up to date (:func:`upgrade_schema`; Alembic: ``consumer.jobs.migrations``).

Times are **unix seconds as double precision** (``now`` may be given as a number in every
call, and lease arithmetic ``now + ttl`` is the same SQL on PostgreSQL and SQLite). The
database clock in that unit is :class:`db_epoch` (PostgreSQL ``extract(epoch from now())``,
SQLite ``julianday`` arithmetic). Job states are the strings of ``consumer.jobs.states``.

``outbox_jobs`` - one row per job (metrics read these names; do not rename):

- ``id``: surrogate key. ``tenant`` + ``action``: the job's identity, unique per tenant
  (``uq_outbox_jobs_tenant_action``); enqueueing it again returns the existing row.
- ``queue``: the named queue the job waits in (``'default'`` unless given): workers claim from
  the queues they are given (all, by default), and an operator can pause one
  (``outbox_paused_queues``).
- ``kind``: the handler's name (NULL: the Worker routes by the action's prefix).
- ``subject`` / ``subject_version``: the business subject the job acts on and the version
  it was planned against. ``payload``: JSON. ``provider``: the external provider, for the
  per-provider backoff ceiling.
- ``state``: READY, LEASED, WAITING_EXTERNAL, WAITING_REVIEW, NEEDS_ATTENTION, DONE,
  CANCELLED. ``priority``: higher first within a tenant.
- ``run_after``: when the job is next eligible (NULL: at once). For a waiting job, when its
  timer wakes it.
- ``attempts``: claims so far. ``auth_failures``: consecutive authentication failures.
  ``first_failed_at``: start of the current failure streak (the recovery window).
  ``last_error``: the latest failure's text. ``wait_reason``: why it waits.
- ``lease_owner`` / ``lease_expires_at`` / ``lease_epoch``: the lease. ``lease_epoch``
  increments on every claim and never decreases; every holder's move is compare-and-set on
  (id, epoch). An expired lease is ``state = 'LEASED' AND lease_expires_at <= now``.
- ``timer_scheduled_for`` / ``timer_reason`` / ``timer_subject_version`` /
  ``timer_cancellation_condition`` (JSON): a business timer (``Store.schedule``).
- ``created_at`` / ``updated_at``.

``replies_received`` / ``replies_consumed``: the job's replies (``outbox_job_replies``) so
far, and up to which a run that ended well consumed them. ``cancel_requested_at`` /
``cancel_reason``: a cancel requested while it was LEASED (``consumer.jobs.cancels``).
``result`` (JSON), ``parents_pending``, ``children``, ``on_parent_failure``: steps
(``consumer.jobs.steps``; edges in ``outbox_job_steps``).

Useful metric queries: jobs per state ``SELECT state, count(*) ... GROUP BY state``; oldest
eligible READY age ``db_epoch - min(coalesce(run_after, created_at)) WHERE state = 'READY'
AND coalesce(run_after, created_at) <= db_epoch``; expired leases ``count(*) WHERE state =
'LEASED' AND lease_expires_at <= db_epoch`` (index ``ix_outbox_jobs_leased``).

``outbox_job_attempts`` - the attempt history, one row per ended attempt or move:
``job_id``, ``epoch``, ``worker``, ``outcome`` (done, retry, waiting_external,
waiting_review, needs_attention, expired, cancelled, scheduled, conflict-free moves only),
``error``, ``at``.

``outbox_operations`` - operation intents and receipts for external effects (guarantee 8;
see ``consumer.jobs.operations``): ``operation_id`` (stable), ``job_id``, ``provider``,
``request_digest``, ``state`` (PENDING, ACCEPTED, UNKNOWN, NOT_SENT, FAILED), ``provider_ref``,
``attempts`` (provider calls, counted before each is made), ``last_error``, ``call_deadline``
(until when the latest call may be in flight: nobody looks it up before), ``settled_by`` /
``settled_reason`` / ``settled_at`` (an operator's or the sweep's decision), ``created_at``,
``updated_at``, ``delivery_status`` / ``delivery_at`` (what the provider said later:
``consumer.jobs.deliveries``). Open receipts: ``ix_outbox_operations_open``. Unknown receipts:
``count(*), db_epoch - min(updated_at) WHERE state = 'UNKNOWN'`` (``ix_outbox_operations_unknown``).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection

from consumer.jobs.order_ddl import (
    ORDER_KEYS_TABLE,
    key_tables,
)
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING_EXTERNAL,
    WAITING_PARENTS,
    WAITING_REVIEW,
)
from outbox.dialect import db_epoch, quoted_table
from outbox.maintenance import HOT_TABLE_AUTOVACUUM, set_storage_parameters
from outbox.validate import MAX_NAME_LENGTH as NAME_LENGTH

__all__ = [
    "ATTEMPTS_TABLE",
    "JOBS_TABLE",
    "OPERATIONS_TABLE",
    "attempts",
]
__all__ += ["WORKERS_TABLE", "db_epoch", "jobs", "metadata", "operations", "workers"]
__all__ += ["PROVIDER_LIMITS_TABLE", "provider_limits"]
__all__ += ["DEFAULT_QUEUE", "PAUSED_QUEUES_TABLE", "paused_queues"]
__all__ += ["DELIVERIES_TABLE", "REPLIES_TABLE", "deliveries", "replies"]
__all__ += ["SCHEDULES_TABLE", "schedules"]
__all__ += ["STEPS_TABLE", "job_steps"]
__all__ += ["EARLY_REPLIES_TABLE", "early_replies"]
__all__ += ["ORDER_KEYS_TABLE", "concurrency_keys", "order_keys"]

JOBS_TABLE = "outbox_jobs"
ATTEMPTS_TABLE = "outbox_job_attempts"
PAUSED_QUEUES_TABLE = "outbox_paused_queues"
DEFAULT_QUEUE = "default"
"""The queue of a job enqueued without one (and of every job of a table made before queues)."""


def _json() -> JSON:
    return JSON().with_variant(JSONB(), "postgresql")


def _id_type() -> BigInteger:
    return BigInteger().with_variant(Integer(), "sqlite")


metadata = MetaData()

jobs = Table(
    JOBS_TABLE,
    metadata,
    Column("id", _id_type(), primary_key=True, autoincrement=True),
    Column("tenant", String(NAME_LENGTH), nullable=False),
    Column("action", String(NAME_LENGTH), nullable=False),
    Column("queue", String(NAME_LENGTH), nullable=False, server_default=text(f"'{DEFAULT_QUEUE}'")),
    Column("kind", String(NAME_LENGTH), nullable=True),
    Column("subject", String(NAME_LENGTH), nullable=True),
    Column("subject_version", String(NAME_LENGTH), nullable=True),
    Column("payload", _json(), nullable=True),
    Column("provider", String(NAME_LENGTH), nullable=True),
    Column("state", String(24), nullable=False, server_default=text(f"'{READY}'")),
    Column("priority", Integer, nullable=False, server_default=text("0")),
    Column("run_after", Double, nullable=True),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("auth_failures", Integer, nullable=False, server_default=text("0")),
    Column("first_failed_at", Double, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("wait_reason", Text, nullable=True),
    Column("lease_owner", String(NAME_LENGTH), nullable=True),
    Column("lease_expires_at", Double, nullable=True),
    Column("lease_epoch", BigInteger, nullable=False, server_default=text("0")),
    Column("timer_scheduled_for", Double, nullable=True),
    Column("timer_reason", Text, nullable=True),
    Column("timer_subject_version", String(NAME_LENGTH), nullable=True),
    Column("timer_cancellation_condition", _json(), nullable=True),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
    # The W3C trace context of the span that enqueued the job (outbox.tracing), as JSON.
    Column("trace_context", Text, nullable=True),
    # Replies (consumer.jobs.replies): how many were received, and up to which of them a run
    # that ended well consumed (each reply's ``seq``). A claim returns both, so a run whose
    # job has no new reply reads nothing more.
    Column("replies_received", Integer, nullable=False, server_default=text("0")),
    Column("replies_consumed", Integer, nullable=False, server_default=text("0")),
    # A cancel requested while the job was LEASED (``Store.cancel``): its holder sees it and
    # the run ends CANCELLED.
    Column("cancel_requested_at", Double, nullable=True),
    Column("cancel_reason", Text, nullable=True),
    # Steps (consumer.jobs.steps): the handler's return value, the parents not DONE yet, the
    # dependents (a lease with none finishes on the plain path), and what a failed parent
    # does to this job (NULL: WAITING_REVIEW; 'cancel').
    Column("result", _json(), nullable=True),
    Column("parents_pending", Integer, nullable=False, server_default=text("0")),
    Column("children", Integer, nullable=False, server_default=text("0")),
    Column("on_parent_failure", String(16), nullable=True),
    # The order key (consumer.jobs.order_keys) and ``order_hold``: 'run' lets later jobs of
    # the key pass this one while it waits on a reply or a timer (NULL: it holds them).
    Column("order_key", String(NAME_LENGTH), nullable=True),
    Column("order_hold", String(8), nullable=True),
    # The concurrency key and its limit: at most that many of the key's jobs admitted (not
    # HELD) and unfinished at once, across the fleet (consumer.jobs.order_keys).
    Column("concurrency_key", String(NAME_LENGTH), nullable=True),
    Column("concurrency_limit", Integer, nullable=True),
    UniqueConstraint("tenant", "action", name="uq_outbox_jobs_tenant_action"),
)

# The claim walks READY rows of one (queue, tenant) in (priority desc, id) order, and the
# fairness scan hops from tenant to tenant of a queue over the same index (a loose index
# scan); ``Store.depth`` counts a queue's READY rows from it. It leads with the queue, so a
# worker of one queue never walks another queue's backlog. Partial: it holds only READY rows,
# so DONE rows piling up never slow the claim. (Tables made before queues had it without the
# queue: ``consumer.jobs.migrations`` re-creates it.)
READY_INDEX = Index(
    "ix_outbox_jobs_ready",
    jobs.c.queue,
    jobs.c.tenant,
    jobs.c.priority.desc(),
    jobs.c.id,
    postgresql_where=jobs.c.state == READY,
    sqlite_where=jobs.c.state == READY,
)
# Recovery looks for expired leases only.
Index(
    "ix_outbox_jobs_leased",
    jobs.c.lease_expires_at,
    postgresql_where=jobs.c.state == LEASED,
    sqlite_where=jobs.c.state == LEASED,
)
# The tenant limit counts a tenant's LEASED jobs in a queue at claim time (at most the limit
# of them): an equality probe on both columns, whatever the size of the table.
LEASED_TENANT_INDEX = Index(
    "ix_outbox_jobs_leased_tenant",
    jobs.c.queue,
    jobs.c.tenant,
    postgresql_where=jobs.c.state == LEASED,
    sqlite_where=jobs.c.state == LEASED,
)
# Jobs that need a person: the metrics count them at every scrape; keep that lookup small.
Index(
    "ix_outbox_jobs_needs_attention",
    jobs.c.updated_at,
    postgresql_where=jobs.c.state == NEEDS_ATTENTION,
    sqlite_where=jobs.c.state == NEEDS_ATTENTION,
)
# Timers of waiting jobs.
Index(
    "ix_outbox_jobs_waiting",
    jobs.c.run_after,
    postgresql_where=jobs.c.state.in_([WAITING_EXTERNAL, WAITING_REVIEW]),
    sqlite_where=jobs.c.state.in_([WAITING_EXTERNAL, WAITING_REVIEW]),
)

# Steps waiting for their parents (consumer.jobs.steps): the metrics count them at every
# scrape, and the oldest one's age; keep that lookup small, as for NEEDS_ATTENTION.
WAITING_PARENTS_INDEX = Index(
    "ix_outbox_jobs_waiting_parents",
    jobs.c.updated_at,
    postgresql_where=jobs.c.state == WAITING_PARENTS,
    sqlite_where=jobs.c.state == WAITING_PARENTS,
)

# Order and concurrency keys (consumer/jobs/order_keys.py): their tables and the partial
# indexes of HELD jobs by key (consumer.jobs.order_ddl has the reasons).
order_keys, concurrency_keys, ORDER_HELD_INDEX, CONCURRENCY_HELD_INDEX = key_tables(metadata, jobs)

# Retention (consumer.jobs.retention) deletes finished jobs oldest first: a walk of this
# index, never a scan of the table. Partial: READY and LEASED rows never enter it.
FINISHED_JOBS_INDEX = Index(
    "ix_outbox_jobs_finished",
    jobs.c.updated_at,
    jobs.c.id,
    postgresql_where=jobs.c.state.in_([DONE, CANCELLED]),
    sqlite_where=jobs.c.state.in_([DONE, CANCELLED]),
)

attempts = Table(
    ATTEMPTS_TABLE,
    metadata,
    Column("id", _id_type(), primary_key=True, autoincrement=True),
    Column("job_id", BigInteger, nullable=False),
    Column("epoch", BigInteger, nullable=True),
    Column("worker", String(NAME_LENGTH), nullable=True),
    Column("outcome", String(32), nullable=False),
    Column("error", Text, nullable=True),
    Column("at", Double, nullable=False),
)
Index("ix_outbox_job_attempts_job", attempts.c.job_id)

OPERATIONS_TABLE = "outbox_operations"

# Operation intents and their receipts (consumer/jobs/operations.py documents the columns).
operations = Table(
    OPERATIONS_TABLE,
    metadata,
    Column("operation_id", String(NAME_LENGTH * 2), primary_key=True),
    Column("job_id", BigInteger, nullable=False),
    Column("provider", String(NAME_LENGTH), nullable=False),
    Column("request_digest", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    Column("provider_ref", String(NAME_LENGTH), nullable=True),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text, nullable=True),
    Column("call_deadline", Double, nullable=True),
    Column("settled_by", String(NAME_LENGTH), nullable=True),
    Column("settled_reason", Text, nullable=True),
    Column("settled_at", Double, nullable=True),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
    # What the provider said later about an ACCEPTED effect (``Operations.record_delivery``):
    # delivered, opened, complained or bounced (the furthest along wins), and when.
    Column("delivery_status", String(16), nullable=True),
    Column("delivery_at", Double, nullable=True),
)
# The reconciliation sweep reads open receipts (PENDING, UNKNOWN) oldest change first; an
# ACCEPTED one leaves this index, so it holds only what is in flight or unsettled.
OPEN_RECEIPTS_INDEX = Index(
    "ix_outbox_operations_open",
    operations.c.updated_at,
    postgresql_where=operations.c.state.in_(["PENDING", "UNKNOWN"]),
    sqlite_where=operations.c.state.in_(["PENDING", "UNKNOWN"]),
)
# Retention deletes a finished job's intents and receipts with it, found by job.
JOB_OPERATIONS_INDEX = Index("ix_outbox_operations_job", operations.c.job_id)
# The metrics read UNKNOWN receipts (count, oldest age): keep that lookup small.
Index(
    "ix_outbox_operations_unknown",
    operations.c.updated_at,
    postgresql_where=operations.c.state == "UNKNOWN",
    sqlite_where=operations.c.state == "UNKNOWN",
)

WORKERS_TABLE = "outbox_workers"

# Worker liveness: each running Worker upserts its row (``name`` is its incarnation name,
# what it writes as ``lease_owner``) every ``liveness_interval`` with ``alive_until`` = the
# database clock + ``liveness_ttl``, and deletes it on a clean stop. A LEASED job whose owner
# has a row that expired is recovered at once (a missing row: the lease's own expiry).
workers = Table(
    WORKERS_TABLE,
    metadata,
    Column("name", String(NAME_LENGTH), primary_key=True),
    Column("alive_until", Double, nullable=False),
)

PROVIDER_LIMITS_TABLE = "outbox_provider_limits"

# Provider limits that bind the whole fleet (consumer/jobs/limits.py): one row per provider,
# written by whichever worker calls it. ``next_call_at``: the earliest time the next call may
# start (a ``rate_limit`` spaces calls by reserving slots here); ``paused_until``: a 429/503
# with Retry-After pauses the provider for every worker until then; ``pauses`` counts them
# (unix seconds, database clock).
provider_limits = Table(
    PROVIDER_LIMITS_TABLE,
    metadata,
    Column("provider", String(NAME_LENGTH), primary_key=True),
    Column("next_call_at", Double, nullable=False, server_default=text("0")),
    Column("paused_until", Double, nullable=False, server_default=text("0")),
    Column("pauses", Integer, nullable=False, server_default=text("0")),
)

# Queues an operator paused (``Store.pause_queue``): no worker claims from them until
# ``resume_queue`` deletes the row. A handful of rows at most.
paused_queues = Table(
    PAUSED_QUEUES_TABLE,
    metadata,
    Column("queue", String(NAME_LENGTH), primary_key=True),
    Column("paused_at", Double, nullable=False),
)

REPLIES_TABLE = "outbox_job_replies"

# Replies to jobs (``Store.reply``; consumer/jobs/replies.py): one row per (job, reply_id),
# ``seq`` numbering a job's replies from 1 in the order received. ``consumed_at`` is set
# when a run that saw it ended well (DONE, a wait, a defer); kept afterwards, for the trace.
replies = Table(
    REPLIES_TABLE,
    metadata,
    Column("id", _id_type(), primary_key=True, autoincrement=True),
    Column("job_id", BigInteger, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("reply_id", String(NAME_LENGTH * 2), nullable=False),
    Column("payload", _json(), nullable=True),
    Column("source", String(NAME_LENGTH), nullable=True),
    Column("received_at", Double, nullable=False),
    Column("consumed_at", Double, nullable=True),
    UniqueConstraint("job_id", "reply_id", name="uq_outbox_job_replies_job_reply"),
)
# A run reads its job's unconsumed replies by (job_id, seq).
Index("ix_outbox_job_replies_job_seq", replies.c.job_id, replies.c.seq)

EARLY_REPLIES_TABLE = "outbox_kept_replies"

# Replies to a (tenant, action) not enqueued yet (consumer/jobs/replies.py): kept here,
# deduplicated by reply_id, until the job's enqueue moves them into ``outbox_job_replies``
# (same transaction), or retention drops them past its early-reply window.
early_replies = Table(
    EARLY_REPLIES_TABLE,
    metadata,
    Column("id", _id_type(), primary_key=True, autoincrement=True),
    Column("tenant", String(NAME_LENGTH), nullable=False),
    Column("action", String(NAME_LENGTH), nullable=False),
    Column("reply_id", String(NAME_LENGTH * 2), nullable=False),
    Column("payload", _json(), nullable=True),
    Column("source", String(NAME_LENGTH), nullable=True),
    Column("received_at", Double, nullable=False),
    UniqueConstraint("tenant", "action", "reply_id", name="uq_outbox_kept_replies_key"),
)
Index("ix_outbox_kept_replies_received", early_replies.c.received_at)

DELIVERIES_TABLE = "outbox_deliveries"

# Delivery callbacks (``Operations.record_delivery``; consumer/jobs/deliveries.py): one row
# per provider event of an operation (``(operation_id, event_id)``, the dedup key: a provider's
# event ids are unique in its own account, not across every provider and operation, issue 53).
# ``applied_at`` is set once its receipt was ACCEPTED and the outcome applied to it; a
# callback that came first waits here until then.
DELIVERIES_KEY = "pk_outbox_deliveries_operation_event"
deliveries = Table(
    DELIVERIES_TABLE,
    metadata,
    Column("event_id", String(NAME_LENGTH * 2), nullable=False),
    Column("operation_id", String(NAME_LENGTH * 2), nullable=False),
    Column("status", String(16), nullable=False),
    Column("provider_ref", String(NAME_LENGTH), nullable=True),
    Column("detail", Text, nullable=True),
    Column("received_at", Double, nullable=False),
    Column("applied_at", Double, nullable=True),
    PrimaryKeyConstraint("operation_id", "event_id", name=DELIVERIES_KEY),
)
DELIVERIES_OPERATION_INDEX = Index("ix_outbox_deliveries_operation", deliveries.c.operation_id)
# Callbacks not applied yet (their receipt was not ACCEPTED when they came): the sweep's read.
UNAPPLIED_DELIVERIES_INDEX = Index(
    "ix_outbox_deliveries_unapplied",
    deliveries.c.received_at,
    postgresql_where=deliveries.c.applied_at.is_(None),
    sqlite_where=deliveries.c.applied_at.is_(None),
)
# LEASED jobs with a cancel request: the worker's watch reads them often, so it stays tiny.
CANCEL_REQUESTED_INDEX = Index(
    "ix_outbox_jobs_cancel_requested",
    jobs.c.lease_owner,
    postgresql_where=(jobs.c.state == LEASED) & jobs.c.cancel_requested_at.is_not(None),
    sqlite_where=(jobs.c.state == LEASED) & jobs.c.cancel_requested_at.is_not(None),
)

SCHEDULES_TABLE = "outbox_schedules"

# Schedules (``Store.schedule_every``; consumer/jobs/schedules.py): one row per schedule, its
# definition and where it stands. ``next_slot`` is the earliest slot not yet decided (unix
# seconds, UTC): the firing duty takes the rows whose ``next_slot`` passed, enqueues their
# slots' jobs and moves it on, in one transaction. ``last_slot`` / ``last_job_id``: the latest
# slot fired and its job. ``fired`` / ``missed``: slots fired and slots given up (an outage
# longer than the grace, beyond ``catch_up_limit``), for the metrics. ``paused_at``: an
# operator paused it. ``source``: ``code`` (a Worker's ``schedules=``) or ``api``.
schedules = Table(
    SCHEDULES_TABLE,
    metadata,
    Column("name", String(NAME_LENGTH), primary_key=True),
    Column("cron", String(NAME_LENGTH), nullable=False),
    Column("tz", String(64), nullable=False),
    Column("tenant", String(NAME_LENGTH), nullable=False),
    Column("action", String(NAME_LENGTH), nullable=False),
    Column("payload", _json(), nullable=True),
    Column("queue", String(NAME_LENGTH), nullable=False),
    Column("missed_policy", String(16), nullable=False),
    Column("catch_up_limit", Integer, nullable=False),
    Column("grace", Double, nullable=False),
    Column("source", String(16), nullable=False),
    Column("next_slot", Double, nullable=False),
    Column("last_slot", Double, nullable=True),
    Column("last_job_id", BigInteger, nullable=True),
    Column("fired", BigInteger, nullable=False, server_default=text("0")),
    Column("missed", BigInteger, nullable=False, server_default=text("0")),
    Column("paused_at", Double, nullable=True),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
)
# The firing duty's read: running schedules by next slot (its earliest, and those due).
DUE_SCHEDULES_INDEX = Index(
    "ix_outbox_schedules_due",
    schedules.c.next_slot,
    postgresql_where=schedules.c.paused_at.is_(None),
    sqlite_where=schedules.c.paused_at.is_(None),
)

STEPS_TABLE = "outbox_job_steps"

# Dependencies (``after=`` at enqueue; consumer/jobs/steps.py): one row per (parent, child).
# ``released`` is set once the parent's end was applied to the child (its count of pending
# parents, or the failure policy): exactly once, whichever worker or sweep gets there first.
job_steps = Table(
    STEPS_TABLE,
    metadata,
    Column("parent_id", BigInteger, primary_key=True),
    Column("child_id", BigInteger, primary_key=True),
    Column("released", Integer, nullable=False, server_default=text("0")),
)
Index("ix_outbox_job_steps_child", job_steps.c.child_id)
# The sweep's read: edges whose parent ended but were not applied yet (a handful).
UNRELEASED_STEPS_INDEX = Index(
    "ix_outbox_job_steps_unreleased",
    job_steps.c.parent_id,
    postgresql_where=job_steps.c.released == 0,
    sqlite_where=job_steps.c.released == 0,
)

HOT_TABLES = (JOBS_TABLE, ATTEMPTS_TABLE, OPERATIONS_TABLE)
"""The job tables written all day (every claim and finish updates a job, every outcome adds
a history row): they get the hot-table autovacuum settings, and the worker vacuums them
itself when the server runs without autovacuum (``outbox.maintenance``)."""


def set_autovacuum(conn: Connection) -> None:
    """PostgreSQL: the hot job tables' per-table autovacuum settings, each set only when
    missing (a value set by hand stays)."""
    for table in HOT_TABLES:
        set_storage_parameters(conn, quoted_table(table), HOT_TABLE_AUTOVACUUM)


# -- creating the tables and bringing them up to date ------------------------------------

TENANT_ROOM_FUNCTION = "outbox_jobs_tenant_room"

PG_TENANT_ROOM_SQL = f"""
CREATE OR REPLACE FUNCTION {TENANT_ROOM_FUNCTION}(p_queue text, p_tenant text, p_cap integer)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- One claim at a time decides for a (queue, tenant), across every process on the
    -- database: the lock is held until the claim's transaction ends. A claim that finds it
    -- taken skips the tenant this time (room 0) instead of waiting: no claim ever waits for
    -- another, and claims that meet tenants in different orders cannot deadlock.
    IF NOT pg_try_advisory_xact_lock(hashtext('{TENANT_ROOM_FUNCTION}'),
            hashtext(current_schema() || '/' || p_queue || '/' || p_tenant)) THEN
        RETURN 0;
    END IF;
    -- VOLATILE plpgsql under READ COMMITTED: this statement takes a fresh snapshot, AFTER the
    -- lock, so it sees the leases every earlier claim of this tenant committed (the calling
    -- claim's own snapshot predates them: counting there would let two claims both fill
    -- the last place). At most p_cap rows are read (ix_outbox_jobs_leased_tenant).
    RETURN greatest(0, p_cap - (
        SELECT count(*) FROM (
            SELECT 1 FROM {JOBS_TABLE}
            WHERE state = '{LEASED}' AND queue = p_queue AND tenant = p_tenant
            LIMIT p_cap) leased))::integer;
END
$$"""
"""The tenant limit's place keeper (PostgreSQL): how many more jobs of the tenant may be
leased in the queue now, ``p_cap`` the limit. Created by :func:`create_schema` and by
``consumer.jobs.migrations.create_job_extras`` (Alembic); the claim calls it only when a
limit applies."""
