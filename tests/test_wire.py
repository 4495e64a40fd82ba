"""The lean HTTP/1.1 client of ``HttpProvider``'s async calls (``consumer.jobs.wire``),
against small real servers on loopback that answer in the ways a provider may: a length, a
chunked body, a body ended by closing, a connection closed while idle, a body too large, a
connection cut after the request. And the proxy rule: a URL an ``*_PROXY`` variable applies
to goes through httpx, which speaks to proxies.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from consumer import HttpProvider, ProviderTimeout, ProviderUnavailable
from consumer.jobs.http import proxied
from consumer.jobs.wire import LostAfterSend, NotSent, WirePool, split_url
from tests.services import free_port

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length) if length else b""


class Server:
    """An asyncio server on the test's loop answering every request with ``reply``; counts
    the connections it accepted and the requests it read."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head, body = await _read_request(reader)
                    self.requests.append(head + body)
                    await self.reply(reader, writer)
                    if writer.is_closing():
                        return
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/send"


def _json(status: int, body: dict[str, Any], extra: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n".encode()
        + extra
        + b"\r\n"
        + data
    )


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_a_kept_alive_connection_serves_every_call() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_json(201, {"id": "r1"}))

    async def main() -> None:
        async with Server(reply) as server:
            pool = WirePool(4, headers={"User-Agent": "t"})
            for _ in range(5):
                answer = await pool.request(
                    "POST", server.url, {"X-A": "1"}, b'{"n":1}', max_body=1000
                )
                assert (answer.status, json.loads(answer.body)) == (201, {"id": "r1"})
                assert answer.headers["content-type"] == "application/json"
            await pool.aclose()
            assert server.connections == 1
            assert len(server.requests) == 5
            first = server.requests[0]
            assert first.startswith(b"POST /send HTTP/1.1\r\n")
            assert b"user-agent: t\r\n" in first.lower() and b"x-a: 1\r\n" in first.lower()
            assert first.endswith(b'\r\n\r\n{"n":1}')

    run(main())


def test_chunked_and_close_delimited_answers_are_read_whole() -> None:
    async def chunked(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'4\r\n{"id\r\n8\r\n": "c1"}\r\n0\r\n\r\n'
        )

    async def closing(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"id": "k1"}')
        await w.drain()
        w.close()

    async def main() -> None:
        for reply, ref in ((chunked, "c1"), (closing, "k1")):
            async with Server(reply) as server:
                pool = WirePool(2)
                for _ in range(2):  # the closed connection is not reused: a new one is made
                    answer = await pool.request("GET", server.url, {}, None, max_body=1000)
                    assert json.loads(answer.body) == {"id": ref}
                await pool.aclose()
                assert server.connections == (1 if reply is chunked else 2)

    run(main())


def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_json(200, {"id": "x"}))  # kept alive by its headers, then closed anyway
        await w.drain()
        w.close()

    async def main() -> None:
        async with Server(reply) as server:
            pool = WirePool(2)
            await pool.request("GET", server.url, {}, None, max_body=1000)
            await asyncio.sleep(0.05)  # the server's FIN arrives while the connection idles
            answer = await pool.request("GET", server.url, {}, None, max_body=1000)
            assert answer.status == 200
            assert server.connections == 2
            await pool.aclose()

    run(main())


def test_a_cut_after_the_request_may_have_landed_and_a_refused_connect_did_not() -> None:
    async def cut(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.transport.abort()  # read the request, answer nothing

    async def main() -> None:
        async with Server(cut) as server:
            pool = WirePool(2)
            with pytest.raises(LostAfterSend):
                await pool.request("POST", server.url, {}, b"{}", max_body=1000)
            assert len(server.requests) == 1
        with pytest.raises(NotSent):
            await WirePool(2).request(
                "POST", f"http://127.0.0.1:{free_port()}/send", {}, b"{}", max_body=1000
            )

    run(main())


def test_before_send_refusing_writes_nothing_and_keeps_the_connection() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_json(200, {"id": "x"}))

    class Late(Exception):
        pass

    def refuse() -> None:
        raise Late

    async def main() -> None:
        async with Server(reply) as server:
            pool = WirePool(2)
            await pool.request("GET", server.url, {}, None, max_body=1000)
            with pytest.raises(Late):
                await pool.request("POST", server.url, {}, b"{}", max_body=1000, before_send=refuse)
            await pool.request("GET", server.url, {}, None, max_body=1000)
            assert len(server.requests) == 2
            assert server.connections == 1
            await pool.aclose()

    run(main())


