"""``outbox.testing`` (issue 24): the pipeline in one object, its assertions, the fake
provider, the test's clock and the kill points. Every test that builds a pipeline runs on
the embedded default (a SQLite file and an embedded Redis in ``tmp_path``) and on PostgreSQL
with the shared Redis (a schema and a key prefix of the pipeline's own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from consumer import HttpProvider, JobContext, Store, Worker
from consumer.consumer import ConsumerTx
from consumer.errors import TransientFailure
from consumer.event import ConsumedEvent
from consumer.jobs.simulation import Simulator, SimulatorConfig
from consumer.jobs.simulator import serve
from outbox.backoff import Backoff
from outbox.errors import ConfigError
from outbox.hooks import Hooks
from outbox.testing import DrainError, FakeProvider, Killed, Pipeline
from relay.config import RelayConfig

ROOT = Path(__file__).resolve().parent.parent
DAY = 86400.0


@pytest.fixture(params=["embedded", "pg"])
def pipeline(
    request: pytest.FixtureRequest, tmp_path: Path, pg_admin_engine: sa.Engine, redis_url: str
) -> Iterator[Pipeline]:
    if request.param == "embedded":
        made = Pipeline(tmp_path)
    else:
        base = pg_admin_engine.url.render_as_string(hide_password=False)
        made = Pipeline(database_url=base, redis_url=redis_url)
    try:
        yield made
    finally:
        made.close()


# -- the user's code, as a team would write it ---------------------------------------------


def approve_quote(p: Pipeline, quote: int, *, identity: str | None = None) -> None:
    with p.outbox.transaction() as tx:
        tx.emit(
            "quote.approved",
            key=f"quote-{quote}",
            payload={"quote": quote, "to": f"client-{quote}@example.com"},
            tenant="studio",
            identity=identity or f"studio:send-quote-{quote}",
        )


def on_quote_approved(store: Store) -> Callable[[ConsumedEvent, ConsumerTx], None]:
    def handle(event: ConsumedEvent, tx: ConsumerTx) -> None:
        quote = event.data["quote"]
        store.enqueue(
            event.tenant or "studio", f"send-quote-{quote}", payload=event.data, session=tx.session
        )

    return handle


def send_quote(job: JobContext) -> None:
    job.dispatch("email", "mail", {"to": job.payload["to"], "quote": job.payload["quote"]})


def wire(p: Pipeline, **fake: Any) -> FakeProvider:
    mail = p.fake_provider("mail", **fake)
    p.consumer("billing", {"quote.approved": on_quote_approved(p.store)})
    p.worker({"send-quote": send_quote}, providers={"mail": mail})
    return mail


# -- drain and what it returns -------------------------------------------------------------


def test_drain_runs_the_whole_loop_and_says_what_happened(pipeline: Pipeline) -> None:
    wire(pipeline)
    for quote in (17, 18):
        approve_quote(pipeline, quote)
    result = pipeline.drain()
    assert (result.published, result.handled, result.duplicates) == (2, 2, 0)
    assert (result.jobs_run, result.effects) == (2, 2)
    assert dict(result.outcomes) == {"done": 2}
    assert dict(result.jobs) == {"DONE": 2}
    assert dict(result.receipts) == {"ACCEPTED": 2}
    assert result.killed is None
    with pytest.raises(TypeError):
        result.jobs["DONE"] = 3  # type: ignore[index]
    again = pipeline.drain()  # nothing left: one cycle that moves nothing
    assert (again.cycles, again.published, again.jobs_run, again.effects) == (1, 0, 0, 0)
    pipeline.assert_emitted("quote.approved", 2)
    pipeline.assert_emitted("quote.approved", 1, key="quote-17", tenant="studio")
    pipeline.assert_jobs(DONE=2)
    pipeline.assert_jobs(action="send-quote-17", DONE=1)
    pipeline.assert_receipts(ACCEPTED=2)
    (effect,) = pipeline.assert_effects("send-quote-17", 1)
    assert effect.identity == "studio:send-quote-17"
    assert effect.body == {"to": "client-17@example.com", "quote": 17}
    pipeline.assert_effects("studio:send-quote-18", 1)


def test_a_duplicate_event_creates_one_job_and_one_effect(pipeline: Pipeline) -> None:
    wire(pipeline)
    approve_quote(pipeline, 17)
    approve_quote(pipeline, 17)  # the same business identity, twice
    result = pipeline.drain()
    assert (result.published, result.handled, result.duplicates) == (2, 1, 1)
    pipeline.assert_emitted("quote.approved", 2, identity="studio:send-quote-17")
    pipeline.assert_jobs(DONE=1)
    pipeline.assert_effects("send-quote-17", 1)


def test_failures_show_what_was_found_instead(pipeline: Pipeline) -> None:
    wire(pipeline)
    approve_quote(pipeline, 17)
    approve_quote(pipeline, 18)
    pipeline.drain()
    with pytest.raises(AssertionError) as emitted:
        pipeline.assert_emitted("quote.approved", 1, key="quote-19")
    text = str(emitted.value)
    assert "expected 1 event(s) topic='quote.approved' key='quote-19', found 0" in text
    assert "key=quote-17" in text and "key=quote-18" in text
    assert "{'quote.approved': 2}" in text
    with pytest.raises(AssertionError) as jobs:
        pipeline.assert_jobs(DONE=1)
    assert "expected jobs {'DONE': 1}, found {'DONE': 2}" in str(jobs.value)
    assert "studio/send-quote-18 DONE attempts=1" in str(jobs.value)
    with pytest.raises(AssertionError) as receipts:
        pipeline.assert_receipts(UNKNOWN=1)
    assert "found {'ACCEPTED': 2}" in str(receipts.value)
    assert "(studio/send-quote-17) mail ACCEPTED ref=sim_" in str(receipts.value)
    with pytest.raises(AssertionError) as effects:
        pipeline.assert_effects("send-quote-17", 2)
    text = str(effects.value)
    assert "expected 2 effect(s) for 'send-quote-17', found 1" in text
    assert "effects by identity: {'studio:send-quote-17': 1, 'studio:send-quote-18': 1}" in text


def test_a_consumer_and_a_worker_built_by_the_user_keep_their_handlers(
    pipeline: Pipeline,
) -> None:
    from consumer import Consumer

    users_consumer = Consumer(
        "sqlite:///" + os.devnull, "redis://unused:1/0", group="billing", topics=["quote.approved"]
    )
    users_consumer.add_handler("quote.approved", on_quote_approved(pipeline.store))
    mail = pipeline.fake_provider("mail")
    users_worker = Worker(providers={"mail": mail})
    users_worker.register("send-quote", send_quote)
    consumer = pipeline.consumer(users_consumer)
    assert consumer.streams == [pipeline.stream("quote.approved")]
    pipeline.worker(users_worker)
    approve_quote(pipeline, 17)
    pipeline.drain()
    pipeline.assert_effects("send-quote-17", 1)


# -- time -----------------------------------------------------------------------------------


def test_a_timer_fires_when_the_clock_passes_it(pipeline: Pipeline) -> None:
    fired: list[float] = []

    def remind(job: JobContext) -> None:
        if job.timer is None:  # first run: plan the reminder three days out
            job.schedule(time.time() + 3 * DAY, "reminder", subject_version=1)
            return
        fired.append(pipeline.clock())

    pipeline.consumer(
        "reminders",
        {
            "quote.sent": lambda e, tx: pipeline.store.enqueue(
                "studio", f"remind-{e.subject}", session=tx.session
            )
        },
    )
    pipeline.worker({"remind": remind})
    with pipeline.outbox.transaction() as tx:
        tx.emit("quote.sent", key="quote-17", payload={})
    assert dict(pipeline.drain().jobs) == {"READY": 1}  # scheduled: READY, not yet eligible
    pipeline.clock.advance(days=2)
    assert pipeline.drain().jobs_run == 0 and fired == []
    pipeline.clock.advance(days=1, minutes=1)
    result = pipeline.drain()
    assert result.jobs_run == 1 and len(fired) == 1
    pipeline.assert_jobs(DONE=1)


def test_a_backoff_ends_when_the_clock_passes_it(pipeline: Pipeline) -> None:
    mail = wire(pipeline)
    mail.fail_next("rate_limit", retry_after=120)
    approve_quote(pipeline, 17)
    first = pipeline.drain()
    assert dict(first.receipts) == {"NOT_SENT": 1} and first.effects == 0
    pipeline.assert_jobs(READY=1)
    pipeline.clock.advance(seconds=60)  # Retry-After is not over
    assert pipeline.drain().jobs_run == 0
    pipeline.clock.advance(seconds=61)
    assert pipeline.drain().effects == 1
    pipeline.assert_jobs(DONE=1)
    pipeline.assert_receipts(ACCEPTED=1)


def test_the_relays_cycle_measures_its_intervals_on_the_pipeline_clock(
    pipeline: Pipeline,
) -> None:
    """The relay's inline cycle is due by the pipeline's clock (``run_once(now=...)``): its
    check of Redis runs again once the clock passes ``redis_check_interval``, not before,
    whatever the wall clock did meanwhile."""
    checks: list[str] = []

    class Seen(Hooks):
        def relay_redis_persistence(self, mode: str) -> None:
            checks.append(mode)

    pipeline.relay.hooks = Seen()
    pipeline.drain()
    assert len(checks) == 1  # the first cycle checks
    pipeline.drain()
    assert len(checks) == 1  # not due yet by the clock
    pipeline.clock.advance(seconds=pipeline.relay.config.redis_check_interval)
    pipeline.drain()
    assert len(checks) == 2


@pytest.mark.parametrize("database", ["sqlite", "pg"])
def test_a_relay_backoff_ends_when_the_clock_passes_it(
    database: str, tmp_path: Path, pg_admin_engine: sa.Engine
) -> None:
    """The relay's rows carry the database's times: a publish that Redis refused (a real OOM
    from the pipeline's own embedded Redis, Redis 6.2) backs off for 10 minutes; once Redis
    accepts again, drain() leaves it pending until the test's clock passes the backoff, then
    publishes it, with no waiting. The refusal is a "not now": never a quarantine."""
    url = None if database == "sqlite" else pg_admin_engine.url.render_as_string(False)
    config = RelayConfig(record_backoff=Backoff(600.0, 600.0))
    with Pipeline(tmp_path, database_url=url, relay_config=config) as p:
        p.redis.config_set("maxmemory", "1")
        p.redis.config_set("maxmemory-policy", "noeviction")
        approve_quote(p, 17)
        assert p.drain().published == 0
        p.redis.config_set("maxmemory", "0")
        assert p.drain().published == 0  # the backoff is not over by the test's clock
        p.assert_emitted("quote.approved", 1)
        p.clock.advance(minutes=11)  # past the backoff's ceiling (its jitter is seeded)
        assert p.drain().published == 1
        assert len(p.redis.xrange(p.stream("quote.approved"))) == 1


def _retry_delays(directory: Path, seed: int | None) -> list[float]:
    """A user's test whose jobs fail once, transiently: the backoff each one got."""
    with Pipeline(directory, seed=seed) as p:
        failed: set[str] = set()

        def flaky(job: JobContext) -> None:
            if job.action not in failed:
                failed.add(job.action)
                raise TransientFailure("the first attempt fails")

        p.worker({"flaky": flaky})
        for n in range(5):
            p.store.enqueue("studio", f"flaky-{n}")
        p.drain()
        p.clock.advance(minutes=10)  # past every backoff (base 1 s, first retry)
        p.drain()
        p.assert_jobs(DONE=5)
        delays = []
        for row in p.job_rows():
            [retry] = [a for a in p.store.history(row.id) if a.outcome == "retry"]
            delays.append(round(float(row.run_after) - retry.at, 6))
        return delays


def test_the_same_seed_gives_the_same_backoffs(tmp_path: Path) -> None:
    """Deterministic: the retry jitter comes from the pipeline's seeded random, so the same
    test gets the same delays run after run (seed 0 by default), another seed others."""
    first = _retry_delays(tmp_path / "a", seed=7)
    assert first == _retry_delays(tmp_path / "b", seed=7)
    assert first != _retry_delays(tmp_path / "c", seed=8)
    assert _retry_delays(tmp_path / "d", seed=0) == _retry_delays(tmp_path / "e", seed=0)
    with Pipeline(tmp_path / "f") as p:
        assert p.seed == 0 and p.store.rng is p.random
        assert p.relay._batches.rng is p.random  # the relay's backoff jitter too


def test_a_failed_consumer_entry_is_retried_after_claim_idle_by_the_clock(
    pipeline: Pipeline,
) -> None:
    calls: list[str] = []

    def flaky(event: ConsumedEvent, tx: ConsumerTx) -> None:
        calls.append(event.id)
        if len(calls) == 1:
            raise RuntimeError("the pricing service is down")
        pipeline.store.enqueue("studio", f"send-quote-{event.data['quote']}", session=tx.session)

    pipeline.consumer("billing", {"quote.approved": flaky})
    approve_quote(pipeline, 17)
    first = pipeline.drain()
    assert first.handled == 0 and len(calls) == 1
    pipeline.clock.advance(seconds=31)  # ConsumerConfig.claim_idle_ms: 30 s
    second = pipeline.drain()
    assert second.handled == 1 and len(calls) == 2
    pipeline.assert_jobs(READY=1)


# -- the fake provider ----------------------------------------------------------------------


def test_one_effect_when_the_provider_accepts_then_times_out(pipeline: Pipeline) -> None:
    mail = wire(pipeline)
    mail.fail_next("hang")  # acts, never answers: the worker's call times out
    approve_quote(pipeline, 17)
    before = pipeline.clock()
    result = pipeline.drain()
    # The timeout took the provider's 5 s of test time, no real waiting; the sweep found
    # the effect by lookup once the call's deadline had passed.
    assert pipeline.clock() - before >= mail.timeout
    assert result.effects == 1 and result.reconciled == 1
    pipeline.clock.advance(minutes=5)  # the job's backoff after the timeout
    pipeline.drain()
    pipeline.assert_effects("send-quote-17", 1)
    pipeline.assert_reconciled("send-quote-17")
    pipeline.assert_jobs(DONE=1)


@pytest.mark.parametrize(
    ("rule", "first", "final", "effects"),
    [
        # The provider acted and the client cannot know: UNKNOWN until the deadline passes.
        ({"kind": "error_after"}, {"UNKNOWN"}, "ACCEPTED", 1),
        ({"kind": "reset"}, {"UNKNOWN"}, "ACCEPTED", 1),
        # Acted, answered after the timeout (5 s of test time): found by lookup at once.
        ({"kind": "late", "delay": 10}, {"ACCEPTED"}, "ACCEPTED", 1),
        # Did not act: NOT_SENT, and the retry (after a jittered backoff) sends once.
        ({"kind": "unauthorized"}, {"NOT_SENT", "ACCEPTED"}, "ACCEPTED", 1),
        ({"kind": "slow", "delay": 9}, {"NOT_SENT", "ACCEPTED"}, "ACCEPTED", 1),
        # Refused for good: FAILED, the job waits for an operator, nothing was sent.
        ({"kind": "bad_request"}, {"FAILED"}, "FAILED", 0),
    ],
)
def test_scripted_faults_leave_the_receipts_the_simulator_would(
    tmp_path: Path, rule: dict[str, Any], first: set[str], final: str, effects: int
) -> None:
    with Pipeline(tmp_path) as p:
        mail = wire(p)
        mail.set_faults([{**rule, "count": 1}])
        approve_quote(p, 17)
        result = p.drain()
        (state,) = result.receipts
        assert state in first, str(result)
        p.clock.advance(minutes=10)  # every deadline and backoff is over
        p.drain()
        p.assert_receipts(**{final: 1})
        p.assert_effects("send-quote-17", effects)
        p.assert_jobs(**{"WAITING_REVIEW" if final == "FAILED" else "DONE": 1})


def test_a_slow_answer_spends_test_time_not_real_time(tmp_path: Path) -> None:
    with Pipeline(tmp_path) as p:
        mail = wire(p, timeout=60.0)
        mail.fail_next("slow", delay=45)
        approve_quote(p, 17)
        started, before = time.monotonic(), p.clock()
        p.drain()
        assert p.clock() - before >= 45
        assert time.monotonic() - started < 30
        p.assert_receipts(ACCEPTED=1)


def test_without_lookup_or_idempotency_an_unknown_outcome_goes_to_review(
    pipeline: Pipeline,
) -> None:
    mail = wire(pipeline, lookup=False, idempotency=False)
    assert not mail.supports_lookup and not mail.supports_idempotency
    mail.fail_next("hang")
    approve_quote(pipeline, 17)
    pipeline.drain()
    pipeline.clock.advance(minutes=10)
    pipeline.drain()
    pipeline.assert_jobs(WAITING_REVIEW=1)
    pipeline.assert_receipts(UNKNOWN=1)
    pipeline.assert_effects("send-quote-17", 1)  # it did happen: an operator settles it


def test_the_fake_and_the_simulator_service_agree(tmp_path: Path) -> None:
    """The same fault plan through the HTTP service (HttpProvider on a socket) and through
    the fake (in-process): the same results, the same effects, the same stats."""
    server = serve("127.0.0.1", 0, str(tmp_path / "sim.db"), SimulatorConfig())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        host, port = server.server_address[:2]
        base = f"http://{host}:{port}"
        http = HttpProvider(
            "mail", f"{base}/send", lookup_url=f"{base}/lookup/{{operation_id}}", timeout=0.5
        )
        fake = FakeProvider("mail", timeout=0.5)
        plan = [
            {"kind": "error_after", "count": 1},
            {"kind": "rate_limit", "count": 1, "retry_after": 3},
            {"kind": "unauthorized", "count": 1},
            {"kind": "bad_request", "count": 1},
            {"kind": "error_before", "count": 1, "status": 502},
            {"kind": "hang", "count": 1, "delay": 2},
        ]
        server.simulator.set_faults({"faults": plan})
        fake.set_faults(plan)
        outcomes: dict[str, list[str]] = {"http": [], "fake": []}
        for label, provider in (("http", http), ("fake", fake)):
            for n in range(8):
                key = f"op-{n % 3}"
                try:
                    provider.send({"n": n % 3}, operation_id=key, idempotency_key=key)
                    outcomes[label].append("ok")
                except Exception as exc:
                    status = getattr(exc, "status", None)
                    retry = getattr(exc, "retry_after", None)
                    outcomes[label].append(f"{type(exc).__name__}:{status}:{retry}")
            outcomes[label].append(f"lookup={provider.lookup('op-1') is not None}")
        assert outcomes["http"] == outcomes["fake"], outcomes
        assert "ProviderTimeout:None:None" in outcomes["fake"]
        sim_stats, fake_stats = server.simulator.stats(), fake.stats
        assert sim_stats == fake_stats
        assert len(server.simulator.effects.list()) == len(fake.effects) == 3
        http.close()
        fake.close()
    finally:
        server.simulator.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_simulation_core_is_the_one_both_use() -> None:
    import consumer.jobs.simulator as service

    assert service.Simulator is Simulator
    assert isinstance(FakeProvider().simulator, Simulator)


# -- kill points ----------------------------------------------------------------------------


def test_acceptance_kill_the_worker_after_the_provider_accepted(pipeline: Pipeline) -> None:
    """The seed's acceptance test with the helpers: one effect, a reconciled receipt."""
    p = pipeline
    wire(p)
    approve_quote(p, 17)
    p.kill_at("after_accepted")
    assert p.drain().killed == "after_accepted"
    p.restart()  # another worker; the dead one's lease expires by the clock
    p.clock.advance(minutes=1)
    p.drain()
    p.assert_effects("send-quote-17", 1)
    p.assert_reconciled("send-quote-17")
    p.assert_jobs(DONE=1)


@pytest.mark.parametrize(
    ("point", "effects_at_kill", "receipt_at_kill"),
    [("after_claim", 0, {}), ("after_intent", 0, {"PENDING": 1}), ("after_accepted", 1, {})],
)
def test_each_kill_point_ends_in_exactly_one_effect(
    pipeline: Pipeline, point: str, effects_at_kill: int, receipt_at_kill: dict[str, int]
) -> None:
    wire(pipeline)
    approve_quote(pipeline, 17)
    pipeline.kill_at(point)
    killed = pipeline.drain()
    assert killed.killed == point
    assert killed.effects == effects_at_kill
    assert dict(killed.jobs) == {"LEASED": 1}
    if point != "after_accepted":
        assert dict(killed.receipts) == receipt_at_kill
    else:
        assert dict(killed.receipts) == {"PENDING": 1}  # the receipt was never written
    with pytest.raises(ConfigError):
        pipeline.drain()  # a killed pipeline must be restarted first
    pipeline.restart()
    assert pipeline.drain().jobs_run == 0  # the dead worker's lease still holds
    pipeline.clock.advance(minutes=1)
    pipeline.drain()
    pipeline.assert_effects("send-quote-17", 1)
    pipeline.assert_jobs(DONE=1)
    pipeline.assert_receipts(ACCEPTED=1)


def test_a_kill_runs_nothing_after_its_point(tmp_path: Path) -> None:
    with Pipeline(tmp_path) as p:
        wire(p)
        approve_quote(p, 17)
        p.kill_at("after_intent")
        p.drain()
        p.assert_effects("send-quote-17", 0)  # the provider was never called
        assert issubclass(Killed, BaseException) and not issubclass(Killed, Exception)
        with pytest.raises(ConfigError) as err:
            p.kill_at("before_lunch")
        assert err.value.setting == "point"


def test_drain_stops_a_loop_that_never_settles(tmp_path: Path) -> None:
    with Pipeline(tmp_path) as p:

        def forever(job: JobContext) -> None:
            job.defer(0.0, "again")  # READY again at once, for ever

        p.worker({"forever": forever})
        p.store.enqueue("studio", "forever")
        with pytest.raises(DrainError) as err:
            p.drain(max_cycles=5)
        assert "still moving after 5 cycles" in str(err.value)
        assert "jobs_run" in str(err.value)


# -- isolation ------------------------------------------------------------------------------


def test_pipelines_on_one_database_and_redis_do_not_see_each_other(
    pg_admin_engine: sa.Engine, redis_url: str
) -> None:
    base = pg_admin_engine.url.render_as_string(hide_password=False)
    first = Pipeline(database_url=base, redis_url=redis_url)
    second = Pipeline(database_url=base, redis_url=redis_url)
    try:
        assert first.database_url != second.database_url and first.prefix != second.prefix
        wire(first)
        wire(second)
        approve_quote(first, 17)
        approve_quote(second, 18)
        approve_quote(second, 19)
        assert first.drain().published == 1
        assert second.drain().published == 2
        first.assert_jobs(DONE=1)
        second.assert_jobs(DONE=2)
        schema = f"outbox_test_{first.token}"
        prefix = first.prefix
    finally:
        first.close()
        second.close()
    with pg_admin_engine.connect() as conn:
        left = conn.execute(
            sa.text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": schema}
        ).scalar()
    assert left == 0
    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match=f"*{prefix}*")) == []
    finally:
        client.close()


