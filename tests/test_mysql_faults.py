"""The relay on MariaDB under SIGKILL (issue 58): real ``outbox-relay run`` subprocesses, real
MariaDB and Redis.

Writers commit 20,000 events over 500 keys while one of three relays is SIGKILLed every
0.5 s and started again: every event reaches its stream exactly once (intent, receipt,
reconciliation), each key's in commit order (the claim walks seq order from the first
pending row; the partitions pass between replicas through named locks that a killed
relay's session gives back).

The domain is tests/test_relay_faults.py's: a writer transaction locks the aggregate row of
each of its keys (``SELECT ... FOR UPDATE``, then the bump: MySQL has no UPDATE ...
RETURNING), and the event's payload carries the new version, so per key the versions 1..N
are the commit order and ``aggregates.version`` counts what committed.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from outbox import Outbox
from outbox.db import make_engine

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from services import wait_for
    from test_relay_faults import (
        assert_clean,
        judge,
        make_keys,
        read_streams,
        relay_command,
        relays,
        topic_of,
    )
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.services import wait_for
    from tests.test_relay_faults import (
        assert_clean,
        judge,
        make_keys,
        read_streams,
        relay_command,
        relays,
        topic_of,
    )

pytestmark = pytest.mark.slow


def create_domain(url: str, keys: list[str]) -> None:
    engine = make_engine(url, pool_size=1)
    try:
        Outbox(engine).create_schema()
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    'CREATE TABLE aggregates ("key" VARCHAR(64) PRIMARY KEY, '
                    "version BIGINT NOT NULL) ENGINE=InnoDB"
                )
            )
            conn.execute(
                sa.text('INSERT INTO aggregates ("key", version) VALUES (:k, 0)'),
                [{"k": key} for key in keys],
            )
    finally:
        engine.dispose()


def committed_versions(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text('SELECT "key", version FROM aggregates')).all()
    return {str(k): int(v) for k, v in rows}


def pending(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM outbox_events WHERE state <> 'published'")
            ).scalar_one()
        )


class Writers:
    """Threads committing two-key domain transactions until ``total`` events committed."""

    def __init__(self, url: str, keys: list[str], total: int, threads: int) -> None:
        self.url = url
        self.keys = keys
        self.left = total
        self.lock = threading.Lock()
        self.confirmed: set[str] = set()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _take(self) -> int:
        with self.lock:
            n = min(2, self.left)
            self.left -= n
            return n

    def _run(self) -> None:
        engine = make_engine(self.url, pool_size=1, max_overflow=0)
        outbox = Outbox(engine)
        rng = random.Random()
        lock = sa.text('SELECT version FROM aggregates WHERE "key" = :k FOR UPDATE')
        bump = sa.text('UPDATE aggregates SET version = version + 1 WHERE "key" = :k')
        try:
            while (n := self._take()) > 0:
                ids = []
                with outbox.transaction() as tx:
                    for key in sorted(rng.sample(self.keys, n)):  # sorted: no deadlocks
                        version = tx.session.execute(lock, {"k": key}).scalar_one() + 1
                        tx.session.execute(bump, {"k": key})
                        payload = {"key": key, "version": version, "pad": "x" * 120}
                        ids.append(tx.emit(topic_of(key), key=key, payload=payload))
                with self.lock:
                    self.confirmed.update(ids)
        except BaseException as exc:  # surfaced by join()
            self.errors.append(exc)
        finally:
            engine.dispose()

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)
        if self.errors:
            raise self.errors[0]


def test_relays_sigkilled_every_half_second_on_mariadb_lose_and_duplicate_nothing(
    mysql_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    stream_prefix: str,
    tmp_path: Path,
) -> None:
    keys = make_keys(500)
    create_domain(mysql_url, keys)
    engine = make_engine(mysql_url, pool_size=2)
    command = relay_command(mysql_url, redis_url, f"{stream_prefix}.{{topic}}", 200)
    writers = Writers(mysql_url, keys, 20_000, threads=4)
    try:
        with relays(command, tmp_path) as procs:
            slots = [procs.spawn() for _ in range(3)]
            victim = 0
            while not writers.done() or procs.kills < 10:
                time.sleep(0.5)  # the kill cadence, not a wait for a condition
                procs.kill(slots[victim % 3])
                slots[victim % 3] = procs.spawn()
                victim += 1
            writers.join()
            kills = procs.kills

            def drained() -> bool:
                procs.assert_running()
                return pending(engine) == 0

            wait_for(drained, "the relays to publish every event", timeout=120, diagnose=procs.tail)
            codes = procs.terminate_all()
        versions = committed_versions(engine)
        verdict = judge(read_streams(redis_client, stream_prefix), versions, writers.confirmed)
        print(f"\nMariaDB kill test: {kills} SIGKILLs, {verdict.entries} entries")
        assert sum(versions.values()) == 20_000
        assert_clean(verdict, f"after {kills} SIGKILLs on MariaDB")
        assert kills >= 10
        assert codes == [0, 0, 0], f"SIGTERM exit codes {codes}"
    finally:
        writers.left = 0
        for thread in writers.threads:
            thread.join(60)
        engine.dispose()
