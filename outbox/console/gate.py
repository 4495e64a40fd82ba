"""What every request to the console passes before any route sees it (an ASGI middleware):

- **The Host header** must name this console (``allowed_hosts``; None: any). A page served
  under a name an attacker controls (DNS rebinding) then gets a 400 instead of the console.
- **The body** is bounded (``max_body`` bytes, :data:`MAX_BODY` by default), before any
  authentication: a ``Content-Length`` above it is answered 413 without reading a byte, and a
  body sent without one (chunked) is read up to the bound and refused when it passes it. The
  routes then read the body from memory. Every form and JSON action of the console fits in a
  few kilobytes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

MAX_BODY = 64 * 1024
"""The largest request body the console reads (bytes)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def host_names(hosts: Iterable[str]) -> frozenset[str]:
    """Allowed names, lower case, without a port (``[::1]`` keeps its brackets)."""
    out = set()
    for host in hosts:
        name = host.strip().lower()
        if not name:
            continue
        if ":" in name and not name.startswith("["):
            name = f"[{name}]"  # a bare IPv6 address, as a Host header writes it
        out.add(name)
    return frozenset(out)


def _host_of(header: str) -> str:
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[: end + 1] if end > 0 else header
    return header.rpartition(":")[0] if ":" in header else header


class Gate:
    """The middleware (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, *, allowed_hosts: frozenset[str] | None, max_body: int = MAX_BODY
    ) -> None:
        self.app, self.allowed_hosts, self.max_body = app, allowed_hosts, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(headers)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        length = headers.get("content-length")
        if scope["method"] in ("GET", "HEAD", "OPTIONS") and length in (None, "0"):
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _answer(send, 413, f"the body is over {self.max_body} bytes")
                return
            chunks.append(chunk)
            more = bool(message.get("more_body"))
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    def _refusal(self, headers: dict[str, str]) -> tuple[int, str] | None:
        """What the headers alone refuse (a Host name, a Content-Length), or None."""
        hosts = self.allowed_hosts
        host = _host_of(headers.get("host", ""))
        if hosts is not None and "*" not in hosts and host not in hosts:
            return 400, "this console is not served under that Host name"
        length = headers.get("content-length")
        if length is None:
            return None
        if not (length.isascii() and length.isdigit() and len(length) <= 18):
            return 400, "a bad Content-Length"
        if int(length) > self.max_body:
            return 413, f"the body is over {self.max_body} bytes"
        return None


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
