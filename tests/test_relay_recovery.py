"""Recovery when Redis loses data (issue 12, the relay's share), against real servers:
``outbox-relay republish``, the persistence check and its gauge, ``--require-aof``, the
marker that reveals a Redis that came back empty or older than the receipts, and stream
trimming that never drops what a consumer group still needs.

FLUSHALL and restarts only ever hit a private ``redis-server`` (``tests/services.py``); tests
on the shared Redis use their ``stream_prefix`` keys.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from metrics import PrometheusHooks
from outbox import Outbox
from outbox.backoff import Backoff
from outbox.errors import ConfigError
from outbox.hooks import Hooks
from relay import RedisStreamPublisher, Relay, RelayConfig
from relay.redis.health import check_persistence
from relay.redis.publisher import marker_key
from relay.republish import parse_since, republish
from relay.store import open_store
from tests.services import wait_for

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from services import PrivateRedis
except ImportError:  # pragma: no cover
    from tests.services import PrivateRedis

ROOT = Path(__file__).resolve().parent.parent


class ConfiguredRedis(PrivateRedis):
    """A private ``redis-server`` with extra command-line settings."""

    def __init__(self, *extra: str, persistent: bool = False) -> None:
        super().__init__(persistent=persistent)
        self.extra = list(extra)

    def _command(self) -> list[str]:
        return [*super()._command(), *self.extra]


class Recorded(Hooks):
    def __init__(self) -> None:
        self.modes: list[str] = []
        self.losses: list[float] = []

    def relay_redis_persistence(self, mode: str) -> None:
        self.modes.append(mode)

    def relay_redis_data_loss(self, timestamp: float) -> None:
        self.losses.append(timestamp)


def config(**overrides: Any) -> RelayConfig:
    values: dict[str, Any] = {
        "publish_deadline": 0.5,
        "clock_margin": 0.2,
        "record_backoff": Backoff(0.05, 0.2),
        "rebalance_interval": 0.1,
    }
    values.update(overrides)
    return RelayConfig(**values)


def emit(outbox: Outbox, n: int, *, keys: int = 3, topic: str = "t", start: int = 0) -> list[str]:
    with outbox.transaction() as tx:
        return [
            tx.emit(topic, key=f"k{i % keys}", payload={"n": i}) for i in range(start, start + n)
        ]


def stream_ids(client: redis.Redis, stream: str) -> list[str]:
    return [fields[b"id"].decode() for _id, fields in client.xrange(stream)]


def drain(relay: Relay, rounds: int = 10) -> int:
    return sum(relay.run_once() for _ in range(rounds))


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    full_env["PYTHONPATH"] = str(ROOT)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def run_until(relay: Relay, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Run the relay's cycles until ``condition`` holds (its periodic checks are timed)."""

    def cycle() -> bool:
        if condition():
            return True
        relay.run_once()
        return False

    wait_for(cycle, "the condition", timeout=timeout, interval=0.02)


def run_checks(relay: Relay, hooks: Recorded, checks: int) -> None:
    """Run the relay's cycles until ``checks`` more periodic checks of Redis have run (each
    reports the persistence)."""
    done = len(hooks.modes)
    run_until(relay, lambda: len(hooks.modes) >= done + checks)


def checking_relay(outbox: Outbox, client: redis.Redis, hooks: Hooks) -> Relay:
    """A relay that checks Redis for lost entries every 0.1 s (the tests' clock)."""
    return Relay(
        outbox, RedisStreamPublisher(client), config(redis_check_interval=0.1), hooks=hooks
    )


@pytest.fixture
def outbox(db_url: str) -> Outbox:
    o = Outbox(db_url)
    o.create_schema()
    return o


# -- TIME ---------------------------------------------------------------------------------------


def test_since_takes_iso_8601_with_a_zone_or_unix_seconds() -> None:
    utc = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert parse_since("2026-11-30T12:00:00Z") == utc
    assert parse_since("2026-11-30T13:00:00+01:00") == utc
    assert parse_since(str(int(utc.timestamp()))) == utc
    assert parse_since(f"{utc.timestamp() + 0.5}") == utc + timedelta(seconds=0.5)
    for bad in ("", "yesterday", "2026-11-30T12:00:00", "-5", "nan", "2026-13-01T00:00:00Z"):
        with pytest.raises(ConfigError) as caught:
            parse_since(bad)
        assert caught.value.setting == "since"


