"""Large documents through ``polygate._json.loads``: request bodies to the gateway,
upstream answers, stored cache entries."""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from polygate._json import loads

# ~2 MB of small objects: a long tool-calling conversation's shape.
_LARGE = json.dumps([{"role": "tool", "content": [i]} for i in range(100_000)]).encode()


@contextmanager
def _collections() -> Iterator[list[int]]:
    runs: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        yield runs
    finally:
        gc.callbacks.remove(seen)


def test_a_large_document_is_decoded_without_collecting_what_it_makes() -> None:
    expected = json.loads(_LARGE)
    with _collections() as runs:
        decoded = loads(_LARGE)
    assert decoded == expected
    assert runs == []  # each of its ~200,000 objects counted towards a collection before
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        loads(_LARGE)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_large_bad_document_fails_as_before_and_the_collector_is_back() -> None:
    with pytest.raises(json.JSONDecodeError):
        loads(_LARGE[:-1])
    assert gc.isenabled()
    assert math.isnan(loads(b"[NaN]" + b" " * len(_LARGE))[0])  # json reads what msgspec refuses
