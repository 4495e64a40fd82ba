"""Workers: claim jobs fairly, run their handlers under a heartbeat, record the outcome.

```python
from consumer import Store, Worker

worker = Worker(Store("postgresql+psycopg://localhost/app"))

@worker.handler("send-quote")            # runs jobs whose kind is "send-quote", or whose
def send_quote(job):                     # action starts with "send-quote-", ":" ...
    quote = load(job.subject)
    job.progress()                       # long handlers report progress: the lease is
    ...                                  # renewed only while they do

@worker.handler("send-invoice")          # an ``async def`` handler runs on the worker's
async def send_invoice(job):             # event loop, many jobs in flight per process
    await job.adispatch("email", "mail", {"to": job.subject})

worker.run_once()                        # one cycle; returns how many jobs it handled
worker.run()                             # until SIGTERM: finishes the jobs in hand, exits
```

A ``Worker`` is what you build: its handlers, providers, queues and config. It is frozen
once it runs (its first ``run`` or ``run_once``): what runs it is a
:class:`~consumer.jobs.runner.Runner` built from it then, which owns the running state.
``worker.bound(store=..., config=..., hooks=...)`` makes a new worker with the same handlers
and providers (the ``outbox-worker`` command builds its final worker that way).

What a worker does, and where each part is explained (the design text lives there once):

- **Slots** (``run``): ``concurrency`` jobs in flight (``DEFAULT_CONCURRENCY``, 256), claimed
  in one statement and started at once; ``def`` handlers on threads, ``async def`` ones on
  the event loop; queues with slots of their own. ``consumer.jobs.slots``,
  ``consumer.jobs.config``; docs/how-to/effects.md, docs/how-to/queues.md. ``run_once`` is
  the steppable form: up to ``batch_size`` jobs, one after another, in the calling thread.
- **Outcomes**: a handler that returns finishes its job (finishes are batched and fenced);
  it may move the job itself through its :class:`JobContext` (wait, schedule, cancel,
  ``recheck`` a timer); ``TransientFailure``/``PermanentFailure``/``AuthFailure`` are
  recorded as such, any other exception as transient. A job no handler routes stays READY.
  docs/how-to/jobs-and-effects.md (States, Recovery and retries, Timers).
- **Leases**: the heartbeat renews a running job's lease only while its handler reports
  progress (a provider call in flight keeps it); :attr:`Worker.liveness` keeps this worker's
  row in ``outbox_workers`` and takes back the leases of workers whose row expired.
  docs/explanation/fencing.md, docs/how-to/jobs-and-effects.md (Worker liveness).
- **Effects**: ``providers=`` gives handlers ``job.dispatch``/``job.adispatch``
  (``consumer.jobs.operations``); :attr:`Worker.reconciliation` sweeps receipts whose call
  deadline passed. docs/explanation/reconciliation.md.
- **Duties**, each named with ``run_once()`` and its interval (``outbox.duty``):
  :attr:`Worker.recovery` (expired leases and due timers, every ``recover_interval`` and as
  soon as the earliest timer comes due), :attr:`Worker.reconciliation`,
  :attr:`Worker.liveness`, and in the background :attr:`Worker.vacuum` and
  :attr:`Worker.retention` (``consumer.jobs.duties``; docs/explanation/retention.md).
- **Wake-up**: an adaptive poll, or LISTEN with ``StoreConfig(notify=True)``.
  docs/how-to/jobs-and-effects.md (Wake on work).

An outage in ``run`` (the database gone) is logged in one line (``outbox.outage``) and waited
out with backoff; the loop never exits on it. Hooks (``outbox.hooks.Hooks``) observe every
outcome.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from consumer.jobs.config import DEFAULT_CONCURRENCY, QueueSlots, WorkerConfig
from consumer.jobs.context import JobContext
from consumer.jobs.firing import ScheduleDuty
from consumer.jobs.runner import Runner
from consumer.jobs.schedules import Schedule, SchedulesDefined, check_definitions
from consumer.jobs.store import Lease, RecoveryResult, Store, Time
from outbox.duty import Duty
from outbox.errors import ConfigError
from outbox.hooks import NO_HOOKS, Hooks
from outbox.lifecycle import GracefulStop
from outbox.maintenance import PeriodicVacuum
from outbox.retention import RetentionDuty
from outbox.validate import check_number

if TYPE_CHECKING:
    from consumer.jobs.operations import Operations, Provider

__all__ = [
    "DEFAULT_CONCURRENCY",
    "Handler",
    "JobContext",
    "QueueSlots",
    "Worker",
    "WorkerConfig",
]

log = logging.getLogger("outbox.worker")

Handler = Callable[["JobContext"], Any]
_SEPARATORS = "-:/.#_"
# What a worker is built from: set before it runs, frozen after (``Worker.__setattr__``).
_BUILT_FROM = frozenset(
    {"config", "store", "hooks", "providers", "default_timeout", "heartbeat", "handlers"}
    | {"schedules"}
)


class Worker:
    """Runs job handlers (see the module docstring). ``store`` may be left None and bound
    before the worker runs (the ``outbox-worker`` command binds it from ``--database-url``
    through :meth:`bound`)."""

    config: WorkerConfig

    def __init__(
        self,
        store: Store | None = None,
        *,
        config: WorkerConfig | None = None,
        hooks: Hooks | None = None,
        providers: Mapping[str, Provider] | None = None,
        default_timeout: float = 30.0,
        schedules: Iterable[Schedule] | None = None,
        **options: Any,
    ) -> None:
        if store is not None and not isinstance(store, Store):
            raise ConfigError("store", f"must be a Store, got {type(store).__name__}")
        base = config if config is not None else WorkerConfig()
        if not isinstance(base, WorkerConfig):
            raise ConfigError("config", "must be a WorkerConfig")
        self._runner: Runner | None = None
        self._runner_lock = threading.Lock()
        self.config = replace(base, **options) if options else base
        self.store = store
        self.hooks = hooks if hooks is not None else NO_HOOKS
        self.handlers: dict[str, Handler] = {}
        self.stop_flag = GracefulStop()
        # False: no heartbeat thread (``outbox.testing`` runs jobs inline, on a clock the test
        # moves: no lease outlives a real-time interval there, and no thread may write).
        self.heartbeat = True
        self.default_timeout = check_number("default_timeout", default_timeout, ConfigError)
        self.providers: dict[str, Provider] = dict(providers or {})
        # Schedules defined in code (consumer.jobs.schedules): created or updated before the
        # first firing round; None: this worker defines none (it fires every schedule).
        self.schedules = None if schedules is None else tuple(check_definitions(schedules))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _BUILT_FROM and getattr(self, "_runner", None) is not None:
            raise ConfigError(
                name,
                "the worker is running and frozen: build the worker you want before it runs "
                "(worker.bound(...) makes a new one with the same handlers)",
            )
        super().__setattr__(name, value)

    def bound(
        self,
        *,
        store: Store | None = None,
        config: WorkerConfig | None = None,
        hooks: Hooks | None = None,
    ) -> Worker:
        """A new worker with this one's handlers, providers and settings, and the ``store``,
        ``config`` and ``hooks`` given (the others kept)."""
        made = Worker(
            store if store is not None else self.store,
            config=config if config is not None else self.config,
            hooks=hooks if hooks is not None else self.hooks,
            providers=self.providers,
            default_timeout=self.default_timeout,
            schedules=self.schedules,
        )
        made.heartbeat = self.heartbeat
        for name, fn in self.handlers.items():
            made.register(name, fn)
        return made

    # -- registry -------------------------------------------------------------------------
    def handler(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: register ``fn`` for jobs of kind ``name`` (or actions prefixed by it)."""

        def decorate(fn: Handler) -> Handler:
            self.register(name, fn)
            return fn

        return decorate

    def register(self, name: str, fn: Handler) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError("handler name", "must be a non-empty string")
        if not callable(fn):
            raise ConfigError("handler", f"{name!r}: not callable")
        if self._runner is not None:
            raise ConfigError("handler", f"{name!r}: the worker is running and frozen")
        self.handlers[name] = fn

    def route(self, lease: Lease) -> tuple[str, Handler] | None:
        """The handler for a job: by ``kind``, else the action itself, else the longest
        registered name the action starts with followed by a separator (``-:/.#_``)."""
        return route(self.handlers, lease)

    @property
    def operations(self) -> Operations | None:
        """Operation intents through this worker's providers (None without providers)."""
        if not self.providers:
            return None
        return self.runner.operations

    @property
    def runner(self) -> Runner:
        """What runs this worker, built at its first use; the worker is frozen from then."""
        runner = self._runner
        if runner is not None:
            return runner
        with self._runner_lock:
            if self._runner is None:
                store = self.store
                if store is None:
                    raise ConfigError(
                        "store", "the worker has no Store: pass one, or bind one with bound()"
                    )
                self._runner = Runner(
                    store=store,
                    config=self.config,
                    hooks=self.hooks,
                    handlers=self.handlers,
                    route=partial(route, self.handlers),
                    providers=self.providers,
                    operations=self._make_operations(store),
                    stop=self.stop_flag,
                    heartbeat=self.heartbeat,
                    schedules=self.schedules,
                )
            return self._runner

    def _make_operations(self, store: Store) -> Operations | None:
        if not self.providers:
            return None
        from consumer.jobs.operations import Operations  # only with providers

        return Operations(
            store,
            self.providers,
            default_timeout=self.default_timeout,
            slots=self.config.slots,
            hooks=self.hooks,
        )

    # -- the duties (``consumer.jobs.duties``) ---------------------------------------------
    @property
    def recovery(self) -> Duty[bool]:
        """Expired leases and due timers back to READY: ``run_once()``, its interval."""
        return self.runner.duties.recovery

    @property
    def reconciliation(self) -> Duty[None]:
        """The receipt sweep (``Operations.reconcile``)."""
        return self.runner.duties.reconciliation

    @property
    def liveness(self) -> Duty[RecoveryResult]:
        """This worker's liveness row, and the leases of workers whose row expired."""
        return self.runner.duties.liveness

    @property
    def vacuum(self) -> PeriodicVacuum | None:
        """The vacuum of the job tables (``outbox.maintenance``): only where the server runs
        without autovacuum. None off PostgreSQL, with ``vacuum_interval=0``, or before a
        store is bound."""
        return self.runner.duties.vacuum if self.store is not None else None

    @property
    def retention(self) -> RetentionDuty | None:
        """The retention duty (``consumer.jobs.retention``). None before a store is bound."""
        return self.runner.duties.retention if self.store is not None else None

    @property
    def schedule_duty(self) -> ScheduleDuty:
        """The schedules' firing duty (``consumer.jobs.firing``): ``run_once()``,
        ``make_due()``; the worker steps it with its other duties."""
        return self.runner.duties.firing

    def define_schedules(self) -> SchedulesDefined:
        """Create or update this worker's ``schedules=`` now (the first firing round does it
        otherwise) and report the schedules defined in code that it no longer defines."""
        return self.runner.duties.define_schedules()

    @property
    def schedules_defined(self) -> SchedulesDefined | None:
        """What the worker's start did with its ``schedules=`` (None: not yet)."""
        return self.runner.duties.schedules_defined

    def beat(self, *, now: Time | None = None) -> RecoveryResult:
        """One liveness tick: this worker is alive for ``liveness_ttl`` more seconds, and the
        leases of workers whose liveness expired go back to READY at once (fenced)."""
        return self.runner.duties.beat(now=now)

    def step_duties(self) -> None:
        """Start vacuum and retention if due, in the background (never blocks)."""
        vacuum, retention = self.vacuum, self.retention
        if vacuum is not None:
            vacuum.maybe_start()
        if retention is not None:
            retention.maybe_start()

    # -- running --------------------------------------------------------------------------
    def run_once(self, *, now: Time | None = None) -> int:
        """Recover if due, claim a batch, run its handlers, record outcomes; returns how many
        jobs were handled (0: nothing eligible). Database errors propagate (``run`` retries)."""
        return self.runner.run_once(now=now)

    def run(self, *, install_signals: bool = True) -> None:
        """Run the worker's slots (``consumer.jobs.slots``) until SIGTERM/SIGINT or
        ``stop()``: no new claims, every job in hand runs to its end, the call returns."""
        runner = self.runner
        if install_signals:
            self.stop_flag.install()
        runner.run()

    def stop(self) -> None:
        self.stop_flag.stop()
        runner = self._runner
        if runner is not None:
            runner.kick()


def route(handlers: Mapping[str, Handler], lease: Lease) -> tuple[str, Handler] | None:
    """``Worker.route`` on ``handlers`` (a function, so that what runs the worker holds its
    handlers, never the worker: a dropped worker is freed at once)."""
    if lease.kind is not None:
        fn = handlers.get(lease.kind)
        return (lease.kind, fn) if fn is not None else None
    if lease.action in handlers:
        return lease.action, handlers[lease.action]
    best: str | None = None
    for name in handlers:
        if (
            lease.action.startswith(name)
            and lease.action[len(name)] in _SEPARATORS
            and (best is None or len(name) > len(best))
        ):
            best = name
    return (best, handlers[best]) if best is not None else None
