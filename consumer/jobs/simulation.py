"""The connector simulator's semantics, in one place: effects, capabilities, the fault plan,
and what one send does.

Two front ends share it, so they cannot drift apart: ``outbox-simulator serve``
(:mod:`consumer.jobs.simulator`, the HTTP service) and the in-process fake provider of
``outbox.testing`` (the same decisions, without a socket, on a test's clock). A send goes
through three steps, each decided here:

1. :meth:`Simulator.begin_send`: the fault that applies (the ``X-Sim-Fault`` override, else
   the plan's first matching rule) and, for a fault that stops the send before it acts, the
   :class:`Refusal` to answer;
2. :func:`wait_before_acting`: how long a ``slow`` send waits before acting (a client that
   gives up meanwhile gets nothing done);
3. :meth:`Simulator.act`: the effect is made (or replayed under its idempotency key), and the
   :class:`Answer` says how it is answered: at once, ``delay`` seconds late, never
   (``hang``), by a reset connection, or by a 5xx after acting.

The front end only carries the answer out (waits, writes, resets a socket, or raises what a
client would have seen).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import ConfigError
from outbox.logs import fields

__all__ = [
    "FAULT_KINDS",
    "MAX_HANG_SECONDS",
    "REFUSALS",
    "STAT_NAMES",
    "Answer",
    "Effects",
    "Fault",
    "Refusal",
    "Simulator",
    "SimulatorConfig",
    "wait_before_acting",
]

log = logging.getLogger("outbox.simulator")

#: Fault kinds that make no effect, with the status they answer.
REFUSALS = {
    "rate_limit": 429,
    "unavailable": 503,
    "unauthorized": 401,
    "forbidden": 403,
    "bad_request": 400,
    "unprocessable": 422,
}
FAULT_KINDS = frozenset(
    {"none", "slow", "late", "hang", "reset", "error_before", "error_after", *REFUSALS}
)
#: A hang ends at the latest after this long, so a forgotten request cannot hold a thread.
MAX_HANG_SECONDS = 3600.0
MAX_BODY_BYTES = 1 << 20
#: Requests counted since the process started (``GET /stats``; not persisted).
STAT_NAMES = ("sends", "effects", "replays", "conflicts", "faults", "lookups", "lookups_found")


@dataclass
class Fault:
    """One rule of the fault plan (see the module docstring)."""

    kind: str
    count: int | None = None
    probability: float | None = None
    operation_id: str | None = None
    status: int | None = None
    delay: float = 0.0
    retry_after: str | None = None

    # complexity: one check per fault rule field, each naming it
    @classmethod
    def from_json(cls, raw: Any) -> Fault:
        if not isinstance(raw, dict):
            raise ConfigError("faults", f"a rule must be an object, not {raw!r}")
        unknown = set(raw) - {
            "kind",
            "count",
            "probability",
            "operation_id",
            "status",
            "delay",
            "retry_after",
        }
        if unknown:
            raise ConfigError("faults", f"unknown rule fields {sorted(unknown)}")
        kind = raw.get("kind")
        if kind not in FAULT_KINDS:
            raise ConfigError("kind", f"{kind!r} is not one of {sorted(FAULT_KINDS)}")
        fault = cls(kind=kind)
        if raw.get("count") is not None:
            fault.count = int(_number(raw["count"], "count", integer=True, minimum=0))
        if raw.get("probability") is not None:
            p = _number(raw["probability"], "probability")
            if not 0 <= p <= 1:
                raise ConfigError("probability", "must be between 0 and 1")
            fault.probability = p
        if raw.get("operation_id") is not None:
            if not isinstance(raw["operation_id"], str):
                raise ConfigError("operation_id", "must be a string")
            fault.operation_id = raw["operation_id"]
        if raw.get("status") is not None:
            status = int(_number(raw["status"], "status", integer=True, minimum=100))
            if status > 599:
                raise ConfigError("status", "must be an HTTP status (100-599)")
            fault.status = status
        if raw.get("delay") is not None:
            fault.delay = _number(raw["delay"], "delay", minimum=0)
        if raw.get("retry_after") is not None:
            value = raw["retry_after"]
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise ConfigError("retry_after", "must be seconds or an HTTP date")
            fault.retry_after = _format_seconds(value) if not isinstance(value, str) else value
        return fault

    @classmethod
    def from_header(cls, header: str) -> Fault:
        """``KIND[;key=value...]`` from ``X-Sim-Fault``."""
        kind, *params = [part.strip() for part in header.split(";")]
        raw: dict[str, Any] = {"kind": kind}
        for param in params:
            key, sep, value = param.partition("=")
            if not sep:
                raise ConfigError("X-Sim-Fault", f"parameter {param!r} is not key=value")
            key = key.strip()
            if key in ("delay", "probability"):
                raw[key] = _parse_float(value, key)
            elif key == "status":
                raw[key] = int(_parse_float(value, key))
            else:
                raw[key] = value.strip()
        return cls.from_json(raw)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "delay": self.delay}
        for name in ("count", "probability", "operation_id", "status", "retry_after"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass
class SimulatorConfig:
    """The capabilities of a run (``POST /config`` changes them while it runs)."""

    idempotency: bool = True
    lookup: bool = True
    latency: float = 0.0  # seconds every send takes before it acts (the HTTP front end)
    jitter: float = 0.0  # the latency varies by up to this fraction either way (0.5: ±50 %)
    capacity: int | None = None  # sends served at once; the others queue (None: no limit)


@dataclass
class Refusal:
    """The answer to a send that a fault stops before it acts."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


