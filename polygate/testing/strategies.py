"""Hypothesis strategies for scheduling-aware tests of code that uses polygate.

Needs ``hypothesis`` (in polygate's ``test`` extra); ``polygate.testing`` itself does
not import it.  The strategies are shaped to find ordering bugs rather than to cover
the value space evenly:

* times are drawn from a **grid** (:func:`instants`), so independent events often
  fall on the *same* instant — the case where two paths become runnable in one
  scheduler batch — and sums of grid times are exact decimals such as ``0.3 + 60``
  (a float boundary that exact-looking window arithmetic gets wrong);
* :func:`schedules` draws the seed of trio's batch order, so every example also
  runs a different, reproducible interleaving (see :class:`~polygate.testing.Schedule`);
* :func:`replies` covers the wire's failure modes — 429 with ``Retry-After: 0``,
  5xx, 401/400, error events, truncation, resets, malformed JSON, silent hangs —
  and answers whose whole tail arrives at once (``inter_token_s=0``);
* :func:`cancellations` draws points of external cancellation on the same grid.

Example::

    from hypothesis import given
    from polygate.testing import EventTransport, FakeUpstream, Schedule
    from polygate.testing import strategies as pst

    @given(reply=pst.replies(), schedule=pst.schedules())
    def test_my_client(reply, schedule):
        schedule.run(my_scenario, EventTransport(FakeUpstream(reply)))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import strategies as st

from .._config import Hedge
from ._schedule import Schedule
from ._script import Reply

__all__ = ["cancellations", "hedges", "instants", "replies", "schedules"]

#: Durations worth hitting exactly: a 60-second attempt ends on a window boundary.
LONG: tuple[float, ...] = (30.0, 60.0, 90.0)


def schedules() -> st.SearchStrategy[Schedule]:
    """Seeds of trio's batch order (shrinks towards seed 0)."""
    return st.builds(Schedule, st.integers(0, 2**32 - 1))


def instants(
    *, most: float = 10.0, per_second: int = 10, extra: Sequence[float] = ()
) -> st.SearchStrategy[float]:
    """Times on a grid: ``k / per_second`` for ``0 <= k / per_second <= most``, or
    one of ``extra``.  Division (not ``k * step``) gives the double nearest each
    decimal, as a human-written ``0.3`` is."""
    if per_second < 1 or most < 0:
        raise ValueError("instants: need per_second >= 1 and most >= 0")
    # (Rounded before the floor: 0.57 * 100 is 56.99999999999999, and 0.57 is on the
    # grid; then back one step if the rounding went past ``most``.)
    last = math.floor(round(most * per_second, 9))
    if last / per_second > most:
        last -= 1
    grid = st.integers(0, last).map(lambda k: k / per_second)
    return st.one_of(grid, st.sampled_from(tuple(extra))) if extra else grid


def cancellations(
    times: st.SearchStrategy[float] | None = None,
) -> st.SearchStrategy[float | None]:
    """``None`` (never cancelled) or a delay after which the caller cancels."""
    return st.one_of(st.none(), times if times is not None else instants(most=12.0))


_STATUSES = (200, 200, 200, 200, 200, 429, 429, 500, 503, 401, 400)
_FAULTS = (None, None, None, None, "reset", "truncated", "malformed_json", "error_event", "silent")
# Built once: constructing strategies inside every draw costs more than the draw.
_RETRY_AFTER = st.sampled_from((None, 0.0, 0.0, 0.5, 3.0))
_RETRY_AFTER_MS = st.sampled_from((None, None, 0.0))
_HEAD_429 = st.sampled_from((0.0, 0.0, 0.1, 1.0))
_HEAD = st.sampled_from((0.0, 0.0, 0.0, 0.1))
_INTER = st.sampled_from((0.0, 0.0, 0.1, 0.5))
_STALL = st.sampled_from((0.0, 3.0, 7.0))
_STREAM = st.sampled_from((None, None, None, False))


def replies(
    *,
    times: st.SearchStrategy[float] | None = None,
    statuses: Sequence[int] = _STATUSES,
    faults: Sequence[str | None] = _FAULTS,
    max_tokens: int = 5,
) -> st.SearchStrategy[Reply]:
    """Scripted replies: mostly complete answers, some failures and faults.

    ``times`` draws first-token delays (default: :func:`instants` up to 10 s plus
    :data:`LONG`); ``statuses`` and ``faults`` are sampled (repeat a value to
    weight it; ``None`` is no fault).  A 429 carries ``Retry-After`` 0, 0.5 or 3 s,
    ``retry-after-ms: 0`` or nothing.  ``inter_token_s=0`` (common) sends the whole
    tail with the first token; ``stream=False`` answers a stream request with plain
    JSON, as an upstream that cannot stream does."""
    first = times if times is not None else instants(extra=LONG)
    status_of = st.sampled_from(tuple(statuses))
    fault_of = st.sampled_from(tuple(faults))
    count = st.integers(0, max_tokens)
    position = st.none() | st.integers(1, max(1, max_tokens))
    after = st.integers(0, max_tokens)

    @st.composite
    def reply(draw: st.DrawFn) -> Reply:
        status = draw(status_of)
        if status == 429:
            # Retry-After 0 is what real gateways send when they mean "now".
            retry_after = draw(_RETRY_AFTER)
            ms = draw(_RETRY_AFTER_MS) if retry_after is None else None
            return Reply(status=429, retry_after_s=retry_after, retry_after_ms=ms,
                         headers_delay_s=draw(_HEAD_429))
        if status != 200:
            return Reply(status=status, headers_delay_s=draw(first))
        fault = draw(fault_of)
        tokens = draw(count)
        stall_at = draw(position)
        return Reply(
            headers_delay_s=draw(_HEAD),
            first_token_s=draw(first),
            inter_token_s=draw(_INTER),
            tokens=tokens,
            stall_at=None if stall_at is None else min(stall_at, max(1, tokens)),
            stall_s=draw(_STALL),
            fault=fault,  # type: ignore[arg-type]
            fault_after=min(draw(after), tokens),
            stream=draw(_STREAM),
        )

    return reply()


def hedges(
    *, after: st.SearchStrategy[float] | None = None, burst: Sequence[float] = (1, 2, 5)
) -> st.SearchStrategy[Hedge]:
    """Hedging configurations: off, a fixed ``after_s`` (with staged extras and a
    stall trigger sometimes), or a learnt quantile clamped to ``min_after_s``."""
    if after is None:
        after = instants(most=4.0, per_second=2).filter(lambda t: t > 0)
    fixed = st.builds(
        Hedge,
        after_s=after,
        max_extra=st.integers(1, 2),
        stall_after_s=st.sampled_from((None, None, 3.0)),
        budget_burst=st.sampled_from(tuple(burst)),
        budget_ratio=st.sampled_from((0.1, 1.0)),
    )
    learnt = st.builds(
        Hedge,
        after_s=after,
        after_quantile=st.just(0.9),
        min_after_s=st.sampled_from((None, 0.5)),
        max_after_s=st.just(5.0),
        budget_burst=st.sampled_from(tuple(burst)),
    )
    return st.one_of(st.just(Hedge()), fixed, fixed, learnt)
