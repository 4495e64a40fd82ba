"""The signed inbound endpoint: replies and delivery callbacks over HTTP (issue 38).

An ASGI app a user mounts in their FastAPI or Starlette application, or runs alone with
``outbox-worker inbound serve``::

    from consumer.jobs.inbound import InboundApp

    inbound = InboundApp(store, secret=os.environ["OUTBOX_INBOUND_SECRET"])
    app.mount("/outbox", inbound)        # FastAPI / Starlette

Routes (``POST``, JSON bodies):

- ``/replies``: ``{"job": 17 | {"tenant": "studio", "action": "send-quote-17"}, "reply_id":
  "...", "payload": ..., "source": "..."}`` -> ``Store.reply``; answers ``{"job_id",
  "reply_id", "duplicate", "resumed", "state", "kept"}``. A reply naming a ``{tenant,
  action}`` not enqueued yet is kept for the job's first run: **202** with ``"kept": true``
  (``job_id`` and ``state`` null).
- ``/deliveries``: ``{"operation_id", "status", "event_id", "ref", "detail"}`` ->
  ``Operations.record_delivery``; answers ``{"event_id", "operation_id", "duplicate",
  "applied", "delivery_status", "woke", "kept"}``: **202** with ``"kept": true`` for a
  callback whose receipt is not ACCEPTED yet (kept, applied when it is).
- ``/webhooks/{name}``: a provider's own webhook (its own signature scheme), verified by the
  :class:`Webhook` the user registered under ``name``, then its ``parse`` turns the body into
  delivery callbacks (each as ``/deliveries`` takes them).
- ``GET /healthz``: ``{"ok": true}``, unauthenticated (a probe); ``GET /openapi.json``:
  this API's OpenAPI description (:mod:`consumer.jobs.inbound_openapi`), unauthenticated.

**Signatures** (``/replies``, ``/deliveries``): the sender puts the unix time in
``X-Outbox-Timestamp`` and ``v1=`` + hex HMAC-SHA256 of ``f"{timestamp}.{body}"`` with the
shared secret in ``X-Outbox-Signature`` (:func:`sign` computes both). Several secrets may be
given (a rotation: any of them verifies), and secrets per tenant that scope a request to
its tenant's jobs (``tenant_secrets``, ``X-Outbox-Tenant``:
:mod:`consumer.jobs.inbound_scope`). A request is refused with **401 and no reason** (the
same body whatever failed: a missing or malformed header, a wrong signature, a timestamp
more than ``window`` seconds (300) away from this server's clock, in either direction)
before its body is parsed. A replayed request within the window is harmless: both routes
are idempotent on the callback's own id (``reply_id`` per job, ``event_id``), and the answer
says ``duplicate``.

**Bounds**: a body over ``max_body`` bytes (64 KiB) is refused with 413 before it is read
whole (the declared length first, then while streaming). After authentication, bad input
is a 400 naming the field, an unknown job id 404; a database outage is a 503 with
``Retry-After`` (the sender retries: nothing was recorded). Bad input is never a 5xx or a
503 (issue 53): the timestamp and the length are read as ASCII digits, the body through the
JSON gate (bounded depth, no NUL, no lone surrogate), a job id within a BIGINT, and a value
the database still refuses (``DataError``) is a 400, never an outage to retry.

The database work runs in a thread (the store is synchronous); one process answers a few
thousand signed callbacks per second (docs/how-to/replies.md has the measurement).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DataError, SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from consumer.errors import JobError, JobNotFound
from consumer.jobs.inbound_openapi import openapi
from consumer.jobs.inbound_scope import Keys, Secrets, check_delivery, check_reply
from consumer.jobs.operations import Operations
from consumer.jobs.store import Store
from outbox.errors import ConfigError
from outbox.logs import fields
from outbox.validate import INT64_MAX, int_problem, load_json

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_WINDOW",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "InboundApp",
    "Webhook",
    "sign",
    "verify",
]

log = logging.getLogger("outbox.inbound")

TIMESTAMP_HEADER = "X-Outbox-Timestamp"
SIGNATURE_HEADER = "X-Outbox-Signature"
DEFAULT_WINDOW = 300.0
"""Seconds a signed request stays valid either side of this server's clock (replays)."""
DEFAULT_MAX_BODY = 64 * 1024
"""The largest body accepted, in bytes."""
_VERSION = "v1="


def sign(secret: str | bytes, body: bytes, *, timestamp: float | None = None) -> dict[str, str]:
    """The headers that sign ``body`` now (or at ``timestamp``): what a sender adds."""
    stamp = str(int(time.time() if timestamp is None else timestamp))
    key = secret.encode() if isinstance(secret, str) else secret
    digest = hmac.new(key, stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: _VERSION + digest}