def test_the_embedded_pipeline_lives_in_the_tests_directory(tmp_path: Path) -> None:
    with Pipeline(tmp_path) as p:
        assert p.database_url.endswith(str(tmp_path / "outbox.db"))
        assert p.stream("quote.approved") == "outbox.quote.approved"  # production's names
    with pytest.raises(ConfigError):
        Pipeline()


# -- the plugin -----------------------------------------------------------------------------

USER_TEST = textwrap.dedent(
    """
    def test_uses_the_fixture(outbox_pipeline, outbox_clock):
        assert outbox_pipeline.clock is outbox_clock
        with outbox_pipeline.outbox.transaction() as tx:
            tx.emit("quote.approved", key="quote-1", payload={})
        assert outbox_pipeline.drain().published == 1
    """
)


def _run_pytest(directory: Path) -> subprocess.CompletedProcess[str]:
    (directory / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(directory)],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_the_plugin_is_registered_only_where_a_conftest_enables_it(tmp_path: Path) -> None:
    without = tmp_path / "without"
    without.mkdir()
    (without / "test_user.py").write_text(USER_TEST)
    result = _run_pytest(without)
    assert result.returncode != 0
    assert "fixture 'outbox_pipeline' not found" in result.stdout
    enabled = tmp_path / "enabled"
    enabled.mkdir()
    (enabled / "conftest.py").write_text('pytest_plugins = ["outbox.testing"]\n')
    (enabled / "test_user.py").write_text(USER_TEST)
    result = _run_pytest(enabled)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


