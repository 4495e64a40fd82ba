"""The shipped alert rules: promtool checks and unit-tests them; tuned copies stay valid.

promtool comes from Debian's ``prometheus`` package (``.ci/run`` installs it); a missing
promtool fails these tests, it never skips them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from metrics import resource_path
from metrics.alerts import default_thresholds, render_rules
from outbox.errors import ConfigError


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: apt-get install prometheus (see .ci/run)")
    return path


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alert_names(text: str) -> list[str]:
    return re.findall(r"^\s*- alert:\s*(\w+)\s*$", text, re.M)


def test_shipped_rules_pass_promtool_check() -> None:
    rules = resource_path("alerts.yml")
    result = run_promtool("check", "rules", str(rules), cwd=rules.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names(rules.read_text()))} rules found" in result.stdout


def test_shipped_rules_pass_their_unit_tests() -> None:
    tests = resource_path("alerts_test.yml")
    result = run_promtool("test", "rules", str(tests), cwd=tests.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    rules = resource_path("alerts.yml").read_text()
    tests = resource_path("alerts_test.yml").read_text()
    names = alert_names(rules)
    assert {
        "OutboxStuckRecord",
        "OutboxBacklogStale",
        "OutboxQuarantinedEvents",
        "OutboxDeadLetters",
        "OutboxRelayStalled",
        "OutboxRelayDown",
        "OutboxConsumerLagGrowing",
        "OutboxJobsNeedAttention",
        "OutboxUnknownReceipts",
    } <= set(names)
    # Split the unit tests into (alertname, expectation) blocks.
    blocks = re.findall(
        r"alertname:\s*(\w+)\s*\n\s*exp_alerts:(.*?)(?=\n\s*- eval_time|\n  #|\Z)", tests, re.S
    )
    for name in names:
        mine = [body for alert, body in blocks if alert == name]
        assert any(body.strip().startswith("[]") for body in mine), f"{name}: no quiet case"
        assert any("exp_labels" in body for body in mine), f"{name}: no firing case"
    for name in names:
        rule = rules.split(f"- alert: {name}", 1)[1].split("- alert:", 1)[0]
        assert "summary:" in rule and "description:" in rule, name


def test_unit_tests_fail_when_an_alert_is_broken(tmp_path: Path) -> None:
    """The unit tests can fail: a rule with a raised threshold no longer fires in them."""
    (tmp_path / "alerts.yml").write_text(render_rules({"stuck_record_attempts": 50}))
    (tmp_path / "alerts_test.yml").write_text(resource_path("alerts_test.yml").read_text())
    result = run_promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "OutboxStuckRecord" in result.stdout + result.stderr


def test_render_rules_lowers_thresholds_and_durations(tmp_path: Path) -> None:
    defaults = default_thresholds()
    assert defaults["stuck_record_attempts"] == 5
    assert defaults["oldest_unpublished_age_seconds"] == 300
    text = render_rules(
        {"stuck_record_attempts": 2, "relay_stalled_seconds": 1.5}, for_duration="1s"
    )
    assert "(outbox_stuck_record_attempts) >= 2'" in text
    assert "> 1.5'" in text
    assert re.findall(r"^\s*for:\s*(\S+)", text, re.M) == ["1s"] * len(alert_names(text))
    assert default_thresholds(text)["stuck_record_attempts"] == 2
    (tmp_path / "tuned.yml").write_text(text)
    result = run_promtool("check", "rules", "tuned.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_rules_rejects_unknown_names_and_bad_durations() -> None:
    with pytest.raises(ConfigError, match="unknown threshold"):
        render_rules({"no_such_threshold": 1})
    with pytest.raises(ConfigError, match="duration"):
        render_rules(for_duration="soon")
