"""The inbound endpoint (:mod:`consumer.jobs.inbound`) as an OpenAPI 3.0 description, served
at ``GET /openapi.json`` (no signature needed: it describes, it holds no data). Senders can
generate clients from it, and the test suite fuzzes the endpoint from it with schemathesis
(``tests/test_inbound_fuzz.py``): every answer to a generated request, signed or not, must
be a 2xx or a 4xx, never a 5xx or a 503.

Keep it beside the routes of :class:`consumer.jobs.inbound.InboundApp`: a route without an
entry here is not fuzzed (a test checks that every route is named).
"""

from __future__ import annotations

from typing import Any


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {}}}}


_SIGNED = [
    {
        "name": "X-Outbox-Timestamp",
        "in": "header",
        "required": False,
        "description": "unix seconds of the signature",
        "schema": {"type": "string"},
    },
    {
        "name": "X-Outbox-Signature",
        "in": "header",
        "required": False,
        "description": "v1= and the hex HMAC-SHA256 of 'timestamp.body'",
        "schema": {"type": "string"},
    },
    {
        "name": "X-Outbox-Tenant",
        "in": "header",
        "required": False,
        "description": "the tenant whose secret signed it: the request reaches its jobs only",
        "schema": {"type": "string"},
    },
]
_ANSWERS = {
    "200": _json("recorded (or a duplicate, said so)"),
    "202": _json("kept until its job or receipt exists"),
    "400": _json("bad input, the field named"),
    "401": _json("not signed, badly signed or stale (no reason given)"),
    "404": _json("no such job (or not this tenant's)"),
    "413": _json("body too large"),
    "503": _json("the database is unavailable: retry"),
}
_REPLY = {
    "type": "object",
    "required": ["job", "reply_id", "payload"],
    "properties": {
        "job": {
            "oneOf": [
                {"type": "integer", "minimum": 1},
                {
                    "type": "object",
                    "required": ["tenant", "action"],
                    "properties": {"tenant": {"type": "string"}, "action": {"type": "string"}},
                },
            ]
        },
        "reply_id": {"type": "string"},
        "payload": {},
        "source": {"type": "string"},
    },
}
_DELIVERY = {
    "type": "object",
    "required": ["operation_id", "status", "event_id"],
    "properties": {
        "operation_id": {"type": "string"},
        "status": {"type": "string", "enum": ["delivered", "bounced", "complained", "opened"]},
        "event_id": {"type": "string"},
        "ref": {"type": "string"},
        "detail": {"type": "string"},
    },
}


def _post(summary: str, schema: dict[str, Any], extra: list[Any] | None = None) -> Any:
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    parameters = [*_SIGNED, *(extra or [])]
    return {
        "post": {
            "summary": summary,
            "parameters": parameters,
            "requestBody": body,
            "responses": _ANSWERS,
        }
    }


def openapi() -> dict[str, Any]:
    """The description (a JSON-able dict)."""
    name = {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "the webhook's registered name",
        "schema": {"type": "string"},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "outbox inbound endpoint", "version": "1"},
        "paths": {
            "/replies": _post("a reply to a job", _REPLY),
            "/deliveries": _post("a delivery callback about an effect", _DELIVERY),
            "/webhooks/{name}": _post(
                "a provider's own webhook, verified by its own scheme",
                {"oneOf": [_DELIVERY, {"type": "array", "items": _DELIVERY}]},
                [name],
            ),
            "/healthz": {"get": {"summary": "a probe", "responses": {"200": _json("ok")}}},
        },
    }


__all__ = ["openapi"]
