"""The order keys' PostgreSQL function (``consumer.jobs.order_keys`` has the contract): the
text of its DDL, run by ``consumer.jobs.schema.upgrade_schema`` and so by Alembic's
``create_job_extras``. A module of its own so that the schema module imports it, not the
other way round.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Double, Index, Integer, MetaData, String, Table

from consumer.jobs.states import CANCELLED, DONE, HELD, READY, WAITING_EXTERNAL
from outbox.validate import MAX_NAME_LENGTH

__all__ = ["ORDER_KEYS_TABLE", "ORDER_RELEASE_FUNCTION", "holds_sql", "pg_order_release_sql"]
__all__ += ["CONCURRENCY_KEYS_TABLE", "CONCURRENCY_RELEASE_FUNCTION", "key_tables"]
__all__ += ["pg_concurrency_release_sql"]

ORDER_KEYS_TABLE = "outbox_order_keys"
ORDER_RELEASE_FUNCTION = "outbox_jobs_order_release"
CONCURRENCY_KEYS_TABLE = "outbox_concurrency_keys"
CONCURRENCY_RELEASE_FUNCTION = "outbox_jobs_concurrency_release"


def key_tables(metadata: MetaData, jobs: Table) -> tuple[Table, Table, Index, Index]:
    """The keys' tables and indexes on the job store's ``metadata``:

    - ``outbox_order_keys``: one row per order key, locked first by every change of its
      line; ``head_id``: the key's job that may run now (the later ones wait HELD), or NULL;
    - ``outbox_concurrency_keys``: one row per concurrency key, locked first by every change
      of its admissions; ``active``: its jobs admitted (READY or further) and not finished;
      ``concurrency_limit``: the limit given with its latest job;
    - the HELD jobs of a key in enqueue order, for each kind of key: the move that frees a
      key's place promotes the first of them, never a walk of the key's history."""
    order_keys = Table(
        ORDER_KEYS_TABLE,
        metadata,
        Column("order_key", String(MAX_NAME_LENGTH), primary_key=True),
        Column("head_id", BigInteger, nullable=True),
        Column("updated_at", Double, nullable=False),
    )
    concurrency_keys = Table(
        CONCURRENCY_KEYS_TABLE,
        metadata,
        Column("concurrency_key", String(MAX_NAME_LENGTH), primary_key=True),
        Column("active", Integer, nullable=False),
        Column("concurrency_limit", Integer, nullable=False),
        Column("updated_at", Double, nullable=False),
    )
    held = jobs.c.state == HELD
    order_index = Index(
        "ix_outbox_jobs_order_held",
        jobs.c.order_key,
        jobs.c.id,
        postgresql_where=held,
        sqlite_where=held,
    )
    concurrency_index = Index(
        "ix_outbox_jobs_concurrency_held",
        jobs.c.concurrency_key,
        jobs.c.id,
        postgresql_where=held,
        sqlite_where=held,
    )
    return order_keys, concurrency_keys, order_index, concurrency_index


def holds_sql(job: str, now: str) -> str:
    """Whether the job row ``job`` (an alias) still holds its key's later jobs at ``now``: it
    is not finished, and it does not wait on a reply or a timer with ``order_hold = 'run'``."""
    passing = (
        f"coalesce({job}.order_hold, '') = 'run' AND ({job}.state = '{WAITING_EXTERNAL}'"
        f" OR ({job}.state = '{READY}' AND {job}.timer_scheduled_for IS NOT NULL"
        f" AND {job}.run_after > {now}))"
    )
    # Never NULL: a row read decides (a NULL column must not read as "holds nothing").
    return f"coalesce(NOT ({job}.state IN ('{DONE}', '{CANCELLED}') OR ({passing})), true)"


def _lock_key(table: str, key: str, name: str, column: str, into: str, values: str) -> str:
    """PL/pgSQL: lock the row of key ``name`` in ``table`` and read its ``column`` into
    ``into``; a key seen for the first time gets its row first (``values``: the columns
    after the key, before ``updated_at``). FOR UPDATE waits for the key's current holder and
    then reads the row as it committed (no new row version for the lock alone); the upsert
    makes a row that is missing, also one a retention round deleted meanwhile
    (``consumer.jobs.key_retention``). Both release functions take their key's lock so."""
    columns = {"order_key": "head_id", "concurrency_key": "active, concurrency_limit"}[key]
    return f"""        SELECT k.{column} INTO {into} FROM {table} k
        WHERE k.{key} = {name} FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO {table} AS k ({key}, {columns}, updated_at)
            VALUES ({name}, {values}, p_now)
            ON CONFLICT ({key}) DO UPDATE SET updated_at = excluded.updated_at
            RETURNING k.{column} INTO {into};
        END IF;"""


