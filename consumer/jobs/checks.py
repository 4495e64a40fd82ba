"""Validation of what the job store is given, before anything reaches a database.

Every public entry point of ``Store`` checks its arguments here; each failure is a
``JobError`` naming the field. Names follow the shared rules of ``outbox.validate``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, and_

from consumer.errors import JobError
from consumer.jobs.order_keys import key_values
from consumer.jobs.rows import Lease
from consumer.jobs.schema import DEFAULT_QUEUE, db_epoch, jobs
from outbox import tracing
from outbox.errors import ConfigError
from outbox.validate import check_name, check_number, json_problem

Time = float | int | datetime
"""A time argument: unix seconds, or a datetime (naive means UTC)."""

NO_TIMER: dict[str, Any] = {
    "timer_scheduled_for": None,
    "timer_reason": None,
    "timer_subject_version": None,
    "timer_cancellation_condition": None,
}


SPEC_FIELDS = frozenset(
    {
        "tenant",
        "action",
        "subject",
        "subject_version",
        "payload",
        "priority",
        "run_after",
        "kind",
        "provider",
        "queue",
        "order_key",
        "hold",
        "concurrency_key",
        "concurrency_limit",
    }
)


# One shared expression (SQLAlchemy elements are immutable): building one per row cost about a
# fifth of enqueue_many's CPU.
_DB_NOW = db_epoch()


def job_values(
    tenant: str,
    action: str,
    *,
    subject: str | None = None,
    subject_version: str | int | None = None,
    payload: Any = None,
    priority: int = 0,
    run_after: Time | None = None,
    kind: str | None = None,
    provider: str | None = None,
    queue: str = DEFAULT_QUEUE,
    order_key: str | None = None,
    hold: str = "wait",
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
    now: Time | None = None,
) -> dict[str, Any]:
    """Validate one job's fields (raising JobError naming the field); its row values. A job
    with an ``order_key`` is written HELD: the enqueue's promotion
    (``consumer.jobs.order_keys.release``) makes it READY when its key has no head; so is
    a job with a ``concurrency_key``, admitted while its key has room."""
    # The natural consumer handler calls this once per event: the absent optional fields
    # (most of them) skip their checks.
    valid_name("tenant", tenant)
    valid_name("action", action)
    if subject is not None:
        valid_name("subject", subject)
    version = None if subject_version is None else valid_version("subject_version", subject_version)
    if queue is not DEFAULT_QUEUE:
        valid_name("queue", queue)
    if kind is not None:
        valid_name("kind", kind)
    if provider is not None:
        valid_name("provider", provider)
    keyed = key_values(order_key, hold, concurrency_key, concurrency_limit)
    if priority.__class__ is not int and (
        isinstance(priority, bool) or not isinstance(priority, int)
    ):
        raise JobError("priority", f"must be an integer, got {priority!r}")
    if payload is not None:
        valid_json("payload", payload)
    when = None if now is None else valid_time("now", now)
    after = None if run_after is None else valid_time("run_after", run_after)
    # A number when ``now`` was given; else the database clock as a SQL expression.
    stamp: Any = when if when is not None else _DB_NOW
    return {
        "tenant": tenant,
        "action": action,
        "queue": queue,
        "kind": kind,
        "subject": subject,
        "subject_version": version,
        "payload": payload,
        "provider": provider,
        "priority": priority,
        "run_after": after,
        "created_at": stamp,
        "updated_at": stamp,
        "trace_context": tracing.job_trace_context(),  # the enqueuing span's, if any
        **keyed,  # the state (HELD for a key's job) and the keys' columns
    }


def valid_name(field_name: str, value: object, *, optional: bool = False) -> None:
    """The shared name rules (``outbox.validate``: non-blank, at most 200 characters, no
    NUL), checked before anything reaches either database; ``JobError`` names the field."""
    check_name(field_name, value, JobError, required=not optional)


def valid_version(field_name: str, value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise JobError(field_name, f"must be a string or an integer, got {value!r}")
    text_value = str(value)
    valid_name(field_name, text_value)
    return text_value


def valid_ttl(ttl: object) -> float:
    return check_number("ttl", ttl, JobError)


def valid_time(field_name: str, value: object) -> float | None:
    """A time argument as unix seconds: a number, or a datetime (naive means UTC)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return aware.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JobError(field_name, f"must be unix seconds or a datetime, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise JobError(field_name, f"must be a finite, non-negative time, got {value!r}")
    return float(value)


def valid_json(field_name: str, value: object) -> None:
    # PostgreSQL's jsonb refuses NUL in strings and neither database encodes a lone
    # surrogate, while SQLite stores the first: refused on both, as JobError naming the
    # field, never the driver's DataError (outbox.validate.json_problem).
    problem = json_problem(value, max_depth=JSON_DEPTH)
    if problem is not None:
        raise JobError(field_name, problem)


JSON_DEPTH = 512
"""The deepest payload a job or a reply may hold (objects and arrays)."""


def error_text(error: object) -> str:
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"[:2000]
    if not isinstance(error, str):
        raise JobError("error", f"must be a string or an exception, got {error!r}")
    return error[:2000]


def job_key(job: object, action: str | None) -> tuple[ColumnElement[bool], str]:
    """A job reference: a Lease, a job id, ``(tenant, action)`` or ``tenant, action``."""
    if isinstance(job, Lease):
        return jobs.c.id == job.job_id, f"{job.tenant}/{job.action}"
    if isinstance(job, int) and not isinstance(job, bool):
        if action is not None:
            raise JobError("action", "give a job id or (tenant, action), not both")
        return jobs.c.id == job, f"#{job}"
    if isinstance(job, tuple) and len(job) == 2 and action is None:
        job, action = job
    if isinstance(job, str):
        valid_name("tenant", job)
        valid_name("action", action)
        return and_(jobs.c.tenant == job, jobs.c.action == action), f"{job}/{action}"
    raise JobError("job", f"expected a Lease, a job id or (tenant, action), got {job!r}")


def valid_holder(
    job: object, action: str | None, worker: str | None, epoch: int | None
) -> tuple[ColumnElement[bool], str, str, int]:
    if isinstance(job, Lease):
        worker = job.worker if worker is None else worker
        epoch = job.epoch if epoch is None else epoch
    where, label = job_key(job, action)
    valid_name("worker", worker)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise JobError("epoch", f"must be a positive integer (from claim), got {epoch!r}")
    assert worker is not None
    return where, label, worker, epoch


# -- worker settings (consumer.jobs.worker.WorkerConfig) ------------------------------------


# complexity: one check per form of queues (names, mapping, slots), each naming it
def check_queue_settings(config: Any) -> None:
    """A ``WorkerConfig``'s ``queues`` (a list of names, kept as a tuple; None: every queue;
    or a mapping of names to slots of their own, None sharing, which sets ``queue_slots``
    too), ``queue_slots`` (queue -> positive slots, each queue one of ``queues``, kept as a
    dict), ``tenant_limit`` (a positive integer or None) and ``tenant_limits`` (tenant ->
    limit, kept as a dict). ``ConfigError`` names the field."""
    queues = config.queues
    slots = config.queue_slots
    slots_field = "queue_slots"
    if isinstance(queues, Mapping):
        # One mapping says both which queues and their slots (``--queues mail=8,billing``):
        # it replaces ``queue_slots``, so ``replace(config, queues={...})`` means what it says.
        slots = {name: value for name, value in queues.items() if value is not None}
        queues, slots_field = list(queues), "queues"
    if queues is not None:
        if isinstance(queues, str) or not isinstance(queues, (list, tuple)):
            raise ConfigError("queues", f"must be a list of queue names, got {queues!r}")
        if not queues:
            raise ConfigError("queues", "must name at least one queue (None: every queue)")
        for name in queues:
            check_name("queues", name, ConfigError)
        object.__setattr__(config, "queues", tuple(dict.fromkeys(queues)))
    if not isinstance(slots, Mapping):
        raise ConfigError("queue_slots", f"must map queues to slots, got {slots!r}")
    for name, value in slots.items():
        check_name(slots_field, name, ConfigError)
        check_number(slots_field, value, ConfigError, integer=True, item=name)
        if config.queues is None or name not in config.queues:
            raise ConfigError(
                "queue_slots",
                f"{name!r} is not one of the worker's queues: name the queues (queues=[...]) "
                "to give one slots of its own",
            )
    object.__setattr__(config, "queue_slots", dict(slots))
    limit = config.tenant_limit
    if limit is not None:
        check_number("tenant_limit", limit, ConfigError, integer=True)
    limits = config.tenant_limits
    if not isinstance(limits, Mapping):
        raise ConfigError("tenant_limits", f"must map tenants to limits, got {limits!r}")
    for tenant, value in limits.items():
        check_name("tenant_limits", tenant, ConfigError)
        check_number("tenant_limits", value, ConfigError, integer=True, item=tenant)
    object.__setattr__(config, "tenant_limits", dict(limits))


def tenant_limits(config: Any) -> dict[str, Any]:
    """A worker's tenant limits, as ``Store.claim_batch`` takes them (and its queues)."""
    return {
        "tenant_limit": config.tenant_limit,
        "tenant_limits": config.tenant_limits,
        "queues": config.queues,
    }


def claim_filters(config: Any, handlers: Iterable[str]) -> dict[str, Any]:
    """What a worker's claim filters on: its queues, its handlers' names (so it never claims
    a job it has no handler for) and its tenant limits."""
    return {"routes": list(handlers), **tenant_limits(config)}


def valid_names(field_name: str, values: Iterable[str] | None) -> list[str] | None:
    """Queue or handler names as a list (None stays None: no filter)."""
    if values is None:
        return None
    if isinstance(values, str):
        raise JobError(field_name, f"must be a list of names, not one string {values!r}")
    names = list(values)
    for name in names:
        valid_name(field_name, name)
    return names


def valid_limit(field_name: str, value: object) -> int | None:
    """A tenant limit: a positive integer, or None (no limit)."""
    if value is None:
        return None
    return int(check_number(field_name, value, JobError, integer=True))


def valid_limits(values: Mapping[str, int] | None) -> dict[str, int]:
    """Per-tenant limits (tenant to limit), each checked; None is none."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise JobError("tenant_limits", f"must map tenants to limits, got {values!r}")
    checked: dict[str, int] = {}
    for tenant, value in values.items():
        valid_name("tenant_limits", tenant)
        limit = valid_limit("tenant_limits", value)
        if limit is None:
            raise JobError("tenant_limits", f"{tenant!r}: a limit must be a positive integer")
        checked[tenant] = limit
    return checked
