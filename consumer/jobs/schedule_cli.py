"""``outbox-worker schedules list|pause|resume|remove``: operate the schedules (issue 39).

```
outbox-worker schedules list [--json] [--worker MODULE:ATTRIBUTE]
outbox-worker schedules pause NAME
outbox-worker schedules resume NAME
outbox-worker schedules remove NAME
```

``list`` prints each schedule with its cron and zone, whether it is paused, its next slot,
its last fired slot with that job's state, and the slots it fired and missed (``--json``:
one JSON array of objects, slots in ISO 8601 UTC). With ``--worker`` it also says which
schedules defined in code are no longer among that Worker's ``schedules=`` (``not in
code``): they stay until removed here. ``pause`` stops a schedule firing, ``resume`` starts
it again from its next slot, ``remove`` deletes it (its jobs stay). An unknown NAME exits 1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from outbox.cli import Flag, UsageError, add_flags

__all__ = ["add_schedules_command", "schedules_command"]


def add_schedules_command(sub: Any) -> argparse.ArgumentParser:
    """The ``schedules`` subcommand on ``outbox-worker``'s subparsers."""
    command: argparse.ArgumentParser = sub.add_parser(
        "schedules",
        help="list, pause, resume or remove the schedules",
        description="List the schedules with their next slot, last fired slot and its job's "
        "state, pause one (it fires nothing until resumed), resume it (from its next slot) "
        "or remove it (the jobs it made stay).",
    )
    command.add_argument("action", choices=("list", "pause", "resume", "remove"), help="what to do")
    command.add_argument(
        "name", nargs="?", default=None, help="the schedule (pause, resume, remove)"
    )
    add_flags(
        command,
        Flag("--json", bool, "list: one JSON array", env=None),
        Flag(
            "--worker",
            help="list: MODULE:ATTRIBUTE of a Worker; marks schedules defined in code that it "
            "no longer defines",
            env=None,
            metavar="MODULE:ATTRIBUTE",
        ),
    )
    command.set_defaults(func=schedules_command)
    return command


# complexity: one branch per schedules subcommand (list, pause, resume, remove) and format
def schedules_command(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.store import Store

    if args.action != "list" and not args.name:
        raise UsageError(f"schedules {args.action} needs the schedule's NAME")
    if args.action == "list" and args.name:
        raise UsageError("schedules list takes no NAME")
    if args.action != "list" and (args.json or args.worker):
        raise UsageError("--json and --worker go with schedules list")
    defined: set[str] | None = None
    if args.worker:
        from consumer.jobs.worker import Worker  # not consumer.jobs.cli: it imports this module
        from outbox.cli import load_target

        worker = load_target(args.worker, Worker, example="myapp.jobs:worker")
        defined = {s.name for s in worker.schedules or ()}
    store = Store(url)
    try:
        if args.action == "pause":
            changed = store.pause_schedule(args.name)
            print(f"{args.name}: paused" + ("" if changed else " (it was already)"))
        elif args.action == "resume":
            changed = store.resume_schedule(args.name)
            print(f"{args.name}: running" + ("" if changed else " (it was not paused)"))
        elif args.action == "remove":
            store.remove_schedule(args.name)
            print(f"{args.name}: removed")
        else:
            _list(store.schedules(), defined, as_json=bool(args.json))
        return 0
    finally:
        store.dispose()


def _list(found: list[Any], defined: set[str] | None, *, as_json: bool) -> None:
    def orphan(info: Any) -> bool:
        return defined is not None and info.source == "code" and info.name not in defined

    if as_json:
        rows = []
        for info in found:
            row = info.as_dict()
            if defined is not None:
                row["in_code"] = not orphan(info)
            rows.append(row)
        print(json.dumps(rows, indent=2))
        return
    header: tuple[str, ...] = ("NAME", "CRON", "TZ", "STATE", "NEXT_SLOT", "LAST_SLOT")
    header += ("LAST_JOB", "FIRED", "MISSED")
    table = [
        (
            info.name,
            info.cron,
            info.tz,
            ("paused" if info.paused else "running") + (", not in code" if orphan(info) else ""),
            str(info.next_slot),
            str(info.last_slot) if info.last_slot is not None else "-",
            f"{info.last_job_id} {info.last_job_state}" if info.last_job_id is not None else "-",
            str(info.fired),
            str(info.missed),
        )
        for info in found
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *table, strict=False)]
    for row in (header, *table):
        print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
