"""The transactional outbox: write a state change and its events in one transaction."""

from typing import TYPE_CHECKING, Any

from outbox.core import EventSpec, Outbox, Transaction
from outbox.db import default_database_url, make_engine, write_locked
from outbox.errors import ConfigError, InvalidEvent, OutboxError
from outbox.event import NewEvent
from outbox.hooks import NO_HOOKS, Hooks
from outbox.ids import new_event_id, uuid7
from outbox.logs import setup_logging
from outbox.migrations import create_extras, drop_extras, include_object_for
from outbox.schema import PENDING, PUBLISHED, QUARANTINED, OutboxSchema, build_schema
from outbox.tablestats import table_stats

if TYPE_CHECKING:
    from outbox.aio import AsyncOutbox, AsyncTransaction


def __getattr__(name: str) -> Any:
    # The async path (SQLAlchemy's asyncio extension) loads on first use: every relay,
    # consumer and worker process starts ~0.1 s sooner without it.
    if name in ("AsyncOutbox", "AsyncTransaction"):
        from outbox import aio

        return getattr(aio, name)
    raise AttributeError(f"module 'outbox' has no attribute {name!r}")


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
    "create_extras",
    "default_database_url",
    "drop_extras",
    "include_object_for",
    "make_engine",
    "new_event_id",
    "setup_logging",
    "table_stats",
    "uuid7",
    "write_locked",
]
