"""The trace as text for a terminal (``outbox-console trace QUERY``): the page's story,
section by section. Values are printed through :func:`outbox.display.printable` (control
characters escaped), so a payload cannot move the cursor or recolour the terminal."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, TextIO

from outbox.console.trace import Trace
from outbox.display import printable


def _clean(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value > 1e9:
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, default=str)
    return printable(value, keep_tabs=True)


def _line(out: TextIO, label: str, row: dict[str, Any], keys: tuple[str, ...]) -> None:
    parts = " ".join(f"{k}={_clean(row.get(k))}" for k in keys)
    out.write(f"  {label}: {parts}\n")


def print_trace(trace: Trace, out: TextIO) -> None:
    out.write(f"{_clean(trace.query)}: {trace.verdict}\n  {_clean(trace.because)}\n")
    if not trace.found:
        return
    out.write("outbox:\n")
    for e in trace.events:
        event_keys = (
            "seq",
            "event_id",
            "topic",
            "key",
            "tenant",
            "identity",
            "state",
            "attempts",
        )
        _line(out, "event", e, (*event_keys, "created_at", "published_at", "stream", "stream_id"))
        if e.get("last_error"):
            out.write(f"    error: {_clean(e['last_error'])}\n")
    out.write("stream entries:\n")
    for s in trace.stream_entries:
        out.write(f"  {_clean(s['stream'])} {_clean(s['id'])} ({s['state']})\n")
        for k, v in s.get("fields", {}).items():
            out.write(f"    {_clean(k)}: {_clean(v)}\n")
    out.write("inbox:\n")
    for i in trace.inbox:
        _line(out, "group", i, ("group_name", "identity", "event_id", "entry_id", "processed_at"))
    for d in trace.dead_letters:
        _line(out, "dead letter", d, ("id", "group_name", "reason", "state", "error"))
    _print_jobs(trace, out)
    out.write("receipts:\n")
    for r in trace.receipts:
        receipt_keys = (
            "operation_id",
            "provider",
            "state",
            "provider_ref",
            "attempts",
            "call_deadline",
        )
        _line(out, "operation", r, (*receipt_keys, "settled_by", "settled_reason"))
    out.write("audit:\n")
    for a in trace.audit:
        _line(out, "action", a, ("at", "actor", "action", "target_kind", "target_id", "reason"))


def _print_jobs(trace: Trace, out: TextIO) -> None:
    """The trace's jobs: each with its timer, history, and parents and children (steps)."""
    out.write("jobs:\n")
    for j in trace.jobs:
        job_keys = (
            "id",
            "tenant",
            "action",
            "subject",
            "state",
            "attempts",
            "lease_epoch",
        )
        _line(out, "job", j, (*job_keys, "run_after", "wait_reason", "last_error"))
        if j.get("timer_scheduled_for") is not None:
            _line(out, "  timer", j, ("timer_scheduled_for", "timer_reason"))
        for h in j.get("history", []):
            _line(out, "  attempt", h, ("at", "epoch", "worker", "outcome", "error"))
        for label, kind in (("  parent", "parents"), ("  child", "children")):  # steps
            for step in j.get(kind, []):
                _line(out, label, step, ("id", "tenant", "action", "state"))
