"""What every part of the job store shares: its settings and its seam to the database.

``Store`` (``consumer.jobs.store``) is assembled from parts by concern: enqueue, reads and
claims in ``store`` (the rows written by ``consumer.jobs.enqueues``), queues in
``consumer.jobs.queues``, the lease holder's and operators' moves in ``consumer.jobs.moves``
(with ``consumer.jobs.batch_moves`` and ``consumer.jobs.operator_moves``),
recovery in ``consumer.jobs.recovery``. Each part derives from :class:`StoreBase`, which
holds the driver (every statement goes through it) and the settings.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from consumer.jobs.driver import JobDriver
from consumer.jobs.retry import RetryPolicy
from outbox.errors import ConfigError
from outbox.validate import check_number


@dataclass(frozen=True)
class StoreConfig:
    """Frozen store settings.

    - ``retry``: what a failed attempt turns into, and when it may run again
      (:class:`~consumer.jobs.retry.RetryPolicy`, below); its ``max_attempts`` also bounds
      lease expiries.
    - ``max_tenants_scanned``: tenants a claim looks at per queue, at most, for the fair
      share between tenants.
    - ``recover_limit``: rows one recovery round takes back at most (expired leases, due
      timers, a dead worker's leases), each.
    - ``notify``: PostgreSQL: True makes enqueues, resumes and recoveries NOTIFY, so
      LISTENing workers claim at once. Off by default (issue 25): a transaction that sent
      NOTIFY takes a global lock at commit, which serialises concurrent enqueuers (``python
      -m bench job_wake``: 8 writers enqueue ~1.4x as many jobs/s without it), and a worker
      whose store does not notify polls adaptively instead (every 10 ms for a second after a
      claim that found work, then backing off to ``poll_interval``;
      ``consumer.jobs.slots``)."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_tenants_scanned: int = 1000
    recover_limit: int = 500
    notify: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError("retry", "must be a RetryPolicy")
        if not isinstance(self.notify, bool):
            raise ConfigError("notify", f"must be True or False, got {self.notify!r}")
        for name in ("max_tenants_scanned", "recover_limit"):
            check_number(name, getattr(self, name), ConfigError, integer=True)


class StoreBase:
    """The store's seam and settings, as its parts see them (``Store.__init__`` sets them)."""

    driver: JobDriver
    config: StoreConfig
    rng: random.Random | None = None  # the retry jitter's source when fail() is given none
    # Wake-ups of this process's running workers on this store (``Runner.run`` adds its
    # slots' kick): an enqueue in the store's own transaction calls them once committed, so
    # an idle worker claims at once, not at its next poll (issue 44; other processes need
    # ``StoreConfig(notify=True)`` and LISTEN).
    local_wakers: list[Callable[[], None]]

    def _clock(self, conn: Connection, now: float | None) -> float:
        return self.driver.clock_read(conn, now)
