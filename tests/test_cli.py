"""One CLI idiom (issue 26): every command is built from ``outbox.cli``, so a boolean, a
``MODULE:ATTRIBUTE``, Ctrl-C and an unreachable service mean the same everywhere."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
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


APP = textwrap.dedent(
    """
    import pathlib, time

    def build():
        pathlib.Path("built").write_text("yes")
        time.sleep(60)
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
