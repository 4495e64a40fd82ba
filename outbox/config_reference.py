"""The generated parts of the configuration page (``docs/reference/configuration.md``).

The page's prose is written by hand; its tables are written from the code, so a new field
or flag cannot be missing from them:

- one table per config dataclass of :data:`CONFIGS`: every field with its type and its
  default (from :func:`dataclasses.fields`), and its meaning, from the class docstring's
  list of fields (``- ``name``: text``, or ``- ``a`` / ``b``: text`` for fields documented
  together, which share a row); a field that list does not name is an error;
- one table per command of ``[project.scripts]``: every ``OUTBOX_*`` variable its flags
  read (from the flag declarations, :mod:`outbox.cli_flags`).

The page marks where each table goes with ``<!-- generated: config NAME -->`` or
``<!-- generated: environment PROGRAM -->``, ending at ``<!-- end generated -->``.
``python -m outbox.config_reference docs/reference/configuration.md`` rewrites those parts in
place; ``--check`` exits 1 if the page is stale. The classes are loaded by name (as
:func:`outbox.cli_reference.installed_programs` loads the commands), so ``outbox`` imports
neither ``relay`` nor ``consumer`` for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from outbox.cli_flags import declared_flag, describe_default
from outbox.cli_reference import installed_programs

#: The config dataclasses of the page: where each is defined, and where a user imports it.
CONFIGS: tuple[tuple[str, str], ...] = (
    ("relay.config:RelayConfig", "relay"),
    ("consumer.config:ConsumerConfig", "consumer"),
    ("consumer.jobs.config:WorkerConfig", "consumer"),
    ("consumer.jobs.retention:JobRetentionConfig", "consumer.jobs"),
    ("consumer.jobs.base:StoreConfig", "consumer"),
    ("consumer.jobs.retry:RetryPolicy", "consumer"),
)

BEGIN = re.compile(r"^<!-- generated: (config|environment) (\S+) -->$")
END = "<!-- end generated -->"

_BULLET = re.compile(r"^- ((?:``\w+``)(?:\s*/\s*``\w+``)*):\s?(.*)$")
_ROLE = re.compile(r":(?:mod|class|meth|func|data|attr|exc):`~?([^`<]+?)(?:\s*<[^>]*>)?`")


def load(target: str) -> type:
    """``module:Name`` -> the class."""
    module, _, name = target.partition(":")
    found: type = getattr(importlib.import_module(module), name)
    return found


def _markdown(text: str) -> str:
    """A docstring's reStructuredText roles and double backticks as Markdown code."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).strip()}`", text)
    return text.replace("``", "`")