class Effects:
    """The effects made, in a SQLite file (one writer: this process, under a lock)."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock  # the effects' ``time`` (a test's clock in the fake provider)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode survives the process being killed (not an OS crash): enough
            # for a simulator whose point is to outlive its clients and its own restarts.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS effects ("
                " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                " ref TEXT NOT NULL UNIQUE,"
                " operation_id TEXT,"
                " idempotency_key TEXT,"
                " body_digest TEXT NOT NULL,"
                " body TEXT NOT NULL,"
                " headers TEXT NOT NULL,"
                " created_at REAL NOT NULL)"
            )
            self._db.execute("CREATE INDEX IF NOT EXISTS effects_key ON effects (idempotency_key)")
            self._db.execute(
                "CREATE INDEX IF NOT EXISTS effects_operation ON effects (operation_id)"
            )
        except sqlite3.Error as exc:
            raise ConfigError("data", f"cannot open {path!r}: {exc}") from None

    def send(
        self,
        operation_id: str | None,
        key: str | None,
        body: str,
        headers: dict[str, str],
        *,
        idempotent: bool,
    ) -> tuple[int, dict[str, Any]]:
        """Make (or, for a known key, replay) an effect: (HTTP status, answer)."""
        digest = hashlib.sha256(body.encode()).hexdigest()
        with self._lock:
            if idempotent and key is not None:
                row = self._db.execute(
                    "SELECT ref, body_digest, operation_id FROM effects"
                    " WHERE idempotency_key = ? ORDER BY seq LIMIT 1",
                    (key,),
                ).fetchone()
                if row is not None:
                    if row[1] != digest:
                        return 409, {
                            "error": "idempotency key reused with another request body",
                            "idempotency_key": key,
                            "id": row[0],
                        }
                    return 200, {"id": row[0], "operation_id": row[2], "replayed": True}
            ref = "sim_" + uuid.uuid4().hex[:16]
            self._db.execute(
                "INSERT INTO effects (ref, operation_id, idempotency_key, body_digest, body,"
                " headers, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (ref, operation_id, key, digest, body, json.dumps(headers), self._clock()),
            )
        return 201, {"id": ref, "operation_id": operation_id, "replayed": False}

    def lookup(self, operation_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT ref, operation_id, created_at FROM effects WHERE operation_id = ?"
                " ORDER BY seq LIMIT 1",
                (operation_id,),
            ).fetchone()
        return None if row is None else {"id": row[0], "operation_id": row[1], "time": row[2]}

    def list(self, operation_id: str | None = None) -> list[dict[str, Any]]:
        query = (
            "SELECT seq, ref, operation_id, idempotency_key, body, headers, created_at FROM effects"
        )
        args: tuple[Any, ...] = ()
        if operation_id is not None:
            query += " WHERE operation_id = ?"
            args = (operation_id,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY seq", args).fetchall()
        return [
            {
                "seq": r[0],
                "id": r[1],
                "operation_id": r[2],
                "idempotency_key": r[3],
                "body": json.loads(r[4]),
                "headers": json.loads(r[5]),
                "time": r[6],
            }
            for r in rows
        ]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM effects").fetchone()[0])

    def clear(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM effects")

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass(frozen=True)
class Answer:
    """How a send that acted is answered: ``status`` and ``body`` after ``delay`` seconds;
    or never (``hang``: nothing for ``delay`` seconds, then the connection closes); or by a
    reset connection (``reset``)."""

    status: int
    body: dict[str, Any]
    delay: float = 0.0
    hang: bool = False
    reset: bool = False


def wait_before_acting(fault: Fault | None) -> float:
    """Seconds a send waits before it acts (``slow``); a client gone by then gets nothing."""
    return fault.delay if fault is not None and fault.kind == "slow" else 0.0


class Simulator:
    """The state behind the endpoints: effects, capabilities, the fault plan, and what one
    send does (module docstring). ``data``: the effects' SQLite file (``":memory:"`` for
    the in-process fake); ``clock``: the effects' time."""

    def __init__(
        self,
        data: str,
        config: SimulatorConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.effects = Effects(data, clock=clock)
        self.config = config or SimulatorConfig()
        self.stopping = threading.Event()
        self._faults: list[Fault] = []
        self._random = random.Random()
        self._plan_lock = threading.Lock()
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._stats_lock = threading.Lock()

    def count(self, name: str) -> None:
        with self._stats_lock:
            self._stats[name] += 1

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    # -- the fault plan -------------------------------------------------------------------------
    def set_faults(self, raw: Any) -> None:
        if not isinstance(raw, dict) or not isinstance(raw.get("faults", []), list):
            raise ConfigError("faults", 'expected {"faults": [RULE, ...], "seed": N}')
        faults = [Fault.from_json(rule) for rule in raw.get("faults", [])]
        with self._plan_lock:
            self._faults = faults
            if raw.get("seed") is not None:
                self._random.seed(raw["seed"])

    def faults(self) -> list[dict[str, Any]]:
        with self._plan_lock:
            return [f.to_json() for f in self._faults]

    def next_fault(self, operation_id: str | None) -> Fault | None:
        """The first rule matching this send (a counted rule is used up by it)."""
        with self._plan_lock:
            for fault in self._faults:
                if fault.operation_id is not None and fault.operation_id != operation_id:
                    continue
                if fault.count is not None:
                    if fault.count <= 0:
                        continue
                    fault.count -= 1
                    return fault
                if fault.probability is not None:
                    if self._random.random() < fault.probability:
                        return fault
                    continue
                return fault
        return None

    # -- a send ---------------------------------------------------------------------------------
    def refusal(self, fault: Fault | None) -> Refusal | None:
        """The answer of a send that ``fault`` stops before it acts, or None (it acts)."""
        if fault is None or fault.kind in ("none", "slow", "late", "hang", "reset", "error_after"):
            return None
        if fault.kind == "error_before":
            status = fault.status or 500
            return Refusal(status, {"error": f"simulated {status} before acting"})
        status = fault.status or REFUSALS[fault.kind]
        headers: dict[str, str] = {}
        if status in (429, 503):
            headers["Retry-After"] = fault.retry_after or "1"
        return Refusal(status, {"error": f"simulated {fault.kind} ({status})"}, headers)

    def begin_send(
        self, operation_id: str | None, override: Fault | None = None
    ) -> tuple[Fault | None, Refusal | None]:
        """Step 1 of a send: the fault that applies (``override``, from ``X-Sim-Fault``, else
        the plan's), counted, and the refusal to answer if it stops the send before acting."""
        fault = override if override is not None else self.next_fault(operation_id)
        refusal = self.refusal(fault)
        self.count("sends")
        if fault is not None:
            self.count("faults")
            log.info(
                "fault",
                extra=fields(kind=fault.kind, operation_id=operation_id, delay=fault.delay),
            )
        return fault, refusal

    def act(
        self,
        fault: Fault | None,
        operation_id: str | None,
        key: str | None,
        body: str,
        headers: dict[str, str],
        *,
        idempotent: bool,
    ) -> Answer:
        """Step 3: make the effect (or replay it under its key) and say how it is answered."""
        status, answer = self.effects.send(operation_id, key, body, headers, idempotent=idempotent)
        self.count({201: "effects", 200: "replays"}.get(status, "conflicts"))
        if fault is None or fault.kind in ("none", "slow") or status == 409:
            return Answer(status, answer)
        # The effect is made (or replayed); now the answer goes wrong.
        if fault.kind == "late":
            return Answer(status, answer, delay=fault.delay)
        if fault.kind == "hang":
            return Answer(status, answer, delay=fault.delay or MAX_HANG_SECONDS, hang=True)
        if fault.kind == "reset":
            return Answer(status, answer, reset=True)
        code = fault.status or 500  # error_after
        return Answer(code, {"error": f"simulated {code} after acting", "id": answer["id"]})

    def lookup(self, operation_id: str, *, enabled: bool) -> dict[str, Any] | None:
        """The first effect made for ``operation_id``; None when there is none or lookup is
        off (``enabled``: the run's setting or the request's override)."""
        self.count("lookups")
        if not enabled:
            return None
        found = self.effects.lookup(operation_id)
        if found is not None:
            self.count("lookups_found")
        return found


def _number(value: Any, name: str, *, integer: bool = False, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number, not {value!r}")
    if integer and int(value) != value:
        raise ConfigError(name, "must be a whole number")
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be at least {minimum:g}")
    return int(value) if integer else float(value)


def _parse_float(value: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(name, f"{value!r} is not a number") from None


def _format_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
