"""Structured logs: JSON lines for machines, key=value lines for a terminal."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from outbox import tracing
from outbox.errors import ConfigError


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        ids = tracing.log_ids()  # the active span's, when there is one (outbox.tracing)
        if ids is not None:
            entry["trace_id"], entry["span_id"] = ids
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class KeyValueFormatter(logging.Formatter):
    """Human-readable lines for a terminal: ``time level message key=value ...``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        base = f"{stamp} {record.levelname:<7} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


def setup_logging(level: str = "info", json_logs: bool | None = None) -> None:
    """Logs to stderr: JSON lines unless stderr is a terminal (or ``json_logs`` says)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError("log_level", f"{level!r} is not a log level")
    use_json = (not sys.stderr.isatty()) if json_logs is None else json_logs
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # httpx logs every request at INFO ("HTTP Request: POST ... 200"): one line per provider
    # call drowns the worker's own log. Its lines show at debug only.
    quiet = logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(quiet)


def fields(**values: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(a=1))``: structured fields for our formatters."""
    return {"fields": values}
