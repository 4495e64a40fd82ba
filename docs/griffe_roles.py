"""A griffe extension for the API reference (docs/reference/api.md): the docstrings' Sphinx
roles (``:class:`~consumer.jobs.retry.RetryPolicy```) become Markdown code (`RetryPolicy`), as
mkdocstrings renders docstrings as Markdown. Loaded by mkdocs.yml, not by the packages."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:mod|class|meth|func|data|attr|exc|obj):`(~?)([^`<]+?)(?:\s*<[^>]*>)?`")


def _code(match: re.Match[str]) -> str:
    target = match.group(2).strip()
    if match.group(1):  # ~a.b.C shows C, as Sphinx does
        target = target.rpartition(".")[2]
    return f"`{target}`"


class RolesToCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
