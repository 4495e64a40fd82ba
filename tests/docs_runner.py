"""Run the Python code blocks of a documentation page, as written (docs/contributing.md).

    python tests/docs_runner.py docs/quickstart.md

Every ```python block of the page runs, in page order, in one namespace, in the working
directory (a fresh temporary directory when the test suite runs it, on ``sys.path`` so that
the page's modules import). Two kinds of block do not run by themselves:

- ```python title="billing.py"``: a module; it is written to that file in the working
  directory when the page reaches it (later blocks import it), and compiled.
- a block whose preceding line is ``<!-- docs: not run: REASON -->``: a fragment (it cannot
  run on its own); REASON is required.

Top-level ``await`` is allowed; such blocks run on one event loop per page. The literal
URLs ``postgresql+psycopg://localhost/app`` and ``redis://localhost:6379/0`` are replaced by
``OUTBOX_DOCS_DATABASE_URL`` and ``OUTBOX_DOCS_REDIS_URL`` when those are set (the suite sets
them to a fresh PostgreSQL schema and a private Redis server). Exit 0 when every block ran,
1 naming the first block that failed (its traceback points at the page's lines).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

NOT_RUN = re.compile(r"^<!--\s*docs:\s*not run:\s*(?P<reason>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>.*)$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')

DATABASE_PLACEHOLDER = "postgresql+psycopg://localhost/app"
REDIS_PLACEHOLDER = "redis://localhost:6379/0"


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the block's first code line
    language: str
    source: str
    title: str | None = None  # ```python title="module.py"
    not_run: str | None = None  # the reason given by <!-- docs: not run: ... -->

    @property
    def is_python(self) -> bool:
        return self.language in ("python", "py")


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with their marks."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    previous = ""  # the last non-blank line before the current one
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"].strip()
        language = info.split()[0] if info else ""
        title = TITLE.search(info)
        reason = NOT_RUN.match(previous)
        body: list[str] = []
        start = i + 2
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        found.append(
            Block(
                page=str(path),
                line=start,
                language=language,
                source="\n".join(body) + "\n",
                title=title["title"] if title else None,
                not_run=reason["reason"] if reason else None,
            )
        )
        previous = ""
        i += 1
    return found


def marks(path: Path) -> list[int]:
    """Lines (1-based) of not-run marks outside code blocks, where the runner looks for them."""
    found: list[int] = []
    fence: str | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None and match is not None:
            fence = match["fence"]
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None and NOT_RUN.match(line.strip()):
            found.append(number)
    return found


def python_blocks(path: Path) -> list[Block]:
    return [block for block in blocks(path) if block.is_python]


def _substitute(source: str) -> str:
    for placeholder, variable in (
        (DATABASE_PLACEHOLDER, "OUTBOX_DOCS_DATABASE_URL"),
        (REDIS_PLACEHOLDER, "OUTBOX_DOCS_REDIS_URL"),
    ):
        value = os.environ.get(variable)
        if value:
            source = source.replace(placeholder, value)
    return source


def run_page(path: Path) -> None:
    """Run the page's blocks; raises what the first failing block raised."""
    namespace: dict[str, object] = {"__name__": "__docs__"}
    loop: asyncio.AbstractEventLoop | None = None
    sys.path.insert(0, os.getcwd())
    try:
        for block in python_blocks(path):
            if block.not_run is not None:
                continue
            # Padding keeps the page's line numbers in tracebacks.
            source = "\n" * (block.line - 1) + _substitute(block.source)
            if block.title is not None:
                Path(block.title).write_text(_substitute(block.source), encoding="utf-8")
                compile(source, block.page, "exec")
                continue
            code = compile(source, block.page, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            result = eval(code, namespace)
            if inspect.iscoroutine(result):
                if loop is None:
                    loop = asyncio.new_event_loop()
                loop.run_until_complete(result)
    finally:
        if loop is not None:
            loop.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: docs_runner.py PAGE.md", file=sys.stderr)
        return 2
    path = Path(argv[0]).resolve()
    try:
        run_page(path)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
