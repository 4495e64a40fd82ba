"""The partitioned outbox (issue 25): real PostgreSQL, real Redis, real relay processes.

What they prove:

- ``init-db --partitioned`` (flag and ``OUTBOX_PARTITIONED``), ``Outbox.create_schema`` and
  ``AsyncOutbox.create_schema(partitioned=...)`` make a table partitioned on ``created_at``
  with a DEFAULT partition and partitions ahead; bad settings are typed errors that name
  the problem, and nothing is converted;
- events written across partition boundaries (one-second partitions, real time; and rows
  placed in hour-old partitions) are published exactly once, per key in commit order, a late
  commit whose row lands in an earlier partition included;
- upkeep drops a partition only when its upper bound is past the retention and no row in it
  is pending or quarantined; the stream and the receipts of what went are untouched;
  ``purge --dry-run`` lists the partitions that would go; no DELETE runs;
- reconciliation of unreceipted intents and ``republish`` work across partitions;
- the publishing across boundaries and the reconciliation and republish cases are broker
  contract cases (``broker_kit``, issue 40): Redis, Redis Cluster and NATS JetStream, the
  broker side only through the :class:`relay.broker.Broker` seam;
- a relay SIGKILLed and restarted on a partitioned table loses and duplicates nothing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from outbox import AsyncOutbox, Outbox
from outbox import partitions as parts
from outbox.errors import ConfigError
from outbox.schema import PG_STORAGE_PARAMETERS
from outbox.tablestats import table_stats
from relay import RedisStreamPublisher, Relay
from relay.broker import Broker
from relay.partitions import PartitionUpkeep
from relay.records import Record
from relay.republish import republish
from relay.store import store_for
from relay.store.pg_statements import PG_RECORD_COLUMNS

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from broker_support import BrokerKit, broker_kit
    from services import wait_for
    from test_relay import fast_config as config
    from test_relay_cli import cli as relay_cli
    from test_relay_faults import pending_count
except ImportError:  # pragma: no cover
    from tests.broker_support import BrokerKit, broker_kit  # noqa: F401
    from tests.services import wait_for
    from tests.test_relay import fast_config as config
    from tests.test_relay_cli import cli as relay_cli
    from tests.test_relay_faults import pending_count

cli = functools.partial(relay_cli, timeout=120)

ROOT = Path(__file__).resolve().parent.parent
TABLE = "outbox_events"
HOUR = 3600


def relkind(engine: sa.Engine, table: str = TABLE) -> str | None:
    with engine.connect() as conn:
        return parts.relkind(conn, f'"{table}"')


def partition_of_rows(engine: sa.Engine) -> dict[str, str]:
    """event_id -> the name of the partition holding it."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                f"SELECT o.event_id, c.relname FROM {TABLE} o JOIN pg_class c ON c.oid = o.tableoid"
            )
        )
        return {str(e): str(p) for e, p in rows}


def schema_of(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT current_schema()")).scalar_one())


def names(engine: sa.Engine, length: int) -> list[str]:
    with engine.connect() as conn:
        return [p.name for p in parts.list_partitions(conn, schema_of(engine), TABLE, length)]


def stream_events(client: redis.Redis, stream: str) -> list[tuple[str, str]]:
    """(event id, subject) of every entry, in stream order."""
    return [
        (f[b"id"].decode(), f[b"subject"].decode()) for _id, f in client.xrange(stream, "-", "+")
    ]


def make_relay(outbox: Outbox, client: redis.Redis, prefix: str, **overrides: Any) -> Relay:
    return Relay(outbox, RedisStreamPublisher(client, f"{prefix}.{{topic}}"), config(**overrides))


def relay_on(outbox: Outbox, broker: Broker, **overrides: Any) -> Relay:
    return Relay(outbox, broker, config(**overrides))


def record_of(outbox: Outbox, event_id: str) -> Record:
    """The row of ``event_id`` as the relay claims it (what it hands its broker)."""
    with outbox.engine.connect() as conn:
        sql = f"SELECT {PG_RECORD_COLUMNS} FROM {TABLE} t WHERE t.event_id = :e"
        return Record(*conn.execute(sa.text(sql), {"e": event_id}).one())


def drain_until(relay: Relay, condition: Any, what: str, timeout: float = 30.0) -> None:
    wait_for(lambda: relay.run_once() >= 0 and condition(), what, timeout=timeout, interval=0.01)


def hour_partitions(outbox: Outbox, hours_back: int) -> None:
    """The hourly partitions of the last ``hours_back`` hours (a table made now has only the
    current one and those ahead)."""
    with outbox.engine.begin() as conn:
        parts.ensure_partitions(
            conn,
            schema_of(outbox.engine),
            TABLE,
            HOUR,
            PG_STORAGE_PARAMETERS,
            now=time.time() - hours_back * HOUR,
            ahead=hours_back,
        )


def move_back(outbox: Outbox, event_ids: list[str], hours: int) -> None:
    """Move rows ``hours`` back in time: PostgreSQL moves them into that hour's partition."""
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE {TABLE} SET created_at = created_at - make_interval(hours => :h) "
                "WHERE event_id = ANY(:ids)"
            ),
            {"h": hours, "ids": event_ids},
        )


