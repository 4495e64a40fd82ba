import pytest
from quotes import Quotes

from outbox.testing import Pipeline


def test_approving_a_quote_emits_quote_approved_once(outbox_pipeline: Pipeline, app: Quotes):
    app.approve(17)
    outbox_pipeline.assert_emitted("quote.approved", 1, key="quote-17")


def test_a_failed_approval_emits_nothing(outbox_pipeline: Pipeline, app: Quotes):
    with pytest.raises(LookupError):
        app.approve(99)  # no such quote: the transaction rolls back, the event with it
    outbox_pipeline.assert_emitted("quote.approved", 0)
