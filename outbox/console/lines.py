"""The console's views of a graph of steps (issue 57) and of an order key's line (issue 56):
routes of their own, beside :mod:`outbox.console.app`'s.

- ``GET /graph?job=ID`` and ``GET /api/graph?job=ID[&limit=N]``: the job's whole graph of
  steps (``after=`` at enqueue), each job at its level with its state, why it waits and its
  parents, and the graph's progress (``consumer.jobs.step_graph``; at most ``limit`` jobs,
  1,000 by default).
- ``GET /keys?key=K`` and ``GET /api/keys?key=K[&limit=N]``: the line of order key ``K``:
  the job that runs or may run (its head), whether it holds the jobs behind it and why, and
  the jobs HELD behind it in the order they will run (``consumer.jobs.order_keys``; the
  first ``limit``, 50 by default).

Both are reads through the job store's own functions, in a worker thread. An unknown job,
or a key with no job, answers 404 (the page: an error page); a job store without the steps
or keys tables (made before them, not upgraded yet) answers the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from consumer.errors import JobError, JobNotFound
from consumer.jobs.schema import JOBS_TABLE, ORDER_KEYS_TABLE, STEPS_TABLE
from consumer.jobs.step_graph import MAX_GRAPH_JOBS
from outbox.console.auth import Principal
from outbox.console.params import integer, optional_integer, text
from outbox.console.queries import FilterError, NotFound

__all__ = ["line_routes"]

Api = Callable[[Callable[[Request], Awaitable[Any]]], Callable[[Request], Awaitable[Response]]]
Page = Callable[
    [Callable[[Request, Principal], Awaitable[Response]]],
    Callable[[Request], Awaitable[Response]],
]
MAX_HELD_SHOWN = 500


class ConsoleParts(Protocol):
    """What the views need of :class:`outbox.console.app.Console`."""

    actions: Any

    def present(self) -> set[str]: ...


class Lines:
    """The graph and key-line reads and pages of one console."""

    def __init__(
        self,
        console: ConsoleParts,
        render: Callable[..., HTMLResponse],
        csrf: Callable[[Principal], str],
    ) -> None:
        self.console = console
        self.render = render
        self.csrf = csrf

    # -- reads -----------------------------------------------------------------------------

    def graph(self, params: dict[str, str]) -> dict[str, Any]:
        job = integer(params.get("job"), "job", minimum=1)
        limit = optional_integer(params, "limit", MAX_GRAPH_JOBS, minimum=1, maximum=10_000)
        present = self.console.present()
        if JOBS_TABLE not in present or STEPS_TABLE not in present:
            raise NotFound("job", f"no job {job}")
        try:
            return dict(self.console.actions.store.step_graph(job, limit=limit).as_dict())
        except JobNotFound:
            raise NotFound("job", f"no job {job}") from None

    def key_line(self, params: dict[str, str]) -> dict[str, Any]:
        key = (text(params.get("key"), "key") or "").strip()
        if not key:
            raise FilterError("key", "give an order key")
        limit = optional_integer(params, "limit", 50, minimum=1, maximum=MAX_HELD_SHOWN)
        if (
            JOBS_TABLE not in self.console.present()
            or ORDER_KEYS_TABLE not in self.console.present()
        ):
            raise NotFound("key", f"no job of order key {key}")
        try:
            line = self.console.actions.store.order_line(key, limit=limit)
        except JobError as exc:
            raise FilterError("key", str(exc)) from None
        if line.head is None and not line.held_count:
            raise NotFound("key", f"no job of order key {key}")
        return dict(line.as_dict())

    # -- endpoints -------------------------------------------------------------------------

    async def api_graph(self, request: Request) -> Any:
        return await run_in_threadpool(self.graph, dict(request.query_params))

    async def api_keys(self, request: Request) -> Any:
        return await run_in_threadpool(self.key_line, dict(request.query_params))

    async def page_graph(self, request: Request, who: Principal) -> Response:
        graph = await run_in_threadpool(self.graph, dict(request.query_params))
        names = {j["id"]: f"{j['tenant']}/{j['action']}" for j in graph["jobs"]}
        return self.render("graph.html", who=who, csrf=self.csrf(who), g=graph, names=names)

    async def page_keys(self, request: Request, who: Principal) -> Response:
        line = await run_in_threadpool(self.key_line, dict(request.query_params))
        return self.render("keys.html", who=who, csrf=self.csrf(who), line=line)


def line_routes(
    console: ConsoleParts,
    api: Api,
    page: Page,
    render: Callable[..., HTMLResponse],
    csrf: Callable[[Principal], str],
) -> list[Route]:
    """The routes of the graph and key-line views, wrapped by the console's ``api`` and
    ``page`` (authentication, errors as 400/404, timing headers)."""
    lines = Lines(console, render, csrf)
    return [
        Route("/api/graph", api(lines.api_graph)),
        Route("/api/keys", api(lines.api_keys)),
        Route("/graph", page(lines.page_graph)),
        Route("/keys", page(lines.page_keys)),
    ]