@pytest.fixture
def hourly(pg_url: str) -> Outbox:
    o = Outbox(pg_url)
    o.create_schema(partitioned="hourly")
    return o


# -- creating the table ----------------------------------------------------------------------


def test_init_db_partitioned_by_flag_and_environment(pg_url: str) -> None:
    made = cli("init-db", "--database-url", pg_url, "--partitioned", "hourly")
    assert made.returncode == 0, made.stderr
    assert "partitioned hourly" in made.stdout
    engine = sa.create_engine(pg_url)
    assert relkind(engine) == "p"
    with engine.connect() as conn:
        assert parts.table_length(conn, f'"{TABLE}"') == HOUR
    got = names(engine, HOUR)
    assert got[-1] == f"{TABLE}_default"
    assert len(got) == 1 + 1 + parts.AHEAD  # the current hour, those ahead, the DEFAULT
    again = cli("init-db", "--database-url", pg_url, "--partitioned", "hourly")
    assert again.returncode == 0, again.stderr  # idempotent

    by_env = cli(
        "init-db", "--database-url", pg_url, "--table", "daily_events",
        env={"OUTBOX_PARTITIONED": "daily"},
    )  # fmt: skip
    assert by_env.returncode == 0, by_env.stderr
    with engine.connect() as conn:
        assert parts.table_length(conn, '"daily_events"') == 86400

    plain = cli("init-db", "--database-url", pg_url, "--table", "plain_events")
    assert plain.returncode == 0, plain.stderr
    refused = cli(
        "init-db", "--database-url", pg_url, "--table", "plain_events", "--partitioned", "daily"
    )
    assert refused.returncode != 0
    assert "partitioned" in refused.stderr and "not partitioned" in refused.stderr
    assert relkind(engine, "plain_events") == "r"  # not converted
    other = cli("init-db", "--database-url", pg_url, "--partitioned", "daily")
    assert other.returncode != 0 and "every 3600 s" in other.stderr
    bad = cli("init-db", "--database-url", pg_url, "--partitioned", "weekly")
    assert bad.returncode == 2 and "weekly" in bad.stderr
    engine.dispose()


def test_create_schema_partitioned_from_the_api_sync_and_async(pg_url: str) -> None:
    outbox = Outbox(pg_url)
    outbox.create_schema(partitioned=120)
    outbox.create_schema()  # an existing table keeps its choice
    with outbox.engine.connect() as conn:
        assert parts.table_length(conn, f'"{TABLE}"') == 120
        params = conn.execute(
            sa.text(
                "SELECT c.reloptions FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = to_regclass(:t)"
            ),
            {"t": TABLE},
        ).all()
    # Each partition has the storage parameters (a partitioned table takes none itself).
    assert params and all("fillfactor=50" in (r[0] or []) for r in params)
    with outbox.transaction() as tx:
        event_id = tx.emit("t", key="k", payload={"n": 1})
    assert partition_of_rows(outbox.engine)[event_id] != f"{TABLE}_default"
    with outbox.engine.connect() as conn:  # status and metrics count the partitions as one
        (stats,) = table_stats(conn, [(TABLE, None, "outbox")])
    assert stats.table_bytes and stats.table_bytes > 0 and stats.index_bytes

    async def make() -> None:
        aio = AsyncOutbox(pg_url.replace("+psycopg", "+psycopg_async"), table="async_events")
        await aio.create_schema(partitioned="daily")
        with pytest.raises(ConfigError, match="partitioned"):
            await aio.create_schema(partitioned="fortnightly")
        await aio.engine.dispose()

    asyncio.run(make())
    with outbox.engine.connect() as conn:
        assert parts.table_length(conn, '"async_events"') == 86400


