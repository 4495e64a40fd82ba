"""The Django app of the outbox (``INSTALLED_APPS += ["outbox.django"]``)."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox.django"
    label = "outbox"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"
