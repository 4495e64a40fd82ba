"""The console's JSON API as an OpenAPI 3.0 description, served at ``GET /api/openapi.json``
(no token needed: it describes, it reveals nothing of the data). Clients can be generated
from it, and the test suite fuzzes the API from it with schemathesis
(``tests/test_console_fuzz.py``): every answer to a generated request must be a 2xx or 4xx.

Keep it beside the routes in :mod:`outbox.console.app`: a route without an entry here is
not fuzzed.
"""

from __future__ import annotations

from typing import Any

from outbox.console.queries import MAX_PAGE, TRACE_LIMIT


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {}}}}


def _query(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema or {"type": "string"},
    }


def _target(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string"},
    }


_PAGE = [
    _query("cursor", "next_cursor of the previous page"),
    _query("limit", "rows per page", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}),
]
_ANSWERS = {
    "200": _json("the answer"),
    "400": _json("a bad parameter, named"),
    "401": _json("no valid token"),
    "404": _json("no such record"),
    "429": _json("too many wrong tokens from this client"),
}
_ACTION_ANSWERS = {**_ANSWERS, "403": _json("read-only console"), "409": _json("refused")}
_WHY: dict[str, Any] = {
    "reason": {"type": "string", "description": "why (required; audited)"},
    "by": {"type": "string", "description": "who, as the audit records it"},
}
_REASON: dict[str, Any] = {"type": "object", "properties": _WHY}


def _read(summary: str, parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"get": {"summary": summary, "parameters": parameters or [], "responses": _ANSWERS}}


def _action(
    summary: str, target: dict[str, Any], body: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [target],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": body or _REASON}},
            },
            "responses": _ACTION_ANSWERS,
        }
    }


def openapi() -> dict[str, Any]:
    """The description (a JSON-able dict)."""
    settle = {
        "type": "object",
        "properties": {
            **_WHY,
            "accepted": {"type": "string", "description": "the provider's reference"},
            "not_sent": {"type": "boolean"},
        },
    }
    bulk = {
        "type": "object",
        "properties": {
            **_WHY,
            "filters": {"type": "object", "additionalProperties": {"type": "string"}},
            "confirm": {"type": "boolean"},
        },
    }
    paths: dict[str, Any] = {
        "/api/overview": _read("backlog, jobs, receipts, dead letters, workers"),
        "/api/trace": _read(
            "one business identity's story",
            [
                {
                    "name": "q",
                    "in": "query",
                    "required": True,
                    "description": "identity, key, event id, job id or operation id",
                    "schema": {"type": "string"},
                },
                _query("cursor", "next_cursor of the previous page of this trace"),
                _query(
                    "limit",
                    "events and jobs per page",
                    {"type": "integer", "minimum": 1, "maximum": TRACE_LIMIT},
                ),
            ],
        ),
        "/api/trace/value": _read(
            "the whole of a long value a trace showed cut (its *_capped.whole)",
            [
                _query("kind", "event, job, attempt, reply, receipt, dead_letter or audit"),
                _query("id", "the record's key"),
                _query("column", "the column whose value was cut"),
            ],
        ),
        "/api/events": _read(
            "outbox events, newest first",
            [_query("topic", "topic"), _query("key", "key"), _query("state", "state"), *_PAGE],
        ),
        "/api/jobs": _read(
            "jobs, newest first",
            [
                _query("state", "state"),
                _query("tenant", "tenant"),
                _query("action", "action"),
                *_PAGE,
            ],
        ),
        "/api/receipts": _read("operation receipts", [_query("state", "state"), *_PAGE]),
        "/api/dead-letters": _read(
            "dead letters", [_query("group", "group"), _query("state", "state"), *_PAGE]
        ),
        "/api/dead-letters/{entry_id}": _read(
            "one dead letter with its payload", [_target("entry_id", "record id")]
        ),
        "/api/audit": _read(
            "the audit of operator actions",
            [_query("action", "action"), _query("target", "target id"), *_PAGE],
        ),
        "/api/queues": _read("queues: READY, oldest READY age, LEASED, paused"),
        "/api/schedules": _read("schedules and their next slot"),
        "/api/graph": _read(
            "a job's whole graph of steps, by level, and its progress",
            [
                {**_query("job", "job id", {"type": "integer", "minimum": 1}), "required": True},
                _query("limit", "jobs read at most", {"type": "integer", "minimum": 1}),
            ],
        ),
        "/api/keys": _read(
            "an order key's line: what runs, what waits HELD behind it, what holds it",
            [
                {**_query("key", "the order key"), "required": True},
                _query("limit", "HELD jobs listed", {"type": "integer", "minimum": 1}),
            ],
        ),
        "/api/events/{event_id}/requeue": _action(
            "put a quarantined event back", _target("event_id", "event id")
        ),
        "/api/jobs/{job_id}/resume": _action("make a waiting job READY", _target("job_id", "id")),
        "/api/jobs/{job_id}/cancel": _action("cancel a job", _target("job_id", "job id")),
        "/api/receipts/{operation_id}/settle": _action(
            "settle an UNKNOWN receipt", _target("operation_id", "operation id"), settle
        ),
        "/api/dead-letters/{entry_id}/replay": _action(
            "replay a dead letter", _target("entry_id", "record id")
        ),
        "/api/bulk/{kind}": _action(
            "an action on every match of a filter (count first, then confirm)",
            _target("kind", "requeue, replay, resume or cancel"),
            bulk,
        ),
        "/api/queues/{queue}/pause": _action("pause a queue", _target("queue", "queue name")),
        "/api/queues/{queue}/resume": _action("resume a queue", _target("queue", "queue name")),
        "/api/schedules/{name}/pause": _action("pause a schedule", _target("name", "name")),
        "/api/schedules/{name}/resume": _action("resume a schedule", _target("name", "name")),
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "outbox console API",
            "version": "1",
            "description": "Reads and audited actions of the outbox toolkit's operator console "
            "(docs/reference/console-api.md).",
        },
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
