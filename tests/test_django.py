"""outbox.django (issue 43), through examples/django_quotes run as a user runs it: real
``manage.py`` processes on PostgreSQL and SQLite, Redis for the streams.

- ``migrate`` makes the table ``create_schema()`` makes, and each accepts the other's;
- the example's tests pass under Django's test runner and under pytest-django (rolled-back
  test transactions leave no event, emit outside a transaction is refused);
- end to end on PostgreSQL: a quote approved twice in the view, ``manage.py outbox_relay``,
  ``outbox_consumer`` and ``outbox_worker`` as processes, exactly one e-mail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from consumer import Store
from outbox import Outbox
from tests.services import wait_for

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "django_quotes"


def django_url(url: str) -> str:
    """The example's DATABASE_URL for one of the suite's SQLAlchemy URLs."""
    return url.replace("postgresql+psycopg://", "postgresql://")


def example_env(url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    env.update(
        DATABASE_URL=django_url(url),
        EMAIL_FILE_PATH=str(tmp_path / "mail"),
        DJANGO_SETTINGS_MODULE="django_quotes.settings",
        **extra,
    )
    return env


def manage(
    env: dict[str, str], *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def table_shape(url: str) -> dict[str, Any]:
    """What the relay depends on: columns (type, nullability, default presence), indexes
    (columns, uniqueness, partial predicate) and, on PostgreSQL, the storage parameters."""
    engine = sa.create_engine(url)
    try:
        inspector = sa.inspect(engine)
        columns = {
            c["name"]: (str(c["type"]), c["nullable"], c["default"] is not None)
            for c in inspector.get_columns("outbox_events")
        }
        indexes = {
            i["name"]: (
                tuple(i["column_names"]),
                bool(i["unique"]),
                str(
                    i.get("dialect_options", {}).get("postgresql_where")
                    or i.get("dialect_options", {}).get("sqlite_where")
                ),
            )
            for i in inspector.get_indexes("outbox_events")
        }
        unique = sorted(
            tuple(u["column_names"]) for u in inspector.get_unique_constraints("outbox_events")
        )
        shape: dict[str, Any] = {"columns": columns, "indexes": indexes, "unique": unique}
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                shape["options"] = conn.execute(
                    sa.text(
                        "SELECT reloptions FROM pg_class WHERE oid = to_regclass('outbox_events')"
                    )
                ).scalar()
        return shape
    finally:
        engine.dispose()


def second_database(url: str, tmp_path: Path, pg_admin_engine: sa.Engine) -> str:
    """Another empty database of the same kind as ``url`` (a schema, or a SQLite file)."""
    if url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'other.db'}"
    schema = f"dj_{uuid.uuid4().hex[:12]}"
    with pg_admin_engine.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    return url.rsplit("search_path%3D", 1)[0] + f"search_path%3D{schema}"


def test_migrate_makes_the_table_create_schema_makes(
    db_url: str, tmp_path: Path, pg_admin_engine: sa.Engine
) -> None:
    migrated = manage(example_env(db_url, tmp_path), "migrate", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr
    other = second_database(db_url, tmp_path, pg_admin_engine)
    try:
        Outbox(other).create_schema()
        assert table_shape(db_url) == table_shape(other)
        Outbox(db_url).create_schema()  # accepts the migrated table as it is
        assert table_shape(db_url) == table_shape(other)
    finally:
        if not other.startswith("sqlite"):
            with pg_admin_engine.connect() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{other.rsplit("%3D", 1)[1]}" CASCADE'))


def test_migrate_accepts_a_table_create_schema_made(db_url: str, tmp_path: Path) -> None:
    outbox = Outbox(db_url)
    outbox.create_schema()
    before = table_shape(db_url)
    with outbox.transaction() as tx:
        tx.emit("quote.approved", key="quote-1", payload={"quote": 1})
    migrated = manage(example_env(db_url, tmp_path), "migrate", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr
    assert table_shape(db_url) == before
    with outbox.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_events")).scalar() == 1
    # And back: unapplying the app drops the table it made.
    reverse = manage(example_env(db_url, tmp_path), "migrate", "outbox", "zero", "-v", "0")
    assert reverse.returncode == 0, reverse.stderr
    assert not sa.inspect(outbox.engine).has_table("outbox_events")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pg", "sqlite"])
def test_the_example_passes_under_djangos_test_runner(
    backend: str, tmp_path: Path, sqlite_url: str
) -> None:
    # Django creates (and drops) a test database of its own: a new one per run on the shared
    # server; SQLite's is in memory.
    url = "postgresql://postgres@127.0.0.1:5432/test" if backend == "pg" else sqlite_url
    env = example_env(url, tmp_path, TEST_DATABASE_NAME=f"test_djq_{uuid.uuid4().hex[:12]}")
    if backend == "sqlite":
        del env["TEST_DATABASE_NAME"]
    result = manage(env, "test", "quotes", "-v", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Ran 9 tests" in result.stderr and "OK" in result.stderr


@pytest.mark.slow
def test_the_example_passes_under_pytest_django(tmp_path: Path) -> None:
    env = example_env(
        "postgresql://postgres@127.0.0.1:5432/test",
        tmp_path,
        TEST_DATABASE_NAME=f"test_djq_{uuid.uuid4().hex[:12]}",
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "quotes/pytest_checks.py"],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout


def _start(env: dict[str, str], *args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=EXAMPLE,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.slow
def test_a_quote_approved_in_the_view_is_mailed_once_by_the_worker(
    pg_url: str, redis_url: str, stream_prefix: str, tmp_path: Path
) -> None:
    env = example_env(
        pg_url,
        tmp_path,
        REDIS_URL=redis_url,
        OUTBOX_STREAM=f"{stream_prefix}.{{topic}}",
        OUTBOX_LOG_LEVEL="info",
    )
    assert manage(env, "migrate", "-v", "0").returncode == 0
    approved = manage(
        env,
        "shell",
        "-c",
        "from django.test import Client\n"
        "from quotes.models import Quote\n"
        "q = Quote.objects.create(customer='Ana', email='ana@example.com', total='120.00')\n"
        "for _ in range(2): print(Client().post(f'/quotes/{q.pk}/approve').json())",
    )
    assert approved.returncode == 0, approved.stderr
    assert approved.stdout.count("'state': 'approved'") == 2
    processes = [
        _start(
            env,
            "outbox_relay",
            "run",
            "--redis-url",
            redis_url,
            "--stream",
            f"{stream_prefix}.{{topic}}",
            log=tmp_path / "relay.log",
        ),
        _start(
            env,
            "outbox_consumer",
            "run",
            "quotes.pipeline:consumer",
            "--redis-url",
            redis_url,
            log=tmp_path / "consumer.log",
        ),
        _start(env, "outbox_worker", "run", "quotes.pipeline:worker", log=tmp_path / "worker.log"),
    ]
    store = Store(pg_url)
    try:

        def done() -> bool:
            with store.engine.connect() as conn:
                states = conn.execute(sa.text("SELECT state FROM outbox_jobs")).scalars().all()
            return states == ["DONE"]

        wait_for(
            done,
            "the quote's job DONE",
            timeout=120,
            diagnose=lambda: "\n".join(p.read_text()[-1500:] for p in tmp_path.glob("*.log")),
        )
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=60) for process in processes]
        store.dispose()
    assert codes == [0, 0, 0], [p.read_text()[-1500:] for p in tmp_path.glob("*.log")]
    mails = list((tmp_path / "mail").iterdir())
    assert len(mails) == 1
    assert "Your quote" in mails[0].read_text()
    with sa.create_engine(pg_url).connect() as conn:
        assert conn.execute(sa.text("SELECT mail_queued FROM quotes_quote")).scalar() is True
