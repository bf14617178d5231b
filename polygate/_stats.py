"""Chunk timeline → the generation statistics of ``CallStats`` (pure arithmetic;
``docs/statistics.md`` defines them).

All inputs are ``trio.current_time()`` seconds; outputs are milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["StallStats", "stall_stats"]


@attrs.frozen
class StallStats:
    stall_ms: float | None
    stall_count: int | None
    active_generation_ms: float | None


_NONE = StallStats(None, None, None)
_EPSILON_S = 1e-6


def stall_stats(chunk_times: Sequence[float], threshold_ms: float) -> StallStats:
    """Sum and count of the gaps between consecutive content chunks longer than
    ``threshold_ms``, and the net decode time ``(last - first) - stall_ms``.

    With fewer than two chunks there are no gaps to speak of: every field is ``None``.
    A gap exactly equal to the threshold is not a stall — to the microsecond: a
    difference of two clock readings carries float noise (``10.3 - 8.3`` is
    ``2.0000000000000018``), so a gap counts only beyond the threshold plus 1 µs.
    """
    if len(chunk_times) < 2:
        return _NONE
    threshold_s = threshold_ms / 1000.0 + _EPSILON_S
    stall_s = 0.0
    count = 0
    previous = chunk_times[0]
    for t in chunk_times[1:]:
        gap = t - previous
        if gap > threshold_s:
            stall_s += gap
            count += 1
        previous = t
    span_s = chunk_times[-1] - chunk_times[0]
    active_s = max(span_s - stall_s, 0.0)
    return StallStats(stall_s * 1000.0, count, active_s * 1000.0)
