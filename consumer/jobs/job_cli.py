"""``outbox-worker jobs reply|cancel``: answer or cancel one job from a shell (issue 59);
``show`` and ``graph``: a job, and its graph of steps (issue 57: ``consumer.jobs.step_cli``);
``keys``: an order key's line (issue 56: ``consumer.jobs.order_cli``, also ``outbox-worker
keys KEY``).

```
outbox-worker jobs reply JOB [ACTION] --reply-id ID --payload JSON [--source NAME] [--json]
outbox-worker jobs cancel JOB [ACTION] --reason TEXT [--json]
outbox-worker jobs show TENANT ACTION [--json]
outbox-worker jobs graph JOB [ACTION] [--json] [--limit N]
outbox-worker jobs keys KEY [--json] [--limit N]
```

``JOB`` is a job id, or a tenant followed by the ``ACTION``, as ``Store.reply`` and
``Store.cancel`` take them. ``reply`` records a reply (``--payload`` is JSON: ``'"yes"'``,
``'{"answer": "accepted"}'``), deduplicated by ``--reply-id``: a job waiting for one becomes
READY, any other keeps it for its next run, and a tenant and action not enqueued yet keep it
for the job's first run (the output says ``kept``). ``cancel`` cancels the job, or records a
cancel request when a worker holds it (``LEASED``: the run stops at its next sensible point).

Prints one line (``--json``: one JSON object). Exit codes: 0 done (a duplicate reply too), 1
no such job or a move the job's state refuses, 2 bad usage (a payload that is not JSON, a
missing flag, a bad name).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from outbox.cli import Flag, UsageError, add_flags
from outbox.display import printable

__all__ = ["add_jobs_command", "jobs_command"]


def add_jobs_command(sub: Any) -> argparse.ArgumentParser:
    """The ``jobs`` subcommand on ``outbox-worker``'s subparsers."""
    command: argparse.ArgumentParser = sub.add_parser(
        "jobs",
        help="reply to a job, cancel it, show it or its graph, or show an order key's line",
        description="Reply to a job (a job waiting for one becomes READY; a tenant and action "
        "not enqueued yet keep the reply for the job's first run) or cancel it (a job a "
        "worker holds gets a cancel request), or show it (its state, result, parents and "
        "children), or its graph of steps and the graph's progress. JOB is a job id, or a "
        "tenant followed by ACTION. keys KEY: the line of an order key (what runs, what "
        "waits, what holds it), as outbox-worker keys KEY.",
    )
    command.add_argument(
        "verb", choices=("reply", "cancel", "show", "graph", "keys"), help="what to do"
    )
    command.add_argument("job", help="the job id, or its tenant (then ACTION)")
    command.add_argument("action", nargs="?", default=None, help="the job's action (with a tenant)")
    add_flags(
        command,
        Flag("--reply-id", help="reply: its id, the deduplication key", env=None, metavar="ID"),
        Flag("--payload", help="reply: the payload, as JSON", env=None, metavar="JSON"),
        Flag("--source", help="reply: who answered (mail, sms, ...)", env=None, metavar="NAME"),
        Flag("--reason", help="cancel: why (kept in the job's history)", env=None),
        Flag("--json", bool, "the result as one JSON object", env=None),
        Flag("--limit", int, "graph: jobs read at most; keys: HELD jobs listed", env=None),
    )
    command.set_defaults(func=jobs_command)
    return command


def job_reference(raw: str, action: str | None) -> tuple[Any, str | None]:
    """``(job id, None)`` or ``(tenant, action)`` from the command line."""
    if action is None:
        if not raw.isdigit():
            raise UsageError(f"{raw!r} is not a job id: give a job id, or a tenant and ACTION")
        return int(raw), None
    return raw, action


def _read_command(args: argparse.Namespace, url: str) -> int:
    """``show``, ``graph`` and ``keys``: reads, each in the module that owns it."""
    if args.verb == "show":
        from consumer.jobs.step_cli import job_command

        if args.action is None:
            raise UsageError("jobs show needs a tenant and ACTION")
        args.tenant, args.job_action = args.job, args.action
        return job_command(args, url)
    if args.verb == "graph":
        from consumer.jobs.step_cli import graph_command

        return graph_command(args, url, *job_reference(args.job, args.action))
    from consumer.jobs.order_cli import keys_command

    if args.action is not None:
        raise UsageError("jobs keys takes one KEY")
    args.order_key = args.job
    return keys_command(args, url)


def jobs_command(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.store import Store

    if args.verb in ("show", "graph", "keys"):
        return _read_command(args, url)
    if args.limit is not None:
        raise UsageError("--limit goes with jobs graph and jobs keys")
    job, action = job_reference(args.job, args.action)
    if args.verb == "reply":
        payload = _reply_payload(args)
    elif args.reason is None:
        raise UsageError("jobs cancel needs --reason")
    elif args.reply_id is not None or args.payload is not None or args.source is not None:
        raise UsageError("--reply-id, --payload and --source go with jobs reply")
    store = Store(url)
    try:
        if args.verb == "reply":
            result = store.reply(
                job, action, payload=payload, reply_id=args.reply_id, source=args.source
            )
            answer: dict[str, Any] = {
                "job_id": result.job_id,
                "reply_id": result.reply_id,
                "duplicate": result.duplicate,
                "resumed": result.resumed,
                "state": result.state,
                "kept": result.kept,
            }
        else:
            state = store.cancel(job, action, reason=args.reason)
            answer = {"job": args.job if action is None else f"{job}/{action}", "state": state}
    finally:
        store.dispose()
    if args.json:
        print(json.dumps(answer))
    elif args.verb == "cancel":
        print(f"{printable(answer['job'])}: {answer['state']}")
    else:
        print(_reply_line(answer))
    return 0


def _reply_payload(args: argparse.Namespace) -> Any:
    if args.reason is not None:
        raise UsageError("--reason goes with jobs cancel")
    if args.reply_id is None or args.payload is None:
        raise UsageError("jobs reply needs --reply-id and --payload")
    try:
        return json.loads(args.payload)
    except ValueError as exc:
        raise UsageError(f"--payload is not JSON ({exc}): quote a string as '\"yes\"'") from None


def _reply_line(answer: dict[str, Any]) -> str:
    reply = printable(answer["reply_id"])
    if answer["kept"]:
        note = " (a duplicate: nothing changed)" if answer["duplicate"] else ""
        return f"reply {reply}: kept for the job's first run, no such job yet{note}"
    if answer["duplicate"]:
        return f"reply {reply}: a duplicate of job #{answer['job_id']}'s, nothing changed"
    moved = ", resumed" if answer["resumed"] else ""
    return f"reply {reply}: recorded for job #{answer['job_id']} ({answer['state']}{moved})"
