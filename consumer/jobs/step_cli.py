"""``outbox-worker jobs show TENANT ACTION``: one job with its result, its parents and its
children; ``outbox-worker jobs graph``: its whole graph of steps and the graph's progress
(issue 57: steps; ``consumer.jobs.job_cli`` parses both).

```
outbox-worker jobs show TENANT ACTION [--json]
outbox-worker jobs graph JOB [ACTION] [--json] [--limit N]
```

``show`` prints the job's id, state, attempts, wait reason and last error, its result (JSON)
and the parents it waits for (``after=`` at enqueue) and the jobs that wait for it, each with
its state. ``--json``: one JSON object with the same fields. An unknown job exits 1.

``graph`` prints the progress (``3 of 10 steps done, 1 running, ...``) and then each job of
the graph by level (the order the steps can run), with its state, why it waits, and its
parents; the job asked for is marked ``*``. ``--limit``: jobs read at most (1,000).
``--json``: ``consumer.jobs.step_graph.StepGraph.as_dict``. An unknown job exits 1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from outbox.display import printable

__all__ = ["graph_command", "job_command"]


def job_command(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.store import Store

    store = Store(url, create_schema=False)
    try:
        job = store.get(args.tenant, args.job_action)
        graph = store.graph(job.id)
    finally:
        store.dispose()
    shown = {
        "id": job.id,
        "tenant": job.tenant,
        "action": job.action,
        "state": job.state,
        "attempts": job.attempts,
        "wait_reason": job.wait_reason,
        "last_error": job.last_error,
        "parents_pending": job.parents_pending,
        "result": job.result,
        **graph,
    }
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    for key in ("id", "tenant", "action", "state", "attempts", "wait_reason", "last_error"):
        if shown[key] is not None:
            print(f"{key}: {shown[key]}")
    print(f"result: {json.dumps(job.result)}")
    for kind in ("parents", "children"):
        print(f"{kind}:" + ("" if graph[kind] else " none"))
        for step in graph[kind]:
            print(f"  #{step['id']} {step['tenant']}/{step['action']} {step['state']}")
    return 0


def graph_command(args: argparse.Namespace, url: str, job: Any, action: str | None) -> int:
    from consumer.jobs.step_graph import MAX_GRAPH_JOBS
    from consumer.jobs.store import Store

    store = Store(url, create_schema=False)
    try:
        graph = store.step_graph(job, action, limit=args.limit or MAX_GRAPH_JOBS)
    finally:
        store.dispose()
    if args.json:
        print(json.dumps(graph.as_dict(), indent=2))
        return 0
    print(graph.summary())
    names = {step["id"]: f"{step['tenant']}/{step['action']}" for step in graph.jobs}
    for step in graph.jobs:
        mark = "*" if step["id"] == graph.root else " "
        line = f"{mark} {'  ' * step['level']}#{step['id']} {names[step['id']]} {step['state']}"
        if step["parents"]:
            line += " after " + ", ".join(names[p] for p in step["parents"])
        if step["wait_reason"]:
            line += f" ({step['wait_reason']})"
        print(printable(line))
    return 0
