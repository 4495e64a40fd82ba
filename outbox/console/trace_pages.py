"""A trace's pages (issue 53): a long flow (a key with thousands of events, an action with
thousands of jobs) is read a page at a time, never whole.

A page holds at most ``limit`` events, by ``seq``, and ``limit`` jobs, by id: each lookup of
the trace reads one row more than that past the cursor, through its index, and the extra row
says that more follow. What the page's events and jobs link to (inbox rows, dead letters,
history, replies, receipts, callbacks, audit) comes with them, each bounded. ``next_cursor``
names the last event and job shown; ``/api/trace?q=...&cursor=...`` (and the page's "next"
link) goes on from there. None: the last page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.console.queries import TRACE_LIMIT, decode_cursor, encode_cursor


@dataclass
class Window:
    """Which page of a trace: past ``after_seq`` (events) and ``after_job`` (jobs), at most
    ``limit`` of each. :meth:`cut_events` and :meth:`cut_jobs` trim what the lookups found
    and set :attr:`next_cursor` when more follow."""

    limit: int = TRACE_LIMIT
    after_seq: int | None = None
    after_job: int | None = None
    more: bool = False
    last_seq: int | None = None
    last_job: int | None = None

    @classmethod
    def parse(cls, cursor: str | None, limit: int = TRACE_LIMIT) -> Window:
        """The window of a cursor from :attr:`next_cursor` (FilterError, a 400, for one that
        is not), or the first page."""
        values = decode_cursor(cursor, [int, int])
        if values is None:
            return cls(limit=limit)
        return cls(limit=limit, after_seq=values[0], after_job=values[1])

    def after(self, query: Any, column: Any) -> Any:
        """``query`` past the cursor on ``column`` (an outbox ``seq`` or a job id)."""
        bound = self.after_seq if column.name == "seq" else self.after_job
        return query if bound is None else query.where(column > bound)

    def _cut(self, rows: list[dict[str, Any]], key: str) -> int | None:
        rows.sort(key=lambda r: int(r[key]))
        if len(rows) > self.limit:
            del rows[self.limit :]
            self.more = True
        return int(rows[-1][key]) if rows else None

    def cut_events(self, events: list[dict[str, Any]]) -> None:
        self.last_seq = self._cut(events, "seq")

    def cut_jobs(self, jobs: list[dict[str, Any]]) -> None:
        self.last_job = self._cut(jobs, "id")

    @property
    def next_cursor(self) -> str | None:
        if not self.more:
            return None
        seq = self.last_seq if self.last_seq is not None else self.after_seq
        job = self.last_job if self.last_job is not None else self.after_job
        return encode_cursor([seq or 0, job or 0])


__all__ = ["Window"]