def test_bad_partition_settings_are_config_errors_naming_the_problem(
    pg_url: str, sqlite_url: str
) -> None:
    plain = Outbox(pg_url)
    plain.create_schema()
    with pytest.raises(ConfigError, match="not partitioned; it is not converted"):
        plain.create_schema(partitioned="hourly")
    assert relkind(plain.engine) == "r"
    with pytest.raises(ConfigError, match="needs PostgreSQL"):
        Outbox(sqlite_url).create_schema(partitioned="daily")
    other = Outbox(pg_url, table="by_minute")
    other.create_schema(partitioned=60)
    with pytest.raises(ConfigError, match="every 60 s, not every 3600 s"):
        other.create_schema(partitioned="hourly")
    for bad in ("weekly", 0, -1, 1.5, True, 10**9, "1h"):
        with pytest.raises(ConfigError, match="partitioned"):
            Outbox(pg_url, table="never").create_schema(partitioned=bad)  # type: ignore[arg-type]
    assert relkind(plain.engine, "never") is None  # nothing was made
    with plain.engine.begin() as conn:  # a partitioned table the toolkit did not make
        conn.execute(
            sa.text("CREATE TABLE foreign_events (LIKE by_minute) PARTITION BY RANGE (created_at)")
        )
    with pytest.raises(ConfigError, match="no 'outbox: partitioned by created_at"):
        Outbox(pg_url, table="foreign_events").create_schema()


# -- publishing across partitions ------------------------------------------------------------


def test_every_relay_statement_rewrite_still_fits_the_plain_statements() -> None:
    from relay.store import pg_statements
    from relay.store.partitions import _REWRITES, unfit_rewrites

    plain = {
        "claim": pg_statements.PG_CLAIM,
        "published": pg_statements.PG_PUBLISHED,
        "failed": pg_statements.PG_FAILED,
        "quarantine": pg_statements.PG_QUARANTINE,
        "resolve_found": pg_statements.PG_RESOLVE_FOUND,
        "resolve_missing": pg_statements.PG_RESOLVE_MISSING,
    }
    assert set(plain) == set(_REWRITES)
    assert unfit_rewrites(plain) == []


def test_events_across_partition_boundaries_are_published_once_in_key_order(
    pg_url: str, broker_kit: BrokerKit
) -> None:
    outbox = Outbox(pg_url)
    outbox.create_schema(partitioned=1)  # one-second partitions: boundaries every second
    relay = relay_on(outbox, broker_kit.make())
    stream = broker_kit.stream("t")
    written: list[tuple[str, str]] = []
    # A transaction begun now and committed last: its rows are stamped with its start, so
    # they land in an earlier partition than rows committed before it (the claim floor).
    with outbox.engine.connect() as held:
        held_tx = held.begin()
        late = outbox.emit(held, "t", key="late", payload={"n": 0})

        def cycle() -> bool:
            relay.run_once()
            relay.partition_duty.maybe_run()  # what ``run`` does after each cycle
            return broker_kit.length(stream) >= len(written)

        def spanned() -> int:
            # In a transaction of its own, closed before the relay's upkeep runs: a read of
            # the whole table holds a lock on the DEFAULT partition, which ATTACH PARTITION
            # waits for (and then gives up on). Kept open across the cycle, as it once was,
            # it made upkeep fail whenever the test outlived the partitions made ahead.
            with outbox.engine.connect() as conn:
                sql = f"SELECT count(DISTINCT tableoid) FROM {outbox.schema.table_name}"
                return int(conn.execute(sa.text(sql)).scalar_one())

        n = 0
        while spanned() < 4:  # across three boundaries at least
            with outbox.transaction() as tx:
                for _ in range(20):
                    key = f"k{n % 7}"
                    written.append((tx.emit("t", key=key, payload={"n": n}), key))
                    n += 1
            wait_for(cycle, "the rows written so far (the held one aside) on the stream")
        held_tx.commit()
    written.append((late, "late"))
    with outbox.transaction() as tx:
        after = tx.emit("t", key="late", payload={"n": 1})
    written.append((after, "late"))
    drain_until(relay, lambda: broker_kit.length(stream) >= len(written), "every event")
    relay.run_once()
    got = [(e["id"], e["subject"]) for e in broker_kit.read(stream)]
    assert Counter(e for e, _k in got) == Counter(e for e, _k in written)  # once each
    per_key_got: dict[str, list[str]] = defaultdict(list)
    for event_id, key in got:
        per_key_got[key].append(event_id)
    per_key_written: dict[str, list[str]] = defaultdict(list)
    for event_id, key in written:
        per_key_written[key].append(event_id)
    assert per_key_got == per_key_written
    where = partition_of_rows(outbox.engine)
    assert len(set(where.values())) >= 3
    assert f"{TABLE}_default" not in where.values()  # upkeep kept partitions ahead
    assert where[late] != where[after]  # the late commit sits in an earlier partition
    relay.store.close()


