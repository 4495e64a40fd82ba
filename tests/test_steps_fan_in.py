"""Fan-in (issue 57's target): a child of 100 parents finished together is READY once, in the
transaction of the last parent's finish, on PostgreSQL and SQLite.

Two views of "in the same transaction": a reader polling single-statement snapshots while
the finishes run never sees every parent DONE with the child still waiting, nor the child
READY with a parent not DONE (both databases: a statement reads one snapshot); and on
PostgreSQL a trigger records the transaction id of every state change, so the child's move
to READY carries the id of exactly one parent's move to DONE.
"""

from __future__ import annotations

import threading

import sqlalchemy as sa

from consumer import Store

N = 100


def _graph(store: Store) -> None:
    parents = [{"tenant": "t", "action": f"p-{i}"} for i in range(N)]
    child = {"tenant": "t", "action": "child", "after": [("t", f"p-{i}") for i in range(N)]}
    store.enqueue_many([*parents, child])
    for i in range(N):
        assert store.claim("t", f"p-{i}", f"w{i}") == 1


def _finish_together(store: Store, threads: int = 20) -> list[BaseException]:
    gate = threading.Barrier(threads)
    errors: list[BaseException] = []

    def finish(chunk: range) -> None:
        try:
            gate.wait()
            for i in chunk:
                store.finish("t", f"p-{i}", f"w{i}", 1, result=i)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    workers = [
        threading.Thread(target=finish, args=(range(k, N, threads),)) for k in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    return errors


_SNAPSHOT = sa.text(
    "SELECT (SELECT count(*) FROM outbox_jobs WHERE action LIKE 'p-%' AND state = 'DONE'), "
    "(SELECT state FROM outbox_jobs WHERE action = 'child')"
)


def test_no_snapshot_shows_the_last_parent_done_without_the_child_ready(db_url: str) -> None:
    store = Store(db_url)
    _graph(store)
    seen: list[tuple[int, str]] = []
    stop = threading.Event()

    def watch() -> None:
        with store.engine.connect() as conn:
            while not stop.is_set():
                done, state = conn.execute(_SNAPSHOT).one()
                seen.append((int(done), str(state)))
                conn.rollback()  # the next read takes a new snapshot

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        errors = _finish_together(store)
    finally:
        stop.set()
        watcher.join(60)
    assert errors == []
    with store.engine.connect() as conn:
        done, state = conn.execute(_SNAPSHOT).one()
    assert (done, state) == (N, "READY")
    assert any(d < N for d, _ in seen)  # the reader ran while the finishes went on
    wrong = [(d, s) for d, s in seen if (d == N) != (s == "READY")]
    assert wrong == []  # READY exactly when every parent is DONE, in every snapshot
    assert all(s in ("WAITING_PARENTS", "READY") for _, s in seen)
    store.dispose()


_PG_TRIGGER = """
CREATE TABLE state_log (job_id bigint, state text, txid bigint);
CREATE FUNCTION log_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        INSERT INTO state_log VALUES (NEW.id, NEW.state, txid_current());
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER log_state AFTER UPDATE ON outbox_jobs FOR EACH ROW EXECUTE FUNCTION log_state();
"""


def test_the_child_is_ready_in_the_transaction_of_a_parents_finish(pg_url: str) -> None:
    store = Store(pg_url)
    _graph(store)
    with store.engine.begin() as conn:
        conn.exec_driver_sql(_PG_TRIGGER)
    assert _finish_together(store) == []
    child = store.get("t", "child").id
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT job_id, state, txid FROM state_log")).all()
    moves = [(state, txid) for job_id, state, txid in rows if job_id == child]
    assert [state for state, _ in moves] == ["READY"]  # once
    parents_done = [txid for job_id, state, txid in rows if job_id != child and state == "DONE"]
    assert len(parents_done) == N and len(set(parents_done)) == N  # each finish its own
    assert parents_done.count(moves[0][1]) == 1  # the child's move is in one parent's finish
    store.dispose()


def test_finishing_in_turn_releases_the_child_at_the_last(db_url: str) -> None:
    """The sequential case: the child waits through 99 finishes and is READY when the 100th
    returns, with no other call between (no recovery, no worker)."""
    store = Store(db_url)
    _graph(store)
    for i in range(N - 1):
        store.finish("t", f"p-{i}", f"w{i}", 1, result=i)
    job = store.get("t", "child")
    assert (job.state, job.parents_pending) == ("WAITING_PARENTS", 1)
    store.finish("t", f"p-{N - 1}", f"w{N - 1}", 1, result=N - 1)
    job = store.get("t", "child")
    assert (job.state, job.parents_pending) == ("READY", 0)
    store.dispose()
