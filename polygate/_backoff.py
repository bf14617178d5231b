"""Backoff policy: exponential with full jitter (AWS architecture blog's "Full Jitter")."""

from __future__ import annotations

import random

__all__ = ["full_jitter"]


def full_jitter(failures: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Seconds to sleep before the next attempt after ``failures`` consecutive failures:
    uniform in ``[0, min(cap, base * 2**(failures - 1))]``; 0 before the first failure."""
    if failures <= 0 or base_s <= 0:
        return 0.0
    ceiling = min(cap_s, base_s * (2.0 ** min(failures - 1, 62)))
    return rng.uniform(0.0, ceiling)
