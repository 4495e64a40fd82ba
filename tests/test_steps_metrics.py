"""Steps in the metrics (issue 57), on PostgreSQL and SQLite: ``outbox_jobs`` counts
WAITING_PARENTS like every open state, and ``outbox_unreleased_steps`` shows a step whose
parent ended without releasing it until a worker's recovery applies it (the one path that
leaves an edge for later: a lease claimed before the step was enqueued after it)."""

from __future__ import annotations

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from consumer import Store
from metrics import build_metrics


def _scrape(engine: sa.Engine) -> CollectorRegistry:
    return build_metrics(engine=engine, cache_seconds=0).registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_waiting_parents_and_an_unreleased_step_are_exported(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many(
        [
            {"tenant": "t", "action": "a"},
            {"tenant": "t", "action": "b", "after": [("t", "a")]},
            {"tenant": "t", "action": "c", "after": [("t", "a"), ("t", "b")]},
            {"tenant": "t", "action": "runs"},
        ]
    )
    [lease] = [x for x in store.claim_batch("w", 4) if x.action == "runs"]
    assert lease.children == 0
    store.enqueue("t", "late", after=[("t", "runs")])  # enqueued while its parent runs
    registry = _scrape(store.engine)
    assert _value(registry, "outbox_jobs", state="WAITING_PARENTS") == 3.0
    assert _value(registry, "outbox_unreleased_steps") == 0.0
    assert _value(registry, "outbox_oldest_unreleased_step_age_seconds") == 0.0
    assert _value(registry, "outbox_metrics_source_up", source="steps") == 1.0

    result = store.finish_batch([lease])  # the plain path: nothing released
    assert result.done == [lease.job_id]
    registry = _scrape(store.engine)
    assert _value(registry, "outbox_unreleased_steps") == 1.0
    age = _value(registry, "outbox_oldest_unreleased_step_age_seconds")
    assert age is not None and 0.0 <= age < 600.0
    with store.engine.begin() as conn:  # the parent ended an hour ago
        conn.execute(
            sa.text("UPDATE outbox_jobs SET updated_at = updated_at - 3600 WHERE action = 'runs'")
        )
    age = _value(_scrape(store.engine), "outbox_oldest_unreleased_step_age_seconds")
    assert age is not None and age >= 3600.0

    store.recover()  # what every worker runs each recover_interval
    registry = _scrape(store.engine)
    assert _value(registry, "outbox_unreleased_steps") == 0.0
    assert _value(registry, "outbox_oldest_unreleased_step_age_seconds") == 0.0
    assert store.get("t", "late").state == "READY"
    assert _value(registry, "outbox_jobs", state="WAITING_PARENTS") == 2.0
    store.dispose()


def test_a_failed_parents_dependents_leave_waiting_parents(db_url: str) -> None:
    """A parked dependent is WAITING_REVIEW (counted there), not an unreleased step."""
    store = Store(db_url)
    store.enqueue_many(
        [{"tenant": "t", "action": "a"}, {"tenant": "t", "action": "b", "after": [("t", "a")]}]
    )
    epoch = store.claim("t", "a", "w")
    assert epoch is not None
    assert store.fail("t", "a", "w", epoch, error="refused", kind="permanent") == "WAITING_REVIEW"
    registry = _scrape(store.engine)
    assert _value(registry, "outbox_jobs", state="WAITING_PARENTS") == 0.0
    assert _value(registry, "outbox_jobs", state="WAITING_REVIEW") == 2.0
    assert _value(registry, "outbox_unreleased_steps") == 0.0
    store.dispose()
