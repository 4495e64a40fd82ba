"""The stream entry format, in one place: the relay encodes with it, consumers decode with it,
and the benchmarks and tools build entries with it.

One flat hash per event, in CloudEvents attribute names so other tools can read it:

=================  =============================================================
``specversion``    ``1.0``
``id``             the event id (UUIDv7 string), stable across republishing
``source``         the publisher's ``source`` (default ``outbox``)
``type``           the topic
``subject``        the key
``time``           ``created_at``, ISO-8601 UTC (``2024-05-01T12:00:00.123456Z``)
``datacontenttype`` ``application/json``
``data``           the payload, JSON text exactly as stored
``tenant``         the tenant, when set
``identity``       the business identity consumers deduplicate on
``partitionkey``   the key (CloudEvents partitioning extension)
``traceparent``    the ``traceparent`` header, when set (W3C trace context)
``tracestate``     the ``tracestate`` header, when set
``header.<name>``  every other header
=================  =============================================================

Decoding is strict where the consumer's guarantees depend on it and lenient elsewhere:
``id``, ``type`` and ``data`` are required, ``data`` must be JSON that every backend can
store (no NaN or Infinity, no number that overflows to infinity, no ``\\u0000``, which
PostgreSQL's ``jsonb`` refuses), and the identity (which defaults to ``id``) must be a valid
name; an unparseable ``time`` just reads as None. An entry that fails is one that can never
succeed, so the consumer dead-letters it at once instead of retrying it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from outbox.validate import MAX_EVENT_ID_LENGTH, ErrorFactory, name_problem

SPECVERSION = "1.0"
CONTENT_TYPE = "application/json"
HEADER_PREFIX = "header."
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# Headers lifted to CloudEvents attributes (the distributed tracing extension).
_LIFTED = frozenset({TRACEPARENT, TRACESTATE})
REQUIRED = ("id", "type", "data")


class EntryFormatError(ValueError):
    """A stream entry does not follow the format; ``field`` names the problem."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"undecodable entry {field}: {problem}")
        self.field = field
        self.problem = problem


# -- encoding --------------------------------------------------------------------------------


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


_SPECVERSION = _bulk(b"specversion") + _bulk(SPECVERSION.encode())
_CONTENTTYPE = _bulk(b"datacontenttype") + _bulk(CONTENT_TYPE.encode())
_F_ID = _bulk(b"id")
_F_SOURCE = _bulk(b"source")
_F_TYPE = _bulk(b"type")
_F_SUBJECT = _bulk(b"subject")
_F_TIME = _bulk(b"time")
_F_DATA = _bulk(b"data")
_F_TENANT = _bulk(b"tenant")
_F_IDENTITY = _bulk(b"identity")
_F_PARTITIONKEY = _bulk(b"partitionkey")
_F_LIFTED = {name: _bulk(name.encode()) for name in _LIFTED}


def _header_field(name: str) -> str:
    return name if name in _LIFTED else HEADER_PREFIX + name


