"""``operation_record`` as SQL text, for both drivers' fast path: every dispatch records its
receipt, so the statement goes to the database driver as text built once per shape (which
columns it sets, which it stamps, which conditions it has) instead of an UPDATE built and
compiled by SQLAlchemy on each call (about two thirds of the statement's client cost)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Shape = tuple[tuple[str, ...], tuple[str, ...], bool, bool, bool]


class RecordStatements:
    """The statement and parameters of one ``operation_record`` call. ``build`` makes the
    text of a shape (columns, stamped columns, with unless-states, with if-states, with an
    attempts condition); ``states`` turns a list of states into the parameter the text
    expects (an array on PostgreSQL, JSON text on SQLite)."""

    def __init__(self, build: Callable[..., str], states: Callable[[list[str]], Any]) -> None:
        self._build = build
        self._states = states
        self._texts: dict[Shape, str] = {}

    def __call__(
        self,
        operation_id: str,
        values: Mapping[str, Any],
        stamp: Sequence[str],
        unless_states: Sequence[str],
        if_states: Sequence[str],
        if_attempts: int | None,
    ) -> tuple[str, dict[str, Any]]:
        shape: Shape = (
            tuple(values),
            tuple(stamp),
            bool(unless_states),
            bool(if_states),
            if_attempts is not None,
        )
        sql = self._texts.get(shape)
        if sql is None:
            sql = self._texts[shape] = self._build(*shape)
        params = dict(values)
        params.update(
            _operation_id=operation_id,
            _unless=self._states(list(unless_states)),
            _if=self._states(list(if_states)),
            _attempts=if_attempts,
        )
        return sql, params
