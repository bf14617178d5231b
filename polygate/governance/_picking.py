"""Picking order: weight × health, weighted random, failed-in-this-call sources last.

Health is this process's own view (an EWMA of latency and of failures per source); it
does not need to be shared, because it only orders candidates — admission, which must
be shared, is decided by the backend.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence

import attrs

__all__ = ["Health", "HealthStats", "pick_order"]

_ALPHA = 0.2  # EWMA weight of the newest sample: ~ the last 10 outcomes matter


@attrs.frozen
class HealthStats:
    latency_ewma_s: float | None
    failure_ewma: float
    score: float


class Health:
    """EWMA latency (successes only) and failure rate of one source."""

    __slots__ = ("failure", "latency")

    def __init__(self) -> None:
        self.latency: float | None = None
        self.failure = 0.0

    def success(self, latency_s: float) -> None:
        self.failure *= 1 - _ALPHA
        if self.latency is None:
            self.latency = latency_s
        else:
            self.latency += _ALPHA * (latency_s - self.latency)

    def failed(self) -> None:
        self.failure += _ALPHA * (1.0 - self.failure)

    def score(self, reference_latency: float | None) -> float:
        """In (0, 1]: 1 for a source that never failed and is no slower than the
        reference; a floor keeps every source pickable so it can recover."""
        ok = max(0.05, 1.0 - self.failure)
        if self.latency is None or not reference_latency:
            return ok
        return ok * min(1.0, reference_latency / max(self.latency, 1e-6))

    def stats(self, reference_latency: float | None) -> HealthStats:
        return HealthStats(self.latency, self.failure, self.score(reference_latency))


def reference_latency(healths: Collection[Health]) -> float | None:
    samples = [h.latency for h in healths if h.latency is not None]
    return min(samples) if samples else None


def pick_order(
    names: Sequence[str],
    weights: Sequence[float],
    rng: random.Random,
    *,
    exclude: Collection[str] = (),
    demote: Collection[str] = (),
) -> list[str]:
    """A weighted random permutation (Efraimidis–Spirakis keys ``u ** (1 / w)``) of the
    names not excluded; names in ``demote`` come after all others, in the order they
    failed (least recently failed first)."""
    fresh: list[tuple[float, str]] = []
    for name, weight in zip(names, weights, strict=True):
        if name in exclude or name in demote:
            continue
        u = rng.random()
        key = math.log(u) / weight if u > 0 else -math.inf
        fresh.append((key, name))
    fresh.sort(reverse=True)
    order = [name for _, name in fresh]
    order += [name for name in demote if name in names and name not in exclude]
    return order
