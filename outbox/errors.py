"""The outbox's errors: a short tree, each documented by its docstring."""

from __future__ import annotations


class OutboxError(Exception):
    """Base of every error raised on purpose by the toolkit."""


class InvalidEvent(OutboxError, ValueError):
    """An event failed validation before anything was written.

    ``field`` names the offending field (``topic``, ``key``, ``tenant``, ``identity``,
    ``payload``, ``headers``, ``event_id``); the message says what is wrong with it.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid event {field}: {problem}")
        self.field = field
        self.problem = problem


class ConfigError(OutboxError, ValueError):
    """A configuration value is invalid; the message names the setting."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"invalid configuration {setting}: {problem}")
        self.setting = setting
        self.problem = problem


class BrokerUnavailable(ConnectionError):
    """The broker does not answer (connection refused, lost, timed out): an outage, waited
    out like Redis's. A publish that raised it may have been added in part: the relay
    reconciles it."""
