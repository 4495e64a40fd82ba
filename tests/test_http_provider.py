"""HttpProvider against the connector simulator running as a real process.

Every HTTP status class lands in the error (and so the receipt) the mapping names; the
headers, the operation id and the idempotency key reach the provider; Retry-After is
surfaced; lookup finds or does not find; a replay returns the same reference.
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from consumer import (
    AuthFailure,
    HttpProvider,
    Operations,
    PermanentFailure,
    ProviderOutcomeUnknown,
    ProviderTimeout,
    ProviderUnavailable,
    Store,
    TransientFailure,
)
from consumer.errors import OperationError
from consumer.jobs.http import parse_retry_after
from outbox.errors import ConfigError
from tests.services import free_port
from tests.simulator_support import SimulatorProcess

_ids = itertools.count(1)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatorProcess]:
    with SimulatorProcess(tmp_path_factory.mktemp("sim") / "effects.db") as process:
        yield process


@pytest.fixture(autouse=True)
def clean_plan(sim: SimulatorProcess) -> Iterator[None]:
    sim.faults()
    sim.configure(idempotency=True, lookup=True)
    yield
    sim.faults()


def op() -> str:
    """A fresh operation id (the simulator is shared by the module's tests)."""
    return f"{next(_ids)}:email-{time.monotonic_ns()}"


@pytest.fixture(params=["sync", "async"])
def form(request: pytest.FixtureRequest) -> str:
    """Which of the provider's forms a contract test calls: ``send``/``lookup`` (a ``def``
    handler's), or ``asend``/``alookup`` on an event loop (an ``async def`` handler's)."""
    return str(request.param)


class Calls:
    """An ``HttpProvider`` behind its sync methods, whichever form is under test: the async
    form runs on one event loop of its own (as a worker's), closed with the provider."""

    def __init__(self, provider: HttpProvider, form: str) -> None:
        self.provider = provider
        self.loop = asyncio.new_event_loop() if form == "async" else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.provider, name)

    def send(
        self, request: dict[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        if self.loop is None:
            return self.provider.send(
                request, operation_id=operation_id, idempotency_key=idempotency_key
            )
        return self.loop.run_until_complete(
            self.provider.asend(request, operation_id=operation_id, idempotency_key=idempotency_key)
        )

    def lookup(self, operation_id: str) -> str | None:
        if self.loop is None:
            return self.provider.lookup(operation_id)
        return self.loop.run_until_complete(self.provider.alookup(operation_id))

    def __enter__(self) -> Calls:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self.provider.aclose())
            self.loop.close()
        self.provider.close()


def calls(form: str, provider: HttpProvider) -> Calls:
    return Calls(provider, form)


def provider(sim: SimulatorProcess, form: str = "sync", **options: object) -> Calls:
    options.setdefault("lookup_url", sim.lookup_url)
    options.setdefault("timeout", 5.0)
    return Calls(HttpProvider("mail", sim.send_url, **options), form)  # type: ignore[arg-type]


# -- accepted ------------------------------------------------------------------------------------


def test_accepted_carries_headers_operation_id_and_idempotency_key(
    sim: SimulatorProcess, form: str
) -> None:
    operation_id = op()
    with provider(sim, form, headers={"Authorization": "Bearer s3cret", "X-Tenant": "studio"}) as p:
        ref = p.send(
            {"to": "a@example.com"},
            operation_id=operation_id,
            idempotency_key=f"key-{operation_id}",
        )
    [effect] = sim.effects(operation_id)
    assert effect["id"] == ref
    assert effect["body"] == {"to": "a@example.com"}
    assert effect["idempotency_key"] == f"key-{operation_id}"
    assert effect["headers"]["authorization"] == "Bearer s3cret"
    assert effect["headers"]["x-tenant"] == "studio"
    assert effect["headers"]["operation-id"] == operation_id
    assert effect["headers"]["content-type"] == "application/json"


def test_without_idempotency_no_key_is_sent_and_the_operation_id_still_is(
    sim: SimulatorProcess,
    form: str,
) -> None:
    operation_id = op()
    with provider(sim, form, idempotency_header=None, headers={"X-Tenant": "studio"}) as p:
        assert not p.supports_idempotency
        first = p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
        second = p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
    effects = sim.effects(operation_id)
    assert [e["id"] for e in effects] == [first, second]  # no dedup without a key
    assert all("idempotency-key" not in e["headers"] for e in effects)
    assert all(e["headers"]["operation-id"] == operation_id for e in effects)
    assert all(e["headers"]["x-tenant"] == "studio" for e in effects)


def test_custom_header_names_and_ref_field(sim: SimulatorProcess, form: str) -> None:
    operation_id = op()
    with provider(
        sim, idempotency_header="X-Request-Key", operation_id_header="X-Op", ref_field="id"
    ) as p:
        p.send({"n": 1}, operation_id=operation_id, idempotency_key="k")
    [effect] = sim.effects()[-1:]
    assert effect["headers"]["x-request-key"] == "k"
    assert effect["headers"]["x-op"] == operation_id


def test_idempotent_replay_returns_the_same_ref_and_makes_one_effect(
    sim: SimulatorProcess,
    form: str,
) -> None:
    operation_id = op()
    with provider(sim, form) as p:
        first = p.send({"to": "b"}, operation_id=operation_id, idempotency_key=operation_id)
        again = p.send({"to": "b"}, operation_id=operation_id, idempotency_key=operation_id)
    assert first == again
    assert len(sim.effects(operation_id)) == 1


def test_reused_key_with_another_body_is_a_permanent_conflict(
    sim: SimulatorProcess, form: str
) -> None:
    operation_id = op()
    with provider(sim, form) as p:
        p.send({"to": "c"}, operation_id=operation_id, idempotency_key=operation_id)
        with pytest.raises(PermanentFailure, match="conflict") as caught:
            p.send({"to": "d"}, operation_id=operation_id, idempotency_key=operation_id)
    assert caught.value.status == 409
    assert not caught.value.not_sent
    assert len(sim.effects(operation_id)) == 1


def test_a_ref_field_missing_from_a_2xx_leaves_the_outcome_unknown(
    sim: SimulatorProcess, form: str
) -> None:
    with (
        provider(sim, form, ref_field="data.id") as p,
        pytest.raises(ProviderOutcomeUnknown) as caught,
    ):
        p.send({"n": 1}, operation_id=op(), idempotency_key=None)
    assert caught.value.status == 201
    assert isinstance(caught.value, ProviderTimeout)  # so the receipt is UNKNOWN


# -- every status class --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "error", "status", "not_sent", "acted"),
    [
        ({"kind": "bad_request"}, PermanentFailure, 400, False, False),
        ({"kind": "unprocessable"}, PermanentFailure, 422, False, False),
        ({"kind": "unauthorized"}, AuthFailure, 401, True, False),
        ({"kind": "forbidden"}, AuthFailure, 403, True, False),
        ({"kind": "rate_limit", "retry_after": 3}, ProviderUnavailable, 429, True, False),
        ({"kind": "unavailable", "retry_after": 2}, ProviderUnavailable, 503, True, False),
        ({"kind": "error_before", "status": 500}, ProviderOutcomeUnknown, 500, False, False),
        ({"kind": "error_after", "status": 502}, ProviderOutcomeUnknown, 502, False, True),
        ({"kind": "error_after", "status": 504}, ProviderOutcomeUnknown, 504, False, True),
    ],
)
def test_each_status_class_lands_in_its_error(
    sim: SimulatorProcess,
    fault: dict[str, object],
    error: type[Exception],
    status: int,
    not_sent: bool,
    acted: bool,
    form: str,
) -> None:
    operation_id = op()
    sim.faults({**fault, "count": 1})
    with provider(sim, form) as p, pytest.raises(error) as caught:
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=operation_id)
    exc = caught.value
    assert exc.status == status  # type: ignore[attr-defined]
    assert exc.not_sent is not_sent  # type: ignore[attr-defined]
    assert exc.provider == "mail"  # type: ignore[attr-defined]
    assert len(sim.effects(operation_id)) == (1 if acted else 0)
    if error is ProviderUnavailable:
        assert isinstance(exc, TransientFailure)
    if error is PermanentFailure:
        assert not isinstance(exc, AuthFailure | TransientFailure)


