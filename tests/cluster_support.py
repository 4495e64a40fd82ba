"""A real Redis Cluster for tests: 3 masters and 3 replicas of ``redis-server`` on free ports.

:class:`PrivateCluster` starts six ``redis-server --cluster-enabled yes`` children (each in a
temporary directory, client and cluster-bus ports chosen free), joins them with
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`` and waits until every
node reports ``cluster_state:ok``, agrees on the slot map and every replica's link is up
(``WAIT 1`` would otherwise time out at the start). ``close()`` kills them and removes the
directories.

Fixtures (registered in ``conftest.py`` through ``pytest_plugins``):

- ``redis_cluster``: one cluster for the whole session (the suite pays the ~3 s start once).
  Tests use it like the shared Redis: keys under their ``stream_prefix``, never a node
  stopped, never a slot moved.
- ``private_cluster``: a cluster of the test's own, for tests that kill a master or move
  slots.
- ``redis_target``: parametrised ``"single"`` / ``"cluster"``: a :class:`RedisTarget` with the
  URL, whether it is a cluster, and a client factory, so a guarantee test runs on both.

``cluster-node-timeout`` is 1,500 ms: a killed master's replica is promoted within ~2-4 s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from tests.services import wait_for

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from services import free_port
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.services import free_port

NODE_TIMEOUT_MS = 1500


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class ClusterNode:
    """One ``redis-server`` of the cluster: restartable on its ports with its nodes.conf."""

    def __init__(self, port: int, bus_port: int, directory: str) -> None:
        self.port = port
        self.bus_port = bus_port
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        command = [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(self.port),
            "--cluster-port",
            str(self.bus_port),
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "no",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            # A replica that lost contact with its master for a while may still be promoted:
            # the tests kill masters on purpose and want the failover, not a down cluster.
            "--cluster-replica-validity-factor",
            "0",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.directory,
            "--logfile",
            os.path.join(self.directory, "redis.log"),
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(
            self._answers, f"redis-server {self.port} to answer", 15, ignore=(redis.RedisError,)
        )

    def _answers(self) -> bool:
        """Whether the node answers PING; a node whose process has exited never will."""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"redis-server {self.port} exited: {self.log()}")
        return bool(self.client().ping())

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: a crash (no AOF here, so its data is gone with it)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log"), errors="replace") as handle:
                return handle.read()[-3000:]
        except OSError:
            return ""


class PrivateCluster:
    """3 masters + 3 replicas (``masters``/``replicas_per_master`` to change), started by
    ``start()`` (or ``with``) and removed by ``close()``."""

    def __init__(self, masters: int = 3, replicas_per_master: int = 1) -> None:
        self.directory = tempfile.mkdtemp(prefix="private-cluster-")
        count = masters * (1 + replicas_per_master)
        ports = _free_ports(2 * count)
        self.nodes = [
            ClusterNode(ports[2 * i], ports[2 * i + 1], os.path.join(self.directory, str(i)))
            for i in range(count)
        ]
        for node in self.nodes:
            os.makedirs(node.directory)
        self.replicas_per_master = replicas_per_master

    @property
    def url(self) -> str:
        """A seed URL (the first node that is up)."""
        for node in self.nodes:
            if node.alive():
                return f"redis://{node.address}/0"
        raise RuntimeError("no node of the cluster is running")

    @property
    def cluster_url(self) -> str:
        return self.url.replace("redis://", "redis+cluster://", 1)

    def start(self) -> PrivateCluster:
        for node in self.nodes:
            node.start()
        created = subprocess.run(
            [
                shutil.which("redis-cli") or "redis-cli",
                "--cluster",
                "create",
                *[node.address for node in self.nodes],
                "--cluster-replicas",
                str(self.replicas_per_master),
                "--cluster-yes",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout.decode()}")
        self.wait_healthy()
        return self

    def client(self, **kwargs: Any) -> RedisCluster:
        kwargs.setdefault("socket_timeout", 5)
        return RedisCluster.from_url(self.url, **kwargs)

    # -- state --------------------------------------------------------------------------------

    def topology(self) -> list[dict[str, Any]]:
        """CLUSTER NODES as seen by a live node: id, address, role, master id, slots."""
        for node in self.nodes:
            if not node.alive():
                continue
            with contextlib.suppress(redis.RedisError):
                return _parse_nodes(_raw(node.client(), "CLUSTER", "NODES"))
        raise RuntimeError("no live node answers CLUSTER NODES")

    def node_at(self, port: int) -> ClusterNode:
        return next(node for node in self.nodes if node.port == port)

    def masters(self) -> list[ClusterNode]:
        """Live masters that serve slots."""
        ports = [
            n["port"]
            for n in self.topology()
            if "master" in n["flags"] and n["slots"] and "fail" not in n["flags"]
        ]
        return [self.node_at(port) for port in ports]

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        """The live replicas of ``master``."""
        nodes = self.topology()
        master_id = next(n["id"] for n in nodes if n["port"] == master.port)
        return [
            self.node_at(n["port"])
            for n in nodes
            if n["master"] == master_id and "fail" not in n["flags"]
        ]

    def master_of(self, key: str) -> ClusterNode:
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for n in self.topology():
            if "master" in n["flags"] and "fail" not in n["flags"]:
                for low, high in n["slots"]:
                    if low <= slot <= high:
                        return self.node_at(n["port"])
        raise RuntimeError(f"no master serves slot {slot}")

    def wait_healthy(self, timeout: float = 60.0, *, replicas: bool = True) -> None:
        """Every live node says ``cluster_state:ok`` and sees the same slot owners; with
        ``replicas`` every live replica's link to its master is up."""
        wait_for(
            lambda: self._healthy(replicas),
            "the cluster to be healthy",
            timeout,
            0.1,
            ignore=(redis.RedisError,),
        )

    def _healthy(self, replicas: bool) -> bool:
        views: set[str] = set()
        for node in self.nodes:
            if not node.alive():
                continue
            client = node.client()
            try:
                if "cluster_state:ok" not in _raw(client, "CLUSTER", "INFO"):
                    return False
                nodes = _parse_nodes(_raw(client, "CLUSTER", "NODES"))
                owners = sorted(
                    (tuple(map(tuple, n["slots"])), n["port"])
                    for n in nodes
                    if "master" in n["flags"] and n["slots"]
                )
                views.add(repr(owners))
                if replicas:
                    role = client.info("replication")
                    if role.get("role") == "slave" and role.get("master_link_status") != "up":
                        return False
            finally:
                client.close()
        return len(views) == 1

    # -- faults -------------------------------------------------------------------------------

    def kill_master_of(self, key: str) -> ClusterNode:
        """SIGKILL the master serving ``key``'s slot; its replica takes over after the node
        timeout. Returns the killed node (``restart`` rejoins it as a replica)."""
        node = self.master_of(key)
        node.kill()
        return node

    def wait_failover(self, victim: ClusterNode, key: str, timeout: float = 30.0) -> ClusterNode:
        """Wait until a replica has taken over ``key``'s slot from the dead ``victim``
        (the node timeout plus an election) and every live node agrees; returns the new
        master. Restart the victim only after this: a master that restarts empty before its
        replica is promoted wipes the replica too (it resyncs from the empty master)."""
        deadline = time.monotonic() + timeout
        master = wait_for(
            lambda: (m := self.master_of(key)).port != victim.port and m,
            f"a replica to take over from {victim.address}",
            timeout,
            0.1,
            ignore=(redis.RedisError, RuntimeError, StopIteration),
        )
        self.wait_healthy(max(1.0, deadline - time.monotonic()), replicas=False)
        return master

    def restart(self, node: ClusterNode) -> None:
        node.start()

    def reshard(self, source: ClusterNode, target: ClusterNode, slots: int) -> str:
        """``redis-cli --cluster reshard``: move ``slots`` slots from ``source`` to
        ``target`` with their keys (MIGRATE), as an operator does under load."""
        ids = {n["port"]: n["id"] for n in self.topology()}
        done = subprocess.run(
            [
                shutil.which("redis-cli") or "redis-cli",
                "--cluster",
                "reshard",
                source.address,
                "--cluster-from",
                ids[source.port],
                "--cluster-to",
                ids[target.port],
                "--cluster-slots",
                str(slots),
                "--cluster-yes",
                "--cluster-pipeline",
                "100",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=120,
            check=False,
        )
        output = done.stdout.decode(errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"reshard failed: {output[-2000:]}")
        return output

    def migrate_slot(
        self, slot: int, source: ClusterNode, target: ClusterNode, pause: float = 0.5
    ) -> int:
        """Move one slot with its keys from ``source`` to ``target`` the way ``redis-cli
        --cluster reshard`` does, one step at a time: IMPORTING/MIGRATING, ``pause`` seconds
        with the slot half-moved (clients get TRYAGAIN/ASK), MIGRATE of every key, then the
        new owner announced to every master. Returns how many keys moved."""
        ids = {n["port"]: n["id"] for n in self.topology()}
        src, dst = source.client(), target.client()
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port])
        # The scenario itself, not a wait: the slot stays half-moved for ``pause`` seconds
        # under load, and writers and readers run into it (TRYAGAIN/ASK) meanwhile.
        time.sleep(pause)
        moved = 0
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 10000, "KEYS", *keys)
            moved += len(keys)
        for node in (target, source, *self.masters()):
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])
        return moved

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raw(client: redis.Redis, *command: str) -> str:
    """A command's reply as the server's text (redis-py parses CLUSTER NODES/INFO into
    dicts that drop the flags the tests read)."""
    conn = client.connection_pool.get_connection()
    try:
        conn.send_command(*command)
        reply = conn.read_response()
    finally:
        client.connection_pool.release(conn)
        client.close()
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _parse_nodes(text: str) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = []
    for line in text.strip().splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        address = parts[1].split("@", 1)[0]
        slots: list[tuple[int, int]] = []
        for part in parts[8:]:
            if part.startswith("["):
                continue  # a slot being migrated or imported
            low, _, high = part.partition("-")
            slots.append((int(low), int(high or low)))
        nodes.append(
            {
                "id": parts[0],
                "port": int(address.rsplit(":", 1)[1]),
                "flags": parts[2].split(","),
                "master": parts[3],
                "slots": slots,
            }
        )
    return nodes


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[PrivateCluster]:
    """One 3+3 cluster for the session: never stop a node or move slots in it."""
    cluster = PrivateCluster().start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def private_cluster() -> Iterator[PrivateCluster]:
    """A 3+3 cluster of this test's own: kill masters and move slots freely."""
    cluster = PrivateCluster().start()
    try:
        yield cluster
    finally:
        cluster.close()


