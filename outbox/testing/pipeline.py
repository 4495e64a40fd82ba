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
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

from consumer import Consumer, ConsumerConfig, Operations, Store, Worker, WorkerConfig
from consumer.jobs.operations import Provider
from consumer.jobs.retention import JobRetentionConfig
from outbox.core import Outbox
from outbox.db import make_engine
from outbox.errors import ConfigError
from outbox.hooks import Hooks, call_hook
from outbox.testing.asserts import Assertions
from outbox.testing.clock import Clock
from outbox.testing.fake import FakeProvider
from relay.config import RelayConfig
from relay.redis.publisher import RedisStreamPublisher
from relay.relay import Relay

KILL_POINTS = ("after_claim", "after_intent", "after_accepted")
"""Where :meth:`Pipeline.kill_at` can stop a worker (module docstring)."""

DEFAULT_MAX_CYCLES = 200


def _no_fsync(dbapi_connection: Any, _record: Any) -> None:
    """The test's own SQLite file (in its temp dir, gone after it) is not fsynced at its WAL
    checkpoints: nothing a test observes depends on surviving a power cut, and the syncs were
    a tenth of a big drain(). Transactions, locks and WAL mode are production's."""
    dbapi_connection.execute("PRAGMA synchronous=OFF")


class Killed(BaseException):
    """Raised at a kill point: a BaseException, so no ``except Exception`` of the code under
    test records anything after it, as after a SIGKILL. ``drain()`` catches it."""

    def __init__(self, point: str, where: str) -> None:
        super().__init__(f"killed {point} ({where})")
        self.point = point
        self.where = where


class DrainError(AssertionError):
    """``drain()`` kept finding work after ``max_cycles`` cycles (a job retried at once for
    ever, a handler that enqueues without end); the message says what was still moving."""


@dataclass(frozen=True)
class DrainResult:
    """What one :meth:`Pipeline.drain` did, and the state it left.

    Counts over the drain: ``published`` (events the relay put in the streams), ``handled``
    (events the consumers' handlers ran for: new identities), ``duplicates`` (entries whose
    identity the inbox had already seen, skipped), ``dead_lettered``, ``jobs_run`` (jobs the
    workers ran, whatever the outcome) with ``outcomes`` (per outcome: ``done``,
    ``failed_ready``, ``waiting_external``, ...), ``recovered`` (expired leases taken back and
    timers fired), ``effects`` (effects the fake providers made) and ``reconciled`` (provider
    calls settled from an earlier attempt's effect: a lookup that found it, a replay under the
    idempotency key). State after it: ``jobs`` and ``receipts`` by state (states with none
    left out). ``killed``: the kill point that stopped it, or None.
    """

    cycles: int = 0
    published: int = 0
    handled: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    jobs_run: int = 0
    outcomes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    recovered: int = 0
    effects: int = 0
    reconciled: int = 0
    jobs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    receipts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    killed: str | None = None
    failures: tuple[str, ...] = ()
    """Each consumer handler failure of the drain, as one line: group, entry, the error,
    and whether it will be retried or was dead-lettered."""

    def __str__(self) -> str:
        parts = [
            f"{self.cycles} cycles",
            f"published {self.published}",
            f"handled {self.handled}",
            f"duplicates {self.duplicates}",
            f"jobs run {self.jobs_run}",
            f"effects {self.effects}",
            f"jobs {dict(self.jobs)}",
            f"receipts {dict(self.receipts)}",
        ]
        if self.dead_lettered:
            parts.append(f"dead-lettered {self.dead_lettered}")
        if self.killed:
            parts.append(f"killed {self.killed}")
        text = "drain: " + ", ".join(parts)
        if self.failures:
            text += "\nhandler failures:\n" + "\n".join(f"  {f}" for f in self.failures)
        return text


