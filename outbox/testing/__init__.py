"""``outbox.testing``: run the real pipeline inline in your own tests.

```python
# conftest.py
pytest_plugins = ["outbox.testing"]

# test_quotes.py
def test_approving_a_quote_sends_one_email(outbox_pipeline):
    p = outbox_pipeline
    mail = p.fake_provider("mail")
    p.consumer("billing", {"quote.approved": on_quote_approved})
    p.worker({"send-quote": send_quote}, providers={"mail": mail})
    approve_quote(p.outbox, 17)
    p.drain()
    p.assert_effects("send-quote-17", 1)
```

- :class:`Pipeline`: an ``Outbox``, a ``Store``, a relay, consumers and workers with your
  handlers, on the embedded default (SQLite file + embedded Redis, private to the test) or
  on your PostgreSQL and Redis (a schema and a key prefix of its own, dropped afterwards);
  ``drain()`` steps them until nothing moves and returns a :class:`DrainResult`.
- Assertions that show what they found instead: ``assert_emitted``, ``assert_jobs``,
  ``assert_receipts``, ``assert_effects``, ``assert_reconciled``.
- :class:`FakeProvider`: the connector simulator's semantics in-process (the same decision
  core as ``outbox-simulator serve``), with scripted faults and recorded effects.
- :class:`Clock`: ``pipeline.clock.advance(days=3)`` and ``drain()`` again: timers fire,
  leases expire, backoffs end, with no waiting.
- Kill points: ``pipeline.kill_at("after_accepted")``, ``drain()``, ``restart()``.

The pytest plugin (fixtures ``outbox_pipeline``, ``outbox_clock``; options
``--outbox-database-url``, ``--outbox-redis-url``) is active only where a conftest enables
it with ``pytest_plugins = ["outbox.testing"]``. See docs/testing.md.
"""

from __future__ import annotations

from outbox.testing.asserts import Effect
from outbox.testing.clock import Clock
from outbox.testing.fake import FakeProvider
from outbox.testing.pipeline import KILL_POINTS, DrainError, DrainResult, Killed, Pipeline
from outbox.testing.plugin import (
    outbox_clock,
    outbox_database_url,
    outbox_pipeline,
    outbox_redis_url,
    pytest_addoption,
)

__all__ = [
    "KILL_POINTS",
    "Clock",
    "DrainError",
    "DrainResult",
    "Effect",
    "FakeProvider",
    "Killed",
    "Pipeline",
    "outbox_clock",
    "outbox_database_url",
    "outbox_pipeline",
    "outbox_redis_url",
    "pytest_addoption",
]
