"""The consumer and the worker of the example, run by Django's commands:

    python manage.py outbox_relay run
    python manage.py outbox_consumer run quotes.pipeline:consumer
    python manage.py outbox_worker run quotes.pipeline:worker

The consumer runs on ``outbox.django.engine()``: its transaction is a Django ``atomic()`` block
on Django's connection, so the handler's ORM update commits with the inbox row and the job
(or not at all). The worker sends each quote's e-mail once, through a provider with a receipt.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage

import outbox.django
from consumer import ConsumedEvent, Consumer, ConsumerTx, JobContext, Store, Worker
from quotes.models import Quote

store = Store(outbox.django.database_url())  # the worker's own connections

consumer = Consumer(
    outbox.django.engine(),
    settings.REDIS_URL,
    group="mail",
    topics=["quote.approved"],
    stream=settings.OUTBOX_STREAM,
)


@consumer.handler("quote.approved")
def on_quote_approved(event: ConsumedEvent, tx: ConsumerTx) -> None:
    quote_id = event.data["quote"]
    Quote.objects.filter(pk=quote_id).update(mail_queued=True)  # the ORM, in tx's transaction
    store.enqueue(
        event.tenant or "default", f"send-quote-{quote_id}", payload=event.data, session=tx.session
    )


class DjangoMail:
    """A provider that sends through Django's e-mail backend. It offers neither a lookup nor
    an idempotency key: an unknown outcome (a worker killed mid-send) goes to review."""

    name = "mail"
    supports_lookup = False
    supports_idempotency = False
    timeout = 30.0

    def send(self, request: Any, *, operation_id: str, idempotency_key: str | None) -> str:
        message = EmailMessage(
            subject=f"Your quote {request['quote']}",
            body=f"Quote {request['quote']}: {request['total']} EUR, approved.",
            to=[request["email"]],
            headers={"X-Operation-Id": operation_id},
        )
        message.send()
        return operation_id

    def lookup(self, operation_id: str) -> str | None:
        return None


worker = Worker(store, providers={"mail": DjangoMail()})


@worker.handler("send-quote")
def send_quote(job: JobContext) -> None:
    job.dispatch("email", "mail", job.payload)
