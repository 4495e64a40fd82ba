"""A fake provider with the connector simulator's semantics, in-process.

:class:`FakeProvider` is an :class:`~consumer.jobs.http.HttpProvider` whose transport is not a
socket but the simulator's own decision core (:mod:`consumer.jobs.simulation`, the module
``outbox-simulator serve`` answers with). So what a test sees is what production code sees
against the simulator service: the same effects, replays under an idempotency key, lookups,
faults, and the same mapping of answers to receipts (``HttpProvider``'s: a timeout is UNKNOWN,
a 429 is NOT_SENT with its ``Retry-After``, a 400 is FAILED, ...). Effects are recorded in an
in-memory SQLite table, so a test states "one email for send-quote-17".

Time is the test's: a ``slow`` or ``late`` answer moves the pipeline's clock forward by its
delay instead of sleeping, and an answer later than the provider's ``timeout`` (``late`` with
a long delay, ``hang``) is a read timeout after ``timeout`` seconds of test time.

Fault kinds (``fail_next(kind, ...)`` or ``set_faults([...])``, the simulator's rule format):

==================  =============================================  ========================
kind                what the provider does                         the receipt
==================  =============================================  ========================
``hang``            acts, never answers: accept, then time out      UNKNOWN (effect made)
``late``            acts, answers ``delay`` s later (a timeout if   UNKNOWN if a timeout
                    ``delay`` >= ``timeout``)
``reset``           acts, resets the connection                     UNKNOWN (effect made)
``error_after``     acts, answers ``status`` (500)                  UNKNOWN (effect made)
``error_before``    answers ``status`` (500) without acting          UNKNOWN (no effect)
``rate_limit``      429 with ``Retry-After: retry_after`` (1)       NOT_SENT, retried after
``unavailable``     503 with ``Retry-After``                        NOT_SENT, retried after
``unauthorized``    401 (``forbidden``: 403)                        NOT_SENT (auth failure)
``bad_request``     400 (``unprocessable``: 422)                    FAILED
``slow``            waits ``delay`` s, then acts (nothing if the     ACCEPTED (or UNKNOWN)
                    client gave up first)
==================  =============================================  ========================
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from consumer.jobs.http import HttpProvider, parse_retry_after
from consumer.jobs.http_answers import transport_error
from consumer.jobs.simulation import Fault, Simulator, SimulatorConfig, wait_before_acting
from outbox.errors import ConfigError
from outbox.extras import optional_module

if TYPE_CHECKING:
    import httpx
else:  # the [http] extra: FakeProvider(...) names it (outbox.testing imports without it)
    httpx = optional_module("httpx", "http", "FakeProvider")

_BASE = "http://fake-provider.invalid"


class FakeProvider:
    """An in-process provider named ``name`` (see the module docstring).

    ``lookup`` / ``idempotency``: whether it offers a lookup by operation id and honours an
    idempotency key (a provider with neither cannot be reconciled: its unknown outcomes go to
    WAITING_REVIEW). ``timeout``: the seconds one call may take (declared to ``Operations``).
    ``clock``: the time that slow and late answers spend (the pipeline passes its own).
    """

    def __init__(
        self,
        name: str = "mail",
        *,
        lookup: bool = True,
        idempotency: bool = True,
        timeout: float = 5.0,
        clock: Callable[[], float] | None = None,
        advance: Callable[[float], object] | None = None,
    ) -> None:
        for setting, value in (("lookup", lookup), ("idempotency", idempotency)):
            if not isinstance(value, bool):
                raise ConfigError(setting, f"must be True or False, got {value!r}")
        self.simulator = Simulator(
            ":memory:",
            SimulatorConfig(idempotency=idempotency, lookup=lookup),
            clock=clock or time.time,
        )
        self._advance = advance
        self.replays: list[str] = []
        """Operation ids whose send was answered with the first effect (an idempotent
        resend that reconciled instead of acting again)."""
        self._http = _SimulatedHttp(
            self,
            name,
            f"{_BASE}/send",
            lookup_url=f"{_BASE}/lookup/{{operation_id}}" if lookup else None,
            idempotency_header="Idempotency-Key" if idempotency else None,
            timeout=timeout,
            client=httpx.Client(transport=httpx.MockTransport(self._handle)),
        )
        self.name = self._http.name
        self.timeout = self._http.timeout
        self.supports_lookup = self._http.supports_lookup
        self.supports_idempotency = self._http.supports_idempotency

    def __repr__(self) -> str:
        return (
            f"FakeProvider({self.name!r}, lookup={self.supports_lookup}, "
            f"idempotency={self.supports_idempotency}, effects={len(self.effects)})"
        )

    # -- the Provider protocol --------------------------------------------------------------

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        return self._http.send(request, operation_id=operation_id, idempotency_key=idempotency_key)

    def lookup(self, operation_id: str) -> str | None:
        return self._http.lookup(operation_id)

    # -- scripting ----------------------------------------------------------------------------

    def fail_next(
        self,
        kind: str,
        *,
        count: int | None = 1,
        delay: float | None = None,
        status: int | None = None,
        retry_after: float | str | None = None,
        operation_id: str | None = None,
    ) -> None:
        """Add a rule to the fault plan: the next ``count`` sends (None: every send; of
        ``operation_id`` only, if given) meet ``kind``. Rules apply in the order added."""
        rule: dict[str, Any] = {"kind": kind}
        for field, value in (
            ("count", count),
            ("delay", delay),
            ("status", status),
            ("retry_after", retry_after),
            ("operation_id", operation_id),
        ):
            if value is not None:
                rule[field] = value
        self.set_faults([*self.simulator.faults(), rule])

    def set_faults(self, rules: list[dict[str, Any]], *, seed: int | None = None) -> None:
        """Replace the fault plan (the rules of ``POST /faults``; ``seed`` for the random
        ones)."""
        self.simulator.set_faults({"faults": list(rules), "seed": seed})

    def clear_faults(self) -> None:
        self.simulator.set_faults({"faults": []})

    # -- what happened ------------------------------------------------------------------------

    @property
    def effects(self) -> list[dict[str, Any]]:
        """The effects made, in order: ``{"seq", "id", "operation_id", "idempotency_key",
        "body", "headers", "time"}`` (what ``GET /effects`` answers)."""
        return self.simulator.effects.list()

    def effects_of(self, operation_id: str) -> list[dict[str, Any]]:
        return self.simulator.effects.list(operation_id)

    @property
    def stats(self) -> dict[str, int]:
        """Sends, effects, replays, conflicts, faults met, lookups, lookups found."""
        return self.simulator.stats()

    def close(self) -> None:
        self._http.close()
        self._http.client.close()
        self.simulator.effects.close()

    # -- the transport: the simulator's decisions, carried out without a socket ---------------

    def _spend(self, seconds: float) -> None:
        if seconds > 0 and self._advance is not None:
            self._advance(seconds)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        """The client's transport (what an ``httpx`` call on ``self._http.client`` meets)."""
        status, body, headers = self._answer(
            request.method, request.url.path, request.headers, request.content
        )
        return httpx.Response(status, json=body, headers=headers)

    def _answer(
        self, method: str, path: str, headers: Mapping[str, str], content: bytes | None
    ) -> tuple[int, Any, dict[str, str]]:
        """One request as the simulator service answers it: ``(status, JSON body, headers)``,
        or the transport failure (``httpx.ReadTimeout``, ``httpx.RemoteProtocolError``) that
        the client meets. ``headers``: case-insensitive look-ups (lower-cased names)."""
        if method == "POST" and path == "/send":
            return self._send(headers, content or b"")
        if method == "GET" and path.startswith("/lookup/"):
            operation_id = unquote(path[len("/lookup/") :])
            found = self.simulator.lookup(operation_id, enabled=self.simulator.config.lookup)
            if found is None:
                return 404, {"error": "no effect for this operation id"}, {}
            return 200, found, {}
        return 404, {"error": f"no route {method} {path}"}, {}

    def _send(self, headers: Mapping[str, str], content: bytes) -> tuple[int, Any, dict[str, str]]:
        try:
            body = json.dumps(json.loads(content), sort_keys=True, separators=(",", ":"))
        except ValueError:
            return 400, {"error": "the request body is not JSON"}, {}
        operation_id = headers.get("operation-id")
        key = headers.get("idempotency-key")
        header = headers.get("x-sim-fault")
        fault, refusal = self.simulator.begin_send(
            operation_id, Fault.from_header(header) if header else None
        )
        if refusal is not None:
            return refusal.status, refusal.body, dict(refusal.headers)
        before = wait_before_acting(fault)
        if before >= self.timeout:  # the client gives up before the provider acts
            self._spend(self.timeout)
            raise httpx.ReadTimeout("no answer (slow)")
        self._spend(before)
        idempotent = self.simulator.config.idempotency
        answer = self.simulator.act(
            fault, operation_id, key, body, dict(headers), idempotent=idempotent
        )
        if answer.status == 200 and answer.body.get("replayed") and operation_id is not None:
            self.replays.append(operation_id)
        if answer.reset:
            raise httpx.RemoteProtocolError("connection reset after acting")
        if answer.hang or before + answer.delay >= self.timeout:
            self._spend(self.timeout - before)
            raise httpx.ReadTimeout("no answer within the timeout")
        self._spend(answer.delay)
        return answer.status, answer.body, {}


class _SimulatedHttp(HttpProvider):
    """``HttpProvider`` with its exchange answered in-process by the fake: the request it
    builds, the mapping of answers and transport failures to receipts are the real class's;
    only the socket (and httpx's per-call machinery, ~1 ms of CPU a call) is left out."""

    def __init__(self, fake: FakeProvider, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fake = fake

    def _exchange(
        self, method: str, url: str, headers: dict[str, str], body: bytes | None
    ) -> tuple[int, Any, float | None]:
        lowered = {name.lower(): value for name, value in headers.items()}
        try:
            status, payload, answered = self._fake._answer(
                method, urlsplit(url).path, lowered, body
            )
        except httpx.TransportError as exc:
            raise transport_error(self.name, self.timeout, exc, method, url) from None
        # Through JSON, as the bytes on a socket would be: the caller gets its own objects.
        payload = json.loads(json.dumps(payload)) if payload is not None else None
        return status, payload, parse_retry_after(answered.get("Retry-After"))
