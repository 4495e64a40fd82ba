"""The event envelope and its validation.

Everything a caller hands to ``emit`` is checked here, before a single byte is written, and
a bad value raises :class:`~outbox.errors.InvalidEvent` naming the field. Validation is pure
Python and costs a few microseconds per event: the JSON encoding it performs is the one we
would need anyway to measure the payload's size.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox import tracing, validate
from outbox.errors import InvalidEvent
from outbox.ids import new_event_id

MAX_NAME_LENGTH = validate.MAX_NAME_LENGTH
"""Longest topic, key, tenant or identity accepted (characters): the shared name limit."""

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
"""Default ceiling of an encoded payload: 1 MiB (Redis handles more, consumers rarely should)."""

MAX_HEADERS = 64
MAX_HEADER_VALUE_LENGTH = 4096


# allow_nan=False: NaN and Infinity are not JSON and PostgreSQL's jsonb refuses them. One
# encoder for every call: json.dumps with any non-default argument builds a new JSONEncoder
# each time, half the cost of encoding a small payload.
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


_NOT_IN_A_TOPIC = re.compile(r"[\s\x00-\x1f\x7f-\x9f]")
"""Whitespace and control characters: a topic names a Redis key (``outbox.{topic}``), where
``"outbox.a b\n"`` is legal but a trap for every tool and operator that reads it."""


def check_topic(value: object) -> str:
    """A topic is a name without whitespace or control characters (InvalidEvent ``topic``)."""
    topic = check_name("topic", value)
    assert topic is not None
    bad = _NOT_IN_A_TOPIC.search(topic)
    if bad is not None:
        raise InvalidEvent(
            "topic",
            f"must not contain whitespace or control characters (found {bad.group()!r} at "
            f"{bad.start()})",
        )
    return topic


def check_name(field_name: str, value: object, *, required: bool = True) -> str | None:
    """Validate a topic, key, tenant or identity; return it (or None when optional and absent)."""
    return validate.check_name(field_name, value, InvalidEvent, required=required)


def encode_payload(payload: object, max_bytes: int) -> str:
    """Encode the payload as JSON text, or raise InvalidEvent naming ``payload``."""
    try:
        text = _encode(payload)
    except (TypeError, ValueError) as exc:
        raise InvalidEvent("payload", f"cannot be encoded as JSON ({exc})") from None
    except RecursionError:
        raise InvalidEvent("payload", "is nested too deeply to encode as JSON") from None
    if "\\u0000" in text:
        # PostgreSQL's jsonb cannot store U+0000; refuse it on every backend alike.
        raise InvalidEvent("payload", "contains a NUL character (\\u0000)")
    if not text.isascii():
        problem = validate.utf8_problem(text)
        if problem is not None:
            raise InvalidEvent("payload", problem)
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    if size > max_bytes:
        raise InvalidEvent("payload", f"is {size} bytes encoded, over the limit of {max_bytes}")
    return text


def check_headers(headers: object) -> dict[str, str]:
    """Headers are a flat mapping of non-empty string names to string values."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidEvent("headers", f"must be a mapping, got {type(headers).__name__}")
    if len(headers) > MAX_HEADERS:
        raise InvalidEvent("headers", f"has {len(headers)} entries, more than {MAX_HEADERS}")
    checked: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not name or "\x00" in name:
            raise InvalidEvent("headers", f"name {name!r} must be a non-empty string")
        if not isinstance(value, str):
            raise InvalidEvent(
                "headers", f"value of {name!r} must be a string, got {type(value).__name__}"
            )
        if "\x00" in value:
            raise InvalidEvent("headers", f"value of {name!r} must not contain NUL characters")
        problem = validate.utf8_problem(name + value)
        if problem is not None:
            raise InvalidEvent("headers", f"{name!r}: {problem}")
        if len(value) > MAX_HEADER_VALUE_LENGTH:
            limit = MAX_HEADER_VALUE_LENGTH
            raise InvalidEvent("headers", f"value of {name!r} is longer than {limit}")
        checked[name] = value
    return checked


def key_hash(key: str) -> int:
    """Stable, language-neutral hash of a key (CRC-32), used to spread keys over partitions."""
    return zlib.crc32(key.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class NewEvent:
    """A validated event, ready to be inserted. Build it with :func:`make_event`."""

    event_id: str
    topic: str
    key: str
    tenant: str | None
    identity: str
    payload: Any
    payload_json: str
    headers: dict[str, str] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The column values of this event's outbox row (database defaults fill the rest)."""
        return {
            "event_id": self.event_id,
            "topic": self.topic,
            "key": self.key,
            "key_hash": key_hash(self.key),
            "tenant": self.tenant,
            "identity": self.identity,
            "payload": self.payload,
            "headers": self.headers or None,
        }


def make_event(
    topic: object,
    *,
    key: object,
    payload: object,
    tenant: object = None,
    identity: object = None,
    headers: object = None,
    event_id: object = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> NewEvent:
    """Validate every field and return the event; raise InvalidEvent on the first bad one."""
    checked_topic = check_topic(topic)
    checked_key = check_name("key", key)
    checked_tenant = check_name("tenant", tenant, required=False)
    if event_id is None:
        checked_id = new_event_id()
    else:
        checked_id = check_name("event_id", event_id) or ""
        if len(checked_id) > 64:
            raise InvalidEvent("event_id", "is longer than 64 characters")
    checked_identity = check_name("identity", identity, required=False) or checked_id
    payload_json = encode_payload(payload, max_payload_bytes)
    checked_headers = check_headers(headers)
    tracing.add_trace_headers(checked_headers)  # the active span's context, unless given
    assert checked_topic is not None and checked_key is not None
    return NewEvent(
        event_id=checked_id,
        topic=checked_topic,
        key=checked_key,
        tenant=checked_tenant,
        identity=checked_identity,
        payload=payload,
        payload_json=payload_json,
        headers=checked_headers,
    )
