"""The outbox on MariaDB/MySQL (issue 58): the relay against a hand-written batched loop on
the same table, and the writer against a minimal hand-written INSERT.

``python -m bench mysql relay [--events 100000] [--rounds 2] [--batch 500]``
    A backlog of ``--events`` pending rows, drained (a) by a hand-written loop (``SELECT ...
    ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED``, one pipelined XADD per batch, one UPDATE
    of the batch, commit) and (b) by the relay (``Relay.run_once`` in this process, the same
    batch size, the same Redis). Rounds alternate a then b on a fresh database each; the
    ratio is the relay's events/s over the loop's, per round.

``python -m bench mysql write [--seconds 10] [--threads 1 8] [--rounds 3]``
    Domain transactions (an aggregate row locked and bumped, one event) for ``--seconds`` at
    each thread count: through ``outbox.emit(conn, ...)`` in the caller's Core transaction
    and through ``outbox.transaction()`` (a Session), on the default schema, each against a
    minimal hand-written INSERT into a table of a primary key and four columns made the same
    way (a Core transaction; a Session). Ratio: the hand-written transactions/s over the
    outbox's, medians of ``--rounds`` alternated rounds (1.00 = no overhead).

``python -m bench mysql retention [--events 100000] [--batch 1000]``
    ``--events`` published rows past the retention, deleted by the relay's retention round
    (``DELETE ... ORDER BY seq LIMIT --batch`` per transaction, until done), against the same
    rows in a table partitioned by ``created_at`` (what MySQL would need: the partition
    column in the primary key and in ``event_id``'s unique key), dropped with ``ALTER TABLE
    ... DROP PARTITION``.

MariaDB at ``OUTBOX_BENCH_MYSQL`` (default ``mysql+pymysql://root@127.0.0.1:3306``), Redis at
``OUTBOX_BENCH_REDIS``. Each run creates and drops its own databases.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from statistics import median

import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.codec import EntryEncoder
from outbox.db import make_engine
from relay import RedisStreamPublisher, Relay, RelayConfig

BASE = os.environ.get("OUTBOX_BENCH_MYSQL", "mysql+pymysql://root@127.0.0.1:3306")
REDIS = os.environ.get("OUTBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
TOPICS = ("bench.a", "bench.b")


@contextmanager
def database() -> Iterator[str]:
    name = f"bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(f"{BASE}/", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    try:
        yield f"{BASE}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def preload(outbox: Outbox, n: int) -> None:
    """``n`` pending events over 1,000 keys, 500 per transaction."""
    for start in range(0, n, 500):
        with outbox.transaction() as tx:
            for i in range(start, min(n, start + 500)):
                tx.emit(TOPICS[i % 2], key=f"k{i % 1000}", payload={"i": i, "pad": "x" * 100})


_ENCODER = EntryEncoder("bench")


def batched_loop(url: str, r: redis.Redis, prefix: str, batch: int) -> int:
    """The hand-written relay: what a careful engineer writes in an afternoon."""
    engine = make_engine(url, pool_size=1)
    done = 0
    try:
        with engine.connect().execution_options(isolation_level="READ COMMITTED") as conn:
            while True:
                with conn.begin():
                    rows = conn.execute(
                        sa.text(
                            'SELECT seq, event_id, topic, "key", tenant, identity, payload, '
                            "created_at FROM outbox_events WHERE state = 'pending' "
                            "ORDER BY seq LIMIT :n FOR UPDATE SKIP LOCKED"
                        ),
                        {"n": batch},
                    ).all()
                    if not rows:
                        return done
                    pipe = r.pipeline(transaction=False)
                    for _seq, event_id, topic, key, tenant, identity, payload, created in rows:
                        fields = _ENCODER.fields(
                            event_id=event_id,
                            topic=topic,
                            data=payload,
                            key=key,
                            time=created.isoformat() + "Z",
                            tenant=tenant,
                            identity=identity,
                        )
                        pipe.xadd(f"{prefix}.{topic}", fields)  # type: ignore[arg-type]
                    ids = [i.decode() for i in pipe.execute()]
                    # One UPDATE for the batch: the receipts in a CASE on the primary key.
                    cases = " ".join(f"WHEN :s{n} THEN :i{n}" for n in range(len(rows)))
                    params: dict[str, object] = {f"s{n}": row[0] for n, row in enumerate(rows)}
                    params.update({f"i{n}": i for n, i in enumerate(ids)})
                    params["seqs"] = [row[0] for row in rows]
                    conn.execute(
                        sa.text(
                            "UPDATE outbox_events SET state = 'published', "
                            f"stream_id = CASE seq {cases} END, "
                            "published_at = UTC_TIMESTAMP(6) WHERE seq IN :seqs"
                        ).bindparams(sa.bindparam("seqs", expanding=True)),
                        params,
                    )
                done += len(rows)
    finally:
        engine.dispose()


def relay_drain(outbox: Outbox, r: redis.Redis, prefix: str, batch: int) -> int:
    publisher = RedisStreamPublisher(r, f"{prefix}.{{topic}}")
    relay = Relay(outbox, publisher, RelayConfig(batch_size=batch), name="bench")
    done = 0
    try:
        while n := relay.run_once():
            done += n
    finally:
        relay.store.close()
    return done


def relay_round(events: int, batch: int) -> dict[str, float]:
    r = redis.Redis.from_url(REDIS)
    out: dict[str, float] = {}
    try:
        for name in ("loop", "relay"):
            prefix = f"bench{uuid.uuid4().hex[:8]}"
            with database() as url:
                outbox = Outbox(url)
                outbox.create_schema()
                preload(outbox, events)
                started = time.perf_counter()
                if name == "loop":
                    done = batched_loop(url, r, prefix, batch)
                else:
                    done = relay_drain(outbox, r, prefix, batch)
                elapsed = time.perf_counter() - started
                outbox.engine.dispose()
            assert done == events, (name, done)
            assert sum(int(r.xlen(f"{prefix}.{t}")) for t in TOPICS) == events
            r.delete(*(f"{prefix}.{t}" for t in TOPICS))
            out[name] = events / elapsed
    finally:
        r.close()
    out["ratio"] = out["relay"] / out["loop"]
    return out


MINIMAL = (
    "CREATE TABLE hand_outbox (id BIGINT AUTO_INCREMENT PRIMARY KEY, event_id VARCHAR(64), "
    'topic VARCHAR(200), "key" VARCHAR(200), payload JSON, '
    "created_at DATETIME(6) DEFAULT (UTC_TIMESTAMP(6))) ENGINE=InnoDB"
)


def hand_row(agg: int, n: int) -> dict[str, str]:
    """The hand-written outbox's row: a random id, the topic, the key, the payload."""
    return {"e": str(uuid.uuid4()), "t": "bench.a", "k": f"agg-{agg}", "p": json.dumps({"n": n})}


