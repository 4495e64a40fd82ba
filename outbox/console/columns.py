"""The columns each list of the console shows, and nothing more: a list never reads a
payload (a 10 MB dead letter made one page 85 MB), and the long text cells in
:data:`LONG_TEXT` are cut in the database (``queries.capped``). One record's payload is read
alone (``queries.dead_letter``)."""

from __future__ import annotations

EVENT_LIST_COLUMNS = (
    "seq",
    "event_id",
    "topic",
    "key",
    "tenant",
    "identity",
    "state",
    "attempts",
    "last_error",
    "created_at",
    "published_at",
    "stream",
    "stream_id",
)


JOB_LIST_COLUMNS = (
    "id",
    "tenant",
    "action",
    "kind",
    "subject",
    "state",
    "attempts",
    "last_error",
    "wait_reason",
    "lease_owner",
    "run_after",
    "timer_scheduled_for",
    "cancel_requested_at",
    "order_key",  # issue 56: HELD jobs wait for an earlier job of this key
    "created_at",
    "updated_at",
)


LONG_TEXT = ("last_error", "wait_reason", "error", "reason", "outcome", "before", "after")
"""Text columns a list shows cut to ``queries.CELL_CHARS`` characters."""

RECEIPT_LIST_COLUMNS = (
    "operation_id",
    "job_id",
    "provider",
    "state",
    "provider_ref",
    "attempts",
    "last_error",
    "call_deadline",
    "settled_by",
    "settled_reason",
    "settled_at",
    "created_at",
    "updated_at",
    "delivery_status",
    "delivery_at",
)
DEAD_LETTER_LIST_COLUMNS = (
    "id",
    "group_name",
    "stream",
    "entry_id",
    "event_id",
    "topic",
    "identity",
    "reason",
    "error",
    "deliveries",
    "state",
    "dead_letter_stream",
    "created_at",
    "replayed_at",
    "replayed_entry_id",
)
