"""``python -m bench house`` (issue 55's measures of the tree): its parts read what they claim."""

from __future__ import annotations

import ast
import json

import pytest

from bench import house


def test_the_deepest_chain_is_the_longest_path() -> None:
    graph = {"a": {"b", "c"}, "b": {"d"}, "c": set(), "d": {"e"}, "e": set(), "f": {"a"}}
    assert house.deepest_chain(graph) == ["f", "a", "b", "d", "e"]
    assert house.deepest_chain(graph, "b") == ["b", "d", "e"]


def test_only_python_blocks_are_read_for_imports() -> None:
    text = (
        "```python\nfrom consumer.jobs.store import Store\n```\n"
        "```sh\nimport relay\n```\n"
        "~~~py\nimport outbox.db, os\n~~~\n"
    )
    blocks = house._python_blocks(text)
    assert blocks == ["from consumer.jobs.store import Store", "import outbox.db, os"]
    assert [m for b in blocks for m in house._imported_modules(b)] == [
        "consumer.jobs.store",
        "outbox.db",
    ]


def test_duplicate_bodies_are_found_whatever_their_names() -> None:
    one = ast.parse("def f(a):\n    x = a + 1\n    y = x * 2\n    z = y - 3\n    return z\n")
    two = ast.parse("def g(b):\n    p = b + 1\n    q = p * 2\n    r = q - 3\n    return r\n")
    other = ast.parse("def h(b):\n    p = b + 1\n    q = p * 2\n    r = q - 4\n    return r\n")
    short = ast.parse("def k(a):\n    return a\n")
    keys = [house._body_key(t.body[0]) for t in (one, two, other, short)]  # type: ignore[arg-type]
    assert keys[0] == keys[1] != keys[2]
    assert keys[3] is None


def test_public_modules_are_the_roots_their_errors_and_the_django_app() -> None:
    assert house.is_public_module("consumer.jobs")
    assert house.is_public_module("relay.errors")
    assert house.is_public_module("outbox.django.models")
    assert not house.is_public_module("consumer.jobs.store")
    assert not house.is_public_module("outbox.redis_client")


def test_the_measures_of_this_tree(capsys: pytest.CaptureFixture[str]) -> None:
    measured = house.measure()
    assert measured["deepest_chain_from_worker"][0] == "consumer.jobs.worker"
    assert len(measured["deepest_chain"]) >= len(measured["deepest_chain_from_worker"]) > 1
    assert "Outbox" in measured["public_names"]["outbox"]
    assert sum(files for _, files, _ in measured["sizes"]) == measured["modules"]
    assert all(complexity >= 15 for *_, complexity in measured["complex_functions"])
    assert house.main(["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["modules"] == measured["modules"]
