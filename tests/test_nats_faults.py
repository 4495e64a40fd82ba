"""The relay's kill test on NATS JetStream (issue 40): real ``outbox-relay run --broker-url
nats://...`` subprocesses SIGKILLed 100 times while writers commit, with the JetStream
streams' duplicate window (0.5 s) shorter than any relay's life, so a relay that comes
after a kill cannot lean on JetStream's deduplication: it must find what the dead relay
published by reading the stream. Zero duplicate messages, zero lost, each key's events in
commit order. The domain, the writers, the relay processes and the verdict are those of
tests/test_relay_faults.py; here, reading JetStream.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from outbox.db import make_engine

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    from broker_support import BrokerKit, _nats_run, nats_kit
    from services import wait_for
    from test_relay_faults import (
        TOPICS,
        RelayProcs,
        WriterFactory,
        assert_clean,
        committed_versions,
        create_domain,
        judge,
        make_keys,
        message_count,
        open_intents,
        pending_count,
        read_jetstream,
        relays,
        writers_factory,
    )
except ImportError:  # pragma: no cover
    from tests.broker_support import BrokerKit, _nats_run, nats_kit  # noqa: F401
    from tests.services import wait_for
    from tests.test_relay_faults import (
        TOPICS,
        RelayProcs,
        WriterFactory,
        assert_clean,
        committed_versions,
        create_domain,
        judge,
        make_keys,
        message_count,
        open_intents,
        pending_count,
        read_jetstream,
        relays,
        writers_factory,  # noqa: F401
    )

from outbox.nats_client import jetstream_name

pytestmark = pytest.mark.slow

DUPLICATE_WINDOW = 0.5


def create_streams(kit: BrokerKit) -> None:
    """The test's JetStream streams, with a duplicate window shorter than a relay's life
    (the relay keeps an existing stream's configuration)."""
    from nats.js.api import StreamConfig

    async def create(js: Any) -> None:
        for topic in TOPICS:
            stream = kit.stream(topic)
            await js.add_stream(
                StreamConfig(
                    name=jetstream_name(stream),
                    subjects=[stream],
                    duplicate_window=DUPLICATE_WINDOW,
                    max_age=3600.0,
                )
            )

    _nats_run(create)


class AckDelayProxy:
    """A TCP proxy between the relays and NATS that can hold the server's replies back
    (:meth:`hold`): what a relay publishes reaches the stream at once, its acknowledgements
    come late, so the relay holds an intent without a receipt for messages already stored,
    the moment a SIGKILL must not turn into a duplicate (JetStream has no ``CLIENT PAUSE``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held_until = 0.0
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def hold(self, seconds: float) -> None:
        self.held_until = time.monotonic() + seconds

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                if replies:
                    wait = self.held_until - time.monotonic()
                    if wait > 0:
                        # The fault itself, not a wait: the server's replies are late.
                        time.sleep(wait)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.closed.set()
        self.server.close()


def found_in_logs(procs: RelayProcs) -> int:
    """How many events the relays' reconciliations found already in a stream."""
    total = 0
    for path in procs.logs.values():
        for match in re.finditer(rb'"found_in_stream": (\d+)', path.read_bytes()):
            total += int(match.group(1))
    return total


def test_zero_duplicates_and_zero_lost_across_100_sigkills_on_nats(
    pg_url: str,
    nats_kit: BrokerKit,
    tmp_path: Path,
    writers_factory: WriterFactory,
) -> None:
    """Three relays talk to NATS through :class:`AckDelayProxy`, which holds JetStream's
    acknowledgements back for 100 ms of every 150. A relay caught holding an intent
    without a receipt (the table names its pid) is SIGKILLed after a random 0-100 ms
    (its messages are then in the stream, their receipts never will be), and one that has
    run 1 s since it logged "relay started" uncaught is killed anyway; each kill starts a
    new relay. Writers commit 2
    events per transaction over 200 keys meanwhile. Then the backlog drains and every
    message is judged; the relays' logs say how many events reconciliation found."""
    keys = make_keys(200)
    create_domain(pg_url, keys)
    create_streams(nats_kit)
    engine = make_engine(pg_url, pool_size=2)
    host, port = nats_kit.url.removeprefix("nats://").split(":")
    proxy = AckDelayProxy((host, int(port)))
    command = [
        sys.executable,
        "-m",
        "relay",
        "run",
        "--database-url",
        pg_url,
        "--broker-url",
        proxy.url,
        "--stream",
        nats_kit.template,
        "--batch-size",
        "50",
    ]
    rng = random.Random()
    at_intent = 0
    lives: list[float] = []
    with relays(command, tmp_path) as procs:
        for _ in range(3):
            procs.spawn()
        writers = writers_factory(pg_url, keys, 10**9, threads=2, per_tx=2, rate=500)
        started = time.monotonic()
        held_until = 0.0

        started_at: dict[int, float] = {}  # pid -> when its log said "relay started"

        def victim() -> tuple[subprocess.Popen[bytes], bool] | None:
            """A relay caught holding an open intent (True), or the one running longest
            once it has run 1 s uncaught (False); None: not yet. Only relays that have
            started count (a loaded machine takes seconds to import one)."""
            nonlocal held_until
            procs.assert_running()
            now = time.monotonic()
            if now > held_until + 0.05:
                proxy.hold(0.1)
                held_until = now + 0.1
            for p in procs.alive():
                if p.pid not in started_at and b'"relay started"' in procs.logs[p.pid].read_bytes():
                    started_at[p.pid] = now
            running = {p.pid: p for p in procs.alive() if p.pid in started_at}
            holders = [
                running[pid]
                for pid in open_intents(engine)
                if pid in running and now - procs.born[pid] > DUPLICATE_WINDOW
            ]
            if holders:
                return rng.choice(holders), True
            if not running:
                return None
            pid = min(running, key=lambda pid: started_at[pid])
            return (running[pid], False) if now - started_at[pid] > 1.0 else None

        while procs.kills < 100:
            proc, caught = wait_for(
                victim,
                f"a relay to kill (kill {procs.kills + 1} of 100)",
                timeout=max(600 - (time.monotonic() - started), 0.0),
                interval=0.002,
                diagnose=procs.tail,
            )
            at_intent += caught
            # The scenario, not a wait: the kill lands anywhere in the next 100 ms, between
            # the stored message and its late acknowledgement, or after the receipt.
            time.sleep(rng.uniform(0, 0.1))
            lives.append(time.monotonic() - procs.born[proc.pid])
            procs.kill(proc)
            procs.spawn()
        kill_phase = time.monotonic() - started
        writers.stop.set()
        writers.join(30)
        expected = sum(committed_versions(pg_url).values())

        def drained() -> bool:
            procs.assert_running()
            return pending_count(engine)[0] == 0 and message_count(nats_kit) >= expected

        wait_for(drained, "the backlog drained into JetStream", timeout=120, diagnose=procs.tail)
        found = found_in_logs(procs)
        codes = procs.terminate_all()
    proxy.close()
    verdict = judge(read_jetstream(nats_kit), committed_versions(pg_url), writers.stats.confirmed)
    print(
        f"\nNATS kill test: {procs.kills} SIGKILLs ({at_intent} while holding an open intent) "
        f"in {kill_phase:.0f} s, shortest relay life {min(lives):.2f} s against a "
        f"{DUPLICATE_WINDOW} s duplicate window; {verdict.entries} messages, "
        f"{len(verdict.duplicates)} duplicated ids, {len(verdict.missing_confirmed)} lost; "
        f"{found} events found in a stream by reconciliation"
    )
    assert min(lives) > DUPLICATE_WINDOW
    assert_clean(verdict, f"after {procs.kills} SIGKILLs ({at_intent} at an open intent)")
    assert codes == [0, 0, 0], f"SIGTERM exit codes {codes}\n{procs.tail()}"
    engine.dispose()
