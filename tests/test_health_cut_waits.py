"""A source that keeps a call waiting past its deadline, or past a hedge's win, with no
answer at all, loses its share of the picking: the time it made a call wait is a
lower bound of its latency, counted in its latency EWMA (never its breaker, never
its failure rate).  Before, a deadline's cut and a hedge's loss left its health
untouched, and a hung source kept half the calls of a two-source scope for ever."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.governance._picking import Health
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, two_source_settings

HUNG = Reply(first_token_s=10_000)


def _health(stats: Any, name: str) -> Any:
    return next(r.health for r in stats.governance.sources if r.state.source == name)


async def test_a_hung_source_cut_by_the_call_deadline_loses_its_share(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = FakeUpstream(Reply(first_token_s=0.1)), FakeUpstream(HUNG)
    settings = two_source_settings(call_deadline_s=2.0)
    cut = 0
    # (A fixed draw: with chance's, 21 cuts or more came about once in 10,000 runs.)
    async with polygate.session(settings, transport=Router({"a": a, "b": b}), rng=random.Random(0)) as s:
        for _ in range(100):
            try:
                await s.chat(MESSAGES)
            except polygate.DeadlineExceeded:
                cut += 1
        stats = await s.statistics()
    # Before: about half (each pick a coin toss).  After: B's first cut puts its
    # latency at 2 s against A's 0.1 s, a score of 0.05: ~5 % of the picks.
    assert cut <= 20, cut
    hung = _health(stats, "b")
    assert hung.latency_ewma_s is not None and hung.latency_ewma_s >= 1.9
    assert hung.failure_ewma == 0.0  # (the breaker and the failure rate: untouched)
    state = next(r.state for r in stats.governance.sources if r.state.source == "b")
    assert state.consecutive_failures == 0


async def test_a_hung_source_that_loses_every_hedge_loses_its_share(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Hedging saves each call, but a hung source that still gets half the primaries
    makes half the calls wait for the hedge, and spends the hedge budget."""
    a, b = FakeUpstream(Reply(first_token_s=0.1)), FakeUpstream(HUNG)
    hedge = polygate.Hedge(after_s=1.0, budget_burst=1000, budget_ratio=1.0)
    settings = two_source_settings(hedge=hedge, call_deadline_s=30.0)
    # (A fixed draw: with chance's, 21 hedges or more came about once in 7,000 runs.)
    async with polygate.session(settings, transport=Router({"a": a, "b": b}), rng=random.Random(0)) as s:
        results = [await s.chat(MESSAGES) for _ in range(100)]
        stats = await s.statistics()
    assert all(r.source == "a" for r in results)
    hedged = sum(r.call_stats.hedges for r in results)
    assert hedged <= 20, hedged  # (before: ~50)
    assert _health(stats, "b").failure_ewma == 0.0


async def test_a_caller_that_leaves_says_nothing_of_the_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """External cancellation (the caller's own timeout, a client gone) is the
    caller's doing: no sample, however long the source had been waiting."""
    a, b = FakeUpstream(Reply(first_token_s=0.1)), FakeUpstream(HUNG)
    async with polygate.session(two_source_settings(), transport=Router({"a": a, "b": b})) as s:
        for _ in range(30):
            with trio.move_on_after(5):
                await s.chat(MESSAGES)
        stats = await s.statistics()
    assert a.requests and b.requests
    assert _health(stats, "b").latency_ewma_s is None


async def test_a_stream_cut_after_its_first_token_is_no_sample(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A source that is generating when the deadline cuts it answered: a long answer
    is not a hung source."""
    slow_writer = Reply(first_token_s=0.1, tokens=500, inter_token_s=0.1)
    a = FakeUpstream(slow_writer)
    settings = two_source_settings(names=("a",), call_deadline_s=5.0)
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES)
        stats = await s.statistics()
    assert _health(stats, "a").latency_ewma_s is None


def test_a_wait_counts_only_above_what_is_known() -> None:
    h = Health()
    h.waited(5.0, None)  # nothing known in the scope: no sample
    assert h.latency is None
    h.waited(0.05, 0.1)  # shorter than the best source's latency: says nothing
    assert h.latency is None
    h.waited(2.0, 0.1)  # longer: a first sample, as a success's would be
    assert h.latency == 2.0
    h.waited(1.0, 0.1)  # below its own latency: says nothing
    assert h.latency == 2.0
    h.waited(4.0, 0.1)
    assert h.latency == pytest.approx(2.4)
    h.success(0.1)  # an answer pulls it back as before
    assert h.latency == pytest.approx(2.4 + 0.2 * (0.1 - 2.4))
    assert h.failure(0.0) == 0.0
