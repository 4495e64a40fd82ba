"""The shape of the house, as a newcomer meets it (issue 55): ``python -m bench house``.

Not a timing: it reads the source tree and prints

- files and lines per package and subpackage (a folder with an ``__init__.py``);
- the deepest chain of module-level imports inside the packages (what importing one module
  runs of ours, one edge per ``import``, as tests/test_layout.py builds the graph), and the
  deepest from ``consumer.jobs.worker``;
- the public names: each root's ``__all__``, their sum and the distinct names;
- the modules of ours that the docs (``python`` blocks of README.md and docs/**/*.md) and
  examples/ import from, those beyond the public roots marked;
- radon's functions at cyclomatic complexity 15 or more (each needs a ``# complexity:``
  reason, which tests/test_layout.py checks);
- duplicate pairs: functions of at least :data:`DUPLICATE_STATEMENTS` statements whose bodies
  are the same code once names are set aside (the same syntax tree with every variable and
  argument renamed alike; attributes, constants and calls' shapes kept; docstrings,
  annotations and positions ignored), wherever they are in the packages.

``--json`` prints the same as one JSON object, to compare two checkouts.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("outbox", "relay", "consumer", "metrics")
# Where a user imports from: the roots, their errors and types modules, and the Django app.
ROOTS = (
    "outbox",
    "relay",
    "consumer",
    "consumer.jobs",
    "consumer.jobs.effects",
    "metrics",
    "outbox.testing",
)
ALLOWED_EXTRA = ("outbox.django",)
COMPLEXITY = 15
DUPLICATE_STATEMENTS = 4

IMPORT_LINE = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w., ]+?)\s*(?:#.*)?$)")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*(\S*)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def sizes() -> list[tuple[str, int, int]]:
    """``(package, files, lines)`` for each package and subpackage: the modules directly in
    its folder, not its subpackages'."""
    found: dict[str, list[int]] = {}
    for path in modules().values():
        package = module_name(path.parent / "__init__.py")
        files_lines = found.setdefault(package, [0, 0])
        files_lines[0] += 1
        files_lines[1] += _line_count(path)
    return [(name, files, lines) for name, (files, lines) in sorted(found.items())]


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (under ``if``, ``try`` and ``with``
    too), not those inside functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    if isinstance(child, ast.ExceptHandler):
                        stack.extend(child.body)
                    else:
                        stack.append(child)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of the module, those inside functions too."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def import_graph(*, function_level: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours its module-level imports name (the deepest known one);
    with ``function_level``, its imports inside functions too (tests/test_layout.py's
    cycles count lazy imports)."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    collect = _all_imports if function_level else _module_level_imports
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in collect(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if sub in known else node.module)
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def deepest_chain(graph: dict[str, set[str]], start: str | None = None) -> list[str]:
    """The longest path of ``graph`` (acyclic: tests/test_layout.py holds it), from ``start``
    or from any module; ties go to the first name in sorted order."""

    @cache
    def longest(node: str) -> tuple[str, ...]:
        best: tuple[str, ...] = ()
        for target in sorted(graph[node]):
            chain = longest(target)
            if len(chain) > len(best):
                best = chain
        return (node, *best)

    if start is not None:
        return list(longest(start))
    best: tuple[str, ...] = ()
    for node in sorted(graph):
        chain = longest(node)
        if len(chain) > len(best):
            best = chain
    return list(best)


def public_names() -> dict[str, list[str]]:
    """Each root's ``__all__`` (a literal list in its ``__init__.py``); [] for a root without
    one, and no entry for a root that does not exist."""
    found: dict[str, list[str]] = {}
    known = modules()
    for root in ROOTS:
        if root not in known:
            continue
        names: list[str] = []
        tree = ast.parse(known[root].read_text(encoding="utf-8"))
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and isinstance(node.value, ast.List | ast.Tuple)
            ):
                names = [ast.literal_eval(element) for element in node.value.elts]
        found[root] = names
    return found


def _imported_modules(source: str) -> list[str]:
    """The modules of ours that a piece of Python names in its imports (a line-based read, so
    a fragment that does not parse still counts)."""
    found: list[str] = []
    for line in source.splitlines():
        match = IMPORT_LINE.match(line)
        if not match:
            continue
        if match.group(1):
            names = [match.group(1)]
        else:
            names = [part.split(" as ")[0].strip() for part in match.group(2).split(",")]
        found += [name for name in names if name.split(".")[0] in PACKAGES]
    return found


def _python_blocks(text: str) -> list[str]:
    """The bodies of a Markdown text's ``python`` fenced blocks."""
    blocks: list[str] = []
    fence: str | None = None  # the open block's fence
    current: list[str] | None = None  # its lines, None for a block of another language
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                current = [] if match.group(2) in ("python", "py", "pycon") else None
        elif line.strip() == fence:
            if current is not None:
                blocks.append("\n".join(current))
            fence, current = None, None
        elif current is not None:
            current.append(line)
    return blocks


def user_imports() -> dict[str, Counter[str]]:
    """Module -> how many times each place (a page, an example file) imports it."""
    found: dict[str, Counter[str]] = {}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    sources: list[tuple[str, str]] = []
    for page in pages:
        for block in _python_blocks(page.read_text(encoding="utf-8")):
            sources.append((str(page.relative_to(ROOT)), block))
    for path in sorted((ROOT / "examples").rglob("*.py")):
        sources.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    for place, source in sources:
        for module in _imported_modules(source):
            found.setdefault(module, Counter())[place] += 1
    return found


def is_public_module(module: str) -> bool:
    """A root, a root's ``errors`` or ``types`` module, or the Django app (and its parts)."""
    if module in ROOTS:
        return True
    parent, _, leaf = module.rpartition(".")
    if parent in ROOTS and leaf in ("errors", "types"):
        return True
    return any(module == extra or module.startswith(extra + ".") for extra in ALLOWED_EXTRA)


