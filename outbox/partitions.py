"""A partitioned outbox table (PostgreSQL): declarative RANGE partitions on ``created_at``.

For high volume. The table is ``PARTITION BY RANGE (created_at)``, one partition per period
(``hourly``, ``daily``, or any whole number of seconds from the Python API, e.g.
``partitioned=120``), plus a DEFAULT partition so that no insert can ever fail for want of a
partition. Retention then drops whole partitions (DETACH, DROP) instead of deleting rows: no
DELETE, no dead tuples, no vacuum debt.

- Naming: ``<table>_p<YYYYMMDD>T<HHMMSS>`` (the partition's lower bound, UTC; periods are
  aligned on multiples of their length since the Unix epoch) and ``<table>_default``. Only
  partitions named so are ever dropped; a partition an operator attached by hand is left.
- The period is kept in the table's comment (``outbox: partitioned by created_at every N
  s``), so every relay, ``status`` and ``purge`` read it from the database.
- Keys: a partitioned table's primary key and unique indexes must include the partition
  key, so the primary key is ``(seq, created_at)`` and ``event_id`` has a unique index on
  ``(event_id, created_at)``. ``seq`` still comes from one sequence and stays unique; the
  writer's UUIDv7 ``event_id`` is unique by construction, but the database no longer refuses
  a caller-given ``event_id`` written twice at different instants.
- Storage parameters (fillfactor, per-table autovacuum) cannot be set on a partitioned
  table: each partition gets them when it is created.
- Upkeep (:func:`ensure_partitions`, :func:`expired_partitions`, :func:`drop_partition`) is
  run by the relay owning key partition 0 (``relay.partitions``): it creates the partitions
  of the next :data:`AHEAD` periods and drops a partition once its upper bound is older than
  the retention and no row in it is pending or quarantined.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import text
from sqlalchemy.engine import Connection

from outbox.errors import ConfigError
from outbox.logs import fields
from outbox.outage import report_failure

log = logging.getLogger("outbox.partitions")

HOURLY = 3600
DAILY = 86400
LENGTHS = {"hourly": HOURLY, "daily": DAILY}
"""The names ``init-db --partitioned`` accepts, in seconds."""

MAX_LENGTH = 31 * DAILY
AHEAD = 3
"""Partitions kept ready beyond the current one (the DEFAULT partition catches the rest)."""

LOCK_TIMEOUT_MS = 200
"""How long upkeep waits for a lock before it gives up until its next round. A drop takes an
ACCESS EXCLUSIVE lock on the table (writers queue behind it while it waits, so the wait is
short); a new partition's ATTACH an ACCESS EXCLUSIVE one on the (empty) DEFAULT partition."""

_COMMENT = "outbox: partitioned by created_at every {n} s"
_COMMENT_RE = re.compile(r"outbox: partitioned by created_at every (\d+) s")
_STAMP = "%Y%m%dT%H%M%S"


def partition_length(value: object, setting: str = "partitioned") -> int | None:
    """``hourly``, ``daily``, a whole number of seconds (int, or digits), or None/False/""
    (not partitioned) -> seconds or None; anything else is a ConfigError naming ``setting``."""
    if value is None or value is False or value == "":
        return None
    if isinstance(value, str):
        word = value.strip().lower()
        if word in LENGTHS:
            return LENGTHS[word]
        if not (word.isascii() and word.isdigit()):  # "\u00b2".isdigit() is True
            raise ConfigError(
                setting, f"{value!r} is not hourly, daily or a whole number of seconds"
            )
        value = int(word)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(setting, f"{value!r} is not hourly, daily or a whole number of seconds")
    if not 1 <= value <= MAX_LENGTH:
        raise ConfigError(setting, f"must be from 1 to {MAX_LENGTH} seconds, got {value}")
    return value


@dataclass(frozen=True)
class Partition:
    """One partition of the outbox table: its name and bounds (unix seconds; None for the
    DEFAULT partition), with the row estimate of the statistics views."""

    name: str
    lower: float | None
    upper: float | None
    rows: int = 0

    @property
    def is_default(self) -> bool:
        return self.lower is None


def qualified(schema_name: str, name: str) -> str:
    return f'"{schema_name}"."{name}"'


