"""The outbox table as a Django model, for reading only (the admin's backlog and quarantine).

The table is the toolkit's: its migration runs ``create_schema`` and only records this model
in Django's state (``SeparateDatabaseAndState``), so Django never writes DDL for it. The model
is managed all the same so that ``TransactionTestCase`` empties the table between tests, as it
does the application's tables. The relay owns every column after the INSERT.
"""

from __future__ import annotations

from django.db import models


class OutboxEvent(models.Model):
    seq = models.BigAutoField(primary_key=True)
    event_id = models.CharField(max_length=64, unique=True)
    topic = models.CharField(max_length=200)
    key = models.CharField(max_length=200)
    key_hash = models.BigIntegerField()
    tenant = models.CharField(max_length=200, null=True)
    identity = models.CharField(max_length=200)
    payload = models.JSONField()
    headers = models.JSONField(null=True)
    created_at = models.DateTimeField()
    available_at = models.DateTimeField()
    attempts = models.IntegerField()
    last_error = models.TextField(null=True)
    state = models.CharField(max_length=16)
    claimed_by = models.CharField(max_length=128, null=True)
    claim_epoch = models.BigIntegerField(null=True)
    claimed_at = models.DateTimeField(null=True)
    stream = models.CharField(max_length=512, null=True)
    stream_id = models.CharField(max_length=64, null=True)
    published_at = models.DateTimeField(null=True)

    class Meta:
        db_table = "outbox_events"
        ordering = ("seq",)
        verbose_name = "outbox event"

    def __str__(self) -> str:
        return f"{self.topic} {self.key} ({self.state})"
