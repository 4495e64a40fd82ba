"""What the demo shows of its stream, on either broker: its length and its latest entries
(``outbox-relay demo --broker-url redis://...`` or ``nats://...``)."""

from __future__ import annotations

import json
from typing import Any

from outbox.nats_client import NatsClient, jetstream_name


class RedisView:
    """The demo's stream in Redis (``client``: a Redis or Redis Cluster client)."""

    def __init__(self, client: Any, stream: str) -> None:
        self.client = client
        self.stream = stream

    def exists(self) -> bool:
        return bool(self.client.exists(self.stream))

    def length(self) -> int:
        return int(self.client.xlen(self.stream))

    def latest(self, count: int) -> list[tuple[str, dict[str, str]]]:
        return [
            (entry_id.decode(), {k.decode(): v.decode() for k, v in fields.items()})
            for entry_id, fields in self.client.xrevrange(self.stream, count=count)
        ]

    def flush(self) -> None:
        """The embedded server is the demo's own: its stream, group and markers go."""
        self.client.flushdb()

    def close(self) -> None:
        self.client.close()


class NatsView:
    """The demo's stream in NATS JetStream (the relay's mapping: the subject is the stream
    name, the JetStream stream :func:`jetstream_name` of it)."""

    def __init__(self, url: str, stream: str) -> None:
        self.client = NatsClient(url, name="outbox-demo")
        self.stream = stream
        self.name = jetstream_name(stream)

    async def _info(self, js: Any) -> Any:
        try:
            return await js.stream_info(self.name)
        except self.client.nats.js.errors.NotFoundError:
            return None

    def exists(self) -> bool:
        info = self.client.run(self._info)
        return info is not None and info.state.messages > 0

    def length(self) -> int:
        info = self.client.run(self._info)
        return 0 if info is None else int(info.state.messages)

    def latest(self, count: int) -> list[tuple[str, dict[str, str]]]:
        async def read(js: Any) -> list[tuple[str, dict[str, str]]]:
            info = await self._info(js)
            if info is None:
                return []
            out: list[tuple[str, dict[str, str]]] = []
            seq = info.state.last_seq
            while seq >= max(1, info.state.first_seq) and len(out) < count:
                try:
                    msg = await js.get_msg(self.name, seq)
                except self.client.nats.js.errors.NotFoundError:
                    seq -= 1
                    continue
                out.append((str(seq), json.loads(msg.data)))
                seq -= 1
            return out

        result: list[tuple[str, dict[str, str]]] = self.client.run(read)
        return result

    def flush(self) -> None:
        """Nothing: the demo never deletes a NATS stream (the server is the user's)."""

    def close(self) -> None:
        self.client.close()


__all__ = ["NatsView", "RedisView"]
