"""Keeping the hot tables small: per-table autovacuum settings, and a vacuum by the process
itself when the server runs without autovacuum.

The queue tables (the outbox, the jobs and their attempts, the consumers' inbox) are
written and updated all day, and every update or delete leaves a dead tuple and dead index
entries behind. The claims walk partial indexes in order (see ``relay/store/``'s
``PG_CLAIM``); dead entries at the head of such an index are read by every claim until
vacuum removes them (measured on the outbox: the claim rate halved within 30 s of steady
draining under default autovacuum settings). Two things keep that bounded:

- **Per-table autovacuum settings** (:data:`HOT_TABLE_AUTOVACUUM`, set by each part's
  ``create_schema`` when missing): vacuum after a fixed number of dead rows, not a fraction
  of a table that only grows until retention, and without cost-based sleeping.
- **A vacuum by the process itself** (:class:`PeriodicVacuum`) when autovacuum will not run
  for the table: the server's ``autovacuum`` (or ``track_counts``) is off, as on this
  project's machines, or the table has ``autovacuum_enabled = false``. With autovacuum on,
  the process does nothing by default: the table's own settings do the job.
- **Catching up** (``PeriodicVacuum(catch_up=...)``, the job worker's): autovacuum visits a
  database once per ``autovacuum_naptime`` (a minute by default), and the process's own
  vacuum without it comes every ``interval`` (30 s); a queue worker fills a table with dead
  rows far faster (issue 44: 200,000 dead tuples in 30 s, a worker at 16 slots down from
  ~3,900 to ~3,250 jobs/s as they piled up, back up after each vacuum). A catching-up
  vacuumer looks every ``catch_up`` seconds and vacuums a table past its own autovacuum
  threshold and scale factor (autovacuum would vacuum it now) that no vacuum has come to
  yet; one already running on it (autovacuum's, another worker's) is skipped, not waited
  for. It reads the server's counts (``track_counts``), so it works with autovacuum on or
  off.
- **A pinned horizon** (issue 60): while one transaction stays open (a report, a client
  idle in transaction, a prepared transaction, a replication slot), no vacuum can remove a
  row that died after it began. A vacuum that leaves its table still past the threshold
  says so: a warning naming the holder (``outbox.horizon``: pid, application name, state,
  age), again each minute while it lasts, and a line when it ends. Until the horizon moves,
  the catch-up look does not vacuum that table again (it could remove nothing more).

PostgreSQL only; on SQLite every function here is a no-op.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from outbox.dialect import quoted_table as quoted_table  # re-exported for callers
from outbox.horizon import HorizonWatch
from outbox.logs import fields
from outbox.outage import report_failure

log = logging.getLogger("outbox.maintenance")

HOT_TABLE_AUTOVACUUM: Mapping[str, str] = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "5000",
    "autovacuum_vacuum_insert_scale_factor": "0",
    "autovacuum_vacuum_insert_threshold": "50000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_delay": "0",
}
"""Autovacuum settings for a hot queue table: vacuum every 5,000 dead rows (and every 50,000
inserted ones, which also keeps the visibility map current for index-only scans), analyze
after 2 % changed, never sleep for cost accounting. ``outbox.schema`` has its own
(with a fillfactor) for the outbox table."""

DEFAULT_VACUUM_INTERVAL = 30.0
"""Seconds between two vacuums by the process when autovacuum is off (the relay's
``vacuum_interval`` default; a vacuum of a table kept small takes milliseconds)."""


def set_storage_parameters(
    conn: Connection, qualified_table: str, parameters: Mapping[str, str]
) -> dict[str, str]:
    """Set the storage parameters the table does not have yet (a value someone set by hand
    is kept); return those set. ``qualified_table`` is quoted SQL (``"schema"."table"``).
    PostgreSQL only: elsewhere nothing happens."""
    if conn.dialect.name != "postgresql":
        return {}
    options = conn.execute(
        text("SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass(:q)"),
        {"q": qualified_table},
    ).scalar()
    present = {str(o).split("=", 1)[0] for o in (options or [])}
    missing = {k: v for k, v in parameters.items() if k not in present}
    if missing:
        settings = ", ".join(f"{k} = {v}" for k, v in missing.items())
        conn.execute(text(f"ALTER TABLE {qualified_table} SET ({settings})"))
    return missing


# Whether autovacuum will ever process the table: the server runs the launcher
# (autovacuum), collects the counts it decides on (track_counts), and the table does not
# opt out (autovacuum_enabled = false in its reloptions).
_AUTOVACUUM_RUNS = """
SELECT current_setting('autovacuum') = 'on' AND current_setting('track_counts') = 'on'
   AND NOT coalesce((SELECT 'autovacuum_enabled=false' = ANY(c.reloptions)
                     OR 'autovacuum_enabled=off' = ANY(c.reloptions)
                     FROM pg_class c WHERE c.oid = to_regclass(%(t)s)), false)"""


def autovacuum_runs(cursor: Any, qualified_table: str) -> bool:
    """Whether autovacuum takes care of the table. ``cursor``: anything with the DB-API
    ``execute(sql, params)`` / ``fetchone()`` pair of psycopg 3 (a connection or cursor)."""
    row = cursor.execute(_AUTOVACUUM_RUNS, {"t": qualified_table}).fetchone()
    return bool(row and row[0])


def vacuum_unless_autovacuum(
    connect: Callable[[], Any],
    tables: Sequence[str],
    after: Callable[[Any, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """VACUUM each table autovacuum does not take care of; return table -> seconds it took
    (empty when autovacuum runs for them all). ``connect`` returns a new psycopg 3
    connection in autocommit mode (VACUUM cannot run inside a transaction); it is closed
    afterwards. ``SKIP_LOCKED``: a table another vacuum (another replica's) holds is skipped,
    not waited for. ``after``: see :func:`_vacuum_where`."""
    return _vacuum_where(
        connect, tables, lambda conn, table: not autovacuum_runs(conn, table), after
    )


def _vacuum_where(
    connect: Callable[[], Any],
    tables: Sequence[str],
    wanted: Callable[[Any, str], bool],
    after: Callable[[Any, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """VACUUM (SKIP_LOCKED) each table ``wanted(conn, table)`` asks for, on one connection
    of ``connect``'s, closed afterwards; table -> seconds it took. ``after(conn, done)``
    runs on the same connection once the tables are vacuumed."""
    done: dict[str, float] = {}
    conn = connect()
    try:
        for table in tables:
            if not wanted(conn, table):
                continue
            started = time.monotonic()
            conn.execute(f"VACUUM (SKIP_LOCKED) {table}")
            done[table] = time.monotonic() - started
        if after is not None:
            after(conn, done)
    finally:
        conn.close()
    return done


# Whether autovacuum would vacuum the table now: its dead tuples past the threshold it
# decides on, the table's own settings first, the server's otherwise (PostgreSQL's formula:
# threshold + scale factor x reltuples).
_PAST_THRESHOLD = """
SELECT s.n_dead_tup >= coalesce(o.threshold, current_setting('autovacuum_vacuum_threshold')::float8)
       + coalesce(o.scale, current_setting('autovacuum_vacuum_scale_factor')::float8)
         * greatest(c.reltuples, 0)
FROM pg_class c
JOIN pg_stat_all_tables s ON s.relid = c.oid
CROSS JOIN LATERAL (
    SELECT max(split_part(opt, '=', 2)) FILTER (
               WHERE split_part(opt, '=', 1) = 'autovacuum_vacuum_threshold')::float8 AS threshold,
           max(split_part(opt, '=', 2)) FILTER (
               WHERE split_part(opt, '=', 1) = 'autovacuum_vacuum_scale_factor')::float8 AS scale
    FROM unnest(coalesce(c.reloptions, '{}')) AS opt
) o
WHERE c.oid = to_regclass(%(t)s)"""


def past_threshold(conn: Any, table: str) -> bool:
    """Whether the table's dead tuples are past its autovacuum threshold (psycopg 3)."""
    row = conn.execute(_PAST_THRESHOLD, {"t": table}).fetchone()
    return bool(row and row[0])


def vacuum_past_threshold(
    connect: Callable[[], Any],
    tables: Sequence[str],
    after: Callable[[Any, dict[str, float]], None] | None = None,
    skip: Callable[[Any, str], bool] | None = None,
) -> dict[str, float]:
    """VACUUM each table whose dead tuples are past its autovacuum threshold (autovacuum
    would vacuum it now, at its next visit); return table -> seconds it took. ``connect``
    and ``SKIP_LOCKED`` as in :func:`vacuum_unless_autovacuum`; a table ``skip(conn,
    table)`` names is left alone; ``after``: see :func:`_vacuum_where`."""

    def wanted(conn: Any, table: str) -> bool:
        return past_threshold(conn, table) and not (skip is not None and skip(conn, table))

    return _vacuum_where(connect, tables, wanted, after)


def psycopg_connector(engine: Engine) -> Callable[[], Any]:
    """A ``connect`` for :func:`vacuum_unless_autovacuum` from a SQLAlchemy engine on
    psycopg 3: a connection of its own, outside the engine's pool, in autocommit mode."""

    def connect() -> Any:
        import psycopg

        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        cparams = dict(cparams)
        cparams.setdefault("connect_timeout", 5)
        return psycopg.connect(*cargs, autocommit=True, **cparams)

    return connect


class PeriodicVacuum:
    """Vacuum some tables every ``interval`` seconds, in a background thread, when autovacuum
    does not take care of them. Call :meth:`maybe_start` from a loop as often as you like: it
    starts a vacuum only when the interval has passed and none is running, and never blocks.

    ``connect``: see :func:`vacuum_unless_autovacuum`. ``interval`` 0 turns it off. The
    first vacuum comes one interval after construction (a process that starts and stops
    quickly never vacuums).

    ``catch_up`` (seconds, 0: off): also look this often for a table autovacuum would vacuum
    now but has not come to yet (:func:`vacuum_past_threshold`; the module docstring).
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        tables: Sequence[str],
        *,
        interval: float = DEFAULT_VACUUM_INTERVAL,
        what: str = "tables",
        catch_up: float = 0.0,
    ) -> None:
        self.connect = connect
        self.tables = list(tables)
        self.interval = interval
        self.what = what
        self.catch_up = catch_up
        self._last = time.monotonic()
        self._looked = self._last
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.last_result: dict[str, float] | None = None
        self.horizon = HorizonWatch(what, past_threshold, log)
        """What the vacuums learnt of the horizon (the holder, the tables pinned)."""

    @classmethod
    def for_engine(
        cls,
        engine: Engine,
        tables: Sequence[str],
        *,
        interval: float = DEFAULT_VACUUM_INTERVAL,
        what: str = "tables",
        catch_up: float = 0.0,
    ) -> PeriodicVacuum | None:
        """For a SQLAlchemy engine: None off PostgreSQL (nothing to do)."""
        if engine.dialect.name != "postgresql" or interval <= 0:
            return None
        connect = psycopg_connector(engine)
        return cls(connect, tables, interval=interval, what=what, catch_up=catch_up)

    def maybe_start(self) -> bool:
        """Start a background vacuum if one is due and none runs; True if one started."""
        if self.interval <= 0:
            return False
        with self._lock:
            now = time.monotonic()
            due = now - self._last >= self.interval
            look = self.catch_up > 0 and now - self._looked >= self.catch_up
            if not (due or look):
                return False
            if self._thread is not None and self._thread.is_alive():
                return False
            self._looked = now
            if due:
                self._last = now
            self._thread = threading.Thread(
                target=self._round, args=(due, look), name=f"vacuum-{self.what}", daemon=True
            )
            self._thread.start()
            return True

    def _round(self, due: bool, look: bool) -> None:
        """The interval's vacuum when it is due, then the catch-up look when that is due
        too: with autovacuum on, the interval's vacuum leaves every table to it, so the look
        must not be skipped for it."""
        if due:
            self.run_once()
        if look:
            self.run_catch_up()

    def run_catch_up(self) -> dict[str, float] | None:
        """Vacuum now, in the calling thread, the tables autovacuum would vacuum but has not
        come to yet; what :func:`vacuum_past_threshold` returned, or None if it failed."""
        watch = self.horizon
        return self._vacuum(
            lambda connect, tables: vacuum_past_threshold(
                connect, tables, after=watch.after_vacuum, skip=watch.skip
            ),
            "looking again later",
            "past their threshold before autovacuum came",
            logging.DEBUG,
        )

    def run_once(self) -> dict[str, float] | None:
        """Vacuum now, in the calling thread; what :func:`vacuum_unless_autovacuum`
        returned, or None if it failed (logged)."""
        watch = self.horizon
        done = self._vacuum(
            lambda connect, tables: vacuum_unless_autovacuum(
                connect, tables, after=watch.after_vacuum
            ),
            "again at the next interval",
            "autovacuum is off",
            logging.INFO,
        )
        if done is not None:
            self.last_result = done
        return done

    def _vacuum(
        self,
        vacuum: Callable[[Callable[[], Any], Sequence[str]], dict[str, float]],
        then: str,
        why: str,
        level: int,
    ) -> dict[str, float] | None:
        """One of the two rules' vacuums: what it returned, or None if it failed (logged,
        with what comes ``then``); the tables vacuumed logged at ``level``, with ``why``."""
        try:
            done = vacuum(self.connect, self.tables)
        except Exception as exc:
            report_failure(log, f"vacuum of the {self.what} failed; {then}", exc)
            return None
        if done:
            log.log(
                level,
                f"vacuumed the {self.what} ({why})",
                extra=fields(seconds={t: round(s, 3) for t, s in done.items()}),
            )
        return done

    def join(self, timeout: float | None = None) -> None:
        """Wait for a vacuum in progress (tests, shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
