"""A call that ran out its timeout is settled at once by a lookup (issue 54).

The provider here is a class of the test's own, as a user writes one: its ``send`` records
the effect, then takes longer than its ``timeout`` to answer (the answer is lost, as a read
timeout loses it) and raises ``ProviderTimeout``; its ``lookup`` finds the effect. The
receipt must be ACCEPTED, through that lookup, within about a second of the call's
deadline, with one effect and one call counted: not UNKNOWN until a retry after backoff.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from consumer.errors import ProviderTimeout
from consumer.jobs.operations import ACCEPTED, UNKNOWN, Operations
from consumer.jobs.store import Store

TIMEOUT = 0.5  # the provider's call timeout: the call's deadline is the intent's + this


class SlowToAnswer:
    """Acts at once, answers past its timeout; ``lookup`` knows what it did. ``act=False``:
    it never acts (a lookup finds nothing)."""

    supports_lookup = True
    supports_idempotency = False

    def __init__(self, name: str, *, act: bool = True) -> None:
        self.name = name
        self.timeout = TIMEOUT
        self.act = act
        self.effects: dict[str, str] = {}
        self.lookups = 0
        self._lock = threading.Lock()

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        if self.act:
            with self._lock:
                self.effects[operation_id] = f"ref-{len(self.effects) + 1}"
        time.sleep(self.timeout + 0.1)  # the answer comes too late: the client gave up
        raise ProviderTimeout(f"no answer in {self.timeout} s")

    def lookup(self, operation_id: str) -> str | None:
        with self._lock:
            self.lookups += 1
            return self.effects.get(operation_id)


def _claim(store: Store, action: str) -> Any:
    store.enqueue("t", action, subject="ann@example.com")
    lease = store.claim_next("w", ttl=30)
    assert lease is not None
    return lease


@pytest.mark.parametrize("way", ["dispatch", "adispatch"])
def test_a_call_past_its_timeout_is_settled_by_lookup_within_a_second(
    db_url: str, way: str
) -> None:
    store = Store(db_url)
    provider = SlowToAnswer(f"slow-{way}")
    ops = Operations(store, {provider.name: provider})
    lease = _claim(store, f"email-{way}")
    started = time.monotonic()
    if way == "dispatch":
        receipt = ops.dispatch(lease, "send", provider.name, {"to": "ann"})
    else:
        receipt = asyncio.run(ops.adispatch(lease, "send", provider.name, {"to": "ann"}))
    took = time.monotonic() - started
    assert receipt.state == ACCEPTED and receipt.reconciled
    assert receipt.provider_ref == provider.effects[receipt.operation_id]
    assert len(provider.effects) == 1 and provider.lookups >= 1
    stored = ops.receipt(receipt.operation_id)
    assert stored is not None and stored.state == ACCEPTED
    assert stored.attempts == 1  # one call: the lookup is not a resend
    assert stored.call_deadline is not None and stored.updated_at is not None
    # Settled within a second of the call's deadline (both on the database clock).
    assert stored.updated_at - stored.call_deadline < 1.0, (stored, took)
    store.dispose()


def test_a_lookup_that_finds_nothing_leaves_the_receipt_unknown(db_url: str) -> None:
    """No effect found right after the deadline proves nothing (the provider may still be
    at it): the timeout is raised as before, the receipt stays UNKNOWN for the reconcile
    path, nothing is sent again."""
    store = Store(db_url)
    provider = SlowToAnswer("never", act=False)
    ops = Operations(store, {provider.name: provider})
    lease = _claim(store, "email-never")
    with pytest.raises(ProviderTimeout):
        ops.dispatch(lease, "send", provider.name, {"to": "ann"})
    stored = ops.receipt(f"{lease.job_id}:send")
    assert stored is not None and stored.state == UNKNOWN and stored.attempts == 1
    assert provider.lookups == 3  # at the deadline, then twice within about a second
    store.dispose()
