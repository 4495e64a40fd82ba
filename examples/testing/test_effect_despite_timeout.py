from quotes import Quotes

from outbox.testing import Pipeline


def test_one_email_although_the_provider_timed_out(outbox_pipeline: Pipeline, app: Quotes):
    p = outbox_pipeline
    mail = p.fake_provider("mail", timeout=5.0)
    p.consumer("billing", app.consumer_handlers)
    p.worker(app.worker_handlers, providers={"mail": mail})
    mail.fail_next("hang")  # the provider sends the email, then never answers

    app.approve(17)
    p.drain()  # the call times out after 5 s of test time: the receipt is UNKNOWN...
    p.clock.advance(minutes=5)  # ...the job's backoff ends
    p.drain()

    p.assert_effects("send-quote-17", 1)  # one email, not two
    p.assert_reconciled("send-quote-17")  # found by lookup, not sent again
    p.assert_jobs(action="send-quote", DONE=1)
