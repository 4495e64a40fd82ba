"""The documentation cannot rot: every Python block of every page runs, and the site builds
with ``mkdocs build --strict`` (docs/contributing.md, "Code blocks")."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import redis

from consumer import Store
from consumer.errors import JobNotFound
from outbox import Outbox
from tests.docs_runner import blocks, marks, python_blocks
from tests.services import PrivateRedis, wait_for

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
RUNNER = Path(__file__).resolve().parent / "docs_runner.py"


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


PAGES_WITH_CODE = [page for page in PAGES if any(not b.not_run for b in python_blocks(page))]


@pytest.fixture(scope="module")
def docs_redis() -> Iterator[str]:
    server = PrivateRedis().start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.mark.slow  # 3-11 s a page: a fresh interpreter, embedded Redis, the simulator
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_name)
def test_page_code_runs(page: Path, pg_url: str, docs_redis: str, tmp_path: Path) -> None:
    """The page's blocks run as written, in order, in a fresh directory; PostgreSQL and Redis
    URLs of the page point at a fresh schema and a private Redis server."""
    client = redis.Redis.from_url(docs_redis)
    client.flushall()
    client.close()
    env = {
        **os.environ,
        "OUTBOX_DOCS_DATABASE_URL": pg_url,
        "OUTBOX_DOCS_REDIS_URL": docs_redis,
    }
    for name in list(env):
        if name.startswith("OUTBOX_") and not name.startswith("OUTBOX_DOCS_"):
            del env[name]  # a page runs as it would for a reader, not with this shell's settings
    result = subprocess.run(
        [sys.executable, str(RUNNER), str(page)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"{_name(page)}: a code block failed\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )


def test_not_run_marks_are_few_and_give_a_reason() -> None:
    """``<!-- docs: not run: REASON -->`` marks a fragment; it must say why, and most blocks run."""
    total = 0
    skipped: list[str] = []
    for page in PAGES:
        for block in python_blocks(page):
            total += 1
            if block.not_run is not None:
                assert block.not_run, f"{_name(page)}:{block.line}: a not-run mark needs a reason"
                skipped.append(f"{_name(page)}:{block.line}")
    assert total > 0
    assert len(skipped) * 4 <= total, f"too many blocks not run ({len(skipped)}/{total}): {skipped}"


def test_not_run_marks_stand_before_python_blocks() -> None:
    """A mark on anything but a python block (or a stray one) is a mistake the runner would
    silently ignore."""
    for page in PAGES:
        found = marks(page)
        marked = sum(1 for block in blocks(page) if block.not_run is not None and block.is_python)
        assert len(found) == marked, (
            f"{_name(page)}: a not-run mark (lines {found}) that is not before a python block"
        )


@pytest.mark.slow  # mkdocs build (~15 s under load)
def test_site_builds_strict(tmp_path: Path) -> None:
    """Every page is in the nav, every link and anchor resolves: ``mkdocs build --strict``."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its future
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").exists()


# The package roots a user imports from, with their errors modules: each has its section in
# the API reference (docs/reference/api.md, rendered by mkdocstrings from the docstrings).
PUBLIC_ROOTS = (
    "outbox",
    "outbox.errors",
    "outbox.testing",
    "outbox.console",
    "relay",
    "relay.errors",
    "consumer",
    "consumer.errors",
    "consumer.jobs",
    "metrics",
)


def test_the_api_reference_has_every_public_root() -> None:
    text = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^::: ([\w.]+)$", text, flags=re.MULTILINE)
    assert sorted(blocks) == sorted(PUBLIC_ROOTS)


# Where the docs and examples import from (issue 55): the package roots, their errors and types
# modules, and the two apps with their own roots, the Django app and the console. The deeper
# modules still import (old paths keep working), but a reader is shown the small surface.
IMPORTABLE_ROOTS = (
    "outbox",
    "outbox.testing",
    "relay",
    "consumer",
    "consumer.jobs",
    "consumer.jobs.effects",
    "metrics",
)
PUBLIC_PACKAGES = ("outbox", "relay", "consumer", "metrics")
IMPORT_LINE = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+(?:\s*,\s*[\w.]+)*))")


def _importable(module: str) -> bool:
    parent, _, leaf = module.rpartition(".")
    return (
        module in IMPORTABLE_ROOTS
        or (parent in IMPORTABLE_ROOTS and leaf in ("errors", "types"))
        or module == "outbox.console"
        or module == "outbox.django"
        or module.startswith("outbox.django.")  # its models and migrations, as Django wants
    )


