"""What a newcomer or a careless caller trips on (issue 41, items 10-20): each case fails
with a clear, typed error or does what the user meant."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox import InvalidEvent, Outbox
from outbox.console.app import Console
from outbox.console.schema import create_audit_table

TOKEN = "test-token-" + "x" * 20


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("payload", {"payload": {"note": "half an emoji \ud83d"}}),
        ("payload", {"payload": {"\udfff": 1}}),
        ("key", {"key": "quote-\ud800"}),
        ("tenant", {"tenant": "\ud83d"}),
        ("identity", {"identity": "studio:\udc00"}),
        ("headers", {"headers": {"x-note": "\ud800"}}),
    ],
)
def test_a_lone_surrogate_is_an_invalid_event(
    sqlite_url: str, field: str, kwargs: dict[str, Any]
) -> None:
    outbox = Outbox(sqlite_url)
    outbox.create_schema()
    args: dict[str, Any] = {"key": "quote-1", "payload": {"total": 1}, **kwargs}
    with pytest.raises(InvalidEvent, match="lone surrogate") as caught, outbox.transaction() as tx:
        tx.emit("quote.approved", **args)
    assert caught.value.field == field  # type: ignore[attr-defined]
    with outbox.engine.connect() as conn:  # nothing was written
        assert conn.exec_driver_sql("SELECT count(*) FROM outbox_events").scalar_one() == 0


def test_sign_in_keeps_the_deep_link_and_its_query(
    sqlite_url: str, redis_client: redis.Redis
) -> None:
    outbox = Outbox(sqlite_url)
    outbox.create_schema()
    create_audit_table(outbox.engine)
    console = Console(outbox.engine, redis_client, TOKEN)
    with TestClient(console.app) as browser:
        page = browser.get("/trace?q=studio%3Asend-quote-017&x=1")
        assert page.status_code == 401
        deep = page.text.split('name="next" value="')[1].split('"')[0]
        assert deep == "/trace?q=studio%3Asend-quote-017&amp;x=1"  # HTML-escaped
        signed = browser.post(
            "/login",
            data={"token": TOKEN, "next": deep.replace("&amp;", "&")},
            follow_redirects=False,
        )
        assert signed.headers["location"] == "/trace?q=studio%3Asend-quote-017&x=1"
        assert "studio:send-quote-017" in browser.get(signed.headers["location"]).text
        by_link = browser.get(
            f"/login?token={TOKEN}&next=/jobs%3Fstate%3DREADY", follow_redirects=False
        )
        assert by_link.headers["location"] == "/jobs?state=READY"
        outside = browser.get(f"/login?token={TOKEN}&next=//evil.example/", follow_redirects=False)
        assert outside.headers["location"] == "/"


def test_every_extra_the_docs_install_is_also_shown_from_a_clone() -> None:
    """Until the package is published, ``pip install 'outbox-toolkit[x]'`` fails: each page
    that says it also says ``pip install -e '.[x]'``."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        text = page.read_text()
        for extra in set(re.findall(r"pip install '?outbox-toolkit\[(\w+)\]", text)):
            if f"pip install -e '.[{extra}]'" not in text:
                missing.append(f"{page.relative_to(root)}: [{extra}]")
    assert not missing, missing


def test_the_console_page_traces_the_quickstart_quote() -> None:
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    identity = "studio:send-quote-17"
    assert identity in (docs / "quickstart.md").read_text()
    console = (docs / "how-to" / "console.md").read_text()
    assert identity in console and "quote-017" not in console


def _cli(name: str) -> Any:
    import consumer.cli
    import consumer.jobs.cli
    import outbox.console.cli
    import relay.cli

    return {
        "relay": relay.cli.main,
        "consumer": consumer.cli.main,
        "worker": consumer.jobs.cli.main,
        "console": outbox.console.cli.main,
    }[name]


