"""How outbox names map onto NATS names (the relay's and the consumer's, the same)."""

from __future__ import annotations

import re

MSG_ID = "Nats-Msg-Id"
"""The header JetStream deduplicates by: the event id (a republish of a message JetStream
still remembers but no longer holds adds ``~`` and a suffix: :func:`event_id_of`)."""
EXPECTED_STREAM = "Nats-Expected-Stream"
"""The header that makes JetStream refuse a message another stream would take."""
_SUBJECT = re.compile(r"^[^\s*>.]+(\.[^\s*>.]+)*$")
_STREAM_NAME_BAD = re.compile(r"[\s.*>/\\]")


def jetstream_name(stream: str) -> str:
    """The JetStream stream that holds outbox stream ``stream`` (a name cannot hold ``.``,
    ``*``, ``>``, slashes or spaces: each becomes ``_``)."""
    return _STREAM_NAME_BAD.sub("_", stream)


def is_subject(name: str) -> bool:
    """Whether ``name`` can be a NATS subject to publish to (dot-separated non-empty tokens
    without spaces or wildcards)."""
    return bool(_SUBJECT.match(name))


def event_id_of(msg_id: str | None) -> str | None:
    """The event id a ``Nats-Msg-Id`` carries."""
    if msg_id is None:
        return None
    return msg_id.split("~", 1)[0]


__all__ = ["EXPECTED_STREAM", "MSG_ID", "event_id_of", "is_subject", "jetstream_name"]
