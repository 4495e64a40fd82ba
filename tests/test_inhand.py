"""consumer.jobs.inhand: the jobs a worker holds, and the heartbeat that renews them.

A lease taken over by another worker (it expired while the handler made no progress) is
marked lost at the next beat, so the handler's moves are refused from then on."""

from __future__ import annotations

from consumer import Store
from consumer.jobs.context import JobContext
from consumer.jobs.inhand import JobsInHand
from outbox.lifecycle import GracefulStop
from tests.services import wait_for


def test_a_lease_taken_over_is_marked_lost_at_the_next_beat(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    store.enqueue("t", "a")
    (lease,) = store.claim_batch("w", 1, 0.2)
    # The lease expires, recovery puts the job back, another worker takes it.
    wait_for(lambda: store.recover().requeued == 1, "the lease to expire", 30)
    thief = store.claim_next("thief", ttl=30)
    assert thief is not None
    assert thief.job_id == lease.job_id and thief.epoch == lease.epoch + 1
    stop = GracefulStop()
    in_hand = JobsInHand(store, ttl=0.3, name="w", stop=stop)
    ctx = JobContext(store, lease)
    ctx.started()
    ctx.progress()  # due for renewal: the renewal is refused (fenced)
    in_hand.add(ctx)
    try:
        wait_for(lambda: ctx.lost, "the heartbeat to find the lease lost", 30)
        assert in_hand.holds(ctx.job_id) and len(in_hand) == 1
    finally:
        stop.stop()
        in_hand.remove(ctx.job_id)
    assert store.get("t", "a").state == "LEASED"  # the thief's, untouched
    store.dispose()
