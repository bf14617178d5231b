"""docs/testing.md's examples run as written: every ``python`` block, in order, in one
namespace (as a reader pasting them one after another would)."""

from __future__ import annotations

import re

import pytest

from .conftest import ROOT

DOC = ROOT / "docs" / "testing.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


@pytest.mark.timeout(120)
def test_testing_guide_examples_run() -> None:
    blocks = _blocks()
    assert len(blocks) >= 4
    namespace: dict[str, object] = {"__name__": "docs_testing"}
    for index, block in enumerate(blocks):
        code = compile(block, f"{DOC.name}[python block {index}]", "exec")
        exec(code, namespace)
