"""The storage seams' contract suites, in the spirit of River's ``riverdrivertest``.

Each test drives one seam's operations directly (no relay loop, no worker, no consumer
around them) on PostgreSQL and on SQLite (the ``db_url`` fixture), the relay's store and the
inbox on MariaDB too (``outbox_db_url``), and asserts the same observable result on each:
the relay's store (``relay.store.store_for``), the job store's driver
(``consumer.jobs.driver.driver_for``) and the consumer's inbox (``consumer.inbox.inbox_for``).
A database-specific override that changes what a caller sees fails here on its database
(docs/contributing.md, "Storage seams").
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert, update
from sqlalchemy.engine import Engine

from consumer.inbox import (
    Inbox,
    MysqlInbox,
    PostgresInbox,
    SqliteInbox,
    build_inbox_schema,
    inbox_for,
)
from consumer.jobs.base import StoreConfig
from consumer.jobs.checks import job_values
from consumer.jobs.driver import JobDriver, PostgresJobDriver, SqliteJobDriver, driver_for
from consumer.jobs.schema import jobs, provider_limits
from consumer.jobs.states import DONE, LEASED, READY
from consumer.jobs.store import Store as JobStore
from outbox import Outbox
from outbox.db import make_engine
from outbox.dialect import is_mysql, is_postgresql
from outbox.errors import ConfigError
from relay import RelayConfig
from relay.store import MysqlStore, PostgresStore, SqliteStore, Store, open_store, store_for

OWNER = "relay-seams"
WORKER = "worker-seams"

# -- the shape every seam shares ----------------------------------------------------------

# The methods that own their transaction (or connection) instead of taking the caller's
# ``conn``; every other public method takes it first (docs/contributing.md, "Storage seams").
# A new entry here is a decision to write down there, with its reason.
OWN_TRANSACTION = {
    JobDriver: {
        "begin",
        "autocommit",
        "connect",
        "pinned",  # this thread's transactions on one connection (a worker's heartbeat)
        "job_ready_listener",
        "provider_pause",  # a read on every dispatch, on the DBAPI connection
        "operation_intent",  # the dispatch fast path: one transaction by contract
        "operation_record",  # the same, for the receipt
        "schema_index_ensure",  # CREATE INDEX CONCURRENTLY runs in no transaction block
        "job_claim_scope",  # where a claim runs alone: PostgreSQL's commits on its own
    },
    Inbox: {"session", "schema_create", "inbox_purge", "dead_letter_list", "dead_letter_count"},
}


def _public_methods(cls: type) -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


@pytest.mark.parametrize(
    "base, classes",
    [
        (JobDriver, (JobDriver, PostgresJobDriver, SqliteJobDriver)),
        (Inbox, (Inbox, PostgresInbox, SqliteInbox)),
    ],
)
def test_one_rule_for_who_owns_the_transaction(base: type, classes: tuple[type, ...]) -> None:
    for cls in classes:
        methods = _public_methods(cls)
        own = {name for name, params in methods.items() if params[1:2] != ["conn"]}
        assert own == OWN_TRANSACTION[base], cls.__name__
        # An override keeps its base's signature: callers never ask which database it is.
        for name, params in methods.items():
            assert params == _public_methods(base)[name], f"{cls.__name__}.{name}"


def test_the_relay_store_owns_every_transaction() -> None:
    """The relay's store holds its own connection; no method joins a caller's transaction."""
    for cls in (PostgresStore, SqliteStore):
        for name, params in _public_methods(cls).items():
            assert "conn" not in params, f"{cls.__name__}.{name}"


# One naming scheme for the three seams: noun first, the thing an operation acts on and then
# what it does (``job_claim_batch``, ``inbox_insert``, ``outbox_claim``), as River's driver
# names its operations. Only the connection's own life (open, close, a transaction, a held
# connection) is named by its verb. A new noun here is a decision, like OWN_TRANSACTION.
NOUNS = {
    Store: {"outbox", "partition", "partitions", "orphan", "notify", "receipt"},
    JobDriver: {
        "job",
        "queue",
        "worker",
        "attempt",
        "operation",
        "provider",
        "schedule",
        "clock",
        "schema",
        "reply",
        "delivery",
    },
    Inbox: {"inbox", "dead_letter", "clock", "schema"},
}
LIFECYCLE = {"connect", "close", "begin", "autocommit", "pinned", "joined", "session", "name"}
# Data the seams expose, not operations (the store's ``partitions`` is one of its nouns).
ATTRIBUTES = {"payload_is_json", "supports_notify", "notify", "tables"}


@pytest.mark.parametrize(
    "classes",
    [
        (Store, PostgresStore, SqliteStore),
        (JobDriver, PostgresJobDriver, SqliteJobDriver),
        (Inbox, PostgresInbox, SqliteInbox),
    ],
    ids=["relay-store", "job-driver", "inbox"],
)
def test_one_naming_scheme_noun_first(classes: tuple[type, ...]) -> None:
    nouns = NOUNS[classes[0]]
    for cls in classes:
        names = {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}
        odd = sorted(
            n
            for n in names - LIFECYCLE - ATTRIBUTES
            if not any(n == noun or n.startswith(noun + "_") for noun in nouns)
        )
        assert not odd, f"{cls.__name__}: not named noun first: {odd}"


def test_each_factory_picks_its_database_class(db_url: str) -> None:
    outbox = Outbox(db_url)
    engine = make_engine(db_url)
    try:
        pg = is_postgresql(engine.dialect.name)
        relay_store = store_for(outbox.engine, outbox.schema)
        assert type(relay_store) is (PostgresStore if pg else SqliteStore)
        assert type(driver_for(engine)) is (PostgresJobDriver if pg else SqliteJobDriver)
        assert type(inbox_for(engine)) is (PostgresInbox if pg else SqliteInbox)
    finally:
        engine.dispose()
        outbox.engine.dispose()


def test_mysql_gets_its_relay_store_and_inbox_and_no_job_driver(mysql_url: str) -> None:
    outbox = Outbox(mysql_url)
    engine = make_engine(mysql_url)
    try:
        assert is_mysql(engine.dialect.name)
        assert type(store_for(outbox.engine, outbox.schema)) is MysqlStore
        assert type(inbox_for(engine)) is MysqlInbox
        with pytest.raises(ConfigError) as caught:
            driver_for(engine)
        assert caught.value.setting == "database_url"
        assert "mysql" in str(caught.value).lower()
    finally:
        engine.dispose()
        outbox.engine.dispose()


# -- the relay's store --------------------------------------------------------------------


@pytest.fixture
def outbox(outbox_db_url: str) -> Iterator[Outbox]:
    o = Outbox(outbox_db_url)
    o.create_schema()
    yield o
    o.engine.dispose()


@pytest.fixture
def store(outbox: Outbox) -> Iterator[Store]:
    s = store_for(outbox.engine, outbox.schema, RelayConfig())
    s.connect()
    s.partition_rebalance()
    try:
        yield s
    finally:
        s.close()


def emit(outbox: Outbox, *keys: str) -> list[str]:
    with outbox.transaction() as tx:
        return [tx.emit("seams.t", key=key, payload={"key": key}) for key in keys]


def test_the_old_factory_name_is_the_new_one() -> None:
    assert open_store is store_for


def test_store_claims_in_seq_order_and_not_twice(outbox: Outbox, store: Store) -> None:
    ids = emit(outbox, "a", "b", "c")
    records = store.outbox_claim(10, OWNER, 1, True)
    assert [r.event_id for r in records] == ids
    assert [r.seq for r in records] == sorted(r.seq for r in records)
    assert {r.topic for r in records} == {"seams.t"}
    assert [r.key for r in records] == ["a", "b", "c"]
    assert all(r.attempts == 0 for r in records)
    assert store.outbox_claim(10, OWNER, 1, True) == []  # claimed rows are not claimed again
    assert store.outbox_backlog()[0] == 3  # claimed is still pending


def test_store_receipts_are_fenced_by_owner_and_epoch(outbox: Outbox, store: Store) -> None:
    emit(outbox, "a", "b")
    first, second = store.outbox_claim(10, OWNER, 1, True)
    assert store.outbox_mark_published(OWNER, 2, [(first.seq, "s", "1-0")]) == 0  # wrong epoch
    assert store.outbox_mark_published("someone-else", 1, [(first.seq, "s", "1-0")]) == 0
    assert store.outbox_mark_published(OWNER, 1, [(first.seq, "s", "1-0")]) == 1
    assert store.outbox_mark_published(OWNER, 1, [(first.seq, "s", "1-0")]) == 0  # once
    assert store.outbox_backlog()[0] == 1
    page = store.outbox_published_page(0, 10)
    assert [(r.event_id, stream) for r, stream in page] == [(first.event_id, "s")]
    assert store.receipt_latest() == [("s", "1-0")]
    assert store.outbox_mark_published(OWNER, 1, [(second.seq, "s", "2-0")]) == 1
    assert store.outbox_backlog()[0] == 0
    assert store.receipt_latest() == [("s", "2-0")]


def test_store_release_makes_rows_claimable_again(outbox: Outbox, store: Store) -> None:
    emit(outbox, "a", "b")
    records = store.outbox_claim(10, OWNER, 1, True)
    store.outbox_release(OWNER, 2, [r.seq for r in records])  # a stale epoch releases nothing
    assert store.outbox_claim(10, OWNER, 2, True) == []
    store.outbox_release(OWNER, 1, [r.seq for r in records])
    again = store.outbox_claim(10, OWNER, 2, True)
    assert [r.seq for r in again] == [r.seq for r in records]
    assert all(r.attempts == 0 for r in again)  # a release is not an attempt


def test_store_failure_counts_an_attempt_and_backs_off(outbox: Outbox, store: Store) -> None:
    emit(outbox, "a", "b")
    now, later = store.outbox_claim(10, OWNER, 1, True)
    store.outbox_mark_failed(
        OWNER, 1, [(now.seq, 0.0, "boom", False), (later.seq, 3600.0, "x", False)]
    )
    retried = store.outbox_claim(10, OWNER, 2, True)
    assert [(r.seq, r.attempts) for r in retried] == [(now.seq, 1)]  # the other backs off
    status = store.outbox_status()["seams.t"]
    assert (status.pending, status.quarantined, status.max_attempts) == (2, 0, 1)


def test_store_quarantine_and_requeue(outbox: Outbox, store: Store) -> None:
    (event_id,) = emit(outbox, "a")
    (record,) = store.outbox_claim(10, OWNER, 1, True)
    store.outbox_quarantine(OWNER, 1, [(record.seq, "poison")])
    status = store.outbox_status()["seams.t"]
    assert (status.pending, status.quarantined, status.max_attempts) == (0, 1, 1)
    assert store.outbox_claim(10, OWNER, 2, True) == []
    result = store.outbox_requeue(None, True)
    assert result.requeued == [event_id]
    assert store.outbox_requeue([event_id, "nope"], False).unknown == ["nope"]
    assert store.outbox_status()["seams.t"].quarantined == 0
    (back,) = store.outbox_claim(10, OWNER, 3, True)
    assert (back.event_id, back.attempts) == (event_id, 1)


# -- the job store's driver ---------------------------------------------------------------


@pytest.fixture
def driver(db_url: str) -> Iterator[JobDriver]:
    job_store = JobStore(db_url)  # creates the schema through its driver
    try:
        yield driver_for(job_store.engine)
    finally:
        job_store.dispose()


def claim(driver: JobDriver, limit: int = 10) -> list[Any]:
    params: dict[str, Any] = {
        "cursor": "",
        "max_tenants": StoreConfig().max_tenants_scanned,
        "limit": limit,
        "worker": WORKER,
        "ttl": 60.0,
        "queues": None,
        "routes": None,
        "tenant_limit": None,
        "tenant_limits": {},
    }
    with driver.begin() as conn:
        return list(driver.job_claim_batch(conn, params, False))


def test_driver_insert_is_once_per_tenant_and_action(driver: JobDriver) -> None:
    with driver.begin() as conn:
        job_id, created = driver.job_insert(conn, job_values("t1", "a1"))
        again, created_again = driver.job_insert(conn, job_values("t1", "a1"))
        other, _ = driver.job_insert(conn, job_values("t2", "a1"))
    assert (created, created_again, again) == (True, False, job_id)
    assert other != job_id
    rows = [job_values("t1", "a1"), job_values("t3", "a3")]
    with driver.begin() as conn:
        new, existing = driver.job_insert_many(conn, rows)
        counts = driver.job_count_by_state(conn)
    assert list(new) == [("t3", "a3")]
    assert existing == {("t1", "a1"): job_id}
    assert counts == {READY: 3}


def test_driver_claim_leases_each_job_once(driver: JobDriver) -> None:
    with driver.begin() as conn:
        ids = {driver.job_insert(conn, job_values(f"t{n}", "a"))[0] for n in range(3)}
    rows = claim(driver)
    assert {int(r.id) for r in rows} == ids
    assert {int(r.lease_epoch) for r in rows} == {1}
    assert claim(driver) == []
    with driver.begin() as conn:
        assert driver.job_count_by_state(conn) == {LEASED: 3}


def test_driver_finish_is_fenced_on_the_epoch(driver: JobDriver) -> None:
    with driver.begin() as conn:
        first = driver.job_insert(conn, job_values("t1", "a"))[0]
        second = driver.job_insert(conn, job_values("t2", "a"))[0]
    claim(driver)
    with driver.begin() as conn:
        assert driver.job_finish_batch(conn, WORKER, [(first, 1), (second, 2)], None) == [first]
        assert driver.job_finish_batch(conn, WORKER, [(first, 1)], None) == []  # once
        moved = driver.job_update_fenced(conn, jobs.c.id == second, "other", 1, {"priority": 5})
        assert moved is None  # not the lease holder
        assert driver.job_update_fenced(conn, jobs.c.id == second, WORKER, 1, {"priority": 5})
        assert driver.job_state(conn, jobs.c.id == first) == DONE
        assert driver.job_state(conn, jobs.c.id == second) == LEASED
        assert driver.job_lease_extend(conn, second, WORKER, 1, 10.0**10)
        assert not driver.job_lease_extend(conn, second, WORKER, 2, 10.0**10)


def test_driver_intent_is_fenced_and_written_once(driver: JobDriver) -> None:
    with driver.begin() as conn:
        job_id = driver.job_insert(conn, job_values("t1", "a"))[0]
    claim(driver)
    intent = {"job_id": job_id, "provider": "p", "digest": "d" * 64, "timeout": 30.0}
    assert driver.operation_intent(operation_id="op1", worker=WORKER, epoch=1, **intent) == (
        "created"
    )
    assert driver.operation_intent(operation_id="op1", worker=WORKER, epoch=1, **intent) == (
        "exists"
    )
    assert driver.operation_intent(operation_id="op2", worker=WORKER, epoch=2, **intent) == (
        "fenced"
    )
    with driver.connect() as conn:
        assert driver.operation_get(conn, "op2") is None  # a fenced intent writes nothing
        row = driver.operation_get(conn, "op1")
        lease = driver.job_get(conn, jobs.c.id == job_id)
    assert (row.state, row.attempts, row.job_id) == ("PENDING", 1, job_id)
    assert lease.lease_expires_at >= row.call_deadline  # the lease covers the call
    assert driver.operation_record("op1", {"state": "ACCEPTED"}, if_states=["PENDING"])
    assert not driver.operation_record("op1", {"state": "UNKNOWN"}, if_states=["PENDING"])
    with driver.connect() as conn:
        assert driver.operation_get(conn, "op1").state == "ACCEPTED"


def test_driver_intent_reads_the_providers_pause(driver: JobDriver) -> None:
    with driver.begin() as conn:
        job_id = driver.job_insert(conn, job_values("t1", "a"))[0]
        conn.execute(insert(provider_limits).values(provider="p", paused_until=10.0**10))
        conn.execute(insert(provider_limits).values(provider="q", paused_until=1.0))
    claim(driver)
    intent = {"job_id": job_id, "digest": "d" * 64, "timeout": 30.0}
    kw: dict[str, Any] = {"worker": WORKER, "epoch": 1, **intent}
    with driver.connect() as conn:
        before = driver.job_get(conn, jobs.c.id == job_id).lease_expires_at
    assert driver.operation_intent(operation_id="op1", provider="p", **kw) == "paused"
    with driver.connect() as conn:
        assert driver.operation_get(conn, "op1") is None  # a paused provider: nothing written
        assert driver.job_get(conn, jobs.c.id == job_id).lease_expires_at == before
    # A pause in the past binds nobody.
    assert driver.operation_intent(operation_id="op1", provider="q", **kw) == "created"


def test_driver_reserves_provider_starts_in_turn_and_a_pause_stops_them(
    driver: JobDriver,
) -> None:
    with driver.begin() as conn:
        driver.provider_insert(conn, "p")
        driver.provider_insert(conn, "p")  # exists: nothing changes
    with driver.begin() as conn:
        first = driver.provider_start_reserve(conn, "p", 1.0, 10.0)
    with driver.begin() as conn:
        second = driver.provider_start_reserve(conn, "p", 1.0, 10.0)
    assert first is not None and second is not None
    assert second[0] == pytest.approx(first[0] + 1.0)  # the next start, one spacing on
    with driver.begin() as conn:
        until, clock = driver.provider_pause_extend(conn, "p", 30.0)
    assert until == pytest.approx(clock + 30.0, abs=1.0)
    with driver.begin() as conn:
        assert driver.provider_start_reserve(conn, "p", 1.0, 10.0) is None  # paused
        paused, booked, now = driver.provider_limits_get(conn, "p")
    assert (paused, booked) == (until, second[0]) and paused > now
    with driver.begin() as conn:
        driver.provider_pause_lift(conn, "p")
    with driver.connect() as conn:
        (row,) = driver.provider_limits_list(conn)
    assert (row[0], row[1], row[3]) == ("p", 0.0, 1)


def test_driver_purges_finished_jobs_oldest_first_in_batches(driver: JobDriver) -> None:
    from consumer.jobs.schema import FINISHED_JOBS_INDEX, JOB_OPERATIONS_INDEX

    driver.schema_index_ensure((FINISHED_JOBS_INDEX, JOB_OPERATIONS_INDEX))  # idempotent
    with driver.begin() as conn:
        ids = [driver.job_insert(conn, job_values(f"t{n}", "a"))[0] for n in range(3)]
        for n, job_id in enumerate(ids):
            driver.attempt_insert(conn, job_id, None, None, "DONE", None, 1.0)
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(state=DONE, updated_at=n))
        assert driver.job_purge_due(conn, 1.5) == (2, 2, 0)  # updated at 0 and 1
        assert driver.job_purge_finished(conn, 1.5, 1) == (1, 1, 0)  # the oldest
        assert driver.job_purge_finished(conn, 1.5, 10) == (1, 1, 0)
        assert driver.job_purge_finished(conn, 1.5, 10) == (0, 0, 0)
        assert driver.job_state(conn, jobs.c.id == ids[2]) == DONE  # not old enough
        assert driver.clock_epoch(conn) > 10**9


# -- the consumer's inbox -----------------------------------------------------------------


@pytest.fixture
def inbox(outbox_db_url: str) -> Iterator[Inbox]:
    engine: Engine = make_engine(outbox_db_url)
    box = inbox_for(engine, build_inbox_schema())
    box.schema_create()
    try:
        yield box
    finally:
        engine.dispose()


def inbox_rows(group: str, *identities: str) -> list[dict[str, Any]]:
    return [
        {
            "group_name": group,
            "identity": identity,
            "event_id": f"e-{identity}",
            "topic": "seams.t",
            "stream": "s",
            "entry_id": f"{n}-0",
        }
        for n, identity in enumerate(identities, 1)
    ]


def test_inbox_inserts_each_identity_once_per_group(inbox: Inbox) -> None:
    with inbox.engine.begin() as conn:
        assert inbox.inbox_insert(conn, inbox_rows("g", "a", "b")) == {"a", "b"}
    with inbox.engine.begin() as conn:
        assert inbox.inbox_insert(conn, inbox_rows("g", "a", "b", "c")) == {"c"}
        assert inbox.inbox_insert(conn, inbox_rows("other", "a")) == {"a"}  # another group
        assert inbox.inbox_seen(conn, "g", ["a", "c", "z"]) == {"a", "c"}


def test_inbox_delete_undoes_an_insert_in_its_transaction(inbox: Inbox) -> None:
    with inbox.engine.begin() as conn:
        inbox.inbox_insert(conn, inbox_rows("g", "a", "b"))
        inbox.inbox_delete(conn, "g", ["b"])
    with inbox.engine.begin() as conn:
        assert inbox.inbox_insert(conn, inbox_rows("g", "a", "b")) == {"b"}


def test_inbox_purge_deletes_only_rows_past_the_retention(inbox: Inbox) -> None:
    with inbox.engine.begin() as conn:
        inbox.inbox_insert(conn, inbox_rows("g", *"abcde"))
        inbox.inbox_insert(conn, inbox_rows("other", "a"))
    assert inbox.inbox_purge("g", 3600.0, batch=2, max_batches=10) == 0
    future = datetime.now(UTC) + timedelta(days=1)
    assert inbox.inbox_purge("g", 60.0, batch=2, max_batches=2, now=future) == 4  # bounded
    assert inbox.inbox_purge("g", 60.0, batch=2, max_batches=2, now=future) == 1
    with inbox.engine.begin() as conn:
        assert inbox.inbox_seen(conn, "g", list("abcde")) == set()
        assert inbox.inbox_seen(conn, "other", ["a"]) == {"a"}  # another group's rows stay
