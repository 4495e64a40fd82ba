"""Who is at the door of a request: its client address (behind a trusted proxy, the one the
proxy forwarded for), whether it came over TLS (the session cookie is then ``Secure``), and
its principal, with the throttle on wrong tokens (a throttled client that presents a wrong
token gets 429; a valid token is always let in). ``X-Forwarded-For`` and
``X-Forwarded-Proto`` are honoured from ``--trusted-proxies`` only (uvicorn runs with
``proxy_headers=False``, so it never rewrites the client's address itself)."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from outbox.console.auth import COOKIE, Guard, Principal


class Door:
    """The request-facing side of :class:`~outbox.console.auth.Guard`."""

    def __init__(
        self, guard: Guard, *, secure_cookies: bool = False, trusted_proxies: Iterable[str] = ()
    ) -> None:
        self.guard = guard
        self.secure_cookies = secure_cookies
        self.trusted_proxies = frozenset(trusted_proxies)

    def client(self, request: Request) -> str:
        """The client's address; behind a trusted proxy, the one it forwarded for."""
        peer = request.client.host if request.client else "?"
        forwarded = request.headers.get("x-forwarded-for")
        if forwarded and peer in self.trusted_proxies:
            return forwarded.rpartition(",")[2].strip() or peer
        return peer

    def secure(self, request: Request) -> bool:
        if self.secure_cookies or request.url.scheme == "https":
            return True
        peer = request.client.host if request.client else None
        proto = (request.headers.get("x-forwarded-proto") or "").strip().lower()
        return peer in self.trusted_proxies and proto == "https"

    def throttled(self, request: Request) -> Response | None:
        """429 while this client has tried too many wrong tokens."""
        wait = self.guard.throttle.retry_after(self.client(request))
        if wait <= 0:
            return None
        return JSONResponse(
            {"error": "too many wrong tokens from this address: try again later"},
            429,
            {"Retry-After": str(max(1, int(wait + 0.999))), "Cache-Control": "no-store"},
        )

    def who(self, request: Request) -> Principal | Response | None:
        """The principal, None (nobody), or the 429 of a throttled client that gave a wrong
        token. A valid token is never throttled (issue 53: 30 wrong tokens from one address,
        or from the proxy every operator comes through, locked every operator out): the
        throttle slows the guessing of wrong ones, and the token is too long to guess."""
        authorization = request.headers.get("authorization")
        who = self.guard.principal(authorization, request.cookies.get(COOKIE))
        if who is not None or not authorization:
            return who
        throttled = self.throttled(request)
        if throttled is not None:
            return throttled
        self.guard.throttle.failed(self.client(request))
        return None
