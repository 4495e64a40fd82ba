"""The operator console: pages and a JSON API over the outbox, the stream, the inbox, the
jobs and the receipts, with audited actions (``outbox-console serve``), and one business
identity's story from commit to receipt (``outbox-console trace``).

Import the parts you need (``outbox.console.app.Console``, ``outbox.console.trace.collect``,
``outbox.console.schema.purge_audit``); this package pulls in the web stack only through
``outbox.console.app``.
"""

from outbox.console.schema import AUDIT_TABLE, create_audit_table, purge_audit

__all__ = ["AUDIT_TABLE", "create_audit_table", "purge_audit"]