def verify(
    secrets: Sequence[bytes],
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float,
    window: float = DEFAULT_WINDOW,
) -> bool:
    """Whether ``headers`` sign ``body`` with one of ``secrets`` within ``window`` of
    ``now`` (constant-time comparison)."""
    stamp = headers.get(TIMESTAMP_HEADER.lower()) or headers.get(TIMESTAMP_HEADER)
    signature = headers.get(SIGNATURE_HEADER.lower()) or headers.get(SIGNATURE_HEADER)
    # ASCII digits only: str.isdigit passes "²" and other scripts' digits, which int()
    # then refuses (a 500 before authentication).
    if not stamp or not signature or int_problem(stamp, minimum=0, maximum=10**12) is not None:
        return False
    if abs(now - int(stamp)) > window:
        return False
    offered = [part.strip() for part in signature.split(",")]
    signed = stamp.encode() + b"." + body
    for key in secrets:
        expected = _VERSION + hmac.new(key, signed, hashlib.sha256).hexdigest()
        if any(hmac.compare_digest(expected, one) for one in offered):
            return True
    return False


@dataclass(frozen=True)
class Webhook:
    """A provider's own webhook: ``verify(headers, body) -> bool`` checks its signature
    scheme (headers with lower-case names); ``parse(body) -> callbacks`` turns its body into
    delivery callbacks, each a mapping of ``operation_id``, ``status``, ``event_id`` and
    optionally ``ref`` and ``detail`` (default: the body is one such JSON object, or a
    list of them)."""

    verify: Callable[[Mapping[str, str], bytes], bool]
    parse: Callable[[bytes], Iterable[Mapping[str, Any]]] | None = None


