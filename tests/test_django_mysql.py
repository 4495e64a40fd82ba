"""outbox.django on MariaDB (issue 58): Django's MySQL backend (PyMySQL standing in for
MySQLdb), the outbox app's migration making the table ``create_schema()`` makes, events
written in ``transaction.atomic()`` committed or rolled back with it, and a relay taking
them from the URL ``outbox.django.database_url()`` gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis
import sqlalchemy as sa

from outbox import Outbox
from relay import RedisStreamPublisher, Relay

APP = Path(__file__).resolve().parent / "django_mysql_app.py"


def test_django_on_mariadb_migrates_and_emits_in_atomic_blocks(
    mysql_url: str, redis_client: redis.Redis, stream_prefix: str
) -> None:
    parsed = sa.make_url(mysql_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    env["OUTBOX_TEST_DJANGO_MYSQL"] = f"{parsed.host}:{parsed.port}/{parsed.database}"
    env["PYTHONPATH"] = str(APP.parents[1])
    result = subprocess.run(
        [sys.executable, str(APP)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["refused"] == "NoTransaction"  # outside atomic(): refused
    assert sa.make_url(report["url"]).database == parsed.database
    outbox = Outbox(report["url"])
    try:
        outbox.create_schema()  # accepts the migrated table as it is
        with outbox.engine.connect() as conn:
            ids = conn.execute(sa.text("SELECT event_id FROM outbox_events")).scalars().all()
        assert ids == [report["kept"]]  # the rolled-back block wrote nothing
        relay = Relay(outbox, RedisStreamPublisher(redis_client, f"{stream_prefix}.{{topic}}"))
        assert relay.run_once() == 1
        relay.store.close()
        [(_entry_id, fields)] = redis_client.xrange(f"{stream_prefix}.quote.approved")
        assert fields[b"id"].decode() == report["kept"]
    finally:
        outbox.engine.dispose()