# -- persistence ----------------------------------------------------------------------------------


def test_persistence_modes_of_real_servers() -> None:
    with PrivateRedis() as plain:
        report = check_persistence(redis.Redis.from_url(plain.url))
        assert (report.mode, report.role) == ("none", "master")
        assert report.loses_acknowledged_entries
    with PrivateRedis(persistent=True) as aof:
        report = check_persistence(redis.Redis.from_url(aof.url))
        assert report.mode == "aof" and not report.loses_acknowledged_entries
    with ConfiguredRedis("--save", "3600 1") as rdb:
        assert check_persistence(redis.Redis.from_url(rdb.url)).mode == "rdb"
    with ConfiguredRedis("--rename-command", "CONFIG", "") as managed:
        report = check_persistence(redis.Redis.from_url(managed.url))
        assert report.mode == "unknown" and "CONFIG" in report.detail


def test_a_redis_that_refuses_config_does_not_stop_the_relay_and_the_gauge_says_so(
    outbox: Outbox,
) -> None:
    hooks = PrometheusHooks()
    with ConfiguredRedis("--rename-command", "CONFIG", "") as managed:
        client = redis.Redis.from_url(managed.url)
        relay = Relay(outbox, RedisStreamPublisher(client), config(), hooks=hooks)
        ids = emit(outbox, 4)
        assert drain(relay) == 4
        assert stream_ids(client, "outbox.t") == ids
        relay.store.close()
    value = hooks.registry.get_sample_value
    assert value("outbox_relay_redis_persistence", {"mode": "unknown"}) == 1.0
    assert value("outbox_relay_redis_persistence", {"mode": "aof"}) == 0.0
    with PrivateRedis() as plain:
        relay = Relay(
            outbox, RedisStreamPublisher(redis.Redis.from_url(plain.url)), config(), hooks=hooks
        )
        relay.run_once()
        relay.store.close()
    assert value("outbox_relay_redis_persistence", {"mode": "none"}) == 1.0
    assert value("outbox_relay_redis_persistence", {"mode": "unknown"}) == 0.0


@pytest.mark.slow  # relay processes and private servers (~25 s under load)
def test_require_aof_refuses_to_start_without_aof_and_says_why(sqlite_url: str) -> None:
    with PrivateRedis() as plain:
        result = cli(
            "run", "--once", "--require-aof", "--database-url", sqlite_url, "--redis-url", plain.url
        )
        assert result.returncode == 1
        assert "--require-aof" in result.stderr and "appendonly yes" in result.stderr
        assert "mode none" in result.stderr
        by_env = cli(
            "run",
            "--once",
            "--database-url",
            sqlite_url,
            "--redis-url",
            plain.url,
            env={"OUTBOX_REQUIRE_AOF": "1"},
        )
        assert by_env.returncode == 1 and "without AOF" in by_env.stderr
    with ConfiguredRedis("--rename-command", "CONFIG", "") as managed:
        result = cli(
            "run",
            "--once",
            "--require-aof",
            "--database-url",
            sqlite_url,
            "--redis-url",
            managed.url,
        )
        assert result.returncode == 1 and "cannot tell" in result.stderr
    with PrivateRedis(persistent=True) as aof:
        result = cli(
            "run", "--once", "--require-aof", "--database-url", sqlite_url, "--redis-url", aof.url
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"published": 0}


# -- lost data ------------------------------------------------------------------------------------