@pytest.mark.slow
def test_the_plugin_options_put_the_pipeline_on_your_servers(
    tmp_path: Path, pg_admin_engine: sa.Engine, redis_url: str
) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["outbox.testing"]\n')
    (tmp_path / "test_user.py").write_text(
        USER_TEST
        + textwrap.dedent(
            """
            def test_on_postgresql(outbox_pipeline):
                assert outbox_pipeline.engine.dialect.name == "postgresql"
                assert "search_path%3Doutbox_test_" in outbox_pipeline.database_url
                assert outbox_pipeline.prefix.startswith("outbox-test-")
            """
        )
    )
    base = pg_admin_engine.url.render_as_string(hide_password=False)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path),
            "--outbox-database-url",
            base,
            "--outbox-redis-url",
            redis_url,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_the_fake_provider_checks_its_settings() -> None:
    with pytest.raises(ConfigError) as err:
        FakeProvider(lookup="yes")  # type: ignore[arg-type]
    assert err.value.setting == "lookup"
    fake = FakeProvider()
    with pytest.raises(ConfigError):
        fake.fail_next("sneeze")
    fake.close()


def test_a_parked_job_waits_for_an_operator_not_for_its_old_run_after(db_url: str) -> None:
    """Found by the helpers: the sweep parked a READY job whose run_after (a backoff) then
    read as a due timer; recovery woke it, the sweep parked it again, for ever."""
    store = Store(db_url)
    try:
        now = time.time()
        store.enqueue("studio", "send-quote-17", run_after=now + 10)
        store.park("studio", "send-quote-17", reason="settle it")
        assert store.recover(now=now + 60).woken == 0
        job = store.get("studio", "send-quote-17")
        assert job.state == "WAITING_REVIEW" and job.run_after is None
    finally:
        store.dispose()


