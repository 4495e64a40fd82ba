"""Inbound secrets per tenant (issue 53: "one inbound secret for every tenant: a signed reply
by job id reaches another tenant's job").

:class:`consumer.jobs.inbound.InboundApp` takes ``tenant_secrets={"studio": [...], ...}``
beside (or instead of) the shared ``secret``. A sender of one tenant names it in
``X-Outbox-Tenant`` and signs with that tenant's secret (:func:`consumer.jobs.inbound.sign`,
the same scheme). Its requests are **scoped** to that tenant:

- a reply reaches only that tenant's jobs: by ``{tenant, action}`` of that tenant, or by a
  job id whose job is that tenant's;
- a delivery callback reaches only the operations of that tenant's jobs (an operation id is
  ``"<job id>:<name>"``, so its job is known even before the receipt exists).

Anything else is a **404** ``no such job``: the same answer as a job that does not exist, so a
tenant learns nothing about another's ids. A request with ``X-Outbox-Tenant`` is verified with
that tenant's secrets only (an unknown tenant: 401); one without it, with the shared secrets
only (unscoped: an operator's, or a single-tenant deployment's).

**Rotation**: each tenant takes several secrets, any of which verifies. Add the new one,
move the sender to it, then drop the old one. The shared secret rotates the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from consumer.errors import JobNotFound
from consumer.jobs.store import Store
from outbox.cli import UsageError
from outbox.errors import ConfigError
from outbox.validate import INT64_MAX, int_problem, load_json, text_problem

TENANT_HEADER = "X-Outbox-Tenant"
MIN_SECRET = 16

Secrets = str | bytes | Sequence[str | bytes]


def secrets_of(secret: Secrets, name: str = "secret") -> list[bytes]:
    """One secret or several (a rotation), each of :data:`MIN_SECRET` characters or more."""
    given = [secret] if isinstance(secret, (str, bytes)) else list(secret)
    keys = [s.encode() if isinstance(s, str) else s for s in given]
    if not keys or any(not isinstance(k, bytes) or len(k) < MIN_SECRET for k in keys):
        raise ConfigError(name, f"needs {MIN_SECRET} characters or more (each, when several)")
    return keys


@dataclass(frozen=True)
class Keys:
    """The shared secrets (unscoped requests) and each tenant's (scoped to it)."""

    shared: list[bytes] = field(default_factory=list)
    tenants: dict[str, list[bytes]] = field(default_factory=dict)

    @classmethod
    def build(cls, secret: Secrets | None, tenant_secrets: Mapping[str, Secrets] | None) -> Keys:
        tenants: dict[str, list[bytes]] = {}
        for tenant, given in (tenant_secrets or {}).items():
            problem = text_problem(tenant, limit=200) if isinstance(tenant, str) else "text"
            if problem is not None or not tenant:
                raise ConfigError("tenant_secrets", f"{tenant!r}: not a tenant name")
            tenants[tenant] = secrets_of(given, f"tenant_secrets[{tenant!r}]")
        if secret is None and not tenants:
            raise ConfigError("secret", "give a shared secret, tenant_secrets, or both")
        return cls(secrets_of(secret) if secret is not None else [], tenants)

    def for_request(self, headers: Mapping[str, str]) -> tuple[list[bytes], str | None]:
        """The secrets that may sign this request, and the tenant it is scoped to (None:
        unscoped). No secret (refused) for a tenant without secrets here."""
        tenant = headers.get(TENANT_HEADER.lower())
        if tenant is None:
            return self.shared, None
        return self.tenants.get(tenant, []), tenant


def server_secrets(
    secret: str, secret_file: str | None, tenant_file: str | None
) -> tuple[str | None, dict[str, Secrets] | None]:
    """``outbox-worker inbound serve``'s secrets: the shared one (``OUTBOX_INBOUND_SECRET``,
    else the first line of ``--secret-file``) and the tenants' (``--tenant-secrets``, a JSON
    object of tenant -> secret or list of secrets). UsageError (exit 2) naming what is wrong;
    one of the two is required."""
    if not secret and secret_file:
        secret = _read(secret_file, "--secret-file").splitlines()[0].strip()
    tenants = _tenant_file(tenant_file) if tenant_file else None
    if not secret and not tenants:
        raise UsageError(
            "inbound serve needs a secret: OUTBOX_INBOUND_SECRET, --secret-file or --tenant-secrets"
        )
    try:
        Keys.build(secret or None, tenants)
    except ConfigError as exc:
        raise UsageError(f"the inbound secrets: {exc}") from None
    return secret or None, tenants


def _tenant_file(path: str) -> dict[str, Secrets]:
    """``--tenant-secrets``: a JSON object of tenant -> secret or list of secrets."""
    try:
        found = load_json(_read(path, "--tenant-secrets"))
    except ValueError as exc:
        raise UsageError(f"--tenant-secrets: {exc}") from None
    if not isinstance(found, dict) or not all(
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        for v in found.values()
    ):
        raise UsageError("--tenant-secrets: a JSON object of tenant -> secret or [secrets]")
    return found


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read() or "\n"
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag}: cannot read {path!r}: {exc}") from None


def check_reply(store: Store, data: Mapping[str, Any], tenant: str | None) -> None:
    """A reply of a request scoped to ``tenant`` names one of its jobs (else JobNotFound)."""
    if tenant is None:
        return
    job = data.get("job")
    if isinstance(job, Mapping):
        if job.get("tenant") != tenant:
            raise JobNotFound("no such job")
        return
    if isinstance(job, int) and not isinstance(job, bool) and _tenant_of(store, job) != tenant:
        raise JobNotFound("no such job")


def check_delivery(store: Store, data: Mapping[str, Any], tenant: str | None) -> None:
    """A callback of a request scoped to ``tenant`` names an operation of one of its jobs
    (``"<job id>:<name>"``), else JobNotFound."""
    if tenant is None:
        return
    operation = data.get("operation_id")
    head = operation.partition(":")[0] if isinstance(operation, str) else ""
    if int_problem(head, minimum=1, maximum=INT64_MAX) is not None:
        raise JobNotFound("no such job")
    if _tenant_of(store, int(head)) != tenant:
        raise JobNotFound("no such job")


def _tenant_of(store: Store, job_id: int) -> str | None:
    try:
        return store.get(job_id).tenant
    except JobNotFound:
        return None


__all__ = [
    "TENANT_HEADER",
    "Keys",
    "check_delivery",
    "check_reply",
    "secrets_of",
    "server_secrets",
]