def partition_name(table: str, lower: float) -> str:
    stamp = datetime.fromtimestamp(lower, UTC).strftime(_STAMP)
    return f"{table[: 63 - 17]}_p{stamp}"


def default_name(table: str) -> str:
    return f"{table[: 63 - 8]}_default"


def comment(length: int) -> str:
    return _COMMENT.format(n=length)


def relkind(conn: Connection, quoted: str) -> str | None:
    """``p`` for a partitioned table, ``r`` for a plain one, None when there is none."""
    kind = conn.execute(
        text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:q)"), {"q": quoted}
    ).scalar()
    return None if kind is None else str(kind)


def table_length(conn: Connection, quoted: str) -> int | None:
    """The partition length of the outbox table ``quoted`` (None: plain or missing). A
    partitioned table without the outbox's comment is a ConfigError: it was not made by the
    toolkit, and its upkeep would be a guess."""
    if conn.dialect.name != "postgresql" or relkind(conn, quoted) != "p":
        return None
    found = commented_length(conn, quoted)
    if found is None:
        raise ConfigError(
            "partitioned",
            f"{quoted} is partitioned but has no {_COMMENT.format(n='N')!r} comment: create it "
            "with init-db --partitioned (or outbox.migrations.create_extras(partitioned=...))",
        )
    return found


def commented_length(conn: Connection, quoted: str) -> int | None:
    """The period the table's comment states, if it has the outbox's comment."""
    note = conn.execute(text("SELECT obj_description(to_regclass(:q), 'pg_class')"), {"q": quoted})
    found = _COMMENT_RE.search(str(note.scalar() or ""))
    return None if found is None else int(found.group(1))


def list_partitions(conn: Connection, schema_name: str, table: str, length: int) -> list[Partition]:
    """The toolkit's partitions of the table, oldest first, the DEFAULT one last."""
    rows = conn.execute(
        text(
            """SELECT c.relname, c.relpartbound IS NOT NULL
                      AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT',
                      coalesce(s.n_live_tup, 0)
            FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
            LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
            WHERE i.inhparent = to_regclass(:q)"""
        ),
        {"q": qualified(schema_name, table)},
    ).all()
    prefix = partition_name(table, 0)[:-15]
    out: list[Partition] = []
    for name, is_default, live in rows:
        if is_default:
            out.append(Partition(str(name), None, None, int(live)))
            continue
        stamp = str(name)[len(prefix) :]
        if not str(name).startswith(prefix):
            continue
        try:
            lower = datetime.strptime(stamp, _STAMP).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue  # not one of ours: never touched
        out.append(Partition(str(name), lower, lower + length, int(live)))
    out.sort(key=lambda p: (p.lower is None, p.lower or 0.0))
    return out


def _storage(parameters: dict[str, str]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in parameters.items())


def _db_epoch(conn: Connection) -> float:
    return float(conn.execute(text("SELECT extract(epoch FROM now())")).scalar_one())


def create_default(
    conn: Connection, schema_name: str, table: str, parameters: dict[str, str]
) -> None:
    conn.execute(
        text(
            f"CREATE TABLE IF NOT EXISTS {qualified(schema_name, default_name(table))} "
            f"PARTITION OF {qualified(schema_name, table)} DEFAULT WITH ({_storage(parameters)})"
        )
    )


