"""Operating schedules (issue 39): ``outbox-worker schedules``, the metrics, on PostgreSQL and
SQLite. The database clock decides here (no ``now=``): schedules are defined now and their
``next_slot`` is moved into the past to stand for an outage."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select as sa_select
from sqlalchemy import update

from consumer.jobs.cli import main
from consumer.jobs.schema import schedules
from consumer.jobs.store import Store
from metrics.collector import DatabaseCollector


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def _move_back(store: Store, name: str, seconds: float) -> None:
    """Stand for an outage: the schedule's next slot ``seconds`` ago."""
    with store.driver.begin() as conn:
        now = store.driver.clock_read(conn, None)
        conn.execute(
            update(schedules).where(schedules.c.name == name).values(next_slot=now - seconds)
        )


def test_cli_lists_pauses_resumes_and_removes(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store.schedule_every("digest", cron="0 9 * * 1-5", tenant="studio", action="digest",
                         tz="Europe/Berlin")  # fmt: skip
    # Yearly: a next slot moved 5 s back is exactly one passed slot, whatever the time. An
    # every-minute schedule fired two slots when the test ran within 5 s after a minute began.
    store.schedule_every("tick", cron="0 0 1 1 *", tenant="t", action="tick")
    _move_back(store, "tick", 5)
    assert len(store.fire_schedules().fired) == 1
    assert main(["schedules", "list", "--database-url", db_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["NAME", "CRON", "TZ", "STATE"]
    assert out[1].startswith("digest") and "Europe/Berlin" in out[1] and "running" in out[1]
    assert out[2].startswith("tick") and "READY" in out[2]
    assert main(["schedules", "pause", "tick", "--database-url", db_url]) == 0
    assert "paused" in capsys.readouterr().out
    assert main(["schedules", "list", "--json", "--database-url", db_url]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert listed["tick"]["paused"] is True and listed["tick"]["fired"] == 1
    assert listed["tick"]["last_job_state"] == "READY"
    assert listed["digest"]["next_slot"].endswith("+00:00")
    assert main(["schedules", "resume", "tick", "--database-url", db_url]) == 0
    assert not store.get_schedule("tick").paused
    assert main(["schedules", "remove", "digest", "--database-url", db_url]) == 0
    assert [s.name for s in store.schedules()] == ["tick"]
    capsys.readouterr()
    assert main(["schedules", "remove", "digest", "--database-url", db_url]) == 1
    assert "no schedule 'digest'" in capsys.readouterr().err
    assert main(["schedules", "pause", "--database-url", db_url]) == 2
    assert main(["schedules", "list", "tick", "--database-url", db_url]) == 2


def test_metrics_count_fired_and_missed_and_show_an_overdue_slot(store: Store) -> None:
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(store.engine, cache_seconds=0, table_recheck_seconds=0))
    # Yearly: moving next_slot back stands for exactly one passed slot, whatever the date.
    store.schedule_every("tick", cron="0 0 1 1 *", tenant="t", action="tick")
    store.schedule_every("idle", cron="0 0 1 1 *", tenant="t", action="idle")
    assert registry.get_sample_value("outbox_schedule_slots_fired_total", {"schedule": "tick"}) == 0
    assert registry.get_sample_value("outbox_workers_alive") == 0
    _move_back(store, "tick", 270)  # a slot passed 270 s ago: 210 s past its 60 s grace
    overdue = registry.get_sample_value("outbox_schedule_overdue_seconds", {"schedule": "tick"})
    assert overdue is not None and 210 <= overdue < 240
    assert registry.get_sample_value("outbox_schedule_overdue_seconds", {"schedule": "idle"}) == 0
    with store.driver.begin() as conn:
        store.driver.worker_beat(conn, "w1", store.driver.clock_read(conn, None), 30)
    assert registry.get_sample_value("outbox_workers_alive") == 1
    result = store.fire_schedules()
    assert result.fired == () and result.missed == {"tick": 1}  # skip: past its grace
    labels = {"schedule": "tick"}
    assert registry.get_sample_value("outbox_schedule_slots_missed_total", labels) == 1
    assert registry.get_sample_value("outbox_schedule_overdue_seconds", labels) == 0
    _move_back(store, "tick", 2)
    assert len(store.fire_schedules().fired) == 1
    assert registry.get_sample_value("outbox_schedule_slots_fired_total", labels) == 1
    store.pause_schedule("tick")
    _move_back(store, "tick", 600)
    assert registry.get_sample_value("outbox_schedule_overdue_seconds", labels) == 0  # paused


def test_console_lists_schedules_and_audits_pause_and_resume(db_url: str) -> None:
    from starlette.testclient import TestClient

    from outbox.console.app import Console
    from outbox.console.schema import audit, create_audit_table

    store = Store(db_url)
    try:
        create_audit_table(store.engine)
        store.schedule_every("digest", cron="0 9 * * 1-5", tenant="studio", action="digest",
                             tz="Europe/Berlin")  # fmt: skip
        store.schedule_every("tick", cron="0 0 1 1 *", tenant="t", action="tick")
        _move_back(store, "tick", 5)
        fired = store.fire_schedules().fired
        console = Console(store.engine, None, "s3cret-token-for-tests")
        bearer = {"Authorization": "Bearer s3cret-token-for-tests"}
        with TestClient(console.app) as api:
            rows = {r["name"]: r for r in api.get("/api/schedules", headers=bearer).json()["rows"]}
            assert rows["tick"]["last_job_id"] == fired[0].job_id
            assert rows["tick"]["last_job_state"] == "READY"
            assert rows["digest"]["next_slot"].endswith("+00:00") and not rows["digest"]["paused"]
            path = "/api/schedules/digest/pause"
            assert api.post(path, headers=bearer, json={}).status_code == 400  # no reason
            done = api.post(path, headers=bearer, json={"reason": "holiday", "by": "ann"})
            assert done.status_code == 200, done.text
            assert done.json()["before"]["paused"] is False and done.json()["after"]["paused"]
            assert store.get_schedule("digest").paused
            again = api.post(path, headers=bearer, json={"reason": "twice"})
            assert again.status_code == 409
            missing = api.post("/api/schedules/nope/pause", headers=bearer, json={"reason": "x"})
            assert missing.status_code == 404
            resumed = api.post(
                "/api/schedules/digest/resume", headers=bearer, json={"reason": "back"}
            )
            assert resumed.status_code == 200 and not store.get_schedule("digest").paused
            page = api.get("/schedules", headers=bearer).text
            assert 'action="/schedules/digest/pause"' in page and "Europe/Berlin" in page
            assert f'href="/trace?q={fired[0].job_id}"' in page
        with store.engine.connect() as conn:
            rows_audit = conn.execute(sa_select(audit).order_by(audit.c.id)).all()
        assert [(r.action, r.target_kind, r.target_id, r.outcome[:7]) for r in rows_audit] == [
            ("pause", "schedule", "digest", "ok"),
            ("pause", "schedule", "digest", "refused"),
            ("pause", "schedule", "nope", "refused"),
            ("resume", "schedule", "digest", "ok"),
        ]
    finally:
        store.dispose()


def test_run_takes_the_schedule_interval_from_its_flag_or_environment() -> None:
    from consumer.jobs.cli import _run_config, build_parser
    from consumer.jobs.config import WorkerConfig

    args = build_parser().parse(["run", "app:worker", "--schedule-interval", "5"])
    assert _run_config(args, WorkerConfig()).schedule_interval == 5.0
    args = build_parser().parse(["run", "app:worker"])
    assert _run_config(args, WorkerConfig(schedule_interval=7)).schedule_interval == 7.0