def test_retry_after_in_seconds_is_surfaced(sim: SimulatorProcess, form: str) -> None:
    sim.faults({"kind": "rate_limit", "retry_after": 7, "count": 1})
    with provider(sim, form) as p, pytest.raises(ProviderUnavailable) as caught:
        p.send({"n": 1}, operation_id=op(), idempotency_key=None)
    assert caught.value.retry_after == 7.0
    assert "retry after 7 s" in str(caught.value)


def test_retry_after_as_an_http_date_is_surfaced(sim: SimulatorProcess, form: str) -> None:
    when = email.utils.formatdate(time.time() + 120, usegmt=True)
    sim.faults({"kind": "unavailable", "retry_after": when, "count": 1})
    with provider(sim, form) as p, pytest.raises(ProviderUnavailable) as caught:
        p.send({"n": 1}, operation_id=op(), idempotency_key=None)
    assert caught.value.retry_after is not None
    assert 100 <= caught.value.retry_after <= 121


def test_retry_after_parsing() -> None:
    assert parse_retry_after("30") == 30.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("-5") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412480 - 60) == 60.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past


def test_a_request_header_fault_applies_to_that_request_only(
    sim: SimulatorProcess, form: str
) -> None:
    operation_id = op()
    with (
        provider(sim, form, headers={"X-Sim-Fault": "unauthorized"}) as p,
        pytest.raises(AuthFailure),
    ):
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
    with provider(sim, form) as p:
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
    assert len(sim.effects(operation_id)) == 1


