"""A read-only admin of the outbox: the backlog (pending) and the quarantined events.

Nothing here changes a row: requeueing a quarantined event after a fix is
``outbox-relay requeue`` (or the console), which records why.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from outbox.django.models import OutboxEvent


@admin.register(OutboxEvent)
class OutboxEventAdmin(admin.ModelAdmin):
    list_display = (
        "seq",
        "topic",
        "key",
        "tenant",
        "state",
        "attempts",
        "created_at",
        "last_error",
    )
    list_filter = ("state", "topic")
    search_fields = ("event_id", "identity", "key")
    ordering = ("seq",)

    def get_queryset(self, request: Any) -> Any:
        # The backlog and the quarantine: published rows wait only for retention.
        return super().get_queryset(request).exclude(state="published")

    def get_readonly_fields(self, request: Any, obj: Any = None) -> Any:
        return [field.name for field in OutboxEvent._meta.fields]

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False
