"""One rule for number settings (issue 26): every size, count, interval and rate of every part
is an int or float, never a bool, finite, and positive (or non-negative where 0 means
"off"). The rule lives in ``outbox.validate.check_number``; before it, the parts had 55
hand-written checks, and some let ``nan`` or ``inf`` through (a worker's ``ttl=nan``, a
consumer's ``claim_idle_ms=inf``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from consumer import ConsumerConfig, HttpProvider, WorkerConfig
from consumer.jobs.base import StoreConfig
from consumer.jobs.retry import RetryPolicy
from outbox import ConfigError, Outbox
from outbox.validate import check_number, number_problem
from relay import RelayConfig

BAD = [True, "5", None, math.inf, -math.inf, math.nan, -1, 0]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_the_rule_refuses_what_is_not_a_positive_finite_number(value: object) -> None:
    assert number_problem(value) is not None
    with pytest.raises(ConfigError) as err:
        check_number("setting", value, ConfigError)
    assert err.value.setting == "setting"


def test_the_rule_allows_zero_integers_and_a_maximum_when_asked() -> None:
    assert number_problem(0, zero=True) is None
    assert number_problem(0.5) is None and check_number("s", 2, ConfigError) == 2.0
    assert "integer" in (number_problem(1.5, integer=True) or "")
    assert "at most" in (number_problem(7, maximum=5) or "")
    with pytest.raises(ConfigError, match="'acme': must be positive"):
        check_number("tenant_limits", 0, ConfigError, integer=True, item="acme")


SETTINGS: list[tuple[str, Callable[[Any], object]]] = [
    ("RelayConfig.poll_interval", lambda v: RelayConfig(poll_interval=v)),
    ("RelayConfig.batch_size", lambda v: RelayConfig(batch_size=v)),
    ("ConsumerConfig.block_ms", lambda v: ConsumerConfig(block_ms=v)),
    ("ConsumerConfig.claim_idle_ms", lambda v: ConsumerConfig(claim_idle_ms=v)),
    ("WorkerConfig.ttl", lambda v: WorkerConfig(ttl=v)),
    ("WorkerConfig.concurrency", lambda v: WorkerConfig(concurrency=v)),
    ("WorkerConfig.tenant_limit", lambda v: WorkerConfig(tenant_limit=v)),
    ("StoreConfig.recover_limit", lambda v: StoreConfig(recover_limit=v)),
    ("RetryPolicy.max_attempts", lambda v: RetryPolicy(max_attempts=v)),
    ("HttpProvider.timeout", lambda v: HttpProvider("mail", "http://x/send", timeout=v)),
    ("HttpProvider.rate_limit", lambda v: HttpProvider("mail", "http://x/s", rate_limit=v)),
    ("Outbox.max_payload_bytes", lambda v: Outbox("sqlite://", max_payload_bytes=v)),
]


@pytest.mark.parametrize("name, build", SETTINGS, ids=[n for n, _ in SETTINGS])
@pytest.mark.parametrize("value", [math.nan, math.inf, True, -1], ids=repr)
def test_every_part_refuses_a_bad_number_the_same_way(
    name: str, build: Callable[[Any], object], value: object
) -> None:
    with pytest.raises(ConfigError) as err:
        build(value)
    assert err.value.setting.split(".")[-1] == name.split(".")[1]
    assert "must be" in str(err.value)