def test_one_provider_shared_by_threads(sim: SimulatorProcess) -> None:
    """A worker's loops share one provider (one keep-alive pool): every call is its own."""
    from concurrent.futures import ThreadPoolExecutor

    tag = op()
    with provider(sim, "sync") as p, ThreadPoolExecutor(8) as pool:
        refs = list(
            pool.map(
                lambda i: p.send({"i": i}, operation_id=f"{tag}-{i}", idempotency_key=f"{tag}-{i}"),
                range(80),
            )
        )
    assert len(set(refs)) == 80
    mine = [e for e in sim.effects() if (e["operation_id"] or "").startswith(f"{tag}-")]
    assert sorted(e["id"] for e in mine) == sorted(refs)


# -- transport faults ----------------------------------------------------------------------------


def test_connect_error_means_nothing_was_sent(form: str) -> None:
    port = free_port()  # nothing listens there
    p = calls(form, HttpProvider("mail", f"http://127.0.0.1:{port}/send", timeout=2.0))
    with p, pytest.raises(ProviderUnavailable) as caught:
        p.send({"n": 1}, operation_id="1:x", idempotency_key="1:x")
    assert caught.value.not_sent is True
    assert caught.value.status is None
    assert not isinstance(caught.value, ProviderTimeout)


def test_a_call_whose_time_is_spent_before_sending_is_not_sent(
    sim: SimulatorProcess, form: str
) -> None:
    operation_id = op()
    with provider(sim, form, timeout=1e-9) as p, pytest.raises(ProviderUnavailable) as caught:
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
    assert caught.value.not_sent
    assert sim.effects(operation_id) == []


def test_accept_then_hang_is_a_timeout_with_the_effect_made(
    sim: SimulatorProcess, form: str
) -> None:
    operation_id = op()
    sim.faults({"kind": "hang", "count": 1})
    with provider(sim, form, timeout=0.5) as p, pytest.raises(ProviderTimeout) as caught:
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=operation_id)
    assert not caught.value.not_sent
    assert not isinstance(caught.value, ProviderOutcomeUnknown)
    assert len(sim.effects(operation_id)) == 1
    assert sim.health()["ok"]  # the simulator noticed the client left