class _Refused(Exception):
    def __init__(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers


class InboundApp:
    """The inbound endpoint as an ASGI application (module docstring).

    ``store``: the job store (replies); ``operations``: where delivery callbacks go (default
    ``Operations(store)``: no providers are needed to record them). ``secret``: the shared
    secret, or several (None: only ``tenant_secrets``). ``tenant_secrets``: tenant -> its
    secret or several; a request naming its tenant in ``X-Outbox-Tenant`` is verified with
    those and reaches that tenant's jobs only (:mod:`consumer.jobs.inbound_scope`).
    ``webhooks``: name -> :class:`Webhook`. ``clock``: unix seconds for the window (default
    ``time.time``)."""

    def __init__(
        self,
        store: Store,
        secret: Secrets | None,
        *,
        tenant_secrets: Mapping[str, Secrets] | None = None,
        operations: Operations | None = None,
        webhooks: Mapping[str, Webhook] | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        window: float = DEFAULT_WINDOW,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(store, Store):
            raise ConfigError("store", f"must be a Store, got {type(store).__name__}")
        self.store = store
        self.keys = Keys.build(secret, tenant_secrets)
        self.secrets = self.keys.shared
        self.operations = operations if operations is not None else Operations(store)
        self.webhooks = dict(webhooks or {})
        for name, hook in self.webhooks.items():
            if not isinstance(hook, Webhook):
                raise ConfigError("webhooks", f"{name!r}: must be a Webhook")
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
            raise ConfigError("max_body", f"must be a positive number of bytes, got {max_body!r}")
        if isinstance(window, bool) or not isinstance(window, (int, float)) or window <= 0:
            raise ConfigError("window", f"must be a positive number of seconds, got {window!r}")
        self.max_body = max_body
        self.window = float(window)
        self.clock = clock or time.time
        self.app = Starlette(
            routes=[
                Route("/replies", self._replies, methods=["POST"]),
                Route("/deliveries", self._deliveries, methods=["POST"]),
                Route("/webhooks/{name}", self._webhook, methods=["POST"]),
                Route("/healthz", self._health, methods=["GET"]),
                Route("/openapi.json", self._description, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    # -- routes ---------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def _description(self, request: Request) -> Response:
        return JSONResponse(openapi())

    async def _replies(self, request: Request) -> Response:
        return await self._answer(request, None, self._reply)

    async def _deliveries(self, request: Request) -> Response:
        return await self._answer(request, None, self._delivery)

    async def _webhook(self, request: Request) -> Response:
        hook = self.webhooks.get(request.path_params["name"])
        if hook is None:
            return JSONResponse({"error": "no such webhook"}, status_code=404)
        return await self._answer(request, hook, self._hooked(hook))

    async def _answer(
        self,
        request: Request,
        hook: Webhook | None,
        work: Callable[[Any, str | None], dict[str, Any]],
    ) -> Response:
        try:
            body = await self._body(request)
            headers = {k.lower(): v for k, v in request.headers.items()}
            tenant = None
            if hook is not None:
                trusted = await run_in_threadpool(_hook_verifies, hook, headers, body)
            else:
                keys, tenant = self.keys.for_request(headers)
                trusted = verify(keys, headers, body, now=self.clock(), window=self.window)
            if not trusted:
                raise _Refused(401, {"error": "unauthorized"})  # never why
            data = body if hook is not None else _json(body)
            result = await run_in_threadpool(work, data, tenant)
        except _Refused as refused:
            return JSONResponse(refused.body, refused.status, headers=refused.headers)
        except JobError as exc:
            return JSONResponse({"error": str(exc), "field": exc.field}, status_code=400)
        except JobNotFound as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except DataError as exc:  # input the gates missed: never an outage to retry
            log.warning(
                "inbound input refused by the database", extra=fields(error=repr(exc)[:300])
            )
            return JSONResponse({"error": "the database refused this input"}, status_code=400)
        except SQLAlchemyError as exc:
            log.warning("inbound request not recorded", extra=fields(error=repr(exc)[:300]))
            return JSONResponse(
                {"error": "database unavailable"}, status_code=503, headers={"Retry-After": "1"}
            )
        # 202: a reply to a job not enqueued yet, or a callback before its receipt: kept for
        # later (nothing acted on it yet).
        return JSONResponse(result, status_code=202 if result.get("kept") else 200)

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        too_large = _Refused(413, {"error": f"body over {self.max_body} bytes"})
        if declared is not None and int_problem(declared, minimum=0, maximum=self.max_body):
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    # -- the work (in a thread) -------------------------------------------------------------

    def _reply(self, data: Any, tenant: str | None) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise JobError("body", "must be a JSON object")
        check_reply(self.store, data, tenant)  # scoped: that tenant's jobs only
        job: Any = data.get("job")
        action: Any = None
        if isinstance(job, dict):
            job, action = job.get("tenant"), job.get("action")
        elif isinstance(job, bool) or not isinstance(job, int) or not 1 <= job <= INT64_MAX:
            raise JobError("job", "must be a job id (1 to 2**63-1) or {tenant, action}")
        if "payload" not in data:
            raise JobError("payload", "is required (null is a payload)")
        result = self.store.reply(
            job,
            action,
            payload=data["payload"],
            reply_id=data.get("reply_id"),  # type: ignore[arg-type]  # checked by reply
            source=data.get("source"),
        )
        return {
            "job_id": result.job_id,
            "reply_id": result.reply_id,
            "duplicate": result.duplicate,
            "resumed": result.resumed,
            "state": result.state,
            "kept": result.kept,
        }

    def _delivery(self, data: Any, tenant: str | None) -> dict[str, Any]:
        if not isinstance(data, Mapping):
            raise JobError("body", "must be a JSON object")
        unknown = set(data) - {"operation_id", "status", "event_id", "ref", "detail"}
        if unknown:
            raise JobError("body", f"unknown fields {sorted(unknown)}")
        check_delivery(self.store, data, tenant)  # scoped: that tenant's operations only
        result = self.operations.record_delivery(
            data.get("operation_id"),  # type: ignore[arg-type]  # checked by record_delivery
            data.get("status"),  # type: ignore[arg-type]
            ref=data.get("ref"),
            detail=data.get("detail"),
            event_id=data.get("event_id"),  # type: ignore[arg-type]
        )
        return {
            "event_id": result.event_id,
            "operation_id": result.operation_id,
            "duplicate": result.duplicate,
            "applied": result.applied,
            "delivery_status": result.delivery_status,
            "woke": result.woke,
            "kept": result.kept,
        }

    def _hooked(self, hook: Webhook) -> Callable[[Any, str | None], dict[str, Any]]:
        def work(body: bytes, tenant: str | None) -> dict[str, Any]:
            try:
                items = hook.parse(body) if hook.parse is not None else _json(body)
            except (ValueError, TypeError, RecursionError) as exc:  # the parser's refusal
                raise JobError("body", f"the webhook's parser refused it: {exc}"[:300]) from None
            if isinstance(items, Mapping):
                items = [items]
            if not isinstance(items, Iterable) or isinstance(items, (str, bytes)):
                raise JobError("body", "must be a callback or a list of them")
            return {"deliveries": [self._delivery(item, tenant) for item in items]}

        return work


def _hook_verifies(hook: Webhook, headers: Mapping[str, str], body: bytes) -> bool:
    try:
        return hook.verify(headers, body) is True
    except Exception as exc:  # a verifier that cannot read the request refuses it
        log.info("webhook not verified", extra=fields(error=repr(exc)[:300]))
        return False


def _json(body: bytes) -> Any:
    """The body through the JSON gate (``outbox.validate.load_json``): not JSON, nested too
    deep (a ``RecursionError`` was a 500), a NUL or a lone surrogate anywhere (the database
    refused them: a 503 the sender retried for ever) are a 400 naming the body."""
    try:
        return load_json(body)
    except ValueError as exc:
        raise JobError("body", str(exc)) from None
