"""One CLI idiom (issue 26): every command is built from ``outbox.cli``, so a boolean, a
``MODULE:ATTRIBUTE``, Ctrl-C and an unreachable service mean the same everywhere."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import consumer.cli
import consumer.jobs.cli
import consumer.jobs.simulator
import metrics.cli
import outbox.console.cli
import outbox.console.trace
import relay.cli
from consumer import Consumer, Worker
from outbox.cli import (
    Exit,
    Flag,
    Parser,
    UsageError,
    add_flags,
    installed_programs,
    parse_bool,
    reference_markdown,
    run_main,
)
from outbox.errors import ConfigError
from tests.services import wait_for

# Every test here starts processes of its own: the slow tier (the fast one stays under 2
# minutes on a 2-core machine).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
UNREACHABLE_PG = "postgresql://nobody@127.0.0.1:1/none"


@pytest.fixture(autouse=True)
def no_outbox_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


# -- the helper itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("word", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_true_words(word: str) -> None:
    assert parse_bool(word) is True


@pytest.mark.parametrize("word", ["0", "false", "False", "NO", "off"])
def test_false_words(word: str) -> None:
    assert parse_bool(word) is False


def test_anything_else_is_not_a_boolean_and_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_X") as caught:
        parse_bool("maybe", "OUTBOX_X")
    assert caught.value.setting == "OUTBOX_X"


def _tiny_parser() -> Parser:
    parser = Parser(prog="tiny")
    add_flags(
        parser,
        Flag("--batch-size", int, "rows", default=5),
        Flag("--no-listen", bool, "poll only"),
        Flag("--lookup-off", bool, "x", env="OUTBOX_LOOKUP", env_negates=True),
    )
    parser.set_defaults(func=lambda args: 0)
    return parser


def test_the_flag_wins_over_its_variable_which_wins_over_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _tiny_parser().parse([]).batch_size == 5
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "7")
    assert _tiny_parser().parse([]).batch_size == 7
    assert _tiny_parser().parse(["--batch-size", "9"]).batch_size == 9
    monkeypatch.setenv("OUTBOX_NO_LISTEN", "Yes")
    assert _tiny_parser().parse([]).no_listen is True
    monkeypatch.setenv("OUTBOX_LOOKUP", "0")
    assert _tiny_parser().parse([]).lookup_off is True
    monkeypatch.setenv("OUTBOX_LOOKUP", "on")
    assert _tiny_parser().parse([]).lookup_off is False


def test_the_help_shows_the_variable_and_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main("tiny", _tiny_parser(), ["--help"]) == Exit.OK
    out = " ".join(capsys.readouterr().out.split())
    assert "rows (env OUTBOX_BATCH_SIZE; default 5)" in out
    assert "poll only (env OUTBOX_NO_LISTEN=true)" in out


def test_a_bad_variable_is_bad_usage_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "many")
    assert run_main("tiny", _tiny_parser(), []) == Exit.USAGE
    err = capsys.readouterr().err
    assert "OUTBOX_BATCH_SIZE" in err and "not an integer" in err


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (None, Exit.OK),
        (KeyboardInterrupt(), Exit.INTERRUPTED),
        (ConfigError("x", "bad"), Exit.USAGE),
        (UsageError("bad"), Exit.USAGE),
        (RuntimeError("boom"), Exit.FAILURE),
        (LookupError("no such record"), Exit.FAILURE),
    ],
)
def test_the_exit_code_map(
    raised: BaseException | None, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    def command(args: argparse.Namespace) -> int:
        if raised is not None:
            raise raised
        return 0

    assert run_main("tiny", _tiny_parser(), [], command=command) == code
    assert "Traceback" not in capsys.readouterr().err


# -- the three disagreements of issue 26 -----------------------------------------------------


@pytest.mark.parametrize("word", ["true", "1", "yes", "ON"])
def test_outbox_no_listen_true_is_accepted_by_the_relay_and_the_worker(
    word: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_NO_LISTEN", word)
    args = relay.cli.build_parser().parse(["run"])
    assert relay.cli.relay_config(args).listen is False

    ran: list[Any] = []
    monkeypatch.setattr(Worker, "run", lambda self, *a, **k: ran.append(self.config))
    assert (
        consumer.jobs.cli.main(["run", "tests.jobs_support:build", "--database-url", "sqlite://"])
        == 0
    )
    assert ran[0].listen is False


def test_a_bad_boolean_variable_is_bad_usage_in_every_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, main, variable in (
        (["run"], relay.cli.main, "OUTBOX_NO_LISTEN"),
        (["run"], relay.cli.main, "OUTBOX_REDIS_CLUSTER"),
        (["run", "tests.jobs_support:build"], consumer.jobs.cli.main, "OUTBOX_NO_LISTEN"),
        (["run", "consumer_app:build"], consumer.cli.main, "OUTBOX_REDIS_CLUSTER"),
        (["serve"], consumer.jobs.simulator.main, "OUTBOX_SIMULATOR_LOOKUP"),
        (["serve"], outbox.console.cli.main, "OUTBOX_CONSOLE_READ_ONLY"),
        (["trace", "q"], outbox.console.cli.main, "OUTBOX_REDIS_CLUSTER"),
    ):
        monkeypatch.setenv(variable, "maybe")
        assert main(argv) == Exit.USAGE, argv
        monkeypatch.delenv(variable)
        assert variable in capsys.readouterr().err


def test_ctrl_c_exits_130_in_every_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONSUMER_APP_STREAM", "cli.ctrl-c")
    monkeypatch.setattr(relay.cli, "status", interrupted)
    monkeypatch.setattr(Consumer, "run", interrupted)
    monkeypatch.setattr(Worker, "run", interrupted)
    monkeypatch.setattr(consumer.jobs.simulator.SimulatorServer, "serve_forever", interrupted)
    monkeypatch.setattr(metrics.cli, "serve_forever", interrupted)
    monkeypatch.setattr(outbox.console.trace, "collect", interrupted)
    sqlite = f"sqlite:///{tmp_path}/c.db"
    assert relay.cli.main(["init-db", "--database-url", sqlite]) == 0
    assert relay.cli.main(["status", "--database-url", sqlite]) == 130
    assert consumer.cli.main(["run", "consumer_app:build", "--database-url", sqlite]) == 130
    assert (
        consumer.jobs.cli.main(["run", "tests.jobs_support:build", "--database-url", sqlite]) == 130
    )
    assert consumer.jobs.simulator.main(["serve", "--port", "0", "--data", "s.db"]) == 130
    assert metrics.cli.main(["--database-url", sqlite, "--port", "0"]) == 130
    trace = ["trace", "q", "--database-url", sqlite, "--redis-url", redis_url]
    assert outbox.console.cli.main(trace) == 130


def _command(name: str) -> list[str]:
    """The installed console script, run as a user runs it: ``-P`` keeps Python from putting
    the working directory on sys.path itself, so the command has to."""
    module = {
        "outbox-relay": "relay.cli",
        "outbox-consumer": "consumer.cli",
        "outbox-worker": "consumer.jobs.cli",
    }[name]
    return [sys.executable, "-P", "-c", f"import sys; from {module} import main; sys.exit(main())"]


def _run(name: str, *args: str, cwd: Path, **kw: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.pop("PYTHONPATH", None)
    return subprocess.Popen(
        [*_command(name), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _run_app(name: str, args: list[str], cwd: Path, **env: str) -> subprocess.Popen[str]:
    """``name`` run on the apps of ``RUN_APPS`` in ``cwd``: info logs, stdout and stderr as
    one text, ``env`` added to an environment without ``OUTBOX_*`` variables."""
    return subprocess.Popen(
        [*_command(name), *args],
        cwd=cwd,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
            "OUTBOX_LOG_LEVEL": "info",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


APP = textwrap.dedent(
    """
    import pathlib, signal

    def build():
        pathlib.Path("built").write_text("yes")
        signal.pause()  # until the test's Ctrl-C
    """
)


@pytest.mark.parametrize("name", ["outbox-consumer", "outbox-worker"])
def test_the_working_directory_is_on_sys_path_and_ctrl_c_exits_130(
    name: str, tmp_path: Path
) -> None:
    """``outbox-consumer run cons:build`` imports ./cons.py, as the worker always did; a
    Ctrl-C while the application builds exits 130 without a traceback."""
    (tmp_path / "cons.py").write_text(APP)
    proc = _run(
        name, "run", "cons:build", "--database-url", f"sqlite:///{tmp_path}/x.db", cwd=tmp_path
    )
    try:
        wait_for(
            lambda: (tmp_path / "built").exists() or proc.poll() is not None,
            "the factory of ./cons.py called",
            timeout=30,
        )
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err


RUN_APPS = textwrap.dedent(
    """
    import os
    from consumer import Consumer, Store, Worker

    def consumer():
        app = Consumer(group="app", streams=[os.environ["APP_STREAM"]])
        app.add_handler("quote.approved", lambda event, tx: None)
        return app

    def consumer_without_handlers():
        return Consumer(group="app", streams=[os.environ["APP_STREAM"]])

    def worker():
        return Worker(Store(os.environ["APP_DB"]))
    """
)


@pytest.mark.slow  # three processes started and stopped (3-8 s)
@pytest.mark.parametrize(
    ("name", "target", "started"),
    [
        ("outbox-relay", None, "relay started"),
        ("outbox-consumer", "apps:consumer", "consumer started"),
        ("outbox-worker", "apps:worker", "worker started"),
    ],
)
def test_ctrl_c_on_a_running_loop_drains_then_exits_130(
    name: str,
    target: str | None,
    started: str,
    tmp_path: Path,
    redis_url: str,
    stream_prefix: str,
) -> None:
    """A real SIGINT, once the loop runs: the first asks for a graceful stop (the batch in
    hand finishes), and the command then exits 130, as a program interrupted by Ctrl-C
    does (issue 26's exit-code map); SIGTERM stays 0."""
    (tmp_path / "apps.py").write_text(RUN_APPS)
    db = f"sqlite:///{tmp_path}/x.db"
    args = ["run", "--database-url", db]
    if name != "outbox-worker":
        args += ["--redis-url", redis_url]
    if target is None:
        args += ["--stream", f"{stream_prefix}.{{topic}}"]
    else:
        args.insert(1, target)
    proc = _run_app(name, args, tmp_path, APP_STREAM=f"{stream_prefix}.quote", APP_DB=db)
    lines: list[str] = []

    def has_started() -> bool:
        assert proc.stdout is not None
        while proc.poll() is None:
            line = proc.stdout.readline()
            lines.append(line)
            if started in line:
                return True
        return False

    try:
        assert has_started(), "".join(lines) + (proc.stdout.read() if proc.stdout else "")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + out
    assert proc.returncode == 130, text
    assert "stopped" in text and "Traceback" not in text, text


def test_a_consumer_without_handlers_is_refused_before_it_starts(
    tmp_path: Path, redis_url: str, stream_prefix: str
) -> None:
    """No handler registered is a mistake in the application: exit 2 with the typed error,
    before "consumer started" (each batch failed with it and was retried for ever)."""
    (tmp_path / "apps.py").write_text(RUN_APPS)
    db = f"sqlite:///{tmp_path}/x.db"
    args = ["run", "apps:consumer_without_handlers", "--database-url", db, "--redis-url", redis_url]
    proc = _run_app("outbox-consumer", args, tmp_path, APP_STREAM=f"{stream_prefix}.quote")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "register at least one handler" in out, out
    assert "consumer started" not in out and "Traceback" not in out, out


@pytest.mark.parametrize("name", ["outbox-consumer", "outbox-worker"])
def test_a_module_with_a_syntax_error_is_one_line_of_bad_usage(name: str, tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def build(:\n    pass\n")
    proc = _run(name, "run", "broken:build", cwd=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert "cannot import 'broken'" in err and "broken.py:1" in err


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (relay.cli.main, ["status"]),
        (relay.cli.main, ["init-db"]),
        (consumer.cli.main, ["init-db"]),
        (consumer.cli.main, ["dead-letters"]),
        (consumer.jobs.cli.main, ["init-db"]),
        (consumer.jobs.cli.main, ["receipts"]),
        (outbox.console.cli.main, ["init-db"]),
    ],
)
def test_an_unreachable_database_is_one_line_naming_it(
    main: Callable[[list[str]], int],
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*argv, "--database-url", UNREACHABLE_PG]) == Exit.FAILURE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("{")]
    assert len(lines) == 1, err
    assert "cannot use the database at postgresql://nobody@127.0.0.1:1/none" in lines[0]


