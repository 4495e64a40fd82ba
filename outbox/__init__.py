"""The transactional outbox: write a state change and its events in one transaction."""

from outbox.aio import AsyncOutbox, AsyncTransaction
from outbox.core import EventSpec, Outbox, Transaction
from outbox.db import make_engine
from outbox.errors import ConfigError, InvalidEvent, OutboxError
from outbox.event import NewEvent
from outbox.hooks import NO_HOOKS, Hooks
from outbox.ids import new_event_id, uuid7
from outbox.schema import PENDING, PUBLISHED, QUARANTINED, OutboxSchema, build_schema

__all__ = [
    "NO_HOOKS",
    "PENDING",
    "PUBLISHED",
    "QUARANTINED",
    "AsyncOutbox",
    "AsyncTransaction",
    "ConfigError",
    "EventSpec",
    "Hooks",
    "InvalidEvent",
    "NewEvent",
    "Outbox",
    "OutboxError",
    "OutboxSchema",
    "Transaction",
    "build_schema",
    "make_engine",
    "new_event_id",
    "uuid7",
]
