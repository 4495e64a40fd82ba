"""The relay store on SQLite: one relay at a time (a lock file), BEGIN IMMEDIATE claims (see
:mod:`relay.store`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from outbox.dialect import NOW_SQL, SQLITE
from outbox.logs import fields
from outbox.schema import OutboxSchema
from relay.records import Orphan, Record, RequeueResult, TopicStatus
from relay.store.base import (
    full_table,
    highest_receipts,
    requeue_quarantined,
    topic_status,
)
from relay.store.pg_statements import PG_BLOCKED

log = logging.getLogger("outbox.relay")


# -- SQLite ------------------------------------------------------------------------------------

_SQLITE_NOW = NOW_SQL[SQLITE]

_SQLITE_RECORD_COLUMNS = """o.seq, o.event_id, o.topic, o.key, o.key_hash, o.tenant, o.identity,
    o.payload, o.headers,
    replace(substr(o.created_at, 1, 23), ' ', 'T') || 'Z',
    (julianday(o.created_at) - 2440587.5) * 86400.0, o.attempts"""

SQLITE_CLAIM = (
    """
SELECT """
    + _SQLITE_RECORD_COLUMNS
    + """
FROM {t} o
WHERE o.state = 'pending' AND o.claimed_by IS NULL AND o.available_at <= """
    + _SQLITE_NOW
    + """
  AND """
    + PG_BLOCKED.replace("{t}", "{t}")
    + """
