"""Order keys in the job store (issue 56): the jobs of one ``order_key`` run one at a time, in
enqueue order, across every worker and slot; a waiting head holds the later ones unless it
was enqueued with ``hold="run"``; a head that needs a person always holds them; DONE and
CANCELLED end a head's hold and promote the next job in the same transaction. Contract cases,
each on PostgreSQL and SQLite."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import pytest
import sqlalchemy as sa

from consumer import Store
from consumer.errors import IllegalTransition, JobError
from consumer.jobs.base import StoreConfig
from consumer.jobs.retry import RetryPolicy


def _state(store: Store, job_id: int) -> str:
    return store.get(job_id).state


def _claimed(store: Store, worker: str = "w", limit: int = 50) -> list[str]:
    return sorted(lease.action for lease in store.claim_batch(worker, limit))


def test_the_jobs_of_a_key_run_one_at_a_time_in_enqueue_order(db_url: str) -> None:
    store = Store(db_url)
    ids = [store.enqueue("t", f"inv-{i}", order_key="invoice-42").job_id for i in range(3)]
    other = store.enqueue("t", "other", order_key="invoice-43").job_id
    free = store.enqueue("t", "free").job_id
    assert [_state(store, i) for i in ids] == ["READY", "HELD", "HELD"]
    assert _state(store, other) == "READY" and _state(store, free) == "READY"
    assert store.get(ids[1]).order_key == "invoice-42" and store.get(free).order_key is None
    leases = {lease.action: lease for lease in store.claim_batch("w", 10)}
    assert sorted(leases) == ["free", "inv-0", "other"]  # one per key, the first enqueued
    assert store.claim_batch("w", 10) == []  # inv-1 waits for inv-0
    store.finish(leases["inv-0"])
    assert _state(store, ids[1]) == "READY" and _state(store, ids[2]) == "HELD"
    assert _claimed(store) == ["inv-1"]
    assert store.counts()["HELD"] == 1
    store.dispose()


def test_enqueue_many_orders_its_items_and_a_duplicate_changes_nothing(db_url: str) -> None:
    store = Store(db_url)
    specs = [{"tenant": "t", "action": f"a-{i}", "order_key": f"k{i % 2}"} for i in range(6)]
    results = store.enqueue_many(specs)
    states = [_state(store, r.job_id) for r in results]
    assert states == ["READY", "READY", "HELD", "HELD", "HELD", "HELD"]
    again = store.enqueue("t", "a-0", order_key="k0")
    assert again.duplicate and again.job_id == results[0].job_id
    assert [_state(store, r.job_id) for r in results] == states
    order: dict[str, list[str]] = defaultdict(list)
    while leases := store.claim_batch("w", 10):
        for lease in leases:
            order[str(store.get(lease.job_id).order_key)].append(lease.action)
        store.finish_batch(leases)
    assert order == {"k0": ["a-0", "a-2", "a-4"], "k1": ["a-1", "a-3", "a-5"]}
    store.dispose()


def test_finish_and_claim_promotes_the_next_job_of_the_key(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many([{"tenant": "t", "action": f"a-{i}", "order_key": "k"} for i in range(3)])
    first = store.claim_batch("w", 4)
    assert [x.action for x in first] == ["a-0"]
    result, nxt = store.finish_and_claim(first, "w", 4)
    assert result.done == [first[0].job_id]
    # The promotion is in the finish's transaction; a claim after it takes the next job (on
    # PostgreSQL the claim in the same statement cannot see it yet).
    nxt = nxt or store.claim_batch("w", 4)
    assert [x.action for x in nxt] == ["a-1"]
    assert store.counts()["HELD"] == 1
    store.dispose()


def test_a_waiting_head_holds_the_line_and_hold_run_lets_it_pass(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "wait-0", order_key="k-wait")
    store.enqueue("t", "wait-1", order_key="k-wait")
    store.enqueue("t", "run-0", order_key="k-run", hold="run")
    store.enqueue("t", "run-1", order_key="k-run")
    leases = {x.action: x for x in store.claim_batch("w", 10)}
    assert sorted(leases) == ["run-0", "wait-0"]
    store.wait_external(leases["wait-0"], reason="customer reply")
    store.wait_external(leases["run-0"], reason="customer reply")
    assert _claimed(store) == ["run-1"]  # passes run-0; wait-1 stays behind wait-0
    assert store.get("t", "wait-1").state == "HELD"
    store.reply("t", "wait-0", payload={"ok": True}, reply_id="r1")
    assert _claimed(store) == ["wait-0"]  # the reply: the head runs again, still alone
    store.enqueue("t", "run-2", order_key="k-run")
    assert store.get("t", "run-2").state == "HELD"  # behind run-1, which runs
    store.dispose()


def test_a_timer_holds_the_line_unless_hold_run(db_url: str) -> None:
    store = Store(db_url)
    now = 1_000_000.0
    for key, hold in (("k-wait", "wait"), ("k-run", "run")):
        store.enqueue("t", f"{key}-0", order_key=key, hold=hold, now=now)
        store.enqueue("t", f"{key}-1", order_key=key, now=now)
    leases = store.claim_batch("w", 10, now=now)
    assert sorted(x.action for x in leases) == ["k-run-0", "k-wait-0"]
    for lease in leases:
        store.schedule(lease, now + 3600, "remind in an hour", now=now)
    assert sorted(x.action for x in store.claim_batch("w", 10, now=now + 1)) == ["k-run-1"]
    # An hour later both timers are due: the held k-wait-1 still waits for its head.
    later = sorted(x.action for x in store.claim_batch("w", 10, now=now + 3601))
    assert later == ["k-run-0", "k-wait-0"]
    assert store.get("t", "k-wait-1").state == "HELD"
    store.dispose()


def test_a_head_that_needs_a_person_holds_even_with_hold_run(db_url: str) -> None:
    store = Store(db_url, config=StoreConfig(retry=RetryPolicy(max_attempts=1)))
    for key in ("review", "attention"):
        store.enqueue("t", f"{key}-0", order_key=key, hold="run")
        store.enqueue("t", f"{key}-1", order_key=key)
    leases = {x.action: x for x in store.claim_batch("w", 10)}
    assert store.fail(leases["review-0"], error="refused", kind="permanent") == "WAITING_REVIEW"
    assert store.fail(leases["attention-0"], error="timeout") == "NEEDS_ATTENTION"
    assert store.claim_batch("w", 10) == []
    assert store.get("t", "review-1").state == "HELD"
    # The operator decides: a resumed head runs (still first); a cancelled one lets the next.
    store.resume("t", "attention-0", reason="fixed")
    store.cancel("t", "review-0", reason="not needed")
    assert _claimed(store) == ["attention-0", "review-1"]
    store.dispose()


def test_cancelling_the_head_releases_the_next_and_a_held_job_can_be_cancelled(
    db_url: str,
) -> None:
    store = Store(db_url)
    ids = [store.enqueue("t", f"a-{i}", order_key="k").job_id for i in range(4)]
    assert store.cancel(ids[2], reason="obsolete") == "CANCELLED"  # HELD -> CANCELLED
    assert _state(store, ids[1]) == "HELD"
    assert store.cancel(ids[0], reason="obsolete") == "CANCELLED"  # the READY head
    assert _state(store, ids[1]) == "READY"
    lease = store.claim_batch("w", 5)[0]
    assert lease.job_id == ids[1]
    # A cancel requested while it runs: the run's end is CANCELLED, and it releases the line.
    assert store.cancel(ids[1], reason="stop") == "LEASED"
    store.finish_batch([lease])
    assert _state(store, ids[1]) == "CANCELLED" and _state(store, ids[3]) == "READY"
    with pytest.raises(IllegalTransition):
        store.resume(ids[2])  # a cancelled job stays cancelled
    store.dispose()


def test_a_lost_lease_and_a_retry_keep_the_head_in_place(db_url: str) -> None:
    store = Store(db_url)
    now = 2_000_000.0
    store.enqueue("t", "a-0", order_key="k", now=now)
    store.enqueue("t", "a-1", order_key="k", now=now)
    lease = store.claim_batch("w1", 5, ttl=10, now=now)[0]
    assert store.fail(lease, error="busy", now=now) == "READY"  # a retry after a backoff
    assert store.get("t", "a-1").state == "HELD"  # a-0 backs off, still the head
    leases = store.claim_batch("w1", 5, ttl=10, now=now + 3600)
    assert [x.action for x in leases] == ["a-0"]
    store.recover(now=now + 3700)  # its lease expired: READY again, still the head
    assert [x.action for x in store.claim_batch("w2", 5, now=now + 3701)] == ["a-0"]
    store.dispose()


def test_bad_order_arguments_are_typed_errors(db_url: str) -> None:
    store = Store(db_url)
    with pytest.raises(JobError) as bad:
        store.enqueue("t", "a", order_key="k", hold="later")
    assert bad.value.field == "hold"
    with pytest.raises(JobError) as bad:
        store.enqueue("t", "a", hold="run")
    assert bad.value.field == "hold"
    with pytest.raises(JobError) as bad:
        store.enqueue("t", "a", order_key="")
    assert bad.value.field == "order_key"
    with pytest.raises(JobError):
        store.enqueue_many([{"tenant": "t", "action": "a", "order_key": 5}])
    assert store.counts()["READY"] == 0
    store.dispose()


def test_concurrent_claimers_keep_each_key_in_order(db_url: str) -> None:
    """Four threads claim and finish over one database: no two jobs of a key are ever held at
    once, and each key's jobs run in enqueue order; enqueues of the same keys go on meanwhile."""
    store = Store(db_url)
    keys, per_key = 12, 8
    first = [
        {"tenant": f"t{k % 3}", "action": f"k{k}-{i}", "order_key": f"k{k}"}
        for i in range(per_key // 2)
        for k in range(keys)
    ]
    store.enqueue_many(first)
    lock = threading.Lock()
    running: dict[str, str] = {}
    ran: dict[str, list[int]] = defaultdict(list)
    overlaps: list[str] = []
    errors: list[BaseException] = []
    total = keys * per_key

    def enqueue_rest() -> None:
        try:
            for i in range(per_key // 2, per_key):
                for k in range(keys):
                    store.enqueue(f"t{k % 3}", f"k{k}-{i}", order_key=f"k{k}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def work(name: str) -> None:
        try:
            idle = 0
            while idle < 400:
                with lock:
                    if sum(len(v) for v in ran.values()) >= total:
                        return
                leases = store.claim_batch(name, 3)
                idle = idle + 1 if not leases else 0
                for lease in leases:
                    key, index = lease.action.rsplit("-", 1)
                    with lock:
                        if key in running:
                            overlaps.append(f"{lease.action} while {running[key]}")
                        running[key] = lease.action
                        ran[key].append(int(index))
                for lease in leases:
                    with lock:
                        running.pop(lease.action.rsplit("-", 1)[0], None)
                store.finish_batch(leases)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=enqueue_rest)]
    threads += [threading.Thread(target=work, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert overlaps == []
    assert {key: order for key, order in ran.items()} == {
        f"k{k}": list(range(per_key)) for k in range(keys)
    }
    assert store.counts()["DONE"] == total
    store.dispose()


def test_an_older_table_gains_the_order_columns(pg_url: str) -> None:
    """A job table made before order keys gets the columns, the index and the key table at
    the next start (``consumer.jobs.migrations``)."""
    store = Store(pg_url)
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_outbox_jobs_order_held"))
        conn.execute(sa.text("ALTER TABLE outbox_jobs DROP COLUMN order_key"))
        conn.execute(sa.text("ALTER TABLE outbox_jobs DROP COLUMN order_hold"))
        conn.execute(sa.text("DROP TABLE outbox_order_keys"))
        conn.execute(sa.text("DROP FUNCTION outbox_jobs_order_release"))
    store.dispose()
    store = Store(pg_url)
    store.enqueue("t", "a-0", order_key="k")
    store.enqueue("t", "a-1", order_key="k")
    store.finish(store.claim_batch("w", 5)[0])
    assert [x.action for x in store.claim_batch("w", 5)] == ["a-1"]
    store.dispose()


def test_a_keys_line_says_what_runs_what_waits_and_what_holds_it(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from consumer.jobs.cli import main

    store = Store(db_url)
    ids = [store.enqueue("acme", f"send-{i}", order_key="invoice-42").job_id for i in range(3)]
    lease = store.claim_batch("w", 5)[0]
    store.wait_external(lease, reason="customer reply")
    line = store.order_line("invoice-42")
    assert line.head is not None and line.head["id"] == ids[0]
    assert line.head["state"] == "WAITING_EXTERNAL" and line.holding
    assert [job["id"] for job in line.held] == ids[1:] and line.held_count == 2
    assert "WAITING_EXTERNAL (customer reply); 2 job(s) HELD" in line.why
    assert main(["keys", "invoice-42", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert f"job {ids[0]} (acme/send-0) is WAITING_EXTERNAL" in out
    assert f"2. job {ids[2]} (acme/send-2) HELD" in out
    assert main(["keys", "invoice-42", "--json", "--database-url", db_url]) == 0
    assert '"held_count": 2' in capsys.readouterr().out
    assert main(["keys", "no-such-key", "--database-url", db_url]) == 1
    store.cancel(ids[0], reason="obsolete")
    line = store.order_line("invoice-42")
    assert line.head is not None and line.head["id"] == ids[1] and line.held_count == 1
    store.dispose()


def test_the_console_lists_a_jobs_order_key_and_its_held_state(
    db_url: str, redis_client: Any, stream_prefix: str
) -> None:
    from starlette.testclient import TestClient

    from outbox.console.app import Console
    from tests.console_support import World

    world = World(db_url, redis_client, stream_prefix)
    try:
        first = world.store.enqueue("acme", "send-a", order_key="invoice-42").job_id
        second = world.store.enqueue("acme", "send-b", order_key="invoice-42").job_id
        token = "order-token-" + "x" * 20
        with TestClient(Console(world.engine, world.client, token).app) as api:
            answer = api.get("/api/jobs", headers={"Authorization": f"Bearer {token}"})
            held = api.get("/api/jobs?state=HELD", headers={"Authorization": f"Bearer {token}"})
        rows = {row["id"]: row for row in answer.json()["rows"]}
        assert rows[first]["order_key"] == rows[second]["order_key"] == "invoice-42"
        assert (rows[first]["state"], rows[second]["state"]) == ("READY", "HELD")
        assert [row["id"] for row in held.json()["rows"]] == [second]
    finally:
        world.close()


def test_a_concurrency_key_admits_at_most_its_limit_in_enqueue_order(db_url: str) -> None:
    store = Store(db_url)
    ids = [
        store.enqueue("t", f"c-{i}", concurrency_key="acct-7", concurrency_limit=2).job_id
        for i in range(5)
    ]
    store.enqueue_many(
        [{"tenant": "t", "action": "d-0", "concurrency_key": "acct-8", "concurrency_limit": 1}]
    )
    assert [_state(store, i) for i in ids] == ["READY", "READY", "HELD", "HELD", "HELD"]
    job = store.get(ids[2])
    assert (job.concurrency_key, job.concurrency_limit) == ("acct-7", 2)
    leases = {x.action: x for x in store.claim_batch("w", 10)}
    assert sorted(leases) == ["c-0", "c-1", "d-0"]
    store.wait_external(leases["c-0"], reason="waits keep their place")
    assert store.claim_batch("w", 10) == []
    assert store.cancel(ids[3], reason="not needed") == "CANCELLED"  # HELD: no place freed
    assert store.claim_batch("w", 10) == []
    store.finish(leases["c-1"])
    assert [x.action for x in store.claim_batch("w", 10)] == ["c-2"]
    store.cancel(ids[0], reason="gave up")  # the waiting one: its place frees too
    assert [x.action for x in store.claim_batch("w", 10)] == ["c-4"]
    store.dispose()


def test_concurrent_claimers_never_exceed_a_concurrency_limit(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many(
        [
            {
                "tenant": f"t{i % 3}",
                "action": f"c-{i}",
                "concurrency_key": f"k{i % 2}",
                "concurrency_limit": 3,
            }
            for i in range(60)
        ]
    )
    admitted = sa.text(
        "SELECT concurrency_key, count(*) FROM outbox_jobs WHERE state IN ('READY', 'LEASED')"
        " GROUP BY concurrency_key"
    )
    lock = threading.Lock()
    running: dict[str, int] = defaultdict(int)
    peak: dict[str, int] = defaultdict(int)
    done: list[int] = []
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            idle = 0
            while idle < 200 and len(done) < 60:
                leases = store.claim_batch(name, 2)
                idle = idle + 1 if not leases else 0
                with store.engine.connect() as conn:  # the admitted jobs, as committed
                    for key, n in conn.execute(admitted):
                        with lock:
                            peak[f"db {key}"] = max(peak[f"db {key}"], int(n))
                with lock:
                    for lease in leases:
                        key = f"k{int(lease.action.split('-')[1]) % 2}"
                        running[key] += 1
                        peak[key] = max(peak[key], running[key])
                with lock:
                    for lease in leases:
                        running[f"k{int(lease.action.split('-')[1]) % 2}"] -= 1
                        done.append(lease.job_id)
                store.finish_batch(leases)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert store.counts()["DONE"] == 60
    assert peak and max(peak.values()) <= 3, dict(peak)
    assert peak["db k0"] == 3  # the limit was reached, not only respected
    with store.engine.connect() as conn:
        leased = conn.execute(
            sa.text("SELECT concurrency_key, active FROM outbox_concurrency_keys ORDER BY 1")
        ).all()
    assert [tuple(row) for row in leased] == [("k0", 0), ("k1", 0)]
    store.dispose()


def test_bad_concurrency_arguments_are_typed_errors(db_url: str) -> None:
    store = Store(db_url)
    for kwargs, field in (
        ({"concurrency_key": "k"}, "concurrency_limit"),
        ({"concurrency_key": "k", "concurrency_limit": 0}, "concurrency_limit"),
        ({"concurrency_limit": 2}, "concurrency_limit"),
        ({"concurrency_key": "k", "concurrency_limit": 2, "order_key": "o"}, "concurrency_key"),
    ):
        with pytest.raises(JobError) as bad:
            store.enqueue("t", "a", **kwargs)  # type: ignore[arg-type]
        assert bad.value.field == field
    store.dispose()
