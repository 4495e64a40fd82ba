"""Draining a :class:`~outbox.testing.Pipeline`: step its parts until nothing moves.

:class:`Draining` (mixed into the pipeline) is :meth:`Draining.drain`: the relay, the
consumers, recovery and reconciliation, then the workers, with their ``run_once``, cycle
after cycle, the test's clock carried into the outbox rows' times; it returns a
:class:`DrainResult`, or raises :class:`DrainError` when work never stops moving. What it
counts comes from :class:`CountingHooks` (the parts' hooks, passed on to the user's) and
:class:`HandlerFailures` (the consumers' failing handlers). A kill point reached during a
drain raises :class:`Killed`, which ends it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from outbox.errors import ConfigError
from outbox.hooks import Hooks, call_hook

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from consumer import Consumer, Store, Worker
    from outbox.core import Outbox
    from outbox.testing.clock import Clock
    from outbox.testing.fake import FakeProvider
    from relay.relay import Relay

KILL_POINTS = ("after_claim", "after_intent", "after_accepted")
"""Where :meth:`Pipeline.kill_at` can stop a worker (module docstring)."""

DEFAULT_MAX_CYCLES = 200


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


class HandlerFailures(logging.Handler):
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


class CountingHooks(Hooks):
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
    def forward(self: CountingHooks, *args: Any, **facts: Any) -> None:
        self._pass(name, *args, **facts)

    forward.__name__ = name
    return forward


for _name in dir(Hooks):
    if not _name.startswith("_") and _name not in CountingHooks.__dict__:
        setattr(CountingHooks, _name, _forwarder(_name))


class Draining:
    """The pipeline's :meth:`drain` (module docstring), on the parts the pipeline built."""

    clock: Clock
    engine: Engine
    outbox: Outbox
    store: Store
    relay: Relay
    consumers: list[Consumer]
    workers: list[Worker]
    fakes: list[FakeProvider]
    counts: Counter[str]
    failures: list[str]
    receipt_counts: Callable[[], dict[str, int]]
    _reconciled: set[str]
    _dead: bool
    _relay_offset: float

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
        caught = HandlerFailures()
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

    def _all_reconciled(self) -> set[str]:
        found = set(self._reconciled)
        for fake in self.fakes:
            found.update(fake.replays)
        return found

    @staticmethod
    def _nonzero(counts: Mapping[str, int]) -> dict[str, int]:
        return {state: n for state, n in counts.items() if n}


__all__ = [
    "DEFAULT_MAX_CYCLES",
    "KILL_POINTS",
    "CountingHooks",
    "DrainError",
    "DrainResult",
    "Draining",
    "HandlerFailures",
    "Killed",
]
