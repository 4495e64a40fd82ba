"""The consumer side: consumers with an inbox that deduplicates by business identity, the
durable job store (leases fenced by epochs, waiting states, timers), workers and operation
intents for external effects (``consumer.jobs``).

Every public name is imported eagerly, so a type checker sees the real classes.
"""

from __future__ import annotations

from consumer.consumer import Consumer, ConsumerConfig, ConsumerTx
from consumer.errors import (
    AuthFailure,
    Conflict,
    ConsumerError,
    DependencyCycle,
    InvalidSchedule,
    JobCancelled,
    OperationUnresolved,
    PermanentFailure,
    ProviderOutcomeUnknown,
    ProviderTimeout,
    ProviderUnavailable,
    ResultTimeout,
    ResultTooLarge,
    ResultUnavailable,
    ScheduleNotFound,
    StepGraphError,
    TransientFailure,
    UnknownParent,
)
from consumer.event import ConsumedEvent
from consumer.inbox import build_inbox_schema
from consumer.jobs.http import HttpProvider
from consumer.jobs.operations import Operations, Provider, Receipt
from consumer.jobs.retry import RetryPolicy
from consumer.jobs.schedules import Schedule, ScheduleInfo
from consumer.jobs.store import EnqueueResult, Lease, Reply, ReplyResult, Store, StoreConfig, Timer
from consumer.jobs.worker import JobContext, Worker, WorkerConfig

__all__ = [
    "AuthFailure",
    "Conflict",
    "ConsumedEvent",
    "Consumer",
    "ConsumerConfig",
    "ConsumerError",
    "ConsumerTx",
    "DependencyCycle",
    "EnqueueResult",
    "HttpProvider",
    "InvalidSchedule",
    "JobCancelled",
    "JobContext",
    "Lease",
    "OperationUnresolved",
    "Operations",
    "PermanentFailure",
    "Provider",
    "ProviderOutcomeUnknown",
    "ProviderTimeout",
    "ProviderUnavailable",
    "Receipt",
    "Reply",
    "ReplyResult",
    "ResultTimeout",
    "ResultTooLarge",
    "ResultUnavailable",
    "RetryPolicy",
    "Schedule",
    "ScheduleInfo",
    "ScheduleNotFound",
    "StepGraphError",
    "Store",
    "StoreConfig",
    "Timer",
    "TransientFailure",
    "UnknownParent",
    "Worker",
    "WorkerConfig",
    "build_inbox_schema",
]
