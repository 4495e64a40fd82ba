from quotes import Quotes

from outbox.testing import Pipeline


def test_a_duplicate_event_creates_one_job_and_one_email(outbox_pipeline: Pipeline, app: Quotes):
    p = outbox_pipeline
    mail = p.fake_provider("mail")
    p.consumer("billing", app.consumer_handlers)
    p.worker(app.worker_handlers, providers={"mail": mail})
    app.approve(17)
    app.approve(17)  # approved twice (a double click): the same business identity

    result = p.drain()

    assert (result.published, result.handled, result.duplicates) == (2, 1, 1)
    p.assert_jobs(action="send-quote", DONE=1)
    p.assert_effects("send-quote-17", 1)
