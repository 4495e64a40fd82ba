"""A worker's settings: :class:`WorkerConfig`, and how its slots divide among its queues.

Slots (``concurrency``) are the jobs a worker process has in flight; it never leases more
jobs than it has free slots (``consumer.jobs.slots``). A queue may have **slots of its own**:
``WorkerConfig(queues={"mail": 8, "billing": 4})`` (or ``queues=["mail", "billing"],
queue_slots={"mail": 8}``; ``outbox-worker run --queues mail=8,billing``). Its jobs never
take more than those slots, and no other queue ever takes them: a busy queue cannot starve
another one. A queue's own slots are reserved out of ``concurrency``, so the process never
has more than ``concurrency`` jobs in flight; the queues without slots of their own (every
queue, when ``queues`` is None) share what is left. The worker claims each group of slots
with its own statement, of its free slots only (:meth:`WorkerConfig.slot_pools`).

``consumer.jobs.worker`` re-exports :class:`WorkerConfig` and :data:`DEFAULT_CONCURRENCY`
(their public home); they live here so that the slot runner can read them without importing
the worker.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from consumer.jobs.checks import check_queue_settings
from consumer.jobs.retention import JobRetentionConfig
from outbox.errors import ConfigError
from outbox.lifecycle import incarnation_name
from outbox.maintenance import DEFAULT_VACUUM_INTERVAL
from outbox.validate import check_number

__all__ = ["DEFAULT_CONCURRENCY", "QueueSlots", "WorkerConfig"]

#: Slots per worker process (``--concurrency``). Effects are I/O: a slot mostly waits on a
#: provider. 256 holds, against a 300 ms provider, ~800 calls/s in flight per process: the
#: measured effects/s of an async handler and of a plain one on this 2-core machine are bound
#: by CPU, not by slots (docs/how-to/effects.md has the figures). A slot costs nothing while
#: free: threads and connections are made as needed.
DEFAULT_CONCURRENCY = 256


@dataclass(frozen=True)
class QueueSlots:
    """One group of a worker's slots: the queues its claims take from (None: every queue)
    and how many jobs of them may be in flight at once in this process."""

    queues: tuple[str, ...] | None
    slots: int


@dataclass(frozen=True)
class WorkerConfig:
    """Frozen worker settings (validated; errors name the field).

    - ``name``: the worker's name, the owner of its leases and its liveness row;
      ``worker-<host>-<pid>-<random>``, fresh per process, by default.
    - ``concurrency``: slots: the jobs in flight in this process (``run`` claims at most its
      free slots).
    - ``threads``: threads running ``def`` handlers at once; None: sized from the CPUs and
      the jobs' own waits, 8 to 64 per CPU (``consumer.jobs.threads``). The other claimed
      jobs wait for one without holding a thread.
    - ``batch_size``: jobs per claim of ``run_once``, the steppable form.
    - ``ttl``: seconds a lease lasts; the heartbeat renews the leases in hand every third of
      it.
    - ``poll_interval``: the longest wait of an idle worker: without NOTIFY it polls every
      10 ms for a second after a claim that found work, then doubles up to this.
    - ``recover_interval``: seconds between the recovery duty's rounds (``Store.recover``:
      expired leases and due timers), which also runs as soon as the earliest timer comes
      due.
    - ``reconcile_interval``: seconds between the sweeps of the receipts whose call
      deadline passed (only with providers).
    - ``listen``: PostgreSQL: LISTEN for jobs that became READY (with
      ``StoreConfig(notify=True)``).
    - ``claim_ahead``: deprecated, without effect (a freed slot starts its next job at once,
      without a buffer of claimed jobs); True warns.
    - ``vacuum_interval``: VACUUM of the job tables when the server runs without
      autovacuum; with or without it, every 5 s a job table past its autovacuum threshold is
      vacuumed if no vacuum has come to it yet. ``0`` turns both off.
    - ``schedule_interval``: the schedules' firing duty (``consumer.jobs.firing``) runs at
      each schedule's next slot and at most this many seconds apart (a schedule defined or
      resumed meanwhile).
    - ``liveness_ttl`` / ``liveness_interval``: the worker's row in ``outbox_workers``: it
      expires after ``liveness_ttl`` seconds unless renewed every ``liveness_interval``; the
      leases of a worker whose row expired go back to READY at once.
    - ``retention``: how long finished jobs, their history and receipts are kept
      (:class:`~consumer.jobs.retention.JobRetentionConfig`, below).
    - ``queues``: claim only from these queues (None: every queue); a list of names, or a
      mapping of names to slots of their own (None: the queue shares the others' slots),
      which sets ``queue_slots`` too.
    - ``tenant_limit`` / ``tenant_limits``: at most N jobs of one tenant LEASED at once in a
      queue, over every worker; per-tenant overrides.
    - ``queue_slots``: queue -> slots of its own, reserved out of ``concurrency``: its jobs
      never take more, and no other queue takes them. Every queue named must be in
      ``queues``; the queues without slots of their own share the rest."""

    name: str = field(default_factory=lambda: incarnation_name("worker"))
    concurrency: int = DEFAULT_CONCURRENCY
    threads: int | None = None
    batch_size: int = 10
    ttl: float = 30.0
    poll_interval: float = 0.5
    recover_interval: float = 5.0
    reconcile_interval: float = 10.0
    listen: bool = True
    # Accepted (with a DeprecationWarning) so that configurations that set it keep working.
    claim_ahead: bool = False
    vacuum_interval: float = DEFAULT_VACUUM_INTERVAL
    schedule_interval: float = 30.0
    liveness_ttl: float = 3.0
    liveness_interval: float = 1.0
    retention: JobRetentionConfig = field(default_factory=JobRetentionConfig)
    queues: tuple[str, ...] | None = None  # claim from these queues (None: every queue)
    tenant_limit: int | None = None  # at most N jobs of a tenant LEASED at once, fleet-wide
    tenant_limits: Mapping[str, int] = field(default_factory=dict)  # per-tenant overrides
    queue_slots: Mapping[str, int] = field(default_factory=dict)  # queue -> slots of its own

    def __post_init__(self) -> None:
        check_queue_settings(self)
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError("name", "must be a non-empty string")
        for switch in ("listen", "claim_ahead"):
            if not isinstance(getattr(self, switch), bool):
                raise ConfigError(switch, f"must be True or False, got {getattr(self, switch)!r}")
        if self.claim_ahead:
            warnings.warn(
                "WorkerConfig(claim_ahead=True) has no effect any more: a freed slot starts "
                "its next job at once without a buffer of claimed jobs",
                DeprecationWarning,
                stacklevel=3,
            )
        for name in ("concurrency", "batch_size"):
            check_number(name, getattr(self, name), ConfigError, integer=True)
        if self.threads is not None:
            check_number("threads", self.threads, ConfigError, integer=True)
        for name in (
            "ttl",
            "poll_interval",
            "recover_interval",
            "reconcile_interval",
            "liveness_ttl",
            "liveness_interval",
        ):
            check_number(name, getattr(self, name), ConfigError)
        check_number("vacuum_interval", self.vacuum_interval, ConfigError, zero=True)  # 0: never
        check_number("schedule_interval", self.schedule_interval, ConfigError)
        if not isinstance(self.retention, JobRetentionConfig):
            raise ConfigError("retention", "must be a consumer.jobs.retention.JobRetentionConfig")
        if self.liveness_interval >= self.liveness_ttl:
            raise ConfigError(
                "liveness_interval",
                f"must be less than liveness_ttl ({self.liveness_ttl!r}), "
                f"got {self.liveness_interval!r}",
            )
        self.slot_pools()  # the slots add up (ConfigError naming queue_slots otherwise)

    def slot_pools(self) -> tuple[QueueSlots, ...]:
        """The worker's slots by queue: one group per queue with slots of its own, then one
        shared by the other queues (every queue when ``queues`` is None) with the rest of
        ``concurrency``. Without ``queue_slots``: one group, every slot."""
        own = dict(self.queue_slots)
        reserved = sum(own.values())
        pools = [QueueSlots((queue,), slots) for queue, slots in own.items()]
        shared = None if self.queues is None else tuple(q for q in self.queues if q not in own)
        if shared is None or shared:
            rest = self.concurrency - reserved
            if rest < 1:
                raise ConfigError(
                    "queue_slots",
                    f"the queues' own slots ({reserved}) leave none of concurrency "
                    f"({self.concurrency}) for the other queues "
                    f"({', '.join(shared) if shared else 'every other queue'})",
                )
            pools.append(QueueSlots(shared, rest))
        elif reserved > self.concurrency:
            raise ConfigError(
                "queue_slots",
                f"the queues' own slots add up to {reserved}, more than concurrency "
                f"({self.concurrency}): raise concurrency or give fewer slots",
            )
        return tuple(pools)

    @property
    def slots(self) -> int:
        """Jobs this worker may have in flight at once: at most ``concurrency``."""
        return sum(pool.slots for pool in self.slot_pools())
