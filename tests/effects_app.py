"""A worker app for the effects tests: ``outbox-worker run tests.effects_app:build``.

One ``email`` handler dispatching each job through an ``HttpProvider`` named by the job's
payload (``"provider"``: ``mail`` by default, or ``sms``). The environment chooses:
``MAIL_URL`` / ``SMS_URL`` (the simulators), ``MAIL_RATE`` (the mail provider's
``rate_limit``), ``HANDLER`` (``sync``: a ``def`` handler with ``job.dispatch``; ``async``: an
``async def`` one with ``await job.adispatch``), ``SIM_TIMEOUT`` (the call timeout),
``WORKER_TTL`` (the lease ttl, 5 s).
"""

from __future__ import annotations

import os
from typing import Any

from consumer import HttpProvider, JobContext, Worker


def _provider(name: str, url: str, rate: str | None) -> HttpProvider:
    return HttpProvider(
        name,
        f"{url}/send",
        lookup_url=f"{url}/lookup/{{operation_id}}",
        timeout=float(os.environ.get("SIM_TIMEOUT", "5")),
        rate_limit=float(rate) if rate else None,
    )


def build() -> Worker:
    providers: dict[str, Any] = {
        "mail": _provider("mail", os.environ["MAIL_URL"], os.environ.get("MAIL_RATE"))
    }
    if os.environ.get("SMS_URL"):
        providers["sms"] = _provider("sms", os.environ["SMS_URL"], None)
    worker = Worker(
        providers=providers,
        ttl=float(os.environ.get("WORKER_TTL", "5")),
        recover_interval=0.2,
        reconcile_interval=0.3,
        poll_interval=0.05,
    )

    def request(job: JobContext) -> tuple[str, dict[str, Any]]:
        payload = job.payload or {}
        return str(payload.get("provider", "mail")), {"to": job.subject, "job": job.job_id}

    if os.environ.get("HANDLER", "sync") == "async":

        @worker.handler("email")
        async def email_async(job: JobContext) -> None:
            provider, body = request(job)
            await job.adispatch("send", provider, body)

    else:

        @worker.handler("email")
        def email(job: JobContext) -> None:
            provider, body = request(job)
            job.dispatch("send", provider, body)

    return worker
