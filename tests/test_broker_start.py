"""A broker that is not there, or not what its URL says, at start (issue 53).

- ``outbox-relay run`` on a NATS URL where nothing listens says so at start: an error line
  naming the broker with its password hidden, then it waits (never exits) and starts once
  a server answers there. Before, it logged "relay started" and nothing else.
- A ``tls://`` URL never talks plain text: against a server that does not require TLS, the
  client sends nothing after the server's INFO (no CONNECT, so no credentials in the clear)
  and the call fails as the broker being unavailable, with a message that says why.
- A Redis broker that is not there at start is said the same way, by the relay and by the
  consumer: one error line naming the URL with its password hidden (before, warnings about
  the cycle or the heartbeat that named no broker), then both go on once a server answers:
  an event written meanwhile is published and handled.
- The consumer's backoff after an outage stops growing at 2 s: it takes up again within
  about 2 s of the service's return (it had grown to ~9 s while Redis was away).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from consumer import ConsumerConfig
from outbox import Outbox
from outbox.errors import BrokerUnavailable
from outbox.nats_client import NatsClient
from tests import consumer_app
from tests.services import PrivateNats, PrivateRedis, free_port, wait_for

REPO = Path(__file__).resolve().parent.parent
SECRET = "PassW0rd"


def _messages(log: Path) -> list[dict[str, object]]:
    found = []
    for line in log.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def test_a_relay_says_at_start_that_its_nats_broker_is_not_there(
    pg_url: str, tmp_path: Path
) -> None:
    port = free_port()
    url = f"nats://bob:{SECRET}@127.0.0.1:{port}"
    log = tmp_path / "relay.log"
    command = [sys.executable, "-m", "relay.cli", "run", "--database-url", pg_url]
    command += ["--redis-url", url, "--log-level", "info"]
    with log.open("ab") as out:
        relay = subprocess.Popen(command, cwd=REPO, env=dict(os.environ), stdout=out, stderr=out)
    nats: PrivateNats | None = None
    try:
        said = wait_for(
            lambda: [m for m in _messages(log) if m.get("level") == "error"],
            "the relay to say the broker is not there",
            timeout=60,
            diagnose=lambda: log.read_text()[-2000:],
        )
        assert said[0]["message"] == "cannot reach the broker; retrying until it answers"
        assert said[0]["broker"] == f"nats://bob:***@127.0.0.1:{port}"
        assert "ConnectionRefusedError" in str(said[0]["error"])  # the reason, at once
        assert relay.poll() is None  # an outage: it waits, it does not exit
        assert "relay started" not in log.read_text()  # not while the broker is missing
        nats = PrivateNats(port=port).start()
        wait_for(
            lambda: "relay started" in log.read_text(),
            "the relay to start once the broker answers",
            timeout=60,
            diagnose=lambda: log.read_text()[-2000:],
        )
        assert "broker reachable" in log.read_text()
    finally:
        if relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
        try:
            code = relay.wait(60)
        finally:
            if nats is not None:
                nats.close()
    assert code == 0, log.read_text()[-2000:]
    assert SECRET not in log.read_text()


def _said_error(log: Path) -> list[dict[str, object]]:
    return [m for m in _messages(log) if m.get("level") == "error"]


def _handled(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.count()).select_from(consumer_app.jobs)).scalar_one()
        )


@pytest.mark.slow
def test_a_relay_and_a_consumer_say_at_start_that_their_redis_is_not_there(
    pg_url: str, tmp_path: Path
) -> None:
    port = free_port()
    redis = PrivateRedis(port=port, password=SECRET)
    url = redis.url
    engine = sa.create_engine(pg_url)
    consumer_app.metadata.create_all(engine)
    Outbox(engine).create_schema()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "CONSUMER_APP_STREAM": "outbox.job.requested",
        "OUTBOX_LOG_LEVEL": "info",
    }
    base = ["--database-url", pg_url, "--redis-url", url]
    commands = {
        "relay": [sys.executable, "-m", "relay.cli", "run", *base, "--log-level", "info"],
        "consumer": [sys.executable, "-m", "consumer.cli", "run", "consumer_app:build", *base],
    }
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, command in commands.items():
        with logs[name].open("ab") as out:
            procs[name] = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out)
    codes: dict[str, int] = {}
    try:
        for name, log in logs.items():
            said = wait_for(
                lambda log=log: _said_error(log),
                f"the {name} to say its Redis is not there",
                timeout=60,
                diagnose=lambda log=log: log.read_text()[-2000:],
            )
            assert said[0]["message"] == "cannot reach the broker; retrying until it answers"
            assert said[0]["broker"] == f"redis://:***@127.0.0.1:{port}/0"
            assert "Connection refused" in str(said[0]["error"])  # the reason, at once
            assert procs[name].poll() is None  # an outage: it waits, it does not exit
        assert "relay started" not in logs["relay"].read_text()
        assert "consumer started" not in logs["consumer"].read_text()
        with Outbox(engine).transaction() as tx:  # written while the broker is away
            tx.emit("job.requested", key="k", payload={"n": 1}, identity="late-1")
        redis.start()
        for name, started in (("relay", "relay started"), ("consumer", "consumer started")):
            wait_for(
                lambda name=name, started=started: started in logs[name].read_text(),
                f"the {name} to start once Redis answers",
                timeout=60,
                diagnose=lambda name=name: logs[name].read_text()[-2000:],
            )
            assert "broker reachable" in logs[name].read_text()
        wait_for(
            lambda: _handled(engine) == 1,
            "the event written meanwhile to be published and handled",
            timeout=60,
            diagnose=lambda: (
                logs["relay"].read_text()[-1500:] + logs["consumer"].read_text()[-1500:]
            ),
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        try:
            for name, proc in procs.items():
                codes[name] = proc.wait(60)
        finally:
            redis.close()
            engine.dispose()
    for name, log in logs.items():
        text = log.read_text()
        assert codes[name] == 0, text[-2000:]
        assert SECRET not in text
        # One error line for the outage at start, not one per attempt.
        assert [m["message"] for m in _said_error(log)] == [
            "cannot reach the broker; retrying until it answers"
        ]


class PlainServer(threading.Thread):
    """A server that answers like a NATS server without TLS (its INFO has no
    ``tls_required``) and records every byte a client sends it."""

    def __init__(self) -> None:
        super().__init__(name="plain-nats", daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0

    def run(self) -> None:
        info = {"server_id": "plain", "version": "2.10.0", "max_payload": 1048576}
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.sendall(b"INFO " + json.dumps(info).encode() + b"\r\n")
                conn.settimeout(1.0)
                try:
                    while chunk := conn.recv(4096):
                        self.received += chunk
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_a_tls_url_never_talks_plain_text() -> None:
    server = PlainServer()
    server.start()
    client = NatsClient(f"tls://bob:{SECRET}@127.0.0.1:{server.port}", timeout=2.0)
    try:
        with pytest.raises(BrokerUnavailable, match="refusing to connect in plain text") as no:
            client.ping()
        assert SECRET not in str(no.value)
        wait_for(lambda: server.connections >= 1, "the client to read the server's INFO")
    finally:
        client.close()
        server.close()
    assert b"CONNECT" not in server.received and SECRET.encode() not in server.received


def test_the_consumer_backoff_stops_growing_at_two_seconds() -> None:
    backoff = ConsumerConfig().backoff
    assert backoff.cap(0) == pytest.approx(0.2)
    assert max(backoff.cap(attempt) for attempt in range(100)) == 2.0


@pytest.mark.parametrize("scheme", ["redis", "nats"])
def test_relay_run_once_fails_on_a_broker_that_is_not_there(
    scheme: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One cycle, like ``--once`` on a database not there: exit 1 saying which broker and
    why (its password hidden), instead of waiting for it for ever."""
    import relay.cli

    port = free_port()
    url = f"{scheme}://bob:{SECRET}@127.0.0.1:{port}"
    argv = ["run", "--once", "--database-url", pg_url, "--redis-url", url]
    assert relay.cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the broker at {scheme}://bob:***@127.0.0.1:{port}" in err, err
    assert "efused" in err and SECRET not in err and "Traceback" not in err