@pytest.mark.parametrize(
    ("cli", "argv", "says"),
    [
        ("relay", ["run", "--metrics-port", "-5"], "--metrics-port: must be a whole number"),
        ("consumer", ["run", "a:b", "--metrics-port", "-5"], "must be a whole number"),
        ("worker", ["run", "a:b", "--metrics-port", "65536"], "must be from 0 to 65535"),
        ("relay", ["run", "--metrics-port", "\uff18\uff10"], "in ASCII digits"),
        ("relay", ["status", "--log-level", "verbose"], "--log-level: invalid"),
        ("relay", ["init-db", "--log-level", "verbose"], "--log-level: invalid"),
        ("console", ["init-db", "--log-level", "loud"], "--log-level: invalid"),
        ("consumer", ["run", "../../etc/passwd:x"], "dotted Python names"),
        ("worker", ["run", "./app:worker"], "dotted Python names"),
        ("relay", ["run", "--batchsize", "5"], "outbox-relay run: error: unrecognized"),
        ("worker", ["receipts", "--no-such-flag"], "outbox-worker receipts: error"),
    ],
)
def test_command_lines_are_checked_alike(
    cli: str, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = _cli(cli)(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = int(exit_.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_an_error_in_the_users_module_names_its_file_and_line(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "shop_consumers.py").write_text("import os\n\nbilling = undefined_name\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{tmp_path}/x.db")
    code = _cli("consumer")(["run", "shop_consumers:billing"])
    assert code == 1
    err = capsys.readouterr().err
    assert "NameError: name 'undefined_name' is not defined" in err
    assert f"{tmp_path / 'shop_consumers.py'}:3" in err and "Traceback" not in err


def test_httpx_logs_each_call_only_at_debug() -> None:
    import logging

    from outbox.logs import setup_logging

    root = logging.getLogger()
    kept = root.handlers[:], root.level
    try:
        setup_logging("info")
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        setup_logging("debug")
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
    finally:
        root.handlers[:], _ = kept[0], root.setLevel(kept[1])
        logging.getLogger("httpx").setLevel(logging.NOTSET)


def test_consumer_run_builds_a_bare_consumer_on_the_given_database(
    pg_url: str,
    redis_client: redis.Redis,
    stream_prefix: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``Consumer()`` without a URL in the user's module, ``OUTBOX_DATABASE_URL`` set: the
    consumer and a ``Store(consumer.engine)`` the module builds are on that database, not
    on a SQLite file; a module whose Consumer names another database is refused (exit 2),
    as ``outbox-worker run`` refuses a Worker with its own Store."""
    import sys

    import sqlalchemy as sa

    import consumer.cli
    from consumer import Consumer
    from relay import RedisStreamPublisher, Relay

    url = redis_client.connection_pool.connection_kwargs
    redis_url = f"redis://{url.get('host', '127.0.0.1')}:{url.get('port', 6379)}/{url.get('db', 0)}"
    (tmp_path / "billing_app.py").write_text(
        "from consumer import Consumer, Store\n"
        f"consumer = Consumer(redis={redis_url!r}, group='billing', topics=['quote.approved'],\n"
        f"                    stream={stream_prefix + '.{topic}'!r})\n"
        "store = Store(consumer.engine)\n"
        "@consumer.handler('quote.approved')\n"
        "def on_quote(event, tx):\n"
        "    store.enqueue(event.tenant, 'send-' + event.subject, session=tx.session)\n"
    )
    (tmp_path / "other_app.py").write_text(
        "from consumer import Consumer\n"
        f"consumer = Consumer({'sqlite:///' + str(tmp_path / 'other.db')!r}, group='g',"
        " topics=['t'])\n"
        "consumer.handler('t')(lambda event, tx: None)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_url)
    outbox = Outbox(pg_url)
    outbox.create_schema()
    with outbox.transaction() as tx:
        tx.emit("quote.approved", key="quote-17", payload={}, tenant="studio")
    Relay(outbox, RedisStreamPublisher(redis_client, f"{stream_prefix}.{{topic}}")).run_once()

    def run(self: Consumer, stop: object = None) -> None:
        while self.run_once(block=False):
            pass

    monkeypatch.setattr(Consumer, "run", run)
    monkeypatch.setattr("consumer.cli.GracefulStop.install", lambda self, *a: self)
    assert consumer.cli.main(["run", "billing_app:consumer"]) == 0
    module = sys.modules.pop("billing_app")
    assert module.store.engine.url.get_backend_name() == "postgresql"
    with outbox.engine.connect() as conn:
        actions = conn.execute(sa.text("SELECT action FROM outbox_jobs")).scalars().all()
    assert actions == ["send-quote-17"]
    assert not (tmp_path / "outbox.db").exists()  # no SQLite file on the side

    capsys.readouterr()
    assert consumer.cli.main(["run", "other_app:consumer"]) == 2
    assert "cannot apply" in capsys.readouterr().err
    sys.modules.pop("other_app", None)
    outbox.engine.dispose()


def test_drain_surfaces_a_failing_consumer_handler(tmp_path: Any) -> None:
    """outbox.testing: a handler that raises is in the drain's result and in the message
    of the assertion that then fails, not only in a log record's extra fields."""
    from outbox.testing import Pipeline

    with Pipeline(tmp_path) as p:

        def on_quote(event: Any, tx: Any) -> None:
            p.store.enqueue(
                "studio", f"send-{event.subject}", payload=event.dat, session=tx.session
            )

        p.consumer("billing", {"quote.approved": on_quote})
        with p.outbox.transaction() as tx:
            tx.emit("quote.approved", key="quote-17", payload={}, tenant="studio")
        result = p.drain()
        assert result.handled == 0
        (failure,) = result.failures
        assert "AttributeError" in failure and "'dat'" in failure and "billing" in failure
        assert "AttributeError" in str(result)
        with pytest.raises(AssertionError) as caught:
            p.assert_jobs(READY=1)
        assert "handler failures during drain()" in str(caught.value)
        assert "'dat'" in str(caught.value)


@pytest.mark.parametrize("sweep", [False, True], ids=["by-dispatch", "by-sweep"])
def test_the_trace_shows_a_receipt_reconciled_after_a_crash(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, sweep: bool
) -> None:
    """The seed's crash: the worker dies after the provider accepted; the next attempt
    finds the effect by lookup. The receipt says it was reconciled (settled_by), the worker
    logs it, and the DONE job's earlier error is not shown as an error."""
    import logging

    from outbox.console.queries import Tables, present_tables
    from outbox.console.trace import collect
    from outbox.testing import Pipeline

    with Pipeline(tmp_path) as p:
        mail = p.fake_provider("mail", lookup=True, idempotency=False)

        def on_quote(event: Any, tx: Any) -> None:
            p.store.enqueue(
                "studio", f"send-{event.subject}", subject=event.subject, session=tx.session
            )

        def send(job: Any) -> None:
            job.dispatch("email", "mail", {"to": "ann"})

        p.consumer("billing", {"quote.approved": on_quote})
        p.worker({"send-quote": send}, providers={"mail": mail})
        with p.outbox.transaction() as tx:
            tx.emit(
                "quote.approved",
                key="quote-17",
                payload={},
                tenant="studio",
                identity="studio:send-quote-17",
            )
        p.kill_at("after_accepted")
        assert p.drain().killed == "after_accepted"
        p.restart()
        p.clock.advance(minutes=1)
        with caplog.at_level(logging.INFO, logger="outbox"):
            if sweep:
                p.workers[0].operations.reconcile()  # type: ignore[union-attr]
            p.drain()
        p.assert_effects("send-quote-17", 1)
        tables = Tables.build()
        with p.engine.connect() as conn:
            story = collect(conn, tables, "studio:send-quote-17", present_tables(p.engine, tables))
        (receipt,) = story.receipts
        assert receipt["state"] == "ACCEPTED" and receipt["settled_by"] == "reconciler"
        assert "lookup" in receipt["settled_reason"]
        logged = [r.getMessage() for r in caplog.records]
        assert any("reconciled" in m for m in logged), logged
        assert not any(m.startswith("HTTP Request") for m in logged)


def test_a_dispatch_that_finds_its_effect_by_lookup_says_it_reconciled(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The next attempt's own dispatch (not the sweep) finds the earlier effect: the
    receipt is settled_by the reconciler, and the worker's log says so."""
    import logging

    from consumer import Operations, ProviderTimeout, Store
    from outbox.testing import Clock

    class Mail:
        name, supports_lookup, supports_idempotency, timeout = "mail", True, False, 0.2
        sent: dict[str, str] = {}

        def send(self, request: Any, *, operation_id: str, idempotency_key: Any) -> str:
            self.sent[operation_id] = f"msg-{len(self.sent) + 1}"
            raise ProviderTimeout("accepted, then the answer was lost")

        def lookup(self, operation_id: str) -> str | None:
            return self.sent.get(operation_id)

    clock = Clock()
    store = Store(sqlite_url, clock=clock)
    store.create_schema()
    ops = Operations(store, {"mail": Mail()})
    store.enqueue("studio", "send-quote-17")
    lease = store.claim_next("w", ttl=60)
    assert lease is not None
    with pytest.raises(ProviderTimeout):
        ops.dispatch(lease, "email", "mail", {"to": "ann"})
    clock.advance(0.3)  # the call's deadline (its timeout, 0.2 s) passes
    with caplog.at_level(logging.INFO, logger="outbox"):
        receipt = ops.dispatch(lease, "email", "mail", {"to": "ann"})
    assert receipt.state == "ACCEPTED" and receipt.reconciled
    row = ops.receipt(f"{lease.job_id}:email")
    assert row is not None and row.settled_by == "reconciler"
    assert any("reconciled" in r.getMessage() for r in caplog.records)
    store.dispose()


def test_an_outage_is_logged_once_a_minute_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A duty that fails every second through a 2-minute outage: one line when it starts,
    one a minute while it lasts, one when it ends (it was a line a second, and no end)."""
    import logging

    from sqlalchemy.exc import OperationalError

    from outbox.outage import Streak

    now = [0.0]
    streak = Streak(logging.getLogger("outbox.worker"), "liveness beat", clock=lambda: now[0])
    outage = OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
    with caplog.at_level(logging.INFO, logger="outbox"):
        for _ in range(121):
            streak.failed(outage)
            now[0] += 1.0
        streak.succeeded()
        streak.succeeded()  # nothing more to say
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "liveness beat failed",
        "liveness beat still failing",
        "liveness beat still failing",
        "liveness beat recovered",
    ]
    assert caplog.records[-1].fields == {"failures": 121, "failing_seconds": 121.0}  # type: ignore[attr-defined]
    assert all(r.exc_info is None for r in caplog.records)  # an outage: no traceback


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("url", "once", "says"),
    [
        ("postgresql+psycopg://postgres@nosuchhost.invalid/test", False, "is the URL right?"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/no_such_db_41", False, "is the URL right?"),
        ("postgresql+psycopg://no_such_role_41@127.0.0.1:5432/test", True, "is the URL right?"),
        ("postgresql+psycopg://postgres@127.0.0.1:1/test", True, "Connection refused"),
    ],
)
def test_relay_run_fails_fast_on_a_wrong_url_and_once_on_any(
    url: str, once: bool, says: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in the URL never mends: `run` says so at once instead of retrying for ever
    (a real outage, connection refused, is still waited out by `run`); `--once` fails on
    any unreachable database."""
    argv = ["run", "--database-url", url, "--redis-url", redis_url]
    assert _cli("relay")([*argv, "--once"] if once else argv) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_destroyed_group_reading_again_does_not_count_its_dead_letters_twice(
    sqlite_url: str, redis_client: redis.Redis, stream_prefix: str
) -> None:
    from consumer.inbox import build_inbox_schema
    from outbox.hooks import Hooks
    from tests.console_support import World

    counted: list[int] = []

    class Counting(Hooks):
        def consumer_dead_lettered(self, group: str, stream: str, count: int) -> None:
            counted.append(count)

    world = World(sqlite_url, redis_client, stream_prefix)
    world.consumer.hooks = Counting()
    world.dead_letter(1)
    assert counted == [1]
    stream = world.stream_template.format(topic="quote.approved")
    redis_client.xgroup_destroy(stream, "billing")  # an operator's reset, from the start
    redis_client.xgroup_create(stream, "billing", id="0")
    world.failing.add("studio:send-quote-001")
    world.consume()  # the group is created again at 0: the entry comes again and fails again
    assert counted == [1]
    copies = redis_client.xrange(world.consumer.dead_letter_stream_for(stream))
    assert len(copies) == 1  # nor copied to the dead-letter stream again
    with world.engine.connect() as conn:
        dl = build_inbox_schema().dead_letters
        assert conn.execute(sa.select(sa.func.count()).select_from(dl)).scalar_one() == 1
    world.close()
