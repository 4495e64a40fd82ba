"""``outbox-simulator serve`` as a process: its command line, its persistence across its
own restarts, its capabilities switches and its fault plan."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from consumer.jobs.simulator import main as simulator_main
from tests.services import free_port
from tests.simulator_support import ROOT, SimulatorProcess

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatorProcess]:
    with SimulatorProcess(tmp_path_factory.mktemp("sim") / "effects.db") as process:
        yield process


@pytest.fixture
def sim(shared: SimulatorProcess) -> SimulatorProcess:
    """The module's simulator, emptied: no effects, no faults, both capabilities on."""
    shared.client.delete(f"{shared.url}/effects").raise_for_status()
    shared.faults()
    shared.configure(idempotency=True, lookup=True)
    return shared


@pytest.fixture
def own_sim(tmp_path: Path) -> Iterator[SimulatorProcess]:
    """A simulator of this test's own, for tests that stop or restart it."""
    with SimulatorProcess(tmp_path / "effects.db") as process:
        yield process


def send(
    sim: SimulatorProcess,
    body: object,
    *,
    key: str | None = None,
    op: str = "1:email",
    **headers: str,
) -> httpx.Response:
    h = {"Operation-Id": op, **headers}
    if key is not None:
        h["Idempotency-Key"] = key
    return sim.client.post(sim.send_url, json=body, headers=h)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer.jobs.simulator", *args],
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- command line --------------------------------------------------------------------------------


def test_help_and_bad_usage_exit_codes() -> None:
    helped = cli("serve", "--help")
    assert helped.returncode == 0
    assert "--data" in helped.stdout and "OUTBOX_SIMULATOR_PORT" in helped.stdout
    assert cli().returncode == 2
    assert simulator_main(["serve", "--port", "many"]) == 2
    assert simulator_main(["--help"]) == 0
    bad_env = cli("serve", env={"OUTBOX_SIMULATOR_LOOKUP": "maybe"})
    assert bad_env.returncode == 2
    assert "OUTBOX_SIMULATOR_LOOKUP" in bad_env.stderr


def test_a_taken_port_exits_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("serve", "--port", str(port), "--data", str(tmp_path / "x.db"))
    assert result.returncode == 1
    # The problem in words, one line, not "[Errno 98] Address already in use".
    assert result.stderr.strip() == (
        f"outbox-simulator: cannot listen on 127.0.0.1:{port}: the port is in use "
        "(another simulator?); --port 0 picks a free one"
    )


