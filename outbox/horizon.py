"""Who holds the vacuum horizon: the oldest transaction, snapshot or slot that keeps VACUUM
from removing the rows that died after it began (issue 60).

A queue table updates and deletes rows all day; VACUUM can remove a dead row only once no
transaction can still see it. One transaction left open for minutes (a report, a migration,
a client "idle in transaction", a prepared transaction nobody committed, a replication slot
with ``hot_standby_feedback`` that falls behind) pins that horizon for every table of its
database: the dead rows, and the dead index entries the claims walk, pile up until it ends.

:data:`HORIZON_HOLDER_SQL` finds the oldest holder as the current database sees it (since
PostgreSQL 14 a backend pins only the tables of its own database, plus the shared catalogs):

- ``backend``: a session of this database whose snapshot (``pg_stat_activity.backend_xmin``)
  is held; its age is that of its transaction (``xact_start``). Autovacuum workers and
  VACUUM commands are left out: PostgreSQL ignores their snapshots when it decides what is
  removable. A walsender (no database) counts: with ``hot_standby_feedback`` its standby's
  queries pin the primary's horizon.
- ``prepared``: a prepared transaction (``pg_prepared_xacts``) of this database, aged from
  its PREPARE.
- ``slot``: a replication slot whose ``xmin`` is set (a physical slot with
  ``hot_standby_feedback``). It has no start time: its age in seconds is NULL, its age in
  transaction ids is given. (A logical slot's ``catalog_xmin`` pins the catalogs only.)

The SQL reads statistics views only (no lock, no table). Other users' sessions show their
``backend_xmin`` only to a role with ``pg_read_all_stats`` (``pg_monitor``): grant it to the
workers' and the exporter's role to see every holder. PostgreSQL only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from outbox.logs import fields

__all__ = ["HORIZON_HOLDER_SQL", "HorizonHolder", "HorizonWatch", "horizon_holder"]

# The oldest holder first: by the age of its xmin in transaction ids (the one measure all
# three kinds share). ``pg_backend_pid()``: this session's own snapshot is not a holder.
# A VACUUM is recognised by its statement (an ``active`` backend whose query starts with
# VACUUM), as pg_stat_activity has no flag for it.
HORIZON_HOLDER_SQL = """
SELECT kind, pid, name, state, age_seconds, xid_age, holder_xmin FROM (
    SELECT 'backend' AS kind, a.pid, a.application_name AS name, a.state,
           extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.query_start))::float8
               AS age_seconds,
           age(a.backend_xmin)::bigint AS xid_age, a.backend_xmin::text AS holder_xmin
    FROM pg_stat_activity a
    WHERE a.backend_xmin IS NOT NULL AND a.pid <> pg_backend_pid()
      AND (a.datname = current_database() OR a.backend_type = 'walsender')
      AND a.backend_type <> 'autovacuum worker'
      AND NOT (a.state = 'active' AND a.query ~* '^[[:space:]]*vacuum')
  UNION ALL
    SELECT 'prepared', NULL, p.gid, 'prepared',
           extract(epoch FROM clock_timestamp() - p.prepared)::float8,
           age(p.transaction)::bigint, p.transaction::text
    FROM pg_prepared_xacts p WHERE p.database = current_database()
  UNION ALL
    SELECT 'slot', NULL, s.slot_name, CASE WHEN s.active THEN 'active' ELSE 'inactive' END,
           NULL, age(s.xmin)::bigint, s.xmin::text
    FROM pg_replication_slots s WHERE s.xmin IS NOT NULL
) h
ORDER BY xid_age DESC, age_seconds DESC NULLS LAST
LIMIT 1"""


@dataclass(frozen=True)
class HorizonHolder:
    """The oldest holder of the horizon (module docstring): ``kind`` (backend, prepared,
    slot), the backend's ``pid`` (None otherwise), ``name`` (application_name, prepared
    transaction's gid, slot name), ``state`` (idle in transaction, active, prepared...),
    ``age_seconds`` (None for a slot), ``xid_age`` (transactions since its xmin) and
    ``xmin`` (the xmin itself, as text: the horizon moved when it changed)."""

    kind: str
    pid: int | None
    name: str | None
    state: str | None
    age_seconds: float | None
    xid_age: int
    xmin: str

    def fields(self) -> dict[str, Any]:
        """For a structured log line."""
        return {
            "holder": self.kind,
            "pid": self.pid,
            "application_name" if self.kind == "backend" else "name": self.name,
            "state": self.state,
            "age_seconds": None if self.age_seconds is None else round(self.age_seconds, 1),
            "xid_age": self.xid_age,
        }


def horizon_holder(cursor: Any) -> HorizonHolder | None:
    """The oldest holder of the horizon seen from ``cursor``'s database, or None when no
    transaction holds a snapshot. ``cursor``: a psycopg 3 connection or cursor, or a
    SQLAlchemy ``Connection`` (anything whose ``execute(sql)`` returns rows)."""
    result = cursor.execute(_statement(cursor))
    row = result.fetchone()
    if row is None:
        return None
    kind, pid, name, state, age, xid_age, xmin = row
    return HorizonHolder(
        kind=str(kind),
        pid=None if pid is None else int(pid),
        name=name,
        state=state,
        age_seconds=None if age is None else max(0.0, float(age)),
        xid_age=int(xid_age),
        xmin=str(xmin),
    )


def _statement(cursor: Any) -> Any:
    # SQLAlchemy connections take a text() clause; psycopg takes the string.
    if hasattr(cursor, "dialect"):
        from sqlalchemy import text

        return text(HORIZON_HOLDER_SQL)
    return HORIZON_HOLDER_SQL


class HorizonWatch:
    """What a vacuumer learns after each of its vacuums (``outbox.maintenance``): a table
    still past its threshold right after a vacuum kept rows the vacuum could not remove, so
    the horizon is pinned. Then a warning names the holder, again every ``repeat`` seconds
    while it lasts, and an info line says when a vacuum removes the rows again.

    ``still_past(conn, table)``: whether the table is still past its threshold.
    :meth:`skip` tells the vacuumer to leave a pinned table alone while the same holder
    still holds the horizon (a vacuum would scan the table and remove nothing more).
    """

    def __init__(
        self,
        what: str,
        still_past: Callable[[Any, str], bool],
        log: logging.Logger,
        *,
        repeat: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.still_past = still_past
        self.log = log
        self.repeat = repeat
        self.clock = clock
        self.pinned: dict[str, str] = {}
        """Table -> the holder's xmin when a vacuum of it last removed too little."""
        self.holder: HorizonHolder | None = None
        """The holder named by the last warning (None: none seen, or not pinned)."""
        self.since: float | None = None
        self._reported: float | None = None

    def after_vacuum(self, conn: Any, done: dict[str, float]) -> None:
        """After the vacuums ``done`` (table -> seconds), on the vacuumer's connection."""
        stuck = [t for t in done if self.still_past(conn, t)]
        freed = [t for t in done if t in self.pinned and t not in stuck]
        for table in freed:
            del self.pinned[table]
        if stuck:
            holder = horizon_holder(conn)
            for table in stuck:
                self.pinned[table] = holder.xmin if holder is not None else ""
            self._warn(stuck, holder)
        elif freed and not self.pinned:
            held = None if self.since is None else round(self.clock() - self.since, 1)
            self.log.info(
                f"vacuum of the {self.what} removes dead rows again: the horizon moved",
                extra=fields(tables=freed, pinned_seconds=held),
            )
            self.holder, self.since, self._reported = None, None, None

    def skip(self, conn: Any, table: str) -> bool:
        """True while ``table``'s last vacuum removed too little and the same holder (same
        xmin) still holds the horizon: vacuuming it again would remove nothing."""
        xmin = self.pinned.get(table)
        if not xmin:
            return False
        holder = horizon_holder(conn)
        if holder is None or holder.xmin != xmin:
            return False
        self._warn([table], holder)
        return True

    def _warn(self, tables: list[str], holder: HorizonHolder | None) -> None:
        now = self.clock()
        if self.since is None:
            self.since = now
        if holder is None or self.holder is None:
            same = holder is None and self.holder is None  # none visible, as last time
        else:
            same = holder.xmin == self.holder.xmin
        if same and self._reported is not None and now - self._reported < self.repeat:
            return
        self.holder, self._reported = holder, now
        if holder is None:
            who: dict[str, Any] = {
                "holder": "unknown",
                "hint": "no session visible to this role holds a snapshot: grant it "
                "pg_read_all_stats (pg_monitor) to see every session",
            }
        else:
            who = holder.fields()
        self.log.warning(
            f"vacuum of the {self.what} cannot keep up: a transaction holds the horizon, "
            "so rows that died after it began cannot be removed",
            extra=fields(tables=tables, **who),
        )
