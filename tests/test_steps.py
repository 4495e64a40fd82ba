"""Steps and results (issue 57): jobs enqueued ``after`` other jobs, on PostgreSQL and SQLite.

A job with parents not DONE is WAITING_PARENTS and never claimed; the finish of its last
parent makes it READY in the same transaction, exactly once even when parents finish
together on many threads; a handler's return value is its job's result, which dependents
read as ``ctx.results`` and callers await with ``Store.result`` / ``aresult``; a refused
graph writes nothing; a failed parent parks or cancels its dependents.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import sqlalchemy as sa

from consumer import (
    DependencyCycle,
    JobContext,
    Lease,
    ResultTimeout,
    ResultTooLarge,
    ResultUnavailable,
    StepGraphError,
    Store,
    UnknownParent,
    Worker,
)
from consumer.errors import JobError, JobNotFound
from consumer.jobs.receipts import Receipt
from consumer.jobs.retention import JobRetention, JobRetentionConfig
from consumer.jobs.step_results import MAX_RESULT_BYTES
from tests.services import wait_for


def _rows(store: Store, table: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def _state(store: Store, action: str, tenant: str = "t") -> str:
    return store.get(tenant, action).state


def _drain(worker: Worker, rounds: int = 50) -> None:
    for _ in range(rounds):
        if worker.run_once() == 0:
            return


def test_a_chain_runs_in_order_and_passes_its_results(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many(
        [
            {"tenant": "t", "action": "step-3", "after": [("t", "step-2")]},
            {"tenant": "t", "action": "step-2", "after": [("t", "step-1")]},
            {"tenant": "t", "action": "step-1", "payload": {"n": 1}},
        ]
    )
    assert [_state(store, f"step-{i}") for i in (1, 2, 3)] == [
        "READY",
        "WAITING_PARENTS",
        "WAITING_PARENTS",
    ]
    seen: list[tuple[str, dict[Any, Any]]] = []

    def step(job: JobContext) -> int:
        seen.append((job.action, job.results))
        if job.action == "step-1":
            return 1
        return int(next(iter(job.results.values()))) + 1

    worker = Worker(store)
    worker.register("step", step)
    assert worker.run_once() == 1  # step-1 only: the others are not claimable
    assert _state(store, "step-2") == "READY" and _state(store, "step-3") == "WAITING_PARENTS"
    _drain(worker)
    assert seen == [
        ("step-1", {}),
        ("step-2", {("t", "step-1"): 1}),
        ("step-3", {("t", "step-2"): 2}),
    ]
    assert store.result("t", "step-3", timeout=0) == 3
    assert asyncio.run(store.aresult("t", "step-2", timeout=5)) == 2
    store.dispose()


def test_a_diamond_gives_its_last_step_both_results(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "a")
    store.enqueue_many(
        [
            {"tenant": "t", "action": "b", "after": [("t", "a")]},
            {"tenant": "t", "action": "c", "after": [("t", "a")]},
            {"tenant": "t", "action": "d", "after": [("t", "b"), ("t", "c")]},
        ]
    )
    got: dict[str, Any] = {}

    def run(job: JobContext) -> Any:
        got[job.action] = job.results
        return {"from": job.action}

    worker = Worker(store)
    for name in "abcd":
        worker.register(name, run)
    assert worker.run_once() == 1
    assert {_state(store, x) for x in "bc"} == {"READY"} and _state(store, "d") == "WAITING_PARENTS"
    _drain(worker)
    assert got["d"] == {("t", "b"): {"from": "b"}, ("t", "c"): {"from": "c"}}
    assert store.get("t", "d").parents_pending == 0
    assert store.graph("t", "d") == {
        "parents": [
            {"id": store.get("t", "b").id, "tenant": "t", "action": "b", "state": "DONE"},
            {"id": store.get("t", "c").id, "tenant": "t", "action": "c", "state": "DONE"},
        ],
        "children": [],
    }
    store.dispose()


def test_a_child_of_100_parents_finished_together_is_ready_once(db_url: str) -> None:
    store = Store(db_url)
    parents = [{"tenant": "t", "action": f"p-{i}"} for i in range(100)]
    child = {"tenant": "t", "action": "child", "after": [("t", f"p-{i}") for i in range(100)]}
    store.enqueue_many([*parents, child])
    leases = [store.claim("t", f"p-{i}", f"w{i}") for i in range(100)]
    assert all(epoch == 1 for epoch in leases)
    assert store.get("t", "child").parents_pending == 100
    gate = threading.Barrier(20)
    errors: list[BaseException] = []

    def finish(chunk: range) -> None:
        try:
            gate.wait()
            for i in chunk:
                store.finish("t", f"p-{i}", f"w{i}", 1, result=i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=finish, args=(range(k, 100, 20),)) for k in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    job = store.get("t", "child")
    assert job.state == "READY" and job.parents_pending == 0  # not -1, not stuck at 1
    with store.engine.connect() as conn:
        released = conn.execute(sa.text("SELECT sum(released) FROM outbox_job_steps")).scalar()
    assert released == 100
    assert store.claim("t", "child", "w") == 1 and store.claim("t", "child", "w2") is None
    assert store.results_of_parents(job.id) == {("t", f"p-{i}"): i for i in range(100)}
    store.dispose()


def test_batch_finishes_on_many_threads_release_the_child_once(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many([{"tenant": "t", "action": f"p-{i}"} for i in range(40)])
    store.enqueue("t", "child", after=[("t", f"p-{i}") for i in range(40)])
    leases = []
    for k in range(8):
        leases.append(store.claim_batch(f"w{k}", 5))
    assert sum(len(x) for x in leases) == 40 and all(x[0].children == 1 for x in leases)
    gate = threading.Barrier(8)

    def finish(batch: list[Any]) -> None:
        gate.wait()
        store.finish_batch(batch)

    threads = [threading.Thread(target=finish, args=(batch,)) for batch in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    job = store.get("t", "child")
    assert (job.state, job.parents_pending) == ("READY", 0)
    store.dispose()


def test_a_cycle_is_refused_and_nothing_is_written(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "existing")
    with pytest.raises(DependencyCycle) as caught:
        store.enqueue_many(
            [
                {"tenant": "t", "action": "free"},
                {"tenant": "t", "action": "a", "after": [("t", "existing"), ("t", "c")]},
                {"tenant": "t", "action": "b", "after": [("t", "a")]},
                {"tenant": "t", "action": "c", "after": [("t", "b")]},
            ]
        )
    assert caught.value.field == "after" and "t/a" in str(caught.value)
    with pytest.raises(DependencyCycle):
        store.enqueue("t", "self", after=[("t", "self")])
    assert _rows(store, "outbox_jobs") == 1 and _rows(store, "outbox_job_steps") == 0
    assert store.get("t", "existing").state == "READY"
    store.dispose()


def test_an_unknown_parent_is_refused_and_nothing_is_written(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "known")
    with pytest.raises(UnknownParent) as caught:
        store.enqueue_many(
            [
                {"tenant": "t", "action": "x", "after": [("t", "known")]},
                {"tenant": "t", "action": "y", "after": [("t", "x"), ("t", "ghost")]},
            ]
        )
    assert caught.value.parents == ["t/ghost"] and isinstance(caught.value, StepGraphError)
    with pytest.raises(UnknownParent):
        store.enqueue("t", "z", after=[("other", "known")])
    # In the caller's transaction too: the refusal comes before the first write.
    with store.engine.begin() as conn:
        with pytest.raises(UnknownParent):
            store.enqueue("t", "w", after=[("t", "ghost")], session=conn)
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_jobs")).scalar() == 1
    assert _rows(store, "outbox_jobs") == 1 and _rows(store, "outbox_job_steps") == 0
    with pytest.raises(Exception, match="after"):
        store.enqueue("t", "bad", after=["t/known"])  # type: ignore[list-item]
    store.dispose()


def test_a_graph_joins_the_callers_transaction(db_url: str) -> None:
    store = Store(db_url)
    with store.engine.connect() as conn, conn.begin() as tx:
        store.enqueue_many(
            [
                {"tenant": "t", "action": "one"},
                {"tenant": "t", "action": "two", "after": [("t", "one")]},
            ],
            session=conn,
        )
        tx.rollback()
    assert _rows(store, "outbox_jobs") == 0 and _rows(store, "outbox_job_steps") == 0
    with store.engine.begin() as conn:
        store.enqueue("t", "one", session=conn)
        store.enqueue("t", "two", after=[("t", "one")], session=conn)
    assert _state(store, "two") == "WAITING_PARENTS"
    store.dispose()


def test_result_waits_for_the_finish_and_raises_for_the_other_ends(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many([{"tenant": "t", "action": a} for a in ("slow", "gone", "spent", "open")])
    store.claim("t", "slow", "w")
    finisher = threading.Timer(0.3, lambda: store.finish("t", "slow", "w", 1, result=[1, "x"]))
    finisher.start()
    assert store.result("t", "slow", timeout=30) == [1, "x"]
    finisher.join()
    store.cancel("t", "gone", reason="not needed")
    with pytest.raises(ResultUnavailable) as gone:
        store.result("t", "gone", timeout=5)
    assert gone.value.state == "CANCELLED" and "not needed" in str(gone.value)
    store.claim("t", "spent", "w")
    for _ in range(store.config.retry.max_attempts):
        epoch = store.get("t", "spent").lease_epoch
        if store.fail("t", "spent", "w", epoch, error="boom") != "READY":
            break
        with store.engine.begin() as conn:  # the backoff: eligible at once for this test
            conn.execute(sa.text("UPDATE outbox_jobs SET run_after = NULL"))
        store.claim("t", "spent", "w")
    assert _state(store, "spent") == "NEEDS_ATTENTION"
    with pytest.raises(ResultUnavailable) as spent:
        store.result("t", "spent")
    assert spent.value.state == "NEEDS_ATTENTION"
    with pytest.raises(ResultTimeout) as late:
        store.result("t", "open", timeout=0.05)
    assert late.value.state == "READY" and isinstance(late.value, TimeoutError)
    with pytest.raises(JobNotFound):
        store.result("t", "nobody", timeout=1)

    # A lease finished without a result: the job's result is None.
    assert asyncio.run(_finish_later(store)) is None
    store.dispose()


async def _finish_later(store: Store) -> Any:
    epoch = store.claim("t", "open", "w")

    def finish() -> None:
        store.finish("t", "open", "w", epoch)

    asyncio.get_running_loop().call_later(0.2, lambda: threading.Thread(target=finish).start())
    with pytest.raises(ResultTimeout):
        await store.aresult("t", "open", timeout=0.01)
    return await store.aresult("t", "open", timeout=30)


def test_a_failed_parent_parks_its_dependents_naming_it(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many(
        [
            {"tenant": "t", "action": "quote"},
            {"tenant": "t", "action": "book", "after": [("t", "quote")]},
            {
                "tenant": "t",
                "action": "skip",
                "after": [("t", "quote")],
                "on_parent_failure": "cancel",
            },
            {"tenant": "t", "action": "later", "after": [("t", "book")]},
        ]
    )
    epoch = store.claim("t", "quote", "w")
    assert (
        store.fail("t", "quote", "w", epoch, error="invalid", kind="permanent") == "WAITING_REVIEW"
    )
    book = store.get("t", "book")
    assert book.state == "WAITING_REVIEW" and "t/quote" in (book.wait_reason or "")
    assert _state(store, "skip") == "CANCELLED"
    assert _state(store, "later") == "WAITING_PARENTS"  # its parent is in review, not failed
    # The operator fixes the quote: it runs again and ends DONE; the parked step goes on.
    store.resume("t", "quote")
    epoch = store.claim("t", "quote", "w")
    store.finish("t", "quote", "w", epoch, result="q-1")
    assert _state(store, "book") == "READY"
    store.dispose()


def test_cancelling_a_job_cancels_its_dependents(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many(
        [
            {"tenant": "t", "action": "a"},
            {"tenant": "t", "action": "b", "after": [("t", "a")]},
            {"tenant": "t", "action": "c", "after": [("t", "b")]},
            {"tenant": "t", "action": "other"},
        ]
    )
    store.cancel("t", "a", reason="customer left")
    assert [_state(store, x) for x in "abc"] == ["CANCELLED"] * 3
    assert "t/b" in (store.get("t", "c").wait_reason or "")
    assert _state(store, "other") == "READY"
    # A child enqueued after a cancelled parent is cancelled at once.
    store.enqueue("t", "d", after=[("t", "a")])
    assert _state(store, "d") == "CANCELLED"
    with pytest.raises(ResultUnavailable):
        store.result("t", "c", timeout=1)
    store.dispose()


def test_a_result_over_the_cap_fails_the_run_and_is_never_truncated(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "big")
    worker = Worker(store)
    worker.register("big", lambda job: "x" * MAX_RESULT_BYTES)
    worker.run_once()
    job = store.get("t", "big")
    assert job.state == "WAITING_REVIEW" and job.result is None
    assert "cap" in (job.last_error or "")
    store.enqueue("t", "direct")
    epoch = store.claim("t", "direct", "w")
    with pytest.raises(ResultTooLarge):
        store.finish("t", "direct", "w", epoch, result={"x": "y" * MAX_RESULT_BYTES})
    with pytest.raises(ResultTooLarge):
        store.finish("t", "direct", "w", epoch, result={1, 2})
    store.finish("t", "direct", "w", epoch, result="y" * (MAX_RESULT_BYTES - 2))  # fits
    assert len(store.result("t", "direct")) == MAX_RESULT_BYTES - 2
    store.dispose()


def test_a_child_enqueued_while_its_parent_runs_is_released(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "parent")
    [lease] = store.claim_batch("w", 1)
    assert lease.children == 0  # claimed before it had any: its finish takes the plain path
    store.enqueue("t", "child", after=[("t", "parent")])
    result, _ = store.finish_and_claim([lease], "w", 1)
    assert result.done == [lease.job_id]
    store.recover()  # the sweep applies the parent's end
    assert _state(store, "child") == "READY"
    store.dispose()


def test_the_slots_run_a_graph_with_results(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many(
        [
            spec
            for i in range(20)
            for spec in (
                {"tenant": "t", "action": f"a-{i}"},
                {"tenant": "t", "action": f"b-{i}", "after": [("t", f"a-{i}")]},
                {"tenant": "t", "action": f"c-{i}", "after": [("t", f"a-{i}")]},
                {"tenant": "t", "action": f"d-{i}", "after": [("t", f"b-{i}"), ("t", f"c-{i}")]},
            )
        ]
    )
    seen: dict[str, Any] = {}

    def step(job: JobContext) -> str:
        seen[job.action] = job.results
        return job.action

    async def last(job: JobContext) -> list[str]:
        seen[job.action] = job.results
        return sorted(str(v) for v in job.results.values())

    worker = Worker(store, concurrency=4, poll_interval=0.05)
    for name in "abc":
        worker.register(name, step)
    worker.register("d", last)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    try:
        wait_for(lambda: store.counts()["DONE"] == 80, timeout=60)
    finally:
        worker.stop()
        thread.join(30)
    for i in range(20):
        assert store.result("t", f"d-{i}", timeout=0) == [f"b-{i}", f"c-{i}"]
        assert seen[f"b-{i}"] == {("t", f"a-{i}"): f"a-{i}"}
    store.dispose()


def test_a_handler_returning_a_receipt_or_an_object_still_ends_done(db_url: str) -> None:
    """Handlers written before results (``return job.dispatch(...)``, any object): the
    receipt is stored as its dict, an object that is not JSON as no result."""
    store = Store(db_url)
    store.enqueue("t", "obj")
    store.enqueue("t", "receipt")
    worker = Worker(store)
    worker.register("obj", lambda job: object())
    worker.register("receipt", lambda job: Receipt("op-1", "ACCEPTED", "ref-1", job_id=job.job_id))
    _drain(worker)
    assert store.get("t", "obj").state == "DONE" and store.result("t", "obj") is None
    stored = store.result("t", "receipt", timeout=0)
    assert stored["operation_id"] == "op-1" and stored["provider_ref"] == "ref-1"
    store.dispose()


def test_retention_keeps_a_parent_while_a_dependent_is_open(db_url: str) -> None:
    """A finished parent whose dependent has not run yet stays (its result is read when the
    dependent runs); once every dependent ended, both go with their edges."""
    store = Store(db_url)
    store.enqueue_many(
        [
            {"tenant": "t", "action": "a"},
            {"tenant": "t", "action": "b", "after": [("t", "a")]},
            {"tenant": "t", "action": "c", "after": [("t", "b")]},
        ]
    )
    store.finish("t", "a", "w", store.claim("t", "a", "w"), result=1)
    retention = JobRetention(store, JobRetentionConfig())
    gone = JobRetentionConfig().job_retention_seconds + 60
    with store.engine.begin() as conn:  # the retention window passes
        conn.execute(sa.text(f"UPDATE outbox_jobs SET updated_at = updated_at - {gone}"))
    assert retention.purge_finished(100) == 0  # b has not run: a stays
    store.finish("t", "b", "w", store.claim("t", "b", "w"), result=2)
    store.cancel("t", "c")
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE outbox_jobs SET updated_at = updated_at - {gone}"))
    assert retention.purge_finished(100) == 3
    assert _rows(store, "outbox_jobs") == 0 and _rows(store, "outbox_job_steps") == 0
    store.dispose()


def test_workers_releasing_the_same_children_together_never_deadlock(db_url: str) -> None:
    """8 workers each finish, at once, one parent of every one of 50 children (in batches
    whose children come in different orders): each child READY once, no error."""
    store = Store(db_url)
    parents = [
        {"tenant": "t", "action": f"p-{w}-{c}", "priority": (w * 7 + c * 3) % 11}
        for w in range(8)
        for c in range(50)
    ]
    children = [
        {"tenant": "t", "action": f"child-{c}", "after": [("t", f"p-{w}-{c}") for w in range(8)]}
        for c in range(50)
    ]
    store.enqueue_many([*parents, *children])
    batches = []
    for w in range(8):
        epochs = [(c, store.claim("t", f"p-{w}-{c}", f"w{w}")) for c in range(50)]
        batches.append([(w, c, e) for c, e in epochs])
    leases = {}
    with store.engine.connect() as conn:
        for row in conn.execute(sa.text("SELECT id, action FROM outbox_jobs")):
            leases[row.action] = int(row.id)
    gate = threading.Barrier(8)
    errors: list[BaseException] = []

    def finish(batch: list[tuple[int, int, int | None]]) -> None:
        w = batch[0][0]
        order = sorted(batch, key=lambda x: (x[1] * (w + 3)) % 50)  # each its own order
        lost = [
            Lease(
                leases[f"p-{w}-{c}"],
                "t",
                f"p-{w}-{c}",
                None,
                None,
                None,
                None,
                None,
                1,
                int(e or 0),
                f"w{w}",
                0.0,
                children=1,
                result=c,
            )
            for _, c, e in order
        ]
        try:
            gate.wait()
            for start in range(0, 50, 10):
                assert store.finish_batch(lost[start : start + 10]).conflicts == []
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=finish, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for c in range(50):
        job = store.get("t", f"child-{c}")
        assert (job.state, job.parents_pending) == ("READY", 0)
    store.dispose()


def test_a_parent_spent_by_recovery_parks_its_dependent(db_url: str) -> None:
    """A parent whose lease expired with its attempts spent goes NEEDS_ATTENTION through
    recovery: its dependent goes to WAITING_REVIEW in the same transaction (a ``cancel``
    one to CANCELLED), and ``result`` of the parent says why there is none."""
    store = Store(db_url)
    store.enqueue_many(
        [
            {"tenant": "t", "action": "parent"},
            {"tenant": "t", "action": "review", "after": [("t", "parent")]},
            {
                "tenant": "t",
                "action": "drop",
                "after": [("t", "parent")],
                "on_parent_failure": "cancel",
            },
        ]
    )
    now = store.get("t", "parent").created_at
    for n in range(store.config.retry.max_attempts):
        assert store.claim("t", "parent", "w", now=now + 100 * n, ttl=10) is not None
    store.recover(now=now + 100 * store.config.retry.max_attempts)
    assert _state(store, "parent") == "NEEDS_ATTENTION"
    review = store.get("t", "review")
    assert review.state == "WAITING_REVIEW" and "t/parent is NEEDS_ATTENTION" in (
        review.wait_reason or ""
    )
    assert _state(store, "drop") == "CANCELLED"
    with pytest.raises(ResultUnavailable) as why:
        store.result("t", "parent", timeout=1)
    assert why.value.state == "NEEDS_ATTENTION" and "attempts spent" in str(why.value)
    store.dispose()


def test_a_step_enqueued_in_a_consumer_batch_sees_its_buffered_parent(db_url: str) -> None:
    """In a consumer's batch Session the plain enqueues wait in a buffer; a step enqueued
    after one of them writes the buffer first, then itself, in the same transaction."""
    from sqlalchemy.orm import Session

    from consumer.bulk import defer_writes, flush_deferred

    store = Store(db_url)
    with Session(store.engine) as session, session.begin():
        defer_writes(session)
        store.enqueue("t", "buffered", session=session)
        store.enqueue("t", "step", after=[("t", "buffered")], session=session)
        store.enqueue("t", "later", session=session)
        flush_deferred(session)
    assert _state(store, "buffered") == "READY" and _state(store, "later") == "READY"
    assert _state(store, "step") == "WAITING_PARENTS"
    assert store.graph("t", "step")["parents"][0]["action"] == "buffered"
    store.dispose()


def test_a_job_table_made_before_steps_is_brought_up_to_date(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "old")
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE outbox_job_steps"))
        for column in ("result", "parents_pending", "children", "on_parent_failure"):
            conn.execute(sa.text(f"ALTER TABLE outbox_jobs DROP COLUMN {column}"))
    store.dispose()
    store = Store(db_url)  # every start brings the tables up to date
    store.enqueue("t", "new", after=[("t", "old")])
    store.finish("t", "old", "w", store.claim("t", "old", "w"), result="kept")
    assert _state(store, "new") == "READY" and store.result("t", "old") == "kept"
    store.dispose()


def test_a_duplicate_keeps_its_parents_and_bad_arguments_name_their_field(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many([{"tenant": "t", "action": "p"}, {"tenant": "t", "action": "q"}])
    first = store.enqueue("t", "child", after=[("t", "p")])
    again = store.enqueue("t", "child", after=[("t", "q")])
    assert again.duplicate and again.job_id == first.job_id
    assert [x["action"] for x in store.graph("t", "child")["parents"]] == ["p"]
    with pytest.raises(JobError) as bad:
        store.enqueue("t", "x", after=[("t", "p")], on_parent_failure="ignore")
    assert bad.value.field == "on_parent_failure"
    with pytest.raises(JobError) as bad:
        store.enqueue_many([{"tenant": "t", "action": "y", "after": [("t",)]}])
    assert bad.value.field == "specs[0].after"
    assert _rows(store, "outbox_jobs") == 3
    store.dispose()