def test_sigterm_exits_0_and_env_configures_the_run(tmp_path: Path) -> None:
    port = free_port()
    env = {
        "OUTBOX_SIMULATOR_PORT": str(port),
        "OUTBOX_SIMULATOR_DATA": str(tmp_path / "env.db"),
        "OUTBOX_SIMULATOR_IDEMPOTENCY": "0",
        "OUTBOX_SIMULATOR_LOOKUP": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "consumer.jobs.simulator", "serve"],
        cwd=ROOT,
        env=dict(os.environ, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == f"listening on http://127.0.0.1:{port}"
        config = httpx.get(f"http://127.0.0.1:{port}/config", timeout=10).json()
        assert config == {
            "idempotency": False,
            "lookup": False,
            "latency": 0.0,  # a send takes no extra time unless --latency says so
            "jitter": 0.0,
            "capacity": None,
        }
        assert (tmp_path / "env.db").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_sigterm_while_a_request_hangs_still_exits_0(own_sim: SimulatorProcess) -> None:
    sim = own_sim
    sim.faults({"kind": "hang"})
    with httpx.Client() as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(sim.send_url, json={"n": 1}, timeout=0.5)
        assert sim.stop() == 0


# -- persistence ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
@pytest.mark.slow  # a simulator process of its own, stopped and started again (~24 s under load)
def test_effects_survive_a_restart(own_sim: SimulatorProcess, kill: bool) -> None:
    sim = own_sim
    first = send(sim, {"to": "a"}, key="k1", op="1:email").json()["id"]
    send(sim, {"to": "b"}, op="2:email")
    port = sim.port
    sim.restart(kill=kill)
    assert sim.port == port
    effects = sim.effects()
    assert [e["operation_id"] for e in effects] == ["1:email", "2:email"]
    assert effects[0]["id"] == first and effects[0]["body"] == {"to": "a"}
    # idempotency and lookup still know the effects made before the restart
    replay = send(sim, {"to": "a"}, key="k1", op="1:email")
    assert replay.status_code == 200 and replay.json() == {
        "id": first,
        "operation_id": "1:email",
        "replayed": True,
    }
    assert sim.client.get(f"{sim.url}/lookup/1:email").json()["id"] == first
    assert sim.health() == {"ok": True, "effects": 2}


# -- capabilities --------------------------------------------------------------------------------


def test_idempotency_replays_same_body_and_refuses_another(sim: SimulatorProcess) -> None:
    created = send(sim, {"to": "a"}, key="k")
    assert created.status_code == 201
    replay = send(sim, {"to": "a"}, key="k")
    assert replay.status_code == 200 and replay.json()["id"] == created.json()["id"]
    # the same JSON in another key order is the same body
    assert send(sim, {"to": "a"}, key="k").json()["replayed"] is True
    conflict = send(sim, {"to": "z"}, key="k")
    assert conflict.status_code == 409
    assert "another request body" in conflict.json()["error"]
    assert len(sim.effects()) == 1


def test_idempotency_off_per_run_and_per_request(sim: SimulatorProcess) -> None:
    send(sim, {"n": 1}, key="k")
    assert send(sim, {"n": 1}, key="k", **{"X-Sim-Idempotency": "off"}).status_code == 201
    assert len(sim.effects()) == 2
    assert sim.configure(idempotency=False) == {
        "idempotency": False,
        "lookup": True,
        "latency": 0.0,
        "jitter": 0.0,
        "capacity": None,
    }
    assert send(sim, {"n": 1}, key="k").status_code == 201
    assert len(sim.effects()) == 3
    assert send(sim, {"n": 1}, key="k", **{"X-Sim-Idempotency": "on"}).status_code == 200


def test_lookup_on_off_per_run_and_per_request(sim: SimulatorProcess) -> None:
    ref = send(sim, {"n": 1}, op="9:email").json()["id"]
    assert sim.client.get(f"{sim.url}/lookup/9:email").json()["id"] == ref
    assert sim.client.get(f"{sim.url}/lookup/8:email").status_code == 404
    off = sim.client.get(f"{sim.url}/lookup/9:email", headers={"X-Sim-Lookup": "off"})
    assert off.status_code == 404
    sim.configure(lookup=False)
    assert sim.client.get(f"{sim.url}/lookup/9:email").status_code == 404
    on = sim.client.get(f"{sim.url}/lookup/9:email", headers={"X-Sim-Lookup": "on"})
    assert on.json()["id"] == ref


def test_bad_requests_to_the_simulator(sim: SimulatorProcess) -> None:
    raw = sim.client.post(sim.send_url, content=b"{not json")
    assert raw.status_code == 400
    assert sim.client.get(f"{sim.url}/nowhere").status_code == 404
    assert (
        sim.client.post(f"{sim.url}/faults", json={"faults": [{"kind": "explode"}]}).status_code
        == 400
    )
    assert (
        httpx.post(
            f"{sim.url}/faults", json={"faults": [{"kind": "late", "delay": -1}]}
        ).status_code
        == 400
    )
    assert sim.client.post(f"{sim.url}/config", json={"lookup": "yes"}).status_code == 400
    assert send(sim, {"n": 1}, **{"X-Sim-Fault": "late;delay"}).status_code == 400
    assert sim.effects() == []
    assert sim.health()["ok"]


# -- the fault plan ------------------------------------------------------------------------------


def test_the_next_n_sends_meet_a_fault_then_it_is_used_up(sim: SimulatorProcess) -> None:
    plan = sim.faults({"kind": "rate_limit", "count": 2, "retry_after": 4})
    assert plan == [{"kind": "rate_limit", "count": 2, "delay": 0.0, "retry_after": "4"}]
    first = send(sim, {"n": 1})
    assert first.status_code == 429 and first.headers["Retry-After"] == "4"
    assert send(sim, {"n": 1}).status_code == 429
    assert send(sim, {"n": 1}).status_code == 201
    assert sim.client.get(f"{sim.url}/faults").json()["faults"][0]["count"] == 0
    assert len(sim.effects()) == 1


def test_probability_rules_with_a_seed_and_per_operation_rules(sim: SimulatorProcess) -> None:
    sim.faults(
        {"kind": "unauthorized", "operation_id": "7:email"},
        {"kind": "unavailable", "probability": 0.5},
        seed=42,
    )
    assert send(sim, {"n": 1}, op="7:email").status_code == 401
    statuses = [send(sim, {"n": i}, op=f"{i}:x").status_code for i in range(40)]
    assert set(statuses) == {201, 503}  # about half each; the seed makes it repeatable
    sim.faults({"kind": "unavailable", "probability": 0.5}, seed=42)
    again = [send(sim, {"n": i}, op=f"{i}:y").status_code for i in range(40)]
    assert again == statuses
    sim.faults({"kind": "unavailable", "probability": 0.0})
    assert send(sim, {"n": 1}, op="z").status_code == 201
    assert sim.client.delete(f"{sim.url}/faults").json() == {"faults": []}


@pytest.mark.parametrize(
    ("kind", "status", "acted"),
    [
        ("error_before", 500, False),
        ("error_after", 500, True),
        ("unauthorized", 401, False),
        ("forbidden", 403, False),
        ("bad_request", 400, False),
        ("unprocessable", 422, False),
        ("unavailable", 503, False),
    ],
)
def test_fault_kinds_answer_and_act_as_documented(
    sim: SimulatorProcess, kind: str, status: int, acted: bool
) -> None:
    sim.faults({"kind": kind, "count": 1})
    assert send(sim, {"n": 1}).status_code == status
    assert len(sim.effects()) == (1 if acted else 0)


def test_accept_then_hang_makes_the_effect_and_never_answers(sim: SimulatorProcess) -> None:
    sim.faults({"kind": "hang", "count": 1})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.send_url, json={"n": 1}, headers={"Operation-Id": "h"}, timeout=0.5)
    assert [e["operation_id"] for e in sim.effects()] == ["h"]


