"""The Grafana dashboard and the alert rules only use metrics the code really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import sqlalchemy as sa

import consumer
import consumer.inbox
import consumer.jobs.upgrades
from metrics import build_metrics, resource_path, unknown_receipts_source
from outbox.db import make_engine
from outbox.hooks import Hooks
from outbox.schema import build_schema, create_schema

NAME = re.compile(r"\b(outbox_[a-z_]+)\b")


def exported_names(tmp_path: Path) -> set[str]:
    """Every sample name a process with all tables present and every hook called exports."""
    engine = make_engine(f"sqlite:///{tmp_path / 'names.db'}")
    create_schema(engine, build_schema())
    consumer.inbox.create_inbox_schema(engine, consumer.inbox.build_inbox_schema())
    consumer.jobs.upgrades.create_schema(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO consumer_dead_letters (group_name, stream, entry_id, reason, error,"
                " deliveries, payload, dead_letter_stream) "
                "VALUES ('g', 's', '1-0', 'poison', 'e', 1, '{}', 'd')"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_events (event_id, topic, key, key_hash, identity, payload,"
                " attempts) VALUES ('e1', 't', 'k', 1, 'e1', '{}', 3)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_events (event_id, topic, key, key_hash, identity, payload,"
                " state, published_at) VALUES ('e2', 't', 'k', 1, 'e2', '{}', 'published',"
                " CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(sa.text("CREATE TABLE receipts (state text, created_at float)"))
    # A READY job (the per-queue gauges) next to the published event (the tables' ages).
    consumer.Store(engine).enqueue("t", "send-a")
    # A schedule: its per-schedule series (fired, missed, overdue).
    consumer.Store(engine).schedule_every("digest", cron="0 9 * * *", tenant="t", action="digest")
    metrics = build_metrics(engine=engine, extra_sources=[unknown_receipts_source("receipts")])
    hooks = metrics.hooks
    for name, method in vars(Hooks).items():
        if name.startswith("_") or not callable(method):
            continue
        if name == "relay_published":
            hooks.relay_published("t", 1, [0.1])
        elif name == "relay_reconciled":
            hooks.relay_reconciled(1, 1)
        elif name == "consumer_lag":
            hooks.consumer_lag("g", "s", 1, 1)
        elif name.endswith("_cycle_ok"):
            getattr(hooks, name)(1.0)
        elif name == "relay_publish_error":
            hooks.relay_publish_error("transient", "t")
        elif name == "relay_batch":
            hooks.relay_batch(0.1, 1)
        elif name == "worker_job_finished":
            hooks.worker_job_finished("a", "done", 0.1, job_id=1, queue="default", kind="a")
        elif name == "worker_job_started":
            hooks.worker_job_started("a", job_id=1, queue="default", kind="a", enqueued_at=1.0)
        elif name == "worker_tenant_limit_waiting":
            hooks.worker_tenant_limit_waiting(1)
        elif name == "worker_slots":
            hooks.worker_slots(1, 2)
        elif name == "worker_queue_slots":
            hooks.worker_queue_slots("mail", 1, 2)
        elif name == "provider_limit_waiting":
            hooks.provider_limit_waiting("mail", 1)
        elif name == "provider_limit":
            hooks.provider_limit("mail", 3, reason="a call timed out")
        elif name == "provider_paused":
            hooks.provider_paused("mail", 3.0, 1.0)
        elif name == "worker_lease_conflict":
            hooks.worker_lease_conflict("a")
        elif name in ("consumer_handled", "consumer_dead_lettered"):
            getattr(hooks, name)("g", "s", 1)
        elif name == "consumer_duplicate":
            hooks.consumer_duplicate("g", 1)
        elif name == "relay_quarantined":
            hooks.relay_quarantined("t", 1)
        elif name == "relay_redis_persistence":
            hooks.relay_redis_persistence("rdb")
        elif name == "relay_redis_data_loss":
            hooks.relay_redis_data_loss(1.0)
        else:  # a new hook: this test must learn to call it
            raise AssertionError(f"unknown hook {name}")
    names = {s.name for family in metrics.registry.collect() for s in family.samples}
    names = {n for n in names if not n.endswith("_created")}  # counters' creation times
    engine.dispose()
    return names


def dashboard() -> dict[str, object]:
    return dict(json.loads(resource_path("dashboard.json").read_text()))


def dashboard_exprs() -> list[str]:
    exprs = []
    for panel in dashboard()["panels"]:  # type: ignore[attr-defined]
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def test_dashboard_is_importable_json_with_documented_panels() -> None:
    board = dashboard()
    assert board["uid"] == "outbox-toolkit"
    panels = board["panels"]
    assert isinstance(panels, list) and len(panels) >= 20
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["description"], panel
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]


def test_dashboard_and_rules_only_use_exported_metrics(tmp_path: Path) -> None:
    exported = exported_names(tmp_path)
    assert "outbox_oldest_unpublished_age_seconds" in exported
    assert "outbox_relay_commit_to_stream_seconds_bucket" in exported
    rules = resource_path("alerts.yml").read_text()
    rule_exprs = re.findall(r"^\s*expr:\s*'(.*)'", rules, re.M)
    used = {n for expr in [*dashboard_exprs(), *rule_exprs] for n in NAME.findall(expr)}
    missing = used - exported
    assert not missing, f"referenced but never exported: {sorted(missing)}"
    # Every exported family appears on the dashboard (histograms through a sample name).
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    on_board = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    not_shown = {
        f
        for f in families - on_board
        if f"{f}_bucket" not in used and f not in {"outbox_relay_batch_size"}
    }
    assert not not_shown, f"exported but not on the dashboard: {sorted(not_shown)}"
