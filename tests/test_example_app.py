"""examples/fastapi_quotes end to end: the one command (run.py) starts uvicorn, the relay
and billing as real processes; the test drives the app over HTTP on a free port, against
PostgreSQL and Redis, and sees the approved quote become a finished job."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from consumer import Store
from tests.services import wait_for

RUN = Path(__file__).resolve().parents[1] / "examples" / "fastapi_quotes" / "run.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_done(http: httpx.Client, quote_id: int) -> Any:
    """The quote's job once it is DONE (None before: billing has not made or run it yet)."""
    job = http.get(f"/quotes/{quote_id}").json()["job"]
    return job if job and job["state"] == "DONE" else None


def stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM the example (it stops its three processes) and return its exit status."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover - surfaced by the caller's assert
        process.kill()
        return process.wait()


@pytest.mark.slow
def test_quote_approved_over_http_becomes_a_job(
    pg_url: str, redis_url: str, stream_prefix: str, redis_client: Any, tmp_path: Path
) -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            str(RUN),
            "--port",
            str(port),
            "--database-url",
            pg_url,
            "--redis-url",
            redis_url,
            "--stream",
            f"{stream_prefix}.{{topic}}",
            "--group",
            f"{stream_prefix}-billing",
        ],
        cwd=tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=10) as http:
            wait_for(
                lambda: http.get("/quotes/1").status_code == 404,
                "the app to answer",
                timeout=60,
                interval=0.1,
                ignore=(httpx.TransportError,),
            )
            created = http.post("/quotes", json={"tenant": "studio", "total": 120})
            assert created.status_code == 201, created.text
            quote_id = created.json()["id"]
            approved = http.post(f"/quotes/{quote_id}/approve")
            assert approved.status_code == 200, approved.text
            assert approved.json()["state"] == "approved"
            again = http.post(f"/quotes/{quote_id}/approve")  # rolled back: no second event
            assert again.status_code == 409
            assert http.post("/quotes/999/approve").status_code == 404
            assert http.post("/quotes", json={"tenant": "", "total": 1}).status_code == 422

            job = wait_for(
                lambda: job_done(http, quote_id),
                "the job to be created and run",
                timeout=60,
                interval=0.1,
                ignore=(httpx.TransportError,),
            )
            assert job["action"] == f"send-quote-{quote_id}"
        store = Store(pg_url, create_schema=False)
        try:
            assert store.get("studio", f"send-quote-{quote_id}").state == "DONE"
        finally:
            store.dispose()
        # Exactly one event reached the stream (the refused second approval wrote none).
        assert redis_client.xlen(f"{stream_prefix}.quote.approved") == 1
    finally:
        returncode = stop(process)
    assert returncode == 0


def test_run_says_what_it_needs_and_exits_1_without_uvicorn() -> None:
    """Without fastapi (the README's install line for the example gives it), run.py says so
    and fails,
    instead of exiting 0 after a child's ``No module named uvicorn``."""
    hide = (
        "import runpy, sys; sys.modules['uvicorn'] = None; "
        f"sys.argv = [{str(RUN)!r}]; runpy.run_path({str(RUN)!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == "this example needs uvicorn, not installed here: pip install uvicorn"
    )


@pytest.mark.slow  # the example on its embedded defaults: three processes, an embedded Redis
def test_run_on_the_embedded_defaults_keeps_its_files_in_dot_outbox(tmp_path: Path) -> None:
    """With no URLs, the example's SQLite file and embedded Redis go in ``.outbox/`` (git
    ignores it), as the demo's do, not in the user's working directory."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(RUN), "--port", str(port)], cwd=tmp_path)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            wait_for(
                lambda: http.get("/quotes/1").status_code == 404,
                "the app to answer",
                timeout=60,
                interval=0.1,
                ignore=(httpx.TransportError,),
            )
            quote_id = http.post("/quotes", json={"tenant": "studio", "total": 120}).json()["id"]
            assert http.post(f"/quotes/{quote_id}/approve").status_code == 200

            wait_for(lambda: job_done(http, quote_id), "the job done", timeout=60, interval=0.1)
    finally:
        returncode = stop(process)
    assert returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == [".outbox"]
    assert (tmp_path / ".outbox" / "outbox.db").exists()