def test_the_docs_page_shows_the_example_files_as_they_are() -> None:
    """docs/testing.md walks through examples/testing/, which CI runs: the page's module
    blocks must be those files, byte for byte, so neither can drift from the other."""
    from tests.docs_runner import python_blocks

    shown = {
        block.title: block.source
        for block in python_blocks(ROOT / "docs" / "testing.md")
        if block.title is not None
    }
    examples = ROOT / "examples" / "testing"
    files = {path.name: path.read_text() for path in examples.glob("*.py")}
    assert set(shown) == set(files)
    for name, source in files.items():
        assert shown[name] == source, f"docs/testing.md shows another {name}"
    assert (examples / "test_worker_killed_after_accepted.py").read_text().count("\n") < 30


def test_drain_starts_no_thread_and_close_leaves_none(tmp_path: Path) -> None:
    """No thread renews leases, vacuums or sweeps behind the test's back: the threads after a
    drain (a kill and a restart included) are the ones before it."""
    before = set(threading.enumerate())
    with Pipeline(tmp_path) as p:
        wire(p)
        approve_quote(p, 17)
        p.kill_at("after_accepted")
        p.drain()
        p.restart()
        p.clock.advance(minutes=1)
        p.drain()
        p.assert_effects("send-quote-17", 1)
        started = [t.name for t in set(threading.enumerate()) - before]
        assert started == []
    assert [t.name for t in set(threading.enumerate()) - before] == []
