"""The outbox in a Django project: ``INSTALLED_APPS += ["outbox.django"]``.

- ``migrate`` creates the outbox table exactly as ``Outbox.create_schema()`` does (its
  migration runs ``create_schema`` itself, on Django's connection), so ``outbox-relay run``
  relays it, and a table made either way is accepted by the other.
- :func:`emit` writes an event on Django's connection, inside the caller's
  ``transaction.atomic()``: the event commits with the state change, or neither does.
- :func:`transactional` is ``@outbox.transactional`` for Django: the function runs in
  ``transaction.atomic()`` and gets a :class:`Transaction` first.
- ``manage.py outbox_relay``, ``outbox_worker`` and ``outbox_consumer`` run the toolkit's
  commands on ``DATABASES`` (:func:`database_url`).
- :func:`engine`: a SQLAlchemy Engine on Django's connection whose transactions are
  ``atomic()`` blocks; a ``Consumer`` built on it commits its handlers' Django ORM writes
  with the inbox row (docs/how-to/django.md).

Validation is the toolkit's own (``outbox.event.make_event``): bad input raises
``InvalidEvent`` naming the field, before anything is written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from outbox.extras import require

require("django", "outbox.django")

from django.db import DEFAULT_DB_ALIAS, connections, transaction  # noqa: E402

from outbox.core import INSERT_COLUMNS, EventSpec, check_specs, row_params  # noqa: E402
from outbox.django.connection import database_url, engine  # noqa: E402
from outbox.errors import OutboxError  # noqa: E402
from outbox.event import DEFAULT_MAX_PAYLOAD_BYTES, NewEvent, make_event  # noqa: E402
from outbox.schema import DEFAULT_TABLE  # noqa: E402

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "NoTransaction",
    "Transaction",
    "database_url",
    "emit",
    "emit_many",
    "engine",
    "transactional",
]


class NoTransaction(OutboxError, RuntimeError):
    """``emit`` was called outside ``transaction.atomic()`` without ``autocommit=True``: the
    event would commit on its own, apart from the state change it reports."""


def _connection(using: str | None, autocommit: bool) -> Any:
    alias = using or DEFAULT_DB_ALIAS
    connection = connections[alias]
    if not (connection.in_atomic_block or not connection.get_autocommit() or autocommit):
        raise NoTransaction(
            f"outbox.django.emit runs inside transaction.atomic(): database {alias!r} is in "
            "autocommit mode, so the event would commit on its own, apart from the state "
            f"change. Wrap both in transaction.atomic(using={alias!r}), or pass "
            "autocommit=True to write the event in a transaction of its own"
        )
    return connection


def _insert_sql(connection: Any) -> str:
    quote = connection.ops.quote_name
    columns = ", ".join(quote(name) for name in INSERT_COLUMNS)
    # PostgreSQL: the payload's JSON text from validation, cast by the server (as Outbox.emit
    # does on psycopg); SQLite stores the same text.
    json_cast = "::jsonb" if connection.vendor == "postgresql" else ""
    values = ", ".join(["%s"] * 6 + [f"%s{json_cast}"] * 2)
    return f"INSERT INTO {quote(DEFAULT_TABLE)} ({columns}) VALUES ({values})"


def _write(connection: Any, events: list[NewEvent]) -> None:
    params = row_params(events)
    width = len(INSERT_COLUMNS)
    rows = [params[i : i + width] for i in range(0, len(params), width)]
    with connection.cursor() as cursor:
        if len(rows) == 1:
            cursor.execute(_insert_sql(connection), rows[0])
        else:
            cursor.executemany(_insert_sql(connection), rows)


def emit(
    topic: str,
    *,
    key: str,
    payload: Any,
    tenant: str | None = None,
    identity: str | None = None,
    headers: Mapping[str, str] | None = None,
    event_id: str | None = None,
    using: str | None = None,
    autocommit: bool = False,
) -> str:
    """Write one event on Django's connection ``using`` (default ``"default"``) in the
    transaction open there; return its event id.

    Outside ``transaction.atomic()`` it raises :class:`NoTransaction`, unless
    ``autocommit=True`` says the event may commit on its own. Bad input raises
    ``InvalidEvent`` (a ``ValueError``) naming the field, before anything is written.
    """
    connection = _connection(using, autocommit)
    event = make_event(
        topic,
        key=key,
        payload=payload,
        tenant=tenant,
        identity=identity,
        headers=headers,
        event_id=event_id,
        max_payload_bytes=DEFAULT_MAX_PAYLOAD_BYTES,
    )
    with transaction.atomic(using=connection.alias, savepoint=False):
        _write(connection, [event])
    return event.event_id


def emit_many(
    events: Iterable[EventSpec], *, using: str | None = None, autocommit: bool = False
) -> list[str]:
    """Validate every event (mappings of :func:`emit`'s arguments, or ``NewEvent``), then
    write them all in the open transaction; return their ids."""
    connection = _connection(using, autocommit)
    checked = check_specs(events, DEFAULT_MAX_PAYLOAD_BYTES)
    if checked:
        with transaction.atomic(using=connection.alias, savepoint=False):
            _write(connection, checked)
    return [event.event_id for event in checked]


@dataclass(frozen=True)
class Transaction:
    """What :func:`transactional` passes first: ``emit`` / ``emit_many`` on its database,
    inside its ``atomic()`` block; ``using`` names the database."""

    using: str

    def emit(
        self,
        topic: str,
        *,
        key: str,
        payload: Any,
        tenant: str | None = None,
        identity: str | None = None,
        headers: Mapping[str, str] | None = None,
        event_id: str | None = None,
    ) -> str:
        return emit(
            topic,
            key=key,
            payload=payload,
            tenant=tenant,
            identity=identity,
            headers=headers,
            event_id=event_id,
            using=self.using,
        )

    def emit_many(self, events: Iterable[EventSpec]) -> list[str]:
        return emit_many(events, using=self.using)


@overload
def transactional(fn: Callable[Concatenate[Transaction, P], R]) -> Callable[P, R]: ...


@overload
def transactional(
    fn: None = None, *, using: str | None = None
) -> Callable[[Callable[Concatenate[Transaction, P], R]], Callable[P, R]]: ...


def transactional(fn: Any = None, *, using: str | None = None) -> Any:
    """Decorate a domain function ``f(tx, ...)``: it runs inside ``transaction.atomic(using)``
    and is called without ``tx``; an exception it raises rolls back the state change and the
    events together and propagates. ``@transactional`` and ``@transactional(using="other")``.
    """
    alias = using or DEFAULT_DB_ALIAS

    def decorate(func: Callable[Concatenate[Transaction, P], R]) -> Callable[P, R]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with transaction.atomic(using=alias):
                return func(Transaction(alias), *args, **kwargs)

        return wrapper

    if fn is None:
        return decorate
    if not callable(fn):
        raise TypeError("transactional decorates a function")
    return decorate(fn)