def write_rate(url: str, threads: int, seconds: float, way: str) -> float:
    """Domain transactions per second: lock and bump an aggregate, write one event."""
    engine = make_engine(url, pool_size=threads + 2)
    outbox = Outbox(engine)
    counts = [0] * threads
    stop = time.monotonic() + seconds
    bump = sa.text("UPDATE aggregates SET version = version + 1 WHERE id = :id")
    insert = sa.text(
        'INSERT INTO hand_outbox (event_id, topic, "key", payload) VALUES (:e, :t, :k, :p)'
    )

    def run(n: int) -> None:
        while time.monotonic() < stop:
            agg = n * 1000 + counts[n] % 1000
            if way == "outbox":
                with outbox.transaction() as tx:
                    tx.session.execute(bump, {"id": agg})
                    tx.emit("bench.a", key=f"agg-{agg}", payload={"n": counts[n]})
            elif way == "emit":  # the connection path: the caller's own transaction
                with engine.begin() as conn:
                    conn.execute(bump, {"id": agg})
                    outbox.emit(conn, "bench.a", key=f"agg-{agg}", payload={"n": counts[n]})
            elif way == "hand-session":  # the hand-written INSERT in a Session of its own
                with Session(engine) as session, session.begin():
                    session.execute(bump, {"id": agg})
                    session.execute(insert, hand_row(agg, counts[n]))
            else:
                with engine.begin() as conn:
                    conn.execute(bump, {"id": agg})
                    conn.execute(insert, hand_row(agg, counts[n]))
            counts[n] += 1

    started = time.perf_counter()
    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    rate = sum(counts) / (time.perf_counter() - started)
    engine.dispose()
    return rate


