"""A small quoting application: the code the tests of examples/testing check.

Approving a quote records the approval and emits ``quote.approved`` in one transaction; the
billing consumer turns the event into two jobs: send the quote by email, and remind the
client three days later unless the quote was signed meanwhile.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, select, update

from consumer import ConsumedEvent, ConsumerTx, JobContext, Store
from outbox import Outbox

REMINDER_DELAY = 3 * 86400.0

metadata = MetaData()
quotes = Table(
    "quotes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("email", String(200), nullable=False),
    Column("state", String(20), nullable=False, default="draft"),
)


class Quotes:
    """The application, given its outbox and its job store (production passes its own, a test
    the pipeline's)."""

    def __init__(self, outbox: Outbox, store: Store) -> None:
        self.outbox = outbox
        self.store = store
        metadata.create_all(outbox.engine)

    # -- domain code ---------------------------------------------------------------------

    def create(self, quote_id: int, email: str) -> None:
        with self.outbox.transaction() as tx:
            tx.session.execute(quotes.insert().values(id=quote_id, email=email))

    def approve(self, quote_id: int) -> None:
        with self.outbox.transaction() as tx:
            done = tx.session.execute(
                update(quotes).where(quotes.c.id == quote_id).values(state="approved")
            )
            if done.rowcount != 1:
                raise LookupError(f"no quote {quote_id}")  # rolls back: nothing is emitted
            tx.emit(
                "quote.approved",
                key=f"quote-{quote_id}",
                payload={"quote": quote_id},
                tenant="studio",
                identity=f"studio:send-quote-{quote_id}",
            )

    def sign(self, quote_id: int) -> None:
        with self.outbox.transaction() as tx:
            tx.session.execute(update(quotes).where(quotes.c.id == quote_id).values(state="signed"))

    def state(self, quote_id: int) -> dict[str, Any]:
        with self.outbox.engine.connect() as conn:
            row = conn.execute(select(quotes).where(quotes.c.id == quote_id)).one()
        return dict(row._mapping)

    # -- the billing consumer: one event, two jobs ----------------------------------------

    def on_quote_approved(self, event: ConsumedEvent, tx: ConsumerTx) -> None:
        quote = event.data["quote"]
        tenant = event.tenant or "studio"
        for action in (f"send-quote-{quote}", f"remind-{quote}"):
            self.store.enqueue(tenant, action, payload={"quote": quote}, session=tx.session)

    @property
    def consumer_handlers(self) -> dict[str, Any]:
        return {"quote.approved": self.on_quote_approved}

    # -- the jobs -------------------------------------------------------------------------

    def send_quote(self, job: JobContext) -> None:
        quote = self.state(job.payload["quote"])
        job.dispatch("email", "mail", {"to": quote["email"], "template": "quote"})

    def remind(self, job: JobContext) -> None:
        quote = self.state(job.payload["quote"])
        if job.timer is None:  # first run: the reminder waits three days, no worker held
            job.schedule(time.time() + REMINDER_DELAY, "remind an unsigned quote")
            return
        if quote["state"] == "signed":
            job.cancel("signed meanwhile")
            return
        job.dispatch("reminder", "mail", {"to": quote["email"], "template": "reminder"})

    @property
    def worker_handlers(self) -> dict[str, Any]:
        return {"send-quote": self.send_quote, "remind": self.remind}
