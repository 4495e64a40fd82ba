"""The relay store on MySQL 8 and MariaDB 10.6+: partitions owned through named locks
(``GET_LOCK``), the claim in seq order from the first pending row with ``FOR UPDATE SKIP
LOCKED``, the intent and the receipt as on PostgreSQL (see :mod:`relay.store`). Its SQL, each
statement with its reason (and why there is no claim floor here):
:mod:`relay.store.mysql_statements`.

Partitions. A relay holds one session-level named lock per partition it owns,
``GET_LOCK(name, 0)`` (never waits); the server releases them when the session ends, a
SIGKILLed relay's included (its TCP connection closes). Replicas count each other through
member slots: each live relay holds one ``member`` lock of a fixed range, and
``IS_USED_LOCK`` over that range is the number of replicas. Named locks need no table and no
privilege beyond connecting, take no row locks a writer could meet, and cannot outlive their
relay (a leases table would need expiry times and a clock to judge them by).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import zlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.elements import TextClause

from outbox.dialect import MYSQL, NOW_SQL
from outbox.duty import Interval, weakly
from outbox.logs import fields
from outbox.schema import OutboxSchema
from relay.records import Orphan, Record, RequeueResult, TopicStatus
from relay.store import mysql_statements as sql
from relay.store.base import full_table, highest_receipts, requeue_quarantined, topic_status

log = logging.getLogger("outbox.relay")

MEMBER_SLOTS = 64
"""How many member slots replicas count each other with (more replicas than this still
work; they are counted as this many)."""

_EXPANDING = ("parts", "seqs")


def _statement(template: str, table: str) -> TextClause:
    """A statement of :mod:`relay.store.mysql_statements` for ``table``, its list
    parameters expanded (``IN :seqs``)."""
    body = template.replace("{t}", table)
    clause = text(body)
    lists: list[Any] = [
        bindparam(name, expanding=True) for name in _EXPANDING if f":{name}" in body
    ]
    return clause.bindparams(*lists) if lists else clause


class MysqlStore:
    """The relay's statements on MySQL/MariaDB, on one dedicated connection (READ
    COMMITTED, a short transaction per call) that also holds the partition locks."""

    payload_is_json = True  # a JSON column: MySQL validates it, MariaDB checks json_valid
    supports_notify = False  # no LISTEN/NOTIFY: the relay's adaptive polling finds new rows

    def __init__(
        self,
        engine: Engine,
        schema: OutboxSchema,
        *,
        partitions: int,
        reconcile_after: float,
        rebalance_interval: float,
    ) -> None:
        self.engine = engine
        self.schema = schema
        self.partitions = partitions
        self.reconcile_after = reconcile_after
        self.rebalance_interval = rebalance_interval
        self.t = full_table(schema)
        self._sql = {
            name: _statement(getattr(sql, name), self.t)
            for name in dir(sql)
            if name.isupper()
            and isinstance(getattr(sql, name), str)
            and "{t}" in getattr(sql, name)
        }
        self._conn: Connection | None = None
        self._owned: frozenset[int] = frozenset()
        self._names: list[str] = []  # partition lock names
        self._members: list[str] = []  # member slot lock names
        self._rebalance = Interval(weakly(self._rebalance_seconds))

    def _rebalance_seconds(self) -> float:
        return self.rebalance_interval

    # -- connection -------------------------------------------------------------------------

    def connect(self) -> None:
        if self._conn is not None and not self._conn.closed:
            return
        conn = self.engine.connect().execution_options(isolation_level="READ COMMITTED")
        try:
            database = str(conn.exec_driver_sql("SELECT DATABASE()").scalar() or "")
            crc = zlib.crc32(f"{database}.{self.schema.qualified_name}".encode())
            # Named locks are server-wide: the database and table are in the name (hashed,
            # MySQL caps lock names at 64 characters).
            self._names = [f"outbox-relay:{crc:08x}:p{p}" for p in range(self.partitions)]
            self._members = [f"outbox-relay:{crc:08x}:m{m}" for m in range(MEMBER_SLOTS)]
            for name in self._members:
                if conn.execute(text("SELECT GET_LOCK(:n, 0)"), {"n": name}).scalar() == 1:
                    break
            conn.commit()
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._owned = frozenset()
        self._rebalance.make_due()

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                # Closing the session releases its named locks; the pool must not keep it.
                self._conn.invalidate()
                self._conn.close()
        self._conn = None
        self._owned = frozenset()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _run(self, work: Callable[[Connection], Any]) -> Any:
        """``work`` in one transaction on the relay's connection; a lost connection is
        forgotten (its session, and so its locks, are gone) and the error raised."""
        if self._conn is None or self._conn.closed:
            raise ConnectionResetError("the relay's database connection is closed")
        conn = self._conn
        try:
            with conn.begin():
                return work(conn)
        except DBAPIError as exc:
            if exc.connection_invalidated or _is_connection_error(exc):
                self.close()
            raise

    def _exec(self, name: str, params: dict[str, Any]) -> Any:
        return self._run(lambda conn: conn.execute(self._sql[name], params))

    # -- partitions -------------------------------------------------------------------------

    @property
    def partitions_owned(self) -> frozenset[int]:
        return self._owned

    def partition_rebalance_due(self) -> bool:
        return self._rebalance.due() or not self._owned

    def partition_rebalance(self, before_release: Callable[[], None] = lambda: None) -> bool:
        """As on PostgreSQL: take or give back partitions toward a fair share; True if any
        were taken (their orphans marked)."""
        if not self.partition_rebalance_due():
            return False
        self._rebalance.done()
        self.connect()
        taken: set[int] = set()
        mine: set[int] = set()
        members = 1

        def rebalance(conn: Connection) -> None:
            nonlocal members, mine, taken
            members, mine, free = self._read_locks(conn)
            target = math.ceil(self.partitions / members)
            if len(mine) > target:
                extra = sorted(mine)[target:]
                before_release()
                for p in extra:
                    conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": self._names[p]})
                mine -= set(extra)
            elif len(mine) < target:
                taken = self._take(conn, free, target - len(mine))
                mine |= taken
                self._mark_orphans(conn, taken)

        self._run(rebalance)
        changed = frozenset(mine) != self._owned
        self._owned = frozenset(mine)
        if changed:
            log.info("partitions", extra=fields(owned=sorted(self._owned), replicas=members))
        return bool(taken)

    def _read_locks(self, conn: Connection) -> tuple[int, set[int], list[int]]:
        """(replicas alive, partitions this session holds, partitions nobody holds), from
        one ``IS_USED_LOCK`` probe of every member slot and partition lock."""
        names = self._members + self._names
        probes = ", ".join(f"IS_USED_LOCK(:n{i})" for i in range(len(names)))
        row = conn.execute(
            text(f"SELECT CONNECTION_ID(), {probes}"), {f"n{i}": n for i, n in enumerate(names)}
        ).one()
        me, holders = row[0], list(row[1:])
        members = max(1, sum(h is not None for h in holders[: len(self._members)]))
        parts = holders[len(self._members) :]
        mine = {p for p, h in enumerate(parts) if h == me}
        return members, mine, [p for p, h in enumerate(parts) if h is None]

    def _take(self, conn: Connection, free: list[int], wanted: int) -> set[int]:
        """Up to ``wanted`` of the ``free`` partitions, in random order (replicas starting
        together do not all try the same ones); ``GET_LOCK(name, 0)`` never waits."""
        random.shuffle(free)
        taken: set[int] = set()
        for p in free:
            if len(taken) >= wanted:
                break
            if conn.execute(text("SELECT GET_LOCK(:n, 0)"), {"n": self._names[p]}).scalar() == 1:
                taken.add(p)
        return taken

    def _mark_orphans(self, conn: Connection, taken: set[int]) -> None:
        """The intents left in partitions just taken: a relay that lost them left them."""
        if not taken:
            return
        params = {"nparts": self.partitions, "parts": sorted(taken)}
        orphans = [r[0] for r in conn.execute(self._sql["ORPHAN_INTENTS"], params)]
        if orphans:
            conn.execute(
                self._sql["MARK_ORPHANS"],
                {"after_us": sql.micros(self.reconcile_after), "seqs": orphans},
            )

    # -- claim and outcomes -----------------------------------------------------------------

    def outbox_claim(self, limit: int, owner: str, epoch: int, sweep: bool) -> list[Record]:
        # ``sweep`` asks other stores to look below their claim floor; every claim here starts
        # at the first pending row (mysql_statements.CLAIM_CANDIDATES), so it is always one.
        if not self._owned:
            return []
        parts = {"nparts": self.partitions, "parts": sorted(self._owned), "limit": limit}

        def claim(conn: Connection) -> list[Record]:
            seqs = [r[0] for r in conn.execute(self._sql["CLAIM_CANDIDATES"], parts)]
            if not seqs:
                return []
            rows = conn.execute(self._sql["CLAIM_LOCK"], {"seqs": seqs}).fetchall()
            if not rows:
                return []
            conn.execute(
                self._sql["CLAIM_INTENT"],
                {"owner": owner, "epoch": epoch, "seqs": [r[0] for r in rows]},
            )
            return [_record(r) for r in rows]

        records: list[Record] = self._run(claim)
        return records

    def outbox_mark_published(
        self, owner: str, epoch: int, receipts: Sequence[tuple[int, str, str]]
    ) -> int:
        if not receipts:
            return 0
        doc = json.dumps([[s, st, sid] for s, st, sid in receipts])
        params = {"doc": doc, "owner": owner, "epoch": epoch, "seqs": [r[0] for r in receipts]}
        return int(self._exec("PUBLISHED", params).rowcount)

    def outbox_mark_failed(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, float, str, bool]]
    ) -> None:
        if failures:
            doc = json.dumps(
                [[s, sql.micros(d), e[:2000], 1 if keep else 0] for s, d, e, keep in failures]
            )
            seqs = [f[0] for f in failures]
            self._exec("FAILED", {"doc": doc, "owner": owner, "epoch": epoch, "seqs": seqs})

    def outbox_quarantine(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, str]]
    ) -> None:
        if failures:
            doc = json.dumps([[s, e[:2000]] for s, e in failures])
            seqs = [f[0] for f in failures]
            self._exec("QUARANTINE", {"doc": doc, "owner": owner, "epoch": epoch, "seqs": seqs})

    def outbox_release(self, owner: str, epoch: int, seqs: Sequence[int]) -> None:
        if seqs:
            self._exec("RELEASE", {"seqs": list(seqs), "owner": owner, "epoch": epoch})

    def outbox_retry_now(self, seqs: Sequence[int]) -> int:
        if not seqs:
            return 0
        return int(self._exec("RETRY_NOW", {"seqs": list(seqs)}).rowcount)

    def orphan_list(self, limit: int) -> list[Orphan]:
        if not self._owned:
            return []
        rows = self._exec(
            "ORPHANS",
            {
                "after_us": sql.micros(self.reconcile_after),
                "nparts": self.partitions,
                "parts": sorted(self._owned),
                "limit": limit,
            },
        ).fetchall()
        return [
            Orphan(int(r[0]), r[1], r[2], r[3], int(r[4]), r[5], r[6], int(r[7]), float(r[8]))
            for r in rows
        ]

    def outbox_retry_ready(self) -> bool:
        return False  # every claim starts at the first pending row: no sweep to ask for

    def orphan_resolve(
        self, found: Sequence[tuple[Orphan, str, str]], missing: Sequence[Orphan]
    ) -> None:
        if found:
            doc = json.dumps([[o.seq, s, i, o.claimed_by, o.claim_epoch] for o, s, i in found])
            self._exec("RESOLVE_FOUND", {"doc": doc, "seqs": [o.seq for o, _s, _i in found]})
        if missing:
            doc = json.dumps([[o.seq, o.claimed_by, o.claim_epoch] for o in missing])
            self._exec("RESOLVE_MISSING", {"doc": doc, "seqs": [o.seq for o in missing]})

    def notify_wait(self, timeout: float) -> int:
        import time

        time.sleep(timeout)
        return 0

    # -- retention, progress and the operator's commands ------------------------------------

    def outbox_delete_published(self, older_than_seconds: float, limit: int) -> int:
        return delete_published(self.engine, self.t, older_than_seconds, limit)

    def outbox_backlog(self) -> tuple[int, float | None]:
        with self.engine.connect() as conn:
            row = conn.execute(self._sql["BACKLOG"]).one()
        return int(row[0]), (float(row[1]) if row[1] is not None else None)

    def receipt_store(self) -> None:
        return None  # claims and receipts share the connection: one short transaction each

    def outbox_vacuum_if_no_autovacuum(self) -> None:
        return None  # InnoDB's purge threads clean up after updates and deletes

    def outbox_status(self) -> dict[str, TopicStatus]:
        with self.engine.connect() as conn:
            return topic_status(conn, self.t, NOW_SQL[MYSQL])

    def outbox_requeue(
        self,
        event_ids: Sequence[str] | None,
        all_quarantined: bool,
        joined: Connection | None = None,
    ) -> RequeueResult:
        return requeue_quarantined(
            self.engine, self.t, NOW_SQL[MYSQL], event_ids, all_quarantined, None, joined
        )

    def outbox_published_page(
        self,
        after_seq: int,
        limit: int,
        *,
        since: datetime | None = None,
        topic: str | None = None,
    ) -> list[tuple[Record, str | None]]:
        body = (
            sql.PUBLISHED_PAGE.replace("{t}", self.t)
            + ("" if since is None else " AND o.created_at >= :since")
            + ("" if topic is None else " AND o.topic = :topic")
            + " ORDER BY o.seq LIMIT :limit"
        )
        params: dict[str, Any] = {"after": after_seq, "limit": limit}
        if since is not None:
            params["since"] = _utc_naive(since)
        if topic is not None:
            params["topic"] = topic
        with self.engine.connect() as conn:
            rows = conn.execute(text(body), params).fetchall()
        return [(_record(row[:12]), row[12]) for row in rows]

    def receipt_latest(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(self._sql["RECEIPT_LATEST"]).fetchall()
        return highest_receipts(rows)

    def outbox_oldest_published_since(self, published_after: float | None) -> datetime | None:
        with self.engine.connect() as conn:
            value = conn.execute(
                self._sql["OLDEST_PUBLISHED_SINCE"],
                {"after_us": sql.micros(published_after or 0.0)},
            ).scalar()
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value if value.tzinfo else value.replace(tzinfo=UTC)


def delete_published(engine: Engine, table: str, older_than_seconds: float, limit: int) -> int:
    """One retention round on MySQL (``outbox-relay purge`` and the relay's retention):
    published rows past the age, oldest first, at most ``limit``."""
    age_us = sql.micros(older_than_seconds)
    # READ COMMITTED: no gap locks, so writers inserting meanwhile never wait on the delete.
    with engine.execution_options(isolation_level="READ COMMITTED").begin() as conn:
        stop = conn.execute(_statement(sql.RETENTION_STOP, table), {"age_us": age_us}).scalar()
        result = conn.execute(
            _statement(sql.RETENTION, table),
            {"age_us": age_us, "limit": limit, "stop": stop if stop is not None else 2**63 - 1},
        )
        return int(result.rowcount)


def count_published_due(engine: Engine, table: str, older_than_seconds: float) -> int:
    """How many published rows are past the age (``outbox-relay purge --dry-run``)."""
    with engine.connect() as conn:
        value = conn.execute(
            _statement(sql.RETENTION_DUE, table), {"age_us": sql.micros(older_than_seconds)}
        ).scalar()
    return int(value or 0)


def _utc_naive(value: datetime) -> datetime:
    """A timestamp as the DATETIME(6) columns hold it: UTC without an offset."""
    return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value


def _record(r: Sequence[Any]) -> Record:
    return Record(
        int(r[0]),
        r[1],
        r[2],
        r[3],
        int(r[4]),
        r[5],
        r[6],
        r[7] if isinstance(r[7], str) else json.dumps(r[7]),
        r[8] if (r[8] is None or isinstance(r[8], str)) else json.dumps(r[8]),
        str(r[9]),
        float(r[10] or 0.0),
        int(r[11]),
    )


def _is_connection_error(exc: DBAPIError) -> bool:
    """A lost or unusable connection: the client error codes every MySQL driver reports
    (2003 cannot connect, 2006 server gone, 2013 lost during a query, 2055 lost at a
    handshake), or the server shutting down (1053) or killing the session (1927)."""
    args = getattr(exc.orig, "args", ())
    code = args[0] if args and isinstance(args[0], int) else 0
    return code in (1053, 1927, 2003, 2006, 2013, 2055) or type(exc.orig).__name__ == (
        "InterfaceError"
    )
