"""The application of the soak (``bench.soak``): a writer, a consumer and a worker, as a user
writes them; each runs as its own process, started through the project's CLIs.

- ``python -m bench.soak_app write --rate R --commits FILE``: a writer. One transaction per
  quote, ``outbox.transaction()`` + ``tx.emit("quote.approved", identity="quote-N")``, at a
  fixed rate; after each commit it appends ``N <unix time>`` to FILE (the commit time of
  quote N, for the commit -> effect latency). ``--writers W --index I``: one of W writers,
  quotes I, I+W, I+2W, ...
- ``outbox-consumer run bench.soak_app:consumer``: group ``billing``; its batch handler
  creates one ``send-quote-N`` job per event (``store.enqueue_many`` in the batch's
  transaction). The consumer's defaults except the inbox window, which it reads from
  ``OUTBOX_INBOX_WINDOW`` (the variable ``outbox-worker run`` reads for its safety check,
  so one setting serves both).
- ``outbox-worker run bench.soak_app:worker``: the worker's defaults; its ``send-quote``
  handler makes the quote's effect, one line ``N <unix time>`` appended to
  ``$SOAK_EFFECTS`` (the effect's time). With ``SOAK_DISPATCH=1`` it dispatches it through
  the ``mail`` provider instead (an operation intent and a receipt per job, as a real
  connector), which answers after ``$SOAK_PROVIDER_LATENCY`` seconds (default 0.005).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

TOPIC = "quote.approved"
TENANTS = ("studio", "bakery", "garage")


def write(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_app write")
    parser.add_argument("--database-url", default=os.environ.get("OUTBOX_DATABASE_URL"))
    parser.add_argument("--rate", type=float, required=True, help="quotes per second")
    parser.add_argument("--commits", required=True, help="file of 'N commit-time' lines")
    parser.add_argument("--writers", type=int, default=1)
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.database_url or args.rate <= 0:
        parser.error("--database-url and a positive --rate are required")

    from outbox import Outbox

    outbox = Outbox(args.database_url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    interval = 1.0 / args.rate
    n = args.index
    failed = 0
    lines: list[str] = []
    flushed_at = time.monotonic()
    next_at = flushed_at
    with open(args.commits, "a", buffering=1 << 16) as commits:
        while not stop.is_set():
            identity = f"quote-{n}"
            try:
                with outbox.transaction() as tx:
                    tx.emit(
                        TOPIC,
                        key=identity,
                        payload={"quote": n},
                        tenant=TENANTS[n % len(TENANTS)],
                        identity=identity,
                    )
                lines.append(f"{n} {time.time():.6f}\n")
                n += args.writers
            except Exception as exc:  # the database is busy or down: wait, go on
                failed += 1
                print(f"writer: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                stop.wait(0.2)
                next_at = time.monotonic()
            now = time.monotonic()
            if now - flushed_at >= 0.2:
                commits.writelines(lines)
                commits.flush()
                lines.clear()
                flushed_at = now
            next_at += interval
            delay = next_at - now
            if delay > 0:
                stop.wait(delay)
            elif delay < -1.0:
                next_at = now  # a second behind: do not burst to catch up
        commits.writelines(lines)
    outbox.engine.dispose()
    print(f"writer {args.index}: next={n} failed={failed}", flush=True)
    return 0


def consumer() -> Any:
    """The ``billing`` consumer: one job per quote, created in the batch's transaction."""
    from consumer import Consumer, ConsumerConfig, ConsumerTx
    from consumer.event import ConsumedEvent
    from consumer.jobs.store import Store

    window = float(os.environ.get("OUTBOX_INBOX_WINDOW", "604800"))
    built = Consumer(
        group="billing", topics=[TOPIC], config=ConsumerConfig(inbox_retention_seconds=window)
    )
    store = Store(os.environ["OUTBOX_DATABASE_URL"])

    @built.handler(TOPIC, batch=True)
    def on_quotes(events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        store.enqueue_many(
            [
                {
                    "tenant": event.tenant or "-",
                    "action": f"send-quote-{event.data['quote']}",
                    "payload": event.data,
                }
                for event in events
            ],
            session=tx.session,
        )

    return built


class FileEffects:
    """A provider whose effect is a line ``N <unix time>`` appended to a file (one
    ``write`` of an ``O_APPEND`` descriptor: lines of concurrent sends never interleave),
    answered ``latency`` seconds after the call.

    Not instantaneous on purpose: the worker's in-flight limit (AIMD,
    ``consumer.jobs.limits.AdaptiveLimit``) backs off when a call takes more than 4x the
    best recent one; with a best of ~50 us any scheduling hiccup of a loaded machine counts
    as overload, the limit falls to 1 and jobs are handed back "deferred"."""

    name = "mail"
    supports_lookup = False
    supports_idempotency = False

    def __init__(self, path: str, latency: float) -> None:
        self.latency = latency
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._sent = 0

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        time.sleep(self.latency)
        self.record(request)
        with self._lock:
            self._sent += 1
            return f"mail-{os.getpid()}-{self._sent}"

    def record(self, request: Mapping[str, Any]) -> None:
        os.write(self._fd, f"{request['quote']} {time.time():.6f}\n".encode())

    def lookup(self, operation_id: str) -> str | None:
        return None


def worker() -> Any:
    """The worker's defaults. Its job makes the quote's effect itself (a line in
    ``$SOAK_EFFECTS``); with ``SOAK_DISPATCH=1`` it dispatches it through the ``mail``
    provider instead (an operation intent and a receipt per job, as a real connector)."""
    from consumer.jobs.worker import JobContext, Worker

    latency = float(os.environ.get("SOAK_PROVIDER_LATENCY", "0.005"))
    effects = FileEffects(os.environ["SOAK_EFFECTS"], latency)
    dispatch = os.environ.get("SOAK_DISPATCH", "") not in ("", "0")
    built = Worker(providers={"mail": effects} if dispatch else None)

    @built.handler("send-quote")
    def send_quote(job: JobContext) -> None:
        request = {"quote": (job.payload or {})["quote"]}
        if dispatch:
            job.dispatch("send", "mail", request)
        else:
            effects.record(request)

    return built


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "write":
        print("usage: python -m bench.soak_app write --rate R --commits FILE", file=sys.stderr)
        return 2
    return write(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