def complex_functions() -> list[tuple[str, str, int, int]]:
    """``(path, function, line, complexity)`` for radon's functions at ``COMPLEXITY`` or more."""
    from radon.complexity import cc_visit
    from radon.visitors import Function

    found: list[tuple[str, str, int, int]] = []
    for path in modules().values():
        seen: set[tuple[str, int]] = set()
        blocks: list[Any] = list(cc_visit(path.read_text(encoding="utf-8")))
        while blocks:
            block = blocks.pop()
            if not isinstance(block, Function):
                blocks.extend(block.methods)
                continue
            blocks.extend(block.closures)
            key = (block.fullname, block.lineno)
            if block.complexity >= COMPLEXITY and key not in seen:
                seen.add(key)
                found.append(
                    (str(path.relative_to(ROOT)), block.fullname, block.lineno, block.complexity)
                )
    return sorted(found, key=lambda row: (-row[3], row[0], row[2]))


def _body_key(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function's body as comparable text, None when it is too short to count."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    statements = sum(isinstance(child, ast.stmt) for stmt in body for child in ast.walk(stmt))
    if statements < DUPLICATE_STATEMENTS:
        return None
    copy = ast.parse("\n".join(ast.unparse(stmt) for stmt in body))
    return ast.dump(_Anonymous().visit(copy), include_attributes=False)


class _Anonymous(ast.NodeTransformer):
    """Every variable and argument named alike, annotations dropped."""

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id="_", ctx=node.ctx)

    def visit_arg(self, node: ast.arg) -> ast.arg:
        return ast.arg(arg="_")


def duplicate_groups() -> list[list[str]]:
    """Groups of functions (``path:line name``) with the same body, biggest first."""
    groups: dict[str, list[str]] = {}
    for path in modules().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key = _body_key(node)
                if key is not None:
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                    groups.setdefault(key, []).append(where)
    found = [sorted(places) for places in groups.values() if len(places) > 1]
    return sorted(found, key=lambda places: (-len(places), places))


def measure() -> dict[str, Any]:
    graph = import_graph()
    names = public_names()
    imports = user_imports()
    return {
        "sizes": sizes(),
        "modules": len(graph),
        "deepest_chain": deepest_chain(graph),
        "deepest_chain_from_worker": deepest_chain(graph, "consumer.jobs.worker")
        if "consumer.jobs.worker" in graph
        else [],
        "public_names": names,
        "user_imports": {module: dict(places) for module, places in sorted(imports.items())},
        "complex_functions": complex_functions(),
        "duplicates": duplicate_groups(),
    }


def report(m: dict[str, Any]) -> str:
    out: list[str] = []
    sizes_ = m["sizes"]
    out += ["## Files and lines per package (modules directly in its folder)", ""]
    out += [f"{'package':32} {'files':>6} {'lines':>8}"]
    for name, files, lines in sizes_:
        out.append(f"{name:32} {files:6} {lines:8}")
    for package in PACKAGES:
        files = sum(f for n, f, _ in sizes_ if n == package or n.startswith(package + "."))
        lines = sum(x for n, _, x in sizes_ if n == package or n.startswith(package + "."))
        out.append(f"{package + ' (all)':32} {files:6} {lines:8}")
    total_files = sum(f for _, f, _ in sizes_)
    total_lines = sum(x for _, _, x in sizes_)
    out += [f"{'total':32} {total_files:6} {total_lines:8}", ""]

    chain, worker = m["deepest_chain"], m["deepest_chain_from_worker"]
    out += ["## Deepest chain of module-level imports", ""]
    out.append(f"{len(chain)} modules: " + " -> ".join(chain))
    if worker:
        out.append(f"from consumer.jobs.worker, {len(worker)} modules: " + " -> ".join(worker))
    out.append("")

    names: dict[str, list[str]] = m["public_names"]
    distinct = {name for values in names.values() for name in values}
    out += ["## Public names (each root's __all__)", ""]
    for root in ROOTS:
        if root in names:
            out.append(f"{root:24} {len(names[root]):4}")
        else:
            out.append(f"{root:24}    - (no such package)")
    total = sum(len(v) for v in names.values())
    out += [f"{'sum':24} {total:4}", f"{'distinct':24} {len(distinct):4}", ""]

    imports: dict[str, dict[str, int]] = m["user_imports"]
    beyond = [module for module in imports if not is_public_module(module)]
    out += ["## Modules the docs and examples import from", ""]
    out.append(
        f"{len(imports)} modules, {len(beyond)} beyond the roots, their errors/types modules"
        " and outbox.django (marked *)"
    )
    for module, places in imports.items():
        mark = " " if is_public_module(module) else "*"
        count = sum(places.values())
        where = ", ".join(sorted(places))
        out.append(f"{mark} {module:36} {count:4}  {where}")
    out.append("")

    functions = m["complex_functions"]
    out += [f"## Functions at radon CC >= {COMPLEXITY}: {len(functions)}", ""]
    for path, function, line, complexity in functions:
        out.append(f"{complexity:4}  {path}:{line} {function}")

    groups = m["duplicates"]
    pairs = sum(len(g) * (len(g) - 1) // 2 for g in groups)
    out += [
        "",
        f"## Duplicate pairs (same body, {DUPLICATE_STATEMENTS}+ statements): {pairs}"
        f" in {len(groups)} groups",
        "",
    ]
    for places in groups:
        out.append("  " + "  =  ".join(places))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench house", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    m = measure()
    print(json.dumps(m, indent=1) if args.json else report(m))
    return 0