def imported_modules(source: str) -> list[str]:
    """The modules of ours that ``source``'s import lines name (line by line, so a fragment
    that does not parse is read too)."""
    found = []
    for line in source.splitlines():
        match = IMPORT_LINE.match(line)
        if match:
            names = [match.group(1)] if match.group(1) else match.group(2).split(",")
            found += [n.strip() for n in names if n.strip().split(".")[0] in PUBLIC_PACKAGES]
    return found


def test_the_docs_and_examples_import_only_from_the_package_roots() -> None:
    sources = [(_name(page), block.source) for page in PAGES for block in python_blocks(page)] + [
        (str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
        for path in sorted((ROOT / "examples").rglob("*.py"))
    ]
    deep = sorted(
        {
            f"{place}: {module}"
            for place, source in sources
            for module in imported_modules(source)
            if not _importable(module)
        }
    )
    assert deep == []
    assert any("consumer.jobs" in imported_modules(source) for _, source in sources)


def test_the_import_check_reads_both_forms() -> None:
    source = "from consumer.jobs.store import Store\n    import relay, outbox.db\nimport os\n"
    assert imported_modules(source) == ["consumer.jobs.store", "relay", "outbox.db"]
    assert [_importable(m) for m in imported_modules(source)] == [False, True, False]
    assert _importable("consumer.errors") and _importable("outbox.django.models")


def _sh_blocks(page: Path) -> list[str]:
    return [block.source.strip() for block in blocks(page) if block.language == "sh"]


def test_readme_is_a_door() -> None:
    """The README is the pitch, the two commands, a short tour and links (issue 26)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"


def test_readme_test_command_is_what_ci_runs() -> None:
    """CI runs the README's test command, byte for byte: the newcomer's command is tested."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    commands = _sh_blocks(ROOT / "README.md")
    assert ci[-1] in commands, f"{ci[-1]!r} is not among the README's commands {commands}"
    assert any(command.endswith("outbox-relay demo") for command in commands)


REPO_PATH = re.compile(r"`((?:outbox|relay|consumer|metrics|bench|tests|examples|docs)/[\w./-]*)`")


def test_paths_named_in_the_docs_exist() -> None:
    """A page that names a file of the repository (`relay/store.py`) names one that exists:
    moving code must move its mentions too."""
    missing = [
        f"{_name(page)}: {path}"
        for page in PAGES
        for path in REPO_PATH.findall(page.read_text(encoding="utf-8"))
        if not (ROOT / path.rstrip("/")).exists()
    ]
    assert not missing, missing


COMMANDS = (
    "outbox-relay",
    "outbox-consumer",
    "outbox-worker",
    "outbox-simulator",
    "outbox-console",
)


def _command_lines() -> list[tuple[str, list[str]]]:
    """The ``outbox-*`` command lines of the pages' ``sh`` blocks, as tokens, comments off."""
    found = []
    for page in PAGES:
        for source in _sh_blocks(page):
            for line in source.splitlines():
                tokens = line.split("#")[0].split()
                if tokens and tokens[0] in COMMANDS:
                    found.append((_name(page), tokens))
    return found


def _help(command: str, subcommand: str) -> str:
    """``COMMAND SUBCOMMAND --help``, in this process (through the installed entry point):
    its text, or "" when it does not exit 0."""
    [entry] = [e for e in entry_points(group="console_scripts") if e.name == command]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = entry.load()([subcommand, "--help"])
    except SystemExit as exit:
        code = exit.code
    return out.getvalue() if code in (0, None) else ""


def test_command_lines_in_the_docs_exist() -> None:
    """Every ``outbox-*`` line of a ``sh`` block names a real subcommand, and each of its
    flags is one that subcommand's ``--help`` lists (shell blocks do not run: this is what
    keeps them honest)."""
    helps: dict[tuple[str, str], str] = {}
    problems = []
    for page, tokens in _command_lines():
        command, subcommand = tokens[0], tokens[1]
        if (command, subcommand) not in helps:
            helps[command, subcommand] = _help(command, subcommand)
        text = helps[command, subcommand]
        if not text:
            problems.append(f"{page}: {command} {subcommand}: no such subcommand")
            continue
        for token in tokens[2:]:
            flag = token.strip("[]|").split("=")[0]
            if flag.startswith("--") and flag not in text:
                problems.append(f"{page}: {command} {subcommand}: no flag {flag}")
    assert not problems, problems


@pytest.mark.slow  # three processes on the embedded default
def test_quickstart_processes_run_as_written(tmp_path: Path) -> None:
    """The quick start's "Run it as processes" commands, exactly as the page writes them,
    carry a new approved quote from the outbox to its job done, and stop cleanly on SIGTERM."""
    page = DOCS / "quickstart.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    ran = subprocess.run(
        [sys.executable, str(RUNNER), str(page)], cwd=tmp_path, env=env, capture_output=True
    )
    assert ran.returncode == 0, ran.stderr.decode()[-4000:]
    [commands] = [s for s in _sh_blocks(page) if s.startswith("outbox-relay run")]

    outbox = Outbox(f"sqlite:///{tmp_path / 'app.db'}")
    with outbox.transaction() as tx:
        tx.emit("quote.approved", key="quote-19", payload={"quote": 19, "total": 60})
    outbox.engine.dispose()

    store = Store(f"sqlite:///{tmp_path / 'app.db'}")
    processes = [
        subprocess.Popen(
            line.split(),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in commands.splitlines()
    ]
    try:
        wait_for(
            lambda: store.get("default", "send-quote-19").state == "DONE",
            "the quote's job to be done by the processes",
            timeout=60,
            ignore=(JobNotFound,),
        )
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=60) for process in processes]
        logs = [process.stderr.read()[-2000:] if process.stderr else "" for process in processes]
        store.dispose()
    assert codes == [0, 0, 0], logs


