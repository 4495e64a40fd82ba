"""``outbox-consumer``: usage, dead letters, replay, SIGTERM, and the kill test (real
subprocesses SIGKILLed mid-batch and restarted; exactly one job per identity afterwards)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from consumer import Consumer
from consumer.cli import main
from consumer.consumer import ConsumerConfig
from consumer.event import encode_entry

sys.path.insert(0, str(Path(__file__).parent))
import consumer_app
from cluster_support import RedisTarget
from services import wait_for

REPO = Path(__file__).resolve().parent.parent
TOPIC = "job.requested"
BIN = Path(sys.executable).parent / "outbox-consumer"


def publish_many(client: redis.Redis, stream: str, specs: list[tuple[str, str]]) -> None:
    pipe = client.pipeline(transaction=False)
    for n, (identity, event_id) in enumerate(specs, 1):
        pipe.xadd(stream, encode_entry(TOPIC, {"n": n}, event_id=event_id, identity=identity))  # type: ignore[arg-type]
        if n % 1000 == 0:
            pipe.execute()
    pipe.execute()


def count_jobs(engine: sa.Engine) -> tuple[int, int]:
    table = consumer_app.jobs
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(sa.func.count(), sa.func.count(sa.distinct(table.c.identity)))
        ).one()
    return int(row[0]), int(row[1])


def jobs_by(engine: sa.Engine, pid: int) -> int:
    table = consumer_app.jobs
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(table.c.worker == str(pid))
        return int(conn.execute(query).scalar_one())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Sample name with labels -> value, from the exporter's text format."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def jobs_stream(redis_target: RedisTarget, stream_prefix: str) -> str:
    """The test's stream: ``<prefix>.jobs``, hash-tagged on the cluster (``<prefix>.{jobs}``:
    its dead-letter stream ``<prefix>.{jobs}.dead-letter`` lands in the same slot)."""
    return redis_target.hash_tagged(f"{stream_prefix}.{{topic}}").format(topic="jobs")


@pytest.fixture
def redis_client(redis_target: RedisTarget) -> Iterator[Any]:
    """A client of ``redis_target`` (a RedisCluster on the cluster); this module's tests that
    talk to Redis run on one server and on the cluster (issue 13)."""
    client = redis_target.connect()
    yield client
    client.close()


class App:
    """Starts ``outbox-consumer run consumer_app:build`` subprocesses against one stream."""

    def __init__(
        self, tmp: Path, db_url: str, redis_target: RedisTarget, stream: str, **env: str
    ) -> None:
        self.tmp = tmp
        self.db_url = db_url
        # ``--redis-url`` and, on the cluster, ``--redis-cluster``.
        self.redis_args = ["--redis-url", redis_target.url, *redis_target.extra_args]
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
            "CONSUMER_APP_STREAM": stream,
            "OUTBOX_LOG_LEVEL": "info",
            **env,
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log_of: dict[int, Path] = {}
        self.logs = 0

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        self.logs += 1
        path = self.tmp / f"consumer-{self.logs}.log"
        log = open(path, "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                str(BIN),
                "run",
                "consumer_app:build",
                "--database-url",
                self.db_url,
                *self.redis_args,
                *extra,
            ],
            cwd=self.tmp,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs.append(proc)
        self.log_of[proc.pid] = path
        return proc

    def started(self, proc: subprocess.Popen[bytes]) -> bool:
        """Past startup (its SIGTERM handler is installed): it logged "consumer started"."""
        return "consumer started" in self.log_of[proc.pid].read_text()

    def logs_text(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.tmp.glob("consumer-*.log")))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def app_factory(tmp_path: Path, redis_target: RedisTarget) -> Iterator[Callable[..., App]]:
    apps: list[App] = []

    def make(db_url: str, stream: str, **env: str) -> App:
        engine = sa.create_engine(db_url)
        consumer_app.metadata.create_all(engine)
        engine.dispose()
        app = App(tmp_path, db_url, redis_target, stream, **env)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()


# -- usage ---------------------------------------------------------------------------------


def test_help_and_bad_usage(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["--help"]) == 0
    assert "dead-letters" in capsys.readouterr().out
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--metrics-port" in out and "OUTBOX_DATABASE_URL" in out
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["run"]) == 2
    assert main(["replay", "not-a-number"]) == 2
    capsys.readouterr()
    assert main(["run", "no-colon"]) == 2
    assert "MODULE:ATTRIBUTE" in capsys.readouterr().err
    assert main(["run", "no_such_module_xyz:thing"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert main(["run", "consumer_app:nothing"]) == 2
    assert "no attribute" in capsys.readouterr().err
    assert main(["run", "consumer_app:metadata"]) == 2
    assert "not a Consumer" in capsys.readouterr().err
    assert main(["run", "consumer_app:build", "--batch-size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err
    monkeypatch.setenv("OUTBOX_METRICS_PORT", "many")
    assert main(["run", "consumer_app:build"]) == 2
    assert "OUTBOX_METRICS_PORT" in capsys.readouterr().err
    # A factory that fails is a failure of the application, not bad usage.
    monkeypatch.delenv("OUTBOX_METRICS_PORT")
    monkeypatch.delenv("CONSUMER_APP_STREAM", raising=False)
    assert main(["run", "consumer_app:build"]) == 1
    assert "CONSUMER_APP_STREAM" in capsys.readouterr().err


def test_recovery_intervals_come_from_flags_and_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONSUMER_APP_STREAM", "recovery.flags")
    ran: list[ConsumerConfig] = []

    def run(self: Consumer, stop: object = None) -> None:
        ran.append(self.config)

    monkeypatch.setattr(Consumer, "run", run)
    monkeypatch.setattr("consumer.cli.GracefulStop.install", lambda self, *a: self)
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--claim-idle-ms", "--heartbeat-ttl-ms", "--heartbeat-interval-ms"):
        assert flag in out
    assert "OUTBOX_HEARTBEAT_TTL_MS" in out

    monkeypatch.setenv("OUTBOX_HEARTBEAT_TTL_MS", "8000")
    monkeypatch.setenv("OUTBOX_CLAIM_IDLE_MS", "60000")
    args = ["run", "consumer_app:build", "--claim-idle-ms", "45000"]
    assert main([*args, "--heartbeat-interval-ms", "2000", "--block-ms", "250"]) == 0
    [config] = ran
    assert config.heartbeat_ttl_ms == 8000  # the environment
    assert config.claim_idle_ms == 45000  # the flag wins over the environment
    assert (config.heartbeat_interval_ms, config.block_ms) == (2000, 250)
    assert config.max_deliveries == 5  # neither: the application's own

    # Validated like the config object: exit 2 naming the setting.
    assert main(["run", "consumer_app:build", "--heartbeat-interval-ms", "9000"]) == 2
    assert "heartbeat_interval_ms" in capsys.readouterr().err
    monkeypatch.setenv("OUTBOX_HEARTBEAT_TTL_MS", "soon")
    assert main(["run", "consumer_app:build"]) == 2
    assert "OUTBOX_HEARTBEAT_TTL_MS" in capsys.readouterr().err


def test_dead_letters_and_replay(
    db_url: str,
    redis_target: RedisTarget,
    redis_client: redis.Redis,
    stream_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stream = jobs_stream(redis_target, stream_prefix)
    consumer = Consumer(
        db_url,
        redis_target.consumer_url,
        group="app",
        streams=[stream],
        config=ConsumerConfig(max_deliveries=1),
    )
    fixed = {"yes": False}

    @consumer.handler(TOPIC)
    def handle(event: Any, tx: Any) -> None:
        if not fixed["yes"]:
            raise RuntimeError("provider rejected the template")
        tx.session.execute(
            sa.insert(consumer_app.jobs).values(
                identity=event.identity, event_id=event.id, worker="t"
            )
        )

    consumer_app.metadata.create_all(consumer.engine)
    publish_many(redis_client, stream, [("q-1", "evt-1")])
    assert consumer.run_once(block=False) == 1
    capsys.readouterr()

    assert main(["dead-letters", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert "evt-1" in out and "RuntimeError: provider rejected the template" in out
    assert main(["dead-letters", "--database-url", db_url, "--json"]) == 0
    [record] = json.loads(capsys.readouterr().out)
    assert record["reason"] == "poison" and record["state"] == "needs_attention"
    assert record["payload"]["id"] == "evt-1" and record["group_name"] == "app"

    fixed["yes"] = True
    args = ["--database-url", db_url, "--redis-url", redis_target.url, *redis_target.extra_args]
    assert main(["replay", str(record["id"]), *args]) == 0
    assert "replayed dead-letter record" in capsys.readouterr().out
    assert consumer.run_once(block=False) == 1
    assert count_jobs(consumer.engine) == (1, 1)
    assert main(["replay", str(record["id"]), *args]) == 1
    assert "was replayed" in capsys.readouterr().err
    assert main(["replay", "987654", *args]) == 1
    assert "no dead-letter record with id 987654" in capsys.readouterr().err
    assert main(["dead-letters", "--database-url", db_url]) == 0
    assert "no dead letters" in capsys.readouterr().out
    assert main(["dead-letters", "--database-url", db_url, "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["state"] == "replayed"
    consumer.engine.dispose()


@pytest.mark.slow  # a consumer process and 300 events (4-13 s)
def test_run_drains_and_exits_zero_on_sigterm(
    pg_url: str,
    redis_target: RedisTarget,
    redis_client: redis.Redis,
    stream_prefix: str,
    app_factory: Callable[..., App],
) -> None:
    stream = jobs_stream(redis_target, stream_prefix)
    app = app_factory(
        pg_url, stream, CONSUMER_APP_FAIL_IDENTITY="poison", CONSUMER_APP_MAX_DELIVERIES="1"
    )
    port = free_port()
    proc = app.start("--batch-size", "50", "--group", "app", "--metrics-port", str(port))
    specs = [(f"id-{n}", f"evt-{n}") for n in range(300)] + [("poison", "evt-poison")]
    publish_many(redis_client, stream, specs)
    engine = sa.create_engine(pg_url)
    try:
        wait_for(lambda: count_jobs(engine)[0] >= 300, "jobs", timeout=60)
        wait_for(lambda: redis_client.xpending(stream, "app")["pending"] == 0, "acks", timeout=60)
        # The exporter serves the process counters and the dead-letter gauge of its database.
        wait_for(
            lambda: scrape(port).get('outbox_dead_letters{group="app",reason="poison"}') == 1.0,
            "dead-letter gauge",
            timeout=60,
        )
        handled = f'outbox_consumer_handled_total{{group="app",stream="{stream}"}}'
        assert scrape(port)[handled] >= 300
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, app.logs_text()
        assert count_jobs(engine) == (300, 300)
        # The poison entry went to the dead-letter stream and NEEDS_ATTENTION.
        assert redis_client.xlen(f"{stream}.dead-letter") == 1
        with engine.connect() as conn:
            reasons = conn.execute(
                sa.text("SELECT reason, event_id FROM consumer_dead_letters")
            ).all()
        assert [tuple(r) for r in reasons] == [("poison", "evt-poison")]
    finally:
        engine.dispose()


def pending_of(client: redis.Redis, stream: str) -> dict[str, int]:
    """Consumer name -> pending entries, in group "app" (none before the group exists)."""
    try:
        summary = client.xpending(stream, "app")
    except redis.ResponseError:
        return {}
    return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"] or []}


def idle_ms_of(client: redis.Redis, stream: str, pid: int) -> int:
    for info in client.xinfo_consumers(stream, "app"):
        if f"-{pid}-" in info["name"].decode():
            return int(info["idle"])
    return -1


@pytest.mark.slow  # waits out 6 s of a hung peer, two processes (14-27 s)
def test_a_consumer_killed_mid_batch_is_taken_over_by_a_live_peer_with_the_defaults(
    pg_url: str,
    redis_target: RedisTarget,
    redis_client: redis.Redis,
    stream_prefix: str,
    app_factory: Callable[..., App],
) -> None:
    """Default settings (claim_idle_ms 30 s): the survivor leaves a live, hung peer's batch
    alone, and takes it over within a few seconds of that peer's SIGKILL (its heartbeat key
    expires)."""
    stream = jobs_stream(redis_target, stream_prefix)
    victim_app = app_factory(pg_url, stream, CONSUMER_APP_HANG_IDENTITY="id-hang")
    survivor_app = app_factory(pg_url, stream)
    specs = [(f"id-{n}", f"evt-{n}") for n in range(200)] + [("id-hang", "evt-hang")]
    publish_many(redis_client, stream, specs)
    engine = sa.create_engine(pg_url)
    try:
        victim = victim_app.start()
        # It read the whole stream in one batch and hangs in the middle of it.
        wait_for(
            lambda: sum(pending_of(redis_client, stream).values()) == 201,
            "victim's batch",
            timeout=60,
        )
        survivor = survivor_app.start()
        wait_for(lambda: survivor_app.started(survivor), "survivor started", timeout=60)
        # The victim is alive (its heartbeat thread runs) though idle in the group well past
        # the heartbeat TTL: the survivor must not take its entries.
        wait_for(
            lambda: idle_ms_of(redis_client, stream, victim.pid) >= 6000,
            "victim idle 6 s",
            timeout=60,
        )
        assert list(pending_of(redis_client, stream).values()) == [201]
        assert count_jobs(engine) == (0, 0)

        victim.send_signal(signal.SIGKILL)
        victim.wait()
        # Within a few seconds (heartbeat TTL 3 s), not claim_idle_ms (30 s): the bound
        # is generous for a loaded machine, the log says which path took the entries.
        wait_for(lambda: count_jobs(engine) == (201, 201), "survivor takes over", timeout=25)
        wait_for(lambda: redis_client.xpending(stream, "app")["pending"] == 0, "acks", timeout=60)
        assert "claimed a dead consumer's pending entries" in survivor_app.logs_text()
        assert jobs_by(engine, survivor.pid) == 201
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(timeout=30) == 0, survivor_app.logs_text()
    finally:
        engine.dispose()


@pytest.mark.slow
def test_kill_test_exactly_one_job_per_identity(
    pg_url: str,
    redis_target: RedisTarget,
    redis_client: redis.Redis,
    stream_prefix: str,
    app_factory: Callable[..., App],
) -> None:
    stream = jobs_stream(redis_target, stream_prefix)
    app = app_factory(
        pg_url, stream, CONSUMER_APP_CLAIM_IDLE_MS="1000", CONSUMER_APP_MAX_DELIVERIES="1000"
    )
    # 10,000 events, 9,000 identities: 1,000 identities are published twice (new event ids).
    specs = [(f"id-{n % 9000}", f"evt-{n}") for n in range(10_000)]
    publish_many(redis_client, stream, specs)
    engine = sa.create_engine(pg_url)
    flags = ("--batch-size", "50")
    try:
        victim = app.start(*flags)
        survivor = app.start(*flags)
        kills = interrupted = 0
        while kills < 10 and count_jobs(engine)[0] < 7500:
            # Kill once the victim itself is handling entries: it spends its time in
            # batches, so the kill lands mid-batch (checked below from what it left pending).
            wait_for(
                lambda p=victim.pid: jobs_by(engine, p) >= 100 or count_jobs(engine)[1] == 9000,
                "victim progress",
                timeout=60,
            )
            if jobs_by(engine, victim.pid) < 100:
                break  # the others finished first
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            kills += 1
            summary = redis_client.xpending(stream, "app")
            left = [c for c in summary["consumers"] if f"-{victim.pid}-" in c["name"].decode()]
            interrupted += bool(left and left[0]["pending"] > 0)
            victim = app.start(*flags)
        assert kills >= 3, "the consumers finished before the victim could be killed enough"
        assert interrupted >= 1, "no kill left a batch pending"
        print(f"kills={kills} mid-batch={interrupted} jobs before the drain={count_jobs(engine)}")

        def done() -> bool:
            return (
                count_jobs(engine)[1] == 9000
                and redis_client.xpending(stream, "app")["pending"] == 0
            )

        wait_for(done, "every identity handled and nothing pending", timeout=120)

        for proc in (victim, survivor):
            wait_for(lambda p=proc: app.started(p), "consumer started", timeout=60)
            proc.send_signal(signal.SIGTERM)
        for proc in (victim, survivor):
            assert proc.wait(timeout=30) == 0, app.logs_text()
        total, distinct = count_jobs(engine)
        assert (total, distinct) == (9000, 9000), f"{total - distinct} duplicate jobs"
        assert redis_client.xpending(stream, "app")["pending"] == 0
        with engine.connect() as conn:
            dead = conn.execute(sa.text("SELECT count(*) FROM consumer_dead_letters")).scalar()
        assert dead == 0
    finally:
        engine.dispose()


@pytest.mark.slow  # a private PostgreSQL stopped and started under a consumer process (~10 s)
def test_a_consumer_waits_out_its_database_in_one_line_a_warning_and_recovers(
    redis_target: RedisTarget,
    redis_client: redis.Redis,
    stream_prefix: str,
    app_factory: Callable[..., App],
) -> None:
    """Its database stopped under it, a consumer logs each failure as one line naming the
    database (no traceback: an outage is not a bug), keeps its entries pending, and handles
    everything once the database is back (issue 26: tracebacks reached the user for every
    consumer warning while the database was down)."""
    from services import PrivatePostgres

    stream = jobs_stream(redis_target, stream_prefix)
    with PrivatePostgres() as pg:
        app = app_factory(pg.url, stream)
        engine = sa.create_engine(pg.url)
        try:
            proc = app.start()
            wait_for(lambda: app.started(proc), "consumer started", timeout=60)
            publish_many(redis_client, stream, [(f"id-{n}", f"evt-{n}") for n in range(20)])
            wait_for(lambda: count_jobs(engine) == (20, 20), "the first 20", timeout=60)
            engine.dispose()
            pg.stop()
            publish_many(redis_client, stream, [(f"id-{n}", f"evt-{n}") for n in range(20, 40)])
            wait_for(lambda: "consumer batch failed" in app.logs_text(), "a failed batch", 60)
            pg.start()
            wait_for(lambda: count_jobs(engine) == (40, 40), "all 40 after the outage", 90)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, app.logs_text()
        finally:
            engine.dispose()
    text = app.logs_text()
    failures = [json.loads(line) for line in text.splitlines() if "batch failed" in line]
    assert failures and all(f.get("service") == "database" for f in failures), text
    assert "Traceback" not in text, text
