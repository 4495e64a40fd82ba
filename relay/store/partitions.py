"""The relay's statements on a partitioned outbox table (``outbox.partitions``).

The statements of :mod:`relay.store.pg_statements` join a batch's sequence numbers to the table
(``FROM unnest(...) u WHERE t.seq = u.seq``; the claim ``t.seq = ANY(ARRAY(... picked))``). On
one table the planner probes the primary key per row. On a partitioned table each probe is
one per partition, and without statistics (autovacuum is off on the project's machines) the planner
costed that above a hash join over a sequential scan of EVERY partition: measured, 100,000
pending rows over 7 hourly partitions, 140 ms per claim of 500 and 190 ms per batch of
receipts, O(table) per batch.

So on a partitioned table each of those statements also bounds ``t.seq`` by the batch's own
array (``t.seq = ANY(...)``): every partition is then read through an index, a probe per
sequence number, or (a partition too small for that to pay) scanned whole, which costs what
the small partition holds. The claim's UPDATE finds its rows by the array of what it locked (as
on a plain table) and within the ``created_at`` range of those rows, so partitions outside
that range are not read at all (run-time pruning). Measured on the same table: 17-60 ms
per claim (a loaded machine), no sequential scan of a partition larger than the batch's
lookups would cost.
"""

from __future__ import annotations

import logging
from typing import Any

from outbox.logs import fields

log = logging.getLogger("outbox.relay")

RELKIND_SQL = "SELECT relkind::text FROM pg_class WHERE oid = to_regclass(%s)"

_SEQ_JOIN = "WHERE t.seq = u.seq"

_REWRITES: dict[str, tuple[tuple[str, str], ...]] = {
    "published": (
        (_SEQ_JOIN, _SEQ_JOIN + " AND t.seq = ANY(string_to_array(%(seqs)s, ',')::bigint[])"),
        # With the bound, the partial pending index is the cheap path (an old partition's
        # holds nothing), no longer the trap postgres.py avoids with ``state || ''``.
        ("(t.state || '') = 'pending'", "t.state = 'pending'"),
    ),
    "failed": ((_SEQ_JOIN, _SEQ_JOIN + " AND t.seq = ANY(%(seqs)b::bigint[])"),),
    "quarantine": ((_SEQ_JOIN, _SEQ_JOIN + " AND t.seq = ANY(%(seqs)b::bigint[])"),),
    "resolve_found": ((_SEQ_JOIN, _SEQ_JOIN + " AND t.seq = ANY(%(seqs)b::bigint[])"),),
    "resolve_missing": ((_SEQ_JOIN, _SEQ_JOIN + " AND t.seq = ANY(%(seqs)b::bigint[])"),),
    "claim": (
        ("SELECT l.seq FROM (", "SELECT l.seq, l.created_at FROM ("),
        ("        SELECT o.seq FROM ", "        SELECT o.seq, o.created_at FROM "),
        (
            "WHERE t.seq = ANY(ARRAY(SELECT seq FROM picked))",
            "WHERE t.seq = ANY(ARRAY(SELECT seq FROM picked))\n"
            "  AND t.created_at >= (SELECT min(created_at) FROM picked)\n"
            "  AND t.created_at <= (SELECT max(created_at) FROM picked)",
        ),
    ),
}


def partitioned_statements(statements: dict[str, str]) -> dict[str, str]:
    """The statements of :mod:`relay.store.pg_statements` (by name, ``{t}`` already replaced)
    rewritten for a partitioned table (see the module docstring). A statement that a rewrite
    no longer fits (``postgres.py`` changed it) is kept as it is, with a warning: correct,
    maybe slow; tests/test_partitioned.py checks that every rewrite applies."""
    out = dict(statements)
    for name, rewrites in _REWRITES.items():
        sql = out[name]
        for old, new in rewrites:
            if sql.count(old) != 1:
                log.warning(
                    "relay statement not rewritten for a partitioned table",
                    extra=fields(statement=name, expected=old),
                )
                break
            sql = sql.replace(old, new)
        else:
            out[name] = sql
    return out


def unfit_rewrites(statements: dict[str, str]) -> list[str]:
    """The names of the statements a rewrite no longer fits (for the tests)."""
    return [
        name
        for name, rewrites in _REWRITES.items()
        if any(statements[name].count(old) != 1 for old, _new in rewrites)
    ]


def statements_for(conn: Any, table: str, statements: dict[str, str]) -> dict[str, str]:
    """``statements`` as they are for a plain table, rewritten for a partitioned one
    (``conn``: the store's psycopg connection; ``table``: the quoted table)."""
    row = conn.execute(RELKIND_SQL, (table,)).fetchone()
    return partitioned_statements(statements) if row and row[0] == "p" else statements


__all__ = ["RELKIND_SQL", "partitioned_statements", "statements_for", "unfit_rewrites"]
