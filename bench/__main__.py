"""``python -m bench NAME [args]`` runs ``bench/NAME.py``'s ``main(argv)``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import bench


def available() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_")
    )


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m bench NAME [options]\n\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; choose from: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
