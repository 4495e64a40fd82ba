"""CPU seconds of processes, from ``/proc`` (Linux): one reader for every benchmark.

``cpu_seconds`` is a process's user + system time; with ``children`` the time of its exited
children it waited for as well. ``postgres_cpu`` is a whole local PostgreSQL cluster's
(its postmaster, the backends that exited and the live ones), and ``local_postmaster`` finds
the postmaster of the server a URL reaches when it runs on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, children: bool = False) -> float:
    """utime + stime of a process (with cutime + cstime when ``children``); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def children_of(parent: int) -> list[int]:
    """The pids of ``parent``'s live children."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            found.append(int(entry))
    return found


def postgres_cpu(postmaster: int) -> float:
    """The cluster's CPU seconds: the postmaster with its exited children, and live ones."""
    live = sum(cpu_seconds(pid) for pid in children_of(postmaster))
    return cpu_seconds(postmaster, children=True) + live


def local_postmaster(engine: sa.Engine) -> int | None:
    """The postmaster's pid of the server ``engine`` reaches, when it runs here and this
    process may read its data directory (a superuser's ``SHOW data_directory``); else None."""
    try:
        with engine.connect() as conn:
            data = conn.execute(sa.text("SHOW data_directory")).scalar_one()
        pid = int((Path(data) / "postmaster.pid").read_text().split()[0])
    except (sa.exc.DBAPIError, OSError, ValueError, IndexError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None
