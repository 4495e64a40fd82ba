"""``python -m bench NAME [args]`` runs ``bench/NAME.py``'s ``main(argv)``."""

from __future__ import annotations

import importlib
import pkgutil
import signal
import sys
from types import FrameType

import bench


def available() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_")
    )


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


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
    # SIGTERM (``timeout``, ``kill``) unwinds like Ctrl-C, so a benchmark's ``finally`` and
    # ``with`` blocks stop the processes, servers and schemas it started instead of leaving
    # them orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