class EntryEncoder:
    """Builds entries for one ``source``: as a dict (tools, tests, cluster pipelines) or packed
    as RESP bulk strings (the relay's hot path: the field names are packed once, here)."""

    def __init__(self, source: str = "outbox") -> None:
        self.source = source
        self._source = _F_SOURCE + _bulk(source.encode())

    def fields(
        self,
        *,
        event_id: str,
        topic: str,
        data: str,
        key: str | None = None,
        time: str | None = None,
        tenant: str | None = None,
        identity: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """The entry as field -> value; ``data`` is the payload's JSON text."""
        out = {"specversion": SPECVERSION, "id": event_id, "source": self.source, "type": topic}
        if key is not None:
            out["subject"] = key
        if time is not None:
            out["time"] = time
        out["datacontenttype"] = CONTENT_TYPE
        out["data"] = data
        if tenant is not None:
            out["tenant"] = tenant
        if identity is not None:
            out["identity"] = identity
        if key is not None:
            out["partitionkey"] = key
        for name, value in (headers or {}).items():
            out[_header_field(name)] = value
        return out

    def pack(
        self,
        *,
        event_id: str,
        topic: str,
        key: str,
        time: str,
        data: str,
        tenant: str | None,
        identity: str,
        headers: Mapping[str, str],
    ) -> tuple[bytes, int]:
        """The same fields as :meth:`fields` (with a key, a time and an identity, as the
        relay always has them), packed for an XADD: the bytes and the argument count."""
        parts = [
            _SPECVERSION,
            _F_ID,
            _bulk(event_id.encode()),
            self._source,
            _F_TYPE,
            _bulk(topic.encode()),
            _F_SUBJECT,
            _bulk(key.encode()),
            _F_TIME,
            _bulk(time.encode()),
            _CONTENTTYPE,
            _F_DATA,
            _bulk(data.encode()),
        ]
        count = 16
        if tenant is not None:
            parts.append(_F_TENANT)
            parts.append(_bulk(tenant.encode()))
            count += 2
        parts.append(_F_IDENTITY)
        parts.append(_bulk(identity.encode()))
        parts.append(_F_PARTITIONKEY)
        parts.append(_bulk(key.encode()))
        count += 4
        for name, value in headers.items():
            field = _F_LIFTED.get(name) or _bulk((HEADER_PREFIX + name).encode())
            parts.append(field)
            parts.append(_bulk(value.encode()))
            count += 2
        return b"".join(parts), count


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
    """The stream fields of an event in the relay's format, ``data`` given as a Python value
    (for tests, tools and benchmarks)."""
    return EntryEncoder(source).fields(
        event_id=event_id,
        topic=topic,
        data=json.dumps(data, separators=(",", ":")),
        key=subject,
        time=time,
        tenant=tenant,
        identity=identity,
        headers=headers,
    )


# -- decoding --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodedEntry:
    """The validated content of one entry (the consumer adds where it was read from)."""

    id: str
    type: str
    subject: str | None
    tenant: str | None
    identity: str
    data: Any
    headers: dict[str, str]
    time: datetime | None
    source: str | None
    partition_key: str | None
    traceparent: str | None
    fields: dict[str, str]


def text_fields(raw: Mapping[Any, Any] | None) -> dict[str, str]:
    """The entry's fields as str -> str; bytes that are not UTF-8 are replaced (for tools and
    dead letters: :func:`decode` refuses them)."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for key, value in raw.items():
        k = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        v = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        out[k] = v
    return out


_decode_bytes = bytes.decode


def _strict_text(raw: Mapping[Any, Any], error: ErrorFactory) -> dict[str, str]:
    try:
        try:
            # The common case (a redis-py client returning bytes), in C: this runs once per
            # entry, tens of thousands of times a second.
            return dict(
                zip(map(_decode_bytes, raw.keys()), map(_decode_bytes, raw.values()), strict=True)
            )
        except TypeError:  # a client that decodes itself (str), or other values
            return {
                (k.decode() if isinstance(k, bytes) else str(k)): (
                    v.decode() if isinstance(v, bytes) else str(v)
                )
                for k, v in raw.items()
            }
    except UnicodeDecodeError:
        raise error("fields", "a field name or value is not UTF-8") from None


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class _NotStorable(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotStorable(f"the number {text[:40]} overflows to infinity")
    return value


def _no_constant(name: str) -> Any:
    raise _NotStorable(f"{name} is not a JSON number")


# One decoder for every entry: json.loads(text, parse_float=...) builds a new one per call.
_DATA_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant)


def _load_data(text: str, error: ErrorFactory) -> Any:
    # "\u0000" (escaped) or a raw NUL: PostgreSQL's jsonb refuses U+0000, and a handler that
    # stores the payload could never commit. Checked on the text: one scan, no tree walk.
    if "\\u0000" in text or "\x00" in text:
        raise error("data", "contains a NUL character (\\u0000), which jsonb cannot store")
    try:
        return _DATA_DECODER.decode(text)
    except _NotStorable as exc:
        raise error("data", f"is not storable JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise error("data", f"is not JSON ({exc})") from None


# complexity: one check per CloudEvents field, each naming its field; split, it reads worse
def decode(raw: Mapping[Any, Any] | None, error: ErrorFactory = EntryFormatError) -> DecodedEntry:
    """Decode one entry's fields, or raise ``error(field, problem)`` naming the field."""
    if not raw:
        raise error("fields", "the entry has no fields")
    fields = _strict_text(raw, error)
    for name in REQUIRED:
        if not fields.get(name):
            raise error(name, "is missing or empty")
    event_id = fields["id"]
    if len(event_id) > MAX_EVENT_ID_LENGTH or "\x00" in event_id:
        raise error("id", f"must be at most {MAX_EVENT_ID_LENGTH} characters without NUL")
    identity = fields.get("identity") or event_id
    problem = name_problem(identity)
    if problem is not None:
        raise error("identity", problem)
    topic = fields["type"]
    problem = name_problem(topic)
    if problem is not None:
        raise error("type", problem)
    data = _load_data(fields["data"], error)
    headers = {
        name[len(HEADER_PREFIX) :]: value
        for name, value in fields.items()
        if name[:7] == HEADER_PREFIX and len(name) > len(HEADER_PREFIX)
    }
    traceparent = fields.get(TRACEPARENT) or None
    if traceparent is not None:
        # The relay lifts the trace headers to CloudEvents attributes; give them back.
        headers.setdefault(TRACEPARENT, traceparent)
        tracestate = fields.get(TRACESTATE)
        if tracestate:
            headers.setdefault(TRACESTATE, tracestate)
    return DecodedEntry(
        id=event_id,
        type=topic,
        subject=fields.get("subject") or None,
        tenant=fields.get("tenant") or None,
        identity=identity,
        data=data,
        headers=headers,
        time=_parse_time(fields.get("time")),
        source=fields.get("source") or None,
        partition_key=fields.get("partitionkey") or None,
        traceparent=traceparent,
        fields=fields,
    )


__all__ = [
    "CONTENT_TYPE",
    "HEADER_PREFIX",
    "SPECVERSION",
    "DecodedEntry",
    "EntryEncoder",
    "EntryFormatError",
    "decode",
    "encode_entry",
    "text_fields",
]
