"""The users' side of outbox.testing: one line enables the plugin (its fixtures
``outbox_pipeline`` and ``outbox_clock``); the rest is this application's own fixture."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from quotes import Quotes

if TYPE_CHECKING:  # imported by the plugin itself, after pytest prepared its assertions
    from outbox.testing import Pipeline

pytest_plugins = ["outbox.testing"]


@pytest.fixture
def app(outbox_pipeline: Pipeline) -> Quotes:
    """The application on the test's pipeline, with quote 17 waiting for approval."""
    quotes = Quotes(outbox_pipeline.outbox, outbox_pipeline.store)
    quotes.create(17, "client@example.com")
    return quotes
