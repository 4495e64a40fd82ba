"""What the console reads of a NATS JetStream broker (``--broker-url nats://...``), in the
shape it reads from Redis: a message by its sequence (the trace's stream entry, ``XRANGE
id id``) and the groups of a stream (the overview, ``XINFO GROUPS``)."""

from __future__ import annotations

import json
from typing import Any

from outbox.nats_client import NatsClient, jetstream_name


class NatsConsoleView:
    """The console's reads on NATS (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.client = NatsClient(url, name="outbox-console")

    def xrange(self, stream: str, min: str, max: str, count: int = 1) -> list[tuple[str, Any]]:
        """The message of ``stream`` at sequence ``min`` (a receipt), or nothing."""
        if not (str(min).isascii() and str(min).isdigit()):
            return []

        async def get(js: Any) -> list[tuple[str, Any]]:
            try:
                msg = await js.get_msg(jetstream_name(stream), int(min))
            except self.client.nats.js.errors.NotFoundError:
                return []
            return [(str(min), json.loads(msg.data))]

        found: list[tuple[str, Any]] = self.client.run(get)
        return found

    def xinfo_groups(self, stream: str) -> list[dict[str, Any]]:
        """Each group (durable consumer) of ``stream``: lag, pending, last delivered."""

        async def groups(js: Any) -> list[dict[str, Any]]:
            out = []
            for info in await js.consumers_info(jetstream_name(stream)):
                out.append(
                    {
                        "name": info.name,
                        "consumers": info.num_waiting or 0,
                        "pending": info.num_ack_pending or 0,
                        "lag": info.num_pending or 0,
                        "last-delivered-id": str(info.delivered.stream_seq)
                        if info.delivered
                        else None,
                    }
                )
            return out

        found: list[dict[str, Any]] = self.client.run(groups)
        return found

    def xadd(self, stream: str, fields: dict[str, str]) -> str:
        """A dead-letter replay (:meth:`outbox.nats_client.NatsClient.xadd`)."""
        return self.client.xadd(stream, fields)

    def close(self) -> None:
        self.client.close()


__all__ = ["NatsConsoleView"]
