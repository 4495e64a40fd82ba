"""Retention of the per-key rows (issue 56), on PostgreSQL and SQLite
(``consumer.jobs.key_retention``): the rows of idle order and concurrency keys go after the
jobs' window, the rows of keys in use stay, a key used again after its row went works as a
new one, a key whose line changes now is skipped, and ``outbox-worker purge`` counts them."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from consumer import Store
from consumer.jobs.cli import main
from consumer.jobs.retention import JobRetention, JobRetentionConfig

DAY = 24 * 3600.0
ORDER, CONCURRENCY = "outbox_order_keys", "outbox_concurrency_keys"


def _rows(store: Store, table: str) -> list[str]:
    with store.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(sa.text(f"SELECT * FROM {table}")))


def _drain(store: Store, prefix: str) -> None:
    while leases := [x for x in store.claim_batch("w", 50, 30) if x.action.startswith(prefix)]:
        store.finish_batch(leases)


def _targets(store: Store) -> dict[str, object]:
    return {t.table: t for t in JobRetention(store).targets() if t.table in (ORDER, CONCURRENCY)}


def _keys(store: Store) -> None:
    for key in ("idle", "busy"):
        for i in range(2):
            store.enqueue("t", f"{key}-o-{i}", order_key=f"order-{key}")
            store.enqueue("t", f"{key}-c-{i}", concurrency_key=f"conc-{key}", concurrency_limit=1)
    _drain(store, "idle-")
    _drain(store, "idle-")  # the second job of each idle key, promoted by the first's finish


def test_idle_keys_rows_go_after_the_window_and_keys_in_use_stay(db_url: str) -> None:
    store = Store(db_url)
    _keys(store)
    assert _rows(store, ORDER) == ["order-busy", "order-idle"]
    assert _rows(store, CONCURRENCY) == ["conc-busy", "conc-idle"]
    targets = _targets(store)
    for table, target in targets.items():
        assert target.due() == 0, table  # type: ignore[attr-defined]  # within the window
    with store.engine.begin() as conn:  # eight days pass for the key rows
        for table in (ORDER, CONCURRENCY):
            conn.execute(sa.text(f"UPDATE {table} SET updated_at = updated_at - {8 * DAY}"))
    for table, target in targets.items():
        assert target.due() == 1, table  # type: ignore[attr-defined]
        assert target.purge(10) == 1, table  # type: ignore[attr-defined]
        assert target.due() == 0, table  # type: ignore[attr-defined]
    assert _rows(store, ORDER) == ["order-busy"] and _rows(store, CONCURRENCY) == ["conc-busy"]
    assert store.get("t", "busy-o-1").state == "HELD"  # the busy lines are untouched
    assert store.get("t", "busy-c-1").state == "HELD"

    # The keys used again: their lines work as new ones.
    first = store.enqueue("t", "idle-o-2", order_key="order-idle").job_id
    second = store.enqueue("t", "idle-o-3", order_key="order-idle").job_id
    assert [store.get(i).state for i in (first, second)] == ["READY", "HELD"]
    one = store.enqueue("t", "idle-c-2", concurrency_key="conc-idle", concurrency_limit=1)
    two = store.enqueue("t", "idle-c-3", concurrency_key="conc-idle", concurrency_limit=1)
    assert [store.get(x.job_id).state for x in (one, two)] == ["READY", "HELD"]
    _drain(store, "idle-")
    assert [store.get(i).state for i in (first, second)] == ["DONE", "DONE"]
    store.dispose()


def test_a_key_whose_line_changes_now_is_skipped(pg_url: str) -> None:
    store = Store(pg_url)
    _keys(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {ORDER} SET updated_at = updated_at - {8 * DAY}"))
    target = _targets(store)[ORDER]
    with store.engine.connect() as holder:  # a line change holds the key's row
        holder.execute(sa.text(f"SELECT 1 FROM {ORDER} WHERE order_key = 'order-idle' FOR UPDATE"))
        assert target.purge(10) == 0  # type: ignore[attr-defined]  # skipped, not waited for
        holder.rollback()
    assert target.purge(10) == 1  # type: ignore[attr-defined]
    store.dispose()


def test_outbox_worker_purge_counts_and_deletes_idle_keys(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = Store(db_url)
    _keys(store)
    with store.engine.begin() as conn:
        for table in (ORDER, CONCURRENCY):
            conn.execute(sa.text(f"UPDATE {table} SET updated_at = updated_at - {8 * DAY}"))
    assert main(["purge", "--database-url", db_url, "--dry-run", "--json"]) == 0
    tables = json.loads(capsys.readouterr().out)["tables"]
    assert (tables[ORDER], tables[CONCURRENCY]) == (1, 1)
    assert main(["purge", "--database-url", db_url]) == 0
    assert _rows(store, ORDER) == ["order-busy"] and _rows(store, CONCURRENCY) == ["conc-busy"]
    forever = JobRetentionConfig(
        job_retention_seconds=0,
        inbox_window_seconds=0,
        outbox_retention_seconds=0,
        stream_retention_seconds=0,
    )
    kept = JobRetention(store, forever)  # jobs kept forever: their keys' rows too
    assert [t.table for t in kept.targets() if t.table in (ORDER, CONCURRENCY)] == []
    store.dispose()
