"""``outbox-worker jobs show TENANT ACTION``: one job with its result, its parents and its
children (issue 57: steps; ``consumer.jobs.job_cli`` parses it).

```
outbox-worker jobs show TENANT ACTION [--json]
```

Prints the job's id, state, attempts, wait reason and last error, its result (JSON) and the
parents it waits for (``after=`` at enqueue) and the jobs that wait for it, each with its
state. ``--json``: one JSON object with the same fields. An unknown job exits 1.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["job_command"]


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
