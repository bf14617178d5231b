"""Behaviour of the settings' validation and OCR's document reading no other test
pinned, found by mutating them: each test fails on the mutation its docstring
names."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import polygate
from polygate import ConfigError


def test_budget_ratio_of_one_is_accepted() -> None:
    """Mutation (``_fraction``: ``0 <= value <= 1`` -> ``0 <= value < 1``): budget_ratio is
    documented as a number in [0, 1] (docs/configuration.md); 1 and 0 are accepted,
    just past either end is not.  The mutant refused budget_ratio=1."""
    assert polygate.Hedge(after_s=1, budget_ratio=1).budget_ratio == 1
    assert polygate.Hedge(after_s=1, budget_ratio=0).budget_ratio == 0
    for bad in (1.0000001, -1e-9):
        with pytest.raises(ConfigError):
            polygate.Hedge(after_s=1, budget_ratio=bad)


def test_a_whole_number_setting_takes_2_63_minus_1() -> None:
    """Mutation (``value > MAX_WHOLE`` -> ``>=``): "must be at most 2**63 - 1": the largest
    64-bit integer is accepted, one more is not.  The mutant refused 2**63 - 1."""
    assert polygate.Breaker(failures=2**63 - 1).failures == 2**63 - 1
    assert polygate.Retry(same_source_retries=2**63 - 1).same_source_retries == 2**63 - 1
    with pytest.raises(ConfigError, match="2\\*\\*63 - 1"):
        polygate.Breaker(failures=2**63)


def test_a_document_that_grew_after_its_size_was_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation (``f.read(cap + 1)`` -> ``f.read(cap)``): a file that grows past
    max_document_bytes between the size check (os.stat) and the read -- a document
    still being written -- is refused, not silently cut to its first
    max_document_bytes bytes.  The mutant returned the truncated bytes."""
    from polygate import _ocr_document

    path = tmp_path / "scan.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"x" * 200)
    real_stat = os.stat

    class Small:
        def __init__(self, st: Any) -> None:
            self._st = st
            self.st_size = 10  # what it was when its size was read

        def __getattr__(self, name: str) -> Any:
            return getattr(self._st, name)

    def stat(p: Any, *a: Any, **k: Any) -> Any:
        st = real_stat(p, *a, **k)
        return Small(st) if str(p) == str(path) else st

    monkeypatch.setattr(_ocr_document.os, "stat", stat)
    settings = polygate.Ocr(max_document_bytes=100)
    with pytest.raises(ConfigError, match="over max_document_bytes=100"):
        _ocr_document._read(path, settings)
