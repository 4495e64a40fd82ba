"""``python -m bench testing_drain``: how long ``outbox.testing``'s ``drain()`` takes on a
1,000-event test (issue 24's target: under 2 s).

A user's test in the large: ``--events`` quotes approved (committed before the clock starts),
a consumer whose handler enqueues one job per event, and a worker whose job dispatches one
email through the pipeline's fake provider. Timed: ``drain()`` alone, until every job is DONE
with one effect each. Baseline in the same run: the same parts stepped by hand (relay,
consumer and worker ``run_once`` loops, no recovery, no sweep, no counting), so the ratio is
what ``drain()`` itself costs on top of the real pipeline's work.

Options: ``--events`` (1000), ``--rounds`` (3, medians), ``--no-dispatch`` (the job does
nothing: the pipeline without provider calls), ``--database-url`` and ``--redis-url``
(default: the embedded SQLite file and Redis, what a user's test gets). Wall and CPU
seconds are both printed: on a shared machine the wall clock also measures the neighbours.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any


def _pipeline(directory: str, args: argparse.Namespace, events: int) -> Any:
    from outbox.testing import Pipeline

    p = Pipeline(directory, database_url=args.database_url, redis_url=args.redis_url)
    mail = p.fake_provider("mail")

    def on_approved(event: Any, tx: Any) -> None:
        p.store.enqueue(
            "studio", f"send-quote-{event.data['quote']}", payload=event.data, session=tx.session
        )

    def send_quote(job: Any) -> None:
        if args.dispatch:
            job.dispatch("email", "mail", {"quote": job.payload["quote"]})

    p.consumer("billing", {"quote.approved": on_approved})
    p.worker({"send-quote": send_quote}, providers={"mail": mail})
    with p.outbox.transaction() as tx:
        tx.emit_many(
            [
                {
                    "topic": "quote.approved",
                    "key": f"quote-{n}",
                    "payload": {"quote": n},
                    "tenant": "studio",
                }
                for n in range(events)
            ]
        )
    return p


def _by_hand(p: Any) -> None:
    while p.relay.run_once() > 0:
        pass
    for consumer in p.consumers:
        while consumer.run_once(block=False) > 0:
            pass
    for worker in p.workers:
        while worker.run_once() > 0:
            pass


def one_round(args: argparse.Namespace, mode: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="bench-testing-") as directory:
        p = _pipeline(directory, args, args.events)
        try:
            started, cpu = time.perf_counter(), time.process_time()
            if mode == "drain":
                result = p.drain()
                assert result.effects == (args.events if args.dispatch else 0), str(result)
            else:
                _by_hand(p)
            took = time.perf_counter() - started, time.process_time() - cpu
            done = p.store.counts()["DONE"]
            assert done == args.events, f"{mode}: {done} of {args.events} jobs done"
            return took
        finally:
            p.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench testing_drain", description=__doc__)
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--no-dispatch", dest="dispatch", action="store_false")
    args = parser.parse_args(argv)
    if (args.database_url is None) != (args.redis_url is None):
        parser.error("give both --database-url and --redis-url, or neither (embedded)")
    where = "embedded (SQLite + embedded Redis)" if args.database_url is None else "servers"
    times: dict[str, list[tuple[float, float]]] = {"drain": [], "by hand": []}
    for _ in range(args.rounds):  # alternating, so a busy phase of the machine hits both
        times["drain"].append(one_round(args, "drain"))
        times["by hand"].append(one_round(args, "hand"))
    wall = {m: statistics.median(w for w, _ in v) for m, v in times.items()}
    cpu = {m: statistics.median(c for _, c in v) for m, v in times.items()}
    jobs = "one email each" if args.dispatch else "no provider call"
    print(f"testing_drain: {args.events} events ({jobs}), {where}, {args.rounds} rounds")
    for mode, values in times.items():
        spread = ", ".join(f"{w:.2f}" for w, _ in values)
        print(f"  {mode:8s} wall {wall[mode]:6.2f} s  cpu {cpu[mode]:6.2f} s  (wall: {spread})")
    print(
        f"  drain() / by hand: x{wall['drain'] / wall['by hand']:.2f} wall, "
        f"x{cpu['drain'] / cpu['by hand']:.2f} cpu; target: drain() under 2 s"
    )
    return 0