def test_a_body_past_the_limit_is_cut_and_its_connection_dropped() -> None:
    async def big(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000)

    async def main() -> None:
        async with Server(big) as server:
            pool = WirePool(2)
            answer = await pool.request("GET", server.url, {}, None, max_body=1000)
            assert answer.truncated and answer.status == 200 and len(answer.body) <= 1000
            await pool.request("GET", server.url, {}, None, max_body=1_000_000)
            assert server.connections == 2
            await pool.aclose()

    run(main())


def test_a_cancelled_call_closes_its_connection() -> None:
    async def slow(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)
        w.write(_json(200, {"id": "late"}))

    async def main() -> None:
        async with Server(slow) as server:
            pool = WirePool(2)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await pool.request("GET", server.url, {}, None, max_body=1000)
            answer = await pool.request("GET", server.url, {}, None, max_body=1000)
            assert json.loads(answer.body) == {"id": "late"}  # its own answer, not the first's
            assert server.connections == 2
            await pool.aclose()

    run(main())


def test_connections_in_use_are_bounded() -> None:
    in_flight = 0
    most = 0

    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        w.write(_json(200, {"id": "x"}))

    async def main() -> None:
        async with Server(reply) as server:
            pool = WirePool(3)
            calls = [pool.request("GET", server.url, {}, None, max_body=1000) for _ in range(12)]
            await asyncio.gather(*calls)
            await pool.aclose()
            assert most == 3 and server.connections == 3

    run(main())


def test_urls_split_into_origin_and_target() -> None:
    origin, target = split_url("https://api.example.com/v1/send?x=1")
    assert (origin.scheme, origin.host, origin.port, target) == (
        "https",
        "api.example.com",
        443,
        "/v1/send?x=1",
    )
    assert origin.host_header == "api.example.com"
    origin, target = split_url("http://[::1]:8080")
    assert (origin.host_header, target) == ("[::1]:8080", "/")
    with pytest.raises(ValueError):
        split_url("ftp://h/x")


# -- HttpProvider: which client, and the mapping of the lean client's failures ------------------


def test_the_proxy_rule_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    assert not proxied("http://127.0.0.1:9/send")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert not proxied("http://api.example.com/send")
    assert proxied("https://api.example.com/send")
    monkeypatch.setenv("NO_PROXY", "example.com")
    assert not proxied("https://api.example.com/send")
    monkeypatch.setenv("ALL_PROXY", "http://proxy:3128")
    assert proxied("http://other.test/send")


class _Forward(BaseHTTPRequestHandler):
    """A forward proxy for plain HTTP: an absolute-form request is passed on as it is."""

    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _forward(self) -> None:
        import http.client
        from urllib.parse import urlsplit

        _Forward.seen.append(self.path)
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
        upstream = http.client.HTTPConnection(url.hostname or "", url.port or 80, timeout=5)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "proxy-connection"}
        upstream.request(self.command, url.path or "/", body=body or None, headers=headers)
        answer = upstream.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.getheader("Content-Type") or "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        upstream.close()

    do_GET = _forward
    do_POST = _forward


@pytest.fixture
def forward_proxy() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Forward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_async_call_through_a_proxy_goes_by_httpx(
    forward_proxy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_json(201, {"id": "via-proxy"}))

    for name in ("HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.setenv("HTTP_PROXY", forward_proxy)
    _Forward.seen.clear()

    async def main() -> None:
        async with Server(reply) as server:
            provider = HttpProvider("mail", server.url, timeout=5)
            ref = await provider.asend({"n": 1}, operation_id="1:x", idempotency_key="1:x")
            await provider.aclose()
            assert ref == "via-proxy"
            assert _Forward.seen == [server.url]  # it went through the proxy
            assert provider._wire_pool is None  # the lean client was never made

    run(main())


def test_the_providers_async_failures_keep_their_meaning() -> None:
    async def cut(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.transport.abort()

    async def main() -> None:
        async with Server(cut) as server:
            provider = HttpProvider("mail", server.url, timeout=5)
            with pytest.raises(ProviderTimeout) as lost:  # may have landed: UNKNOWN
                await provider.asend({"n": 1}, operation_id="1:x", idempotency_key=None)
            assert not lost.value.not_sent
            await provider.aclose()
        refused = HttpProvider("mail", f"http://127.0.0.1:{free_port()}/send", timeout=5)
        with pytest.raises(ProviderUnavailable) as unsent:
            await refused.asend({"n": 1}, operation_id="1:x", idempotency_key=None)
        assert unsent.value.not_sent
        await refused.aclose()

    run(main())