class _Failures(logging.Handler):
    """Collects the consumers' "handler failed" log lines while a drain runs: a failing
    handler is then in the drain's result and in assertion messages, not only in a log
    record's extra fields."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith("handler failed"):
            return
        facts = getattr(record, "fields", {}) or {}
        then = message.removeprefix("handler failed, ")
        self.lines.append(
            f"group {facts.get('group')!s}, entry {facts.get('entry_id')!s} of "
            f"{facts.get('stream')!s}: {facts.get('error')!s} ({then})"
        )


class _Counting(Hooks):
    """Counts what the pipeline reports, and passes every hook on to the user's own."""

    def __init__(self, counts: Counter[str], inner: Hooks | None) -> None:
        self.counts = counts
        self.inner = inner

    def _pass(self, name: str, *args: Any, **facts: Any) -> None:
        if self.inner is not None:
            call_hook(self.inner, name, *args, **facts)

    def consumer_handled(self, group: str, stream: str, count: int) -> None:
        self.counts["handled"] += count
        self._pass("consumer_handled", group, stream, count)

    def consumer_duplicate(self, group: str, count: int) -> None:
        self.counts["duplicates"] += count
        self._pass("consumer_duplicate", group, count)

    def consumer_dead_lettered(self, group: str, stream: str, count: int) -> None:
        self.counts["dead_lettered"] += count
        self._pass("consumer_dead_lettered", group, stream, count)

    def worker_job_finished(
        self, action: str, outcome: str, duration_seconds: float, **facts: Any
    ) -> None:
        self.counts["outcome:" + outcome] += 1
        self._pass("worker_job_finished", action, outcome, duration_seconds, **facts)


def _forwarder(name: str) -> Callable[..., None]:
    def forward(self: _Counting, *args: Any, **facts: Any) -> None:
        self._pass(name, *args, **facts)

    forward.__name__ = name
    return forward


for _name in dir(Hooks):
    if not _name.startswith("_") and _name not in _Counting.__dict__:
        setattr(_Counting, _name, _forwarder(_name))


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