def pg_order_release_sql(jobs_table: str) -> str:
    """``CREATE OR REPLACE FUNCTION outbox_jobs_order_release(p_ids, p_ended, p_now)``: for
    each order key of the jobs ``p_ids`` (that just moved; ``p_ended``: they are finished,
    whatever the snapshot shows), keys in sorted order:

    1. lock the key's row (an upsert, so a key seen for the first time gets one): every
       change of a key's line takes this lock first, so they happen one at a time;
    2. in statements that come after the lock (a VOLATILE function takes a fresh snapshot
       per statement under READ COMMITTED, so they see every change committed by whoever
       held the lock before, even when the calling statement's snapshot is older), read
       whether the key's head still holds its line, and if not make the first HELD job of
       the key READY and the key's head (a HELD row cancelled meanwhile is skipped: its
       UPDATE finds it no longer HELD).

    Called inside the statements that finish jobs (``consumer.jobs.queries``), so a finish
    and its promotion are one statement and one commit, and by
    ``consumer.jobs.order_keys.release`` after the other moves. Returns the jobs promoted."""
    holding = holds_sql("j", "p_now")
    return f"""
CREATE OR REPLACE FUNCTION {ORDER_RELEASE_FUNCTION}(
    p_ids bigint[], p_ended boolean, p_now double precision)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    line_key text;
    head bigint;
    holding boolean;
    next_id bigint;
    promoted integer := 0;
BEGIN
    FOR line_key IN
        SELECT DISTINCT order_key FROM {jobs_table}
        WHERE id = ANY(p_ids) AND order_key IS NOT NULL ORDER BY 1
    LOOP
{_lock_key(ORDER_KEYS_TABLE, "order_key", "line_key", "head_id", "head", "NULL")}
        IF head IS NOT NULL AND NOT (p_ended AND head = ANY(p_ids)) THEN
            holding := NULL;
            SELECT {holding} INTO holding FROM {jobs_table} j WHERE j.id = head;
            CONTINUE WHEN holding;  -- NULL: the head is gone (retention), it holds nothing
        END IF;
        LOOP
            next_id := NULL;
            UPDATE {jobs_table} SET state = '{READY}', updated_at = p_now
            WHERE id = (SELECT id FROM {jobs_table} WHERE order_key = line_key
                        AND state = '{HELD}' ORDER BY id LIMIT 1)
              AND state = '{HELD}'
            RETURNING id INTO next_id;
            -- Not found: no HELD job, or the first was cancelled under this UPDATE (it found
            -- it no longer HELD): the next one, if any, in a fresh snapshot.
            EXIT WHEN next_id IS NOT NULL OR NOT EXISTS (
                SELECT 1 FROM {jobs_table} WHERE order_key = line_key AND state = '{HELD}');
        END LOOP;
        UPDATE {ORDER_KEYS_TABLE} SET head_id = next_id, updated_at = p_now
        WHERE order_key = line_key;
        IF next_id IS NOT NULL THEN
            promoted := promoted + 1;
        END IF;
    END LOOP;
    RETURN promoted;
END
$$"""


def pg_concurrency_release_sql(jobs_table: str) -> str:
    """``CREATE OR REPLACE FUNCTION outbox_jobs_concurrency_release(p_ids, p_ended, p_now)``:
    for the concurrency keys of the jobs ``p_ids`` (``p_ended``: they finished and each held
    a place), keys in sorted order: lock the key's row (as the order keys' function does),
    give the ended jobs' places back, take the limit of the key's latest job among them, and
    admit the key's first HELD jobs (READY) while places are free. Returns the jobs admitted."""
    keys = CONCURRENCY_KEYS_TABLE
    return f"""
CREATE OR REPLACE FUNCTION {CONCURRENCY_RELEASE_FUNCTION}(
    p_ids bigint[], p_ended boolean, p_now double precision)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    line record;
    taken integer;
    room integer;
    moved integer;
    admitted integer := 0;
BEGIN
    FOR line IN
        SELECT j.concurrency_key AS name, count(*) AS ended,
               (array_agg(j.concurrency_limit ORDER BY j.id DESC))[1] AS cap
        FROM {jobs_table} j
        WHERE j.id = ANY(p_ids) AND j.concurrency_key IS NOT NULL
        GROUP BY j.concurrency_key ORDER BY 1
    LOOP
{_lock_key(keys, "concurrency_key", "line.name", "active", "taken", "0, line.cap")}
        IF p_ended THEN
            taken := greatest(0, taken - line.ended);
        END IF;
        moved := 0;
        LOOP
            room := line.cap - taken - moved;
            EXIT WHEN room <= 0;
            UPDATE {jobs_table} SET state = '{READY}', updated_at = p_now
            WHERE id IN (SELECT id FROM {jobs_table} WHERE concurrency_key = line.name
                         AND state = '{HELD}' ORDER BY id LIMIT room)
              AND state = '{HELD}';
            GET DIAGNOSTICS room = ROW_COUNT;
            moved := moved + room;
            -- Fewer than asked: no more HELD jobs, or some were cancelled under this UPDATE
            -- (found no longer HELD): look again in a fresh snapshot until none is left.
            EXIT WHEN room = 0 AND NOT EXISTS (SELECT 1 FROM {jobs_table}
                WHERE concurrency_key = line.name AND state = '{HELD}');
        END LOOP;
        UPDATE {keys} SET active = taken + moved, concurrency_limit = line.cap,
            updated_at = p_now
        WHERE concurrency_key = line.name;
        admitted := admitted + moved;
    END LOOP;
    RETURN admitted;
END
$$"""
