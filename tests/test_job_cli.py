"""``outbox-worker jobs reply|cancel`` (issue 59): a reply or a cancel from a shell, with its
exit codes (0 done, 1 no such job or a refused move, 2 bad usage) and ``--json``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from consumer.jobs.cli import main
from consumer.jobs.context import JobContext
from consumer.jobs.states import CANCELLED, DONE, LEASED, READY
from consumer.jobs.store import Store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def test_jobs_reply_wakes_a_waiting_job_and_its_run_sees_the_payload(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    job = store.enqueue("studio", "send-quote-201").job_id
    lease = store.claim_next("w", ttl=30)
    assert lease is not None
    JobContext(store, lease).wait_external("the customer's answer", until=10**10)
    argv = ["jobs", "reply", "studio", "send-quote-201", "--reply-id", "mail-1"]
    argv += ["--payload", '{"answer": "accepted"}', "--source", "mail", "--database-url", db_url]

    assert main([*argv, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer == {
        "job_id": job,
        "reply_id": "mail-1",
        "duplicate": False,
        "resumed": True,
        "state": READY,
        "kept": False,
    }
    assert main(argv) == 0  # the same reply again: a duplicate, still a success
    assert "duplicate" in capsys.readouterr().out
    lease = store.claim_next("w", ttl=30)
    assert lease is not None
    [reply] = JobContext(store, lease).replies
    assert (reply.payload, reply.source) == ({"answer": "accepted"}, "mail")


def test_jobs_reply_to_a_job_not_enqueued_is_kept_for_its_first_run(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["jobs", "reply", "studio", "q-9", "--reply-id", "r1", "--payload", '"yes"']
    assert main([*argv, "--database-url", db_url]) == 0
    assert "kept for the job's first run" in capsys.readouterr().out
    store.enqueue("studio", "q-9")
    lease = store.claim_next("w", ttl=30)
    assert lease is not None
    assert [r.payload for r in JobContext(store, lease).replies] == ["yes"]


def test_jobs_cancel_a_ready_job_and_request_it_of_a_running_one(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = store.enqueue("studio", "a").job_id
    store.enqueue("studio", "b", priority=-1)
    url = ["--database-url", db_url]
    assert main(["jobs", "cancel", str(ready), "--reason", "typo", "--json", *url]) == 0
    assert json.loads(capsys.readouterr().out) == {"job": str(ready), "state": CANCELLED}
    assert store.get(ready).state == CANCELLED
    lease = store.claim_next("w", ttl=30)
    assert lease is not None and lease.action == "b"
    assert main(["jobs", "cancel", "studio", "b", "--reason", "customer left", *url]) == 0
    assert capsys.readouterr().out.strip() == f"studio/b: {LEASED}"
    assert JobContext(store, lease).cancelled
    # A finished job cannot be cancelled: a failure, one line on stderr.
    store.finish_batch([lease])
    done = store.enqueue("studio", "c").job_id
    held = store.claim_next("w", ttl=30)
    assert held is not None
    store.finish_batch([held])
    assert store.get(done).state == DONE
    assert main(["jobs", "cancel", str(done), "--reason", "late", *url]) == 1
    assert "outbox-worker" in capsys.readouterr().err


def test_jobs_exit_codes_for_bad_usage_and_unknown_jobs(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--database-url", db_url]
    reply = ["jobs", "reply", "studio", "q", "--reply-id", "r1"]
    assert main([*reply, "--payload", "not json", *url]) == 2
    assert "--payload is not JSON" in capsys.readouterr().err
    assert main([*reply, *url]) == 2  # no --payload
    assert main([*reply, "--payload", "1", "--reason", "x", *url]) == 2
    assert main(["jobs", "cancel", "17", *url]) == 2  # no --reason
    assert main(["jobs", "cancel", "studio", "--reason", "x", *url]) == 2  # tenant, no action
    assert main(["jobs", "cancel", "17", "--reason", "x", "--reply-id", "r", *url]) == 2
    assert main(["jobs", "reply", "studio", "q", "--reply-id", "", "--payload", "1", *url]) == 2
    assert main(["jobs", "nudge", "17", *url]) == 2
    capsys.readouterr()
    assert main(["jobs", "reply", "999999", "--reply-id", "r", "--payload", "1", *url]) == 1
    assert "no job #999999" in capsys.readouterr().err
    assert main(["jobs", "cancel", "999999", "--reason", "x", *url]) == 1


def test_jobs_help_is_the_installed_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "consumer.jobs.cli", "jobs", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "{reply,cancel,show,graph,keys}" in done.stdout and "--reply-id" in done.stdout
