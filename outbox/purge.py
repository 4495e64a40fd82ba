"""What the ``purge`` commands share (``outbox-worker purge``, ``outbox-relay purge``): run
the retention targets until nothing is due, or with ``--dry-run`` count what would go, per
table; progress on stderr as it goes, the result on stdout (aligned lines, or ``--json``:
``{"dry_run": bool, "tables": {TABLE: rows}}``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from outbox.retention import ProgressFn


def progress_printer(prog: str, stream: TextIO | None = None, every: float = 1.0) -> ProgressFn:
    """A progress callback printing ``PROG: TABLE: N deleted so far`` at most every
    ``every`` seconds per table, and ``PROG: TABLE: N deleted, done`` after its last batch."""
    out = stream if stream is not None else sys.stderr
    last: dict[str, float] = {}

    def report(table: str, removed: int, total: int, finished: bool) -> None:
        now = time.monotonic()
        if finished:
            print(f"{prog}: {table}: {total} deleted, done", file=out, flush=True)
            return
        if now - last.setdefault(table, now) < every:
            return
        last[table] = now
        print(f"{prog}: {table}: {total} deleted so far", file=out, flush=True)

    return report


def print_result(rows: Mapping[str, int], *, dry_run: bool, as_json: bool) -> None:
    """The per-table result on stdout."""
    if as_json:
        print(json.dumps({"dry_run": dry_run, "tables": dict(rows)}, sort_keys=True))
        return
    verb = "would go" if dry_run else "deleted"
    width = max((len(t) for t in rows), default=0)
    for table, count in rows.items():
        print(f"{table.ljust(width)}  {count} {verb}")
    if not rows:
        print("no table has a retention to run")


def run_purge(
    prog: str,
    *,
    dry_run: bool,
    as_json: bool,
    count: Callable[[], Mapping[str, int]],
    purge: Callable[[ProgressFn], Mapping[str, int]],
) -> int:
    """Count (``dry_run``) or purge, print, exit 0."""
    rows = count() if dry_run else purge(progress_printer(prog))
    print_result(rows, dry_run=dry_run, as_json=as_json)
    return 0
