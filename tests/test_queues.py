"""Queues, handler routes, the tenant limit, pause/resume and depth (issue 27): the job store's
contract on PostgreSQL and SQLite (``db_url``), and the upgrade of tables made before queues.

The worker-process tests (two services on one database, ``--queues``, two processes racing
for a tenant's last place) are in tests/test_queues_process.py; the plans in
tests/test_query_plans.py.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import sqlalchemy as sa

from consumer.errors import JobError
from consumer.jobs.rows import Lease
from consumer.jobs.states import LEASED, READY
from consumer.jobs.store import QueueDepth, Store
from consumer.jobs.worker import Worker, WorkerConfig
from outbox.errors import ConfigError
from tests.services import wait_for


def test_enqueue_puts_jobs_in_the_default_queue_unless_given(db_url: str) -> None:
    store = Store(db_url)
    a = store.enqueue("t", "plain")
    b = store.enqueue("t", "mailed", queue="mail")
    c, d = store.enqueue_many(
        [{"tenant": "t", "action": "m1", "queue": "mail"}, {"tenant": "t", "action": "d1"}]
    )
    assert store.get(a.job_id).queue == "default"
    assert store.get(b.job_id).queue == "mail"
    assert (store.get(c.job_id).queue, store.get(d.job_id).queue) == ("mail", "default")
    for bad in ("", " ", "x" * 201, "a\x00b", 7):
        with pytest.raises(JobError) as info:
            store.enqueue("t", "bad", queue=bad)  # type: ignore[arg-type]
        assert info.value.field == "queue"
    with pytest.raises(JobError):
        store.enqueue_many([{"tenant": "t", "action": "bad", "queue": ""}])
    assert store.depth()["mail"].ready == 2  # nothing of the refused ones was written
    store.dispose()


def test_a_claim_takes_only_the_queues_it_is_given(db_url: str) -> None:
    store = Store(db_url)
    for i in range(5):
        store.enqueue("t", f"a-{i}", queue="alpha")
        store.enqueue("t", f"b-{i}", queue="beta")
        store.enqueue("u", f"c-{i}", queue="gamma")
    taken = store.claim_batch("w", 100, queues=["beta", "gamma"])
    assert {lease.queue for lease in taken} == {"beta", "gamma"}
    assert len(taken) == 10
    assert store.claim_batch("w", 100, queues=["beta"]) == []
    assert store.claim_batch("w", 100, queues=[]) == []
    rest = store.claim_batch("w", 100)  # None: every queue
    assert sorted(lease.action for lease in rest) == [f"a-{i}" for i in range(5)]
    with pytest.raises(JobError):
        store.claim_batch("w", 1, queues="alpha")  # one string, not a list
    store.dispose()


def test_fairness_between_tenants_holds_within_a_queue(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many([{"tenant": "big", "action": f"b-{i}", "queue": "q"} for i in range(200)])
    store.enqueue_many([{"tenant": "small", "action": f"s-{i}", "queue": "q"} for i in range(10)])
    store.enqueue_many([{"tenant": "small", "action": f"o-{i}"} for i in range(50)])  # default
    order = []
    for _ in range(20):
        batch = store.claim_batch("w", 1, queues=["q"])
        assert len(batch) == 1
        order.append(batch[0].tenant)
    assert order.count("small") == 10  # every small job within the first 20 claims
    store.dispose()


ROUTED = [
    # (kind, action, handler names, routed?) exactly as Worker.route decides
    (None, "send-quote-17", ["send-quote"], True),
    (None, "send-quote", ["send-quote"], True),
    (None, "send-quote:17", ["send-quote"], True),
    (None, "send-quote/17", ["send-quote"], True),
    (None, "send-quote.17", ["send-quote"], True),
    (None, "send-quote#17", ["send-quote"], True),
    (None, "send-quote_17", ["send-quote"], True),
    (None, "send-quotes-17", ["send-quote"], False),
    (None, "send-quote17", ["send-quote"], False),
    (None, "send", ["send-quote"], False),
    (None, "x-send-quote-1", ["send-quote"], False),
    ("send-invoice", "send-quote-17", ["send-quote"], False),  # the kind decides
    ("send-quote", "anything", ["send-quote"], True),
    (None, "a%b-1", ["a%b"], True),  # no LIKE: % and _ are plain characters
    (None, "axb-1", ["a_b"], False),
    (None, "ümlaut:1", ["ümlaut"], True),
]


def test_a_claim_takes_only_jobs_its_routes_run_exactly_as_worker_route(db_url: str) -> None:
    store = Store(db_url)
    for index, (kind, action, names, routed) in enumerate(ROUTED):
        tenant = f"t{index}"
        store.enqueue(tenant, action, kind=kind)
        worker = Worker(store)
        for name in names:
            worker.register(name, lambda job: None)
        probe = Lease(0, tenant, action, kind, None, None, None, None, 0, 1, "w", 0.0)
        assert (worker.route(probe) is not None) is routed, (kind, action, names)
        got = store.claim_batch(f"w{index}", 10, routes=names)
        assert [lease.action for lease in got if lease.tenant == tenant] == (
            [action] if routed else []
        ), (kind, action, names)
        assert all(lease.tenant == tenant for lease in got), "another case's job was taken"
    store.dispose()


def test_routes_agree_with_worker_route_on_random_actions(db_url: str) -> None:
    rng = random.Random(27)
    names = ["mail", "mail-digest", "bill", "a.b"]
    alphabet = ["mail", "bill", "a", "b", "-", ":", "/", ".", "#", "_", "x", "digest", "1"]
    store = Store(db_url)
    worker = Worker(store)
    for name in names:
        worker.register(name, lambda job: None)
    actions = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(300)}
    store.enqueue_many([{"tenant": "t", "action": action} for action in actions])
    claimed = {lease.action for lease in store.claim_batch("w", 1000, routes=names)}
    routed = {
        action
        for action in actions
        if worker.route(Lease(0, "t", action, None, None, None, None, None, 0, 1, "w", 0.0))
    }
    assert claimed == routed and routed and routed != actions
    store.dispose()


def test_a_paused_queue_is_not_claimed_and_resumes(db_url: str) -> None:
    store = Store(db_url)
    for i in range(3):
        store.enqueue("t", f"m-{i}", queue="mail")
        store.enqueue("t", f"d-{i}")
    assert store.pause_queue("mail") is True
    assert store.pause_queue("mail") is False  # idempotent
    assert store.paused_queues() == ["mail"]
    taken = store.claim_batch("w", 100)
    assert {lease.queue for lease in taken} == {"default"}
    assert store.claim_batch("w", 100, queues=["mail"]) == []
    depth = store.depth()
    assert depth["mail"].paused and depth["mail"].ready == 3 and not depth.get("default")
    assert store.resume_queue("mail") is True
    assert store.resume_queue("mail") is False
    assert store.paused_queues() == []
    assert len(store.claim_batch("w", 100, queues=["mail"])) == 3
    store.dispose()


def test_the_tenant_limit_caps_leased_jobs_per_tenant_across_workers(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue_many([{"tenant": "big", "action": f"b-{i}"} for i in range(20)])
    store.enqueue_many([{"tenant": "vip", "action": f"v-{i}"} for i in range(20)])
    store.enqueue_many([{"tenant": "small", "action": f"s-{i}"} for i in range(3)])
    limits = {"tenant_limit": 2, "tenant_limits": {"vip": 5}}
    first = store.claim_batch("w1", 4, **limits)  # type: ignore[arg-type]
    second = store.claim_batch("w2", 100, **limits)  # type: ignore[arg-type]
    third = store.claim_batch("w3", 100, **limits)  # type: ignore[arg-type]

    def leased(tenant: str) -> int:
        return sum(
            1 for batch in (first, second, third) for lease in batch if lease.tenant == tenant
        )

    assert (leased("big"), leased("vip"), leased("small")) == (2, 5, 2)
    assert third == []  # everyone at the limit: nothing more, the jobs stay READY
    assert store.get("big", "b-19").state == READY
    assert store.get("big", "b-19").lease_owner is None
    assert store.waiting_on_tenant_limit(**limits) == 18 + 15 + 1  # type: ignore[arg-type]
    # A finished job frees one place for its tenant, and only one.
    store.finish(next(lease for lease in first + second if lease.tenant == "big"))
    again = store.claim_batch("w3", 100, **limits)  # type: ignore[arg-type]
    assert [lease.tenant for lease in again] == ["big"]
    # Without a limit the same claim takes everything that is left.
    assert len(store.claim_batch("w4", 100)) == 17 + 15 + 1
    store.dispose()


def test_every_claim_path_honours_the_tenant_limit_and_a_paused_queue(db_url: str) -> None:
    """``claim`` of one named job and ``claim_next`` count the same LEASED jobs as the batch
    claims (whoever leased them), and none of them takes from a paused queue."""
    store = Store(db_url)
    store.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(6)])
    assert len(store.claim_batch("w1", 2, tenant_limit=3)) == 2  # t: 2 (a-0, a-1)
    store.enqueue_many([{"tenant": "u", "action": f"u-{i}"} for i in range(2)])
    store.enqueue_many([{"tenant": "t", "action": f"m-{i}", "queue": "mail"} for i in range(2)])
    assert store.claim("t", "a-5", "w2", tenant_limit=3) is not None  # t: 3, the limit
    assert store.claim("t", "a-4", "w2", tenant_limit=3) is None  # refused: at its limit
    assert store.get("t", "a-4").state == READY and store.get("t", "a-4").attempts == 0
    assert store.claim("t", "a-4", "w2", tenant_limits={"t": 4}) == 1  # an override
    assert store.claim("t", "a-3", "w2", tenant_limit=9, tenant_limits={"t": 4}) is None
    assert store.claim("t", "m-0", "w2", tenant_limit=1) == 1  # counted within its queue
    assert store.claim("u", "u-0", "w2", tenant_limit=1) == 1  # another tenant has its own
    assert store.claim_next("w3", tenant_limit=1, queues=["default"]) is None  # t, u full
    lease = store.claim_next("w3", tenant_limit=2, queues=["default"])
    assert lease is not None and lease.tenant == "u"
    assert store.claim("t", "a-3", "w2") == 1  # no limit given: no limit
    with pytest.raises(JobError):
        store.claim("t", "a-2", "w2", tenant_limit=0)
    # A paused queue: no claim path takes from it.
    store.pause_queue("mail")
    assert store.claim("t", "m-1", "w2") is None
    assert store.claim_next("w3", queues=["mail"]) is None
    store.resume_queue("mail")
    assert store.claim("t", "m-1", "w2") == 1
    # A takeover of an expired lease does not add to the tenant's count: not refused.
    clock = store.get("t", "a-5").lease_expires_at
    assert clock is not None
    assert store.claim("t", "a-5", "w4", now=clock + 1, tenant_limit=1) == 2
    store.dispose()


def test_the_tenant_limit_counts_within_a_queue(db_url: str) -> None:
    store = Store(db_url)
    for queue in ("a", "b"):
        store.enqueue_many(
            [{"tenant": "t", "action": f"{queue}-{i}", "queue": queue} for i in range(5)]
        )
    taken = store.claim_batch("w", 100, tenant_limit=2)
    assert sorted(lease.queue for lease in taken) == ["a", "a", "b", "b"]
    store.dispose()


def test_bad_limits_are_refused_before_anything_is_claimed(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "x")
    for kwargs in (
        {"tenant_limit": 0},
        {"tenant_limit": True},
        {"tenant_limits": {"t": 0}},
        {"tenant_limits": {"": 1}},
        {"tenant_limits": ["t"]},
    ):
        with pytest.raises(JobError):
            store.claim_batch("w", 1, **kwargs)  # type: ignore[arg-type]
    assert store.counts()[READY] == 1
    store.dispose()


def test_depth_counts_ready_jobs_and_the_oldest_eligible_age_per_queue(db_url: str) -> None:
    store = Store(db_url)
    store.enqueue("t", "m1", queue="mail", now=1000)
    store.enqueue("t", "m2", queue="mail", now=1010)
    store.enqueue("t", "later", queue="mail", run_after=4_000_000_000, now=1020)
    store.enqueue("t", "d1", now=5000)
    store.enqueue("t", "done", queue="done-only")
    store.finish(store.claim_batch("w", 1, queues=["done-only"])[0])
    store.enqueue("t", "leased", queue="busy")
    store.claim_batch("w", 1, queues=["busy"])
    depth = store.depth()
    assert sorted(depth) == ["default", "mail"]  # no READY job: no entry
    mail = depth["mail"]
    assert isinstance(mail, QueueDepth)
    assert mail.ready == 3  # the scheduled one is READY too
    with store.driver.connect() as conn:
        now = store.driver.clock_read(conn, None)
    assert abs(mail.oldest_ready_age_seconds - (now - 1000)) < 60  # m1, the oldest eligible
    assert mail["ready"] == 3 and mail.as_dict()["queue"] == "mail"
    only = store.depth("busy")
    assert only == {"busy": QueueDepth("busy", 0, 0.0)}
    assert list(store.depth("mail")) == ["mail"] and store.depth("mail")["mail"].ready == 3
    with pytest.raises(JobError):
        store.depth("")
    store.dispose()


def test_worker_config_validates_queues_and_limits() -> None:
    config = WorkerConfig(queues=["mail", "bill", "mail"], tenant_limit=3, tenant_limits={"a": 1})
    assert config.queues == ("mail", "bill")
    for bad in (
        {"queues": "mail"},
        {"queues": []},
        {"queues": [""]},
        {"tenant_limit": 0},
        {"tenant_limit": "3"},
        {"tenant_limits": {"a": 0}},
        {"tenant_limits": {"": 2}},
    ):
        with pytest.raises(ConfigError) as info:
            WorkerConfig(**bad)  # type: ignore[arg-type]
        assert info.value.setting == next(iter(bad))
    worker = Worker(Store(), queues=["x"], tenant_limit=2)
    assert worker.config.queues == ("x",) and worker.config.tenant_limit == 2


def test_per_queue_slots_are_reserved_out_of_concurrency() -> None:
    from consumer.jobs.cli import queue_names
    from consumer.jobs.config import QueueSlots

    mapped = WorkerConfig(queues={"mail": 8, "billing": 4})
    assert mapped.queues == ("mail", "billing") and mapped.queue_slots == {"mail": 8, "billing": 4}
    assert mapped.slot_pools() == (QueueSlots(("mail",), 8), QueueSlots(("billing",), 4))
    assert mapped.slots == 12  # every queue has its own: the process never has more in flight
    mixed = WorkerConfig(
        concurrency=16, queues=["mail", "billing", "reports"], queue_slots={"mail": 6}
    )
    assert mixed.slot_pools() == (
        QueueSlots(("mail",), 6),
        QueueSlots(("billing", "reports"), 10),  # the rest, shared
    )
    assert WorkerConfig(concurrency=5).slot_pools() == (QueueSlots(None, 5),)
    # A mapping sets both (None: shares the rest), also through replace().
    again = replace(mapped, queues={"mail": None, "sms": 2})
    assert again.queue_slots == {"sms": 2}
    assert again.slot_pools() == (QueueSlots(("sms",), 2), QueueSlots(("mail",), 254))
    for bad, setting in (
        ({"queue_slots": {"mail": 2}}, "queue_slots"),  # no queues named: every queue shares
        ({"queues": ["a"], "queue_slots": {"b": 2}}, "queue_slots"),  # not one of the queues
        ({"queues": {"a": 0}}, "queues"),
        ({"queues": {"a": "3"}}, "queues"),
        ({"queues": ["a"], "queue_slots": {"a": True}}, "queue_slots"),
        ({"concurrency": 4, "queues": {"a": 3, "b": 2}}, "queue_slots"),  # 5 > 4
        ({"concurrency": 4, "queues": {"a": 4, "b": None}}, "queue_slots"),  # none left for b
    ):
        with pytest.raises(ConfigError) as info:
            WorkerConfig(**bad)  # type: ignore[arg-type]
        assert info.value.setting == setting, bad
    # --queues / OUTBOX_QUEUES
    assert queue_names("mail,billing") == ["mail", "billing"]
    assert queue_names("mail=8, billing") == {"mail": 8, "billing": None}
    for raw in ("mail=0", "mail=x", "=3", "mail=8,,b", "mail=-1"):
        with pytest.raises(ValueError):
            queue_names(raw)


def test_a_worker_claims_only_what_its_handlers_run_and_leaves_the_rest_ready(
    db_url: str,
) -> None:
    store = Store(db_url)
    for i in range(5):
        store.enqueue("t", f"send-invoice-{i}")
        store.enqueue("t", f"send-quote-{i}")
        store.enqueue("t", f"other-{i}", kind="send-invoice", queue="elsewhere")
    seen: list[str] = []
    worker = Worker(store, batch_size=100, queues=["default"])
    worker.register("send-invoice", lambda job: seen.append(job.action))
    while worker.run_once():
        pass
    assert sorted(seen) == [f"send-invoice-{i}" for i in range(5)]
    counts = store.counts()
    assert counts["WAITING_REVIEW"] == 0 and counts[READY] == 10
    assert store.depth()["default"].ready == 5 and store.depth()["elsewhere"].ready == 5
    store.dispose()


def test_hooks_say_which_job_started_and_finished(db_url: str) -> None:
    from outbox.hooks import Hooks

    calls: list[tuple[str, dict[str, object]]] = []

    class Recorder(Hooks):
        def worker_job_started(self, action: str, **facts: object) -> None:  # type: ignore[override]
            calls.append(("started", {"action": action, **facts}))

        def worker_job_finished(  # type: ignore[override]
            self, action: str, outcome: str, duration_seconds: float, **facts: object
        ) -> None:
            calls.append(("finished", {"action": action, "outcome": outcome, **facts}))

    store = Store(db_url)
    job = store.enqueue("t", "mail-1", queue="mail", kind="mail", now=1234.5)
    worker = Worker(store, hooks=Recorder())
    worker.register("mail", lambda ctx: None)
    assert worker.run_once() == 1
    facts = {"job_id": job.job_id, "queue": "mail", "kind": "mail", "enqueued_at": 1234.5}
    assert calls == [
        ("started", {"action": "mail", **facts}),
        ("finished", {"action": "mail", "outcome": "done", **facts}),
    ]
    store.dispose()


def test_a_running_worker_keeps_each_queue_within_its_slots(db_url: str) -> None:
    """``Worker.run`` with ``queues={"mail": 1, "bulk": None}`` and 3 slots: mail has one
    slot of its own, bulk the other 2; the ``worker_queue_slots`` hook reports each group and
    never more busy than its slots (the process test, tests/test_queues_process.py, checks
    the leases in the database with a queue whose jobs hold their slots)."""
    import threading

    from outbox.hooks import Hooks

    seen: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    class Recorder(Hooks):
        def worker_queue_slots(self, queue: str, busy: int, total: int) -> None:
            with lock:
                seen.append((queue, busy, total))

    store = Store(db_url)
    store.enqueue_many([{"tenant": "t", "action": f"send-m{i}", "queue": "mail"} for i in range(6)])
    store.enqueue_many([{"tenant": "t", "action": f"send-b{i}", "queue": "bulk"} for i in range(6)])
    store.enqueue_many(
        [{"tenant": "t", "action": f"send-x{i}", "queue": "other"} for i in range(2)]
    )
    running: dict[str, int] = {"mail": 0, "bulk": 0}
    most = dict(running)

    def send(job: object) -> None:
        queue = job.lease.queue  # type: ignore[attr-defined]
        with lock:
            running[queue] += 1
            most[queue] = max(most[queue], running[queue])
        time.sleep(0.02)  # the scenario: the handler's work, other jobs overlap it meanwhile
        with lock:
            running[queue] -= 1

    worker = Worker(
        store, hooks=Recorder(), concurrency=3, queues={"mail": 1, "bulk": None}, poll_interval=0.05
    )
    worker.register("send", send)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    try:
        wait_for(lambda: store.counts()["DONE"] >= 12, "the 12 jobs DONE", 60)
    finally:
        worker.stop()
        thread.join(30)
    assert store.counts()["DONE"] == 12
    assert store.depth("other")["other"].ready == 2  # a queue the worker does not serve
    assert most["mail"] == 1 and most["bulk"] <= 2
    assert {(queue, total) for queue, _, total in seen} == {("mail", 1), ("*", 2)}
    assert all(0 <= busy <= total for _, busy, total in seen)
    assert ("mail", 1, 1) in seen and ("*", 0, 2) in seen
    store.dispose()


def test_prometheus_hooks_observe_the_new_hook_arguments() -> None:
    from prometheus_client import CollectorRegistry

    from metrics.hooks import PrometheusHooks

    registry = CollectorRegistry()
    hooks = PrometheusHooks(registry, max_queue_labels=2)
    for queue in ("a", "b", "c", "d"):
        hooks.worker_job_started("mail", job_id=1, queue=queue, kind=None, enqueued_at=0.0)
        hooks.worker_job_finished("mail", "done", 0.1, job_id=1, queue=queue, enqueued_at=0.0)
    hooks.worker_job_finished("mail", "done", 0.1)  # an older caller: still counted
    hooks.worker_tenant_limit_waiting(7)
    started = {
        s.labels["queue"]: s.value
        for m in registry.collect()
        if m.name == "outbox_worker_jobs_started"
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert started == {"a": 1.0, "b": 1.0, "other": 2.0}
    assert registry.get_sample_value("outbox_worker_jobs_waiting_tenant_limit") == 7.0
    assert (
        registry.get_sample_value(
            "outbox_worker_jobs_finished_total", {"action": "mail", "outcome": "done"}
        )
        == 5.0
    )


# -- the upgrade of tables made before queues ------------------------------------------------

OLD_JOBS_DDL = """
CREATE TABLE outbox_jobs (
    id {id}, tenant VARCHAR(200) NOT NULL, action VARCHAR(200) NOT NULL,
    kind VARCHAR(200), subject VARCHAR(200), subject_version VARCHAR(200), payload {json},
    provider VARCHAR(200), state VARCHAR(24) DEFAULT 'READY' NOT NULL,
    priority INTEGER DEFAULT 0 NOT NULL, run_after FLOAT, attempts INTEGER DEFAULT 0 NOT NULL,
    auth_failures INTEGER DEFAULT 0 NOT NULL, first_failed_at FLOAT, last_error TEXT,
    wait_reason TEXT, lease_owner VARCHAR(200), lease_expires_at FLOAT,
    lease_epoch BIGINT DEFAULT 0 NOT NULL, timer_scheduled_for FLOAT, timer_reason TEXT,
    timer_subject_version VARCHAR(200), timer_cancellation_condition {json},
    created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL,
    CONSTRAINT uq_outbox_jobs_tenant_action UNIQUE (tenant, action)
)"""


def make_old_jobs_table(engine: sa.Engine) -> None:
    """The job table as it was before queues: no queue column, the READY index on tenant."""
    pg = engine.dialect.name == "postgresql"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                OLD_JOBS_DDL.format(
                    id="BIGSERIAL PRIMARY KEY" if pg else "INTEGER PRIMARY KEY AUTOINCREMENT",
                    json="JSONB" if pg else "JSON",
                )
            )
        )
        conn.execute(
            sa.text(
                "CREATE INDEX ix_outbox_jobs_ready ON outbox_jobs (tenant, priority DESC, id) "
                "WHERE state = 'READY'"
            )
        )
        for i in range(3):
            conn.execute(
                sa.text(
                    "INSERT INTO outbox_jobs (tenant, action, created_at, updated_at) "
                    "VALUES ('old', :a, 1, 1)"
                ),
                {"a": f"send-{i}"},
            )


def test_a_table_made_before_queues_is_upgraded_at_start(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    make_old_jobs_table(engine)
    store = Store(db_url)  # what `outbox-worker init-db` and every worker start run
    Store(db_url).dispose()  # and again: idempotent
    indexes = {i["name"]: i for i in sa.inspect(engine).get_indexes("outbox_jobs")}
    assert indexes["ix_outbox_jobs_ready"]["column_names"][:2] == ["queue", "tenant"]
    assert "ix_outbox_jobs_leased_tenant" in indexes
    assert list(store.depth()) == ["default"]
    assert store.depth()["default"].ready == 3
    taken = store.claim_batch("w", 10, queues=["default"], routes=["send"], tenant_limit=2)
    assert sorted(lease.action for lease in taken) == ["send-0", "send-1"]
    assert all(lease.queue == "default" for lease in taken)
    assert store.get("old", "send-0").state == LEASED
    store.pause_queue("default")
    assert store.claim_batch("w", 10) == []
    store.dispose()
    engine.dispose()
