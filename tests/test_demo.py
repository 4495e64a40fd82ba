"""``outbox-relay demo --chaos``: worker processes SIGKILLed mid-send, one email per quote.

Real processes throughout: the demo (relay, consumer and writer threads), its worker
subprocesses, the connector simulator service and the embedded Redis, in a fresh directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.embedded_support import embedded_servers_in

ROOT = Path(__file__).resolve().parent.parent

CHAOS_SUMMARY = re.compile(
    r"chaos: (\d+) quotes approved, (\d+) emails sent, (\d+) duplicate effects,"
    r" (\d+) workers killed \((\d+) mid-send\); receipts (\d+) ACCEPTED, (\d+) UNKNOWN,"
    r" (\d+) PENDING"
)


def _children_in(directory: Path) -> list[int]:
    """Live processes started for the demo in ``directory``: its workers (whose working
    directory it is) and its simulator (whose data file is in it)."""
    root = os.path.realpath(directory)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ")
            with open(f"/proc/{name}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            cwd = os.readlink(f"/proc/{name}/cwd")
        except OSError:
            continue
        demo_child = b"relay.demo_app" in cmdline or b"consumer.jobs.simulator" in cmdline
        if demo_child and (cwd == root or root.encode() in cmdline):
            found.append(int(name))
    return found


@pytest.mark.slow
def test_chaos_demo_kills_workers_mid_send_and_sends_one_email_per_quote(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "relay", "demo", "--chaos", "--duration", "8"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    # Not a terminal: the live view is one line per interval, not the screen reprinted.
    progress = [line for line in result.stdout.splitlines() if line.startswith("demo ")]
    assert progress and all("duplicate effects" in line for line in progress)
    assert "\x1b[" not in result.stdout
    lines = result.stdout.strip().splitlines()
    summary = CHAOS_SUMMARY.fullmatch(lines[-1])
    assert summary, lines[-1]
    quotes, sent, duplicates, killed, _mid_send, accepted, unknown, pending = map(
        int, summary.groups()
    )
    assert quotes > 0
    assert sent == quotes and duplicates == 0  # one customer-visible effect per quote
    assert killed >= 1
    assert (accepted, unknown, pending) == (quotes, 0, 0)  # every receipt reconciled
    # The usual summary still holds: every quote's job done once.
    assert lines[-2].startswith("stopped: ") and lines[-2].endswith(
        f"; {quotes} quotes sent, one job each"
    )
    # The demo's files are in .outbox/, none in the working directory itself.
    assert (tmp_path / ".outbox" / "simulator.db").exists()
    assert (tmp_path / ".outbox" / "outbox.db").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".outbox"]
    # Nothing left running: the embedded Redis released, every worker and the simulator
    # stopped and reaped.
    assert embedded_servers_in(tmp_path) == []
    assert _children_in(tmp_path) == []


@pytest.mark.slow
def test_chaos_demo_on_nats_sends_one_email_per_quote(tmp_path: Path) -> None:
    """``outbox-relay demo --broker-url nats://... --chaos`` (issue 40): the same loop with
    JetStream between the relay and the consumer, workers SIGKILLed mid-send, one email per
    quote. The demo's stream is the shared NATS's ``outbox_quote_approved``: removed before
    and after, so the run counts only its own events."""
    from tests.broker_support import _nats_run, nats_reachable

    url = nats_reachable()

    async def drop(js: Any) -> None:
        from nats.js.errors import NotFoundError

        with contextlib.suppress(NotFoundError):
            await js.delete_stream("outbox_quote_approved")

    _nats_run(drop)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(ROOT)
    try:
        command = [sys.executable, "-m", "relay", "demo", "--chaos", "--duration", "8"]
        result = subprocess.run(
            [*command, "--broker-url", url],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=150,
        )
    finally:
        _nats_run(drop)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    summary = CHAOS_SUMMARY.fullmatch(lines[-1])
    assert summary, lines[-1]
    quotes, sent, duplicates, killed, _mid_send, accepted, unknown, pending = map(
        int, summary.groups()
    )
    assert quotes > 0 and killed >= 1
    assert sent == quotes and duplicates == 0
    assert (accepted, unknown, pending) == (quotes, 0, 0)
    assert lines[-2].endswith(f"; {quotes} quotes sent, one job each"), lines[-2]
    assert _children_in(tmp_path) == []