def _metric_names(tmp_path: Path) -> set[str]:
    """Every metric the toolkit exports: the families of a registry built on a database with
    every part's tables, and every ``"outbox_..."`` name in ``metrics/`` that is not a table."""
    from consumer.inbox import build_inbox_schema
    from consumer.jobs.schema import metadata as jobs_metadata
    from metrics import build_metrics
    from outbox import build_schema

    outbox = Outbox(f"sqlite:///{tmp_path / 'metrics.db'}")
    outbox.create_schema()
    Store(outbox.engine).create_schema()
    families = {family.name for family in build_metrics(engine=outbox.engine).registry.collect()}
    outbox.engine.dispose()
    tables = {
        table.name
        for metadata in (build_schema().metadata, build_inbox_schema().metadata, jobs_metadata)
        for table in metadata.tables.values()
    }
    named = {
        name
        for path in (ROOT / "metrics").glob("*.py")
        for name in re.findall(r'"(outbox_[a-z_]+)"', path.read_text(encoding="utf-8"))
    }
    return families | {name for name in named if name not in tables or name in families}


def test_every_metric_is_documented(tmp_path: Path) -> None:
    """The metrics table of docs/how-to/metrics.md lists every metric the code exports."""
    text = (DOCS / "how-to" / "metrics.md").read_text(encoding="utf-8")
    missing = sorted(
        name for name in _metric_names(tmp_path) if not re.search(rf"`{name}(_total)?`", text)
    )
    assert not missing, f"metrics not in docs/how-to/metrics.md: {missing}"


def test_every_alert_rule_is_documented() -> None:
    """docs/reference/alert-rules.md names every rule of metrics/alerts.yml and every
    threshold that ``render_rules`` can tune."""
    from metrics.alerts import default_thresholds

    rules = (ROOT / "metrics" / "alerts.yml").read_text(encoding="utf-8")
    text = (DOCS / "reference" / "alert-rules.md").read_text(encoding="utf-8")
    alerts = re.findall(r"^\s*- alert: (\w+)", rules, flags=re.MULTILINE)
    assert alerts
    missing = [f"alert {name}" for name in alerts if f"`{name}`" not in text]
    missing += [f"threshold {name}" for name in default_thresholds() if f"`{name}`" not in text]
    assert not missing, f"not in docs/reference/alert-rules.md: {missing}"


def test_readme_links_resolve() -> None:
    """The README's relative links (into docs/, bench/reports/) name files that exist; the
    site's own links are checked by ``mkdocs build --strict``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, missing


def test_no_file_points_to_a_document_outside_the_repository() -> None:
    """The project's own docs carry its guarantees: no file names the design or style notes
    its developers keep elsewhere."""
    names = ("DESIGN" + ".md", "STYLE" + ".md")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    citing = [
        path
        for path in tracked
        if path.endswith((".py", ".md", ".yml", ".yaml", ".toml", ".html", ".txt"))
        and any(
            name in (ROOT / path).read_text(encoding="utf-8", errors="ignore") for name in names
        )
    ]
    assert citing == []
