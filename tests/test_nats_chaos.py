"""The chaos loop on NATS JetStream (issue 40: "every effect once"): the whole pipeline as
real processes (writers, 2 relays, 2 consumers, 2 workers, the connector simulator) with a
private ``nats-server -js`` as the broker, the relays SIGKILLed in turn every second while
quotes are approved; after the load stops and the loop settles, the books must balance
(``bench.loop.problems``): every committed quote exactly one effect, rolled-back quotes
none, one job per identity, nothing pending in the outbox, the JetStream group or the job
store, no receipt UNKNOWN.

Bounded: one fault, a few seconds of it (``python -m bench chaos --broker nats --faults
kill-relays`` runs it longer; the Redis-only faults are refused there)."""

from __future__ import annotations

import pytest

from bench.chaos import Plan, Row, run_matrix, table


@pytest.mark.slow
def test_every_effect_once_through_relay_kills_on_nats() -> None:
    plan = Plan(duration=5.0, warmup=2.0, tail=2.0, settle=60.0, rate=30.0, broker="nats")
    rows: list[Row] = run_matrix(["kill-relays"], plan)
    [row] = rows
    detail = f"{row.problems}\n{row.logs[-4000:]}"
    assert row.ok, f"{table(rows)}\n\n{detail}"
    assert row.lost == 0 and row.duplicated == 0, table(rows)
    assert row.settled, table(rows)
    assert row.books["effects"] > 0, row.books
    # The events went through JetStream (the private server's stream holds them all).
    assert row.books["broker"] == "nats", row.books
    assert (row.books["stream_messages"] or 0) >= row.books["committed"], row.books
    assert "relay SIGKILLs" in row.note, row.note
