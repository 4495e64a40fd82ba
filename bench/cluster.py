"""What a Redis Cluster buys the relay, measured in one run (``python -m bench relay
--cluster``, or ``python -m bench cluster``).

Each variant preloads ``--events`` events (4 topics, 1,000 keys, ~300-byte entries) into a
fresh PostgreSQL schema and times ``outbox-relay run`` processes emptying it, from the first
entry they publish to the last (start-up excluded), as ``bench relay`` does:

  (1) one relay  -> one Redis (a private master with one replica)
  (2) one relay  -> a 3-master cluster (3 replicas)
  (3) two relays -> the same cluster
  and (1)-(3) again with ``--wait-replicas 1`` (a receipt only once a replica has the batch).

Both targets are private servers this benchmark starts (``redis-server`` on free ports, the
cluster with ``redis-cli --cluster create``), so every variant has a replica to wait for.
The cluster's streams are hash-tagged (``prefix.{topic}``): one slot per topic stream.

Besides rates it prints the ratio to (1) and the per-event CPU cost: CPU seconds used by the
relay processes and by every redis-server while the variant ran, divided by the events. On a
2-core machine the ceiling is the CPU, not Redis: the cluster's gain shows in how the cost
per event moves, and it shows as throughput only on machines with cores to spare.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from bench.procstat import cpu_seconds
from bench.relay import DEFAULT_PG, TOPICS, Place, place, preload, relay_processes


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MasterWithReplica:
    """One ``redis-server`` and its replica (``--replicaof``), no persistence."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="bench-redis-")
        self.ports = [_free_port(), _free_port()]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> MasterWithReplica:
        for i, port in enumerate(self.ports):
            command = [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.directory,
                "--dbfilename",
                f"dump-{port}.rdb",
            ]
            if i:
                command += ["--replicaof", "127.0.0.1", str(self.ports[0])]
            self.procs.append(
                subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        replica = redis.Redis(port=self.ports[1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if replica.info("replication").get("master_link_status") == "up":
                    return self
            time.sleep(0.1)
        raise SystemExit("the private Redis replica did not connect")

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def client(self) -> Any:
        return redis.Redis.from_url(self.url)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class Result:
    name: str
    events: int
    seconds: float
    relay_cpu: float
    redis_cpu: float
    master_cpu: float

    @property
    def rate(self) -> float:
        return self.events / self.seconds


def stream_total(client: Any, where: Place, tagged: bool) -> int:
    return sum(int(client.xlen(stream_name(where, t, tagged))) for t in TOPICS)


def stream_name(where: Place, topic: str, tagged: bool) -> str:
    return f"{where.prefix}.{{{topic}}}" if tagged else f"{where.prefix}.{topic}"


def run_variant(
    name: str,
    args: argparse.Namespace,
    client: Any,
    redis_url: str,
    redis_pids: list[int],
    master_pids: list[int],
    relays: int,
    extra: list[str],
    tagged: bool,
) -> Result:
    n = args.events
    with place(args.database_url, client, name.split()[0].strip("()")) as where:
        preload(where, n)
        template = f"{where.prefix}.{{{{{{topic}}}}}}" if tagged else where.template
        argv = [
            sys.executable,
            "-m",
            "relay",
            "run",
            "--database-url",
            where.url,
            "--redis-url",
            redis_url,
            "--stream",
            template,
            "--batch-size",
            str(args.batch_size),
            *extra,
        ]
        with relay_processes(argv, relays) as procs:
            deadline = time.monotonic() + 60
            while stream_total(client, where, tagged) == 0:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    codes = [p.poll() for p in procs]
                    raise SystemExit(f"{name}: the relay published nothing (exit codes {codes})")
                time.sleep(0.002)
            start = time.perf_counter()
            first = stream_total(client, where, tagged)
            relay_cpu0 = sum(cpu_seconds(p.pid, children=True) for p in procs)
            redis_cpu0 = sum(cpu_seconds(pid, children=True) for pid in redis_pids)
            master_cpu0 = sum(cpu_seconds(pid, children=True) for pid in master_pids)
            deadline = time.monotonic() + 600
            while (seen := stream_total(client, where, tagged)) < n:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: only {seen} of {n} published after 600 s")
                time.sleep(0.01)
            elapsed = time.perf_counter() - start
            relay_cpu = sum(cpu_seconds(p.pid, children=True) for p in procs) - relay_cpu0
            redis_cpu = sum(cpu_seconds(pid, children=True) for pid in redis_pids) - redis_cpu0
            master_cpu = sum(cpu_seconds(pid, children=True) for pid in master_pids) - master_cpu0
    result = Result(name, seen - first, elapsed, relay_cpu, redis_cpu, master_cpu)
    extra_entries = f" ({seen - n} more entries than events!)" if seen > n else ""
    print(
        f"  {name:<40} {result.events:>7} in {elapsed:6.2f} s = {result.rate:>8,.0f}/s  "
        f"cpu/event: relay {1e6 * relay_cpu / max(result.events, 1):5.1f} us, "
        f"redis {1e6 * redis_cpu / max(result.events, 1):5.1f} us "
        f"(masters {1e6 * master_cpu / max(result.events, 1):5.1f} us){extra_entries}",
        flush=True,
    )
    return result


@contextlib.contextmanager
def targets() -> Iterator[tuple[MasterWithReplica, Any]]:
    try:
        from tests.cluster_support import PrivateCluster
    except ImportError as exc:  # pragma: no cover - bench runs from the checkout
        raise SystemExit(f"run from the checkout (tests/cluster_support.py): {exc}") from None
    single = MasterWithReplica().start()
    cluster = PrivateCluster()
    try:
        cluster.start()
        yield single, cluster
    finally:
        cluster.close()
        single.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench cluster", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--database-url", default=DEFAULT_PG, help="PostgreSQL (a schema per run)")
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--no-wait", action="store_true", help="skip the --wait-replicas 1 variants"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds of every variant; medians are reported"
    )
    args = parser.parse_args(argv)
    runs: dict[str, list[Result]] = {}
    with targets() as (single, cluster):
        single_client = single.client()
        cluster_client = RedisCluster.from_url(cluster.url)
        cluster_pids = [node.process.pid for node in cluster.nodes if node.process is not None]
        master_pids = [node.process.pid for node in cluster.masters() if node.process is not None]
        print(
            f"relay -> one Redis vs a 3-master cluster: {args.events} events preloaded, "
            f"batch {args.batch_size}, {os.cpu_count()} cores",
            flush=True,
        )
        waits: list[list[str]] = [[]] if args.no_wait else [[], ["--wait-replicas", "1"]]
        for _round in range(max(1, args.repeat)):
            for wait in waits:
                label = " +wait 1" if wait else ""
                name = f"(1) 1 relay, 1 Redis{label}"
                runs.setdefault(name, []).append(
                    run_variant(
                        name,
                        args,
                        single_client,
                        single.url,
                        single.pids(),
                        single.pids()[:1],
                        1,
                        wait,
                        tagged=False,
                    )
                )
                for count in (1, 2):
                    name = f"({count + 1}) {count} relay{'s' if count > 1 else ''}, cluster{label}"
                    runs.setdefault(name, []).append(
                        run_variant(
                            name,
                            args,
                            cluster_client,
                            cluster.url,
                            cluster_pids,
                            master_pids,
                            count,
                            ["--redis-cluster", *wait],
                            tagged=True,
                        )
                    )
        single_client.close()
        cluster_client.close()
    medians = {name: _median(rounds) for name, rounds in runs.items()}
    base = next(iter(medians.values()))
    print(f"medians of {max(1, args.repeat)} round(s); ratios to (1) 1 relay, 1 Redis (same run):")
    for name, (rate, relay_us, redis_us, master_us) in medians.items():
        print(
            f"  {name:<40} {rate:>8,.0f}/s  x{rate / base[0]:4.2f}   cpu/event: relay "
            f"{relay_us:5.1f} us + redis {redis_us:5.1f} us (masters {master_us:4.1f}) = "
            f"{relay_us + redis_us:5.1f} us"
        )
    return 0


def _median(rounds: list[Result]) -> tuple[float, float, float, float]:
    """Median rate and per-event CPU (microseconds) of a variant's rounds."""
    return (
        statistics.median(r.rate for r in rounds),
        statistics.median(1e6 * r.relay_cpu / max(r.events, 1) for r in rounds),
        statistics.median(1e6 * r.redis_cpu / max(r.events, 1) for r in rounds),
        statistics.median(1e6 * r.master_cpu / max(r.events, 1) for r in rounds),
    )
