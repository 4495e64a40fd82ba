"""The checks of :class:`~consumer.jobs.http.HttpProvider`'s arguments: each refusal a
``ConfigError`` naming the argument, before the provider holds anything."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from outbox.errors import ConfigError
from outbox.extras import optional_module
from outbox.validate import check_number

if TYPE_CHECKING:
    import httpx
else:  # the [http] extra: this module imports without it, HttpProvider(...) names it
    httpx = optional_module("httpx", "http", "HttpProvider")

__all__ = ["check_header_name", "check_provider_arguments", "check_url"]


# complexity: one check per HttpProvider argument, each naming it (owner: effects)
def check_provider_arguments(
    name: str,
    send_url: str,
    *,
    lookup_url: str | None,
    idempotency_header: str | None,
    timeout: float,
    headers: Mapping[str, str] | None,
    client: httpx.Client | None,
    ref_field: str,
    operation_id_header: str,
    rate_limit: float | None,
    max_connections: int,
) -> None:
    """``ConfigError`` for the first argument of ``HttpProvider(...)`` that is wrong."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("name", "must be a non-empty string")
    check_url("send_url", send_url)
    if lookup_url is not None:
        check_url("lookup_url", lookup_url)
        try:
            lookup_url.format(operation_id="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                "lookup_url", f"must be a template with only {{operation_id}} ({exc!r})"
            ) from None
        if "{operation_id}" not in lookup_url:
            raise ConfigError("lookup_url", "must contain {operation_id}")
    if idempotency_header is not None:
        check_header_name("idempotency_header", idempotency_header)
    check_header_name("operation_id_header", operation_id_header)
    check_number("timeout", timeout, ConfigError)
    if headers is not None:
        if not isinstance(headers, Mapping):
            raise ConfigError("headers", "must be a mapping of header names to values")
        for key, value in headers.items():
            check_header_name("headers", key)
            if not isinstance(value, str) or "\r" in value or "\n" in value:
                raise ConfigError("headers", f"value of {key!r} must be a one-line string")
    if client is not None and not isinstance(client, httpx.Client):
        raise ConfigError("client", "must be an httpx.Client (the provider is synchronous)")
    if not isinstance(ref_field, str) or not ref_field or "" in ref_field.split("."):
        raise ConfigError("ref_field", "must be a JSON field name or a dotted path")
    if rate_limit is not None:
        check_number("rate_limit", rate_limit, ConfigError)  # calls per second
    check_number("max_connections", max_connections, ConfigError, integer=True)


def check_url(field: str, url: object) -> None:
    """An http:// or https:// URL httpx can read (``{operation_id}`` standing for a value)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(field, f"must be an http:// or https:// URL, not {url!r}")
    try:
        httpx.URL(url.replace("{operation_id}", "x"))
    except (httpx.InvalidURL, ValueError) as exc:
        raise ConfigError(field, f"is not a valid URL ({exc})") from None


def check_header_name(field: str, name: object) -> None:
    """A header name of token characters only."""
    # RFC 9110 token characters: letters, digits and !#$%&'*+-.^_`|~
    allowed = set("!#$%&'*+-.^_`|~")
    if (
        not isinstance(name, str)
        or not name
        or not all(c.isascii() and (c.isalnum() or c in allowed) for c in name)
    ):
        raise ConfigError(field, f"{name!r} is not a valid HTTP header name")
