"""Bounded traces (issue 53): a trace reads at most :data:`VALUE_CHARS` characters of each
long value (a payload, an error, a reply, an audit row's before and after), cut in the
database so the rest never leaves it, with the value's whole size beside it. Before, a trace
loaded whole rows: 8 dead letters of 20 MB gave a 168 MB ``/api/trace`` and 970 MB of
console memory.

A cut value comes as its first characters (JSON as text, since a cut document does not
parse), with ``<column>_capped``: ``{"chars": whole size, "shown": VALUE_CHARS, "whole":
the API path that answers the whole value}``. :func:`whole_value` reads that one value, for
``GET /api/trace/value?kind=...&id=...&column=...``: one value at a time, asked for by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlencode

from sqlalchemy import JSON, BigInteger, Integer, Table, Text, cast, func, select
from sqlalchemy.engine import Connection

from consumer.jobs.schema import attempts, jobs, operations, replies
from outbox.console.params import integer
from outbox.console.queries import FilterError, NotFound, Tables, jsonable
from outbox.console.schema import audit

VALUE_CHARS = 4096
"""The characters of a long value a trace shows; the rest is one request away."""

SIZE = "__chars"  # the suffix of a long column's size in a capped select


def long_columns(table: Table) -> list[str]:
    """The columns of ``table`` without a length bound: text and JSON."""
    return [
        c.name
        for c in table.c
        if isinstance(c.type, JSON) or (isinstance(c.type, Text) and c.type.length is None)
    ]


def capped_select(table: Table) -> Any:
    """``SELECT`` of ``table`` with every long column cut to :data:`VALUE_CHARS` characters in
    the database, and its whole size beside it (``<column>__chars``)."""
    long = set(long_columns(table))
    columns: list[Any] = []
    for column in table.c:
        if column.name in long:
            as_text = cast(column, Text)
            columns.append(func.substr(as_text, 1, VALUE_CHARS).label(column.name))
            columns.append(func.length(as_text).label(column.name + SIZE))
        else:
            columns.append(column)
    return select(*columns)


def _kinds(tables: Tables) -> dict[str, tuple[Table, str]]:
    """The records whose whole values can be asked for: kind -> (table, key column)."""
    return {
        "event": (tables.outbox, "seq"),
        "dead_letter": (tables.inbox.dead_letters, "id"),
        "job": (jobs, "id"),
        "attempt": (attempts, "id"),
        "reply": (replies, "id"),
        "receipt": (operations, "operation_id"),
        "audit": (audit, "id"),
    }


def uncapped(rows: Iterable[Any], table: Table, tables: Tables) -> list[dict[str, Any]]:
    """The rows of a :func:`capped_select` as JSON-able dicts: a value that fits decoded as
    its column's type, a cut one as its head with ``<column>_capped`` beside it."""
    long = long_columns(table)
    kind = next((k for k, (t, _) in _kinds(tables).items() if t is table), None)
    key = _kinds(tables)[kind][1] if kind is not None else None
    return [_uncapped(row, table, long, kind, key) for row in rows]


def _uncapped(
    row: Any, table: Table, long: list[str], kind: str | None, key: str | None
) -> dict[str, Any]:
    item = {k: jsonable(v) for k, v in row._mapping.items() if not k.endswith(SIZE)}
    for name in long:
        size = row._mapping.get(name + SIZE)
        value = item.get(name)
        if size is not None and int(size) > VALUE_CHARS:
            whole = None
            if kind is not None and key is not None:
                query = {"kind": kind, "id": str(item[key]), "column": name}
                whole = "/api/trace/value?" + urlencode(query)
            item[name + "_capped"] = {"chars": int(size), "shown": VALUE_CHARS, "whole": whole}
        elif isinstance(value, str) and isinstance(table.c[name].type, JSON):
            item[name] = json.loads(value)
    return item


def capped_fields(found: dict[str, str]) -> tuple[dict[str, str], dict[str, int]]:
    """A stream entry's fields with each long one cut to :data:`VALUE_CHARS` characters, and
    the whole sizes of those cut (Redis answers a whole entry: it is cut here, not sent)."""
    cut = {k: len(v) for k, v in found.items() if len(v) > VALUE_CHARS}
    return {k: v[:VALUE_CHARS] for k, v in found.items()}, cut


def whole_value(
    conn: Connection, tables: Tables, present: set[str], kind: str, record: str, column: str
) -> Any:
    """The whole value of ``column`` of one record (``kind`` and its key ``record``), decoded
    as its column's type. FilterError (400) for a kind, key or column that is not one;
    NotFound (404) for a record that does not exist (or a part with no table here)."""
    kinds = _kinds(tables)
    if kind not in kinds:
        raise FilterError("kind", f"one of {', '.join(sorted(kinds))}")
    table, key = kinds[kind]
    if table.name not in present:
        raise NotFound("kind", f"no {kind} table in this database")
    if column not in long_columns(table):
        raise FilterError("column", f"one of {', '.join(long_columns(table))}")
    key_column = table.c[key]
    value: Any = record
    if isinstance(key_column.type, (Integer, BigInteger)):
        value = integer(record, "id")
    row = conn.execute(select(table.c[column]).where(key_column == value)).first()
    if row is None:
        raise NotFound("id", f"no {kind} {record}")
    return jsonable(row[0])


__all__ = [
    "VALUE_CHARS",
    "capped_fields",
    "capped_select",
    "long_columns",
    "uncapped",
    "whole_value",
]
