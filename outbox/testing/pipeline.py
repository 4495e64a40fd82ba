"""The whole loop in one object, run inline: outbox -> relay -> consumers -> workers.

:class:`Pipeline` builds the real parts (``Outbox``, ``relay.Relay``, ``consumer.Consumer``,
``consumer.Worker`` on a ``consumer.Store``) on a database and a Redis of the test's own, and
:meth:`Pipeline.drain` steps them with their ``run_once`` in that order, cycle after cycle,
until nothing moves. No thread of its own, no sleep: what a test sees after ``drain()`` is
what the processes would have done by then, with the pipeline's :class:`~outbox.testing.
clock.Clock` standing in for time.

Where it runs:

- the embedded default (``Pipeline(directory)``): a SQLite file and an embedded Redis server
  in ``directory`` (the test's ``tmp_path``), both private to the test;
- your servers (``database_url=`` PostgreSQL, ``redis_url=``): a schema of its own
  (``outbox_test_<random>``, selected by the connection's ``search_path``), dropped by
  :meth:`Pipeline.close`, and stream keys under a prefix of its own, deleted too, so tests
  can run in parallel on one database and one Redis.

Kill points (:meth:`Pipeline.kill_at`) stop the pipeline the way SIGKILL stops a worker:
after it claimed a job (``after_claim``), after it persisted an operation intent and before
the provider is called (``after_intent``), or after the provider accepted and before the
receipt is written (``after_accepted``). Nothing after the point runs; :meth:`Pipeline.
restart` starts new processes, and the database and the provider keep what happened.

The pipeline's parts live beside it: :mod:`outbox.testing.services` opens the database and
the Redis it runs on, :mod:`outbox.testing.drain` is :meth:`Pipeline.drain` with its
:class:`DrainResult`, and :mod:`outbox.testing.asserts` the assertions; this module keeps
its public names (``Pipeline``, ``DrainResult``, ``DrainError``, ``Killed``,
``KILL_POINTS``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from consumer import Consumer, ConsumerConfig, Operations, Store, Worker, WorkerConfig
from consumer.jobs.operations import Provider
from consumer.jobs.retention import JobRetentionConfig
from outbox.core import Outbox
from outbox.errors import ConfigError
from outbox.hooks import Hooks
from outbox.testing.asserts import Assertions
from outbox.testing.clock import Clock
from outbox.testing.drain import DEFAULT_MAX_CYCLES as DEFAULT_MAX_CYCLES
from outbox.testing.drain import (
    KILL_POINTS,
    CountingHooks,
    DrainError,
    Draining,
    DrainResult,
    Killed,
)
from outbox.testing.fake import FakeProvider
from outbox.testing.services import open_database, open_redis
from relay.config import RelayConfig
from relay.redis.publisher import RedisStreamPublisher
from relay.relay import Relay


class _Watched:
    """A provider as the pipeline's workers see it: the user's (or a fake), with the kill
    points around its call and the reconciliations it makes counted."""

    def __init__(self, inner: Provider, pipeline: Pipeline) -> None:
        self.inner = inner
        self.pipeline = pipeline
        self.name = inner.name
        self.supports_lookup = inner.supports_lookup
        self.supports_idempotency = inner.supports_idempotency

    def __getattr__(self, name: str) -> Any:  # timeout, rate_limit, ...: the provider's own
        return getattr(self.inner, name)

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        self.pipeline._reach("after_intent", operation_id)
        ref = self.inner.send(request, operation_id=operation_id, idempotency_key=idempotency_key)
        self.pipeline._reach("after_accepted", operation_id)
        return ref

    def lookup(self, operation_id: str) -> str | None:
        found = self.inner.lookup(operation_id)
        if found is not None:
            self.pipeline._reconciled.add(operation_id)
        return found


@dataclass
class _ConsumerSpec:
    group: str
    handlers: dict[str, tuple[Callable[..., Any], bool]]
    streams: list[str]
    config: ConsumerConfig
    hooks: Hooks | None
    users: Consumer | None = None  # a Consumer the user built: copied, handlers and all


@dataclass
class _WorkerSpec:
    handlers: dict[str, Callable[..., Any]]
    providers: dict[str, Provider]
    config: WorkerConfig
    hooks: Hooks | None
    default_timeout: float


class Pipeline(Draining, Assertions):
    """The real pipeline for one test (module docstring).

    ``directory``: where the embedded default keeps its SQLite file and Redis data (the
    test's ``tmp_path``); needed unless both ``database_url`` and ``redis_url`` are given.
    ``database_url``: a PostgreSQL URL (a schema of the pipeline's own is made in it) or a
    SQLite URL (used as is). ``redis_url``: a Redis server shared with others (keys under a
    prefix of the pipeline's own). ``stream``: the stream template (``{topic}``).
    ``seed``: the pipeline's randomness (:attr:`random`: the jobs' retry backoff jitter, the
    relay's, the fake providers' random faults) comes from ``random.Random(seed)``, so the
    same test gives the same result run after run; ``None`` seeds it from the system.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        database_url: str | None = None,
        redis_url: str | None = None,
        stream: str = "outbox.{topic}",
        relay_config: RelayConfig | None = None,
        seed: int | None = 0,
    ) -> None:
        if directory is None and (database_url is None or redis_url is None):
            raise ConfigError(
                "directory", "the embedded database and Redis need a directory (tmp_path)"
            )
        self.directory = None if directory is None else os.fspath(directory)
        self.clock = Clock()
        self.seed = seed
        self.random = random.Random(seed)
        self.token = uuid.uuid4().hex[:10]
        self._closers: list[Callable[[], None]] = []
        try:
            self.engine, self.database_url = open_database(
                database_url, directory=self.directory, token=self.token, closers=self._closers
            )
            self.redis, self.prefix = open_redis(
                redis_url, directory=self.directory, token=self.token, closers=self._closers
            )
            self.stream_template = self.prefix + stream
            self.outbox = Outbox(self.engine)
            self.outbox.create_schema()
            self.store = Store(self.engine, clock=self.clock, rng=self.random)
            self._relay_config = replace(
                relay_config or RelayConfig(), listen=False, name_prefix=f"{self.prefix}relay"
            )
            self.relay = self._new_relay()
        except BaseException:
            self.close()
            raise
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self._consumer_specs: list[_ConsumerSpec] = []
        self._worker_specs: list[_WorkerSpec] = []
        self.consumers: list[Consumer] = []
        self.workers: list[Worker] = []
        self.fakes: list[FakeProvider] = []
        self._kills: list[str] = []
        self._reconciled: set[str] = set()
        self._dead = False
        self._closed = False
        self._relay_offset = 0.0  # how much of the clock's advance the relay's rows have seen

    # -- where it runs (outbox.testing.services) --------------------------------------------

    def close(self) -> None:
        """Stop the workers' threads, drop the schema (PostgreSQL), delete the stream keys
        (shared Redis) or stop the embedded Redis, and dispose of the engines."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for worker in getattr(self, "workers", []):
            worker.stop()
        for fake in getattr(self, "fakes", []):
            fake.close()
        relay = getattr(self, "relay", None)
        if relay is not None:
            relay.store.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.dispose()
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):
                closer()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, topic: str) -> str:
        """The stream name of ``topic`` in this pipeline."""
        return self.stream_template.format(topic=topic)

    # -- the parts --------------------------------------------------------------------------

    def _new_relay(self) -> Relay:
        publisher = RedisStreamPublisher(self.redis, self.stream_template)
        return Relay(
            self.outbox,
            publisher,
            self._relay_config,
            name=f"{self.prefix}relay-{uuid.uuid4().hex[:6]}",
            rng=self.random,
        )

    def consumer(
        self,
        group_or_consumer: str | Consumer,
        handlers: Mapping[str, Callable[..., Any]] | None = None,
        *,
        topics: Sequence[str] | None = None,
        batch: Iterable[str] = (),
        config: ConsumerConfig | None = None,
        hooks: Hooks | None = None,
    ) -> Consumer:
        """A consumer run by ``drain()``: ``consumer("billing", {"quote.approved": fn})``
        (``fn(event, tx)``; topics are the handlers' unless ``topics`` says; ``batch`` names
        the topics whose handler takes the batch's list of events), or a ``Consumer`` you
        built, whose group, streams, handlers, config and hooks are kept."""
        if isinstance(group_or_consumer, Consumer):
            user = group_or_consumer
            if handlers is not None:
                raise ConfigError("handlers", "a Consumer brings its own handlers")
            spec = _ConsumerSpec(
                group=user.group,
                handlers={},
                streams=[self.prefix + name for name in user.streams],
                config=config or user.config,
                hooks=hooks or user.hooks,
                users=user,
            )
        else:
            if not handlers:
                raise ConfigError("handlers", "give the consumer at least one handler")
            batched = set(batch)
            names = list(topics) if topics is not None else list(handlers)
            spec = _ConsumerSpec(
                group=group_or_consumer,
                handlers={t: (fn, t in batched) for t, fn in handlers.items()},
                streams=[self.stream(t) for t in names],
                config=config or ConsumerConfig(),
                hooks=hooks,
            )
        spec.config = replace(
            spec.config,
            block_ms=1,
            name_prefix=f"{self.prefix}{spec.config.name_prefix}",
            create_schema=True,
        )
        self._consumer_specs.append(spec)
        made = self._make_consumer(spec)
        self.consumers.append(made)
        return made

    def _make_consumer(self, spec: _ConsumerSpec) -> Consumer:
        hooks = CountingHooks(self.counts, spec.hooks)
        if spec.users is not None:
            # The public copy (what the CLI's flags do): the same handlers, our database,
            # Redis, config and hooks; the streams under the pipeline's prefix.
            made = spec.users.with_overrides(
                database=self.engine,
                redis=self.redis,
                config=spec.config,
                hooks=hooks,
                streams=spec.streams,
            )
        else:
            made = Consumer(
                self.engine,
                self.redis,
                group=spec.group,
                streams=spec.streams,
                config=spec.config,
                hooks=hooks,
            )
        made.vacuum = None  # no background vacuum thread: drain() is all there is
        for topic, (fn, batch) in spec.handlers.items():
            made.add_handler(topic, fn, batch=batch)
        return made

    def worker(
        self,
        handlers_or_worker: Mapping[str, Callable[..., Any]] | Worker,
        *,
        providers: Mapping[str, Provider] | None = None,
        config: WorkerConfig | None = None,
        hooks: Hooks | None = None,
        default_timeout: float = 30.0,
    ) -> Worker:
        """A worker run by ``drain()`` on the pipeline's store: ``worker({"send-quote":
        send_quote}, providers={"mail": mail})``, or a ``Worker`` you built (its handlers,
        providers, config, hooks and default timeout are kept, its store is not)."""
        if isinstance(handlers_or_worker, Worker):
            user = handlers_or_worker
            spec = _WorkerSpec(
                handlers=dict(user.handlers),
                providers={**user.providers, **(providers or {})},
                config=config or user.config,
                hooks=hooks or user.hooks,
                default_timeout=user.default_timeout,
            )
        else:
            if not handlers_or_worker:
                raise ConfigError("handlers", "give the worker at least one handler")
            spec = _WorkerSpec(
                handlers=dict(handlers_or_worker),
                providers=dict(providers or {}),
                # Claims of 100: fewer drain cycles for a big test; nothing else changes.
                config=config or WorkerConfig(batch_size=100),
                hooks=hooks,
                default_timeout=default_timeout,
            )
        self._worker_specs.append(spec)
        made = self._make_worker(spec)
        self.workers.append(made)
        return made

    def _make_worker(self, spec: _WorkerSpec) -> Worker:
        number = len(self.workers) + 1
        config = replace(
            spec.config,
            name=f"{self.prefix}worker-{number}-{uuid.uuid4().hex[:6]}",
            vacuum_interval=0,  # no background duties: drain() is all there is
            retention=replace(spec.config.retention, purge_interval=0)
            if isinstance(spec.config.retention, JobRetentionConfig)
            else spec.config.retention,
        )
        made = Worker(
            self.store,
            config=config,
            hooks=CountingHooks(self.counts, spec.hooks),
            providers={name: _Watched(p, self) for name, p in spec.providers.items()},
            default_timeout=spec.default_timeout,
        )
        made.heartbeat = False  # no thread renewing leases behind the test's back
        for name, fn in spec.handlers.items():
            made.register(name, self._watched_handler(fn))
        return made

    def _watched_handler(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            async def run_async(job: Any) -> Any:
                self._reach("after_claim", job.action)
                return await fn(job)

            return run_async

        def run(job: Any) -> Any:
            self._reach("after_claim", job.action)
            return fn(job)

        return run

    def fake_provider(
        self,
        name: str = "mail",
        *,
        lookup: bool = True,
        idempotency: bool = True,
        timeout: float = 5.0,
    ) -> FakeProvider:
        """A :class:`~outbox.testing.fake.FakeProvider` on the pipeline's clock (its slow and
        late answers spend test time); pass it to :meth:`worker` in ``providers``."""
        fake = FakeProvider(
            name,
            lookup=lookup,
            idempotency=idempotency,
            timeout=timeout,
            clock=self.clock,
            advance=self.clock.advance,
        )
        fake.simulator.set_faults({"faults": [], "seed": self.random.random()})
        self.fakes.append(fake)
        return fake

    @property
    def operations(self) -> Operations:
        """Operation receipts of the pipeline's store (``receipts()``, ``settle()``), with the
        providers of every worker."""
        providers: dict[str, Provider] = {}
        for spec in self._worker_specs:
            providers.update(spec.providers)
        return Operations(self.store, providers)

    # -- kill points ------------------------------------------------------------------------

    def kill_at(self, point: str) -> None:
        """Stop the pipeline the next time a worker reaches ``point`` (``after_claim``,
        ``after_intent``, ``after_accepted``): that ``drain()`` returns with ``killed`` set,
        and nothing after the point runs. Call :meth:`restart` to go on."""
        if point not in KILL_POINTS:
            raise ConfigError("point", f"must be one of {', '.join(KILL_POINTS)}, got {point!r}")
        self._kills.append(point)

    def _reach(self, point: str, where: str) -> None:
        if point in self._kills:
            self._kills.remove(point)
            raise Killed(point, where)

    def restart(self) -> None:
        """New processes in place of the old ones: a relay, the consumers and the workers,
        built again from what :meth:`consumer` and :meth:`worker` were given. The database,
        Redis and the providers keep everything; the dead processes' leases expire by the
        clock (advance it past them)."""
        self.relay.store.close()
        self.relay = self._new_relay()
        self.consumers = [self._make_consumer(spec) for spec in self._consumer_specs]
        for worker in self.workers:
            worker.stop()
        self.workers = []
        for spec in self._worker_specs:
            self.workers.append(self._make_worker(spec))
        self._dead = False

    # -- drain ------------------------------------------------------------------------------
    def assert_reconciled(self, identity: str) -> Any:
        """The receipt of ``identity``'s job (its action, or ``tenant:action``) is ACCEPTED
        with the reference of its one effect, settled from that effect (a lookup that found
        it, or a replay under the idempotency key), not by making another; returns it."""
        rows = [r for r in self.receipt_rows() if identity in (r.action, f"{r.tenant}:{r.action}")]
        effects = self.effects(identity)
        problems = []
        if len(rows) != 1 or rows[0].state != "ACCEPTED":
            problems.append(f"expected one ACCEPTED receipt, found {[r.state for r in rows]}")
        if len(effects) != 1:
            problems.append(f"expected one effect, found {len(effects)}")
        elif rows and rows[0].provider_ref != effects[0].ref:
            problems.append(
                f"the receipt names {rows[0].provider_ref!r}, the effect is {effects[0].ref!r}"
            )
        if rows and rows[0].operation_id not in self._all_reconciled():
            problems.append(f"operation {rows[0].operation_id} was not reconciled (sent directly)")
        if problems:
            shown = "\n".join(f"  {row}" for row in rows) or "  (no receipt)"
            raise AssertionError(
                f"{identity!r} not reconciled: " + "; ".join(problems) + f"\nreceipts:\n{shown}"
            )
        return rows[0]


__all__ = ["KILL_POINTS", "DrainError", "DrainResult", "Killed", "Pipeline"]
