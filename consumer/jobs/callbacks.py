"""Delivery callbacks the connector simulator sends, signed, to an inbound endpoint.

``outbox-simulator serve --callback-url URL`` (with the shared secret in
``OUTBOX_INBOUND_SECRET`` or ``--callback-secret-file``) behaves like a mail provider with
webhooks: a while (``--callback-delay``, 0.5 s) after each effect it made, it tells
``URL/deliveries`` (``consumer.jobs.inbound``) what became of it, signed with HMAC-SHA256
of ``timestamp.body``:

- ``bounced`` when the request's ``"to"`` ends with ``.invalid`` (a reserved top-level
  domain: no such mailbox can exist), with ``detail`` ``"550 5.1.1 no such user"``;
- ``delivered`` otherwise.

The event id is ``sim-<ref>-<status>``: a callback retried (the endpoint was down, answered
5xx) is deduplicated there. Each is tried up to :data:`ATTEMPTS` times with backoff, from
one background thread; a simulator stopped before sending drops what is queued (a real
provider's webhook can be lost too: the receipt then simply has no delivery outcome).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from consumer.jobs.inbound import sign
from outbox.errors import ConfigError

__all__ = ["ATTEMPTS", "CallbackSender", "outcome_of", "read_secret"]

log = logging.getLogger("outbox.simulator")

ATTEMPTS = 5
BOUNCE_DETAIL = "550 5.1.1 no such user"


def read_secret(path: str | None) -> str:
    """The first line of ``path`` (the ``--callback-secret-file``); ``ConfigError`` when
    there is none, or it is shorter than the endpoint accepts."""
    secret = ""
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                secret = handle.readline().strip()
        except OSError as exc:
            problem = f"cannot read {path!r}: {exc.strerror}"
            raise ConfigError("callback_secret_file", problem) from None
    if len(secret) < 16:
        raise ConfigError("OUTBOX_INBOUND_SECRET", "--callback-url needs the endpoint's secret")
    return secret


def outcome_of(request: Any) -> str:
    """What becomes of an effect made for ``request`` (the module docstring's rule)."""
    to = request.get("to") if isinstance(request, dict) else None
    return "bounced" if isinstance(to, str) and to.lower().endswith(".invalid") else "delivered"


@dataclass(frozen=True)
class _Due:
    at: float
    operation_id: str
    ref: str
    status: str


class CallbackSender:
    """Sends each effect's delivery callback after ``delay`` seconds (module docstring)."""

    def __init__(self, url: str, secret: str, *, delay: float = 0.5, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/") + "/deliveries"
        self.secret = secret
        self.delay = delay
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[_Due | None] = queue.Queue()
        self._client = httpx.Client(timeout=timeout)
        self._thread = threading.Thread(target=self._run, name="sim-callbacks", daemon=True)
        self._thread.start()

    def effect(self, operation_id: str | None, ref: str, request: Any) -> None:
        """An effect was made: its callback goes out after the delay."""
        if operation_id:
            status = outcome_of(request)
            self._queue.put(_Due(time.time() + self.delay, operation_id, ref, status))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._client.close()

    def _run(self) -> None:
        while (due := self._queue.get()) is not None:
            wait = due.at - time.time()
            if wait > 0:
                time.sleep(wait)
            self._send(due)

    def _send(self, due: _Due) -> None:
        callback: dict[str, Any] = {
            "operation_id": due.operation_id,
            "status": due.status,
            "event_id": f"sim-{due.ref}-{due.status}",
            "ref": due.ref,
        }
        if due.status == "bounced":
            callback["detail"] = BOUNCE_DETAIL
        body = json.dumps(callback).encode()
        for attempt in range(ATTEMPTS):
            headers = {"Content-Type": "application/json", **sign(self.secret, body)}
            try:
                answer = self._client.post(self.url, content=body, headers=headers)
                if answer.status_code < 500:
                    if answer.status_code >= 400:
                        log.warning(
                            "delivery callback refused",
                            extra={"status": answer.status_code, "operation_id": due.operation_id},
                        )
                        self.failed += 1
                    else:
                        self.sent += 1
                    return
            except httpx.HTTPError as exc:
                log.info("delivery callback not sent yet", extra={"error": repr(exc)[:200]})
            time.sleep(min(5.0, 0.2 * 2**attempt))
        self.failed += 1