def write(seconds: float, thread_counts: list[int], rounds: int = 3) -> None:
    with database() as url:
        engine = make_engine(url, pool_size=2)
        Outbox(engine).create_schema()
        with engine.begin() as conn:
            conn.execute(sa.text(MINIMAL))
            conn.execute(sa.text("CREATE TABLE aggregates (id INT PRIMARY KEY, version INT)"))
            conn.execute(
                sa.text("INSERT INTO aggregates VALUES (:i, 0)"),
                [{"i": i} for i in range(max(thread_counts) * 1000)],
            )
        engine.dispose()
        for threads in thread_counts:
            # Alternated, twice each: the machine's load drifts between runs.
            # Each way against the hand-written INSERT made the same way: emit() in a Core
            # transaction against the INSERT in a Core transaction, outbox.transaction() (a
            # Session) against the INSERT in a Session (what the ORM costs either way is not
            # the outbox's).
            ways = ("hand", "emit", "hand-session", "outbox")
            rates: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(rounds):
                for way in ways:
                    rates[way].append(write_rate(url, threads, seconds, way))
            for way, base in (("emit", "hand"), ("outbox", "hand-session")):
                box, hand = median(rates[way]), median(rates[base])
                print(
                    f"writer, {threads} thread(s), {way}: {box:,.0f} tx/s against {base} "
                    f"{hand:,.0f}: x{hand / box:.2f} "
                    f"(rounds: {[round(r) for r in rates[way]]} / "
                    f"{[round(r) for r in rates[base]]})"
                )


PARTITIONED = (
    "CREATE TABLE parted (seq BIGINT NOT NULL AUTO_INCREMENT, event_id VARCHAR(64) NOT NULL, "
    'topic VARCHAR(200) NOT NULL, "key" VARCHAR(200) NOT NULL, payload JSON NOT NULL, '
    "state VARCHAR(16) NOT NULL, created_at DATETIME(6) NOT NULL, "
    "PRIMARY KEY (seq, created_at), UNIQUE KEY (event_id, created_at), "
    'KEY (state, seq), KEY ("key", state, seq)) ENGINE=InnoDB '
    "PARTITION BY RANGE COLUMNS (created_at) ("
    "PARTITION p_old VALUES LESS THAN ('2000-01-02'), PARTITION p_now VALUES LESS THAN MAXVALUE)"
)


def retention(events: int, batch: int) -> None:
    """Published rows past the retention: the relay's batched DELETE (``purge``'s round,
    ``batch`` rows a transaction) against dropping a partition holding the same rows."""
    from relay.store.mysql import delete_published

    with database() as url:
        engine = make_engine(url, pool_size=2)
        outbox = Outbox(engine)
        outbox.create_schema()
        preload(outbox, events)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE outbox_events SET state = 'published', "
                    "published_at = '2000-01-01', created_at = '2000-01-01'"
                )
            )
            conn.execute(sa.text(PARTITIONED))
            conn.execute(
                sa.text(
                    'INSERT INTO parted (event_id, topic, "key", payload, state, created_at) '
                    'SELECT event_id, topic, "key", payload, state, created_at FROM outbox_events'
                )
            )
        started = time.perf_counter()
        deleted = 0
        while True:
            n = delete_published(engine, '"outbox_events"', 86400, batch)
            deleted += n
            if n < batch:
                break
        batched = time.perf_counter() - started
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE parted DROP PARTITION p_old"))
        dropped = time.perf_counter() - started
        engine.dispose()
    print(
        f"retention, {deleted:,} published rows: batched DELETE ({batch} a round) "
        f"{batched:.2f} s ({deleted / batched:,.0f} rows/s); DROP PARTITION {dropped:.3f} s"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench mysql")
    sub = parser.add_subparsers(dest="what", required=True)
    relay_args = sub.add_parser("relay")
    relay_args.add_argument("--events", type=int, default=100_000)
    relay_args.add_argument("--rounds", type=int, default=2)
    relay_args.add_argument("--batch", type=int, default=500)
    write_args = sub.add_parser("write")
    write_args.add_argument("--seconds", type=float, default=10.0)
    write_args.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    write_args.add_argument("--rounds", type=int, default=3)
    retention_args = sub.add_parser("retention")
    retention_args.add_argument("--events", type=int, default=100_000)
    retention_args.add_argument("--batch", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.what == "retention":
        retention(args.events, args.batch)
        return 0
    if args.what == "write":
        write(args.seconds, args.threads, args.rounds)
        return 0
    for n in range(args.rounds):
        got = relay_round(args.events, args.batch)
        print(
            f"relay round {n + 1}: {args.events:,} events, hand-written loop "
            f"{got['loop']:,.0f}/s, relay {got['relay']:,.0f}/s, ratio {got['ratio']:.2f}"
        )
    return 0
