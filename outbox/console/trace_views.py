"""The trace's page and API (``/trace``, ``/api/trace``, ``/api/trace/value``), paged and
capped (issue 53): ``cursor`` and ``limit`` choose a page of a long flow
(:mod:`outbox.console.trace_pages`), long values come cut with the path of their whole
(:mod:`outbox.console.trace_cap`), and ``/api/trace/value`` answers one whole value.

Every parameter goes through the console's gates (:mod:`outbox.console.params`): bad input
is a 400, never a 500."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from outbox.console.auth import Principal
from outbox.console.params import local_path, optional_integer, text
from outbox.console.queries import TRACE_LIMIT, FilterError
from outbox.console.trace import Trace, collect
from outbox.console.trace_cap import whole_value
from outbox.console.trace_pages import Window

NO_QUERY = "give an identity, event key, event id, job id or operation id"


class TraceViews:
    """The trace's handlers, on one console."""

    def __init__(self, console: Any) -> None:
        """``console``: the :class:`outbox.console.app.Console` (its engine, tables, Redis,
        and page rendering)."""
        self.console = console

    def _collect(self, q: str, window: Window) -> Trace:
        console = self.console
        with console.engine.connect() as conn:
            return collect(conn, console.tables, q, console.present(), console.redis, window=window)

    @staticmethod
    def _asked(request: Request) -> tuple[str, Window]:
        params = request.query_params
        q = (text(params.get("q"), "q") or "").strip()
        limit = optional_integer(dict(params), "limit", TRACE_LIMIT, minimum=1, maximum=TRACE_LIMIT)
        return q, Window.parse(text(params.get("cursor"), "cursor"), limit)

    async def api_trace(self, request: Request) -> Any:
        q, window = self._asked(request)
        if not q:
            raise FilterError("q", NO_QUERY)
        trace = await run_in_threadpool(self._collect, q, window)
        return trace.as_dict()

    async def api_value(self, request: Request) -> Any:
        """One whole long value of a record a trace showed cut (its ``*_capped.whole``)."""
        params = request.query_params
        kind = text(params.get("kind"), "kind") or ""
        record = text(params.get("id"), "id") or ""
        column = text(params.get("column"), "column") or ""
        console = self.console

        def read() -> Any:
            with console.engine.connect() as conn:
                return whole_value(conn, console.tables, console.present(), kind, record, column)

        value = await run_in_threadpool(read)
        return {"kind": kind, "id": record, "column": column, "value": value}

    async def page_trace(self, request: Request, who: Principal) -> Response:
        q, window = self._asked(request)
        trace = await run_in_threadpool(self._collect, q, window) if q else None
        first = window.after_seq is None and window.after_job is None
        # A later page past the flow's last rows is empty, not a trace that found nothing.
        status = 404 if trace is not None and not trace.found and first else 200
        next_url = None
        if trace is not None and trace.window.next_cursor:
            query = {"q": q, "cursor": trace.window.next_cursor, "limit": str(window.limit)}
            next_url = "/trace?" + urlencode(query)
        console = self.console
        page: Response = console._render(
            "trace.html",
            status,
            who=who,
            csrf=console._csrf(who),
            q=q,
            t=trace,
            next_url=next_url,
            notice=request.query_params.get("notice"),
            here=local_path(
                str(request.url.path) + ("?" + request.url.query if request.url.query else "")
            ),
        )
        return page


__all__ = ["TraceViews"]
