"""The in-process test double of a provider (tests only; not shipped).

:class:`SimulatedProvider` keeps its effects in a SQLite file (so they survive a killed
worker), can accept and then time out or hang, and switches lookup and idempotency support.
:func:`simulator_from_env` builds one from ``SIM_*`` variables for worker subprocesses.
The connector simulator *service* (``outbox-simulator serve``) replaces it where a test needs
real HTTP.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Mapping
from typing import Any

from consumer.errors import JobError, PermanentFailure, ProviderTimeout


class SimulatedProvider:
    """A provider whose effects are rows in a SQLite file (visible across processes).

    ``mode``: ``"ok"``; ``"timeout_after_accept"`` (the effect is made, then
    ``ProviderTimeout``); ``"hang_after_accept"`` (the effect is made, a ``<path>.accepted``
    marker file is written, then the call blocks: a test SIGKILLs the worker there);
    ``"reject"`` (``PermanentFailure``). ``lookup`` and ``idempotency`` switch the two
    reconciliation aids.
    """

    def __init__(
        self,
        path: str,
        name: str = "sim",
        *,
        mode: str = "ok",
        lookup: bool = True,
        idempotency: bool = False,
        timeout: float | None = None,
    ) -> None:
        if mode not in ("ok", "timeout_after_accept", "hang_after_accept", "reject"):
            raise JobError("mode", f"unknown simulator mode {mode!r}")
        self.path = path
        self.name = name
        self.mode = mode
        self.supports_lookup = lookup
        self.supports_idempotency = idempotency
        if timeout is not None:
            self.timeout = timeout  # seconds one call may take (Operations' call deadline)
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS effects (ref TEXT PRIMARY KEY, operation_id TEXT,"
                " idempotency_key TEXT UNIQUE, request TEXT)"
            )

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30, isolation_level=None)

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        if self.mode == "reject":
            raise PermanentFailure("rejected by the simulated provider")
        with self._db() as db:
            if idempotency_key is not None:
                row = db.execute(
                    "SELECT ref FROM effects WHERE idempotency_key = ?", (idempotency_key,)
                ).fetchone()
                if row is not None:
                    return str(row[0])
            ref = f"{self.name}-{uuid.uuid4().hex[:12]}"
            db.execute(
                "INSERT INTO effects VALUES (?, ?, ?, ?)",
                (ref, operation_id, idempotency_key, json.dumps(request)),
            )
        if self.mode == "timeout_after_accept":
            raise ProviderTimeout("the simulated provider accepted, then the answer was lost")
        if self.mode == "hang_after_accept":
            with open(self.path + ".accepted", "w") as fh:
                fh.write(ref)
            while True:  # a worker stuck on a provider call: the test kills it here
                time.sleep(1)
        return ref

    def lookup(self, operation_id: str) -> str | None:
        if not self.supports_lookup:
            raise NotImplementedError("this provider has no lookup")
        with self._db() as db:
            row = db.execute(
                "SELECT ref FROM effects WHERE operation_id = ?", (operation_id,)
            ).fetchone()
        return None if row is None else str(row[0])

    def effects(self) -> list[tuple[str, str]]:
        """(ref, operation_id) of every effect made, for tests."""
        with self._db() as db:
            return [
                (str(r[0]), str(r[1])) for r in db.execute("SELECT ref, operation_id FROM effects")
            ]


def simulator_from_env() -> SimulatedProvider:
    """The simulator configured by ``SIM_PATH``, ``SIM_MODE``, ``SIM_LOOKUP``,
    ``SIM_IDEMPOTENCY``, ``SIM_TIMEOUT`` (for worker subprocesses in tests)."""
    return SimulatedProvider(
        os.environ["SIM_PATH"],
        mode=os.environ.get("SIM_MODE", "ok"),
        lookup=os.environ.get("SIM_LOOKUP", "1") == "1",
        idempotency=os.environ.get("SIM_IDEMPOTENCY", "0") == "1",
        timeout=float(os.environ["SIM_TIMEOUT"]) if os.environ.get("SIM_TIMEOUT") else None,
    )