def ensure_partitions(
    conn: Connection,
    schema_name: str,
    table: str,
    length: int,
    parameters: dict[str, str],
    *,
    now: float | None = None,
    ahead: int = AHEAD,
) -> list[str]:
    """Create the partitions of the current period and the ``ahead`` next ones that are
    missing (each in a savepoint of ``conn``'s transaction); their names. ``now``: unix
    seconds (default: the database clock). A period whose rows already went to the DEFAULT
    partition (upkeep stopped longer than ``ahead`` periods) cannot be created: it is logged
    and skipped, and its rows stay in the DEFAULT partition."""
    at = _db_epoch(conn) if now is None else float(now)
    first = math.floor(at / length) * length
    have = {p.name for p in list_partitions(conn, schema_name, table, length)}
    created: list[str] = []
    for k in range(ahead + 1):
        lower = first + k * length
        name = partition_name(table, lower)
        if name in have:
            continue
        bounds = [datetime.fromtimestamp(b, UTC).isoformat() for b in (lower, lower + length)]
        part = qualified(schema_name, name)
        # Made apart, then attached: CREATE TABLE ... PARTITION OF would take an ACCESS
        # EXCLUSIVE lock on the table (every writer waits behind it, and it behind any open
        # transaction); ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE, which writers and
        # claims do not conflict with. The CHECK spares ATTACH a scan of the new table.
        statements = (
            f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}",
            f"CREATE TABLE {part} (LIKE {qualified(schema_name, table)} INCLUDING DEFAULTS) "
            f"WITH ({_storage(parameters)})",
            f"ALTER TABLE {part} ADD CONSTRAINT bounds CHECK "
            f"(created_at >= '{bounds[0]}' AND created_at < '{bounds[1]}')",
            f"ALTER TABLE {qualified(schema_name, table)} ATTACH PARTITION {part} "
            f"FOR VALUES FROM ('{bounds[0]}') TO ('{bounds[1]}')",
            f"ALTER TABLE {part} DROP CONSTRAINT bounds",
        )
        try:
            with conn.begin_nested():
                for sql in statements:
                    conn.execute(text(sql))
        except Exception as exc:
            report_failure(
                log,
                "cannot create an outbox partition now; again next round (its rows go to the "
                "DEFAULT partition until then)",
                exc,
                partition=name,
            )
            continue
        created.append(name)
    return created


def holds_unpublished(conn: Connection, schema_name: str, name: str) -> bool:
    """Whether a pending or quarantined row is in the partition (two probes of its partial
    indexes)."""
    part = qualified(schema_name, name)
    return bool(
        conn.execute(
            text(
                f"SELECT EXISTS (SELECT 1 FROM {part} WHERE state = 'pending') "
                f"OR EXISTS (SELECT 1 FROM {part} WHERE state = 'quarantined')"
            )
        ).scalar()
    )


def expired_partitions(
    conn: Connection,
    schema_name: str,
    table: str,
    length: int,
    retention_seconds: float,
    *,
    now: float | None = None,
) -> tuple[list[Partition], list[Partition]]:
    """``(droppable, kept)``: the partitions whose upper bound is older than the retention,
    split by whether a row in them is still pending or quarantined (those are kept, however
    old). The DEFAULT partition is never either."""
    if retention_seconds <= 0:
        return [], []
    at = _db_epoch(conn) if now is None else float(now)
    cutoff = at - retention_seconds
    droppable: list[Partition] = []
    kept: list[Partition] = []
    for part in list_partitions(conn, schema_name, table, length):
        if part.upper is None or part.upper > cutoff:
            continue
        (kept if holds_unpublished(conn, schema_name, part.name) else droppable).append(part)
    return droppable, kept


def drop_partition(conn: Connection, schema_name: str, table: str, part: Partition) -> bool:
    """Detach and drop ``part`` in the transaction ``conn`` is in, unless a pending or
    quarantined row is in it; whether it went.

    The table is locked first (ACCESS EXCLUSIVE, waiting at most :data:`LOCK_TIMEOUT_MS`):
    once no other transaction holds it, no writer whose transaction began inside the
    partition's range is still open, so the check that follows cannot be outrun by a late
    insert. (``DETACH ... CONCURRENTLY`` is not allowed on a table with a DEFAULT partition,
    and the lock is held for a few catalogue updates only.)"""
    conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
    conn.execute(text(f"LOCK TABLE {qualified(schema_name, table)} IN ACCESS EXCLUSIVE MODE"))
    if holds_unpublished(conn, schema_name, part.name):
        return False
    conn.execute(
        text(
            f"ALTER TABLE {qualified(schema_name, table)} "
            f"DETACH PARTITION {qualified(schema_name, part.name)}"
        )
    )
    conn.execute(text(f"DROP TABLE {qualified(schema_name, part.name)}"))
    log.info("outbox partition dropped", extra=fields(partition=part.name, rows=part.rows))
    return True


__all__ = [
    "AHEAD",
    "DAILY",
    "HOURLY",
    "LENGTHS",
    "Partition",
    "comment",
    "drop_partition",
    "ensure_partitions",
    "expired_partitions",
    "list_partitions",
    "partition_length",
    "table_length",
]