# -- the reference page ------------------------------------------------------------------------


def test_every_command_is_built_with_the_helper() -> None:
    programs = dict(installed_programs())
    assert set(programs) >= {
        "outbox-relay",
        "outbox-consumer",
        "outbox-worker",
        "outbox-simulator",
        "outbox-console",
    }
    for prog, parser in programs.items():
        assert isinstance(parser, Parser), prog


def every_parser() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command and subcommand of the installed programs, with its name
    (``outbox-relay run``)."""
    stack = list(installed_programs())
    while stack:
        name, parser = stack.pop()
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend((f"{name} {sub}", p) for sub, p in action.choices.items())


def test_every_option_of_every_command_is_one_flag_declaration() -> None:
    """Every ``--option`` of every command and subcommand comes from a :class:`Flag` (its
    argparse default is the declaration, resolved from the environment after parsing):
    none is added by hand beside the helper, where it would read no variable and say
    nothing of one in the generated reference."""
    by_hand = [
        f"{name} {action.option_strings[0]}"
        for name, parser in every_parser()
        for action in parser._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction | argparse._VersionAction)
        and type(action.default).__name__ != "_Pending"
    ]
    assert by_hand == []


def test_every_subcommand_help_says_what_it_does() -> None:
    """``outbox-relay run --help`` opens with the line the command list shows (the
    subcommands' own help had only their options)."""
    programs = {prog for prog, _ in installed_programs()}
    for name, parser in every_parser():
        if name not in programs:
            assert parser.description, f"{name} --help has no description"


@pytest.mark.parametrize(
    ("main", "argv", "says"),
    [
        (relay.cli.main, ["run", "--metrics-host", "0.0.0.0", "--once"], "needs --metrics-port"),
        (
            consumer.jobs.cli.main,
            ["run", "apps:worker", "--metrics-host", "0.0.0.0"],
            "needs --metrics-port",
        ),
        (relay.cli.main, ["run", "--wait-timeout", "3", "--once"], "only with --wait-replicas"),
    ],
    ids=["relay metrics host", "worker metrics host", "relay wait timeout"],
)
def test_a_flag_that_needs_another_is_refused_without_it(
    main: Callable[[list[str]], int],
    argv: list[str],
    says: str,
    own_syspath: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--metrics-host`` without ``--metrics-port`` (no metrics server would run) and
    ``--wait-timeout`` without ``--wait-replicas`` (nothing waits) exit 2, never ignored."""
    assert main(argv) == Exit.USAGE
    assert says in capsys.readouterr().err
    assert list(own_syspath.iterdir()) == []


def test_maxlen_beside_stream_retention_is_refused(
    own_syspath: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--maxlen`` trims instead of ``--stream-retention``: given both, one would be
    ignored, so the relay refuses to start (exit 2) and says which to drop."""
    argv = ["run", "--maxlen", "100", "--stream-retention", "50", "--once"]
    assert relay.cli.main(argv) == Exit.USAGE
    assert "give one of them" in capsys.readouterr().err
    assert list(own_syspath.iterdir()) == []  # refused before anything was opened


def test_the_cli_reference_page_is_current() -> None:
    page = ROOT / "docs" / "reference" / "cli.md"
    generated = reference_markdown(installed_programs())
    assert page.read_text() == generated, (
        "docs/reference/cli.md is stale: python -m outbox.cli --markdown > docs/reference/cli.md"
    )
    for needle in (
        "OUTBOX_DATABASE_URL",
        "OUTBOX_NO_LISTEN",
        "outbox-worker run",
        "--redis-cluster",
    ):
        assert needle in generated


def test_the_reference_page_is_printed_by_the_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == reference_markdown(installed_programs())


# -- newcomer fixes (issue 26) -------------------------------------------------------------------


@pytest.fixture
def own_syspath(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The test runs in ``tmp_path``; sys.path is restored after (the loader adds the cwd)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_database_url_the_worker_cannot_use_is_refused(
    own_syspath: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``outbox-worker run mod:worker --database-url X`` when the module built its own store:
    exit 2 naming the flag, never a run on the module's database with X ignored."""
    own = f"sqlite:///{own_syspath}/own.db"
    (own_syspath / "own_store_app.py").write_text(
        f"from consumer import Store, Worker\ndef build():\n    return Worker(Store({own!r}))\n"
    )
    ran: list[str] = []
    monkeypatch.setattr(Worker, "run", lambda self, *a, **k: ran.append(str(self.store.engine.url)))
    assert (
        consumer.jobs.cli.main(["run", "own_store_app:build", "--database-url", "not-a-url"]) == 2
    )
    err = capsys.readouterr().err
    assert "--database-url cannot apply" in err and "built its own Store" in err
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{own_syspath}/other.db")
    assert consumer.jobs.cli.main(["run", "own_store_app:build"]) == 2
    assert "OUTBOX_DATABASE_URL cannot apply" in capsys.readouterr().err
    # The same database is no conflict; no URL at all neither.
    monkeypatch.setenv("OUTBOX_DATABASE_URL", own)
    assert consumer.jobs.cli.main(["run", "own_store_app:build"]) == 0
    monkeypatch.delenv("OUTBOX_DATABASE_URL")
    assert consumer.jobs.cli.main(["run", "own_store_app:build"]) == 0
    assert ran == [own, own]
    assert ran


def test_status_without_a_database_does_not_create_one(
    own_syspath: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["status"], ["status", "--json"], ["requeue", "--all"]):
        assert relay.cli.main(argv) == Exit.FAILURE
        err = capsys.readouterr().err
        assert err.startswith(f"outbox-relay: no database at {own_syspath}/outbox.db: give")
        assert len(err.strip().splitlines()) == 1
    missing = own_syspath / "nowhere.db"
    assert relay.cli.main(["status", "--database-url", f"sqlite:///{missing}"]) == Exit.FAILURE
    assert list(own_syspath.iterdir()) == []  # no empty outbox.db left behind


@pytest.mark.parametrize(
    ("main", "prog", "argv"),
    [
        (consumer.jobs.cli.main, "outbox-worker", ["receipts"]),
        (consumer.jobs.cli.main, "outbox-worker", ["queues", "list"]),
        (
            consumer.jobs.cli.main,
            "outbox-worker",
            ["settle", "1:email", "--not-sent", "--reason", "x"],
        ),
        (consumer.cli.main, "outbox-consumer", ["dead-letters"]),
    ],
    ids=["worker receipts", "worker queues list", "worker settle", "consumer dead-letters"],
)
def test_a_command_that_reads_never_creates_the_default_database(
    main: Callable[[list[str]], int],
    prog: str,
    argv: list[str],
    own_syspath: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every command that only reads or repairs refuses a SQLite file that is not there, as
    ``status`` does; before, these created an empty ``outbox.db`` and answered "none"."""
    assert main(argv) == Exit.FAILURE
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: no database at {own_syspath}/outbox.db: give"), err
    assert list(own_syspath.iterdir()) == []
    assert main(["init-db"]) == Exit.OK  # the command that creates it still does
    assert (own_syspath / "outbox.db").exists()


@pytest.mark.parametrize(
    "flags",
    [["--redis-url", "redis://127.0.0.1:1/0"], ["--database-url", UNREACHABLE_PG]],
    ids=["redis down", "database down"],
)
def test_the_demo_with_a_service_down_is_one_line(
    flags: list[str], own_syspath: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert relay.cli.main(["demo", "--duration", "1", *flags]) == Exit.FAILURE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    service = "Redis at redis://127.0.0.1:1/0" if "--redis-url" in flags else "the database"
    assert err.startswith(f"outbox-relay: cannot use {service}")


def test_a_redis_database_index_out_of_range_is_bad_usage(redis_url: str, tmp_path: Path) -> None:
    """``redis://.../99`` on a server with 16 databases: exit 2 at once, not retried forever."""
    server = redis_url.rsplit("/", 1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    result = subprocess.run(
        [sys.executable, "-m", "relay", "run", "--redis-url", f"{server}/99"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT), "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "database 99: DB index is out of range" in result.stderr
    assert "Traceback" not in result.stderr


class _Clock:
    """relay.relay's ``time`` with a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        import time

        return getattr(time, name)


def test_an_idle_relay_with_redis_down_backs_off_its_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """57 lines of "cannot check Redis now" in 15 s before (one a cycle); now the check waits
    0.5 s, 1 s, 2 s ... up to 30 s after each failure."""
    import redis

    import relay.relay
    from outbox import Outbox
    from relay.config import RelayConfig
    from relay.redis.publisher import RedisStreamPublisher

    clock = _Clock()
    monkeypatch.setattr(relay.relay, "time", clock)
    box = Outbox(f"sqlite:///{tmp_path}/idle.db")
    box.create_schema()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    down = redis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    idle = relay.relay.Relay(box, RedisStreamPublisher(down, "outbox.{topic}"), RelayConfig())
    caplog.set_level("WARNING", logger="outbox")

    def checks() -> list[float]:
        return [
            r.fields["retry_in_seconds"]  # type: ignore[attr-defined]
            for r in caplog.records
            if r.getMessage() == "cannot check Redis now"
        ]

    for _ in range(60):  # 15 s of 0.25 s cycles
        idle.run_once()
        clock.now += 0.25
    assert checks() == [0.5, 1.0, 2.0, 4.0, 8.0]
    for _ in range(60):  # 5 more minutes, a cycle every 5 s: capped at 30 s
        idle.run_once()
        clock.now += 5.0
    assert max(checks()) == 30.0 and len(checks()) < 20
    idle.store.close()
    box.engine.dispose()