class Pipeline(Assertions):
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
        self._schema: str | None = None
        self._admin: Engine | None = None
        try:
            self.engine = self._open_database(database_url)
            self.redis, self.prefix = self._open_redis(redis_url)
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

    # -- where it runs ----------------------------------------------------------------------

    def _open_database(self, url: str | None) -> Engine:
        own_file = None
        if url is None:
            assert self.directory is not None
            url = own_file = "sqlite:///" + os.path.join(self.directory, "outbox.db")
        parsed = make_url(url)
        if parsed.get_backend_name() != "postgresql":
            engine = make_engine(parsed)
            if url == own_file:
                event.listen(engine, "connect", _no_fsync)
            self._closers.append(engine.dispose)
            self.database_url = parsed.render_as_string(hide_password=False)
            return engine
        schema = f"outbox_test_{self.token}"
        admin = sa.create_engine(parsed, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        self._schema, self._admin = schema, admin
        self._closers.append(self._drop_schema)
        own = parsed.update_query_dict({"options": f"-csearch_path={schema}"})
        self.database_url = own.render_as_string(hide_password=False)
        engine = make_engine(own, pool_size=5, max_overflow=5)
        self._closers.append(engine.dispose)
        return engine

    def _drop_schema(self) -> None:
        assert self._admin is not None and self._schema is not None
        with self._admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{self._schema}" CASCADE'))
        self._admin.dispose()

    def _open_redis(self, url: str | None) -> tuple[redis.Redis, str]:
        if url is None:
            from outbox.embedded_redis import embedded_server

            assert self.directory is not None
            server = embedded_server(os.path.join(self.directory, "redis.db"))
            self._closers.append(server.release)
            return server.client(), ""  # a server of the test's own: production's names
        client = redis.Redis.from_url(url)
        client.ping()
        prefix = f"outbox-test-{self.token}."

        def clean() -> None:
            keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
            if keys:
                client.delete(*keys)
            client.close()

        self._closers.append(clean)
        return client, prefix

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
        hooks = _Counting(self.counts, spec.hooks)
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
            hooks=_Counting(self.counts, spec.hooks),
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

    def drain(self, *, max_cycles: int = DEFAULT_MAX_CYCLES) -> DrainResult:
        """Run relay -> consumers -> recovery and reconciliation -> workers, cycle after
        cycle, until a cycle moves nothing; return what happened (:class:`DrainResult`).
        Raises :class:`DrainError` when work still moves after ``max_cycles`` cycles."""
        if self._dead:
            raise ConfigError("pipeline", "it was killed: call restart() first")
        before = Counter(self.counts)
        effects_before = sum(len(f.effects) for f in self.fakes)
        reconciled_before = len(self._all_reconciled())
        totals: Counter[str] = Counter()
        killed: str | None = None
        cycles = 0
        last: Counter[str] = Counter()
        caught = _Failures()
        consumer_log = logging.getLogger("outbox.consumer")
        consumer_log.addHandler(caught)
        try:
            while True:
                if cycles >= max_cycles:
                    raise DrainError(
                        f"drain(): still moving after {max_cycles} cycles; the last one: "
                        f"{dict(last)}; jobs {self._nonzero(self.store.counts())}"
                    )
                cycles += 1
                last = Counter()
                try:
                    self._cycle(last)
                finally:  # a kill mid-cycle keeps what the cycle did before it
                    totals.update(last)
                if not any(last.values()):
                    break
        except Killed as kill:
            killed = kill.point
            self._dead = True
            for worker in self.workers:
                worker.stop()
        finally:
            consumer_log.removeHandler(caught)
            self.failures.extend(caught.lines)
        counted = self.counts - before
        return DrainResult(
            cycles=cycles,
            published=totals["published"],
            handled=counted["handled"],
            duplicates=counted["duplicates"],
            dead_lettered=counted["dead_lettered"],
            jobs_run=totals["jobs_run"],
            outcomes=MappingProxyType(
                {k.split(":", 1)[1]: v for k, v in sorted(counted.items()) if k[:8] == "outcome:"}
            ),
            recovered=totals["recovered"],
            effects=sum(len(f.effects) for f in self.fakes) - effects_before,
            reconciled=len(self._all_reconciled()) - reconciled_before,
            jobs=MappingProxyType(self._nonzero(self.store.counts())),
            receipts=MappingProxyType(self.receipt_counts()),
            killed=killed,
            failures=tuple(caught.lines),
        )

    def _cycle(self, moved: Counter[str]) -> None:
        self._age_relay_rows()
        while (published := self.relay.run_once(now=self.clock())) > 0:
            moved["published"] += published
        for consumer in self.consumers:
            while (acked := consumer.run_once(block=False, now=self.clock())) > 0:
                moved["acknowledged"] += acked
        recovery = self.store.recover()
        moved["recovered"] += recovery.requeued + recovery.woken + recovery.needs_attention
        for worker in self.workers:
            operations = worker.operations
            if operations is not None:
                swept = operations.reconcile()
                moved["swept"] += swept.accepted + swept.not_sent + swept.resend + swept.review
        for worker in self.workers:
            moved["jobs_run"] += worker.run_once(now=self.clock())

    def _age_relay_rows(self) -> None:
        """Carry the clock's advance into the times the database stamped on pending outbox
        rows: a publish's backoff (``available_at``) and an intent's age (``claimed_at``).
        The relay compares them with the database's clock, which does not move with the
        test's; moving them back by what the test advanced since the last cycle is the same
        as moving that clock forward (the pipeline's clock is real time plus the advance), so
        a retry or a reconciliation comes due when the test's time passes it."""
        delta = self.clock.offset - self._relay_offset
        if delta <= 0:
            return
        self._relay_offset = self.clock.offset
        table = self.engine.dialect.identifier_preparer.format_table(self.outbox.table)
        if self.engine.dialect.name == "postgresql":
            back, now = "{} - make_interval(secs => :delta)", "now()"
        else:
            back = "strftime('%Y-%m-%d %H:%M:%f', {}, '-' || :delta || ' seconds')"
            now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE {table} SET available_at = {back.format('available_at')}, "
                    f"claimed_at = {back.format('claimed_at')} "
                    "WHERE state = 'pending' "
                    f"AND (attempts > 0 OR claimed_at IS NOT NULL OR available_at > {now})"
                ),
                {"delta": delta},
            )

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

    def _all_reconciled(self) -> set[str]:
        found = set(self._reconciled)
        for fake in self.fakes:
            found.update(fake.replays)
        return found

    @staticmethod
    def _nonzero(counts: Mapping[str, int]) -> dict[str, int]:
        return {state: n for state, n in counts.items() if n}


__all__ = ["KILL_POINTS", "DrainError", "DrainResult", "Killed", "Pipeline"]
