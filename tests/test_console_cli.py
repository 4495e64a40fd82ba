"""``outbox-console`` as a command: ``trace`` exit codes and output, ``init-db``, and
``serve``'s token (generated and printed, from a file, from the environment), its warning
off 127.0.0.1, ``--read-only`` from the environment, hidden passwords and SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import sqlalchemy as sa

from consumer.jobs.store import Store
from outbox import Outbox
from outbox.console.schema import LOOKUP_INDEXES, missing_lookup_indexes
from tests.conftest import PG_BASE
from tests.console_process import ROOT, ConsoleProcess
from tests.console_support import World

TOKEN = "cli-token-" + "z" * 24


@pytest.fixture
def world(db_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[World]:
    w = World(db_url, redis_client, stream_prefix)
    yield w
    w.close()


@pytest.fixture
def pg_tables(pg_url: str) -> None:
    """The parts' tables, as their processes create them at start."""
    Outbox(pg_url).create_schema()
    Store(pg_url).dispose()


def console(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.console.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # four console processes (10-70 s under load)
def test_trace_prints_the_story_and_exits_1_when_not_found(
    world: World, db_url: str, redis_url: str
) -> None:
    event_id = world.through_consumer(1)
    world.send(1)
    common = ["--database-url", db_url, "--redis-url", redis_url]
    found = console("trace", "studio:send-quote-001", *common)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines()[0] == "studio:send-quote-001: sent"
    assert event_id in found.stdout and "operation: operation_id=1:email" in found.stdout
    as_json = console("trace", "quote-001", "--json", *common)
    assert as_json.returncode == 0
    story = json.loads(as_json.stdout)
    assert story["verdict"] == "sent" and story["stream_entries"][0]["fields"]["id"] == event_id
    missing = console("trace", "quote-404", *common)
    assert missing.returncode == 1 and "not found" in missing.stdout
    assert json.loads(console("trace", "quote-404", "--json", *common).stdout)["verdict"] == (
        "not found"
    )


@pytest.mark.slow  # two console processes (5-22 s under load)
def test_init_db_creates_the_audit_table_and_the_lookup_indexes(world: World, db_url: str) -> None:
    missing = missing_lookup_indexes(world.engine)
    assert "ix_outbox_events_identity_seq" in missing and len(missing) <= len(LOOKUP_INDEXES)
    done = console("init-db", "--database-url", db_url)
    assert done.returncode == 0, done.stderr
    assert missing_lookup_indexes(world.engine) == []
    assert sa.inspect(world.engine).has_table("outbox_audit")
    again = console("init-db", "--database-url", db_url)  # idempotent
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
def test_serve_generates_a_token_and_prints_its_login_url(
    pg_schema: str, pg_tables: None, redis_url: str
) -> None:
    # A URL with a password (trust auth ignores it): never shown on a page or in the log.
    url = PG_BASE.replace("postgres@", "postgres:hunter2secret@") + (
        f"?options=-csearch_path%3D{pg_schema}"
    )
    with ConsoleProcess(url, redis_url) as process:
        line = process.first_line
        assert "/login?token=" in line, line
        token = line.strip().rsplit("token=", 1)[1]
        assert len(token) >= 32
        client = httpx.Client(base_url=process.url)
        assert client.get("/api/overview").status_code == 401
        assert client.get(f"/login?token={token}", follow_redirects=False).status_code == 303
        page = client.get("/")
        assert page.status_code == 200 and "Overview" in page.text
        assert "hunter2secret" not in page.text and "***" in page.text
        code, log = process.stop()
    assert code == 0
    assert "hunter2secret" not in log
    assert "lookup indexes missing" in log


@pytest.mark.slow
def test_serve_takes_the_token_from_a_file_or_the_environment(
    pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {"OUTBOX_CONSOLE_READ_ONLY": "1"}
    with ConsoleProcess(pg_url, redis_url, extra=["--token-file", str(token_file)], env=env) as p:
        assert "token=" not in p.first_line
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(p.url + "/api/jobs", headers=bearer).status_code == 200
        refused = httpx.post(
            p.url + "/api/jobs/1/cancel", headers=bearer, json={"reason": "read-only?"}
        )
        assert refused.status_code == 403
    with ConsoleProcess(pg_url, redis_url, token="env-token-" + "q" * 20, host="0.0.0.0") as p:
        bearer = {"Authorization": "Bearer env-token-" + "q" * 20}
        assert httpx.get(p.url + "/api/jobs", headers=bearer).status_code == 200
        _, log = p.stop()
    assert "the token is the only protection" in log


@pytest.mark.slow  # a console process per bad usage (6-48 s under load)
def test_serve_refuses_bad_usage(pg_url: str, tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("tiny\n")
    refused = console("serve", "--database-url", pg_url, "--token-file", str(short))
    assert refused.returncode == 2 and "16 characters" in refused.stderr
    assert console("serve", "--port", "99999", "--database-url", pg_url).returncode == 2
    assert console("nonsense").returncode == 2
