"""Trimming a stream by time (``XADD ... MINID ~``) without dropping what a consumer group
still needs: :class:`StreamTrim`, which :class:`relay.redis.publisher.RedisStreamPublisher`
asks for each batch's MINIDs (measured with ``python -m bench trim``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from outbox.errors import ConfigError
from outbox.validate import check_number
from relay.records import entry_id_key

DEFAULT_STREAM_RETENTION = 24 * 3600.0
"""Seconds of entries a stream keeps (``MINID ~``), like the outbox's own retention."""


class StreamTrim:
    """The MINID each stream is trimmed to: ``XADD ... MINID ~ <id>`` drops entries older
    than ``retention_seconds`` (Redis clock ids are milliseconds, compared with this host's
    clock: retention is hours, skew is not), except what a consumer group still needs.

    A group needs its pending entries (delivered, not acknowledged: XPENDING's smallest id)
    and everything after its last-delivered id. The floor per stream costs one XINFO GROUPS
    plus one XPENDING per group with pending entries, all pipelined, and is cached for
    ``floor_ttl`` seconds: a group's floor only moves forward, and within the cache window
    the retention cutoff moves by seconds out of hours, so nothing it protects can be
    trimmed meanwhile. (A group created during the window, at ``0`` on a stream holding
    entries older than the retention, is the exception: it may miss those for up to
    ``floor_ttl`` seconds; such entries were due for trimming anyway.) Measured with
    ``python -m bench trim``. ``retention_seconds`` None or 0: no time-based trimming.
    """

    def __init__(
        self,
        client: Any,
        retention_seconds: float | None,
        floor_ttl: float = 10.0,
        clock: Any = time.time,
    ) -> None:
        if retention_seconds is not None:
            check_number("stream_retention", retention_seconds, ConfigError, zero=True)
        self.client = client
        self.retention_seconds = float(retention_seconds or 0.0)
        self.floor_ttl = float(floor_ttl)
        self.refreshes = 0
        """Rounds of XINFO GROUPS/XPENDING run (cache misses), for the benchmark."""
        self._clock = clock
        self._floors: dict[str, tuple[float, tuple[int, int] | None]] = {}

    def minids(self, streams: Sequence[str]) -> dict[str, str]:
        """Stream -> MINID for the streams of one batch (empty: no trimming)."""
        if self.retention_seconds <= 0:
            return {}
        now = time.monotonic()
        due = [s for s in streams if self._floors.get(s, (-1.0, None))[0] <= now]
        if due:
            self._refresh(due, now + self.floor_ttl)
        cutoff = (int((self._clock() - self.retention_seconds) * 1000), 0)
        out: dict[str, str] = {}
        for stream in streams:
            floor = self._floors[stream][1]
            ms, seq = cutoff if floor is None or cutoff <= floor else floor
            out[stream] = "0" if ms <= 0 else f"{ms}-{seq}"
        return out

    # complexity: one branch per trimming mode and stream state (owner: nats, issue 40)
    def _refresh(self, streams: Sequence[str], until: float) -> None:
        self.refreshes += 1
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        replies = pipe.execute(raise_on_error=False)
        floors: dict[str, tuple[int, int] | None] = {}
        pending: list[tuple[str, str]] = []
        for stream, groups in zip(streams, replies, strict=True):
            if isinstance(groups, ResponseError):
                floors[stream] = None  # no such stream yet: no group needs anything
                continue
            if isinstance(groups, Exception):
                raise groups
            floor: tuple[int, int] | None = None
            for group in groups:
                delivered = entry_id_key(_text(group.get("last-delivered-id")))
                floor = delivered if floor is None else min(floor, delivered)
                if int(group.get("pending") or 0) > 0:
                    pending.append((stream, _text(group.get("name"))))
            floors[stream] = floor
        if pending:
            pipe = self.client.pipeline(transaction=False)
            for stream, name in pending:
                pipe.xpending(stream, name)
            for (stream, _name), summary in zip(pending, pipe.execute(), strict=True):
                oldest = summary.get("min") if isinstance(summary, dict) else None
                if oldest is not None:
                    key = entry_id_key(_text(oldest))
                    current = floors[stream]
                    floors[stream] = key if current is None else min(current, key)
        for stream, floor in floors.items():
            self._floors[stream] = (until, floor)
        if len(self._floors) > 10_000:
            self._floors = {s: v for s, v in self._floors.items() if v[0] > time.monotonic()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["DEFAULT_STREAM_RETENTION", "StreamTrim"]