def test_reset_after_accepting(sim: SimulatorProcess) -> None:
    with pytest.raises(httpx.TransportError):
        send(sim, {"n": 1}, **{"X-Sim-Fault": "reset"})
    assert len(sim.effects()) == 1


def test_effects_can_be_cleared(sim: SimulatorProcess) -> None:
    send(sim, {"n": 1})
    assert sim.client.delete(f"{sim.url}/effects").json() == {"effects": []}
    assert sim.effects() == []


def test_stats_count_requests_since_start(sim: SimulatorProcess) -> None:
    before = sim.stats()
    send(sim, {"n": 1}, key="s1", op="s:1")
    send(sim, {"n": 1}, key="s1", op="s:1")
    send(sim, {"n": 2}, key="s1", op="s:1")
    send(sim, {"n": 1}, **{"X-Sim-Fault": "unauthorized"})
    sim.client.get(f"{sim.url}/lookup/s:1")
    sim.client.get(f"{sim.url}/lookup/s:2")
    after = sim.stats()
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {
        "sends": 4,
        "effects": 1,
        "replays": 1,
        "conflicts": 1,
        "faults": 1,
        "lookups": 2,
        "lookups_found": 1,
    }


def _reset(sock: socket.socket) -> None:
    """Close with RST, as a SIGKILLed worker's kernel does with a half-sent request."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.slow  # a simulator process of its own, stopped to read its log (~14 s under load)
def test_a_client_killed_mid_send_leaves_no_traceback_in_the_log(own_sim: SimulatorProcess) -> None:
    for partial in (
        b"POST /send HTTP/1.1\r\nHost: x\r\nContent-Len",  # cut in the headers
        b"POST /send HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",  # in the body
        b"POST /se",  # in the request line
    ):
        with socket.create_connection(("127.0.0.1", own_sim.port)) as sock:
            sock.sendall(partial)
            _reset(sock)
    # The server still answers, and its log shows nothing of the three.
    assert own_sim.client.get(f"{own_sim.url}/health").status_code == 200
    assert own_sim.stop() == 0  # and its whole output read
    assert "Traceback" not in own_sim.log(), own_sim.log()
    assert "ConnectionResetError" not in own_sim.log(), own_sim.log()
