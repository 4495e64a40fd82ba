"""Operator actions on dead letters: list them, and replay one after a fix.

Replay re-injects the entry's original fields into its original stream as a NEW entry
(XADD), then marks the record ``replayed`` with the new entry id, in one database
transaction that commits only after the XADD succeeded. Every group reading that stream
sees the new entry; groups that had already handled its identity skip it as a duplicate
(their inbox has it), the group that dead-lettered it handles it (a dead-lettered identity
is never in the inbox). If the process dies between XADD and commit, the record stays
``needs_attention`` and a second replay adds a second entry: the inbox makes that one a
duplicate too.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from typing import Any

from sqlalchemy.engine import Connection

from consumer.errors import AlreadyReplayed, DeadLetterNotFound
from consumer.inbox import REPLAYED, Inbox


def list_dead_letters(
    inbox: Inbox, *, group: str | None = None, include_replayed: bool = False, limit: int = 100
) -> list[dict[str, Any]]:
    """NEEDS_ATTENTION records, oldest first (with ``include_replayed``, replayed ones too)."""
    return inbox.dead_letter_list(group=group, include_replayed=include_replayed, limit=limit)


def replay_dead_letter(
    inbox: Inbox, client: Any, record_id: int, *, joined: Connection | None = None
) -> str:
    """Re-inject dead-letter record ``record_id`` into its stream; return the new entry id.
    ``client``: a Redis client, or on NATS an :class:`outbox.nats_client.NatsClient` (its
    ``xadd`` publishes the entry again under a message id of its own).

    Raises DeadLetterNotFound for an unknown id, AlreadyReplayed for a record replayed
    before (its ``replayed_entry_id`` says where). ``joined``: the caller's transaction to
    run in (the console's action and its audit row commit together)."""
    with inbox.engine.begin() if joined is None else nullcontext(joined) as conn:
        row = inbox.dead_letter_get_for_update(conn, record_id)
        if row is None:
            raise DeadLetterNotFound(f"no dead-letter record with id {record_id}")
        if row["state"] == REPLAYED:
            raise AlreadyReplayed(
                f"dead-letter record {record_id} was replayed at {row['replayed_at']} "
                f"as entry {row['replayed_entry_id']} of {row['stream']}"
            )
        fields = json.loads(row["payload"])
        if not isinstance(fields, dict) or not fields:
            fields = {"dl.empty": "1"}
        new_id = client.xadd(row["stream"], {str(k): str(v) for k, v in fields.items()})
        entry_id = new_id.decode() if isinstance(new_id, bytes) else str(new_id)
        inbox.dead_letter_mark_replayed(conn, record_id, entry_id)
    return entry_id
