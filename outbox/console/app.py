"""The console's web application: server-rendered pages and the JSON API (Starlette).

Why Starlette with Jinja2 under uvicorn: a small, well-kept ASGI toolkit (routing, requests,
responses, a test client) with no framework around it, templates that escape every value by
default, and a server that is one dependency. The pages are plain HTML forms: nothing needs
JavaScript, and the Content-Security-Policy forbids scripts altogether, so even a value that
escaped the escaping could not run.

Reads and actions run in a worker thread (``run_in_threadpool``): the database calls are
the library's own, synchronous ones.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import parse_qs, urlencode

from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from consumer.inbox import NEEDS_ATTENTION as DL_NEEDS_ATTENTION
from outbox.console import queries
from outbox.console.actions import ActionError, Actions, Actor
from outbox.console.auth import COOKIE, CSRF_HEADER, Guard, Principal, Sessions
from outbox.console.door import Door
from outbox.console.gate import MAX_BODY, Gate, host_names
from outbox.console.lines import line_routes
from outbox.console.openapi import openapi
from outbox.console.overview import overview
from outbox.console.params import integer, optional_integer, text
from outbox.console.params import local_path as _local
from outbox.console.queries import FilterError, NotFound, Tables
from outbox.console.templating import templates
from outbox.console.trace_views import TraceViews
from outbox.logs import fields
from outbox.schema import OutboxSchema, build_schema

log = logging.getLogger("outbox.console")

CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
Handler = Callable[[Request], Awaitable[Response]]


class Console:
    """One console: its database, Redis, token and templates; :attr:`app` is the ASGI app."""

    def __init__(
        self,
        engine: Engine,
        redis: Any,
        token: str | Callable[[], str],
        *,
        read_only: bool = False,
        outbox_schema: OutboxSchema | None = None,
        describe: dict[str, str] | None = None,
        allowed_hosts: Iterable[str] | None = None,
        secure_cookies: bool = False,
        trusted_proxies: Iterable[str] = (),
        sessions: Sessions | None = None,
        max_body: int = MAX_BODY,
    ) -> None:
        """``token``: the token, or a function giving the current one (a new one ends every
        session). ``allowed_hosts``: the names the Host header may carry (None: any; the
        ``serve`` command always gives them). ``secure_cookies``: the session cookie is
        ``Secure`` (TLS in front); it also is for a request that arrives over https, or from
        one of ``trusted_proxies`` (client addresses) with ``X-Forwarded-Proto: https``.
        ``max_body``: the largest request body read (bytes), before authentication."""
        self.engine = engine
        self.redis = redis
        self.guard = Guard(token, sessions)
        self.door = Door(self.guard, secure_cookies=secure_cookies, trusted_proxies=trusted_proxies)
        self.read_only = read_only
        self.outbox_schema = outbox_schema if outbox_schema is not None else build_schema()
        self.tables = Tables.build(self.outbox_schema)
        self.actions = Actions(engine, self.outbox_schema, self.tables, redis)
        self.describe = describe or {}
        self._present: tuple[float, set[str]] = (0.0, set())
        self.templates = templates()
        self.traces = TraceViews(self)
        hosts = None if allowed_hosts is None else host_names(allowed_hosts)
        self.app = Gate(Starlette(routes=self._routes()), allowed_hosts=hosts, max_body=max_body)

    # -- plumbing --------------------------------------------------------------------------

    def present(self) -> set[str]:
        """The parts' tables that exist, re-read every 10 s (tables may appear later)."""
        at, found = self._present
        if time.monotonic() - at > 10.0:
            found = queries.present_tables(self.engine, self.tables)
            self._present = (time.monotonic(), found)
        return found

    def _routes(self) -> list[Route]:
        r = Route
        api, page, act = self._api, self._page, self._action
        return [
            r("/console.css", self.css),
            r("/login", self.login, methods=["GET", "POST"]),
            r("/logout", page(self.logout), methods=["POST"]),
            r("/api/openapi.json", self.api_description),
            r("/api/overview", api(self.api_overview)),
            r("/api/trace", api(self.traces.api_trace)),
            r("/api/trace/value", api(self.traces.api_value)),
            r("/api/events", api(self.api_list("events"))),
            r("/api/jobs", api(self.api_list("jobs"))),
            r("/api/receipts", api(self.api_list("receipts"))),
            r("/api/dead-letters", api(self.api_list("dead_letters"))),
            r("/api/dead-letters/{target}", api(self.api_dead_letter)),
            r("/api/audit", api(self.api_list("audit"))),
            r("/api/events/{target}/requeue", act("requeue", json_api=True), methods=["POST"]),
            r("/api/jobs/{target}/resume", act("resume", json_api=True), methods=["POST"]),
            r("/api/jobs/{target}/cancel", act("cancel", json_api=True), methods=["POST"]),
            r("/api/receipts/{target:path}/settle", act("settle", json_api=True), methods=["POST"]),
            r("/api/dead-letters/{target}/replay", act("replay", json_api=True), methods=["POST"]),
            r("/api/bulk/{kind}", act("bulk", json_api=True), methods=["POST"]),
            r("/api/queues", api(self.api_queues)),
            r("/api/queues/{target:path}/pause", act("pause_queue", True), methods=["POST"]),
            r("/api/queues/{target:path}/resume", act("resume_queue", True), methods=["POST"]),
            r("/api/schedules", api(self.api_schedules)),
            r("/api/schedules/{target:path}/pause", act("pause_schedule", True), methods=["POST"]),
            r(
                "/api/schedules/{target:path}/resume",
                act("resume_schedule", True),
                methods=["POST"],
            ),
            r("/", page(self.page_overview)),
            r("/trace", page(self.traces.page_trace)),
            r("/events", page(self.page_list("events"))),
            r("/jobs", page(self.page_list("jobs"))),
            r("/receipts", page(self.page_list("receipts"))),
            r("/dead-letters", page(self.page_list("dead_letters"))),
            r("/audit", page(self.page_list("audit"))),
            r("/events/{target}/requeue", act("requeue"), methods=["POST"]),
            r("/jobs/{target}/resume", act("resume"), methods=["POST"]),
            r("/jobs/{target}/cancel", act("cancel"), methods=["POST"]),
            r("/receipts/{target:path}/settle", act("settle"), methods=["POST"]),
            r("/dead-letters/{target}/replay", act("replay"), methods=["POST"]),
            r("/bulk/{kind}", act("bulk"), methods=["POST"]),
            r("/queues", page(self.page_queues)),
            r("/queues/{target:path}/pause", act("pause_queue"), methods=["POST"]),
            r("/queues/{target:path}/resume", act("resume_queue"), methods=["POST"]),
            r("/schedules", page(self.page_schedules)),
            r("/schedules/{target:path}/pause", act("pause_schedule"), methods=["POST"]),
            r("/schedules/{target:path}/resume", act("resume_schedule"), methods=["POST"]),
            *line_routes(self, api, page, self._render, self._csrf),  # graphs, key lines
        ]

    def _render(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        template = self.templates.get_template(name)
        # Who runs where (database, Redis) is shown to the signed-in only.
        describe = self.describe if context.get("who") is not None else {}
        body = template.render(read_only=self.read_only, describe=describe, **context)
        return HTMLResponse(body, status, headers=_headers())

    def _api(self, handler: Callable[[Request], Awaitable[Any]]) -> Handler:
        async def endpoint(request: Request) -> Response:
            who = self.door.who(request)
            if isinstance(who, Response):
                return who
            if who is None:
                return _json({"error": "a valid token is required (Authorization: Bearer)"}, 401)
            started = time.perf_counter()
            try:
                return _timed(_json(await handler(request)), started)
            except FilterError as exc:
                return _json({"error": str(exc)}, 404 if isinstance(exc, NotFound) else 400)

        return endpoint

    def _page(self, handler: Callable[[Request, Principal], Awaitable[Response]]) -> Handler:
        async def endpoint(request: Request) -> Response:
            who = self.door.who(request)
            if isinstance(who, Response):
                return who
            if who is None:
                return self._render("login.html", 401, error=None, next=_here(request))
            started = time.perf_counter()
            try:
                return _timed(await handler(request, who), started)
            except FilterError as exc:
                return self._render("error.html", 400, who=who, message=str(exc), csrf="")

        return endpoint

    def _csrf(self, who: Principal) -> str:
        return self.guard.csrf_token(who.session) if who.session else ""

    # -- sign in ---------------------------------------------------------------------------

    async def api_description(self, request: Request) -> Response:
        """The API's OpenAPI description (no token: it describes, it holds no data)."""
        return _json(openapi())

    async def css(self, request: Request) -> Response:
        template = self.templates.get_template("console.css")
        return Response(template.render(), media_type="text/css", headers=_headers())

    async def login(self, request: Request) -> Response:
        if request.method == "POST":
            form = await _form(request)
            token, target = form.get("token"), _local(form.get("next") or "/")
        else:
            token = request.query_params.get("token")
            target = _local(request.query_params.get("next") or "/")
        if token is None:
            return self._render("login.html", error=None, next=target)
        if not self.guard.token_ok(token):  # a valid token is never throttled (Door.who)
            throttled = self.door.throttled(request)
            if throttled is not None:
                return throttled
            self.guard.throttle.failed(self.door.client(request))
            log.info("console sign-in refused", extra=fields(client=self.door.client(request)))
            return self._render("login.html", 401, error="That token is not valid.", next=target)
        response = RedirectResponse(target, 303, headers=_headers())
        response.set_cookie(
            COOKIE,
            self.guard.new_session_cookie(),
            httponly=True,
            samesite="strict",
            path="/",
            secure=self.door.secure(request),
        )
        return response

    async def logout(self, request: Request, who: Principal) -> Response:
        self.guard.end_session(request.cookies.get(COOKIE))
        response = RedirectResponse("/login", 303, headers=_headers())
        response.delete_cookie(COOKIE, path="/", secure=self.door.secure(request), httponly=True)
        return response

    # -- reads -----------------------------------------------------------------------------

    def _overview(self) -> dict[str, Any]:
        return overview(self.engine, self.tables, self.outbox_schema, self.redis, self.present())

    def _list(self, kind: str, params: dict[str, str]) -> queries.Page:
        size = optional_integer(params, "limit", 50, minimum=1, maximum=queries.MAX_PAGE)
        cursor = text(params.get("cursor"), "cursor")
        table = {
            "events": self.tables.outbox.name,
            "jobs": "outbox_jobs",
            "receipts": "outbox_operations",
            "dead_letters": self.tables.inbox.dead_letters.name,
        }.get(kind, "outbox_audit")
        if table not in self.present():
            return queries.Page([], None, {})  # that part has no table here (yet)
        with self.engine.connect() as conn:
            if kind == "events":
                return queries.list_events(
                    conn,
                    self.tables,
                    topic=params.get("topic"),
                    key=params.get("key"),
                    state=params.get("state"),
                    cursor=cursor,
                    limit=size,
                )
            if kind == "jobs":
                return queries.list_jobs(
                    conn,
                    state=params.get("state"),
                    tenant=params.get("tenant"),
                    action=params.get("action"),
                    cursor=cursor,
                    limit=size,
                )
            if kind == "receipts":
                return queries.list_receipts(
                    conn, state=params.get("state"), cursor=cursor, limit=size
                )
            if kind == "dead_letters":
                state = params.get("state", DL_NEEDS_ATTENTION)
                return queries.list_dead_letters(
                    conn,
                    self.tables,
                    group=params.get("group"),
                    state=state,
                    cursor=cursor,
                    limit=size,
                )
            return queries.list_audit(
                conn,
                action=params.get("action"),
                target=params.get("target"),
                cursor=cursor,
                limit=size,
            )

    def _queues(self) -> queries.Page:
        store, here = self.actions.store, self.present()
        if store is None or "outbox_jobs" not in here or "outbox_paused_queues" not in here:
            return queries.Page([], None, {})  # no job store here (yet, or on MySQL)
        return queries.list_queues(store)

    async def api_queues(self, request: Request) -> Any:
        return (await run_in_threadpool(self._queues)).as_dict()

    async def page_queues(self, request: Request, who: Principal) -> Response:
        page = await run_in_threadpool(self._queues)
        return self._render(
            "queues.html",
            who=who,
            csrf=self._csrf(who),
            page=page,
            here="/queues",
            notice=_notice(request),
        )

    def _schedules(self) -> queries.Page:
        store, here = self.actions.store, self.present()
        if store is None or "outbox_schedules" not in here or "outbox_jobs" not in here:
            return queries.Page([], None, {})  # no schedules here (yet, or on MySQL)
        return queries.list_schedules(store)

    async def api_schedules(self, request: Request) -> Any:
        return (await run_in_threadpool(self._schedules)).as_dict()

    async def page_schedules(self, request: Request, who: Principal) -> Response:
        page = await run_in_threadpool(self._schedules)
        return self._render(
            "schedules.html",
            who=who,
            csrf=self._csrf(who),
            page=page,
            here="/schedules",
            notice=_notice(request),
        )

    def _dead_letter(self, record: int) -> dict[str, Any] | None:
        if self.tables.inbox.dead_letters.name not in self.present():
            return None
        with self.engine.connect() as conn:
            return queries.dead_letter(conn, self.tables, record)

    async def api_dead_letter(self, request: Request) -> Any:
        """One dead letter with its payload: lists leave payloads out, this reads one."""
        record = integer(request.path_params["target"], "entry_id", minimum=1)
        found = await run_in_threadpool(self._dead_letter, record)
        if found is None:
            raise NotFound("entry_id", f"no dead letter {record}")
        return found

    async def api_overview(self, request: Request) -> Any:
        return await run_in_threadpool(self._overview)

    def api_list(self, kind: str) -> Callable[[Request], Awaitable[Any]]:
        async def handler(request: Request) -> Any:
            page = await run_in_threadpool(self._list, kind, dict(request.query_params))
            return page.as_dict()

        return handler

    async def page_overview(self, request: Request, who: Principal) -> Response:
        data = await run_in_threadpool(self._overview)
        return self._render(
            "overview.html", who=who, csrf=self._csrf(who), o=data, notice=_notice(request)
        )

    def page_list(self, kind: str) -> Callable[[Request, Principal], Awaitable[Response]]:
        async def handler(request: Request, who: Principal) -> Response:
            params = dict(request.query_params)
            page = await run_in_threadpool(self._list, kind, params)
            query = {k: v for k, v in params.items() if k not in ("cursor", "notice")}
            here = request.url.path + ("?" + urlencode(query) if query else "")
            next_url = None
            if page.next_cursor:
                next_url = request.url.path + "?" + urlencode({**query, "cursor": page.next_cursor})
            preview = None
            if params.get("preview") and not self.read_only:
                kind_of_bulk = params["preview"]
                try:
                    count = await run_in_threadpool(
                        self.actions.bulk_preview, kind_of_bulk, page.filters
                    )
                    preview = {"kind": kind_of_bulk, "count": count, "error": None}
                except ActionError as exc:
                    preview = {"kind": kind_of_bulk, "count": 0, "error": str(exc)}
            return self._render(
                f"{kind}.html",
                who=who,
                csrf=self._csrf(who),
                page=page,
                params=params,
                next_url=next_url,
                here=_local(here),
                first_url=_local(here),
                preview=preview,
                notice=_notice(request),
            )

        return handler

    # -- actions ---------------------------------------------------------------------------

    def _action(self, action: str, json_api: bool = False) -> Handler:
        async def endpoint(request: Request) -> Response:
            who = self.door.who(request)
            if who is None or isinstance(who, Response):
                return who or _json({"error": "a valid token is required"}, 401)
            body = await _body(request)
            refused = self._admit(who, request, body, json_api)
            if refused is not None:
                return refused
            actor = Actor(
                name=(_text(body.get("by")) or "console").strip()[:200] or "console",
                via=who.via,
                client=request.client.host if request.client else None,
            )
            target = request.path_params.get("target", "")
            if len(target) > 400 or "\x00" in target:
                return self._refuse(json_api, 404, "no such target (too long, or holds NUL)")
            try:
                result = await run_in_threadpool(self._do, action, request, target, body, actor)
            except ActionError as exc:
                log.info("console action refused", extra=fields(action=action, error=str(exc)))
                return self._refuse(json_api, exc.status, str(exc), body.get("back"))
            if json_api:
                return _json(result)
            back = _local(_text(body.get("back")) or "/")
            message = result.get("message") or f"{action}: done"
            return RedirectResponse(_with_notice(back, message), 303, headers=_headers())

        return endpoint

    def _admit(
        self, who: Principal, request: Request, body: dict[str, Any], json_api: bool
    ) -> Response | None:
        """The refusal of a change by this principal (read-only, CSRF), or None."""
        if self.read_only:
            return self._refuse(json_api, 403, "the console runs --read-only: no actions")
        if who.via == "cookie":
            given = request.headers.get(CSRF_HEADER) or _text(body.get("csrf"))
            if not self.guard.csrf_ok(who.session, given):
                return self._refuse(json_api, 403, "a CSRF token is required for this change")
        return None

    # complexity: one dispatch per console action, each audited (owner: the console)
    def _do(
        self, action: str, request: Request, target: str, body: dict[str, Any], actor: Actor
    ) -> dict[str, Any]:
        reason = body.get("reason")
        a = self.actions
        if action == "requeue":
            out = a.requeue_event(target, reason, actor)
        elif action == "replay":
            out = a.replay_dead_letter(target, reason, actor)
        elif action == "resume":
            out = a.resume_job(target, reason, actor)
        elif action == "cancel":
            out = a.cancel_job(target, reason, actor)
        elif action == "pause_queue":
            out = a.pause_queue(target, reason, actor)
        elif action == "resume_queue":
            out = a.resume_queue(target, reason, actor)
        elif action == "pause_schedule":
            out = a.pause_schedule(target, reason, actor)
        elif action == "resume_schedule":
            out = a.resume_schedule(target, reason, actor)
        elif action == "settle":
            not_sent = body.get("not_sent")
            if isinstance(not_sent, str):  # a form's checkbox or radio button
                not_sent = not_sent.lower() in ("1", "true", "on", "yes")
            accepted = body.get("accepted")
            if body.get("decision") == "not_sent":
                not_sent, accepted = True, None
            elif body.get("decision") == "accepted":
                not_sent = False
            out = a.settle_receipt(target, reason, actor, accepted=accepted, not_sent=not_sent)
        else:
            kind = request.path_params["kind"]
            filters = body.get("filters")
            if not isinstance(filters, dict):
                filters = {
                    k[2:]: _text(v) or ""
                    for k, v in body.items()
                    if isinstance(k, str) and k.startswith("f_")
                }
            filters = {str(k): str(v) for k, v in filters.items() if v not in (None, "")}
            confirm = body.get("confirm") in (True, "1", "true", "yes")
            if not confirm:
                count = a.bulk_preview(kind, filters)
                return {"action": kind, "filters": filters, "count": count, "confirmed": False}
            done = a.bulk_apply(kind, filters, reason, actor)
            done["message"] = f"{kind}: {len(done['done'])} done, {len(done['refused'])} refused"
            return done
        result = out.as_dict()
        result["message"] = f"{out.action} {out.target_id}: done"
        return result

    def _refuse(self, json_api: bool, status: int, message: str, back: Any = None) -> Response:
        if json_api:
            return _json({"error": message}, status)
        return self._render(
            "error.html", status, who=None, message=message, csrf="", back=_local(_text(back))
        )


def _headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }


