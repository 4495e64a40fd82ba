"""The relay's storage seam: every SQL statement the relay runs, PostgreSQL, SQLite and
MySQL/MariaDB.

Why the statements look as they do (partitions owned through advisory locks, the claim in
``seq`` order that also writes the intent, the ``blocked`` index that holds back a failing
key only, the claim floor that never skips a late commit, the receipt as a compare-and-set,
the single relay on SQLite) is explained once, in docs/explanation/claims-and-order.md and
docs/explanation/reconciliation.md; each statement below carries its own reason beside it.
:func:`store_for` picks the store for an engine; every store method commits on its own
(docs/contributing.md, "Storage seams").
"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from outbox.dialect import SQLITE, is_mysql, is_postgresql
from outbox.errors import ConfigError
from outbox.schema import OutboxSchema
from outbox.status import age_seconds as age_seconds
from outbox.status import backlog_by_topic as backlog_by_topic
from outbox.status import most_attempted as most_attempted
from outbox.status import pending_attempts as pending_attempts
from outbox.status import pending_max_attempts_by_topic as pending_max_attempts_by_topic
from outbox.status import quarantined_by_topic as quarantined_by_topic
from outbox.status import quarantined_count as quarantined_count
from relay.config import RelayConfig
from relay.store.base import Store as Store
from relay.store.mysql import MysqlStore as MysqlStore
from relay.store.pg_statements import PG_BACKLOG as PG_BACKLOG
from relay.store.pg_statements import PG_CLAIM as PG_CLAIM
from relay.store.pg_statements import PG_FAILED as PG_FAILED
from relay.store.pg_statements import PG_LOCKS as PG_LOCKS
from relay.store.pg_statements import PG_MARK_ORPHANS as PG_MARK_ORPHANS
from relay.store.pg_statements import PG_ORPHANS as PG_ORPHANS
from relay.store.pg_statements import PG_PUBLISHED as PG_PUBLISHED
from relay.store.pg_statements import PG_QUARANTINE as PG_QUARANTINE
from relay.store.pg_statements import PG_RELEASE as PG_RELEASE
from relay.store.pg_statements import PG_RESOLVE_FOUND as PG_RESOLVE_FOUND
from relay.store.pg_statements import PG_RESOLVE_MISSING as PG_RESOLVE_MISSING
from relay.store.pg_statements import PG_RETENTION as PG_RETENTION
from relay.store.pg_statements import PG_RETRY_NOW as PG_RETRY_NOW
from relay.store.pg_statements import PG_RETRY_READY as PG_RETRY_READY
from relay.store.pg_statements import PG_SNAPSHOT as PG_SNAPSHOT
from relay.store.postgres import SETTLE as SETTLE
from relay.store.postgres import PostgresStore as PostgresStore
from relay.store.sqlite import SQLITE_CLAIM as SQLITE_CLAIM
from relay.store.sqlite import SqliteStore as SqliteStore


def store_for(engine: Engine, schema: OutboxSchema, config: RelayConfig | None = None) -> Store:
    """The store for ``engine``'s database: the one place that asks which database it is.

    Named as the other seams' factories are (``<seam>_for(engine, ...)``:
    :func:`consumer.jobs.driver.driver_for`, :func:`consumer.inbox.inbox_for`)."""
    config = config or RelayConfig()
    if is_postgresql(engine.dialect.name):
        return PostgresStore(
            engine,
            schema,
            partitions=config.partitions,
            reconcile_after=config.reconcile_after,
            listen=config.listen,
            rebalance_interval=config.rebalance_interval,
            sweep_interval=config.sweep_interval,
        )
    if engine.dialect.name == SQLITE:
        return SqliteStore(engine, schema, reconcile_after=config.reconcile_after)
    if is_mysql(engine.dialect.name):
        return MysqlStore(
            engine,
            schema,
            partitions=config.partitions,
            reconcile_after=config.reconcile_after,
            rebalance_interval=config.rebalance_interval,
        )
    raise ConfigError("database_url", f"unsupported database {engine.dialect.name}")


open_store = store_for
"""The earlier name of :func:`store_for`, kept for callers that import it."""
