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
# Failures are forgotten with time too, not only by later successes: a source that was
# failing gets few requests, so without this its score would stay at the floor long
# after it recovered (and its breaker would rarely be probed).
_FAILURE_HALF_LIFE_S = 10.0
# A latency is forgotten with time as well, for the same reason: a source that was slow
# gets few requests, so one slow answer (a cold start, a long queue that has since
# drained) would otherwise keep it near the floor of the scope's traffic for as long as
# the scope lives.  The older the latency, the less it weighs: in the score (its factor
# fades toward 1) and against the next sample (which then counts for more).  Not a
# latency learnt from waits cut before any answer (a hung source): each cost a caller
# its call, and faded, a hung source in a quiet scope (a call a minute) was back to
# half the calls, 44-48 of 100 cut by their deadline against 5-7.
_LATENCY_HALF_LIFE_S = 30.0


@attrs.frozen
class HealthStats:
    latency_ewma_s: float | None
    failure_ewma: float
    score: float


class Health:
    """EWMA latency (successes, and waits cut before any answer as lower bounds: see
    :meth:`waited`) and failure rate of one source; the failure rate halves every
    ``_FAILURE_HALF_LIFE_S`` seconds without news, and a latency's weight every
    ``_LATENCY_HALF_LIFE_S``."""

    __slots__ = ("_failure", "_failure_at", "_latency_at", "_waited", "latency")

    def __init__(self) -> None:
        self.latency: float | None = None
        self._latency_at = 0.0
        #: The latency's last news was a wait cut before any answer (see waited()).
        self._waited = False
        self._failure = 0.0
        self._failure_at = 0.0

    def _latency_weight(self, now: float) -> float:
        """What the latency known now still weighs: 1 when it is fresh, halving every
        ``_LATENCY_HALF_LIFE_S`` without news."""
        return math.pow(2.0, -max(now - self._latency_at, 0.0) / _LATENCY_HALF_LIFE_S)

    def _sample(self, latency_s: float, now: float) -> None:
        if self.latency is None:
            self.latency = latency_s
        else:
            # An EWMA over irregular times: the newest sample weighs _ALPHA against a
            # fresh latency, and more against an old one.
            alpha = 1.0 - (1.0 - _ALPHA) * self._latency_weight(now)
            self.latency += alpha * (latency_s - self.latency)
        self._latency_at = now

    def failure(self, now: float) -> float:
        if self._failure == 0.0:
            return 0.0
        elapsed = max(now - self._failure_at, 0.0)
        return self._failure * math.pow(2.0, -elapsed / _FAILURE_HALF_LIFE_S)

    def _set_failure(self, value: float, now: float) -> None:
        self._failure = value if value > 1e-6 else 0.0
        self._failure_at = now

    def success(self, latency_s: float, now: float = 0.0) -> None:
        self._set_failure(self.failure(now) * (1 - _ALPHA), now)
        self._sample(latency_s, now)
        self._waited = False

    def waited(self, waited_s: float, reference_latency: float | None, now: float = 0.0) -> None:
        """An attempt cut before any answer, after ``waited_s`` (by the call's deadline,
        or by a hedge that won): its latency would have been longer, so the wait is a
        lower bound, counted like a success's latency where it says more than is known:
        above this source's own latency, or, with none yet, above the scope's best.
        Never a failure: the breaker and the failure rate are the upstream errors'.
        Its own latency as the score sees it now: faded with age, a source slow once
        (a 60 s cold start) and hung since was cut by 30 s deadlines that taught
        nothing, back at a score of 1 and half the calls."""
        known = self._seen(reference_latency, now) if self.latency is not None else reference_latency
        if known is None or waited_s <= known:
            return  # a cut sooner than answers come says nothing of this source
        if self.latency is None or waited_s > self.latency:
            self._sample(waited_s, now)
        else:
            # Above the latency as it faded, below it as it was learnt: that latency,
            # confirmed now.
            self._latency_at = now
        self._waited = True

    def _seen(self, reference_latency: float | None, now: float) -> float | None:
        """The latency as :meth:`score` sees it now: faded toward the reference with age
        (a latency from waits, or one no slower than the reference, as it is)."""
        latency = self.latency
        if latency is None or not reference_latency or latency <= reference_latency or self._waited:
            return latency
        return reference_latency * math.pow(latency / reference_latency, self._latency_weight(now))

    def failed(self, now: float = 0.0) -> None:
        failure = self.failure(now)
        self._set_failure(failure + _ALPHA * (1.0 - failure), now)

    def recovered(self, now: float) -> None:
        """Its breaker's probe succeeded: the failures are history."""
        self._set_failure(0.0, now)

    def score(self, reference_latency: float | None, now: float = 0.0) -> float:
        """In (0, 1]: 1 for a source that never failed and is no slower than the
        reference; a floor, and latencies that fade, keep every source pickable so it
        can recover."""
        ok = max(0.05, 1.0 - self.failure(now))
        if self.latency is None or not reference_latency:
            return ok
        factor = reference_latency / max(self.latency, 1e-6)
        if factor >= 1.0:
            return ok
        return ok * (factor if self._waited else math.pow(factor, self._latency_weight(now)))

    def stats(self, reference_latency: float | None, now: float = 0.0) -> HealthStats:
        return HealthStats(self.latency, self.failure(now), self.score(reference_latency, now))


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
    first: Collection[str] = (),
) -> list[str]:
    """A weighted random permutation (Efraimidis–Spirakis keys ``u ** (1 / w)``) of the
    names not excluded; names in ``first`` (breakers due for a probe) lead, names in
    ``demote`` come after all others, in the order they failed (least recently failed
    first)."""
    fresh: list[tuple[float, str]] = []
    for name, weight in zip(names, weights, strict=True):
        if name in exclude or name in demote:
            continue
        u = rng.random()
        # The key log(u) / w, in log space: log(-log u) - log w, smallest first.  As a
        # quotient it overflowed to -inf for any weight under ~1e-306 (a Source.weight
        # may be any positive number), and equal tiny weights then came first by name,
        # never by chance.  A weight that underflowed to 0 (a subnormal weight times a
        # low score) sorts last.
        key = math.log(-math.log(u)) - math.log(weight) if u > 0 and weight > 0 else math.inf
        fresh.append((key, name))
    fresh.sort()
    order = [name for _, name in fresh if name in first]
    order += [name for _, name in fresh if name not in first]
    order += [name for name in demote if name in names and name not in exclude]
    return order