def test_accept_then_answer_late_is_a_timeout_and_a_short_delay_is_not(
    sim: SimulatorProcess,
    form: str,
) -> None:
    late = op()
    sim.faults({"kind": "late", "delay": 3, "count": 1})
    with provider(sim, form, timeout=0.5) as p, pytest.raises(ProviderTimeout):
        p.send({"n": 1}, operation_id=late, idempotency_key=late)
    assert len(sim.effects(late)) == 1
    # the idempotent resend after the timeout replays the first effect
    with provider(sim, form) as p:
        ref = p.send({"n": 1}, operation_id=late, idempotency_key=late)
    assert [e["id"] for e in sim.effects(late)] == [ref]

    quick = op()
    sim.faults({"kind": "late", "delay": 0.2, "count": 1})
    with provider(sim, form, timeout=5.0) as p:
        assert p.send({"n": 1}, operation_id=quick, idempotency_key=None)


def test_slow_answer_within_the_timeout_is_accepted(sim: SimulatorProcess, form: str) -> None:
    operation_id = op()
    sim.faults({"kind": "slow", "delay": 0.2, "count": 1})
    with provider(sim, form) as p:
        ref = p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
    assert [e["id"] for e in sim.effects(operation_id)] == [ref]


def test_slow_answer_past_the_timeout_is_unknown_and_made_nothing_yet(
    sim: SimulatorProcess,
    form: str,
) -> None:
    operation_id = op()
    sim.faults({"kind": "slow", "delay": 3, "count": 1})
    with provider(sim, form, timeout=0.3) as p, pytest.raises(ProviderTimeout):
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
    # the client cannot tell "slow" from "hang": UNKNOWN. The simulator saw it leave.
    assert sim.effects(operation_id) == []


def test_connection_reset_after_sending_is_a_timeout(sim: SimulatorProcess, form: str) -> None:
    operation_id = op()
    sim.faults({"kind": "reset", "count": 1})
    with provider(sim, form) as p, pytest.raises(ProviderTimeout) as caught:
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=operation_id)
    assert not caught.value.not_sent
    assert len(sim.effects(operation_id)) == 1


# -- lookup --------------------------------------------------------------------------------------


def test_lookup_found_and_not_found(sim: SimulatorProcess, form: str) -> None:
    operation_id = op()
    with provider(sim, form) as p:
        assert p.supports_lookup
        assert p.lookup(operation_id) is None
        ref = p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
        assert p.lookup(operation_id) == ref


def test_lookup_of_an_operation_id_needing_quoting(sim: SimulatorProcess, form: str) -> None:
    operation_id = f"{next(_ids)}:a/b c?d"
    with provider(sim, form) as p:
        ref = p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
        assert p.lookup(operation_id) == ref


def test_lookup_switched_off_at_the_provider_finds_nothing(
    sim: SimulatorProcess, form: str
) -> None:
    operation_id = op()
    with provider(sim, form) as p:
        p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
        sim.configure(lookup=False)
        assert p.lookup(operation_id) is None


def test_lookup_failures_are_transient_never_unknown(sim: SimulatorProcess, form: str) -> None:
    with provider(sim, form, headers={"X-Sim-Fault": "x"}) as p:  # lookups ignore X-Sim-Fault
        assert p.lookup(op()) is None
    port = free_port()
    dead = calls(
        form,
        HttpProvider(
            "mail",
            f"http://127.0.0.1:{port}/send",
            lookup_url=f"http://127.0.0.1:{port}/l/{{operation_id}}",
        ),
    )
    with dead, pytest.raises(ProviderUnavailable):
        dead.lookup("1:x")


def test_a_provider_without_lookup_url(sim: SimulatorProcess, form: str) -> None:
    with provider(sim, form, lookup_url=None) as p:
        assert not p.supports_lookup
        assert p.supports_idempotency
        with pytest.raises(OperationError):
            p.lookup("1:x")


