"""A broker that is not there, or not what its URL says, at start (issue 53).

- ``outbox-relay run`` on a NATS URL where nothing listens says so at start: an error line
  naming the broker with its password hidden, then it waits (never exits) and starts once
  a server answers there. Before, it logged "relay started" and nothing else.
- A ``tls://`` URL never talks plain text: against a server that does not require TLS, the
  client sends nothing after the server's INFO (no CONNECT, so no credentials in the clear)
  and the call fails as the broker being unavailable, with a message that says why.
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

from consumer import ConsumerConfig
from outbox.errors import BrokerUnavailable
from outbox.nats_client import NatsClient
from tests.services import PrivateNats, free_port, wait_for

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
