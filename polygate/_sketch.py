"""Per-source latency quantiles for adaptive hedge thresholds.

DDSketch (relative-error quantiles, ~0.5 µs an insert here) does the counting.  A
single sketch never forgets, but a hedge threshold must follow the source as it is
*now*, so two sketches rotate: quantiles come from the current one merged with the
previous one, and every ``rotate_every`` samples the previous one is dropped.  The
answer therefore reflects the last ``rotate_every``–``2 × rotate_every`` samples.

Censoring: a path cancelled before its first token never reports one, so the slowest
observations are missing and the learned quantile leans low; the ``min_after_s`` clamp
bounds how eagerly that can hedge.
"""

from __future__ import annotations

from ddsketch import DDSketch

__all__ = ["LatencySketch"]

_ACCURACY = 0.01
#: DDSketch answers a bucket's middle (``2γ^i / (γ + 1)``), up to 1 % under a sample in
#: it; a hedge threshold takes the bucket's top (``γ^i``), so that a call exactly as
#: slow as the quantile is not "slower than it" (a source answering at a constant 1.0 s
#: was hedged at 0.99 s on every call).  Plus a hair for the float arithmetic.
_TO_TOP = (1 + (1 + _ACCURACY) / (1 - _ACCURACY)) / 2 * (1 + 1e-9)


class LatencySketch:
    def __init__(self, *, rotate_every: int = 500, min_samples: int = 20) -> None:
        self._current = DDSketch(relative_accuracy=_ACCURACY)
        self._previous: DDSketch | None = None
        self._in_current = 0
        self._rotate_every = rotate_every
        self.min_samples = min_samples
        self._cache: dict[float, float] = {}

    @property
    def count(self) -> int:
        previous = int(self._previous.count) if self._previous is not None else 0
        return self._in_current + previous

    def add(self, seconds: float) -> None:
        if seconds < 0:
            return
        if self._in_current >= self._rotate_every:
            self._previous = self._current
            self._current = DDSketch(relative_accuracy=_ACCURACY)
            self._in_current = 0
        self._current.add(max(seconds, 1e-6))
        self._in_current += 1
        self._cache.clear()

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile in seconds, or ``None`` with fewer than ``min_samples``."""
        if self.count < self.min_samples:
            return None
        cached = self._cache.get(q)
        if cached is not None:
            return cached
        sketch = self._current
        if self._previous is not None:
            sketch = DDSketch(relative_accuracy=_ACCURACY)
            sketch.merge(self._current)
            sketch.merge(self._previous)
        value = sketch.get_quantile_value(q)
        result = float(value) * _TO_TOP if value is not None else None
        if result is not None:
            self._cache[q] = result
        return result
