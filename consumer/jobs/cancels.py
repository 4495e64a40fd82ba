"""Cancelling a running job: what a cancel request does (issue 38).

``Store.cancel`` on a LEASED job records a request on its row (``cancel_requested_at``,
``cancel_reason``) instead of moving it under its holder. From there:

- the holder's worker learns it (the driver's ``job_cancel_requested_list``, a probe of the
  tiny partial index ``ix_outbox_jobs_cancel_requested`` run with its maintenance) and tells
  the job's :class:`~consumer.jobs.context.JobContext`: ``ctx.cancelled`` is True, an ``async def``
  handler's task is cancelled (at its next ``await``, never inside a provider call: see
  ``JobContext.dispatching``), and ``ctx.dispatch`` raises ``JobCancelled`` before writing a
  new intent (the driver's ``job_cancel_requested``, read at that moment);
- whatever the run's end (a finish, a wait, a failure, a defer), the holder's fenced move
  makes the job CANCELLED instead (``LeaseMoves._move``; a batch finish in its own
  statement, ``consumer.jobs.queries``), its history saying how the run ended.

An intent written before the request keeps its receipt, whatever it becomes: a cancel cannot
recall an email. The trace says so when a CANCELLED job holds an ACCEPTED receipt.

The statements are the job driver's (``consumer.jobs.driver_cancels``); this module holds
the contract only.
"""
