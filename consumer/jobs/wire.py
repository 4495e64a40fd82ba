"""A lean HTTP/1.1 client on asyncio for ``HttpProvider``'s async calls (``asend``/``alookup``).

Why not ``httpx.AsyncClient``: measured in a worker with 256 async slots against a 300 ms
provider (``python -m bench effects --handlers async``, py-spy in ``--gil`` mode), the
httpx/httpcore/anyio stack held the GIL for ~65 % of the worker's Python time, about 1 ms of
CPU per call: cookies, auth and redirect layers, a pool that scans its connections on every
request, a socket-readability probe before every reuse, anyio's cancel scopes. A worker's
call is always the same shape (one POST of a small JSON body, or one GET, on a kept-alive
connection), so this module does only that: the request is framed and the answer parsed by
``h11``, the sans-I/O HTTP/1.1 parser that httpcore itself uses (nothing hand-parsed here),
over asyncio streams, with one idle list per origin.

What it promises ``HttpProvider``:

- :class:`NotSent`: the request certainly did not leave this process (no connection could
  be made, or ``before_send`` refused).
- Any other failure after the first byte was written is :class:`LostAfterSend`: the
  request may have reached the provider (a reset, an answer cut short, a connection that
  the server closed while the request was on its way).
- The caller bounds the whole call (``asyncio.timeout``); a cancelled call closes its
  connection, which is never reused half-read.

TLS uses ``httpx.create_ssl_context()`` (the same certificates as the sync client:
certifi, or ``SSL_CERT_FILE``/``SSL_CERT_DIR``). Proxies are not spoken here:
``HttpProvider`` keeps httpx for a URL that an ``*_PROXY`` variable applies to.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from outbox.extras import optional_module

if TYPE_CHECKING:
    import h11
else:  # the [http] extra (HttpProvider requires it before this client is ever made)
    h11 = optional_module("h11", "http", "HttpProvider")

__all__ = ["Answer", "LostAfterSend", "NotSent", "WirePool"]

READ_SIZE = 65536


class NotSent(Exception):
    """Nothing of the request was written: connecting failed, or ``before_send`` refused."""


class LostAfterSend(Exception):
    """The request was (at least partly) written and no whole answer came back: it may have
    reached the server."""


@dataclass(frozen=True)
class Answer:
    """A whole answer: the status, the headers (names in lower case) and the body, cut at
    ``max_body`` bytes (``truncated`` then)."""

    status: int
    headers: dict[str, str]
    body: bytes
    truncated: bool = False


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def split_url(url: str) -> tuple[Origin, str]:
    """``(origin, request target)`` of an absolute http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an absolute http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port), target


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(our_role=h11.CLIENT))

    def reusable(self) -> bool:
        """Idle, and not closed by the server meanwhile (an EOF already read counts)."""
        return (
            self.h11.our_state is h11.IDLE
            and self.h11.their_state is h11.IDLE
            and not self.writer.transport.is_closing()
            and not self.reader.at_eof()
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing is best effort
            self.writer.close()


class WirePool:
    """Kept-alive connections of one event loop, at most ``max_connections`` in use at once
    (a request beyond that waits for one, before anything is sent)."""

    def __init__(
        self,
        max_connections: int,
        *,
        headers: Mapping[str, str] | None = None,
        ssl_context: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[Origin, list[_Connection]] = {}
        self._base = [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()
        ]
        self._ssl_factory = ssl_context
        self._ssl: ssl.SSLContext | None = None
        self._origins: dict[str, tuple[Origin, str]] = {}
        self._closed = False

    # complexity: one HTTP request's connection reuse, retry and timeout rules
    async def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        *,
        max_body: int,
        before_send: Callable[[], None] | None = None,
    ) -> Answer:
        """One exchange. ``before_send`` runs just before the first byte is written (an
        exception from it means :class:`NotSent` semantics for the caller: it propagates
        as raised, nothing written)."""
        split = self._origins.get(url)
        if split is None:
            split = split_url(url)
            if len(self._origins) < 1024:  # the send URL, and a few lookups' worth
                self._origins[url] = split
        origin, target = split
        async with self._slots:
            conn = self._pooled(origin) or await self._connect(origin)
            if before_send is not None:
                try:
                    before_send()
                except BaseException:
                    self._release(origin, conn)
                    raise
            written = False
            done = False
            try:
                framed = [
                    (b"Host", origin.host_header.encode("latin-1")),
                    *self._base,
                    *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
                ]
                if body is not None:
                    framed.append((b"Content-Length", str(len(body)).encode()))
                parts = [conn.h11.send(h11.Request(method=method, target=target, headers=framed))]
                if body:
                    parts.append(conn.h11.send(h11.Data(data=body)))
                parts.append(conn.h11.send(h11.EndOfMessage()))
                written = True
                conn.writer.write(b"".join(p for p in parts if p))
                answer = await self._answer(conn, max_body)
                done = True
                return answer
            except (h11.LocalProtocolError, UnicodeEncodeError) as exc:
                if written:
                    raise LostAfterSend(f"{type(exc).__name__}: {exc}") from None
                raise NotSent(f"request not framed: {exc}") from None  # nothing written
            except (OSError, EOFError, h11.RemoteProtocolError) as exc:
                raise LostAfterSend(f"{type(exc).__name__}: {exc}") from None
            finally:
                if done and not self._closed:
                    self._release(origin, conn)
                else:
                    conn.close()  # cancelled, failed or cut short: never reused half-read

    async def _answer(self, conn: _Connection, max_body: int) -> Answer:
        status = 0
        headers: dict[str, str] = {}
        chunks: list[bytes] = []
        size = 0
        while True:
            event = conn.h11.next_event()
            if event is h11.NEED_DATA:
                data = await conn.reader.read(READ_SIZE)
                if not data and conn.h11.their_state is not h11.SEND_BODY:
                    raise EOFError("server closed the connection without a whole answer")
                conn.h11.receive_data(data)  # b"": the end of a body framed by closing
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
                continue
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > max_body:  # the status is what matters; a huge body is no reference
                    conn.h11 = h11.Connection(our_role=h11.CLIENT)  # never reused
                    conn.writer.transport.abort()
                    return Answer(status, headers, b"".join(chunks), truncated=True)
                chunks.append(bytes(event.data))
                continue
            if isinstance(event, h11.EndOfMessage):
                return Answer(status, headers, b"".join(chunks))
            if isinstance(event, h11.ConnectionClosed):
                raise EOFError("server closed the connection without a whole answer")

    def _pooled(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be alive
            if conn.reusable():
                return conn
            conn.close()
        return None

    def _release(self, origin: Origin, conn: _Connection) -> None:
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            with contextlib.suppress(h11.LocalProtocolError):
                conn.h11.start_next_cycle()
        if conn.reusable() and not self._closed:
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()

    async def _connect(self, origin: Origin) -> _Connection:
        tls: ssl.SSLContext | None = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = (
                    self._ssl_factory() if self._ssl_factory else ssl.create_default_context()
                )
            tls = self._ssl
        try:
            reader, writer = await asyncio.open_connection(
                origin.host,
                origin.port,
                ssl=tls,
                server_hostname=origin.host if tls is not None else None,
                limit=READ_SIZE * 2,
            )
        except (OSError, ssl.SSLError) as exc:
            raise NotSent(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        # asyncio sets TCP_NODELAY on TCP transports: a request is one write, sent at once.
        return _Connection(reader, writer)

    async def aclose(self) -> None:
        """Close every idle connection; the ones in use close when their call ends."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
                with contextlib.suppress(Exception):
                    await conn.writer.wait_closed()
