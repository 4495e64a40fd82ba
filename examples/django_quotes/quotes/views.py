"""Approve a quote: the state change and its event in one ``transaction.atomic()``."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

import outbox.django
from quotes.models import Quote


@outbox.django.transactional
def approve_quote(tx: outbox.django.Transaction, quote_id: int) -> Quote:
    # The row lock serialises approvals of one quote, so its events keep commit order.
    quote = get_object_or_404(Quote.objects.select_for_update(), pk=quote_id)
    if quote.state != "approved":
        quote.state = "approved"
        quote.save(update_fields=["state"])
        tx.emit(
            "quote.approved",
            key=f"quote-{quote.pk}",
            payload={"quote": quote.pk, "email": quote.email, "total": str(quote.total)},
            tenant="studio",
            identity=f"studio:send-quote-{quote.pk}",  # one email per quote, however often
        )
    return quote


@csrf_exempt  # an example: a real app keeps CSRF and authentication
@require_POST
def approve(request: HttpRequest, quote_id: int) -> JsonResponse:
    quote = approve_quote(quote_id)
    return JsonResponse({"quote": quote.pk, "state": quote.state})


def show(request: HttpRequest, quote_id: int) -> JsonResponse:
    quote = get_object_or_404(Quote, pk=quote_id)
    return JsonResponse({"quote": quote.pk, "state": quote.state, "mail_queued": quote.mail_queued})
