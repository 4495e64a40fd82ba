"""The example's own tests, under Django's test runner (``python manage.py test quotes``).

Each TestCase test runs in a transaction that is rolled back at its end: the events it wrote
go with it (``test_2_...`` runs after ``test_1_...`` and finds none).
"""

from __future__ import annotations

import sqlalchemy
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase

import outbox
import outbox.django
from outbox import ConfigError, InvalidEvent
from outbox.django.models import OutboxEvent
from quotes.models import Quote


def new_quote() -> Quote:
    return Quote.objects.create(customer="Ana", email="ana@example.com", total="120.00")


class ApproveTests(TestCase):
    def test_1_approving_writes_the_state_and_one_event(self) -> None:
        quote = new_quote()
        for _ in range(2):  # a second approval changes nothing and emits nothing
            response = self.client.post(f"/quotes/{quote.pk}/approve")
            self.assertEqual(response.json()["state"], "approved")
        event = OutboxEvent.objects.get()
        self.assertEqual(event.topic, "quote.approved")
        self.assertEqual(event.identity, f"studio:send-quote-{quote.pk}")
        self.assertEqual(event.payload["email"], "ana@example.com")
        self.assertEqual(event.state, "pending")

    def test_2_the_rolled_back_test_left_no_event(self) -> None:
        self.assertEqual(OutboxEvent.objects.count(), 0)

    def test_an_exception_rolls_back_the_state_and_the_event(self) -> None:
        quote = new_quote()
        with self.assertRaises(RuntimeError), transaction.atomic():
            Quote.objects.filter(pk=quote.pk).update(state="approved")
            outbox.django.emit("quote.approved", key=f"quote-{quote.pk}", payload={})
            raise RuntimeError("the domain changed its mind")
        self.assertEqual(Quote.objects.get(pk=quote.pk).state, "draft")
        self.assertEqual(OutboxEvent.objects.count(), 0)

    def test_bad_input_raises_invalid_event_naming_the_field(self) -> None:
        with self.assertRaises(InvalidEvent) as caught:
            outbox.django.emit("quote.approved", key="", payload={})
        self.assertEqual(caught.exception.field, "key")
        with self.assertRaises(InvalidEvent) as caught:
            outbox.django.emit("quote.approved", key="q", payload={"total": object()})
        self.assertEqual(caught.exception.field, "payload")
        self.assertEqual(OutboxEvent.objects.count(), 0)

    def test_sqlalchemy_on_djangos_connection_reads_json_as_the_orm_does(self) -> None:
        """outbox.django.engine(): one transaction with the ORM, JSON decoded on both sides."""
        outbox.django.emit("quote.approved", key="quote-1", payload={"total": 120})
        engine = outbox.django.engine()
        try:
            with engine.connect() as conn:
                table = outbox.build_schema().table  # typed: JSON decoded on either backend
                payload = conn.execute(sqlalchemy.select(table.c.payload)).scalar()
                self.assertEqual(payload, {"total": 120})  # sees the uncommitted row
                self.assertEqual(OutboxEvent.objects.get().payload, {"total": 120})
        finally:
            engine.dispose()

    def test_the_admin_shows_the_backlog_read_only(self) -> None:
        quote = new_quote()
        self.client.post(f"/quotes/{quote.pk}/approve")
        self.client.force_login(User.objects.create_superuser("op", "op@example.com", "pw"))
        page = self.client.get("/admin/outbox/outboxevent/")
        self.assertContains(page, f"quote-{quote.pk}")
        event = OutboxEvent.objects.get()
        self.assertEqual(self.client.get("/admin/outbox/outboxevent/add/").status_code, 403)
        delete = self.client.post(f"/admin/outbox/outboxevent/{event.pk}/delete/", {"post": "yes"})
        self.assertEqual(delete.status_code, 403)
        self.assertEqual(OutboxEvent.objects.count(), 1)


class OutsideATransactionTests(TransactionTestCase):
    def test_emit_outside_atomic_is_refused(self) -> None:
        with self.assertRaises(outbox.django.NoTransaction):
            outbox.django.emit("quote.approved", key="quote-1", payload={})
        self.assertEqual(OutboxEvent.objects.count(), 0)

    def test_autocommit_true_writes_the_event_on_its_own(self) -> None:
        outbox.django.emit("quote.approved", key="quote-1", payload={}, autocommit=True)
        self.assertEqual(OutboxEvent.objects.count(), 1)

    def test_database_url_names_the_database_django_uses(self) -> None:
        """What manage.py outbox_relay & co. connect to: the test database, here."""
        new_quote()
        if connection.vendor == "sqlite" and "memory" in connection.settings_dict["NAME"]:
            # An in-memory test database: no other process could open it, so it is refused.
            with self.assertRaises(ConfigError):
                outbox.django.database_url()
            return
        engine = sqlalchemy.create_engine(outbox.django.database_url())
        try:
            with engine.connect() as conn:
                count = conn.execute(sqlalchemy.text("SELECT count(*) FROM quotes_quote"))
                self.assertEqual(count.scalar(), 1)
        finally:
            engine.dispose()