@pytest.mark.slow
def test_a_consumer_says_at_start_that_its_nats_broker_is_not_there(
    pg_url: str, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "consumer.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "CONSUMER_APP_STREAM": "outbox.job.requested",
        "OUTBOX_LOG_LEVEL": "info",
    }
    command = [sys.executable, "-m", "consumer.cli", "run", "consumer_app:build"]
    command += ["--database-url", pg_url, "--redis-url", f"nats://bob:{SECRET}@127.0.0.1:{port}"]
    with log.open("ab") as out:
        consumer = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out)
    nats: PrivateNats | None = None
    try:
        said = wait_for(
            lambda: _said_error(log),
            "the consumer to say its broker is not there",
            timeout=60,
            diagnose=lambda: log.read_text()[-2000:],
        )
        assert said[0]["message"] == "cannot reach the broker; retrying until it answers"
        assert said[0]["broker"] == f"nats://bob:***@127.0.0.1:{port}"
        assert consumer.poll() is None and "consumer started" not in log.read_text()
        nats = PrivateNats(port=port).start()
        wait_for(
            lambda: "consumer started" in log.read_text(),
            "the consumer to start once the broker answers",
            timeout=60,
            diagnose=lambda: log.read_text()[-2000:],
        )
        assert "broker reachable" in log.read_text()
    finally:
        if consumer.poll() is None:
            consumer.send_signal(signal.SIGTERM)
        try:
            code = consumer.wait(60)
        finally:
            if nats is not None:
                nats.close()
    assert code == 0, log.read_text()[-2000:]
    assert SECRET not in log.read_text()
