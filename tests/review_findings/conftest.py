"""Review findings: each test here reproduces a bug found on main at f431ce0.

They are collected as strict xfails so that the suite stays green while a bug is
open, and turns red (XPASS strict) when a fix lands — then move the test into the
suite proper, without the mark.  To see them fail as plain tests:

    POLYGATE_REVIEW_RAW=1 python -m pytest tests/review_findings -q
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("POLYGATE_REVIEW_RAW"):
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here) and os.path.basename(str(item.fspath)).startswith("test_f_"):
            item.add_marker(pytest.mark.xfail(
                strict=True, reason="review finding: reproduces a bug on main f431ce0"
            ))