# -- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "options", "field"),
    [
        (("", "http://h/send"), {}, "name"),
        (("m", "ftp://h/send"), {}, "send_url"),
        (("m", 42), {}, "send_url"),
        (("m", "http://h/send"), {"lookup_url": "http://h/lookup"}, "lookup_url"),
        (("m", "http://h/send"), {"lookup_url": "http://h/{op}"}, "lookup_url"),
        (("m", "http://h/send"), {"timeout": 0}, "timeout"),
        (("m", "http://h/send"), {"timeout": float("inf")}, "timeout"),
        (("m", "http://h/send"), {"timeout": "5"}, "timeout"),
        (("m", "http://h/send"), {"idempotency_header": "Bad Header"}, "idempotency_header"),
        (("m", "http://h/send"), {"operation_id_header": ""}, "operation_id_header"),
        (("m", "http://h/send"), {"headers": {"X-A": "1\r\nX-B: 2"}}, "headers"),
        (("m", "http://h/send"), {"headers": {"Bad:Name": "1"}}, "headers"),
        (("m", "http://h/send"), {"client": object()}, "client"),
        (("m", "http://h/send"), {"ref_field": "data..id"}, "ref_field"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(
    args: tuple[object, ...], options: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        HttpProvider(*args, **options)  # type: ignore[arg-type]
    assert caught.value.setting == field  # type: ignore[attr-defined]
    assert isinstance(caught.value, ValueError)


def test_capabilities_follow_from_the_arguments() -> None:
    both = HttpProvider("m", "http://h/send", lookup_url="http://h/l/{operation_id}")
    neither = HttpProvider("m", "http://h/send", idempotency_header=None)
    assert (both.supports_lookup, both.supports_idempotency) == (True, True)
    assert (neither.supports_lookup, neither.supports_idempotency) == (False, False)
    assert neither.timeout == 5.0
    both.close()
    neither.close()


def test_a_client_passed_in_is_used_and_left_open(sim: SimulatorProcess) -> None:
    client = httpx.Client(headers={"X-From-Client": "yes"})
    p = HttpProvider("mail", sim.send_url, client=client)
    operation_id = op()
    p.send({"n": 1}, operation_id=operation_id, idempotency_key=None)
    p.close()
    assert not client.is_closed
    [effect] = sim.effects(operation_id)
    assert effect["headers"]["x-from-client"] == "yes"
    client.close()


# -- through Operations --------------------------------------------------------------------------


def test_dispatch_through_http_accepts_then_returns_the_receipt(
    sim: SimulatorProcess, tmp_path: Path
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.enqueue("studio", f"send-{next(_ids)}")
    lease = store.claim_next("worker-a", ttl=30)
    assert lease is not None
    with provider(sim) as p:
        ops = Operations(store, {"mail": p})
        receipt = ops.dispatch(lease, "email", "mail", {"to": "a"})
        assert receipt.state == "ACCEPTED"
        again = ops.dispatch(lease, "email", "mail", {"to": "a"})
    assert again.provider_ref == receipt.provider_ref
    [effect] = sim.effects(receipt.operation_id)
    assert effect["id"] == receipt.provider_ref
    assert effect["idempotency_key"] == receipt.operation_id
    store.dispose()


@pytest.mark.parametrize(
    ("fault", "state"),
    [
        ({"kind": "bad_request"}, "FAILED"),
        ({"kind": "unprocessable"}, "FAILED"),
        ({"kind": "unauthorized"}, "NOT_SENT"),
        ({"kind": "forbidden"}, "NOT_SENT"),
        ({"kind": "rate_limit", "retry_after": 5}, "NOT_SENT"),
        ({"kind": "unavailable"}, "NOT_SENT"),
        ({"kind": "error_before", "status": 500}, "UNKNOWN"),
        ({"kind": "error_after", "status": 502}, "UNKNOWN"),
        ({"kind": "reset"}, "UNKNOWN"),
    ],
)
def test_each_status_class_lands_in_its_receipt(
    sim: SimulatorProcess, sqlite_url: str, fault: dict[str, object], state: str
) -> None:
    store = Store(sqlite_url)
    store.enqueue("studio", "send-1")
    lease = store.claim_next("worker-a", ttl=30)
    assert lease is not None
    sim.faults({**fault, "count": 1})
    with provider(sim, timeout=0.5) as p:
        ops = Operations(store, {"mail": p})
        with pytest.raises((PermanentFailure, TransientFailure, AuthFailure)):
            ops.dispatch(lease, "email", "mail", {"to": "a"})
    receipt = ops.receipt(f"{lease.job_id}:email")
    assert receipt is not None and receipt.state == state
    assert receipt.attempts == 1
    store.dispose()


def test_a_call_that_runs_out_its_timeout_is_looked_up_at_once(
    sim: SimulatorProcess, sqlite_url: str
) -> None:
    """The simulator acts, then never answers: the call runs out its timeout and, since the
    provider has a lookup, is looked up right after it: ACCEPTED, one call, no retry."""
    store = Store(sqlite_url)
    store.enqueue("studio", "send-1")
    lease = store.claim_next("worker-a", ttl=30)
    assert lease is not None
    sim.faults({"kind": "hang", "count": 1})
    # 2 s: the lookups after it take the same timeout, and must answer on a loaded machine.
    with provider(sim, timeout=2.0) as p:
        ops = Operations(store, {"mail": p})
        assert ops.dispatch(lease, "email", "mail", {"to": "a"}).state == "ACCEPTED"
    receipt = ops.receipt(f"{lease.job_id}:email")
    assert receipt is not None and receipt.state == "ACCEPTED"
    assert receipt.attempts == 1  # the call; the lookup is not a second one
    # The receipt names the one effect the call made (the simulator serves other tests too).
    assert [e["id"] for e in sim.effects() if e["id"] == receipt.provider_ref] == [
        receipt.provider_ref
    ]
    store.dispose()


def test_a_connection_refused_is_not_sent(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    store.enqueue("studio", "send-1")
    lease = store.claim_next("worker-a", ttl=30)
    assert lease is not None
    with HttpProvider("mail", f"http://127.0.0.1:{free_port()}/send", timeout=1.0) as p:
        ops = Operations(store, {"mail": p})
        with pytest.raises(ProviderUnavailable):
            ops.dispatch(lease, "email", "mail", {"to": "a"})
    receipt = ops.receipt(f"{lease.job_id}:email")
    assert receipt is not None and receipt.state == "NOT_SENT"
    store.dispose()


def test_retry_after_is_honoured_by_the_worker_then_it_sends_once(
    sim: SimulatorProcess, sqlite_url: str
) -> None:
    from consumer import JobContext, Worker

    store = Store(sqlite_url)
    with provider(sim) as p:
        worker = Worker(store, providers={"mail": p}, poll_interval=0.05)

        @worker.handler("email")
        def email(job: JobContext) -> None:
            job.dispatch("send", "mail", {"to": job.subject})

        store.enqueue("studio", "email-quote-017", subject="ann@example.com")
        sim.faults({"kind": "rate_limit", "retry_after": 40, "count": 1})
        assert worker.run_once() == 1
        job = store.get("studio", "email-quote-017")
        assert job.state == "READY"
        assert job.run_after is not None and job.run_after - job.updated_at >= 39.9
        operation_id = f"{job.id}:send"
        receipt = Operations(store).receipt(operation_id)
        assert receipt is not None and receipt.state == "NOT_SENT"
        assert sim.effects(operation_id) == []
        # the 429 paused the provider for every worker, until its Retry-After
        limits = Operations(store).limits
        paused = limits.paused_until("mail")
        assert paused is not None and abs(paused - job.run_after) < 1.0
        limits.unpause("mail")  # the provider's time has come (the test cannot wait 40 s)
        # at the provider's time, the retry sends (once)
        assert worker.store is store
        assert store.claim_next("worker-b", ttl=30, now=job.run_after - 1) is None
        lease = store.claim_next("worker-b", ttl=30, now=job.run_after + 0.01)
        assert lease is not None
        receipt = Operations(store, {"mail": p}).dispatch(
            lease, "send", "mail", {"to": job.subject}
        )
    assert receipt.state == "ACCEPTED"
    assert [e["id"] for e in sim.effects(operation_id)] == [receipt.provider_ref]
    store.dispose()
