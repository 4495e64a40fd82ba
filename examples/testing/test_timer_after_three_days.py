from quotes import Quotes

from outbox.testing import Pipeline


def test_the_reminder_goes_out_three_days_later(outbox_pipeline: Pipeline, app: Quotes):
    p = outbox_pipeline
    mail = p.fake_provider("mail")
    p.consumer("billing", app.consumer_handlers)
    p.worker(app.worker_handlers, providers={"mail": mail})
    app.approve(17)
    p.drain()
    p.assert_effects("send-quote-17", 1)

    p.clock.advance(days=2, hours=23)
    p.drain()
    p.assert_effects("remind-17", 0)  # not yet

    p.clock.advance(hours=1, seconds=1)
    p.drain()
    p.assert_effects("remind-17", 1)
    p.assert_jobs(DONE=2)


def test_no_reminder_for_a_quote_signed_meanwhile(outbox_pipeline: Pipeline, app: Quotes):
    p = outbox_pipeline
    p.consumer("billing", app.consumer_handlers)
    p.worker(app.worker_handlers, providers={"mail": p.fake_provider("mail")})
    app.approve(17)
    p.drain()
    app.sign(17)
    p.clock.advance(days=3, seconds=1)
    p.drain()
    p.assert_effects("remind-17", 0)
    p.assert_jobs(action="remind", CANCELLED=1)
