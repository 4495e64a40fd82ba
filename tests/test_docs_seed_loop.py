"""The seed's loop as the docs write it, with every process real (issue 59, slow tier).

The application is docs/how-to/replies.md's ``conversation.py`` (a quote emailed, a wait for
the customer, a reply as a domain event, a bounce sending the job to review) wired by the
same page's ``conversation_app.py``, both taken from the page as written: a page that drifts
from the code fails here. Real processes on PostgreSQL and a private Redis: the connector
simulator as the mail provider, ``outbox-relay run``, ``outbox-consumer run``,
``outbox-worker run`` and ``outbox-worker inbound serve``; the customer's answer and a cancel
go through ``outbox-worker jobs reply|cancel``, a reply that comes before its job and a
bounce through the signed endpoint.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from consumer.jobs.inbound import sign
from consumer.jobs.store import Store
from outbox import Outbox
from tests.docs_runner import python_blocks
from tests.services import PrivateRedis, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "how-to" / "replies.md"
SECRET = "the-seed-loop-inbound-secret"

pytestmark = pytest.mark.slow


def page_module(title: str) -> str:
    [block] = [b for b in python_blocks(PAGE) if b.title == title]
    return block.source


class Processes:
    """The loop's processes, stopped with SIGTERM at the end (each must exit 0)."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd, self.env = cwd, env
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []

    def start(
        self, name: str, *argv: str, stdout: Any = subprocess.DEVNULL
    ) -> subprocess.Popen[str]:
        log = (self.cwd / f"{name}.log").open("a")
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            cwd=self.cwd,
            env=self.env,
            stdout=stdout,
            stderr=log,
            text=True,
        )
        self.procs.append((name, proc))
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{(self.cwd / f'{name}.log').read_text()[-2000:]}"
            for name, _ in self.procs
        )

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs:
            try:
                codes[name] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        assert all(code == 0 for code in codes.values()), (codes, self.logs())


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    server = PrivateRedis().start()
    try:
        yield server
    finally:
        server.close()


def test_the_seed_loop_from_the_docs_runs_as_processes(
    pg_url: str, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    (tmp_path / "conversation.py").write_text(page_module("conversation.py"))
    (tmp_path / "conversation_app.py").write_text(page_module("conversation_app.py"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "APP_DATABASE_URL": pg_url,
        "APP_REDIS_URL": redis_server.url,
        "OUTBOX_DATABASE_URL": pg_url,
        "OUTBOX_LOG_LEVEL": "warning",
        "OUTBOX_INBOUND_SECRET": SECRET,
    }
    run = Processes(tmp_path, env)
    store = Store(pg_url)
    outbox = Outbox(pg_url)
    sys.path.insert(0, str(tmp_path))
    try:
        simulator = run.start(
            "simulator",
            *("consumer.jobs.simulator", "serve", "--port", "0", "--data", "mail.db"),
            stdout=subprocess.PIPE,
        )
        assert simulator.stdout is not None
        mail_url = simulator.stdout.readline().split()[-1]  # "listening on http://..."
        env["APP_MAIL_URL"] = mail_url
        app = importlib.import_module("conversation").Conversation(outbox, store)
        port = free_port()
        run.start("relay", "relay.cli", "run", "--redis-url", redis_server.url)
        run.start("consumer", "consumer.cli", "run", "conversation_app:consumer")
        run.start("worker", "consumer.jobs.cli", "run", "conversation_app:worker")
        run.start("inbound", "consumer.jobs.cli", "inbound", "serve", "--port", str(port))
        inbound = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: httpx.get(f"{inbound}/healthz").status_code == 200,
            "the inbound endpoint",
            timeout=60,
            ignore=(httpx.HTTPError,),
        )

        def state(quote: int) -> str | None:
            try:
                return store.get("studio", f"quote-{quote}").state
            except LookupError:
                return None

        def until(quote: int, wanted: str) -> None:
            wait_for(
                lambda: state(quote) == wanted,
                f"quote-{quote} {wanted}",
                60,
                0.1,
                diagnose=run.logs,
            )

        def emails(quote: int) -> int:
            job = store.get("studio", f"quote-{quote}")
            found = httpx.get(f"{mail_url}/effects", params={"operation_id": f"{job.id}:quote"})
            return len(found.json()["effects"])

        def post(path: str, data: dict[str, Any]) -> httpx.Response:
            body = json.dumps(data).encode()
            return httpx.post(f"{inbound}{path}", content=body, headers=sign(SECRET, body))

        def cli(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "consumer.jobs.cli", "jobs", *argv],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )

        # 17: emailed, waits for its customer, whose answer comes from a shell: DONE.
        app.create(17, "ann@example.com")
        app.approve(17)
        until(17, "WAITING_EXTERNAL")
        assert emails(17) == 1
        answered = cli(
            "reply",
            "studio",
            "quote-17",
            "--reply-id",
            "mail-4711",
            "--source",
            "customer",
            "--payload",
            '{"answer": "accepted"}',
            "--json",
        )
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["resumed"] is True
        until(17, "DONE")

        # 18: the customer answered before the job existed: kept, seen by its first run,
        # which ends the conversation without an email.
        early = post(
            "/replies",
            {
                "job": {"tenant": "studio", "action": "quote-18"},
                "reply_id": "mail-18",
                "source": "customer",
                "payload": {"answer": "accepted"},
            },
        )
        assert (early.status_code, early.json()["kept"]) == (202, True), early.text
        app.create(18, "bob@example.com")
        app.approve(18)
        until(18, "DONE")
        assert emails(18) == 0
        assert [r.reply_id for r in store.replies("studio", "quote-18")] == ["mail-18"]

        # 19: the email bounces; the provider's signed callback wakes the job: review.
        app.create(19, "nobody@example.invalid")
        app.approve(19)
        until(19, "WAITING_EXTERNAL")
        job = store.get("studio", "quote-19")
        bounce = post(
            "/deliveries",
            {
                "operation_id": f"{job.id}:quote",
                "status": "bounced",
                "event_id": "bounce-19",
                "detail": "550 no such user",
            },
        )
        assert bounce.status_code == 200 and bounce.json()["woke"] is True, bounce.text
        until(19, "WAITING_REVIEW")
        assert store.get("studio", "quote-19").wait_reason.endswith("550 no such user")

        # 20: cancelled from a shell while it waits.
        app.create(20, "eve@example.com")
        app.approve(20)
        until(20, "WAITING_EXTERNAL")
        cancelled = cli("cancel", "studio", "quote-20", "--reason", "the customer left")
        assert cancelled.returncode == 0, cancelled.stderr
        assert state(20) == "CANCELLED"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("conversation", None)
        run.stop()
        store.dispose()
        outbox.engine.dispose()
