"""One application shape across the docs (issue 59): the quick start's ``billing.py``, as the
page writes it, runs under ``outbox.testing.Pipeline`` the way docs/testing.md says
(``Billing(pipeline.store)`` with its handler mappings), and the testing helpers return the
types docs/testing.md names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from sqlalchemy import Row

from outbox.testing import Effect, Pipeline
from tests.docs_runner import python_blocks

ROOT = Path(__file__).resolve().parent.parent


def test_the_quickstart_billing_module_runs_on_a_test_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    [module] = [
        b for b in python_blocks(ROOT / "docs" / "quickstart.md") if b.title == "billing.py"
    ]
    path = tmp_path / "billing.py"
    path.write_text(module.source)
    spec = importlib.util.spec_from_file_location("quickstart_billing", path)
    assert spec is not None and spec.loader is not None
    billing = importlib.util.module_from_spec(spec)
    monkeypatch.chdir(tmp_path)  # its production store: a SQLite file in the working directory
    try:
        spec.loader.exec_module(billing)
        with Pipeline(tmp_path / "pipeline") as p:
            app = billing.Billing(p.store)
            p.consumer("billing", app.consumer_handlers)
            p.worker(app.worker_handlers)
            for quote in (17, 17, 18):  # 17 twice: one job
                with p.outbox.transaction() as tx:
                    tx.emit(
                        "quote.approved",
                        key=f"quote-{quote}",
                        payload={"quote": quote, "total": 120},
                        tenant="studio",
                        identity=f"studio:quote-{quote}",
                    )
            result = p.drain()
            assert result.jobs_run == 2
            p.assert_jobs(action="send-quote", DONE=2)
            rows = p.job_rows()
            assert all(isinstance(row, Row) for row in rows)
            assert [row._asdict()["action"] for row in rows] == ["send-quote-17", "send-quote-18"]
            assert p.receipt_rows() == [] and p.effects() == []
            assert isinstance(p.events()[0], dict)
    finally:
        billing.store.dispose()
        sys.modules.pop("quickstart_billing", None)


def test_receipt_rows_are_rows_and_effects_are_effects(tmp_path: Path) -> None:
    with Pipeline(tmp_path) as p:
        mail = p.fake_provider("mail")
        p.worker(
            {"send": lambda job: job.dispatch("email", "mail", {"to": "a@example.com"})},
            providers={"mail": mail},
        )
        p.store.enqueue("studio", "send-1")
        p.drain()
        [receipt] = p.receipt_rows()
        assert isinstance(receipt, Row)
        assert (receipt.state, receipt.action) == ("ACCEPTED", "send-1")
        [effect] = p.effects()
        assert isinstance(effect, Effect) and effect.identity == "studio:send-1"
        assert p.operations.receipt(receipt.operation_id).provider_ref == receipt.provider_ref
