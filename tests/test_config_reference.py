"""The configuration page's tables come from the code (issue 55): every field of every config
dataclass, with its default and the meaning its class docstring gives, and every ``OUTBOX_*``
variable of every command. A field or a flag added without them fails here."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from outbox.config_reference import (
    CONFIGS,
    config_table,
    documented_fields,
    generated_parts,
    load,
    main,
    render,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "configuration.md"
PACKAGES = ("outbox", "relay", "consumer", "metrics")

# Config dataclasses that are not on the page, each with its reason. A new one must be added
# to outbox.config_reference.CONFIGS (the page gets its table) or here.
NOT_ON_THE_PAGE = {
    # outbox-console serve's own flags, built from the command line (docs/reference/cli.md).
    "outbox.console.cli:ServeConfig",
    # The simulator's capabilities, changed over HTTP (POST /config, the simulator's page).
    "consumer.jobs.simulation:SimulatorConfig",
}


def test_the_configuration_page_is_current() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert render(text) == text, (
        "docs/reference/configuration.md is stale: "
        "python -m outbox.config_reference docs/reference/configuration.md"
    )


def test_every_field_of_every_config_has_a_row_with_its_default() -> None:
    text = PAGE.read_text(encoding="utf-8")
    for target, _ in CONFIGS:
        cls = load(target)
        assert f"<!-- generated: config {cls.__name__} -->" in text
        for item in dataclasses.fields(cls):
            assert f"`{item.name}`" in text, (cls.__name__, item.name)
    # what the issue found missing from the hand-written WorkerConfig table
    worker = "\n".join(generated_parts()["config", "WorkerConfig"])
    for name in ("claim_ahead", "name", "retention"):
        assert f"| `{name}` |" in worker


def _config_dataclasses() -> set[str]:
    """``module:Class`` of every dataclass of the packages named ``*Config`` or ``*Policy``."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if (
                    isinstance(node, ast.ClassDef)
                    and node.name.endswith(("Config", "Policy"))
                    and any("dataclass" in ast.unparse(d) for d in node.decorator_list)
                ):
                    found.add(f"{module}:{node.name}")
    return found


def test_every_config_dataclass_is_on_the_page_or_said_why_not() -> None:
    listed = {target for target, _ in CONFIGS}
    found = _config_dataclasses()
    assert "consumer.jobs.config:WorkerConfig" in found
    assert found - listed - NOT_ON_THE_PAGE == set()
    assert (listed | NOT_ON_THE_PAGE) - found == set()  # no stale entry


def test_every_flag_variable_is_on_the_page() -> None:
    from outbox.cli_flags import declared_flag
    from outbox.cli_reference import installed_programs

    text = PAGE.read_text(encoding="utf-8")
    variables: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            flag = declared_flag(action)
            if flag is not None and flag.env_var:
                variables.add(flag.env_var)

    for _, parser in installed_programs():
        walk(parser)
    assert "OUTBOX_TENANT_LIMIT" in variables
    assert sorted(v for v in variables if f"`{v}`" not in text) == []


@dataclasses.dataclass(frozen=True)
class _Documented:
    """A config.

    - ``a`` / ``b``: two fields
      on two lines.
    - ``c``: one.
    """

    a: int = 1
    b: float = 2.5
    c: str = "x"


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    """- ``a``: only one of two."""

    a: int = 1
    b: int = 2


def test_the_docstring_list_gives_each_field_its_meaning() -> None:
    assert documented_fields(_Documented) == [
        (("a", "b"), "two fields on two lines."),
        (("c",), "one."),
    ]
    assert config_table(_Documented)[2:] == [
        "| `a` / `b` | `int` / `float` | `1` / `2.5` | two fields on two lines. |",
        '| `c` | `str` | `"x"` | one. |',
    ]


def test_a_field_the_docstring_leaves_out_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        config_table(_Undocumented)


def test_a_page_that_leaves_a_table_out_or_asks_for_an_unknown_one_is_an_error() -> None:
    parts = {("config", "A"): ["| a |"]}
    page = "# P\n<!-- generated: config A -->\nold\n<!-- end generated -->\ntext\n"
    assert render(page, parts) == (
        "# P\n<!-- generated: config A -->\n\n| a |\n\n<!-- end generated -->\ntext\n"
    )
    with pytest.raises(ValueError, match="leaves out"):
        render("# P\n", parts)
    with pytest.raises(ValueError, match="no generated part"):
        render("<!-- generated: config B -->\n<!-- end generated -->\n", parts)
    with pytest.raises(ValueError, match="has no"):
        render("<!-- generated: config A -->\n", parts)


def test_check_says_a_stale_page_and_the_command_rewrites_it(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    current = PAGE.read_text(encoding="utf-8")
    page.write_text(current.replace("| `ttl` |", "| `ttl_old` |"), encoding="utf-8")
    said: list[str] = []
    assert main(["--check", str(page)], out=said.append) == 1
    assert "stale" in said[0]
    assert main([str(page)]) == 0
    assert page.read_text(encoding="utf-8") == current
    assert main(["--check", str(page)], out=said.append) == 0