def documented_fields(cls: type) -> list[tuple[tuple[str, ...], str]]:
    """The class docstring's list of fields: ``(names, meaning)`` in its order."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    found: list[tuple[tuple[str, ...], str]] = []
    current: list[str] | None = None
    for line in lines:
        match = _BULLET.match(line)
        if match:
            names = tuple(re.findall(r"``(\w+)``", match.group(1)))
            current = [match.group(2)]
            found.append((names, ""))
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line.strip())
        else:
            current = None
        if current is not None:
            found[-1] = (found[-1][0], " ".join(part for part in current if part))
    return found


def _default(item: dataclasses.Field[Any]) -> str:
    """A field's default as the page shows it; a factory whose value differs on every call
    (a fresh name per process) is said so."""
    if item.default is not dataclasses.MISSING:
        value = item.default
    elif item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
        if value != item.default_factory():
            return "new per instance"
    else:
        return "required"
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value == type(value)():
        return f"`{type(value).__name__}()`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{describe_default(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_table(cls: type) -> list[str]:
    """The table of ``cls``'s fields; ValueError naming the fields its docstring leaves out
    or names wrongly."""
    fields = {item.name: item for item in dataclasses.fields(cls)}
    rows = documented_fields(cls)
    named = [name for names, _ in rows for name in names]
    missing = [name for name in fields if name not in named]
    unknown = [name for name in named if name not in fields]
    if missing or unknown:
        raise ValueError(
            f"{cls.__name__}'s docstring must list each field once: "
            f"missing {missing}, not fields {unknown}"
        )
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for names, meaning in rows:
        lines.append(_row([fields[name] for name in names], meaning))
    return lines


def _row(items: list[dataclasses.Field[Any]], meaning: str) -> str:
    """One row: fields documented together share it, their types and defaults joined."""
    names = " / ".join(f"`{item.name}`" for item in items)
    types = " / ".join(dict.fromkeys(f"`{item.type}`" for item in items))
    defaults = " / ".join(_default(item) for item in items)
    return f"| {names} | {_cell(types)} | {_cell(defaults)} | {_cell(_markdown(meaning))} |"


def _commands(
    parser: argparse.ArgumentParser, command: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(command line, parser)`` of ``parser``'s leaves: each subcommand that has none."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield command, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, f"{command} {name}")


def environment_table(program: str, parser: argparse.ArgumentParser) -> list[str]:
    """Every variable ``program``'s flags read: the flag, and the commands that have it."""
    commands = list(_commands(parser, program))
    found: dict[tuple[str, str], list[str]] = {}
    for command, leaf in commands:
        for action in leaf._actions:
            flag = declared_flag(action)
            if flag is None or not action.option_strings:
                continue
            option = f"`{action.option_strings[0]}`"
            entries = [(flag.env_var, option)]
            if flag.env_fallback:
                entries.append((flag.env_fallback, f"{option} (when `{flag.env_var}` is unset)"))
            for variable, shown in entries:
                if variable:
                    readers = found.setdefault((variable, shown), [])
                    if command not in readers:
                        readers.append(command)
    lines = ["| variable | flag | read by |", "|---|---|---|"]
    for (variable, shown), readers in sorted(found.items()):
        where = (
            f"every `{program}` command"
            if len(readers) == len(commands) > 1
            else ", ".join(f"`{c}`" for c in readers)
        )
        lines.append(f"| `{variable}` | {shown} | {where} |")
    return lines


def generated_parts() -> dict[tuple[str, str], list[str]]:
    """Every table the page may ask for, by ``(kind, name)``."""
    parts: dict[tuple[str, str], list[str]] = {}
    for target, home in CONFIGS:
        cls = load(target)
        parts["config", cls.__name__] = [
            f"`from {home} import {cls.__name__}`",
            "",
            *config_table(cls),
        ]
    for program, parser in installed_programs():
        parts["environment", program] = environment_table(program, parser)
    return parts


def render(page: str, parts: dict[tuple[str, str], list[str]] | None = None) -> str:
    """``page`` with each generated part rewritten; ValueError for a part it does not know,
    an unclosed one, or a table of :data:`CONFIGS` or a program the page leaves out."""
    parts = generated_parts() if parts is None else parts
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    lines = iter(page.splitlines())
    for line in lines:
        out.append(line)
        match = BEGIN.match(line)
        if not match:
            continue
        key = (match.group(1), match.group(2))
        if key not in parts:
            raise ValueError(f"no generated part {key[0]} {key[1]}")
        seen.add(key)
        for skipped in lines:
            if skipped == END:
                break
        else:
            raise ValueError(f"generated part {key[0]} {key[1]} has no {END!r}")
        out += ["", *parts[key], "", END]
    left_out = sorted(set(parts) - seen)
    if left_out:
        raise ValueError(f"the page leaves out {[' '.join(k) for k in left_out]}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None, out: Callable[[str], object] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m outbox.config_reference",
        description="Rewrite the generated tables of the configuration page in place.",
    )
    parser.add_argument("page", type=Path, help="docs/reference/configuration.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            out(f"{args.page} is stale: python -m outbox.config_reference {args.page}")
            return 1
        return 0
    if new != text:
        args.page.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
