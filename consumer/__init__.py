"""The consumer side: consumers with an inbox that deduplicates by business identity, the
durable job store (leases fenced by epochs, waiting states, timers), workers and operation
intents for external effects."""

from __future__ import annotations

from typing import Any

from consumer.errors import Conflict, ConsumerError

# Filled in as the parts land; resolved lazily so each part imports on its own.
_LAZY = {
    "Store": "consumer.store",
    "Consumer": "consumer.consumer",
    # the job store's public names (consumer/store.py, worker.py, retry.py, operations.py)
    "EnqueueResult": "consumer.store",
    "Lease": "consumer.store",
    "Timer": "consumer.store",
    "StoreConfig": "consumer.store",
    "RetryPolicy": "consumer.retry",
    "Worker": "consumer.worker",
    "WorkerConfig": "consumer.worker",
    "JobContext": "consumer.worker",
}

__all__ = [
    "Conflict",
    "Consumer",
    "ConsumerError",
    "EnqueueResult",
    "JobContext",
    "Lease",
    "RetryPolicy",
    "Store",
    "StoreConfig",
    "Timer",
    "Worker",
    "WorkerConfig",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'consumer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
