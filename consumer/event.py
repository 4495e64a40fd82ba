"""What a handler receives, and how a stream entry becomes one.

The relay writes one flat hash per event in CloudEvents attribute names (see the README's
stream format): ``specversion``, ``id``, ``source``, ``type`` (topic), ``subject`` (key),
``time``, ``datacontenttype``, ``data`` (JSON text), and the extensions ``tenant``,
``identity``, ``partitionkey``, ``traceparent``; headers travel as ``header.<name>`` fields.

Decoding is strict where the consumer's guarantees depend on it and lenient elsewhere:
``id``, ``type`` and ``data`` are required, ``data`` must be JSON, and the identity (which
defaults to ``id``) must fit the inbox column; an unparseable ``time`` just reads as None.
Anything that fails raises :class:`~consumer.errors.UndecodableEntry` naming the field, and
the consumer dead-letters that entry at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from consumer.errors import UndecodableEntry

MAX_IDENTITY_LENGTH = 200
MAX_ID_LENGTH = 64
HEADER_PREFIX = "header."
REQUIRED = ("id", "type", "data")


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


def text_fields(raw: Mapping[Any, Any] | None) -> dict[str, str]:
    """The entry's fields as str -> str; bytes that are not UTF-8 are replaced (the caller
    learns of it through :func:`decode_entry`)."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for key, value in raw.items():
        k = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        v = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        out[k] = v
    return out


def _strict_text(raw: Mapping[Any, Any]) -> dict[str, str]:
    try:
        # The common case (a redis-py client returning bytes) in one comprehension: this
        # runs once per entry, tens of thousands of times a second.
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): (
                v.decode() if isinstance(v, bytes) else str(v)
            )
            for k, v in raw.items()
        }
    except UnicodeDecodeError:
        raise UndecodableEntry("fields", "a field name or value is not UTF-8") from None


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def decode_entry(
    stream: str, entry_id: str, raw: Mapping[Any, Any] | None, deliveries: int
) -> ConsumedEvent:
    """Decode one stream entry or raise UndecodableEntry naming the field."""
    if not raw:
        raise UndecodableEntry("fields", "the entry has no fields")
    fields = _strict_text(raw)
    for name in REQUIRED:
        if not fields.get(name):
            raise UndecodableEntry(name, "is missing or empty")
    event_id = fields["id"]
    if len(event_id) > MAX_ID_LENGTH or "\x00" in event_id:
        raise UndecodableEntry("id", f"must be at most {MAX_ID_LENGTH} characters without NUL")
    identity = fields.get("identity") or event_id
    if len(identity) > MAX_IDENTITY_LENGTH or "\x00" in identity or not identity.strip():
        raise UndecodableEntry(
            "identity", f"must be 1-{MAX_IDENTITY_LENGTH} characters, not blank, without NUL"
        )
    topic = fields["type"]
    if len(topic) > MAX_IDENTITY_LENGTH or "\x00" in topic:
        raise UndecodableEntry("type", f"must be at most {MAX_IDENTITY_LENGTH} characters")
    try:
        data = json.loads(fields["data"])
    except ValueError as exc:
        raise UndecodableEntry("data", f"is not JSON ({exc})") from None
    headers = {
        name[len(HEADER_PREFIX) :]: value
        for name, value in fields.items()
        if name[:7] == HEADER_PREFIX and len(name) > len(HEADER_PREFIX)
    }
    traceparent = fields.get("traceparent") or None
    if traceparent is not None:
        # The relay lifts the traceparent header to a CloudEvents attribute; give it back.
        headers.setdefault("traceparent", traceparent)
    return ConsumedEvent(
        id=event_id,
        type=topic,
        subject=fields.get("subject") or None,
        tenant=fields.get("tenant") or None,
        identity=identity,
        data=data,
        headers=headers,
        stream=stream,
        entry_id=entry_id,
        deliveries=deliveries,
        time=_parse_time(fields.get("time")),
        source=fields.get("source") or None,
        partition_key=fields.get("partitionkey") or None,
        traceparent=traceparent,
        fields=fields,
    )


def encode_entry(
    topic: str,
    data: Any,
    *,
    event_id: str,
    subject: str | None = None,
    tenant: str | None = None,
    identity: str | None = None,
    headers: Mapping[str, str] | None = None,
    time: str | None = None,
    source: str = "outbox",
) -> dict[str, str]:
    """The stream fields of an event in the relay's format (for tests, tools and benches)."""
    fields = {
        "specversion": "1.0",
        "id": event_id,
        "source": source,
        "type": topic,
        "datacontenttype": "application/json",
        "data": json.dumps(data, separators=(",", ":")),
    }
    if subject is not None:
        fields["subject"] = subject
    if time is not None:
        fields["time"] = time
    if tenant is not None:
        fields["tenant"] = tenant
    if identity is not None:
        fields["identity"] = identity
    for name, value in (headers or {}).items():
        fields[HEADER_PREFIX + name] = value
    return fields
