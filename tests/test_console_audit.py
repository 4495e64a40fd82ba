"""An operator's action and its audit row commit together or not at all (issue 53), on
PostgreSQL and SQLite: text the audit row cannot hold (a NUL, a lone surrogate in ``by`` or
``reason``) is a 400 before anything is written; and when the audit row cannot be written at
all, the action is rolled back with it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox.console.app import Console
from outbox.console.schema import audit, create_audit_table
from tests.console_support import World

TOKEN = "test-token-" + "a" * 20
JSON_BEARER = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture
def world(db_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[World]:
    w = World(db_url, redis_client, stream_prefix)
    create_audit_table(w.engine)
    w.store.schedule_every("nightly", cron="0 3 * * *", tenant="studio", action="report")
    yield w
    w.close()


@pytest.fixture
def api(world: World) -> Iterator[TestClient]:
    with TestClient(Console(world.engine, world.client, TOKEN).app) as client:
        yield client


def post(api: TestClient, path: str, body: dict[str, Any]) -> Any:
    # json.dumps writes a lone surrogate as the escape \ud800: the body is valid JSON, and
    # the app reads it back as a str holding that surrogate.
    return api.post(path, headers=JSON_BEARER, content=json.dumps(body))


def audit_count(world: World) -> int:
    with world.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(audit)).scalar_one())


def queue_paused(world: World) -> bool:
    return world.store.depth("zz")["zz"].paused


def schedule_paused(world: World) -> bool:
    (schedule,) = world.store.schedules()
    return schedule.paused


def job_state(world: World) -> str:
    return world.store.get("studio", "send-1").state


# (path, the state the action would change, its value before; the set-up it needs)
Case = tuple[str, Callable[[World], Any], Callable[[World], Any]]
CASES: dict[str, Case] = {
    "pause queue": ("/api/queues/zz/pause", queue_paused, lambda w: None),
    "resume queue": ("/api/queues/zz/resume", queue_paused, lambda w: w.store.pause_queue("zz")),
    "pause schedule": ("/api/schedules/nightly/pause", schedule_paused, lambda w: None),
    "resume schedule": (
        "/api/schedules/nightly/resume",
        schedule_paused,
        lambda w: w.store.pause_schedule("nightly"),
    ),
    "cancel job": ("/api/jobs/{job}/cancel", job_state, lambda w: None),
}
BAD = {
    "NUL in by": {"by": "a\x00b", "reason": "fine"},
    "surrogate in by": {"by": "a\ud800b", "reason": "fine"},
    "NUL in reason": {"reason": "a\x00b"},
    "surrogate in reason": {"reason": "x\udfff"},
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("case", list(CASES))
def test_bad_text_is_a_400_and_nothing_is_written(
    world: World, api: TestClient, case: str, bad: str
) -> None:
    path, read, setup = CASES[case]
    setup(world)
    job = world.store.enqueue("studio", "send-1").job_id
    before, audited = read(world), audit_count(world)
    answer = post(api, path.format(job=job), BAD[bad])
    assert answer.status_code == 400, answer.text
    assert read(world) == before  # no action
    assert audit_count(world) == audited  # and no audit row
    good = post(api, path.format(job=job), {"by": "ann", "reason": "the fix"})
    assert good.status_code == 200, good.text  # the same action with good text is taken
    assert read(world) != before and audit_count(world) == audited + 1


@pytest.mark.parametrize("case", list(CASES))
def test_an_action_whose_audit_row_fails_is_rolled_back(world: World, case: str) -> None:
    path, read, setup = CASES[case]
    setup(world)
    job = world.store.enqueue("studio", "send-1").job_id
    before = read(world)
    with TestClient(
        Console(world.engine, world.client, TOKEN).app, raise_server_exceptions=False
    ) as client:
        audit.drop(world.engine)  # the audit row cannot be written now
        answer = post(client, path.format(job=job), {"by": "ann", "reason": "x"})
    assert answer.status_code == 500
    assert read(world) == before  # the action went with it
