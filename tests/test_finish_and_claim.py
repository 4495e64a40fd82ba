"""``Store.finish_and_claim``: a worker's finishes and its next claim (issue 44).

The worker's default path: the claim that takes the slots of jobs whose handlers returned
writes their finishes. Each finish is fenced on its own epoch as in ``finish_batch``, a job
with a cancel request ends CANCELLED, and on PostgreSQL the finish and the claim are one
statement (one round trip, one commit), so the worker never holds more leases than slots."""

from __future__ import annotations

import dataclasses
from typing import Any

import sqlalchemy as sa

from consumer import Store


def _jobs(store: Store, count: int, tenant: str = "t") -> None:
    store.enqueue_many([{"tenant": tenant, "action": f"noop-{i}"} for i in range(count)])


def _states(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT state, count(*) FROM outbox_jobs GROUP BY state"))
        return {state: int(n) for state, n in rows}


def _claim_fails_once(store: Store, monkeypatch: Any) -> None:
    """The store's next claim statement fails as on a lost connection; later ones run."""
    real = store.driver.job_claim_batch
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise sa.exc.OperationalError("claim", {}, Exception("the connection is lost"))
        return real(*args, **kwargs)

    monkeypatch.setattr(store.driver, "job_claim_batch", failing)


def test_it_finishes_the_leases_and_claims_the_next_jobs(db_url: str) -> None:
    store = Store(db_url)
    _jobs(store, 10)
    first = store.claim_batch("w1", 4)
    result, nxt = store.finish_and_claim(first, "w1", 4, routes=["noop"])
    assert result.done == sorted(lease.job_id for lease in first) and result.conflicts == []
    assert len(nxt) == 4 and not {x.job_id for x in nxt} & {x.job_id for x in first}
    assert all(x.worker == "w1" and x.epoch == 1 for x in nxt)
    assert _states(store) == {"DONE": 4, "LEASED": 4, "READY": 2}
    history = store.history(first[0].job_id)
    assert [(a.outcome, a.epoch, a.worker) for a in history][-1] == ("done", 1, "w1")
    # Nothing left to claim: the finishes are still written.
    result, last = store.finish_and_claim(nxt, "w1", 8)
    assert len(result.done) == 4 and len(last) == 2
    result, none = store.finish_and_claim(last, "w1", 8)
    assert len(result.done) == 2 and none == []
    assert _states(store) == {"DONE": 10}
    store.dispose()


def test_a_lost_lease_is_refused_and_the_claim_still_goes(db_url: str) -> None:
    store = Store(db_url)
    _jobs(store, 6)
    held = store.claim_batch("w1", 2)
    stale = dataclasses.replace(held[0], epoch=held[0].epoch + 1)  # taken over since
    result, nxt = store.finish_and_claim([stale, held[1]], "w1", 2)
    assert result.done == [held[1].job_id] and result.conflicts == [held[0].job_id]
    assert len(nxt) == 2
    assert store.get(held[0].job_id).state == "LEASED"  # not finished by a stale holder
    store.dispose()


def test_a_job_with_a_cancel_request_ends_cancelled(db_url: str) -> None:
    store = Store(db_url)
    _jobs(store, 3)
    held = store.claim_batch("w1", 2)
    assert store.cancel(held[0].job_id, reason="not wanted") == "LEASED"  # a request
    result, _ = store.finish_and_claim(held, "w1", 1)
    assert sorted(result.done) == sorted(x.job_id for x in held)
    assert store.get(held[0].job_id).state == "CANCELLED"
    assert store.get(held[1].job_id).state == "DONE"
    assert store.history(held[0].job_id)[-1].outcome == "cancelled"
    store.dispose()


def test_another_workers_lease_is_written_apart_and_fenced(db_url: str) -> None:
    store = Store(db_url)
    _jobs(store, 4)
    theirs = store.claim_batch("w2", 1)
    mine = store.claim_batch("w1", 1)
    result, nxt = store.finish_and_claim([*mine, *theirs], "w1", 1)
    # w2's lease is w2's: finish_batch fences it on its own holder, as the lease says.
    assert sorted(result.done) == sorted([mine[0].job_id, theirs[0].job_id])
    assert len(nxt) == 1 and nxt[0].worker == "w1"
    store.dispose()


def test_on_postgresql_the_finish_and_the_claim_are_one_statement(pg_url: str) -> None:
    store = Store(pg_url)
    _jobs(store, 8)
    held = store.claim_batch("w1", 4)
    sent: list[str] = []

    def capture(_c: Any, _cur: Any, statement: str, *_rest: Any) -> None:
        sent.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", capture)
    try:
        result, nxt = store.finish_and_claim(held, "w1", 4)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", capture)
    assert len(result.done) == 4 and len(nxt) == 4
    assert len(sent) == 1, sent  # no BEGIN/COMMIT round trips either: it commits alone
    assert "outbox_job_attempts" in sent[0] and "SKIP LOCKED" in sent[0]
    store.dispose()


def test_a_claims_row_is_read_by_position_in_lease_columns_order() -> None:
    """``lease_from_row`` unpacks a claim's row by position (issue 44: by name it cost
    ~7 us a lease on the worker's critical path): each column lands in its own field."""
    from consumer.jobs.queries import LEASE_COLUMNS
    from consumer.jobs.rows import lease_from_row

    numeric = {"id", "subject_version", "attempts", "lease_epoch", "lease_expires_at"}
    numeric |= {"timer_scheduled_for", "created_at", "replies_received", "replies_consumed"}
    numeric |= {"children"}
    values = {
        name: (i + 1 if name in numeric else f"{name}-value")
        for i, name in enumerate(LEASE_COLUMNS)
    }
    lease = lease_from_row(tuple(values[name] for name in LEASE_COLUMNS))
    assert lease.timer is not None
    read = {
        "id": lease.job_id,
        "tenant": lease.tenant,
        "action": lease.action,
        "kind": lease.kind,
        "subject": lease.subject,
        "subject_version": lease.subject_version,
        "payload": lease.payload,
        "provider": lease.provider,
        "attempts": lease.attempts,
        "lease_epoch": lease.epoch,
        "lease_owner": lease.worker,
        "lease_expires_at": lease.expires_at,
        "timer_scheduled_for": lease.timer.scheduled_for,
        "timer_reason": lease.timer.reason,
        "timer_subject_version": lease.timer.subject_version,
        "timer_cancellation_condition": lease.timer.cancellation_condition,
        "trace_context": lease.trace_context,
        "queue": lease.queue,
        "created_at": lease.enqueued_at,
        "replies_received": lease.replies_received,
        "replies_consumed": lease.replies_consumed,
        "children": lease.children,
    }
    assert read == values


def test_a_claim_that_fails_after_its_finishes_committed_reports_them_done_once(
    db_url: str, monkeypatch: Any
) -> None:
    """Where the finish commits before the claim (SQLite; PostgreSQL when the statement
    cannot carry the finishes), a claim that then fails does not undo nor repeat them: the
    finishes come back done, the claim comes back empty, and the next call claims."""
    store = Store(db_url)
    _jobs(store, 6)
    held = store.claim_batch("w1", 2)
    monkeypatch.setattr(type(store.driver), "job_claim_finishes", False, raising=False)
    _claim_fails_once(store, monkeypatch)
    result, claimed = store.finish_and_claim(held, "w1", 2)
    assert result.done == sorted(x.job_id for x in held) and result.conflicts == []
    assert claimed == []
    assert _states(store) == {"DONE": 2, "READY": 4}
    result, claimed = store.finish_and_claim([], "w1", 2)  # the next statement claims
    assert len(claimed) == 2 and _states(store) == {"DONE": 2, "LEASED": 2, "READY": 2}
    assert len([a for a in store.history(held[0].job_id) if a.outcome == "done"]) == 1
    store.dispose()


def test_on_postgresql_finishes_with_results_and_the_claim_commit_together(
    pg_url: str, monkeypatch: Any
) -> None:
    """Leases the one statement cannot carry (a result to write) are finished in the
    claim's own transaction on PostgreSQL: one commit for both, so a claim that fails takes
    the finishes back with it (the worker carries them into its next statement) and the
    next call writes each once, results included."""
    store = Store(pg_url)
    _jobs(store, 6)
    held = [
        dataclasses.replace(lease, result={"n": lease.job_id})
        for lease in store.claim_batch("w1", 2)
    ]
    _claim_fails_once(store, monkeypatch)
    try:
        store.finish_and_claim(held, "w1", 2)
    except sa.exc.OperationalError:
        pass
    else:  # pragma: no cover - the claim's failure must reach the caller
        raise AssertionError("the failed claim was swallowed")
    assert _states(store) == {"LEASED": 2, "READY": 4}  # neither the finishes nor the claim
    result, claimed = store.finish_and_claim(held, "w1", 2)
    assert result.done == sorted(x.job_id for x in held) and result.conflicts == []
    assert len(claimed) == 2 and _states(store) == {"DONE": 2, "LEASED": 2, "READY": 2}
    for lease in held:
        assert store.result(lease.tenant, lease.action, timeout=5) == {"n": lease.job_id}
        assert len([a for a in store.history(lease.job_id) if a.outcome == "done"]) == 1
    store.dispose()