ORDER BY o.seq
LIMIT :limit"""
)


class SqliteStore:
    """The relay's statements on SQLite: one relay at a time (a lock file), BEGIN IMMEDIATE,
    polling. Same semantics as :class:`PostgresStore` with a single partition."""

    payload_is_json = False
    supports_notify = False
    partitions = 1

    def __init__(self, engine: Engine, schema: OutboxSchema, *, reconcile_after: float) -> None:
        self.engine = engine
        self.schema = schema
        self.reconcile_after = reconcile_after
        self.t = full_table(schema)
        self._lock_fd: int | None = None
        self._owned: frozenset[int] = frozenset()
        self._waiting_logged = False

    def _lock_path(self) -> str | None:
        database = self.engine.url.database
        if not database or database == ":memory:":
            return None
        return os.path.abspath(database) + ".relay.lock"

    def connect(self) -> None:
        pass

    def close(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
        self._lock_fd = None
        self._owned = frozenset()

    def __del__(self) -> None:
        # A relay its user dropped lets go of the database at once, as on PostgreSQL (where
        # the partition locks go with the connection): the lock file is this process's.
        with contextlib.suppress(Exception):
            self.close()

    @property
    def partitions_owned(self) -> frozenset[int]:
        return self._owned

    def partition_rebalance_due(self) -> bool:
        return not self._owned

    def partition_rebalance(self, before_release: Callable[[], None] = lambda: None) -> bool:
        if self._owned:
            return False
        path = self._lock_path()
        if path is not None:
            import fcntl

            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                if not self._waiting_logged:
                    log.warning(
                        "another relay holds this SQLite database; waiting (SQLite runs one "
                        "relay at a time)",
                        extra=fields(lock=path),
                    )
                    self._waiting_logged = True
                return False
            self._lock_fd = fd
        self._owned = frozenset({0})
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    f"UPDATE {self.t} SET attempts = attempts + 1, "
                    "available_at = max(available_at, strftime('%Y-%m-%d %H:%M:%f', claimed_at, "
                    "'+' || :after || ' seconds')), "
                    "last_error = 'relay ' || claimed_by || ' left an intent without a receipt' "
                    "WHERE state = 'pending' AND claimed_by IS NOT NULL"
                ),
                {"after": self.reconcile_after},
            )
        return True

    def outbox_claim(self, limit: int, owner: str, epoch: int, sweep: bool) -> list[Record]:
        if not self._owned:
            return []
        sql = SQLITE_CLAIM.replace("{t}", self.t)
        with (
            self.engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn,
            conn.begin(),
        ):
            rows = conn.execute(text(sql), {"limit": limit}).fetchall()
            if not rows:
                return []
            conn.execute(
                text(
                    f"UPDATE {self.t} SET claimed_by = :owner, claim_epoch = :epoch, "
                    f"claimed_at = {_SQLITE_NOW} WHERE seq = :seq"
                ),
                [{"owner": owner, "epoch": epoch, "seq": r[0]} for r in rows],
            )
        return [_sqlite_record(r) for r in rows]

    def _run_many(self, sql: str, params: list[dict[str, Any]]) -> int:
        if not params:
            return 0
        with self.engine.begin() as conn:
            result = conn.execute(text(sql), params)
            return int(result.rowcount)

    def outbox_mark_published(
        self, owner: str, epoch: int, receipts: Sequence[tuple[int, str, str]]
    ) -> int:
        return self._run_many(
            f"UPDATE {self.t} SET state = 'published', stream = :stream, stream_id = :sid, "
            f"published_at = {_SQLITE_NOW} WHERE seq = :seq AND claimed_by = :owner "
            "AND claim_epoch = :epoch AND state = 'pending'",
            [
                {"seq": s, "stream": st, "sid": sid, "owner": owner, "epoch": epoch}
                for s, st, sid in receipts
            ],
        )

    def outbox_mark_failed(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, float, str, bool]]
    ) -> None:
        self._run_many(
            f"UPDATE {self.t} SET attempts = attempts + 1, "
            "available_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || :delay || ' seconds'), "
            "last_error = :err, "
            "claimed_by = CASE WHEN :keep THEN claimed_by END, "
            "claim_epoch = CASE WHEN :keep THEN claim_epoch END, "
            "claimed_at = CASE WHEN :keep THEN claimed_at END "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [
                {
                    "seq": s,
                    "delay": f"{delay:.6f}",
                    "err": err[:2000],
                    "keep": 1 if keep else 0,
                    "owner": owner,
                    "epoch": epoch,
                }
                for s, delay, err, keep in failures
            ],
        )

    def outbox_quarantine(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, str]]
    ) -> None:
        self._run_many(
            f"UPDATE {self.t} SET state = 'quarantined', attempts = attempts + 1, "
            "last_error = :err, claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [{"seq": s, "err": err[:2000], "owner": owner, "epoch": epoch} for s, err in failures],
        )

    def outbox_release(self, owner: str, epoch: int, seqs: Sequence[int]) -> None:
        self._run_many(
            f"UPDATE {self.t} SET claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [{"seq": s, "owner": owner, "epoch": epoch} for s in seqs],
        )

    def outbox_retry_now(self, seqs: Sequence[int]) -> int:
        return self._run_many(
            f"UPDATE {self.t} SET available_at = {_SQLITE_NOW} WHERE seq = :seq "
            f"AND claimed_by IS NULL AND state = 'pending' AND available_at > {_SQLITE_NOW}",
            [{"seq": s} for s in seqs],
        )

    def orphan_list(self, limit: int) -> list[Orphan]:
        if not self._owned:
            return []
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT seq, event_id, topic, key, key_hash, tenant, claimed_by, claim_epoch, "
                    "(julianday(claimed_at) - 2440587.5) * 86400.0 "
                    f"FROM {self.t} WHERE state = 'pending' AND attempts > 0 "
                    f"AND claimed_by IS NOT NULL AND available_at <= {_SQLITE_NOW} "
                    "AND claimed_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', "
                    "'-' || :after || ' seconds') ORDER BY seq LIMIT :limit"
                ),
                {"after": self.reconcile_after, "limit": limit},
            ).fetchall()
        return [
            Orphan(int(r[0]), r[1], r[2], r[3], int(r[4]), r[5], r[6], int(r[7]), float(r[8]))
            for r in rows
        ]

    def orphan_resolve(
        self, found: Sequence[tuple[Orphan, str, str]], missing: Sequence[Orphan]
    ) -> None:
        self._run_many(
            f"UPDATE {self.t} SET state = 'published', stream = :stream, stream_id = :sid, "
            f"published_at = {_SQLITE_NOW} WHERE seq = :seq AND claimed_by = :owner "
            "AND claim_epoch = :epoch AND state = 'pending'",
            [
                {
                    "seq": o.seq,
                    "stream": s,
                    "sid": i,
                    "owner": o.claimed_by,
                    "epoch": o.claim_epoch,
                }
                for o, s, i in found
            ],
        )
        self._run_many(
            f"UPDATE {self.t} SET claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [{"seq": o.seq, "owner": o.claimed_by, "epoch": o.claim_epoch} for o in missing],
        )

    def outbox_retry_ready(self) -> bool:
        return False  # SQLite claims always scan from the first pending row

    def notify_wait(self, timeout: float) -> int:
        time.sleep(timeout)
        return 0

    def outbox_delete_published(self, older_than_seconds: float, limit: int) -> int:
        with self.engine.begin() as conn:
            result = conn.execute(
                text(
                    f"DELETE FROM {self.t} WHERE seq IN (SELECT seq FROM {self.t} "
                    "WHERE state = 'published' AND published_at < "
                    "strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || :age || ' seconds') "
                    "ORDER BY seq LIMIT :limit)"
                ),
                {"age": f"{older_than_seconds:.6f}", "limit": limit},
            )
            return int(result.rowcount)

    def outbox_backlog(self) -> tuple[int, float | None]:
        with self.engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT count(*), (julianday('now') - julianday(min(created_at))) * 86400.0 "
                    f"FROM {self.t} WHERE state = 'pending'"
                )
            ).fetchone()
        assert row is not None
        return int(row[0]), (float(row[1]) if row[1] is not None else None)

    def receipt_store(self) -> None:
        return None  # one writer at a time: a second connection would only wait for the lock

    def outbox_vacuum_if_no_autovacuum(self) -> None:
        return None

    def outbox_status(self) -> dict[str, TopicStatus]:
        with self.engine.connect() as conn:
            return topic_status(conn, self.t, NOW_SQL[SQLITE])

    def outbox_requeue(
        self,
        event_ids: Sequence[str] | None,
        all_quarantined: bool,
        joined: Connection | None = None,
    ) -> RequeueResult:
        return requeue_quarantined(
            self.engine, self.t, NOW_SQL[SQLITE], event_ids, all_quarantined, joined=joined
        )

    def outbox_published_page(
        self,
        after_seq: int,
        limit: int,
        *,
        since: datetime | None = None,
        topic: str | None = None,
    ) -> list[tuple[Record, str | None]]:
        sql = (
            f"SELECT {_SQLITE_RECORD_COLUMNS}, o.stream FROM {self.t} o "
            "WHERE o.seq > :after AND o.state = 'published'"
            + ("" if since is None else " AND o.created_at >= :since")
            + ("" if topic is None else " AND o.topic = :topic")
            + " ORDER BY o.seq LIMIT :limit"
        )
        params: dict[str, Any] = {"after": after_seq, "topic": topic, "limit": limit}
        if since is not None:
            params["since"] = _sqlite_time(since)
        with self.engine.connect() as conn:
            rows = conn.execute(text(sql), params).fetchall()
        return [(_sqlite_record(row[:12]), row[12]) for row in rows]

    def receipt_latest(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    f"SELECT stream, stream_id FROM {self.t} WHERE state = 'published' "
                    "AND stream_id IS NOT NULL ORDER BY seq DESC LIMIT 1000"
                )
            ).fetchall()
        return highest_receipts(rows)

    def outbox_oldest_published_since(self, published_after: float | None) -> datetime | None:
        with self.engine.connect() as conn:
            value = conn.execute(
                text(
                    f"SELECT min(created_at) FROM {self.t} WHERE state = 'published' "
                    "AND published_at >= strftime('%Y-%m-%d %H:%M:%f', :after, 'unixepoch')"
                ),
                {"after": published_after or 0.0},
            ).scalar()
        if value is None:
            return None
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
        return datetime.fromisoformat(str(value).replace(" ", "T")).replace(tzinfo=UTC)


def _sqlite_time(value: datetime) -> str:
    """A timestamp as SQLite's columns hold it: UTC text with milliseconds."""
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:23]


def _sqlite_record(r: Sequence[Any]) -> Record:
    payload = r[7] if isinstance(r[7], str) else json.dumps(r[7])
    headers = r[8] if (r[8] is None or isinstance(r[8], str)) else json.dumps(r[8])
    return Record(
        int(r[0]),
        r[1],
        r[2],
        r[3],
        int(r[4]),
        r[5],
        r[6],
        payload,
        headers,
        str(r[9]),
        float(r[10] or 0.0),
        int(r[11]),
    )
