"""The operator console: pages and a JSON API over the outbox, the stream, the inbox, the
jobs and the receipts, with audited actions (``outbox-console serve``), and one business
identity's story from commit to receipt (``outbox-console trace``).

The package root has the audit table's upkeep (``create_audit_table``, ``purge_audit``) and
the trace in code (``Tables``, ``present_tables``, ``collect``: loaded on first use, since
they read every part's tables); this package pulls in the web stack only through
``outbox.console.app``.
"""

from typing import TYPE_CHECKING, Any

from outbox.console.schema import AUDIT_TABLE, create_audit_table, purge_audit

if TYPE_CHECKING:
    from outbox.console.queries import Tables, present_tables
    from outbox.console.trace import collect


def __getattr__(name: str) -> Any:
    # The trace reads the consumer's and the jobs' tables: imported when asked for, so that
    # the audit table's upkeep (outbox.retention purges it) stays light.
    if name in ("Tables", "present_tables"):
        from outbox.console import queries

        return getattr(queries, name)
    if name == "collect":
        from outbox.console import trace

        return trace.collect
    raise AttributeError(f"module 'outbox.console' has no attribute {name!r}")


__all__ = [
    "AUDIT_TABLE",
    "Tables",
    "collect",
    "create_audit_table",
    "present_tables",
    "purge_audit",
]