def test_old_partitions_drop_only_when_all_published_and_the_stream_is_untouched(
    hourly: Outbox, pg_url: str, redis_client: redis.Redis, stream_prefix: str
) -> None:
    outbox = hourly
    hour_partitions(outbox, 5)
    relay = make_relay(outbox, redis_client, stream_prefix, retention_seconds=HOUR)
    stream = f"{stream_prefix}.t"
    with outbox.transaction() as tx:
        published = [tx.emit("t", key=f"p{i}", payload={"i": i}) for i in range(3)]
        quarantined = tx.emit("t", key="q", payload={})
        pending = tx.emit("t", key="w", payload={})
    drain_until(relay, lambda: redis_client.xlen(stream) >= 5, "five events")
    with outbox.engine.begin() as conn:  # one row quarantined, one not yet published
        conn.execute(
            sa.text(f"UPDATE {TABLE} SET state = 'quarantined' WHERE event_id = :q"),
            {"q": quarantined},
        )
        conn.execute(
            sa.text(f"UPDATE {TABLE} SET state = 'pending', attempts = 1 WHERE event_id = :w"),
            {"w": pending},
        )
    move_back(outbox, published, 4)
    move_back(outbox, [quarantined], 3)
    move_back(outbox, [pending], 2)
    where = partition_of_rows(outbox.engine)
    doomed = where[published[0]]
    assert len({doomed, where[quarantined], where[pending]}) == 3

    dry = cli("purge", "--dry-run", "--json", "--database-url", pg_url, "--retention", "3600")
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout)["tables"]
    assert listed[doomed] == 3  # the partition and its rows (and the empty ones before it)
    assert set(listed.values()) == {0, 3}
    assert where[quarantined] not in listed and where[pending] not in listed

    relay.store.connect()
    relay.store.partition_rebalance()
    assert 0 in relay.store.partitions_owned
    assert relay.delete_expired() == 0  # no DELETE on a partitioned table
    done = relay.partition_duty.run_now()
    assert {p.name for p in done.dropped} == set(listed)
    assert {p.name for p in done.kept} == {where[quarantined], where[pending]}
    assert doomed not in names(outbox.engine, HOUR)
    left = partition_of_rows(outbox.engine)
    assert set(left) == {quarantined, pending}  # the published rows went with their partition
    assert redis_client.xlen(stream) == 5  # the stream is not touched
    # Later rounds keep what holds an unpublished row, however old.
    again = PartitionUpkeep(outbox.engine, outbox.schema, 1.0).run_once(now=time.time() + 10 * HOUR)
    assert set(partition_of_rows(outbox.engine)) == {quarantined, pending}
    assert {p.name for p in again.kept} == {where[quarantined], where[pending]}
    assert f"{TABLE}_default" in names(outbox.engine, HOUR)  # never dropped
    relay.store.close()


