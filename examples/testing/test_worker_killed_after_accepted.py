"""The seed's acceptance test, for this application's own handler: kill the worker after
the provider accepted, start another, observe exactly one effect and a reconciled receipt."""

from quotes import Quotes

from outbox.testing import Pipeline


def test_a_worker_killed_after_the_provider_accepted(outbox_pipeline: Pipeline, app: Quotes):
    p = outbox_pipeline
    mail = p.fake_provider("mail")
    p.consumer("billing", app.consumer_handlers)
    p.worker(app.worker_handlers, providers={"mail": mail})
    app.approve(17)

    p.kill_at("after_accepted")  # the email is sent, the worker dies before the receipt
    assert p.drain().killed == "after_accepted"
    p.restart()  # another worker, the same handlers
    p.clock.advance(minutes=1)  # the dead worker's lease expires
    p.drain()

    p.assert_effects("send-quote-17", 1)
    p.assert_reconciled("send-quote-17")
    p.assert_jobs(action="send-quote", DONE=1)
