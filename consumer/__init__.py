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
}

__all__ = ["Conflict", "ConsumerError", "Consumer", "Store"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'consumer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
