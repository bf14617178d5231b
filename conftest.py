"""Collects README.md and docs/*.md: every code block is a test (see tests/_docs.py)."""

from __future__ import annotations

import pytest

from tests._docs import sybil

pytest_collect_file = sybil().pytest()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # ``<!-- docs: timeout=N -->`` before a block: a slow page example says so.
    for item in items:
        example = getattr(item, "example", None)
        timeout = example.region.lexemes.get("timeout") if example is not None else None
        if timeout:
            item.add_marker(pytest.mark.timeout(timeout))
