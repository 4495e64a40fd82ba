"""The brokers the contract suite (tests/test_brokers.py) runs on: the shared Redis, the
session's Redis Cluster and the shared NATS JetStream. A :class:`BrokerKit` makes a broker
for a test's own streams (under ``stream_prefix``), reads a stream back in order, makes the
broker lose a stream, and removes the test's streams afterwards."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from outbox.nats_client import NatsClient, jetstream_name
from relay.broker import Broker, broker_for

NATS_URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")


@dataclass
class BrokerKit:
    """One broker under test (see the module docstring)."""

    name: str
    url: str
    prefix: str
    cluster: bool = False
    made: list[Broker] = field(default_factory=list)

    @property
    def template(self) -> str:
        """The test's stream template (a hash tag per topic on the cluster)."""
        if self.cluster:
            return f"{self.prefix}.{{{{{{topic}}}}}}"
        return f"{self.prefix}.{{topic}}"

    def stream(self, topic: str) -> str:
        return self.template.replace("{{", "{").replace("}}", "}").replace("{topic}", topic)

    def make(self, **options: Any) -> Broker:
        options.setdefault("stream_template", self.template)
        broker = broker_for(self.url, cluster=self.cluster, **options)
        self.made.append(broker)
        return broker

    # -- reading and breaking ---------------------------------------------------------------

    def read(self, stream: str) -> list[dict[str, str]]:
        """The entries of ``stream`` in order, as field dicts (``id`` is the event id)."""
        if self.name == "nats":
            return _nats_read(stream, self.url)
        client = self._redis()
        try:
            return [
                {k.decode(): v.decode() for k, v in fields.items()}
                for _id, fields in client.xrange(stream)
            ]
        except redis.ResponseError:
            return []
        finally:
            client.close()

    def ids(self, stream: str) -> list[str]:
        return [e["id"] for e in self.read(stream)]

    def length(self, stream: str) -> int:
        """How many entries ``stream`` holds (0: no such stream), without reading them."""
        if self.name == "nats":
            return _nats_length(stream, self.url)
        client = self._redis()
        try:
            return int(client.xlen(stream))
        finally:
            client.close()

    def lose(self, stream: str) -> None:
        """The broker loses ``stream``: on NATS the JetStream stream is deleted; on Redis
        every key of this test goes (the stream and the relay's markers and fences: what a
        FLUSHALL or an empty restart does to them, on the shared server)."""
        if self.name == "nats":
            _nats_run(lambda js: js.delete_stream(jetstream_name(stream)), url=self.url)
            return
        client = self._redis()
        try:
            for key in [stream, *client.scan_iter(match=f"*{self.prefix}*", count=1000)]:
                client.delete(key)
        finally:
            client.close()

    def _redis(self) -> Any:
        if self.cluster:
            return redis.RedisCluster.from_url(self.url)
        return redis.Redis.from_url(self.url)

    def cleanup(self) -> None:
        for broker in self.made:
            with contextlib.suppress(Exception):
                broker.close()
        if self.name == "nats":
            _nats_delete_prefixed(self.prefix, self.url)
            return
        client = self._redis()
        try:
            for key in list(client.scan_iter(match=f"*{self.prefix}*", count=1000)):
                client.delete(key)
        finally:
            client.close()


def _nats_run(step: Callable[[Any], Any], timeout: float = 10.0, url: str = NATS_URL) -> Any:
    client = NatsClient(url, timeout=timeout)
    try:

        async def call(js: Any) -> Any:
            return await step(js)

        return client.run(call)
    finally:
        client.close()


def _nats_read(stream: str, url: str = NATS_URL) -> list[dict[str, str]]:
    name = jetstream_name(stream)

    async def read(js: Any) -> list[dict[str, str]]:
        from nats.js.errors import NotFoundError

        try:
            info = await js.stream_info(name)
        except NotFoundError:
            return []
        out: list[dict[str, str]] = []
        if not info.state.messages:  # a new stream's first_seq is 0, which get_msg refuses
            return out
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(name, seq)
            except NotFoundError:
                continue
            if msg.subject == stream:
                out.append(json.loads(msg.data))
        return out

    result: list[dict[str, str]] = _nats_run(read, timeout=60.0, url=url)
    return result


def _nats_length(stream: str, url: str = NATS_URL) -> int:
    async def length(js: Any) -> int:
        from nats.js.errors import NotFoundError

        try:
            info = await js.stream_info(jetstream_name(stream))
        except NotFoundError:
            return 0
        return int(info.state.messages)

    result: int = _nats_run(length, url=url)
    return result


def _nats_delete_prefixed(prefix: str, url: str = NATS_URL) -> None:
    async def delete(js: Any) -> None:
        names = [
            info.config.name
            for info in await js.streams_info()
            if info.config.name.startswith(jetstream_name(prefix))
        ]
        for name in names:
            await js.delete_stream(name)

    _nats_run(delete, url=url)


def nats_reachable() -> str:
    """The shared NATS's URL; a NATS that does not answer fails the test (never skips)."""
    try:
        _nats_run(lambda js: js.account_info(), timeout=5.0)
    except Exception as exc:  # pragma: no cover - environment problem
        pytest.fail(f"NATS JetStream is not reachable at {NATS_URL}: {exc}")
    return NATS_URL


def kit_for(request: pytest.FixtureRequest, kind: str, prefix: str) -> Iterator[BrokerKit]:
    if kind == "redis":
        kit = BrokerKit("redis", str(request.getfixturevalue("redis_url")), prefix)
    elif kind == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        kit = BrokerKit("cluster", cluster.url, prefix, cluster=True)
    elif kind == "nats":
        kit = BrokerKit("nats", nats_reachable(), prefix)
    else:
        raise ValueError(f"unknown broker {kind!r}")
    try:
        yield kit
    finally:
        kit.cleanup()


# The cluster case costs a six-node cluster per module: whole suite (CI) only, not the fast tier.
@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.slow), "nats"])
def broker_kit(request: pytest.FixtureRequest, stream_prefix: str) -> Iterator[BrokerKit]:
    """Parametrise a guarantee test over every broker."""
    yield from kit_for(request, str(request.param), stream_prefix)


@pytest.fixture
def nats_kit(request: pytest.FixtureRequest, stream_prefix: str) -> Iterator[BrokerKit]:
    yield from kit_for(request, "nats", stream_prefix)


@dataclass
class Restartable:
    """A broker on a private server of its own (``restartable_kit``): :meth:`restart` kills
    it (SIGKILL) and starts it again on the same port with what it had stored (Redis with
    its append-only file, ``appendfsync always``; NATS with its JetStream store)."""

    kit: BrokerKit
    restart: Callable[[], None]


@pytest.fixture(params=["redis", "nats"])
def restartable_kit(request: pytest.FixtureRequest, stream_prefix: str) -> Iterator[Restartable]:
    """Parametrise a reconnection case over every broker, each on a private server."""
    try:
        from services import PrivateNats, PrivateRedis
    except ImportError:  # pragma: no cover
        from tests.services import PrivateNats, PrivateRedis
    if request.param == "redis":
        with PrivateRedis(persistent=True) as server:
            kit = BrokerKit("redis", server.url, stream_prefix)
            yield Restartable(kit, lambda: server.restart(kill=True))
            kit.cleanup()
        return
    with PrivateNats() as nats:
        kit = BrokerKit("nats", nats.url, stream_prefix)

        def restart() -> None:
            nats.kill()
            nats.start()

        yield Restartable(kit, restart)
        kit.cleanup()
