"""Bringing an existing job store's tables up to date, at every start and in Alembic.

``metadata.create_all`` never alters a table that exists, so what the job tables gained after
their first release is added by :func:`upgrade_schema` (``consumer.jobs.upgrades``, which
``consumer.jobs.schema`` calls when it creates the tables; re-exported here), each piece only
when missing (idempotent):

- ``outbox_operations``: the call deadline and the operator's settlement (issue 11);
- ``outbox_jobs.trace_context`` (issue 23);
- queues (issue 27): ``outbox_jobs.queue`` (NOT NULL, default ``'default'``: every job of
  an older table is in the default queue), the READY claim index re-created to lead with the
  queue, the index the tenant limit counts with, and ``outbox_paused_queues``;
- replies, delivery callbacks and cancel requests (issue 38): ``outbox_jobs``'s reply
  counters (NOT NULL, default 0) and cancel request, ``outbox_operations``' delivery
  outcome, the tables ``outbox_job_replies`` and ``outbox_deliveries``, and the partial
  index of LEASED jobs with a cancel request;
- steps (issue 57): ``outbox_jobs``'s ``result``, ``on_parent_failure`` and the counters
  ``parents_pending`` and ``children`` (NOT NULL, default 0), and the table
  ``outbox_job_steps`` with its indexes, and the partial index of WAITING_PARENTS jobs the
  metrics count;
- ``outbox_deliveries`` keyed by ``(operation_id, event_id)`` instead of ``event_id`` alone
  (issue 53: callbacks are deduplicated per operation); SQLite rebuilds the table;
- replies to a job not enqueued yet (issue 59): the table ``outbox_kept_replies``;
- order and concurrency keys (issue 56): ``outbox_jobs.order_key``, ``order_hold``,
  ``concurrency_key`` and ``concurrency_limit``, the partial indexes of HELD jobs by key,
  the tables ``outbox_order_keys`` and ``outbox_concurrency_keys`` and (PostgreSQL) their
  functions (``consumer.jobs.order_ddl``);
- PostgreSQL: the tenant limit's function (``consumer.jobs.schema.PG_TENANT_ROOM_SQL``),
  which no MetaData holds and Alembic's autogenerate never emits.

``Store(...)``, ``outbox-worker init-db`` and ``consumer.jobs.upgrades.create_schema`` run
:func:`upgrade_schema`. Alembic users add one line at the end of the migration's
``upgrade()``, after the generated operations (or instead of them, on a database made
before queues)::

    from consumer.jobs.migrations import create_job_extras

    def upgrade() -> None:
        ...                       # the generated operations
        create_job_extras(op)

    def downgrade() -> None:
        drop_job_extras(op)       # before the generated drop_table operations
        ...

On PostgreSQL the column is added without rewriting the table (a constant default), but the
index is built with a plain CREATE INDEX, which blocks writes to the jobs table meanwhile:
on a large table, run the upgrade at a quiet time.
"""

from __future__ import annotations

from typing import Any

from consumer.jobs.order_ddl import CONCURRENCY_RELEASE_FUNCTION, ORDER_RELEASE_FUNCTION
from consumer.jobs.schema import TENANT_ROOM_FUNCTION
from consumer.jobs.upgrades import ADDED_JOB_COLUMNS as ADDED_JOB_COLUMNS
from consumer.jobs.upgrades import ADDED_OPERATION_COLUMNS as ADDED_OPERATION_COLUMNS
from consumer.jobs.upgrades import upgrade_schema as upgrade_schema
from outbox.dialect import is_postgresql


def create_job_extras(op: Any) -> None:
    """In an Alembic migration (``op`` is ``alembic.op``): :func:`upgrade_schema` on the
    migration's connection, after the job tables exist."""
    upgrade_schema(op.get_bind())


def drop_job_extras(op: Any) -> None:
    """In an Alembic downgrade: the tenant limit's and the order keys' functions (PostgreSQL),
    which no MetaData holds; the tables and indexes go with the generated operations."""
    bind = op.get_bind()
    if is_postgresql(bind.dialect.name):
        bind.exec_driver_sql(f"DROP FUNCTION IF EXISTS {TENANT_ROOM_FUNCTION}(text, text, integer)")
        for function in (ORDER_RELEASE_FUNCTION, CONCURRENCY_RELEASE_FUNCTION):
            bind.exec_driver_sql(
                f"DROP FUNCTION IF EXISTS {function}(bigint[], boolean, double precision)"
            )