@pytest.mark.slow  # a private Redis (~6 s under load)
def test_flushall_is_detected_before_a_new_entry_hides_it_and_republish_repairs(
    outbox: Outbox, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    hooks = Recorded()
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        relay = Relay(outbox, RedisStreamPublisher(client), config(), hooks=hooks)
        before = emit(outbox, 6)
        assert drain(relay) == 6
        assert client.get(marker_key("outbox.{topic}")) is not None
        client.flushall()
        after = emit(outbox, 3, start=6)
        with caplog.at_level(logging.ERROR, logger="outbox.relay"):
            # The next batch is refused whole (nothing added), then the check reports it.
            assert relay.run_once() == 0
            assert client.exists("outbox.t") == 0
            drain(relay)
        assert relay.stats.data_loss_detected == 1 and len(hooks.losses) == 1
        assert hooks.modes and hooks.modes[-1] == "none"
        [error] = [r for r in caplog.records if "lost stream entries" in r.getMessage()]
        command = error.__dict__["fields"]["republish"]
        assert command.startswith("outbox-relay republish --since ")
        # The marker is re-armed: new events flowed; the lost ones wait for republish.
        assert stream_ids(client, "outbox.t") == after
        since = command.split("--since ", 1)[1]
        result = cli(
            "republish", "--since", since, "--database-url", db_url, "--redis-url", server.url
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["republished"] == 9 and report["failed"] == 0
        assert report["streams"] == ["outbox.t"]
        assert "republished 9 events" in result.stderr
        got = stream_ids(client, "outbox.t")
        assert set(got) == set(before + after)
        assert got[3:] == before + after  # republished in seq order, after the new ones
        relay.store.close()


def test_auto_republish_repairs_in_order_before_anything_new(outbox: Outbox) -> None:
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        relay = Relay(outbox, RedisStreamPublisher(client), config(auto_republish=True))
        before = emit(outbox, 10)
        assert drain(relay) == 10
        client.flushall()
        after = emit(outbox, 4, start=10)
        drain(relay)
        assert relay.stats.data_loss_detected == 1
        assert relay.stats.republished == 10
        assert stream_ids(client, "outbox.t") == before + after  # per-key order holds
        relay.store.close()


def test_an_idle_relay_sees_redis_come_back_empty_on_its_next_check(outbox: Outbox) -> None:
    hooks = Recorded()
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        relay = checking_relay(outbox, client, hooks)
        emit(outbox, 3)
        drain(relay)
        server.restart(kill=True)  # no persistence: it comes back empty
        # Nothing to publish: the periodic check (every 0.1 s) finds the loss.
        run_until(relay, lambda: bool(hooks.losses))
        assert len(hooks.losses) == 1
        # Reported once, then re-armed: the checks after it, the relay still idle (its latest
        # receipt still the lost entry), do not report it again (they did, every 0.1 s).
        run_checks(relay, hooks, 3)
        assert len(hooks.losses) == 1
        # A second empty restart, still idle, is a new loss: reported again.
        server.restart(kill=True)
        run_until(relay, lambda: len(hooks.losses) >= 2)
        run_checks(relay, hooks, 3)
        assert len(hooks.losses) == 2
        relay.store.close()


def test_a_redis_restored_from_an_older_snapshot_is_seen(
    outbox: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    hooks = Recorded()
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        relay = checking_relay(outbox, client, hooks)
        kept = emit(outbox, 4)
        drain(relay)
        client.save()  # the snapshot the crash will come back from
        lost = emit(outbox, 4, start=4)
        drain(relay)
        assert stream_ids(client, "outbox.t") == kept + lost
        server.restart(kill=True)
        client = redis.Redis.from_url(server.url)
        assert stream_ids(client, "outbox.t") == kept  # older than the receipts
        with caplog.at_level(logging.ERROR, logger="outbox.relay"):
            run_until(relay, lambda: bool(hooks.losses))
            run_checks(relay, hooks, 3)
        assert len(hooks.losses) == 1
        [error] = [r for r in caplog.records if "lost stream entries" in r.getMessage()]
        since = parse_since(error.__dict__["fields"]["republish"].split("--since ", 1)[1])
        # The window starts at or before the first event published after the snapshot.
        page = open_store(outbox.engine, outbox.schema).outbox_published_page(0, 100)
        first_lost = min(parse_since(r.time) for r, _s in page if r.event_id in lost)
        assert since <= first_lost
        result = republish(
            open_store(outbox.engine, outbox.schema), RedisStreamPublisher(client), since=since
        )
        assert result.republished >= 4
        assert stream_ids(client, "outbox.t")[-4:] == lost
        relay.store.close()


def test_a_new_relay_takes_the_latest_receipt_from_the_database(outbox: Outbox) -> None:
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        first = Relay(outbox, RedisStreamPublisher(client), config())
        emit(outbox, 3)
        drain(first)
        first.store.close()
        client.flushall()
        hooks = Recorded()
        second = Relay(outbox, RedisStreamPublisher(client), config(), hooks=hooks)
        second.run_once()
        assert len(hooks.losses) == 1
        second.store.close()


def test_a_loss_hidden_by_a_writer_that_knew_nothing_of_it_is_still_seen(
    outbox: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis comes back empty and a writer with no receipts for this stream (a relay that
    never published there) adds an entry first: marker and stream head are now past our
    receipt. The receipt's own entry is gone, so the check still reports the loss, with a
    window that covers every lost event."""
    hooks = Recorded()
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        relay = checking_relay(outbox, client, hooks)
        lost = emit(outbox, 3)
        drain(relay)
        server.restart(kill=True)
        client = redis.Redis.from_url(server.url)
        newer = client.xadd("outbox.t", {"id": "from-another-writer"})
        client.set(marker_key("outbox.{topic}"), newer)
        with caplog.at_level(logging.ERROR, logger="outbox.relay"):
            assert relay.check_redis() is True
        assert len(hooks.losses) == 1
        [error] = [r for r in caplog.records if "lost stream entries" in r.getMessage()]
        since = parse_since(error.__dict__["fields"]["republish"].split("--since ", 1)[1])
        page = open_store(outbox.engine, outbox.schema).outbox_published_page(0, 100)
        assert since <= min(parse_since(r.time) for r, _s in page if r.event_id in lost)
        relay.store.close()


def test_entries_trimmed_on_purpose_are_not_a_loss(outbox: Outbox) -> None:
    """Our latest entry trimmed away (XTRIM, MAXLEN) is deleted on purpose: Redis 7 says so
    (max-deleted-entry-id), and the check reports nothing."""
    hooks = Recorded()
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        relay = checking_relay(outbox, client, hooks)
        emit(outbox, 3)
        drain(relay)
        client.xtrim("outbox.t", maxlen=0)
        assert relay.check_redis() is False
        assert hooks.losses == []
        relay.store.close()


def test_a_missing_marker_alone_is_not_a_loss(outbox: Outbox) -> None:
    """A marker deleted (or a Redis used by an older relay) with the stream intact: the
    relay re-arms the marker and reports nothing."""
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url)
        hooks = Recorded()
        relay = Relay(outbox, RedisStreamPublisher(client), config(), hooks=hooks)
        emit(outbox, 3)
        drain(relay)
        client.delete(marker_key("outbox.{topic}"))
        more = emit(outbox, 2, start=3)
        drain(relay)
        assert hooks.losses == []
        assert stream_ids(client, "outbox.t")[-2:] == more
        relay.store.close()


# -- republish on the shared Redis ----------------------------------------------------------------


@pytest.mark.slow  # relay processes (~40 s under load)
def test_republish_cli_options_on_the_shared_redis(
    outbox: Outbox, db_url: str, redis_url: str, redis_client: redis.Redis, stream_prefix: str
) -> None:
    template = f"{stream_prefix}.{{topic}}"
    relay = Relay(outbox, RedisStreamPublisher(redis_client, template), config())
    quotes = emit(outbox, 12, keys=4, topic="quote")
    mails = emit(outbox, 3, topic="mail", start=100)
    drain(relay)
    relay.store.close()
    created = open_store(outbox.engine, outbox.schema).outbox_published_page(0, 1)[0][0].time
    quote_stream, mail_stream = f"{stream_prefix}.quote", f"{stream_prefix}.mail"
    redis_client.delete(quote_stream, mail_stream)  # what a flush would do to them
    common = ("--database-url", db_url, "--redis-url", redis_url)

    dry = cli("republish", "--since", created, "--dry-run", *common)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["republished"] == 15 and json.loads(dry.stdout)["dry_run"]
    assert redis_client.exists(quote_stream, mail_stream) == 0

    only = cli("republish", "--from-seq", "1", "--topic", "mail", *common)
    assert only.returncode == 0, only.stderr
    assert json.loads(only.stdout)["republished"] == 3
    assert stream_ids(redis_client, mail_stream) == mails

    other = f"{stream_prefix}.again.{{topic}}"
    routed = cli("republish", "--since", "0", "--topic", "quote", "--stream", other, *common)
    assert routed.returncode == 0, routed.stderr
    got = redis_client.xrange(f"{stream_prefix}.again.quote")
    per_key: dict[str, list[str]] = defaultdict(list)
    for _id, fields in got:
        per_key[fields[b"subject"].decode()].append(fields[b"id"].decode())
    expected: dict[str, list[str]] = defaultdict(list)
    for n, event_id in enumerate(quotes):
        expected[f"k{n % 4}"].append(event_id)
    assert per_key == expected

    future = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    none = cli("republish", "--since", future, *common)
    assert none.returncode == 0 and json.loads(none.stdout)["republished"] == 0

    for bad in (
        ("--since", "yesterday"),
        ("--since", "2026-11-30T12:00:00"),
        ("--since", "0", "--from-seq", "1"),
        (),
        ("--from-seq", "-1"),
    ):
        result = cli("republish", *bad, *common)
        assert result.returncode == 2, (bad, result.stderr)
        assert result.stderr.strip()
    with sa.create_engine(db_url).connect() as conn:  # nothing changed in the table
        states = {s for (s,) in conn.execute(sa.text("SELECT DISTINCT state FROM outbox_events"))}
    assert states == {"published"}


# -- trimming -------------------------------------------------------------------------------------


def test_time_retention_trims_old_entries_but_never_what_a_group_still_needs(
    outbox: Outbox,
) -> None:
    # One entry per stream node, so approximate trimming (MINID ~) trims entry by entry.
    with ConfiguredRedis("--stream-node-max-entries", "1") as server:
        client = redis.Redis.from_url(server.url)
        old = int((time.time() - 3 * 86400) * 1000)
        for stream in ("outbox.grouped", "outbox.alone"):
            for i in range(10):
                client.xadd(stream, {"id": f"old-{i}"}, id=f"{old + i}-0")
        client.xgroup_create("outbox.grouped", "billing", id="0")
        client.xreadgroup("billing", "c1", {"outbox.grouped": ">"}, count=10)
        for i in (0, 1, 2, 3, 4, 6, 7, 8, 9):  # entry 5 stays pending
            client.xack("outbox.grouped", "billing", f"{old + i}-0")
        relay = Relay(outbox, RedisStreamPublisher(client), config())
        [grouped] = emit(outbox, 1, topic="grouped")
        [alone] = emit(outbox, 1, topic="alone")
        drain(relay)
        assert stream_ids(client, "outbox.alone") == [alone]
        assert stream_ids(client, "outbox.grouped") == [
            *(f"old-{i}" for i in range(5, 10)),
            grouped,
        ]
        relay.store.close()
        # Without retention nothing is trimmed.
        for i in range(3):
            client.xadd("outbox.kept", {"id": f"old-{i}"}, id=f"{old + i}-0")
        kept = Relay(outbox, RedisStreamPublisher(client, stream_retention=0), config())
        [new] = emit(outbox, 1, topic="kept")
        drain(kept)
        assert stream_ids(client, "outbox.kept") == ["old-0", "old-1", "old-2", new]
        kept.store.close()


# -- the loop: relay process, flush, republish, consumer dedup ------------------------------------


@pytest.mark.slow  # 1,000 events, relay processes, a private Redis flushed (~16 s under load)
def test_flush_after_half_consumed_then_republish_gives_one_job_per_identity(
    pg_url: str, tmp_path: Path
) -> None:
    """Issue 12's acceptance, on real processes: 1,000 events published by a relay process,
    half of them consumed (one job each), Redis flushed, more events written; the relay logs
    the republish command, ``outbox-relay republish`` runs it, and the consumer ends with
    every event handled once and exactly one job per identity."""
    from consumer import Consumer, ConsumerConfig, Store

    outbox = Outbox(pg_url)
    outbox.create_schema()
    store = Store(outbox.engine)
    with outbox.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE handled (identity text NOT NULL)"))
    identities: list[str] = []

    def write(start: int, n: int) -> None:
        for first in range(start, start + n, 100):
            with outbox.transaction() as tx:
                for i in range(first, min(first + 100, start + n)):
                    identity = f"studio:send-quote-{i}"
                    tx.emit("quote.approved", key=f"quote-{i % 50}", payload={"quote": i},
                            tenant="studio", identity=identity)  # fmt: skip
                    identities.append(identity)

    def published() -> int:
        sql = "SELECT count(*) FROM outbox_events WHERE state = 'published'"
        with outbox.engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar_one())

    def wait(condition: Any, what: str, timeout: float = 90) -> None:
        wait_for(
            condition,
            what,
            timeout=timeout,
            interval=0.1,
            diagnose=lambda: f"relay log:\n{log_path.read_text()[-3000:]}",
        )

    log_path = tmp_path / "relay.log"
    with PrivateRedis() as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["PYTHONPATH"] = str(ROOT)
        with log_path.open("w") as log:
            relay = subprocess.Popen(
                [sys.executable, "-m", "relay", "run", "--database-url", pg_url,
                 "--redis-url", server.url], env=env, stderr=log)  # fmt: skip
        try:
            write(0, 1000)
            wait(lambda: published() == 1000, "1,000 events not published")
            consumer = Consumer(outbox.engine, server.url, group="billing",
                                topics=["quote.approved"],
                                config=ConsumerConfig(block_ms=100, batch_size=100))  # fmt: skip

            @consumer.handler("quote.approved")
            def on_quote(event: Any, tx: Any) -> None:
                tx.session.execute(sa.text("INSERT INTO handled VALUES (:i)"),
                                   {"i": event.identity})  # fmt: skip
                store.enqueue("studio", event.identity.split(":", 1)[1],
                              payload=event.data, session=tx.session)  # fmt: skip

            handled = sum(consumer.run_once() for _ in range(5))
            assert handled == 500
            redis.Redis.from_url(server.url).flushall()
            write(1000, 20)
            wait(lambda: "lost stream entries" in log_path.read_text(), "loss not reported")
            line = next(
                json.loads(x) for x in log_path.read_text().splitlines()
                if "lost stream entries" in x
            )  # fmt: skip
            since = line["republish"].split("--since ", 1)[1]
            wait(lambda: published() == 1020, "the events after the flush not published")
            result = cli("republish", "--since", since, "--database-url", pg_url,
                         "--redis-url", server.url)  # fmt: skip
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["republished"] == 1020

            def step() -> int:
                try:
                    return consumer.run_once()
                except redis.ResponseError as exc:  # the flush took the group: made again
                    assert "NOGROUP" in str(exc)
                    return 0

            distinct = "SELECT count(DISTINCT identity) FROM handled"
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if step() == 0:
                    with outbox.engine.connect() as conn:
                        if conn.execute(sa.text(distinct)).scalar_one() == 1020:
                            break
        finally:
            relay.terminate()
            assert relay.wait(timeout=30) == 0
    with outbox.engine.connect() as conn:
        counts = dict(conn.execute(sa.text(
            "SELECT identity, count(*) FROM handled GROUP BY identity")).all())  # fmt: skip
        jobs = conn.execute(
            sa.text("SELECT count(*), count(DISTINCT action) FROM outbox_jobs")
        ).one()
    assert set(counts) == set(identities) and set(counts.values()) == {1}
    assert tuple(jobs) == (1020, 1020)


@pytest.mark.slow  # a relay process and a private Redis (~8 s under load)
def test_a_relay_process_exports_persistence_and_a_data_loss(
    sqlite_url: str, tmp_path: Path
) -> None:
    """``outbox-relay run --metrics-port``: the persistence gauge at start, and after a
    FLUSHALL the data-loss timestamp that OutboxRedisDataLoss reads."""
    import urllib.request

    try:
        from services import free_port
    except ImportError:  # pragma: no cover
        from tests.services import free_port

    outbox = Outbox(sqlite_url)
    outbox.create_schema()
    port = free_port()

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    def wait(text: str) -> str:
        def exported() -> str | None:
            body = scrape()
            return body if text in body else None

        body = wait_for(
            exported,
            f"{text!r} exported",
            timeout=60,
            interval=0.1,
            diagnose=lambda: f"relay log:\n{log_path.read_text()[-3000:]}",
        )
        assert body is not None
        return body

    log_path = tmp_path / "relay.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(ROOT)
    with PrivateRedis() as server, log_path.open("w") as log:
        client = redis.Redis.from_url(server.url)
        relay = subprocess.Popen(
            [sys.executable, "-m", "relay", "run", "--database-url", sqlite_url,
             "--redis-url", server.url, "--metrics-port", str(port)],
            env=env, stderr=log,
        )  # fmt: skip
        try:
            body = wait('outbox_relay_redis_persistence{mode="none"} 1.0')
            assert 'outbox_relay_redis_persistence{mode="aof"} 0.0' in body
            assert "outbox_relay_redis_data_loss_timestamp_seconds" not in body
            emit(outbox, 3)
            wait_for(lambda: client.xlen("outbox.t") >= 3, "three events published", timeout=60)
            client.flushall()
            emit(outbox, 1, start=3)
            wait("outbox_relay_redis_data_loss_timestamp_seconds ")
        finally:
            relay.terminate()
            assert relay.wait(timeout=30) == 0
    assert "Redis runs without AOF" in log_path.read_text()
