"""The relay store on PostgreSQL: partitions owned through advisory locks, the claim that
writes the intent, LISTEN/NOTIFY (see :mod:`relay.store`). Its SQL, each statement with its
reason: :mod:`relay.store.pg_statements`."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, cast

from psycopg import sql as psycopg_sql
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from outbox.dialect import NOW_SQL, POSTGRESQL
from outbox.duty import Interval, weakly
from outbox.logs import fields
from outbox.maintenance import vacuum_unless_autovacuum
from outbox.outage import report_failure
from outbox.schema import OutboxSchema, table_schema_of
from relay.records import Orphan, Record, RequeueResult, TopicStatus
from relay.store.base import (
    full_table,
    highest_receipts,
    requeue_quarantined,
    topic_status,
)
from relay.store.partitions import statements_for
from relay.store.pg_statements import (
    PG_LOCKS,
    PG_MEMBER_LOCK,
    PG_NAMED,
    PG_OLDEST_PUBLISHED_SINCE,
    PG_PUBLISHED_PAGE,
    PG_PUBLISHED_PAGE_END,
    PG_PUBLISHED_PAGE_SINCE,
    PG_PUBLISHED_PAGE_TOPIC,
    PG_RECEIPT_LATEST,
    PG_SERIAL_SEQUENCE,
    PG_SNAPSHOT,
    PG_TABLE_SCHEMA,
    PG_TRY_LOCK_PARTITIONS,
    PG_UNLOCK_PARTITIONS,
)

log = logging.getLogger("outbox.relay")


SETTLE = 0.25
"""Seconds between reading a sequence value and the snapshot whose xmax covers it."""


FLOOR_SAMPLE_INTERVAL = 0.1
"""Seconds between two samples of the snapshot that raise the claim floor. Each is a round
trip of its own: every 50 ms it was 40 statements a second for two idle-ish relays (4 per
effect at 10 events/s, issue 54), while the floor lags ``SETTLE`` (0.25 s) behind anyway."""


class PostgresStore:
    """The relay's statements on PostgreSQL (psycopg 3, autocommit: each statement is one
    short transaction). See the module doc for the design."""

    payload_is_json = True
    supports_notify = True

    def __init__(
        self,
        engine: Engine,
        schema: OutboxSchema,
        *,
        partitions: int,
        reconcile_after: float,
        listen: bool,
        rebalance_interval: float,
        sweep_interval: float,
        member: bool = True,
    ) -> None:
        self.member = member  # False: a helper connection (receipts), not a replica
        self.engine = engine
        self.schema = schema
        self.partitions = partitions
        self.reconcile_after = reconcile_after
        self.listen = listen
        self.rebalance_interval = rebalance_interval
        self.sweep_interval = sweep_interval
        self._conn: Any = None
        self._listen_conn: Any = None
        self._owned: frozenset[int] = frozenset()
        self._sql: dict[str, str] = {}
        self._lock_class = 0
        self._member_class = 0
        self._member_id = random.randrange(1, 2**31 - 1)
        self._sequence = ""
        self._samples: list[tuple[float, int, int]] = []  # (monotonic, xmax, last_value)
        self._floor = 0  # highest sequence value that can no longer appear
        self._low = 0  # where ordinary claims start (see claim)
        self._sweep_pos: int | None = None  # where the sweep in progress goes on
        # When partitions are next rebalanced (and at once without any), and when the
        # snapshot is next sampled for the floor (outbox.duty).
        # (Read through a weak reference: a lambda on self would make the store a cycle, kept
        # with its partition locks until the cyclic garbage collector ran.)
        self._rebalance = Interval(weakly(self._rebalance_seconds))
        self._floor_sample = Interval(FLOOR_SAMPLE_INTERVAL)

    # -- connections ------------------------------------------------------------------------

    def _connect_args(self) -> tuple[list[Any], dict[str, Any]]:
        cargs, cparams = self.engine.dialect.create_connect_args(self.engine.url)
        return list(cargs), dict(cparams)

    def _new_connection(self) -> Any:
        import psycopg

        cargs, cparams = self._connect_args()
        cparams.setdefault("connect_timeout", 5)
        conn = psycopg.connect(*cargs, autocommit=True, **cparams)
        # Receipts, backoffs and releases may be lost in a database crash without harm:
        # the intent stays and is reconciled against the stream. The claim (the intent
        # itself) must be durable before any XADD, so the claim statement switches
        # synchronous_commit back on for its own transaction (see PG_CLAIM). This saves a
        # WAL flush per batch.
        conn.execute("SET synchronous_commit = off")
        return conn

    def _rebalance_seconds(self) -> float:
        return self.rebalance_interval

    def connect(self) -> None:
        if self._conn is not None and not self._conn.closed:
            return
        conn = self._new_connection()
        try:
            row = conn.execute("SELECT current_schema()").fetchone()
            schema_name = self.schema.schema or (row[0] if row else "public")
            qualified = f"{schema_name}.{self.schema.table_name}"
            t = f'"{schema_name}"."{self.schema.table_name}"'
            self._sql = {name: sql.replace("{t}", t) for name, sql in PG_NAMED.items()}
            self._sql = statements_for(conn, t, self._sql)  # relay.store.partitions
            self._sql["table"] = t
            seq_row = conn.execute(
                PG_SERIAL_SEQUENCE, (f'"{schema_name}"."{self.schema.table_name}"',)
            ).fetchone()
            self._sequence = seq_row[0] if seq_row and seq_row[0] else ""
            self._lock_class = zlib.crc32(f"outbox-relay:{qualified}".encode()) & 0x7FFFFFFF
            self._member_class = (self._lock_class ^ 0x2B5A5A5A) & 0x7FFFFFFF
            if self.member:
                conn.execute(PG_MEMBER_LOCK, (self._member_class, self._member_id))
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._owned = frozenset()
        self._samples.clear()
        self._floor = 0
        self._low = 0
        self._sweep_pos = None
        self._rebalance.make_due()

    def close(self) -> None:
        for conn in (self._conn, self._listen_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._conn = None
        self._listen_conn = None
        self._owned = frozenset()

    def _lost(self) -> None:
        """Forget a connection that failed: its session (and so its locks) is gone or going."""
        self.close()

    def _execute(self, name: str, params: dict[str, Any]) -> Any:
        if self._conn is None or self._conn.closed:
            raise ConnectionResetError("the relay's database connection is closed")
        try:
            return self._conn.execute(self._sql[name], params)
        except Exception as exc:
            if _is_connection_error(exc):
                self._lost()
            raise

    # -- partitions -------------------------------------------------------------------------

    @property
    def partitions_owned(self) -> frozenset[int]:
        return self._owned

    def partition_rebalance_due(self) -> bool:
        return self._rebalance.due() or not self._owned

    # complexity: the partition rebalance's take and give-back rules
    def partition_rebalance(self, before_release: Callable[[], None] = lambda: None) -> bool:
        """Take or give back partitions toward a fair share (``before_release`` runs first if
        any go back); True if any were taken (orphans marked: the caller should sweep)."""
        if not self.partition_rebalance_due():
            return False
        self._rebalance.done()
        self.connect()
        assert self._conn is not None
        try:
            rows = self._conn.execute(
                PG_LOCKS, {"c": self._lock_class, "m": self._member_class}
            ).fetchall()
            members = max(1, len({(c, o) for c, o, _mine in rows if c == self._member_class}))
            mine = {o for c, o, m in rows if c == self._lock_class and m}
            others = {o for c, o, m in rows if c == self._lock_class and not m}
            target = math.ceil(self.partitions / members)
            taken: set[int] = set()
            if len(mine) > target:
                extra = sorted(mine)[target:]
                before_release()
                self._conn.execute(PG_UNLOCK_PARTITIONS, (self._lock_class, extra))
                mine -= set(extra)
            elif len(mine) < target:
                free = [p for p in range(self.partitions) if p not in mine and p not in others]
                random.shuffle(free)
                if free:
                    got = self._conn.execute(
                        PG_TRY_LOCK_PARTITIONS, (free, self._lock_class, target - len(mine))
                    ).fetchall()
                    taken = {int(r[0]) for r in got}
                    mine |= taken
            if taken:
                self._conn.execute(
                    self._sql["mark_orphans"],
                    {
                        "after": self.reconcile_after,
                        "nparts": self.partitions,
                        "parts": sorted(taken),
                    },
                )
        except Exception as exc:
            if _is_connection_error(exc):
                self._lost()
            raise
        changed = frozenset(mine) != self._owned
        self._owned = frozenset(mine)
        if changed:
            log.info(
                "partitions",
                extra=fields(owned=sorted(self._owned), replicas=members, target=target),
            )
        return bool(taken)

    # -- floor ------------------------------------------------------------------------------

    def _advance_floor(self) -> None:
        """Sample the snapshot (at most every ``FLOOR_SAMPLE_INTERVAL``) and raise the floor
        past sequence values whose transactions have all finished (see the module doc)."""
        now = time.monotonic()
        if not self._floor_sample.due(now) or not self._sequence:
            return
        self._floor_sample.done(now)
        assert self._conn is not None
        try:
            row = self._conn.execute(PG_SNAPSHOT, {"seq": self._sequence}).fetchone()
        except Exception as exc:
            if _is_connection_error(exc):
                self._lost()
                raise
            # Most likely no privilege to read the sequence: claims then start from the
            # first pending row (correct, slower while dead index entries pile up).
            log.warning(
                "cannot read the sequence for the claim floor; claiming from the first row",
                extra=fields(error=f"{type(exc).__name__}: {exc}"[:300]),
            )
            self._sequence = ""
            return
        xmin, xmax, last_value = int(row[0]), int(row[1]), int(row[2])
        self._samples.append((now, xmax, last_value))
        # The sequence value of sample i is safe once every transaction that could hold a
        # value up to it has ended. An INSERT allocates its value a moment before its
        # transaction id, so the xmax that covers sample i is the one of a sample taken
        # SETTLE seconds later; once the current xmin has passed that xmax, no transaction
        # holding a value up to sample i's last_value is still running.
        best = -1
        for i, (t_i, _x, _lv) in enumerate(self._samples):
            later = next((s for s in self._samples[i + 1 :] if s[0] - t_i >= SETTLE), None)
            if later is None or later[1] > xmin:
                break
            best = i
        if best >= 0:
            self._floor = max(self._floor, self._samples[best][2])
            del self._samples[: best + 1]
        if len(self._samples) > 2000:
            del self._samples[: len(self._samples) - 2000]

    # -- claim and outcomes -----------------------------------------------------------------

    def outbox_claim(self, limit: int, owner: str, epoch: int, sweep: bool) -> list[Record]:
        if not self._owned:
            return []
        self._advance_floor()
        # Where an ordinary claim starts (``_low``): every row below it has been examined by
        # an earlier claim (claimed, or left behind a blocked key: a sweep takes those) and
        # no new row can appear below it. After a claim that examined [start, end], the
        # rows up to min(end, safe floor) were all visible and examined, so _low moves there.
        # A sweep walks from the first pending row up to _low, one batch per claim.
        if sweep:
            self._sweep_pos = 0
        start = self._low if self._sweep_pos is None else self._sweep_pos
        cur = self._execute(
            "claim",
            {
                "floor": start,
                "nparts": self.partitions,
                "parts": sorted(self._owned),
                "limit": limit,
                "owner": owner,
                "epoch": epoch,
            },
        )
        records = [Record(*row) for row in cur.fetchall()]
        records.sort(key=lambda r: r.seq)
        examined_to = records[-1].seq if len(records) >= limit else math.inf
        if self._sweep_pos is not None:
            self._sweep_pos = None if examined_to + 1 >= self._low else int(examined_to + 1)
        if start <= self._low:
            self._low = int(max(self._low, min(examined_to, self._floor) + 1))
        return records

    def outbox_mark_published(
        self, owner: str, epoch: int, receipts: Sequence[tuple[int, str, str]]
    ) -> int:
        if not receipts:
            return 0
        streams: dict[str, int] = {}
        indexes = [streams.setdefault(r[1], len(streams) + 1) for r in receipts]
        cur = self._execute(
            "published",
            {
                "seqs": ",".join([str(r[0]) for r in receipts]),
                "sids": ",".join([r[2] for r in receipts]),
                "sidxs": ",".join(map(str, indexes)),
                "streams": list(streams),
                "owner": owner,
                "epoch": epoch,
            },
        )
        return int(cur.rowcount)

    def outbox_mark_failed(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, float, str, bool]]
    ) -> None:
        if not failures:
            return
        self._execute(
            "failed",
            {
                "seqs": [f[0] for f in failures],
                "delays": [float(f[1]) for f in failures],
                "errs": [f[2][:2000] for f in failures],
                "keeps": [bool(f[3]) for f in failures],
                "owner": owner,
                "epoch": epoch,
            },
        )

    def outbox_quarantine(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, str]]
    ) -> None:
        if not failures:
            return
        self._execute(
            "quarantine",
            {
                "seqs": [f[0] for f in failures],
                "errs": [f[1][:2000] for f in failures],
                "owner": owner,
                "epoch": epoch,
            },
        )

    def outbox_release(self, owner: str, epoch: int, seqs: Sequence[int]) -> None:
        if seqs:
            self._execute("release", {"seqs": list(seqs), "owner": owner, "epoch": epoch})

    def outbox_retry_now(self, seqs: Sequence[int]) -> int:
        if not seqs:
            return 0
        return int(self._execute("retry_now", {"seqs": list(seqs)}).rowcount)

    def orphan_list(self, limit: int) -> list[Orphan]:
        if not self._owned:
            return []
        cur = self._execute(
            "orphans",
            {
                "after": self.reconcile_after,
                "nparts": self.partitions,
                "parts": sorted(self._owned),
                "limit": limit,
            },
        )
        return [Orphan(*row) for row in cur.fetchall()]

    def outbox_retry_ready(self) -> bool:
        if not self._owned:
            return False
        cur = self._execute(
            "retry_ready", {"nparts": self.partitions, "parts": sorted(self._owned)}
        )
        row = cur.fetchone()
        return bool(row and row[0])

    def orphan_resolve(
        self, found: Sequence[tuple[Orphan, str, str]], missing: Sequence[Orphan]
    ) -> None:
        if found:
            self._execute(
                "resolve_found",
                {
                    "seqs": [o.seq for o, _s, _i in found],
                    "streams": [s for _o, s, _i in found],
                    "sids": [i for _o, _s, i in found],
                    "owners": [o.claimed_by for o, _s, _i in found],
                    "epochs": [o.claim_epoch for o, _s, _i in found],
                },
            )
        if missing:
            self._execute(
                "resolve_missing",
                {
                    "seqs": [o.seq for o in missing],
                    "owners": [o.claimed_by for o in missing],
                    "epochs": [o.claim_epoch for o in missing],
                },
            )

    # -- wake-up ----------------------------------------------------------------------------

    def notify_wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` for a NOTIFY: 0 if none came, 1 for new rows, 2 when a
        ``requeue`` asked for a sweep. Without LISTEN (or if the listening connection
        fails) this is a plain sleep."""
        if not self.listen:
            time.sleep(timeout)
            return 0
        try:
            if self._listen_conn is None or self._listen_conn.closed:
                conn = self._new_connection()
                # The channel names the schema the table lives in (the trigger uses
                # TG_TABLE_SCHEMA): other schemas' outboxes do not wake this relay.
                row = conn.execute(PG_TABLE_SCHEMA, {"q": full_table(self.schema)}).fetchone()
                table_schema = row[0] if row and row[0] else (self.schema.schema or "public")
                channel = self.schema.notify_channel(table_schema)
                conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel)))
                self._listen_conn = conn
            got = 0
            for n in self._listen_conn.notifies(timeout=timeout, stop_after=1):
                got = max(got, 2 if n.payload == "sweep" else 1)
            if got:  # drain what else is queued: one wake-up is enough
                for n in self._listen_conn.notifies(timeout=0.0001):
                    got = max(got, 2 if n.payload == "sweep" else 1)
            return got
        except Exception as exc:
            report_failure(log, "LISTEN connection failed; polling", exc)
            if self._listen_conn is not None:
                with contextlib.suppress(Exception):
                    self._listen_conn.close()
            self._listen_conn = None
            time.sleep(timeout)
            return 0

    # -- maintenance ------------------------------------------------------------------------

    def outbox_vacuum_if_no_autovacuum(self) -> float | None:
        """VACUUM the table when the server runs without autovacuum; seconds it took, or
        None when autovacuum is on (nothing done). Runs on a connection of its own."""
        # The decision and the VACUUM are outbox.maintenance's, shared with the job worker
        # and the consumer (also: a table with autovacuum_enabled = false is vacuumed).
        done = vacuum_unless_autovacuum(self._new_connection, [self._sql["table"]])
        return sum(done.values()) if done else None

    # -- retention and progress -------------------------------------------------------------

    def outbox_delete_published(self, older_than_seconds: float, limit: int) -> int:
        cur = self._execute("retention", {"age": float(older_than_seconds), "limit": limit})
        return int(cur.rowcount)

    def outbox_backlog(self) -> tuple[int, float | None]:
        row = self._execute("backlog", {}).fetchone()
        return int(row[0]), (float(row[1]) if row[1] is not None else None)

    # -- the pipeline and the operator's commands -------------------------------------------

    def receipt_store(self) -> PostgresStore:
        return PostgresStore(
            self.engine,
            self.schema,
            partitions=self.partitions,
            reconcile_after=self.reconcile_after,
            listen=False,
            rebalance_interval=self.rebalance_interval,
            sweep_interval=self.sweep_interval,
            member=False,
        )

    def outbox_status(self) -> dict[str, TopicStatus]:
        with self.engine.connect() as conn:
            return topic_status(conn, full_table(self.schema), NOW_SQL[POSTGRESQL])

    def outbox_published_page(
        self,
        after_seq: int,
        limit: int,
        *,
        since: datetime | None = None,
        topic: str | None = None,
    ) -> list[tuple[Record, str | None]]:
        sql = (
            PG_PUBLISHED_PAGE.replace("{t}", full_table(self.schema))
            + ("" if since is None else PG_PUBLISHED_PAGE_SINCE)
            + ("" if topic is None else PG_PUBLISHED_PAGE_TOPIC)
            + PG_PUBLISHED_PAGE_END
        )
        params = {"after": after_seq, "since": since, "topic": topic, "limit": limit}
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql(sql, params).fetchall()
        return [(Record(*row[:12]), row[12]) for row in rows]

    def receipt_latest(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                PG_RECEIPT_LATEST.replace("{t}", full_table(self.schema))
            ).fetchall()
        return highest_receipts(rows)

    def outbox_oldest_published_since(self, published_after: float | None) -> datetime | None:
        with self.engine.connect() as conn:
            return cast(
                "datetime | None",
                conn.exec_driver_sql(
                    PG_OLDEST_PUBLISHED_SINCE.replace("{t}", full_table(self.schema)),
                    {"after": published_after or 0.0},
                ).scalar(),
            )

    def outbox_requeue(
        self,
        event_ids: Sequence[str] | None,
        all_quarantined: bool,
        joined: Connection | None = None,
    ) -> RequeueResult:
        outbox_schema = self.schema

        def ask_for_a_sweep(conn: Connection) -> None:
            # Relays claim from a floor above old rows; a requeued row needs a full sweep.
            channel = outbox_schema.notify_channel(table_schema_of(conn, outbox_schema))
            conn.execute(text("SELECT pg_notify(:c, 'sweep')"), {"c": channel})

        return requeue_quarantined(
            self.engine,
            full_table(self.schema),
            NOW_SQL[POSTGRESQL],
            event_ids,
            all_quarantined,
            ask_for_a_sweep,
            joined,
        )


def _is_connection_error(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError, OSError))
