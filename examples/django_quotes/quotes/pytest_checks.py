"""The same promises under pytest-django (``pytest`` in this folder; pytest.ini names the
settings)."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test import Client

import outbox.django
from outbox.django.models import OutboxEvent
from quotes.models import Quote


@pytest.mark.django_db
def test_1_approving_writes_one_event() -> None:
    quote = Quote.objects.create(customer="Ana", email="ana@example.com", total="120.00")
    assert Client().post(f"/quotes/{quote.pk}/approve").json()["state"] == "approved"
    assert OutboxEvent.objects.filter(key=f"quote-{quote.pk}").count() == 1


@pytest.mark.django_db
def test_2_the_rolled_back_test_left_no_event() -> None:
    assert OutboxEvent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_emit_needs_a_transaction_and_commits_with_it() -> None:
    with pytest.raises(outbox.django.NoTransaction):
        outbox.django.emit("quote.approved", key="quote-1", payload={})
    with transaction.atomic():
        outbox.django.emit("quote.approved", key="quote-1", payload={})
    assert OutboxEvent.objects.count() == 1
