"""Where a :class:`~outbox.testing.Pipeline` runs: a database and a Redis of the test's own.

- :func:`open_database`: the embedded default (a SQLite file in the test's directory, not
  fsynced), a SQLite URL as is, or a schema of the pipeline's own on your PostgreSQL
  (``outbox_test_<token>``, selected by the connection's ``search_path``), dropped on close;
- :func:`open_redis`: an embedded Redis server in the test's directory, or your Redis with
  the pipeline's keys under a prefix of its own, deleted on close.

Each appends what undoes it to ``closers``, which :meth:`Pipeline.close
<outbox.testing.Pipeline.close>` runs in reverse order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

from outbox.db import make_engine


def _no_fsync(dbapi_connection: Any, _record: Any) -> None:
    """The test's own SQLite file (in its temp dir, gone after it) is not fsynced at its WAL
    checkpoints: nothing a test observes depends on surviving a power cut, and the syncs were
    a tenth of a big drain(). Transactions, locks and WAL mode are production's."""
    dbapi_connection.execute("PRAGMA synchronous=OFF")


def open_database(
    url: str | None, *, directory: str | None, token: str, closers: list[Callable[[], None]]
) -> tuple[Engine, str]:
    """The pipeline's engine and its URL (password shown): ``url``, or the SQLite file
    ``outbox.db`` in ``directory``; on PostgreSQL in the schema ``outbox_test_<token>``,
    made here and dropped by the closer appended to ``closers``."""
    own_file = None
    if url is None:
        assert directory is not None
        url = own_file = "sqlite:///" + os.path.join(directory, "outbox.db")
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        engine = make_engine(parsed)
        if url == own_file:
            event.listen(engine, "connect", _no_fsync)
        closers.append(engine.dispose)
        return engine, parsed.render_as_string(hide_password=False)
    schema = f"outbox_test_{token}"
    admin = sa.create_engine(parsed, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))

    def drop_schema() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()

    closers.append(drop_schema)
    own = parsed.update_query_dict({"options": f"-csearch_path={schema}"})
    database_url = own.render_as_string(hide_password=False)
    engine = make_engine(own, pool_size=5, max_overflow=5)
    closers.append(engine.dispose)
    return engine, database_url


def open_redis(
    url: str | None, *, directory: str | None, token: str, closers: list[Callable[[], None]]
) -> tuple[redis.Redis, str]:
    """The pipeline's Redis client and its key prefix: an embedded server in ``directory``
    when ``url`` is None (no prefix: production's names), else ``url``'s server with the
    prefix ``outbox-test-<token>.``, whose keys the closer appended to ``closers`` deletes."""
    if url is None:
        from outbox.embedded_redis import embedded_server

        assert directory is not None
        server = embedded_server(os.path.join(directory, "redis.db"))
        closers.append(server.release)
        return server.client(), ""  # a server of the test's own: production's names
    client = redis.Redis.from_url(url)
    client.ping()
    prefix = f"outbox-test-{token}."

    def clean() -> None:
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()

    closers.append(clean)
    return client, prefix


__all__ = ["open_database", "open_redis"]
