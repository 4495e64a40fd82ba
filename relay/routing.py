"""Routing an event to its outbox stream, the same on every broker.

Stream names come from a template with ``{topic}``, ``{tenant}`` and ``{partition}``
(``key_hash % partitions``); ``{{`` and ``}}`` are literal braces, which is how a Redis
Cluster hash tag is written: ``outbox.{{{topic}}}`` makes ``outbox.{quote.approved}``.
On NATS the rendered name is the subject of the message (:mod:`relay.nats`).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Any

from outbox.errors import ConfigError
from outbox.validate import check_number
from relay.errors import PermanentPublishError, RoutingError
from relay.records import Record

TEMPLATE_FIELDS = frozenset({"topic", "tenant", "partition"})
MAX_STREAM_NAME = 512


@dataclass(frozen=True)
class StreamTemplate:
    """A validated stream-name template."""

    template: str
    fields: frozenset[str]
    partitions: int

    @classmethod
    def parse(cls, template: str, partitions: int = 16) -> StreamTemplate:
        if not isinstance(template, str) or not template.strip():
            raise ConfigError("stream", "the stream template must be a non-empty string")
        check_number("stream_partitions", partitions, ConfigError, integer=True)
        used: set[str] = set()
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ConfigError("stream", f"{template!r} is not a valid template ({exc})") from None
        for _literal, name, spec, conversion in parsed:
            if name is None:
                continue
            if name not in TEMPLATE_FIELDS:
                allowed = ", ".join("{" + f + "}" for f in sorted(TEMPLATE_FIELDS))
                raise ConfigError(
                    "stream",
                    f"{template!r} uses unknown placeholder {{{name}}}; allowed: {allowed} "
                    "(write {{ and }} for literal braces)",
                )
            if spec or conversion:
                raise ConfigError("stream", f"{template!r}: placeholders take no format spec")
            used.add(name)
        if "topic" not in used and not used and "{" in template.replace("{{", "").replace("}}", ""):
            raise ConfigError("stream", f"{template!r} is not a valid template")
        return cls(template=template, fields=frozenset(used), partitions=partitions)

    def render(self, topic: str, tenant: str | None, key_hash: int) -> str:
        values: dict[str, Any] = {"topic": topic}
        if "tenant" in self.fields:
            if tenant is None:
                raise RoutingError(
                    f"stream template {self.template!r} needs {{tenant}} and the event has none"
                )
            values["tenant"] = tenant
        if "partition" in self.fields:
            values["partition"] = key_hash % self.partitions
        name = self.template.format(**values)
        if len(name) > MAX_STREAM_NAME:
            raise RoutingError(f"stream name is {len(name)} characters, over {MAX_STREAM_NAME}")
        return name


def headers_of(record: Record) -> dict[str, str]:
    if not record.headers:
        return {}
    try:
        value = json.loads(record.headers)
    except ValueError as exc:
        raise PermanentPublishError(f"stored headers are not valid JSON: {exc}") from None
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise PermanentPublishError("stored headers are not a mapping of strings to strings")
    return value
