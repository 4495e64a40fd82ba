"""The pytest plugin: fixtures that give each test a pipeline of its own.

Enabled only where the user asks for it, in a ``conftest.py``::

    pytest_plugins = ["outbox.testing"]

(never through an entry point: a project that does not enable it gets no fixture and no
option from it).

- ``outbox_pipeline``: a :class:`~outbox.testing.Pipeline` for the test, closed afterwards.
  On the embedded default (a SQLite file and an embedded Redis in the test's ``tmp_path``),
  or on your servers when ``outbox_database_url`` / ``outbox_redis_url`` name them: the
  command-line options ``--outbox-database-url`` / ``--outbox-redis-url``, the ini settings
  of the same names, or fixtures of those names that your conftest overrides.
- ``outbox_clock``: the pipeline's clock (``outbox_clock.advance(days=3)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.testing.clock import Clock
from outbox.testing.pipeline import Pipeline

_OPTIONS = {
    "outbox_database_url": "PostgreSQL (a schema per test) or SQLite URL for outbox_pipeline "
    "(default: a SQLite file in the test's tmp_path)",
    "outbox_redis_url": "Redis URL for outbox_pipeline, keys prefixed per test "
    "(default: an embedded Redis server per test)",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outbox", "outbox.testing: the pipeline in one test")
    for name, help_text in _OPTIONS.items():
        group.addoption("--" + name.replace("_", "-"), dest=name, default=None, help=help_text)
        parser.addini(name, help_text, default=None)


def _setting(config: pytest.Config, name: str) -> str | None:
    value = config.getoption(name, default=None) or config.getini(name)
    return str(value) if value else None


@pytest.fixture
def outbox_database_url(request: pytest.FixtureRequest) -> str | None:
    """The database ``outbox_pipeline`` uses; None: the embedded SQLite file."""
    return _setting(request.config, "outbox_database_url")


@pytest.fixture
def outbox_redis_url(request: pytest.FixtureRequest) -> str | None:
    """The Redis ``outbox_pipeline`` uses; None: an embedded server of the test's own."""
    return _setting(request.config, "outbox_redis_url")


@pytest.fixture
def outbox_pipeline(
    tmp_path: Path, outbox_database_url: str | None, outbox_redis_url: str | None
) -> Iterator[Pipeline]:
    """The real pipeline, private to this test (module docstring)."""
    pipeline = Pipeline(tmp_path, database_url=outbox_database_url, redis_url=outbox_redis_url)
    try:
        yield pipeline
    finally:
        pipeline.close()


@pytest.fixture
def outbox_clock(outbox_pipeline: Pipeline) -> Clock:
    """The clock of ``outbox_pipeline``."""
    return outbox_pipeline.clock
