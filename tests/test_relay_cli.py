"""``outbox-relay`` as a user runs it: real subprocesses, real PostgreSQL, SQLite and Redis."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from outbox import Outbox
from relay.cli import main
from tests.services import wait_for

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from cluster_support import RedisTarget
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.cluster_support import RedisTarget

ROOT = Path(__file__).resolve().parent.parent


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Any = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    full_env["PYTHONPATH"] = str(ROOT)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture
def target_client(redis_target: RedisTarget) -> Iterator[Any]:
    """A client of ``redis_target`` (a RedisCluster on the cluster), closed afterwards."""
    client = redis_target.connect()
    yield client
    client.close()


@pytest.mark.slow  # relay processes (11-28 s under load)
def test_init_db_status_and_requeue(outbox_db_url: str, tmp_path: Path) -> None:
    db_url = outbox_db_url
    result = cli("init-db", "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    outbox = Outbox(db_url)
    with outbox.transaction() as tx:
        bad = tx.emit("quote.approved", key="q1", payload={})
        tx.emit("quote.approved", key="q2", payload={})
        tx.emit("invoice.created", key="i1", payload={})
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_events SET state = 'quarantined', attempts = 3, "
                "last_error = 'WRONGTYPE' WHERE event_id = :e"
            ),
            {"e": bad},
        )
    result = cli("status", "--json", env={"OUTBOX_DATABASE_URL": db_url})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["pending"] == 2 and report["quarantined"] == 1 and report["max_attempts"] == 3
    assert report["oldest_unpublished_age_seconds"] >= 0
    assert set(report["topics"]) == {"quote.approved", "invoice.created"}
    assert report["topics"]["quote.approved"] == {
        "pending": 1,
        "quarantined": 1,
        "oldest_unpublished_age_seconds": report["topics"]["quote.approved"][
            "oldest_unpublished_age_seconds"
        ],
        "max_attempts": 3,
    }
    table = cli("status", "--database-url", db_url)
    assert table.returncode == 0 and "quote.approved" in table.stdout and "PENDING" in table.stdout
    unknown = cli("requeue", "--database-url", db_url, "no-such-event")
    assert unknown.returncode == 1 and "unknown event id: no-such-event" in unknown.stderr
    ok = cli("requeue", "--database-url", db_url, bad)
    assert ok.returncode == 0 and f"requeued {bad}" in ok.stdout
    again = cli("requeue", "--database-url", db_url, "--all")
    assert again.returncode == 0 and "no quarantined events" in again.stdout
    assert json.loads(cli("status", "--json", "--database-url", db_url).stdout)["quarantined"] == 0


@pytest.mark.slow  # a relay process per bad argument (~18 s under load)
def test_bad_arguments_and_unreachable_services() -> None:
    assert cli("run", "--no-such-flag").returncode == 2
    assert cli().returncode == 2
    assert cli("requeue", "--database-url", "sqlite:///x.db").returncode == 2
    bad_url = cli("status", "--database-url", "oracle://localhost/x")
    assert bad_url.returncode == 2 and "unsupported backend" in bad_url.stderr
    down = cli("status", "--database-url", "postgresql://nobody@127.0.0.1:1/none", timeout=30)
    assert down.returncode == 1
    assert "cannot use the database at postgresql" in down.stderr
    assert "Connection refused" in down.stderr or "connection" in down.stderr.lower()
    assert cli("init-db", "--database-url", "postgresql://x@127.0.0.1:1/x").returncode == 1
    bad_stream = cli("run", "--stream", "outbox.{nope}", "--database-url", "sqlite:///x.db")
    assert bad_stream.returncode == 2 and "unknown placeholder" in bad_stream.stderr
    bad_env = cli("run", "--once", env={"OUTBOX_BATCH_SIZE": "many"})
    assert bad_env.returncode == 2 and "OUTBOX_BATCH_SIZE" in bad_env.stderr
    assert main(["status", "--database-url", "postgresql://x@127.0.0.1:1/x"]) == 1


@pytest.mark.slow  # relay processes (5-7 s under load)
def test_run_once_publishes(
    pg_url: str, redis_target: RedisTarget, target_client: Any, stream_prefix: str
) -> None:
    """On one Redis and on a Redis Cluster (``--redis-cluster``, the stream hash-tagged)."""
    outbox = Outbox(pg_url)
    outbox.create_schema()
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key=f"k{i}", payload={"i": i}) for i in range(3)]
    template = redis_target.hash_tagged(f"{stream_prefix}.{{topic}}")
    result = cli(
        "run",
        "--once",
        "--stream",
        template,
        *redis_target.extra_args,
        env={"OUTBOX_DATABASE_URL": pg_url, "OUTBOX_REDIS_URL": redis_target.url},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"published": 3}
    got = [f[b"id"].decode() for _i, f in target_client.xrange(template.format(topic="t"))]
    assert got == ids


@pytest.mark.slow  # a relay process (7-9 s under load)
def test_sigterm_drains_and_exits_zero(
    pg_url: str, redis_target: RedisTarget, target_client: Any, stream_prefix: str
) -> None:
    """On one Redis and on a Redis Cluster (``--redis-cluster``, the stream hash-tagged)."""
    outbox = Outbox(pg_url)
    outbox.create_schema()
    template = redis_target.hash_tagged(f"{stream_prefix}.{{topic}}")
    stream = template.format(topic="t")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        PYTHONPATH=str(ROOT),
        OUTBOX_DATABASE_URL=pg_url,
        OUTBOX_REDIS_URL=redis_target.url,
        OUTBOX_STREAM=template,
        OUTBOX_BATCH_SIZE="200",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "run", "--log-level", "info", *redis_target.extra_args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with outbox.transaction() as tx:
            tx.emit_many(
                [{"topic": "t", "key": f"k{i % 50}", "payload": {"i": i}} for i in range(2000)]
            )
        wait_for(lambda: target_client.xlen(stream) > 0, "publishing to start", timeout=60)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    messages = [line["message"] for line in lines]
    assert "relay started" in messages and "relay stopped" in messages
    assert "stop requested" in messages
    # Whatever it claimed before stopping has its receipt: no intent is left behind.
    with outbox.engine.connect() as conn:
        dangling = conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox_events WHERE state = 'pending' "
                "AND claimed_by IS NOT NULL"
            )
        ).scalar()
        published = conn.execute(
            sa.text("SELECT count(*) FROM outbox_events WHERE state = 'published'")
        ).scalar()
    assert dangling == 0
    assert published == target_client.xlen(stream)


def test_run_waits_for_database_instead_of_exiting(tmp_path: Path, redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        PYTHONPATH=str(ROOT),
        OUTBOX_DATABASE_URL="postgresql://x@127.0.0.1:1/x",
        OUTBOX_REDIS_URL=redis_url,
    )
    log_path = tmp_path / "relay.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "relay", "run"], env=env, stderr=log)
    try:
        # Observable: it logs a retry, backs off, and retries again instead of exiting.
        wait_for(
            lambda: log_path.read_text().count("retrying") >= 2 or proc.poll() is not None,
            "two retries logged",
            timeout=60,
            diagnose=log_path.read_text,
        )
        assert proc.poll() is None, log_path.read_text()  # still waiting, not exited
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # the demo as a process (~16 s under load)
def test_demo_runs_on_the_embedded_default(tmp_path: Path) -> None:
    result = cli("demo", "--duration", "3", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "published by the relay" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    summary = re.fullmatch(
        r"stopped: (\d+) quotes approved \(\+(\d+) duplicate events\), (\d+) events published,"
        r" 0 pending, 0 quarantined; stream outbox.quote.approved has (\d+) entries;"
        r" consumer handled (\d+), skipped (\d+) duplicates; (\d+) quotes sent, one job each",
        last,
    )
    assert summary, last
    quotes, duplicates, published, entries, handled, skipped, sent = map(int, summary.groups())
    assert quotes > 0 and published == entries == quotes + duplicates
    # The whole loop: every quote's job sent once, every duplicate event skipped by the inbox.
    assert (handled, skipped, sent) == (quotes, duplicates, quotes)
    # The demo's files are in one folder, .outbox/ (git ignores it), none beside it.
    assert (tmp_path / ".outbox" / "outbox.db").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".outbox"]
    # A second run starts fresh: its totals are its own, not added to the first run's.
    again = cli("demo", "--duration", "2", cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "starting fresh" in again.stdout
    second = re.search(r"stopped: (\d+) quotes approved.*has (\d+) entries", again.stdout)
    assert second, again.stdout
    assert int(second.group(2)) <= 2 * int(second.group(1))  # this run's events only


@pytest.mark.parametrize("flag", ["--help"])
@pytest.mark.slow  # a relay process per subcommand (~30 s under load)
def test_help(flag: str) -> None:
    result = cli(flag)
    assert result.returncode == 0 and "run" in result.stdout and "demo" in result.stdout
    for command in ("run", "status", "requeue", "init-db", "demo"):
        assert cli(command, "--help").returncode == 0


@pytest.mark.slow  # a relay process (~10 s under load)
def test_run_serves_metrics(
    pg_url: str, redis_url: str, redis_client: redis.Redis, stream_prefix: str
) -> None:
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outbox = Outbox(pg_url)
    outbox.create_schema()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        PYTHONPATH=str(ROOT),
        OUTBOX_DATABASE_URL=pg_url,
        OUTBOX_REDIS_URL=redis_url,
        OUTBOX_STREAM=f"{stream_prefix}.{{topic}}",
        OUTBOX_METRICS_PORT=str(port),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "run"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        with outbox.transaction() as tx:
            tx.emit_many([{"topic": "t", "key": f"k{i}", "payload": {}} for i in range(10)])

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text: str = r.read().decode()
            return text if 'outbox_relay_published_total{topic="t"} 10.0' in text else ""

        body = wait_for(scrape, "ten events counted", timeout=30, interval=0.1, ignore=(OSError,))
        assert 'outbox_relay_published_total{topic="t"} 10.0' in body
        assert "outbox_relay_commit_to_stream_seconds_count" in body
        assert "outbox_relay_last_success_timestamp_seconds" in body
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
