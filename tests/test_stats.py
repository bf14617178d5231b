"""Stall arithmetic (SPEC §5) as a pure function."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polygate._stats import stall_stats


def test_fewer_than_two_chunks() -> None:
    assert stall_stats([], 2000).stall_ms is None
    one = stall_stats([1.0], 2000)
    assert (one.stall_ms, one.stall_count, one.active_generation_ms) == (None, None, None)


def test_exact_values() -> None:
    # chunks at 0, 0.5, 3.5 (gap 3 s > 2 s), 4.0, 4.0 + 2.0 (exactly the threshold: no stall)
    s = stall_stats([10.0, 10.5, 13.5, 14.0, 16.0], 2000)
    assert s.stall_count == 1
    assert s.stall_ms == pytest.approx(3000.0)
    assert s.active_generation_ms == pytest.approx(6000.0 - 3000.0)


times = st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=2, max_size=50).map(sorted)


@given(times, st.floats(min_value=1, max_value=1e5))
def test_invariants(chunks: list[float], threshold_ms: float) -> None:
    s = stall_stats(chunks, threshold_ms)
    assert s.stall_ms is not None and s.stall_count is not None and s.active_generation_ms is not None
    span_ms = (chunks[-1] - chunks[0]) * 1000
    assert 0 <= s.stall_ms <= span_ms + 1e-6
    assert 0 <= s.stall_count <= len(chunks) - 1
    assert s.active_generation_ms == pytest.approx(max(span_ms - s.stall_ms, 0.0), abs=1e-6)
    # every counted gap is longer than the threshold
    assert s.stall_ms >= s.stall_count * threshold_ms - 1e-6
    if s.stall_count == 0:
        assert s.stall_ms == 0


@given(times, st.floats(min_value=1, max_value=1e5), st.floats(min_value=1, max_value=1e5))
def test_higher_threshold_never_counts_more(chunks: list[float], a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert stall_stats(chunks, hi).stall_count <= stall_stats(chunks, lo).stall_count  # type: ignore[operator]


@given(times, st.floats(min_value=-1e3, max_value=1e3))
def test_shift_invariant(chunks: list[float], shift: float) -> None:
    a = stall_stats(chunks, 2000)
    b = stall_stats([t + shift for t in chunks], 2000)
    assert a.stall_count == b.stall_count


def test_a_gap_equal_to_the_threshold_is_not_a_stall_despite_float_noise() -> None:
    # 10.3 - 8.3 == 2.0000000000000018 in floating point: still exactly the threshold.
    s = stall_stats([8.3, 10.3], 2000)
    assert (s.stall_count, s.stall_ms) == (0, 0.0)
    s = stall_stats([8.3, 10.3011], 2000)  # a millisecond over: a stall
    assert s.stall_count == 1