@dataclass(frozen=True)
class RedisTarget:
    """Where a parametrised test publishes: the shared Redis or the session cluster."""

    name: str
    url: str
    cluster: bool
    connect: Callable[[], Any]

    @property
    def extra_args(self) -> list[str]:
        """Command-line flags besides ``--redis-url`` that point a process at this target."""
        return ["--redis-cluster"] if self.cluster else []

    @property
    def consumer_url(self) -> str:
        """The URL a Consumer is given (``redis+cluster://`` on the cluster)."""
        return self.url.replace("redis://", "redis+cluster://", 1) if self.cluster else self.url

    def hash_tagged(self, template: str) -> str:
        """``template`` with its topic made a hash tag on the cluster (one slot per stream,
        as the README advises); unchanged on one node."""
        if not self.cluster or "{{" in template:
            return template
        return template.replace("{topic}", "{{{topic}}}")


def target_for(
    request: pytest.FixtureRequest, kind: str, stream_prefix: str
) -> Iterator[RedisTarget]:
    """The :class:`RedisTarget` ``kind`` (``"single"``: the shared Redis; ``"cluster"``: the
    session cluster); the test's keys (under ``stream_prefix``) are deleted afterwards."""
    if kind == "single":
        url = str(request.getfixturevalue("redis_url"))
        target = RedisTarget("single", url, False, lambda: redis.Redis.from_url(url))
    elif kind == "cluster":
        cluster: PrivateCluster = request.getfixturevalue("redis_cluster")
        seed = cluster.url
        target = RedisTarget("cluster", seed, True, lambda: RedisCluster.from_url(seed))
    else:
        raise ValueError(f"unknown Redis target {kind!r}")
    yield target
    client = target.connect()
    try:
        for key in list(client.scan_iter(match=f"*{stream_prefix}*", count=1000)):
            client.delete(key)
    finally:
        client.close()


# The cluster case runs in the whole suite (CI), not in the fast tier: the cluster costs seconds
# to start on each xdist worker.
@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.slow)])
def redis_target(request: pytest.FixtureRequest, stream_prefix: str) -> Iterator[RedisTarget]:
    """Parametrise a guarantee test over one Redis server and a Redis Cluster."""
    yield from target_for(request, str(request.param), stream_prefix)
