"""The NATS consumer outlives its server (issue 53): ``outbox-consumer run`` on a private
``nats-server -js`` that is SIGKILLed and started again twice while 3,000 events flow.

Before, the consumer kept its pull subscriptions on the lost connection and logged
``ConnectionClosedError`` at every retry, taking nothing more until restarted by hand. Now
it binds them again on the new connection: every event is handled exactly once (one row
per identity in the app's table, which has no unique constraint), without a restart, and
the process exits 0 on SIGTERM at the end.

The events are published straight to JetStream by the test (each with its event id as
``Nats-Msg-Id``, so a publish retried across a restart is deduplicated by JetStream): the
relay's own survival of broker restarts is tested with the relay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.codec import encode_entry
from outbox.errors import BrokerUnavailable
from outbox.nats_client import EXPECTED_STREAM, MSG_ID, NatsClient, jetstream_name

try:  # tests/ is a rootdir without __init__.py: pytest puts it on sys.path
    import consumer_app
    from services import PrivateNats, wait_for
except ImportError:  # pragma: no cover
    from tests import consumer_app
    from tests.services import PrivateNats, wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
EVENTS = 3000
CHUNK = 50


def _handled(engine: sa.Engine) -> tuple[int, int]:
    table = consumer_app.jobs
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(sa.func.count(), sa.func.count(sa.distinct(table.c.identity)))
        ).one()
    return int(row[0]), int(row[1])


class Publisher(threading.Thread):
    """Publishes the events in chunks, each chunk again until JetStream took all of it (a
    server being restarted refuses it)."""

    def __init__(self, url: str, stream: str, first: int = 0, count: int = EVENTS) -> None:
        super().__init__(name="publisher", daemon=True)
        self.client = NatsClient(url, timeout=2.0)
        self.stream = stream
        self.first, self.count = first, count
        self.sent = 0
        self.retries = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def _chunk(self, start: int) -> list[tuple[str, bytes, dict[str, str]]]:
        headers = {EXPECTED_STREAM: jetstream_name(self.stream)}
        messages = []
        for n in range(start, start + CHUNK):
            fields = encode_entry(
                "job.requested", {"n": n}, event_id=f"ev-{n}", identity=f"quote-{n}"
            )
            body = json.dumps(fields).encode()
            messages.append((self.stream, body, {**headers, MSG_ID: f"ev-{n}"}))
        return messages

    def run(self) -> None:
        try:
            for start in range(self.first, self.first + self.count, CHUNK):
                messages = self._chunk(start)
                while not self.stop.is_set():
                    try:
                        replies = self.client.run(lambda _js: self.client.publish_many(messages))  # noqa: B023
                    except BrokerUnavailable:
                        replies = []
                    if replies and all("error" not in reply for reply in replies):
                        break
                    self.retries += 1
                    self.stop.wait(0.2)
                self.sent = start + CHUNK - self.first
                self.stop.wait(0.04)  # ~1,200 events/s: the kills land while events flow
        except BaseException as exc:  # the test reports it
            self.error = exc
        finally:
            self.client.close()


def _consumer(pg_url: str, nats: PrivateNats, stream: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "CONSUMER_APP_STREAM": stream,
        "OUTBOX_LOG_LEVEL": "info",
    }
    command = [sys.executable, "-m", "consumer.cli", "run", "consumer_app:build"]
    command += ["--database-url", pg_url, "--redis-url", nats.url]
    with log.open("ab") as out:
        return subprocess.Popen(command, cwd=log.parent, env=env, stdout=out, stderr=out)


def test_the_nats_consumer_takes_up_again_after_two_server_restarts(
    pg_url: str, stream_prefix: str, tmp_path: Path
) -> None:
    engine = sa.create_engine(pg_url)
    consumer_app.metadata.create_all(engine)
    stream = f"{stream_prefix}.jobs"
    log = tmp_path / "consumer.log"
    with PrivateNats() as nats:
        proc = _consumer(pg_url, nats, stream, log)
        publisher = Publisher(nats.url, stream)
        try:
            wait_for(lambda: "consumer started" in log.read_text(), "the consumer", 60)
            # The group exists (the consumer made the stream and its durable consumer).
            wait_for(lambda: "consumer group created" in log.read_text(), "the group", 60)
            publisher.start()
            for at in (EVENTS // 4, EVENTS // 2):
                wait_for(lambda a=at: _handled(engine)[0] >= a, f"{at} handled", 60)
                nats.kill()
                # Down long enough for the consumer's fetches and acknowledgements to fail.
                wait_for(
                    lambda: "Error" in log.read_text() or "failed" in log.read_text(),
                    "the consumer to meet the outage",
                    30,
                )
                nats.start()
            wait_for(
                lambda: proc.poll() is not None or _handled(engine)[0] >= EVENTS,
                "every event handled",
                timeout=120,
                diagnose=lambda: (
                    f"{_handled(engine)} sent {publisher.sent}\n{log.read_text()[-3000:]}"
                ),
            )
            assert proc.poll() is None, log.read_text()[-3000:]  # no restart, no exit
        finally:
            publisher.stop.set()
            publisher.join(30)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert publisher.error is None, publisher.error
    assert publisher.sent == EVENTS
    assert code == 0, log.read_text()[-3000:]
    assert _handled(engine) == (EVENTS, EVENTS)  # 0 lost, 0 twice
    text = log.read_text()
    assert text.count("NATS connection back; the group's subscriptions renewed") >= 2
    engine.dispose()


def test_private_nats_keeps_its_streams_across_a_kill(tmp_path: Path) -> None:
    """The harness itself: a killed and restarted server keeps what JetStream stored."""
    with PrivateNats() as nats:
        client = NatsClient(nats.url, timeout=2.0)

        async def make(js: Any) -> Any:
            return await js.add_stream(name="kept", subjects=["kept.x"])

        client.run(make)
        nats.kill()
        nats.start()

        async def info(js: Any) -> Any:
            return await js.stream_info("kept")

        assert wait_for(lambda: client.run(info), "the stream", 30, ignore=(BrokerUnavailable,))
        client.close()


def test_the_nats_consumer_makes_its_group_again_on_a_server_back_empty(
    pg_url: str, stream_prefix: str, tmp_path: Path
) -> None:
    """A server that came back without its store (a new node, a lost volume): the consumer
    makes the stream and its group again on the new connection, and what is published there
    from then on is handled (what the lost store held is the server's loss, not read here)."""
    engine = sa.create_engine(pg_url)
    consumer_app.metadata.create_all(engine)
    stream = f"{stream_prefix}.jobs"
    log = tmp_path / "consumer.log"
    with PrivateNats() as nats:
        proc = _consumer(pg_url, nats, stream, log)
        try:
            wait_for(lambda: "consumer group created" in log.read_text(), "the group", 60)
            before = Publisher(nats.url, stream, 0, 500)
            before.run()
            wait_for(lambda: _handled(engine)[0] >= 500, "the first 500 handled", 60)
            nats.kill()
            nats.start(empty=True)
            after = Publisher(nats.url, stream, 500, 500)
            after.run()  # refused until the consumer made the stream again: retried
            wait_for(
                lambda: proc.poll() is not None or _handled(engine)[0] >= 1000,
                "the next 500 handled",
                timeout=60,
                diagnose=lambda: f"{_handled(engine)}\n{log.read_text()[-3000:]}",
            )
            assert proc.poll() is None, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
    assert before.error is None and after.error is None
    assert code == 0, log.read_text()[-3000:]
    assert _handled(engine) == (1000, 1000)
    assert "NATS connection back; the group's subscriptions renewed" in log.read_text()
    engine.dispose()
