"""The worker's periodic duties besides claiming: vacuum and retention.

Each is a named service with ``run_once()`` and its interval in one place
(``outbox.maintenance.PeriodicVacuum``, ``outbox.retention.RetentionDuty``); the worker's
``run_once`` steps them (:meth:`WorkerDuties.step_duties`), and each runs its round in a
background thread when due, so a claim never waits for a VACUUM or a DELETE.

- ``Worker.vacuum``: the job tables, when the server runs without autovacuum
  (``WorkerConfig.vacuum_interval``).
- ``Worker.retention``: finished jobs with their history and receipts, and gone workers'
  liveness rows (``WorkerConfig.retention``, a
  :class:`consumer.jobs.retention.JobRetentionConfig`; ``consumer.jobs.retention``).
"""

from __future__ import annotations

from typing import Protocol

from consumer.jobs.retention import JobRetentionConfig, job_retention_duty
from consumer.jobs.schema import HOT_TABLES
from consumer.jobs.store import Store
from outbox.maintenance import PeriodicVacuum, quoted_table
from outbox.retention import RetentionDuty


class _DutySettings(Protocol):
    @property
    def vacuum_interval(self) -> float: ...

    @property
    def retention(self) -> JobRetentionConfig: ...


class WorkerDuties:
    """Mixed into ``Worker``: its duties, built for the store it is bound to."""

    store: Store | None
    config: _DutySettings
    _duties_store: Store | None = None
    _vacuum: PeriodicVacuum | None = None
    _retention: RetentionDuty | None = None

    def _bind_duties(self) -> Store | None:
        store = self.store
        if store is not None and self._duties_store is not store:
            self._duties_store = store
            self._vacuum = PeriodicVacuum.for_engine(
                store.engine,
                [quoted_table(t) for t in HOT_TABLES],
                interval=self.config.vacuum_interval,
                what="job tables",
            )
            self._retention = job_retention_duty(store, self.config.retention)
        return store

    @property
    def vacuum(self) -> PeriodicVacuum | None:
        """The worker's vacuum of the job tables (``outbox.maintenance``): ``run_once``
        starts it in the background every ``vacuum_interval`` seconds, and it vacuums only
        the tables autovacuum does not take care of (the server runs without it). None off
        PostgreSQL, with ``vacuum_interval=0``, or before a store is bound."""
        return self._vacuum if self._bind_duties() is not None else None

    @property
    def retention(self) -> RetentionDuty | None:
        """The worker's retention duty (``consumer.jobs.retention``): ``run_once`` starts a
        round in the background every ``retention.purge_interval`` seconds. None before a
        store is bound."""
        return self._retention if self._bind_duties() is not None else None

    def step_duties(self) -> None:
        """Start each duty that is due, in the background (never blocks)."""
        vacuum, retention = self.vacuum, self.retention
        if vacuum is not None:
            vacuum.maybe_start()
        if retention is not None:
            retention.maybe_start()