def _timed(response: Response, started: float) -> Response:
    """The server's time for the request (reads and rendering), as a Server-Timing header:
    what a browser's developer tools and ``python -m bench console`` show."""
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    response.headers["Server-Timing"] = f"app;dur={elapsed_ms:.1f}"
    return response


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(queries.jsonable(data), status, headers={**_headers(), **(headers or {})})


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


async def _form(request: Request) -> dict[str, str]:
    raw = (await request.body()).decode("utf-8", "replace")
    return {k: v[-1] for k, v in parse_qs(raw, keep_blank_values=True).items()}


async def _body(request: Request) -> dict[str, Any]:
    """A JSON object (the API) or an urlencoded form (the pages); {} when empty or bad."""
    kind = request.headers.get("content-type", "")
    if kind.startswith("application/x-www-form-urlencoded"):
        return dict(await _form(request))
    raw = await request.body()
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        return {}
    return data if isinstance(data, dict) else {}


def _here(request: Request) -> str:
    """This request's path and query string, as a sign-in's way back (a deep link)."""
    query = request.url.query
    return _local(request.url.path + (f"?{query}" if query else ""))


def _with_notice(path: str, message: str) -> str:
    sep = "&" if "?" in path else "?"
    return f"{path}{sep}{urlencode({'notice': message[:300]})}"


def _notice(request: Request) -> str | None:
    return request.query_params.get("notice")
