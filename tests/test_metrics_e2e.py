"""End to end: a real Prometheus server scrapes a real relay and evaluates alerts.yml.

The rules are the shipped ones with lowered thresholds and ``for:`` durations
(``metrics.alerts.render_rules``), evaluated every second; the target is ``outbox-relay run
--metrics-port`` (a subprocess on PostgreSQL and the shared Redis, streams under the test's
prefix). Two poison records:

- a record the relay keeps failing on (attempts past the threshold, its backoff in the
  future): OutboxStuckRecord fires with its event id; after the fix the relay publishes it
  and the alert resolves;
- an event whose stream the Redis server rejects (the key holds a string: WRONGTYPE, a
  permanent failure): the relay quarantines it, OutboxQuarantinedEvents fires; after the fix
  (the key removed) ``outbox-relay requeue`` puts it back, the relay publishes it, and the
  alert resolves.

Deadlines bound every wait; no fixed sleeps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from metrics.alerts import render_rules
from outbox.db import make_engine
from outbox.schema import OutboxSchema, build_schema, create_schema, db_now
from tests.services import wait_for

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bytes(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@dataclass
class Proc:
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    handle = log.open("wb")
    process = subprocess.Popen(
        args,
        cwd=REPO,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    handle.close()
    return Proc(process, log)


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is missing: apt-get install prometheus (see .ci/run)")
    return path


def start_prometheus(binary: str, tmp: Path, target_port: int) -> tuple[Proc, str]:
    (tmp / "rules.yml").write_text(render_rules({"stuck_record_attempts": 3}, for_duration="1s"))
    (tmp / "prometheus.yml").write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "rule_files:\n"
        "  - rules.yml\n"
        "scrape_configs:\n"
        "  - job_name: outbox-relay\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )
    port = free_port()
    proc = spawn(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        tmp / "prometheus.log",
    )
    return proc, f"http://127.0.0.1:{port}"


def alerts(api: str) -> list[dict[str, Any]]:
    body = http_get(f"{api}/api/v1/alerts")
    if body is None:
        return []
    return list(json.loads(body)["data"]["alerts"])


def stuck_alert(api: str, event_id: str, state: str) -> dict[str, Any] | None:
    for alert in alerts(api):
        labels = alert["labels"]
        if (
            labels.get("alertname") == "OutboxStuckRecord"
            and labels.get("event_id") == event_id
            and alert["state"] == state
        ):
            return alert
    return None


def target_up(api: str) -> bool:
    body = http_get(f"{api}/api/v1/targets")
    if body is None:
        return False
    targets = json.loads(body)["data"]["activeTargets"]
    return any(t["health"] == "up" for t in targets)


@pytest.fixture
def outbox_engine(pg_url: str) -> Iterator[tuple[sa.Engine, OutboxSchema]]:
    engine = make_engine(pg_url)
    schema = build_schema()
    create_schema(engine, schema)
    yield engine, schema
    engine.dispose()


def insert_stuck(engine: sa.Engine, schema: OutboxSchema, event_id: str, attempts: int) -> None:
    """A record the relay keeps failing on: many attempts, backoff pushed into the future."""
    with engine.begin() as conn:
        now = conn.execute(sa.select(db_now())).scalar_one()
        conn.execute(
            schema.table.insert().values(
                event_id=event_id,
                topic="orders",
                key="quote-017",
                key_hash=1,
                identity=event_id,
                payload={"total": 120},
                attempts=attempts,
                last_error="ResponseError: stream rejected the entry",
                created_at=now,
                available_at=now + timedelta(hours=1),
            )
        )


def relay_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "relay", *args]


def alert_named(api: str, name: str, state: str) -> dict[str, Any] | None:
    for alert in alerts(api):
        if alert["labels"].get("alertname") == name and alert["state"] == state:
            return alert
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prometheus_pages_on_a_poisoned_relay_and_resolves_after_the_fix(
    pg_url: str,
    redis_url: str,
    redis_client: Any,
    stream_prefix: str,
    outbox_engine: tuple[sa.Engine, OutboxSchema],
    prometheus_binary: str,
    tmp_path: Path,
) -> None:
    engine, schema = outbox_engine
    metrics_port = free_port()
    relay = spawn(
        relay_command(
            "run",
            "--database-url",
            pg_url,
            "--redis-url",
            redis_url,
            "--stream",
            f"{stream_prefix}.{{topic}}",
            "--metrics-port",
            str(metrics_port),
            "--retention",
            "0",
        ),
        tmp_path / "relay.log",
    )
    prometheus, api = start_prometheus(prometheus_binary, tmp_path, metrics_port)
    try:
        wait_for(
            lambda: http_get(f"http://127.0.0.1:{metrics_port}/metrics"),
            "the relay to serve metrics",
            timeout=60,
            interval=0.2,
        )
        wait_for(lambda: target_up(api), "Prometheus to scrape the relay", timeout=60, interval=0.2)

        # 1. A stuck record, and a flaky one under the threshold.
        insert_stuck(engine, schema, "ev-flaky", attempts=1)
        insert_stuck(engine, schema, "ev-poison", attempts=7)
        firing = wait_for(
            lambda: stuck_alert(api, "ev-poison", "firing"),
            "OutboxStuckRecord firing for ev-poison",
            timeout=60,
            interval=0.2,
        )
        assert firing["labels"]["topic"] == "orders"
        assert "outbox-relay status" in firing["annotations"]["description"]
        assert stuck_alert(api, "ev-flaky", "firing") is None
        assert stuck_alert(api, "ev-flaky", "pending") is None
        # The fix: its cause is gone, it is due now; the relay publishes it.
        with engine.begin() as conn:
            conn.execute(
                schema.table.update()
                .where(schema.table.c.event_id.in_(["ev-poison", "ev-flaky"]))
                .values(available_at=db_now())
            )
        wait_for(
            lambda: not any(a["labels"].get("event_id") == "ev-poison" for a in alerts(api)),
            "OutboxStuckRecord to resolve",
            timeout=60,
            interval=0.2,
        )
        entries = redis_client.xrange(f"{stream_prefix}.orders")
        assert {fields[b"id"] for _, fields in entries} >= {b"ev-poison", b"ev-flaky"}

        # 2. A stream the server rejects: quarantined at once, the relay carries on.
        redis_client.set(f"{stream_prefix}.invoices", "not a stream")
        with engine.begin() as conn:
            conn.execute(
                schema.table.insert().values(
                    event_id="ev-rejected",
                    topic="invoices",
                    key="invoice-9",
                    key_hash=9,
                    identity="ev-rejected",
                    payload={"total": 9},
                )
            )
        quarantined = wait_for(
            lambda: alert_named(api, "OutboxQuarantinedEvents", "firing"),
            "OutboxQuarantinedEvents firing",
            timeout=60,
            interval=0.2,
        )
        assert "outbox-relay requeue" in quarantined["annotations"]["description"]
        redis_client.delete(f"{stream_prefix}.invoices")
        requeue = subprocess.run(
            relay_command("requeue", "--database-url", pg_url, "ev-rejected"),
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert requeue.returncode == 0, requeue.stdout + requeue.stderr
        wait_for(
            lambda: (
                alert_named(api, "OutboxQuarantinedEvents", "firing") is None
                and alert_named(api, "OutboxQuarantinedEvents", "pending") is None
            ),
            "OutboxQuarantinedEvents to resolve",
            timeout=60,
            interval=0.2,
        )
        entries = redis_client.xrange(f"{stream_prefix}.invoices")
        assert [fields[b"id"] for _, fields in entries] == [b"ev-rejected"]
        # The relay kept making progress all along: no stalled/absent-relay alert.
        for name in ("OutboxRelayStalled", "OutboxNoRelayReporting", "OutboxRelayDown"):
            assert alert_named(api, name, "firing") is None, name
    finally:
        prometheus.stop()
        relay.stop()
    assert relay.process.returncode == 0, relay.output()


@pytest.mark.timeout(120)
@pytest.mark.slow  # an exporter process (~10 s under load)
def test_outbox_relay_metrics_serves_the_gauges_and_stops_on_sigterm(
    pg_url: str, outbox_engine: tuple[sa.Engine, OutboxSchema], tmp_path: Path
) -> None:
    engine, schema = outbox_engine
    insert_stuck(engine, schema, "ev-stuck", attempts=4)
    port = free_port()
    exporter = spawn(
        relay_command("metrics", "--database-url", pg_url, "--port", str(port)),
        tmp_path / "exporter.log",
    )
    try:
        body = wait_for(
            lambda: http_get(f"http://127.0.0.1:{port}/metrics"),
            "the exporter to serve",
            timeout=60,
            interval=0.2,
        ).decode()
        assert 'outbox_stuck_record_attempts{event_id="ev-stuck",topic="orders"} 4.0' in body
        assert 'outbox_backlog{topic="orders"} 1.0' in body
        assert "outbox_max_attempts 4.0" in body
    finally:
        exporter.stop()
    assert exporter.process.returncode == 0, exporter.output()


@pytest.mark.slow  # exporter processes (~9 s under load)
def test_outbox_relay_metrics_rejects_a_bad_port(pg_url: str) -> None:
    result = subprocess.run(
        relay_command("metrics", "--database-url", pg_url, "--port", "70000"),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "metrics_port" in result.stderr
