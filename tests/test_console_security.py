"""The console under attack (issue 41, items 1-9), each fixed as a class: one function that
renders URLs for display, server-side sessions, a body limit before authentication, path
segments from one helper, lists without payloads, strict integers, throttled tokens, the Host
header, the Secure cookie, the consumer's entry size limit, and one place that makes text safe
for a terminal. Real pipeline pieces (tests/console_support.py) on PostgreSQL and SQLite."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import urljoin

import pytest
import redis
import sqlalchemy as sa
from starlette.testclient import TestClient

from consumer.inbox import TOO_LARGE, build_inbox_schema
from outbox.console import cli as console_cli
from outbox.console.app import Console
from outbox.console.auth import COOKIE, Sessions
from outbox.console.cli import allowed_hosts
from outbox.console.params import path, segment
from outbox.console.schema import create_audit_table
from outbox.db import describe_url, make_engine
from outbox.display import display_url, printable, table
from relay import RedisStreamPublisher, Relay
from tests.console_support import World

TOKEN = "test-token-" + "x" * 20
BEARER = {"Authorization": f"Bearer {TOKEN}"}
SECRET = "S3cretPw"


@pytest.fixture
def world(db_url: str, redis_client: redis.Redis, stream_prefix: str) -> Iterator[World]:
    w = World(db_url, redis_client, stream_prefix)
    create_audit_table(w.engine)
    yield w
    w.close()


def client(console: Console) -> TestClient:
    return TestClient(console.app)


def csrf_of(page: str) -> str:
    return page.split('name="csrf" value="')[1].split('"')[0]


# -- 1. URLs for display: no password, wherever it is written ------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://ann:{SECRET}@db.internal:5432/app",
        f"postgresql+psycopg://ann@db.internal/app?password={SECRET}&sslmode=require",
        f"postgresql://db/app?sslpassword={SECRET}",
        f"redis://:{SECRET}@cache:6379/0",
        f"redis://cache:6379/0?password={SECRET}",
        f"rediss://user:{SECRET}@cache?Password={SECRET}",
        f"nats://n:{SECRET}@broker:4222?token={SECRET}",
        f"nats://{SECRET}@broker:4222",  # NATS token auth: the user part is the secret
        f"nats://n:{SECRET}@a:4222,nats://n:{SECRET}@b:4222",  # a server list
        f"tls://{SECRET}@broker:4222",
        f"host=db password={SECRET}",  # not a URL: shown as nothing of it
    ],
)
def test_display_url_hides_every_password(url: str) -> None:
    shown = display_url(url)
    assert SECRET not in shown and describe_url(url) == shown
    single = "://" in url and "," not in url  # SQLAlchemy reads one URL, not a list
    assert SECRET not in display_url(sa.make_url(url)) if single else True


def test_display_url_keeps_what_is_not_secret() -> None:
    assert display_url("sqlite:///outbox.db") == "sqlite:///outbox.db"
    shown = display_url(f"postgresql+psycopg://ann:{SECRET}@db:5432/app?sslmode=require")
    assert shown == "postgresql+psycopg://ann:***@db:5432/app?sslmode=require"


def test_pages_show_no_password_and_the_sign_in_page_shows_no_where(world: World) -> None:
    database = f"postgresql+psycopg://ann@db.internal/app?password={SECRET}"
    console = Console(
        world.engine,
        world.client,
        TOKEN,
        describe={"database": describe_url(database), "redis": describe_url("redis://c?pass=x")},
    )
    with client(console) as api:
        signed_in = api.get("/", headers=BEARER).text
        assert "db.internal" in signed_in and SECRET not in signed_in
        for path_ in ("/login", "/", "/jobs", "/trace?q=x"):
            anonymous = api.get(path_).text  # the sign-in page, before authentication
            assert "db.internal" not in anonymous and "redis://" not in anonymous, path_
            assert "ann" not in anonymous and SECRET not in anonymous


def test_the_relay_logs_its_database_without_a_password(
    pg_url: str, redis_client: redis.Redis, stream_prefix: str, caplog: Any
) -> None:
    url = sa.make_url(pg_url).update_query_dict({"password": SECRET})
    from outbox import Outbox

    outbox = Outbox(make_engine(url))
    outbox.create_schema()
    relay = Relay(outbox, RedisStreamPublisher(redis_client, f"{stream_prefix}.{{topic}}"))
    with caplog.at_level(logging.INFO, logger="outbox"):
        relay._log_start()
    logged = " ".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "relay started" in logged and "password=***" in logged and SECRET not in logged
    outbox.engine.dispose()


# -- 2. the body limit, before authentication ----------------------------------------------


def _raw_post(console: Console, path_: str, headers: dict[str, str], chunks: list[bytes]) -> Any:
    """POST through the ASGI app; returns (status, how many body chunks were read)."""
    read, sent = [0], []

    async def receive() -> dict[str, Any]:
        if read[0] < len(chunks):
            read[0] += 1
            more = read[0] < len(chunks)
            return {"type": "http.request", "body": chunks[read[0] - 1], "more_body": more}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path_,
        "raw_path": path_.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8780),
        "scheme": "http",
        "http_version": "1.1",
        "root_path": "",
    }
    asyncio.run(console.app(scope, receive, send))  # type: ignore[arg-type]
    return sent[0]["status"], read[0]


def test_a_large_body_is_refused_before_it_is_read(world: World) -> None:
    console = Console(world.engine, world.client, TOKEN)
    big = {"host": "testserver", "content-type": "application/x-www-form-urlencoded"}
    status, read = _raw_post(console, "/login", {**big, "content-length": str(150 << 20)}, [])
    assert (status, read) == (413, 0)  # 150 MB announced: not a byte read
    # Without a Content-Length (chunked): read up to the bound, then refused.
    chunks = [b"token=" + b"x" * 16384 for _ in range(640)]  # 10 MiB in 16 KiB chunks
    status, read = _raw_post(console, "/login", big, chunks)
    assert status == 413 and read <= 5
    status, _ = _raw_post(console, "/api/jobs/1/cancel", {**big, "content-length": "1e9"}, [])
    assert status == 400
    with client(console) as api:  # a normal sign-in still works
        ok = api.post("/login", data={"token": TOKEN, "next": "/jobs"}, follow_redirects=False)
        assert ok.status_code == 303 and ok.headers["location"] == "/jobs"


# -- 3. server-side sessions -----------------------------------------------------------------


def test_logout_ends_the_session_on_the_server(world: World) -> None:
    world.through_consumer(1)
    console = Console(world.engine, world.client, TOKEN)
    with client(console) as api:
        api.get(f"/login?token={TOKEN}")
        cookie = api.cookies[COOKIE]
        csrf = csrf_of(api.get("/jobs").text)
        assert api.post("/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    with client(console) as replay:  # the old cookie, kept by an attacker
        replay.cookies.set(COOKIE, cookie)
        assert replay.get("/api/jobs").status_code == 401
        job = world.store.claim_next("w", ttl=1)
        assert job is not None
        world.store.finish(job)
        answer = replay.post(
            f"/api/jobs/{job.job_id}/resume",
            json={"reason": "after logout"},
            headers={"x-csrf-token": csrf},
        )
        assert answer.status_code == 401
    assert len(console.guard.sessions) == 0


def test_sessions_expire_when_idle_and_at_their_absolute_age(world: World) -> None:
    now = [1000.0]
    sessions = Sessions(idle=60, absolute=300, clock=lambda: now[0])
    console = Console(world.engine, world.client, TOKEN, sessions=sessions)
    with client(console) as api:
        api.get(f"/login?token={TOKEN}")
        for _ in range(5):  # used every 50 s: the idle expiry never comes
            now[0] += 50
            assert api.get("/api/overview").status_code == 200
        now[0] += 51  # 301 s after sign-in
        assert api.get("/api/overview").status_code == 401
        api.get(f"/login?token={TOKEN}")
        now[0] += 61
        assert api.get("/api/overview").status_code == 401  # idle too long


def test_a_new_token_ends_every_session(world: World, tmp_path: Any) -> None:
    from outbox.console.cli import TokenFile

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    console = Console(world.engine, world.client, TokenFile(str(token_file)))
    with client(console) as api:
        api.get(f"/login?token={TOKEN}")
        assert api.get("/api/overview").status_code == 200
        new = "rotated-token-" + "y" * 20
        token_file.write_text(new + "\n\n")  # another size: seen as changed at once
        assert api.get("/api/overview").status_code == 401
        assert api.get("/api/overview", headers=BEARER).status_code == 401
        assert api.get("/api/overview", headers={"Authorization": f"Bearer {new}"}).is_success


# -- 4. path segments: one helper escapes "/" --------------------------------------------------


def test_segment_escapes_slashes_and_refuses_dot_segments() -> None:
    assert segment("../jobs/2") == "..%2Fjobs%2F2"
    assert path("receipts", "7:email/../x", "settle") == "/receipts/7%3Aemail%2F..%2Fx/settle"
    for bad in ("", ".", ".."):
        with pytest.raises(ValueError):
            segment(bad)


def test_a_queue_named_like_a_path_cannot_redirect_its_button(world: World) -> None:
    store = world.store
    store.enqueue("t", "victim")  # job 1, waiting for review: must not move
    lease = store.claim_next("w", ttl=60)
    assert lease is not None
    store.wait_review(lease, reason="receipt UNKNOWN")
    store.enqueue("t", "bait", queue="../jobs/1")
    console = Console(world.engine, world.client, TOKEN)
    with client(console) as api:
        api.get(f"/login?token={TOKEN}")
        page = api.get("/queues").text
        action = page.split('action="/queues/..')[1].split('"')[0]
        action = "/queues/.." + action
        assert action == "/queues/..%2Fjobs%2F1/pause"
        resolved = urljoin("http://testserver/queues", action)  # as a browser resolves it
        assert resolved == "http://testserver/queues/..%2Fjobs%2F1/pause"
        done = api.post(action, data={"reason": "r", "csrf": csrf_of(page), "back": "/queues"})
        assert done.status_code == 200
    assert store.paused_queues() == ["../jobs/1"]
    with world.engine.connect() as conn:
        state = conn.execute(sa.text("SELECT state FROM outbox_jobs WHERE action='victim'"))
        assert state.scalar_one() == "WAITING_REVIEW"


# -- 5. lists without payloads, one payload at a time ------------------------------------------


def test_lists_leave_payloads_out_and_cap_long_cells(world: World) -> None:
    world.dead_letter(1)
    dl = build_inbox_schema().dead_letters
    huge = json.dumps({"data": "x" * (3 << 20)})
    with world.engine.begin() as conn:
        conn.execute(sa.update(dl).values(payload=huge, error="e" * (1 << 20)))
    console = Console(world.engine, world.client, TOKEN)
    with client(console) as api:
        listed = api.get("/api/dead-letters", headers=BEARER)
        assert listed.status_code == 200 and len(listed.content) < 20_000
        (row,) = listed.json()["rows"]
        assert "payload" not in row and len(row["error"]) == 2000
        one = api.get(f"/api/dead-letters/{row['id']}", headers=BEARER).json()
        assert len(one["payload"]) == 1 << 20 and one["payload_truncated"] is True
        assert one["payload_chars"] == len(huge)
        assert api.get("/api/dead-letters/999", headers=BEARER).status_code == 404
        page = api.get("/dead-letters", headers=BEARER)
        assert page.status_code == 200 and len(page.content) < 50_000


# -- 6. the consumer's entry size limit ------------------------------------------------------


def test_an_entry_over_the_limit_is_dead_lettered_without_its_data(world: World) -> None:
    world.approve(1)
    world.publish()
    stream = world.stream_template.format(topic="quote.approved")
    fields = {k.decode(): v.decode() for k, v in world.client.xrange(stream)[0][1].items()}
    fields.update(id="big-one", identity="studio:big", data=json.dumps({"x": "y" * (10 << 20)}))
    world.client.xadd(stream, fields)  # type: ignore[arg-type]
    world.consume()
    with world.engine.connect() as conn:
        jobs = conn.execute(sa.text("SELECT action FROM outbox_jobs ORDER BY id")).all()
        dl = build_inbox_schema().dead_letters
        (dead,) = conn.execute(sa.select(dl)).mappings().all()
    assert [j[0] for j in jobs] == ["send-quote-001"]  # no 10 MB job
    assert dead["reason"] == TOO_LARGE and "max_entry_bytes" in dead["error"]
    assert dead["event_id"] == "big-one" and len(dead["payload"]) < 10_000
    assert world.client.xpending(stream, "billing")["pending"] == 0


# -- 7. throttling, the Host header, the Secure flag -----------------------------------------


def test_wrong_tokens_are_throttled_per_client(world: World) -> None:
    console = Console(world.engine, world.client, TOKEN)
    with client(console) as api:
        answers = [api.get("/login?token=wrong-guess").status_code for _ in range(30)]
        assert set(answers) == {401}
        throttled = api.get("/login?token=one-more-guess", follow_redirects=False)
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) > 0
        wrong = {"Authorization": "Bearer wrong-guess"}
        assert api.get("/api/overview", headers=wrong).status_code == 429
        # A valid token is never locked out by someone else's guesses (issue 53): the
        # operators behind the same proxy or on the same host keep working.
        assert api.get("/api/overview", headers=BEARER).status_code == 200
        signed_in = api.get(f"/login?token={TOKEN}", follow_redirects=False)
        assert signed_in.status_code == 303
    other = TestClient(console.app, client=("10.0.0.9", 4000))
    assert other.get("/api/overview", headers={"Authorization": "Bearer x"}).status_code == 401


def test_forwarded_for_is_honoured_from_trusted_proxies_only(world: World) -> None:
    """X-Forwarded-For from an untrusted peer changes nothing: the throttle counts the peer
    (a forger cannot spread guesses over invented addresses), and the serve command runs
    uvicorn with proxy_headers=False so it never rewrites the peer itself (issue 53)."""
    console = Console(world.engine, world.client, TOKEN)
    with TestClient(console.app, client=("127.0.0.1", 4000)) as api:
        for n in range(30):
            forged = {"Authorization": "Bearer guess", "X-Forwarded-For": f"10.9.9.{n}"}
            assert api.get("/api/overview", headers=forged).status_code == 401
        last = {"Authorization": "Bearer guess", "X-Forwarded-For": "10.9.9.99"}
        assert api.get("/api/overview", headers=last).status_code == 429
    proxied = Console(world.engine, world.client, TOKEN, trusted_proxies=["10.0.0.1"])
    with TestClient(proxied.app, client=("10.0.0.1", 4000)) as api:
        for _ in range(30):
            forwarded = {"Authorization": "Bearer guess", "X-Forwarded-For": "203.0.113.7"}
            assert api.get("/api/overview", headers=forwarded).status_code == 401
        other = {"Authorization": "Bearer guess", "X-Forwarded-For": "203.0.113.8"}
        assert api.get("/api/overview", headers=other).status_code == 401  # per client
    assert "proxy_headers=False" in inspect.getsource(console_cli)


def test_the_host_header_must_name_the_console(world: World) -> None:
    console = Console(world.engine, world.client, TOKEN, allowed_hosts=["console.example"])
    api = TestClient(console.app, base_url="http://console.example")
    assert api.get("/api/overview", headers=BEARER).status_code == 200
    evil = TestClient(console.app, base_url="http://attacker.example")
    assert evil.get("/api/overview", headers=BEARER).status_code == 400
    assert evil.get("/login").status_code == 400
    assert allowed_hosts("127.0.0.1", None) == ("localhost", "127.0.0.1", "::1")
    assert "10.1.2.3" in allowed_hosts("10.1.2.3", None)
    assert allowed_hosts("0.0.0.0", ("ops.example",)) == ("ops.example",)


def test_the_cookie_is_secure_behind_tls(world: World) -> None:
    def cookie(console: Console, **headers: str) -> str:
        with TestClient(console.app, client=("10.0.0.1", 4000)) as api:
            answer = api.get(f"/login?token={TOKEN}", headers=headers, follow_redirects=False)
            return str(answer.headers["set-cookie"])

    plain = Console(world.engine, world.client, TOKEN)
    assert "secure" not in cookie(plain).lower()
    assert "secure" not in cookie(plain, **{"x-forwarded-proto": "https"}).lower()  # untrusted
    proxied = Console(world.engine, world.client, TOKEN, trusted_proxies=["10.0.0.1"])
    assert "Secure" in cookie(proxied, **{"x-forwarded-proto": "https"})
    assert "Secure" in cookie(Console(world.engine, world.client, TOKEN, secure_cookies=True))


# -- 8. strict parameters: 4xx, never 500 ------------------------------------------------------


def test_bad_parameters_are_4xx_never_500(world: World) -> None:
    world.through_consumer(5)
    console = Console(world.engine, world.client, TOKEN)
    with client(console) as api:
        for query in ("limit=²", "limit=٣", "limit=0", "limit=501", "limit=+5", "limit= 5"):
            answer = api.get(f"/api/jobs?{query}", headers=BEARER)
            assert answer.status_code == 400, query
        big = __import__("base64").urlsafe_b64encode(json.dumps([10**30]).encode()).decode()
        assert api.get(f"/api/jobs?cursor={big}", headers=BEARER).status_code == 400
        assert api.get(f"/jobs?cursor={big}", headers=BEARER).status_code == 400
        assert api.get("/api/trace?q=a%00b", headers=BEARER).status_code == 400
        assert api.get("/trace?q=a%00b", headers=BEARER).status_code == 400
        assert api.get("/api/events?topic=a%00b", headers=BEARER).status_code == 400
        job_id = world.store.claim_next("w", ttl=1)
        assert job_id is not None and job_id.job_id < 10
        full_width = chr(0xFF10 + job_id.job_id)
        answer = api.post(f"/api/jobs/{full_width}/cancel", headers=BEARER, json={"reason": "x"})
        assert answer.status_code == 404
        answer = api.post("/api/events/a%00b/requeue", headers=BEARER, json={"reason": "x"})
        assert answer.status_code == 404
        deep = "[" * 30_000 + "]" * 30_000  # within the body limit, far past the parser's depth
        answer = api.post(
            "/api/jobs/1/cancel",
            headers={**BEARER, "content-type": "application/json"},
            content=deep,
        )
        assert 400 <= answer.status_code < 500
        too_deep = "[" * 200_000 + "]" * 200_000
        answer = api.post("/api/jobs/1/cancel", headers=BEARER, content=too_deep)
        assert answer.status_code == 413
    with world.engine.connect() as conn:
        state = conn.execute(sa.text(f"SELECT state FROM outbox_jobs WHERE id={job_id.job_id}"))
        assert state.scalar_one() == "LEASED"  # not cancelled by its fullwidth twin


# -- 9. text for a terminal ------------------------------------------------------------------


def test_printable_escapes_terminal_controls() -> None:
    hostile = "ref\x1b[2J\x1b]0;pwned\x07\r\u202eevil\u2028"
    shown = printable(hostile)
    assert all(ord(c) >= 32 and c not in "\x7f\u202e\u2028" for c in shown)
    assert shown == "ref\\e[2J\\e]0;pwned\\x07\\r\\u202eevil\\u2028"
    assert table([("A", "B"), ("\x1b[31mred", "1")]) == "A" + " " * 10 + "B\n\\e[31mred  1"


def test_receipts_and_queues_reach_the_terminal_escaped(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import consumer.jobs.cli
    from consumer.jobs.store import Store

    store = Store(pg_url)
    store.create_schema()
    store.enqueue("t", "hostile", queue="q\x1b[2J\x1b]0;title\x07")
    lease = store.claim_next("w", ttl=60)
    assert lease is not None
    store.enqueue("t", "waiting", queue="q\x1b[2J\x1b]0;title\x07")  # READY: listed
    with store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_operations (operation_id, job_id, provider, request_digest, "
                "state, provider_ref, attempts, created_at, updated_at) VALUES "
                "('op\x1b[31m', :job, 'mail', 'd', 'ACCEPTED', 'ref\x1b[2J\x1b[H', 1, 0, 0)"
            ),
            {"job": lease.job_id},
        )
    store.dispose()
    for argv in (["receipts"], ["queues", "list"]):
        capsys.readouterr()
        assert consumer.jobs.cli.main([*argv, "--database-url", pg_url]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out, argv
        assert "\\e[" in out, (argv, out)


def test_a_nats_clients_errors_never_show_its_credentials() -> None:
    """The relay logs a broker outage's message: a NATS URL's password or token is not in
    it, nor in a refused URL's message (issue 53)."""
    from outbox.errors import BrokerUnavailable, ConfigError
    from outbox.nats_client import NatsClient, broker_kind

    client = NatsClient(f"nats://bob:{SECRET}@127.0.0.1:1", timeout=0.5)
    try:
        with pytest.raises(BrokerUnavailable) as info:
            client.run(lambda js: js.account_info())
        assert SECRET not in str(info.value) and "bob:***@127.0.0.1:1" in str(info.value)
    finally:
        client.close()
    with pytest.raises(ConfigError) as refused:
        broker_kind(f"ftp://bob:{SECRET}@host")
    assert SECRET not in str(refused.value)
