"""What stream retention costs per XADD: ``python -m bench trim [--events N] [--batch N]``.

The relay's publish script (one EVAL per batch) against one Redis, side by side in one run:

(a) no trimming;
(b) ``MINID ~`` at the default retention (one day), two consumer groups on the stream, their
    floor (XINFO GROUPS + XPENDING) cached for 10 s: the relay's default;
(c) the same, the floor read before every batch (what caching saves);
(d) ``MINID ~`` with a 1 s retention and no group, so entries are trimmed as it goes;
(e) ``MAXLEN ~ 10000`` (the opt-in count-based trimming).

Prints microseconds per XADD and the ratio to (a). Entries are ~300-byte payloads like the
relay bench's; keys under ``bench:trim:`` are deleted afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import redis

from relay.records import Record
from relay.redis.publisher import RedisStreamPublisher

PAYLOAD = '{"quote": "q-0000", "total": 120, "lines": [' + ",".join(["1"] * 120) + "]}"


def records(n: int, topic: str) -> list[Record]:
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(now))
    return [
        Record(i, str(uuid.uuid4()), topic, f"k{i % 64}", i % 64, None, f"id-{i}",
               PAYLOAD, None, stamp, now, 0)
        for i in range(n)
    ]  # fmt: skip


def run(
    client: redis.Redis,
    name: str,
    n: int,
    batch: int,
    *,
    retention: float,
    ttl: float = 10.0,
    maxlen: int | None = None,
    groups: int = 0,
) -> float:
    prefix = f"bench:trim:{uuid.uuid4().hex[:8]}"
    topic = "t"
    stream = f"{prefix}.{topic}"
    publisher = RedisStreamPublisher(
        client, f"{prefix}.{{topic}}", maxlen, stream_retention=retention, trim_floor_ttl=ttl
    )
    for g in range(groups):
        client.xgroup_create(stream, f"g{g}", id="$", mkstream=True)
    work = records(n, topic)
    prepared = [publisher.prepare(r) for r in work]
    started = time.perf_counter()
    for start in range(0, n, batch):
        results = publisher.publish(prepared[start : start + batch])
        assert all(isinstance(r, str) for r in results), results[:1]
    took = time.perf_counter() - started
    length = client.xlen(stream)
    client.delete(stream, publisher.marker_key)
    per = took / n * 1e6
    print(
        f"  {name:<44} {n} XADDs in {took:6.2f} s = {per:6.2f} us each"
        f"  (stream length after: {length}, floor reads: {publisher.trim.refreshes})"
    )
    return per


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench trim", description=__doc__)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    client = redis.Redis.from_url(args.redis_url)
    n, batch = args.events, args.batch
    print(
        f"stream retention cost per XADD, batch {batch}, {n} entries per variant, "
        f"{args.rounds} rounds interleaved (medians; the machine's load is the noise)"
    )
    run(client, "warm-up", min(n, 5000), batch, retention=0)
    variants = {
        "a": ("(a) no trimming", {"retention": 0}),
        "b": ("(b) MINID ~ 1 day, 2 groups, floor cached 10s", {"retention": 86400, "groups": 2}),
        "c": ("(c) MINID ~ 1 day, 2 groups, floor every batch",
              {"retention": 86400, "ttl": 0, "groups": 2}),
        "d": ("(d) MINID ~ 1 s (trims as it goes)", {"retention": 1}),
        "e": ("(e) MAXLEN ~ 10000", {"retention": 0, "maxlen": 10_000}),
    }  # fmt: skip
    samples: dict[str, list[float]] = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, (name, options) in variants.items():
            samples[key].append(run(client, name, n, batch, **options))  # type: ignore[arg-type]
    figures = {key: statistics.median(values) for key, values in samples.items()}
    print("medians, and ratios against (a) in the same run:")
    for key, value in figures.items():
        print(f"  {variants[key][0]:<48} {value:6.2f} us/XADD  ({value / figures['a']:.2f})")
    return 0