def test_reconcile_and_republish_across_partitions(hourly: Outbox, broker_kit: BrokerKit) -> None:
    """A relay died holding intents in two partitions, after one of them reached the
    broker: the next relay finds that one in the stream (not published twice) and publishes
    the other; after the broker lost the stream, ``republish`` sends all three again, in
    ``seq`` order across the partitions."""
    outbox = hourly
    hour_partitions(outbox, 3)
    stream = broker_kit.stream("t")
    with outbox.transaction() as tx:
        sent = tx.emit("t", key="A", payload={"n": 1})
        unsent = tx.emit("t", key="B", payload={"n": 1})
        later = tx.emit("t", key="A", payload={"n": 2})
    move_back(outbox, [sent], 2)
    move_back(outbox, [unsent], 1)
    # A relay "died" after claiming both and publishing one: its intents, and what it sent.
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE {TABLE} SET claimed_by = 'relay-dead', claim_epoch = 7, "
                "claimed_at = now() WHERE event_id IN (:a, :b)"
            ),
            {"a": sent, "b": unsent},
        )
    dead = broker_kit.make()
    [receipt] = dead.publish([dead.prepare(record_of(outbox, sent))])
    assert isinstance(receipt, str), receipt
    dead.close()
    relay = relay_on(outbox, broker_kit.make())
    drain_until(relay, lambda: broker_kit.length(stream) >= 3, "the three events")
    got = broker_kit.ids(stream)
    assert sorted(got) == sorted([sent, unsent, later])  # nothing twice
    assert got.index(sent) < got.index(later)
    assert relay.stats.reconciled_found == 1 and relay.stats.reconciled_missing == 1
    relay.store.close()

    broker_kit.lose(stream)  # what a flush would do
    assert broker_kit.ids(stream) == []
    result = republish(store_for(outbox.engine, outbox.schema), broker_kit.make(), from_seq=0)
    assert result.republished == 3 and not result.failed
    assert broker_kit.ids(stream) == [sent, unsent, later]  # seq order, across the partitions


# -- a relay killed on a partitioned table ---------------------------------------------------


@pytest.mark.slow  # relay processes started and SIGKILLed for ~15 s, then a drain (20-40 s)
def test_a_sigkilled_relay_on_a_partitioned_table_loses_and_duplicates_nothing(
    pg_url: str, redis_url: str, redis_client: redis.Redis, stream_prefix: str, tmp_path: Path
) -> None:
    outbox = Outbox(pg_url)
    outbox.create_schema(partitioned=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(ROOT)
    command = [
        sys.executable, "-m", "relay", "run", "--database-url", pg_url, "--redis-url", redis_url,
        "--stream", f"{stream_prefix}.{{topic}}", "--retention", "0",
    ]  # fmt: skip
    written: list[tuple[str, str]] = []
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            with outbox.transaction() as tx:
                for _ in range(10):
                    key = f"k{n % 11}"
                    written.append((tx.emit("t", key=key, payload={"n": n}), key))
                    n += 1
            stop.wait(0.01)  # a steady writer, ended by the stop at once

    writer = threading.Thread(target=write)
    writer.start()
    log = (tmp_path / "relay.log").open("w")
    kills = 0
    stream = f"{stream_prefix}.t"
    try:
        # Each relay is killed as soon as it has published since it started: mid-work, in
        # the window between XADD and the receipt. For 12 s (rows over several partitions)
        # and at least 10 kills.
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline or kills < 10:
            before = redis_client.xlen(stream)
            relay = subprocess.Popen(command, env=env, stderr=log)
            wait_for(
                lambda relay=relay, before=before: (
                    redis_client.xlen(stream) > before or relay.poll() is not None
                ),
                f"relay {kills + 1} to publish",
                timeout=60,
            )
            assert relay.poll() is None, f"the relay exited by itself ({relay.returncode})"
            relay.send_signal(signal.SIGKILL)
            relay.wait()
            kills += 1
        stop.set()
        writer.join()
        relay = subprocess.Popen(command, env=env, stderr=log)
        try:
            wait_for(
                lambda: redis_client.xlen(stream) >= len(written),
                "every event in the stream",
                timeout=90,
            )
            # A duplicate would be XADDed before its row's receipt: once no row is left
            # unpublished, every publish this relay will make has been made.
            wait_for(lambda: pending_count(outbox.engine) == (0, 0), "every receipt", timeout=60)
        finally:
            relay.send_signal(signal.SIGTERM)
            relay.wait(30)
    finally:
        stop.set()
        writer.join()
        log.close()
    got = stream_events(redis_client, stream)
    counts = Counter(e for e, _k in got)
    assert not [e for e, c in counts.items() if c > 1], "duplicates"
    assert set(counts) == {e for e, _k in written}, "lost events"
    per_key: dict[str, list[str]] = defaultdict(list)
    for event_id, key in got:
        per_key[key].append(event_id)
    expected: dict[str, list[str]] = defaultdict(list)
    for event_id, key in written:
        expected[key].append(event_id)
    assert per_key == expected
    assert kills >= 8
    assert len(set(partition_of_rows(outbox.engine).values())) >= 4
