"""What a handler receives, and how a stream entry becomes one.

The entry format and its decoding rules live in :mod:`outbox.codec` (the relay encodes with
the same module). An entry that fails to decode raises :class:`~consumer.errors.UndecodableEntry`
naming the field, and the consumer dead-letters that entry at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from consumer.errors import UndecodableEntry
from outbox import codec
from outbox.codec import HEADER_PREFIX, encode_entry, text_fields

__all__ = ["HEADER_PREFIX", "ConsumedEvent", "decode_entry", "encode_entry", "text_fields"]


@dataclass(frozen=True)
class ConsumedEvent:
    """One event read from a stream, as a handler sees it."""

    id: str
    type: str
    subject: str | None
    tenant: str | None
    identity: str
    data: Any
    headers: Mapping[str, str]
    stream: str
    entry_id: str
    deliveries: int
    time: datetime | None = None
    source: str | None = None
    partition_key: str | None = None
    traceparent: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Every field of the entry, decoded as text (for tools and dead letters)."""


def decode_entry(
    stream: str, entry_id: str, raw: Mapping[Any, Any] | None, deliveries: int
) -> ConsumedEvent:
    """Decode one stream entry (:func:`outbox.codec.decode`) or raise UndecodableEntry naming
    the field."""
    d = codec.decode(raw, UndecodableEntry)
    return ConsumedEvent(
        id=d.id,
        type=d.type,
        subject=d.subject,
        tenant=d.tenant,
        identity=d.identity,
        data=d.data,
        headers=d.headers,
        stream=stream,
        entry_id=entry_id,
        deliveries=deliveries,
        time=d.time,
        source=d.source,
        partition_key=d.partition_key,
        traceparent=d.traceparent,
        fields=d.fields,
    )
