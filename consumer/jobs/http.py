"""``HttpProvider``: the Provider protocol over HTTP (``send``/``lookup`` on a synchronous
``httpx.Client``; ``asend``/``alookup`` on the lean asyncio client of ``consumer.jobs.wire``).

A real provider (email, payments, CRM) is an HTTP API. ``HttpProvider`` POSTs the request as
JSON to ``send_url`` and reads the provider's reference from a JSON field of the answer
(``ref_field``, ``"id"`` by default; a dotted path such as ``"data.id"`` reaches into
nested objects). Every call carries ``headers`` and the operation id (``Operation-Id``),
and, when ``idempotency_header`` is not None, the idempotency key in that header: the IETF
``Idempotency-Key`` draft and Stripe's practice are the convention, and a provider that
honours it turns a resend into a replay of the first answer.

The capabilities follow from the arguments: ``supports_idempotency`` when
``idempotency_header`` is set, ``supports_lookup`` when ``lookup_url`` is given.
``lookup_url`` is a template with ``{operation_id}``; 200 means found (the reference from
``ref_field``), 404 means not found.

How an answer becomes a receipt (``consumer.jobs.operations`` records it):

====================================================  =======================================
what happened                                         raised / returned (receipt)
====================================================  =======================================
connect error, pool timeout (nothing was sent)        ``ProviderUnavailable`` (NOT_SENT)
read timeout, connection reset after sending          ``ProviderTimeout`` (UNKNOWN)
2xx                                                   the reference (ACCEPTED)
2xx without a readable reference                      ``ProviderOutcomeUnknown`` (UNKNOWN)
400, 422 (and other 4xx but 408/409/429)              ``PermanentFailure`` (FAILED)
401, 403                                              ``AuthFailure``, ``not_sent`` (NOT_SENT)
409 (a reused key with another body)                  ``PermanentFailure`` naming the conflict
408, 429, 503                                         ``ProviderUnavailable`` + ``retry_after``
other 5xx (the request may have taken effect)         ``ProviderOutcomeUnknown`` (UNKNOWN)
====================================================  =======================================

Errors carry ``status`` (the HTTP status), ``provider`` (the name), ``not_sent`` (True when
the provider certainly did not act: 401/403/408/429/503 and connect errors) and
``retry_after`` (seconds, from ``Retry-After`` given as seconds or as an HTTP date).

``timeout`` bounds the whole call, measured from its start: what waiting for a pooled
connection and connecting took comes off the wait for the answer (set through httpcore's
``trace`` hook just before the first byte is written; a call with no time left then is not
sent), and the body is streamed with the same deadline. It is also declared to
``Operations`` (``provider.timeout``), which records the call's deadline in the intent so that
no reconciler looks the operation up while the call may still be in flight. (A transport
of your own that is not httpcore's keeps httpx's per-phase timeouts only.)

``asend``/``alookup`` are the same calls for ``async def`` handlers (``await
job.adispatch(...)``), on the lean HTTP/1.1 client of ``consumer.jobs.wire`` (h11 over
asyncio streams, about a fifth of ``httpx.AsyncClient``'s CPU per call), made on first use
in the worker's event loop and bounded by one ``asyncio.timeout``; a URL that a proxy
variable (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, not exempted by ``NO_PROXY``)
applies to goes through an ``httpx.AsyncClient`` instead, which speaks to proxies. A
``client`` passed in is the sync client only.

``rate_limit`` (calls per second for the whole fleet, None: none) is read by ``Operations``
(``consumer.jobs.limits``), which spaces the calls of every worker; a call that could write
its first byte only past the start reserved for it is not sent (``StartMissed``: Operations
reserves a new start). A 429/503 with ``Retry-After`` pauses the provider for every worker.
``max_connections`` (256) bounds the connections kept alive: as many as a worker's slots may
call at once (the sync client's are spread over clients of ``SHARD`` (16) connections each:
httpcore scans a pool's connections on every request).

The mapping of answers and transport failures lives in :mod:`consumer.jobs.http_answers`
(``parse_retry_after`` is importable from here too, as before the split), and the checks of
the arguments in :mod:`consumer.jobs.http_checks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit
from urllib.request import (  # type: ignore[attr-defined]  # untyped in typeshed
    getproxies_environment,
    proxy_bypass_environment,
)

from consumer.errors import (
    OperationError,
    PermanentFailure,
    ProviderTimeout,
    ProviderUnavailable,
)
from consumer.jobs.http_answers import lookup_result, lookup_silent, send_result, transport_error
from consumer.jobs.http_answers import parse_retry_after as parse_retry_after
from consumer.jobs.http_checks import check_provider_arguments
from consumer.jobs.limits import StartMissed, send_by
from consumer.jobs.wire import LostAfterSend, NotSent, WirePool
from outbox import tracing
from outbox.display import display_url
from outbox.extras import optional_module, require

if TYPE_CHECKING:
    import httpx
else:  # the [http] extra: this module imports without it, HttpProvider(...) names it
    httpx = optional_module("httpx", "http", "HttpProvider")

#: Connections per pooled client: a provider's ``max_connections`` are spread over
#: ``max_connections / SHARD`` clients (see ``HttpProvider.__init__``).
SHARD = 16

USER_AGENT = "outbox-toolkit HttpProvider"

#: The largest answer body read (a reference is small; a provider sending megabytes is broken).
MAX_BODY_BYTES = 1 << 20


class HttpProvider:
    """A provider reached over HTTP (see the module docstring for the status mapping).

    ``client``: an ``httpx.Client`` of your own (proxies, TLS, transports, mounts); the
    provider then never closes it. Without one, the provider owns a client with keep-alive
    connections, shared safely by a worker's threads; ``close()`` (or ``with``) releases it.
    """

    def __init__(
        self,
        name: str,
        send_url: str,
        *,
        lookup_url: str | None = None,
        idempotency_header: str | None = "Idempotency-Key",
        timeout: float = 5.0,
        headers: Mapping[str, str] | None = None,
        client: httpx.Client | None = None,
        ref_field: str = "id",
        operation_id_header: str = "Operation-Id",
        rate_limit: float | None = None,
        max_connections: int = 256,
    ) -> None:
        require("http", "HttpProvider")
        check_provider_arguments(
            name,
            send_url,
            lookup_url=lookup_url,
            idempotency_header=idempotency_header,
            timeout=timeout,
            headers=headers,
            client=client,
            ref_field=ref_field,
            operation_id_header=operation_id_header,
            rate_limit=rate_limit,
            max_connections=max_connections,
        )

        self.name = name
        self.send_url = send_url
        self.lookup_url = lookup_url
        self.idempotency_header = idempotency_header
        self.operation_id_header = operation_id_header
        self.timeout = float(timeout)
        self.headers: dict[str, str] = dict(headers or {})
        self.ref_field = ref_field
        self.supports_lookup = lookup_url is not None
        self.supports_idempotency = idempotency_header is not None
        self.rate_limit = None if rate_limit is None else float(rate_limit)
        # A worker's slots may all call one provider at once: as many connections, kept alive
        # (a new TCP connection per call costs more CPU than the call itself).
        # Spread over clients of SHARD connections each: httpcore assigns requests to a
        # pool's connections by scanning them all on every request and every close, so
        # one pool of 256 spent 58 % of a loaded async worker's CPU there (34 ms per
        # effect), and a sync one's 256 threads queued on the pool's one lock.
        per = min(SHARD, max_connections)
        self._limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        self._shards = max(1, -(-max_connections // SHARD))
        self._owns_client = client is None
        self.client = client if client is not None else self._new_client()
        self._clients: list[httpx.Client] = [self.client]
        self._busy: list[int] = [0]
        self._pick = threading.Lock()
        self._aclient: httpx.AsyncClient | None = None
        self._aclients: list[httpx.AsyncClient] = []
        self._abusy: list[int] = []
        self._aclient_loop: asyncio.AbstractEventLoop | None = None
        self._max_connections = int(max_connections)
        self._wire_pool: WirePool | None = None
        self._wire_loop: asyncio.AbstractEventLoop | None = None
        self._via_proxy: dict[str, bool] = {}  # origin -> a proxy variable applies to it

    def _new_client(self) -> httpx.Client:
        return httpx.Client(
            timeout=httpx.Timeout(self.timeout),
            limits=self._limits,
            headers={"User-Agent": USER_AGENT},
        )

    @contextlib.contextmanager
    def _sync_client(self) -> Iterator[httpx.Client]:
        """The least busy of the provider's clients (made as the calls need them); a client
        passed in is used as given."""
        if not self._owns_client:
            yield self.client
            return
        with self._pick:
            index = min(range(len(self._busy)), key=self._busy.__getitem__)
            if self._busy[index] >= SHARD and len(self._clients) < self._shards:
                self._clients.append(self._new_client())
                self._busy.append(0)
                index = len(self._clients) - 1
            self._busy[index] += 1
        try:
            yield self._clients[index]
        finally:
            with self._pick:
                self._busy[index] -= 1

    def __repr__(self) -> str:
        return (
            f"HttpProvider({self.name!r}, {self.send_url!r}, lookup={self.supports_lookup}, "
            f"idempotency={self.supports_idempotency})"
        )

    # -- the Provider protocol ----------------------------------------------------------------
    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        """POST the request; return the provider's reference (see the mapping above)."""
        headers, body = self._send_request(request, operation_id, idempotency_key)
        answer = self._exchange("POST", self.send_url, headers, body)
        return send_result(self.name, self.ref_field, *answer)

    async def asend(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        """:meth:`send` on ``httpx.AsyncClient`` (``Operations.adispatch`` calls it)."""
        headers, body = self._send_request(request, operation_id, idempotency_key)
        answer = await self._aexchange("POST", self.send_url, headers, body)
        return send_result(self.name, self.ref_field, *answer)

    def lookup(self, operation_id: str) -> str | None:
        """GET ``lookup_url``: the reference of the effect made for ``operation_id``, or None.

        A lookup sends nothing, so every failure here is one to retry later (or a
        misconfiguration: ``PermanentFailure`` / ``AuthFailure``); it never makes a receipt
        UNKNOWN.
        """
        url = self._lookup_url(operation_id)
        try:
            answer = self._exchange("GET", url, self._headers(operation_id), None)
        except ProviderTimeout as exc:  # nothing to be unsure about: a lookup acts on nothing
            raise lookup_silent(self.name, exc) from None
        return lookup_result(self.name, self.ref_field, *answer)

    async def alookup(self, operation_id: str) -> str | None:
        """:meth:`lookup` on ``httpx.AsyncClient``."""
        url = self._lookup_url(operation_id)
        try:
            answer = await self._aexchange("GET", url, self._headers(operation_id), None)
        except ProviderTimeout as exc:
            raise lookup_silent(self.name, exc) from None
        return lookup_result(self.name, self.ref_field, *answer)

    def _send_request(
        self, request: Mapping[str, Any], operation_id: str, idempotency_key: str | None
    ) -> tuple[dict[str, str], bytes]:
        try:
            body = json.dumps(request, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise PermanentFailure(
                f"{self.name}: request is not JSON-serialisable ({exc})", provider=self.name
            ) from None
        headers = self._headers(operation_id)
        headers["Content-Type"] = "application/json"
        if self.idempotency_header is not None and idempotency_key is not None:
            headers[self.idempotency_header] = idempotency_key
        return headers, body

    def _lookup_url(self, operation_id: str) -> str:
        if self.lookup_url is None:
            raise OperationError(f"provider {self.name!r} has no lookup_url")
        return self.lookup_url.format(operation_id=quote(operation_id, safe=""))

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the client this provider created (a client passed in stays open)."""
        if self._owns_client:
            for client in self._clients:
                client.close()
        aclients, self._aclients, self._aclient = self._aclients, [], None
        wire, self._wire_pool = self._wire_pool, None
        for closing, loop in (
            (_aclose_all(aclients) if aclients else None, self._aclient_loop),
            (wire.aclose() if wire is not None else None, self._wire_loop),
        ):
            if closing is not None:
                _close_on(loop, closing)

    async def aprepare(self) -> None:
        """Make the async client (and, for a proxied URL, load httpx's async transport)
        before the first call (the worker does it when its loop starts): a cold httpx client
        took ~1 s on a busy machine for its first calls, which then reached the provider
        together, out of the spacing of a rate limit."""
        if self._proxied(self.send_url):
            import anyio  # noqa: F401 - loaded here rather than inside the first call
            import httpcore._backends.anyio  # noqa: F401

            self._async_client()
        else:
            self._wire()

    async def aclose(self) -> None:
        """Close the async clients (the worker does it when its event loop stops)."""
        aclients, self._aclients, self._aclient = self._aclients, [], None
        await _aclose_all(aclients)
        wire, self._wire_pool = self._wire_pool, None
        if wire is not None:
            await wire.aclose()

    def __enter__(self) -> HttpProvider:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _headers(self, operation_id: str) -> dict[str, str]:
        headers = dict(self.headers)
        headers[self.operation_id_header] = operation_id
        tracing.inject_http(headers)  # traceparent: the dispatch span's context
        return headers

    def _exchange(
        self, method: str, url: str, headers: dict[str, str], body: bytes | None
    ) -> tuple[int, Any, float | None]:
        """One request: (status, the JSON answer or None, Retry-After seconds).

        Transport errors are sorted by whether the request can have left this process: a
        failure to connect (or to get a pooled connection) happens before any byte is
        written, everything after may have reached the provider.
        """
        started = time.monotonic()
        deadline = started + self.timeout

        def budget(event: str, info: dict[str, Any]) -> None:
            # httpcore's trace hook runs just before the first byte is written: whatever the
            # pool and the connect took comes off the wait for the answer, so the call ends
            # by ``timeout`` after it began (the deadline Operations recorded), and a call
            # with no time left is not sent at all.
            if not event.endswith("send_request_headers.started"):
                return
            now = time.monotonic()
            by = send_by()
            if by is not None and now > by:  # past the start a rate limit reserved
                raise StartMissed
            left = deadline - now
            if left <= 0:
                raise _NoTimeLeft
            timeouts = getattr(info.get("request"), "extensions", {}).get("timeout")
            if isinstance(timeouts, dict):
                timeouts["write"] = left
                timeouts["read"] = left

        try:
            with (
                self._sync_client() as client,
                client.stream(
                    method,
                    url,
                    headers=headers,
                    content=body,
                    timeout=self.timeout,
                    extensions={"trace": budget},
                ) as response,
            ):
                chunks: list[bytes] = []
                size = 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        break  # the status is what matters; a huge body is not a reference
                    chunks.append(chunk)
                    if time.monotonic() - started > self.timeout:
                        raise ProviderTimeout(
                            f"{self.name}: {method} {display_url(url)}: answer still arriving "
                            f"after {self.timeout:g} s",
                            provider=self.name,
                            status=response.status_code,
                        )
                status = response.status_code
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
        except _NoTimeLeft:
            raise ProviderUnavailable(
                f"{self.name}: {method} {display_url(url)}: not sent (connecting took the whole "
                f"{self.timeout:g} s)",
                provider=self.name,
            ) from None
        except httpx.TransportError as exc:
            raise transport_error(self.name, self.timeout, exc, method, url) from None
        raw = b"".join(chunks)
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = None
        return status, payload, retry_after

    def _async_client(self) -> httpx.AsyncClient:
        """The first async client of this event loop (a client's connections belong to the
        loop that opened them; a worker has one loop, so they are made once)."""
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aclient_loop is not loop:
            self._aclients = [
                httpx.AsyncClient(
                    timeout=httpx.Timeout(self.timeout),
                    limits=self._limits,
                    headers={"User-Agent": USER_AGENT},
                )
                for _ in range(self._shards)
            ]
            self._abusy = [0] * self._shards
            self._aclient = self._aclients[0]
            self._aclient_loop = loop
        return self._aclient

    @contextlib.contextmanager
    def _least_busy_async(self) -> Iterator[httpx.AsyncClient]:
        self._async_client()
        index = min(range(len(self._abusy)), key=self._abusy.__getitem__)
        self._abusy[index] += 1  # the loop's thread only: no lock
        try:
            yield self._aclients[index]
        finally:
            if index < len(self._abusy):
                self._abusy[index] -= 1

    def _proxied(self, url: str) -> bool:
        """:func:`proxied`, read once per origin (the environment is read at the first call
        to it, not at every call: that read was 6 % of a loaded async worker's time)."""
        origin = "/".join(url.split("/", 3)[:3])  # scheme://host:port
        known = self._via_proxy.get(origin)
        if known is None:
            known = self._via_proxy[origin] = proxied(url)
        return known

    def _wire(self) -> WirePool:
        """This event loop's pool of the lean client (``consumer.jobs.wire``), made once."""
        loop = asyncio.get_running_loop()
        if self._wire_pool is None or self._wire_loop is not loop:
            self._wire_pool = WirePool(
                self._max_connections,
                headers={"User-Agent": USER_AGENT},
                ssl_context=httpx.create_ssl_context,
            )
            self._wire_loop = loop
        return self._wire_pool

    async def _aexchange(
        self, method: str, url: str, headers: dict[str, str], body: bytes | None
    ) -> tuple[int, Any, float | None]:
        """:meth:`_exchange` on the event loop, on the lean client (``consumer.jobs.wire``;
        httpx where a proxy variable applies to the URL). The whole call is bounded by one
        ``asyncio.timeout(timeout)``; whether its first byte was written sorts a failure
        into "not sent" (NOT_SENT) or "may have landed" (UNKNOWN) exactly as the sync form
        does."""
        if self._proxied(url):
            return await self._aexchange_httpx(method, url, headers, body)
        sent = False
        by = send_by()

        def before_send() -> None:
            nonlocal sent
            if by is not None and time.monotonic() > by:  # past its reserved start
                raise StartMissed
            sent = True

        what = f"{self.name}: {method} {display_url(url)}"
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self._wire().request(
                    method, url, headers, body, max_body=MAX_BODY_BYTES, before_send=before_send
                )
        except TimeoutError:
            if not sent:
                raise ProviderUnavailable(
                    f"{what}: not sent (connecting took the whole {self.timeout:g} s)",
                    provider=self.name,
                ) from None
            raise ProviderTimeout(
                f"{what}: no answer within {self.timeout:g} s", provider=self.name
            ) from None
        except NotSent as exc:
            raise ProviderUnavailable(f"{what}: not sent ({exc})", provider=self.name) from None
        except LostAfterSend as exc:
            raise ProviderTimeout(
                f"{what}: connection lost after sending ({exc})", provider=self.name
            ) from None
        try:
            payload = json.loads(answer.body) if answer.body else None
        except ValueError:
            payload = None
        return answer.status, payload, parse_retry_after(answer.headers.get("retry-after"))

    async def _aexchange_httpx(
        self, method: str, url: str, headers: dict[str, str], body: bytes | None
    ) -> tuple[int, Any, float | None]:
        """:meth:`_aexchange` on ``httpx.AsyncClient``, for a URL reached through a proxy
        (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``; ``NO_PROXY`` exempts a host): httpx
        speaks to proxies, the lean client does not. The trace hook notes when the first
        byte is about to be written."""
        sent = False

        by = send_by()

        async def trace(event: str, info: dict[str, Any]) -> None:
            nonlocal sent
            if event.endswith("send_request_headers.started"):
                if by is not None and time.monotonic() > by:  # past its reserved start
                    raise StartMissed
                sent = True

        try:
            with self._least_busy_async() as client:
                async with asyncio.timeout(self.timeout):
                    response = await client.request(
                        method, url, headers=headers, content=body, extensions={"trace": trace}
                    )
        except TimeoutError:
            if not sent:
                raise ProviderUnavailable(
                    f"{self.name}: {method} {display_url(url)}: not sent (connecting took the "
                    f"whole {self.timeout:g} s)",
                    provider=self.name,
                ) from None
            raise ProviderTimeout(
                f"{self.name}: {method} {display_url(url)}: no answer within {self.timeout:g} s",
                provider=self.name,
            ) from None
        except httpx.TransportError as exc:
            raise transport_error(self.name, self.timeout, exc, method, url) from None
        raw = response.content[:MAX_BODY_BYTES]
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = None
        return response.status_code, payload, parse_retry_after(response.headers.get("Retry-After"))


def proxied(url: str) -> bool:
    """Whether a proxy variable of the environment applies to ``url`` (as httpx reads them:
    ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``, exempted by ``NO_PROXY``)."""
    proxies = getproxies_environment()
    if not proxies:
        return False
    parts = urlsplit(url)
    if parts.scheme not in proxies and "all" not in proxies:
        return False
    return not proxy_bypass_environment(parts.hostname or "", proxies)


def _close_on(loop: asyncio.AbstractEventLoop | None, closing: Coroutine[Any, Any, None]) -> None:
    """Run ``closing`` on the loop its connections belong to; where that loop is gone there
    is nothing left to release."""
    try:
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(closing, loop)
            return
        if loop is not None and not loop.is_closed():
            loop.run_until_complete(closing)
            return
    except RuntimeError:  # closed meanwhile, or run from inside it: nothing to wait for
        pass
    closing.close()


async def _aclose_all(clients: list[httpx.AsyncClient]) -> None:
    for client in clients:
        with contextlib.suppress(Exception):  # closing is best effort
            await client.aclose()


class _NoTimeLeft(Exception):
    """Raised from the trace hook: the call's time was spent before anything was sent."""
