"""consumer.jobs.runner and consumer.jobs.worker: what the user builds is frozen once it runs.

A ``Worker`` takes its handlers, providers and config until it runs; its first
``run_once`` builds the :class:`~consumer.jobs.runner.Runner` that owns the running state,
and from then on nothing it was built from can be swapped. ``Worker.bound`` makes the worker
the ``outbox-worker`` command runs: the same handlers, the store, config and hooks given."""

from __future__ import annotations

from dataclasses import replace

import pytest

from consumer import Store, Worker, WorkerConfig
from outbox.errors import ConfigError
from outbox.hooks import Hooks


def test_a_worker_is_frozen_once_it_runs(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    worker = Worker(store)
    worker.register("send", lambda job: None)
    worker.config = replace(worker.config, ttl=12.0)  # before it runs: the user's to change
    store.enqueue("t", "send-1")
    assert worker.run_once() == 1
    assert worker.runner.config.ttl == 12.0
    for name, value in (("config", WorkerConfig()), ("store", store), ("hooks", Hooks())):
        with pytest.raises(ConfigError) as raised:
            setattr(worker, name, value)
        assert raised.value.setting == name
    with pytest.raises(ConfigError):
        worker.register("other", lambda job: None)
    store.dispose()


def test_bound_makes_a_new_worker_with_the_same_handlers(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    ran: list[str] = []
    built = Worker()  # no store: the command line binds one
    built.register("send", lambda job: ran.append(job.action))
    hooks = Hooks()
    worker = built.bound(store=store, config=WorkerConfig(ttl=9.0), hooks=hooks)
    assert built.store is None and built.config.ttl == 30.0  # the user's worker as it was
    assert worker.store is store and worker.config.ttl == 9.0 and worker.hooks is hooks
    store.enqueue("t", "send-1")
    assert worker.run_once() == 1 and ran == ["send-1"]
    with pytest.raises(ConfigError) as raised:
        built.run_once()  # still no store
    assert raised.value.setting == "store"
    store.dispose()


def test_the_duties_are_the_runners(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    worker = Worker(store, recover_interval=7.0)
    assert worker.recovery is worker.runner.duties.recovery
    assert worker.recovery.interval.seconds == 7.0
    assert worker.recovery.run_once() is False  # nothing to recover
    assert worker.retention is worker.runner.duties.retention
    assert worker.beat().requeued == 0
    store.dispose()
