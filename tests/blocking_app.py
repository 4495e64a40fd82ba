"""A user's own blocking provider, used as the docs show: ``outbox-worker run
tests.blocking_app:build``.

What a team adopting the toolkit writes first (issue 37): a class with ``send``/``lookup``
around a blocking client (here plain ``urllib``, a new connection per call, as a SendGrid or
SES SDK would make), registered with an ``Operations`` built apart from the worker, and a
plain ``def`` handler that dispatches through it. The worker itself has no providers.

The environment chooses: ``MAIL_URL`` (the simulator), ``SIM_TIMEOUT`` (the call timeout, 5
s), ``WORKER_TTL`` (the lease ttl, 5 s), ``SLOW_DOWN`` (how the provider says "slow down"
when the simulator answers 429: ``transient``, ``TransientFailure(..., retry_after=S)``,
the default; ``attribute``, an exception of its own with a ``retry_after`` attribute;
``unavailable``, ``ProviderUnavailable``), ``MAIL_RATE`` (its ``rate_limit``). Slots, tenant
limits and the database come from the command line and its ``OUTBOX_*`` variables.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from consumer import JobContext, Operations, ProviderTimeout, Store, TransientFailure, Worker
from consumer.errors import ProviderUnavailable


class SlowDown(Exception):
    """An SDK's own "too many requests" error: not ours, but it says when to call again."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PostMail:
    """The provider protocol around a blocking HTTP client (one connection per call)."""

    name = "postmail"
    supports_lookup = True
    supports_idempotency = True
    rate_limit: float | None = None  # calls/s for the fleet (MAIL_RATE)

    def __init__(self, url: str, *, timeout: float = 5.0, slow_down: str = "transient") -> None:
        self.url = url
        self.timeout = timeout
        self.slow_down = slow_down

    def _call(self, request: urllib.request.Request) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return dict(json.load(answer))
        except urllib.error.HTTPError as exc:
            if exc.code in (429, 503):
                seconds = float(exc.headers.get("Retry-After") or 1)
                raise self._too_many(exc.code, seconds) from None
            if exc.code == 404:
                return {}
            raise TransientFailure(f"HTTP {exc.code}", status=exc.code) from None
        except TimeoutError as exc:  # sent, no answer in time: the outcome is unknown
            raise ProviderTimeout(f"no answer in {self.timeout} s") from exc
        except urllib.error.URLError as exc:  # no connection: nothing was sent
            raise ProviderUnavailable(f"connect: {exc.reason}") from exc

    def _too_many(self, status: int, seconds: float) -> Exception:
        text = f"HTTP {status}: slow down for {seconds} s"
        if self.slow_down == "attribute":
            return SlowDown(text, seconds)
        if self.slow_down == "unavailable":
            return ProviderUnavailable(text, status=status, retry_after=seconds)
        return TransientFailure(text, status=status, retry_after=seconds)

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        headers = {"Content-Type": "application/json", "Operation-Id": operation_id}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        body = json.dumps(dict(request)).encode()
        made = urllib.request.Request(f"{self.url}/send", body, headers, method="POST")
        return str(self._call(made)["id"])

    def lookup(self, operation_id: str) -> str | None:
        found = self._call(urllib.request.Request(f"{self.url}/lookup/{operation_id}"))
        return str(found["id"]) if found.get("id") else None


def build() -> Worker:
    store = Store(os.environ["OUTBOX_DATABASE_URL"])
    mail = PostMail(
        os.environ["MAIL_URL"],
        timeout=float(os.environ.get("SIM_TIMEOUT", "5")),
        slow_down=os.environ.get("SLOW_DOWN", "transient"),
    )
    if os.environ.get("MAIL_RATE"):
        mail.rate_limit = float(os.environ["MAIL_RATE"])
    operations = Operations(store, {"postmail": mail})
    worker = Worker(
        store,
        ttl=float(os.environ.get("WORKER_TTL", "5")),
        recover_interval=0.2,
        poll_interval=0.05,
    )

    @worker.handler("email")
    def email(job: JobContext) -> None:
        operations.dispatch(job, "send", "postmail", {"to": job.subject, "job": job.job_id})

    return worker
