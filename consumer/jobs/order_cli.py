"""``outbox-worker keys KEY``: an order key's line, for an operator (issue 56).

```
outbox-worker keys invoice-42 [--json] [--limit N]
```

Prints what runs (the key's head: its job, state and wait reason), whether it holds the jobs
behind it, and the jobs HELD behind it in the order they will run (the first ``--limit``,
50). ``--json``: one JSON object (``consumer.jobs.order_keys.KeyLine.as_dict``). A key with
neither a head nor a HELD job exits 1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from outbox.cli import Flag, add_flags

__all__ = ["add_keys_command", "keys_command"]


def add_keys_command(sub: Any) -> argparse.ArgumentParser:
    """The ``keys`` subcommand on ``outbox-worker``'s subparsers."""
    command: argparse.ArgumentParser = sub.add_parser(
        "keys",
        help="show an order key's line: what runs, what waits, what holds it",
        description="Show the line of one order key: its head (the job that runs or may run "
        "now, with its state and why it waits), whether it holds the later jobs, and the jobs "
        "HELD behind it in the order they will run.",
    )
    command.add_argument("order_key", help="the order key (store.enqueue(..., order_key=...))")
    add_flags(
        command,
        Flag("--json", bool, "one JSON object", env=None),
        Flag("--limit", int, "HELD jobs listed at most", env=None, metavar="N"),
    )
    command.set_defaults(func=keys_command)
    return command


def keys_command(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.store import Store

    store = Store(url)
    try:
        line = store.order_line(args.order_key, limit=args.limit or 50)
    finally:
        store.dispose()
    if args.json:
        print(json.dumps(line.as_dict()))
    else:
        print(line.why)
        for position, job in enumerate(line.held, start=1):
            print(f"  {position}. job {job['id']} ({job['tenant']}/{job['action']}) HELD")
        if line.held_count > len(line.held):
            print(f"  ... and {line.held_count - len(line.held)} more")
    return 0 if line.head is not None or line.held_count else 1
