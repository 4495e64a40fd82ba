"""A job's whole graph of steps and its progress (issue 57), for operators: the console's
``/graph`` page and ``/api/graph``, and ``outbox-worker jobs graph``.

The graph of a job is every job joined to it by edges of ``outbox_job_steps`` (``after=`` at
enqueue), in either direction: its parents, their parents, its children, their other
parents, and so on. It is walked breadth first from the job, each generation of ids read
through the edges' primary key (parents' side) and ``ix_outbox_job_steps_child`` (children's
side), then the jobs by primary key: never a scan, whatever the size of the history. At most
``limit`` jobs (:data:`MAX_GRAPH_JOBS` by default) are read; a larger graph is ``truncated``
and its counts are of the part read.

Each job is placed at a **level**: 0 for a job with no parent in the graph, else one more
than its deepest parent's, so the levels read in the order the steps can run. The
**progress** counts the jobs per state, and ``done`` of ``total``: DONE and CANCELLED jobs
are finished, WAITING_PARENTS ones wait for steps, WAITING_REVIEW and NEEDS_ATTENTION ones
wait for a person.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from consumer.jobs.schema import job_steps, jobs
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING_PARENTS,
    WAITING_REVIEW,
)

__all__ = ["MAX_GRAPH_JOBS", "StepGraph", "walk_graph"]

MAX_GRAPH_JOBS = 1000
"""Jobs of a graph read at most by default (a page of them stays readable)."""
_CHUNK = 500


@dataclass
class StepGraph:
    """The jobs of a graph (each a dict: id, tenant, action, state, level, wait_reason,
    parents, children), its edges ``(parent, child, released)`` and its progress."""

    root: int
    jobs: list[dict[str, Any]] = field(default_factory=list)
    edges: list[tuple[int, int, bool]] = field(default_factory=list)
    truncated: bool = False

    def counts(self) -> dict[str, int]:
        """Jobs per state, the most frequent first."""
        return dict(Counter(job["state"] for job in self.jobs).most_common())

    def progress(self) -> dict[str, int]:
        """``total``, ``done`` (DONE), ``cancelled``, ``finished`` (both), ``running``
        (LEASED), ``ready`` (READY), ``waiting`` (WAITING_PARENTS), ``stuck`` (a person
        must decide: WAITING_REVIEW, NEEDS_ATTENTION) and ``other`` (WAITING_EXTERNAL: a
        reply or a timer; HELD: an order key)."""
        states = Counter(job["state"] for job in self.jobs)
        done, cancelled = states[DONE], states[CANCELLED]
        running, ready, waiting = states[LEASED], states[READY], states[WAITING_PARENTS]
        stuck = states[WAITING_REVIEW] + states[NEEDS_ATTENTION]
        total = len(self.jobs)
        return {
            "total": total,
            "done": done,
            "cancelled": cancelled,
            "finished": done + cancelled,
            "running": running,
            "ready": ready,
            "waiting": waiting,
            "stuck": stuck,
            "other": total - done - cancelled - running - ready - waiting - stuck,
        }

    def summary(self) -> str:
        """One line: ``3 of 10 steps done (1 cancelled), 1 running, 4 waiting for parents,
        1 waiting for a person``; parts that are 0 are left out."""
        p = self.progress()
        parts = [f"{p['done']} of {p['total']} steps done"]
        if p["cancelled"]:
            parts[0] += f" ({p['cancelled']} cancelled)"
        for key, words in (
            ("running", "running"),
            ("ready", "ready"),
            ("waiting", "waiting for parents"),
            ("stuck", "waiting for a person"),
            ("other", "waiting for a reply, a timer or a key"),
        ):
            if p[key]:
                parts.append(f"{p[key]} {words}")
        line = ", ".join(parts)
        return line + (" (the first of a larger graph)" if self.truncated else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "progress": self.progress(),
            "counts": self.counts(),
            "summary": self.summary(),
            "truncated": self.truncated,
            "jobs": self.jobs,
            "edges": [{"parent": p, "child": c, "released": r} for p, c, r in self.edges],
        }


def walk_graph(conn: Connection, job_id: int, limit: int = MAX_GRAPH_JOBS) -> StepGraph:
    """The graph of ``job_id`` (module docstring); an unknown id gives an empty graph."""
    graph = StepGraph(root=job_id)
    seen, edges, graph.truncated = _reach(conn, job_id, limit)
    rows = _jobs_of(conn, sorted(seen))
    if not rows:
        return graph
    graph.edges = [(p, c, r) for (p, c), r in sorted(edges.items()) if p in rows and c in rows]
    levels = _levels(rows, graph.edges)
    for one, row in sorted(rows.items(), key=lambda item: (levels[item[0]], item[0])):
        row["level"] = levels[one]
        row["parents"] = [p for p, c, _ in graph.edges if c == one]
        row["children"] = [c for p, c, _ in graph.edges if p == one]
        graph.jobs.append(row)
    return graph


def _reach(
    conn: Connection, job_id: int, limit: int
) -> tuple[set[int], dict[tuple[int, int], bool], bool]:
    """The ids joined to ``job_id``, breadth first, at most ``limit``; the edges read (some
    may lead out of the ids kept); whether the walk stopped at the limit."""
    seen = {job_id}
    frontier = [job_id]
    edges: dict[tuple[int, int], bool] = {}
    while frontier:
        found: list[int] = []
        for parent, child, released in _edges_of(conn, frontier):
            edges[(parent, child)] = released
            for other in (parent, child):
                if other in seen:
                    continue
                if len(seen) >= limit:
                    return seen, edges, True
                seen.add(other)
                found.append(other)
        frontier = found
    return seen, edges, False


def _edges_of(conn: Connection, ids: list[int]) -> Iterable[tuple[int, int, bool]]:
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        columns = (job_steps.c.parent_id, job_steps.c.child_id, job_steps.c.released)
        for side in (job_steps.c.parent_id, job_steps.c.child_id):
            for parent, child, released in conn.execute(select(*columns).where(side.in_(chunk))):
                yield int(parent), int(child), bool(released)


def _jobs_of(conn: Connection, ids: list[int]) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    columns = (jobs.c.id, jobs.c.tenant, jobs.c.action, jobs.c.state, jobs.c.wait_reason)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        for row in conn.execute(
            select(*columns, jobs.c.parents_pending).where(jobs.c.id.in_(chunk))
        ):
            rows[int(row.id)] = {
                "id": int(row.id),
                "tenant": row.tenant,
                "action": row.action,
                "state": row.state,
                "wait_reason": row.wait_reason,
                "parents_pending": int(row.parents_pending or 0),
            }
    return rows


def _levels(rows: dict[int, Any], edges: list[tuple[int, int, bool]]) -> dict[int, int]:
    """Longest path from a job without parents (Kahn's order; edges form no cycle, as the
    enqueue refuses one, but a job left over by a cycle's remains gets level 0)."""
    parents: dict[int, list[int]] = {i: [] for i in rows}
    children: dict[int, list[int]] = {i: [] for i in rows}
    for parent, child, _ in edges:
        parents[child].append(parent)
        children[parent].append(child)
    left = {i: len(parents[i]) for i in rows}
    level = dict.fromkeys(rows, 0)
    ready = sorted(i for i, n in left.items() if n == 0)
    while ready:
        current = ready.pop()
        for child in children[current]:
            level[child] = max(level[child], level[current] + 1)
            left[child] -= 1
            if left[child] == 0:
                ready.append(child)
    return level
