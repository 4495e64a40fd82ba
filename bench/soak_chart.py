"""The soak's chart (``bench.soak``): one CSV, or two runs overlaid (solid, dashed).

    python -m bench soak_chart OUT.png RUN.csv [OTHER.csv]

Six panels over time: rows per table, total size per table, dead tuples per table, relay
claims/s with jobs finished/s, commit -> effect p50/p99, WAL bytes written per event.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

TABLES = ("outbox", "inbox", "jobs", "attempts", "operations", "dead_letters", "workers", "audit")
COLOURS = dict(zip(TABLES, ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7"), strict=True))
STYLES = ("-", "--")


def _read(path: Path) -> dict[str, list[float]]:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    columns: dict[str, list[float]] = {key: [] for key in rows[0]} if rows else {}
    for row in rows:
        for key, value in row.items():
            columns[key].append(float(value) if value not in ("", "nan") else float("nan"))
    return columns


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib  # dev-only dependency, imported when a chart is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(path.stem.removeprefix("soak-"), _read(path)) for path in paths]
    fig, axes = plt.subplots(3, 2, figsize=(13, 11), sharex=True)
    (rows_ax, size_ax), (dead_ax, rate_ax), (lat_ax, wal_ax) = axes
    for index, (label, data) in enumerate(runs):
        style = STYLES[index % len(STYLES)]
        minutes = [t / 60 for t in data["t"]]
        suffix = f" ({label})" if len(runs) > 1 else ""
        for table in TABLES:
            if max(data.get(f"{table}_rows", [0]) or [0]) == 0 and index:
                continue
            colour = COLOURS[table]
            rows_ax.plot(minutes, data[f"{table}_rows"], style, color=colour, label=table + suffix)
            size_ax.plot(minutes, [b / 2**20 for b in data[f"{table}_bytes"]], style, color=colour)
            dead_ax.plot(minutes, data[f"{table}_dead"], style, color=colour)
        rate_ax.plot(minutes, data["claims_s"], style, color="C0", label="relay claims/s" + suffix)
        rate_ax.plot(minutes, data["jobs_s"], style, color="C2", label="jobs finished/s" + suffix)
        lat_ax.plot(minutes, data["p50_ms"], style, color="C1", label="p50" + suffix)
        lat_ax.plot(minutes, data["p99_ms"], style, color="C3", label="p99" + suffix)
        wal_ax.plot(minutes, data["wal_per_event"], style, color="C4", label=label)
    rows_ax.set_title("rows per table")
    size_ax.set_title("total size per table (MiB, pg_total_relation_size)")
    dead_ax.set_title("dead tuples per table")
    rate_ax.set_title("throughput (per s, each 15 s interval)")
    lat_ax.set_title("commit -> effect latency (ms, each interval)")
    wal_ax.set_title("WAL bytes written per committed event")
    rows_ax.legend(fontsize=7, ncol=2)
    for ax in (rate_ax, lat_ax, wal_ax):
        ax.legend(fontsize=8)
    lat_ax.set_yscale("log")
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0 if ax is not lat_ax else None)
    names = " vs ".join(label for label, _ in runs)
    fig.suptitle(f"bench soak: {names}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    plot([Path(p) for p in argv[1:]], Path(argv[0]))
    return 0
