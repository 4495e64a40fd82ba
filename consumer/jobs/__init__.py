"""The durable job store: leases fenced by epochs, waiting states, timers, tenant fairness;
the workers that run jobs, and operation intents with receipts for external effects.

The package root gathers what a user needs beyond ``consumer``'s own names: the job
tables' ``metadata`` and their Alembic extras, the retention and queue-slot settings, and
the signed inbound endpoint (``InboundApp``, ``sign``: the ``inbound`` extra, imported on
first use).
"""

from typing import TYPE_CHECKING, Any

from consumer.jobs.config import QueueSlots
from consumer.jobs.migrations import create_job_extras, drop_job_extras
from consumer.jobs.retention import JobRetentionConfig
from consumer.jobs.schema import metadata

if TYPE_CHECKING:
    from consumer.jobs.inbound import InboundApp, sign


def __getattr__(name: str) -> Any:
    # The inbound endpoint needs Starlette (the ``inbound`` extra): loaded on first use, so
    # that importing the job store never requires it.
    if name in ("InboundApp", "sign"):
        from consumer.jobs import inbound

        return getattr(inbound, name)
    raise AttributeError(f"module 'consumer.jobs' has no attribute {name!r}")


__all__ = [
    "InboundApp",
    "JobRetentionConfig",
    "QueueSlots",
    "create_job_extras",
    "drop_job_extras",
    "metadata",
    "sign",
]
