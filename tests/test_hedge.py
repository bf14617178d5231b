"""Hedged requests: the acceptance matrix of seed 002 (①–⑩) and the mid-stream cases of
seed 004, each under MockClock through the fake transport with exact virtual times."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.governance import MemoryBackend
from polygate.testing import EventTransport, FakeUpstream, Reply, Router, Schedule

from .conftest import FIRST_A, MESSAGES, SECRET, two_source_settings


def _settings(
    *,
    names: tuple[str, ...] = ("a", "b"),
    hedge: polygate.Hedge | None = None,
    source_kw: dict[str, dict[str, object]] | None = None,
    **scope: object,
) -> polygate.Settings:
    kw = source_kw or {}
    sources = [
        polygate.Source(
            name=n, base_url=f"http://{n}/v1", api_key=SECRET,
            **{"weight": FIRST_A.get(n, 1.0), **kw.get(n, {})},  # type: ignore[arg-type]
        )
        for n in names
    ]
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=sources, hedge=hedge or polygate.Hedge(after_s=8), **scope)})  # type: ignore[arg-type]


def _source(stats: polygate.SessionStatistics, name: str) -> polygate.governance.SourceSnapshot:  # type: ignore[name-defined]
    return next(s.state for s in stats.governance.sources if s.state.source == name)


# ① triggers ---------------------------------------------------------------------------


async def test_missing_first_token_triggers_a_hedge(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=20, tokens=4))
    b = FakeUpstream(Reply(first_token_s=1, inter_token_s=0.5, tokens=4))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
        stats = await s.statistics()
    st = r.call_stats
    assert (r.source, st.attempts, st.hedges, st.hedge_won) == ("b", 2, 1, True)
    assert b.requests[0].started_at == pytest.approx(8)
    # ⑩ the winner's transport time only: sent at 8, first token at 9, last at 10.5
    assert st.generation_ms == pytest.approx(2500)
    assert st.ttft_ms == pytest.approx(1000)
    assert st.total_latency_ms == pytest.approx(10_500)
    # ⑤ the loser was cancelled and is accounted before the call returned
    assert a.requests[0].outcome == "client_closed"
    assert a.in_flight == b.in_flight == 0
    assert _source(stats, "a").in_flight == 0 and _source(stats, "a").tokens_reserved == 0


async def test_first_token_in_time_means_no_hedge(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=7.9, inter_token_s=1, tokens=30))
    b = FakeUpstream(Reply())
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert (r.source, r.call_stats.attempts, r.call_stats.hedges) == ("a", 1, 0)
    assert b.requests == []  # a long healthy generation is never hedged


async def test_keepalives_do_not_reset_the_trigger(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=30, keepalive_s=0.5))
    b = FakeUpstream(Reply(first_token_s=1))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.hedge_won
    assert b.requests[0].started_at == pytest.approx(8)


async def test_non_streaming_source_uses_the_whole_call_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=20))
    b = FakeUpstream(Reply(first_token_s=2))
    settings = _settings(source_kw={"a": {"streaming": False}, "b": {"streaming": False}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.hedge_won and r.source == "b"
    assert b.requests[0].started_at == pytest.approx(8)
    assert r.call_stats.total_latency_ms == pytest.approx(10_000)
    assert r.call_stats.ttft_ms is None


async def test_primary_finishing_first_after_the_trigger_wins(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=9, tokens=2))
    b = FakeUpstream(Reply(first_token_s=5, tokens=2))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    st = r.call_stats
    assert (r.source, st.attempts, st.hedges, st.hedge_won) == ("a", 2, 1, False)
    assert st.generation_ms == pytest.approx(9000)  # ⑩ the primary's own transport time
    assert st.total_latency_ms == pytest.approx(9000)
    assert b.requests[0].outcome == "client_closed"


# ② target ------------------------------------------------------------------------------


async def test_hedge_never_goes_to_a_source_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    """a is hung and weighs a billion times b: picked by weight alone, the hedge would
    go to a again; it goes to b, the one source not in flight."""
    a = FakeUpstream(Reply(first_token_s=20))
    b = FakeUpstream(Reply(first_token_s=1))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert (r.source, r.call_stats.attempts, r.call_stats.hedges, r.call_stats.hedge_won) == (
        "b", 2, 1, True)
    assert (len(a.requests), len(b.requests)) == (1, 1)


async def test_a_single_source_scope_never_hedges_to_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=20))
    with pytest.warns(polygate.ConfigWarning, match="single source"):
        settings = _settings(names=("a",))
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        r = await s.chat(MESSAGES)
    assert (r.call_stats.attempts, r.call_stats.hedges) == (1, 0)
    assert len(a.requests) == 1


@pytest.mark.parametrize("kind", ["router", "events"])
@pytest.mark.parametrize("seed", range(12))
def test_a_hedge_triggered_in_the_instant_the_primary_answers_is_not_sent(kind: str, seed: int) -> None:
    """The trigger (after_s = 8) and the primary's whole answer (at 8) fall in one
    instant.  The primary wins in that batch, in every order of trio's scheduler
    batches (each seed one order): nothing reaches b, and ``hedges`` -- hedge
    attempts actually sent (SPEC §5) -- is 0.  Before, the hedge was counted whatever
    happened, and through a transport that records a request on hand-over (Router) it
    even went out after the round was decided.  (The monitor's checkpoint lets the
    answer win first, so no hedge is launched here at all: a hedge launched and cut
    unsent by the win is the next test but one.)"""
    a = FakeUpstream(Reply(first_token_s=8, tokens=1))
    b = FakeUpstream(Reply(first_token_s=1, tokens=1))
    routes = {"a": a, "b": b}
    transport = Router(routes) if kind == "router" else EventTransport(routes)

    async def call() -> polygate.ChatResponse:
        async with polygate.session(_settings(), transport=transport) as s:
            return await s.chat(MESSAGES)

    r = Schedule(seed).run(call)
    assert r.source == "a" and not r.call_stats.hedge_won
    assert r.call_stats.hedges == len(b.requests) == 0


@pytest.mark.parametrize("kind", ["router", "events"])
@pytest.mark.parametrize("seed", range(4))
def test_a_hedge_that_was_never_sent_gives_its_budget_token_back(kind: str, seed: int) -> None:
    """The budget caps the hedges that reach an upstream: the first call's hedge
    trigger falls in the instant its primary answered, and no token is spent on it,
    so with a budget of one token and no refill the next call still hedges."""
    a = FakeUpstream([Reply(first_token_s=8, tokens=1), Reply(first_token_s=20, tokens=1)])
    b = FakeUpstream(Reply(first_token_s=1, tokens=1))
    routes = {"a": a, "b": b}
    transport = Router(routes) if kind == "router" else EventTransport(routes)
    settings = _settings(hedge=polygate.Hedge(after_s=8, budget_burst=1, budget_ratio=0))

    async def calls() -> tuple[polygate.ChatResponse, polygate.ChatResponse]:
        async with polygate.session(settings, transport=transport) as s:
            return await s.chat(MESSAGES), await s.chat(MESSAGES)

    first, second = Schedule(seed).run(calls)
    assert (first.source, first.call_stats.hedges) == ("a", 0)
    assert (second.source, second.call_stats.hedges, second.call_stats.hedge_won) == ("b", 1, True)
    assert len(b.requests) == 1


class _SlowToConnect(httpx.AsyncBaseTransport):
    """Says itself when it writes (REPORTS_SENT); host b takes 100 s to "connect"
    first, so a hedge to b waits there with nothing written."""

    polygate_reports_sent = True

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "b":
            await trio.sleep(100)
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize("end", ["deadline", "caller"])
async def test_a_hedge_cut_with_its_call_before_it_was_sent_gives_its_token_back(
    end: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The call ends (its deadline, its caller's cancel scope) while its hedge still
    waits for a connection: the hedge was never sent, so its token goes back on the
    way out too."""
    a = FakeUpstream(Reply(first_token_s=50, tokens=1))
    b = FakeUpstream(Reply(first_token_s=1, tokens=1))
    settings = _settings(hedge=polygate.Hedge(after_s=1, budget_burst=1, budget_ratio=0),
                         call_deadline_s=5 if end == "deadline" else None)
    async with polygate.session(settings, transport=_SlowToConnect(Router({"a": a, "b": b}))) as s:
        if end == "deadline":
            with pytest.raises(polygate.DeadlineExceeded) as caught:
                await s.chat(MESSAGES)
            assert caught.value.call_stats.hedges == 0 and caught.value.call_stats.attempts == 2
        else:
            with trio.move_on_after(5):
                await s.chat(MESSAGES)
        budget = (await s.statistics()).governance.hedge_budget
    assert b.requests == [] and budget == {"chat": pytest.approx(1)}


async def test_a_hedge_cut_unsent_by_the_primarys_win_is_not_counted_and_gives_its_token_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The hedge is launched at 1 s (its token taken) and waits for a connection to
    b; the primary answers at 3 s.  The hedge is cut with nothing written: ``hedges``
    (hedges sent) is 0, its attempt is counted, and its token goes back: a budget of
    one token with no refill is whole again."""
    a = FakeUpstream(Reply(first_token_s=3, tokens=1))
    b = FakeUpstream(Reply(first_token_s=1, tokens=1))
    settings = _settings(hedge=polygate.Hedge(after_s=1, budget_burst=1, budget_ratio=0))
    async with polygate.session(settings, transport=_SlowToConnect(Router({"a": a, "b": b}))) as s:
        first = await s.chat(MESSAGES)
        budget = (await s.statistics()).governance.hedge_budget
    assert (first.source, first.call_stats.attempts, first.call_stats.hedges) == ("a", 2, 0)
    assert b.requests == []
    assert budget == {"chat": pytest.approx(1)}


async def test_no_candidate_is_silent(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream([Reply(status=401), Reply(first_token_s=20)])
    b = FakeUpstream(Reply(first_token_s=20))
    settings = _settings(source_kw={"b": {"weight": 1.0}, "a": {"weight": 1e-9}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        # a dies on its first call (one request), then is cooling down: no candidate
        r0 = await s.chat(MESSAGES, call_deadline_s=30)
        assert len(a.requests) <= 1
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        assert trio.current_time() - start == pytest.approx(20)
    assert r.source == "b" and r.call_stats.hedges == 0 and r.call_stats.attempts == 1
    assert r0.source == "b"


# ③ admission refused -------------------------------------------------------------------


@pytest.mark.parametrize("limit", [{"max_in_flight": 1}, {"rpm": 1}])
async def test_refused_admission_is_silent(
    limit: dict[str, int], autojump_clock: trio.testing.MockClock
) -> None:
    # The first call fails on a and moves to b, which then holds b's only permit (it
    # hangs) or b's only request of the minute.  The second call's hedge is refused.
    a = FakeUpstream([Reply(status=500), Reply(first_token_s=20)])
    b = FakeUpstream(Reply(first_token_s=100))
    settings = _settings(source_kw={"b": limit})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.chat, MESSAGES)
            await trio.sleep(1)
            assert len(b.requests) == 1
            start = trio.current_time()
            r = await s.chat(MESSAGES)
            assert trio.current_time() - start == pytest.approx(20)  # the primary went on
            nursery.cancel_scope.cancel()
    assert r.source == "a" and r.call_stats.hedges == 0 and r.call_stats.attempts == 1
    assert len(b.requests) == 1


async def test_open_breaker_refuses_the_hedge(autojump_clock: trio.testing.MockClock) -> None:
    # a answers at 12 s: the hedge tries b at 8 s, while b's breaker is open (30 s, at
    # least 15 s with the jitter), and the call ends before the next look at 16 s.
    a = FakeUpstream(Reply(first_token_s=12))
    b = FakeUpstream(Reply(status=500))
    settings = _settings(source_kw={"a": {"weight": 1e-9}, "b": {"weight": 1.0}},
                         retry=polygate.Retry(max_attempts=1),
                         breaker=polygate.Breaker(open_s=30, max_open_s=30))  # past the 8 s trigger
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        for _ in range(5):  # five consecutive failures open b's breaker
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
        assert _source(await s.statistics(), "b").breaker.value == "open"
        r = await s.chat(MESSAGES)
    assert r.source == "a" and r.call_stats.hedges == 0 and len(b.requests) == 5


# ④ accounting -------------------------------------------------------------------------


async def test_winner_settles_usage_loser_keeps_estimate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=20, tokens=4))
    b = FakeUpstream(Reply(first_token_s=1, tokens=4))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES, max_tokens=50)
        stats = await s.statistics()
    sa, sb = _source(stats, "a"), _source(stats, "b")
    assert r.usage is not None and r.usage.source == "upstream"
    assert sb.tokens_in_window == r.usage.total_tokens  # real usage
    assert sa.tokens_in_window == sa.reserved_total  # the estimate, kept
    assert sa.reserved_total == sb.reserved_total  # same call, same estimate
    for src in (sa, sb):
        assert src.reserved_total == src.settled_total + src.released_total + src.tokens_reserved
        assert src.in_flight == 0
    # losers feed neither the breaker nor the failure count
    assert sa.breaker.value == "closed" and sa.consecutive_failures == 0


# ⑦ external cancellation ⑧ deadline ---------------------------------------------------


async def test_external_cancellation_cancels_every_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=100))
    b = FakeUpstream(Reply(first_token_s=100))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        with trio.move_on_after(12) as scope:
            await s.chat(MESSAGES)
        assert scope.cancelled_caught
        assert trio.current_time() == pytest.approx(12)
        stats = await s.statistics()
    assert [r.outcome for r in a.requests + b.requests] == ["client_closed", "client_closed"]
    for name in ("a", "b"):
        src = _source(stats, name)
        assert src.in_flight == 0 and src.tokens_reserved == 0 and src.consecutive_failures == 0


async def test_deadline_cuts_the_hedged_tree(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=100))
    b = FakeUpstream(Reply(first_token_s=100))
    async with polygate.session(_settings(call_deadline_s=15), transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await s.chat(MESSAGES)
        assert trio.current_time() == pytest.approx(15)
    assert info.value.call_stats is not None
    assert (info.value.call_stats.attempts, info.value.call_stats.hedges) == (2, 1)
    assert a.in_flight == b.in_flight == 0


# failure merging ----------------------------------------------------------------------


async def test_both_paths_failing_count_once(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream([Reply(status=500, headers_delay_s=10), Reply()])
    b = FakeUpstream([Reply(status=500), Reply()])
    settings = _settings(retry=polygate.Retry(max_attempts=2, backoff_base_s=0))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    # round 1: a (fails at 10) + hedge b (fails at 8) = one attempt of the budget; round 2 wins
    assert r.call_stats.attempts == 3 and r.call_stats.hedges == 1
    assert not r.call_stats.hedge_won


async def test_a_failing_hedge_does_not_end_the_round(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=12))
    b = FakeUpstream(Reply(status=503))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "a" and r.call_stats.total_latency_ms == pytest.approx(12_000)
    assert (r.call_stats.attempts, r.call_stats.hedges) == (2, 1)


async def test_a_fatal_hedge_ends_the_round_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """Review finding: a 400 (the request is wrong) from the hedge at 8 s waited for the
    primary, here until its own 400 at 30 s.  SPEC §3: a fatal error is raised at once;
    the primary is cancelled as a loser, and settled before the statistics freeze."""
    a = FakeUpstream(Reply(status=400, headers_delay_s=30))
    b = FakeUpstream(Reply(status=400))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.chat(MESSAGES)
        assert trio.current_time() == pytest.approx(8)
        stats = await s.statistics()
    assert info.value.source == "b"
    assert (info.value.call_stats.attempts, info.value.call_stats.hedges) == (2, 1)
    assert a.requests[0].outcome == "client_closed"
    assert _source(stats, "a").in_flight == 0 and _source(stats, "a").tokens_reserved == 0


async def test_a_fatal_primary_ends_the_round_at_once(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=422, headers_delay_s=10))
    b = FakeUpstream(Reply(first_token_s=5))  # would answer at 13
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.chat(MESSAGES)
        assert trio.current_time() == pytest.approx(10)
    assert info.value.source == "a" and b.requests[0].outcome == "client_closed"


@pytest.mark.parametrize("seed", range(8))
def test_a_first_token_exactly_at_the_threshold_is_not_late(seed: int) -> None:
    """Review finding: the first token and the trigger in one instant sent a hedge in
    about half of trio's batch orders (a request to b, a budget token, hedges == 1).
    The monitor now lets the paths woken in that instant run first."""
    a = FakeUpstream(Reply(first_token_s=8, inter_token_s=1, tokens=3))
    b = FakeUpstream(Reply(first_token_s=5, tokens=1))

    async def call() -> polygate.ChatResponse:
        async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
            return await s.chat(MESSAGES)

    r = Schedule(seed).run(call)
    assert (r.source, r.call_stats.attempts, r.call_stats.hedges) == ("a", 1, 0)
    assert not b.requests


@pytest.mark.parametrize("seed", range(8))
def test_a_failure_exactly_at_the_threshold_ends_the_round(seed: int) -> None:
    """The same instant with a failing primary and one attempt allowed: the call
    ended as AllSourcesExhausted or as b's answer by batch order alone."""
    a = FakeUpstream(Reply(status=500, headers_delay_s=8))
    b = FakeUpstream(Reply(first_token_s=1, tokens=1))

    async def call() -> polygate.AllSourcesExhausted:
        settings = _settings(retry=polygate.Retry(max_attempts=1))
        async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
            return info.value

    error = Schedule(seed).run(call)
    assert (error.call_stats.attempts, error.call_stats.hedges) == (1, 0)
    assert not b.requests


# mid-stream (seed 004) ----------------------------------------------------------------


async def test_mid_stream_stall_hedges_chat(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=1.6, tokens=20, stall_at=5, stall_s=55))
    b = FakeUpstream(Reply(first_token_s=1, tokens=20))
    settings = _settings(hedge=polygate.Hedge(after_s=8, stall_after_s=5))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.hedge_won
    assert b.requests[0].started_at == pytest.approx(1.6 + 5)
    assert r.call_stats.total_latency_ms == pytest.approx((1.6 + 5 + 1) * 1000)


async def test_stream_chat_commits_to_the_first_content(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text="late primary", first_token_s=30))
    b = FakeUpstream(Reply(text="hedge answer here", first_token_s=1, inter_token_s=0.5))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            text = "".join([chunk.text async for chunk in stream])
    assert text == "hedge answer here"
    assert stream.response is not None
    st = stream.response.call_stats
    assert st.hedge_won and st.attempts == 2
    assert st.total_latency_ms == pytest.approx(8000 + 1000 + 1000)
    assert a.requests[0].outcome == "client_closed"


# ⑥ staged extras, budget ---------------------------------------------------------------


async def test_staged_extras(autojump_clock: trio.testing.MockClock) -> None:
    ups = {n: FakeUpstream(Reply(first_token_s=t)) for n, t in (("a", 100), ("b", 100), ("c", 3))}
    settings = _settings(names=("a", "b", "c"), hedge=polygate.Hedge(after_s=8, max_extra=2),
                         source_kw={"b": {"weight": 1e-9}, "c": {"weight": 1e-18}})
    async with polygate.session(settings, transport=Router(ups)) as s:
        r = await s.chat(MESSAGES)
    st = r.call_stats
    assert (st.attempts, st.hedges, r.source) == (3, 2, "c")
    assert ups["b"].requests[0].started_at == pytest.approx(8)
    assert ups["c"].requests[0].started_at == pytest.approx(16)
    assert st.total_latency_ms == pytest.approx(19_000)


async def test_budget_suppresses_hedges(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=10))
    b = FakeUpstream(Reply(first_token_s=10))
    hedge = polygate.Hedge(after_s=8, budget_burst=2, budget_ratio=0.1)
    async with polygate.session(_settings(hedge=hedge), transport=Router({"a": a, "b": b})) as s:
        results = [await s.chat(MESSAGES) for _ in range(10)]
        stats = await s.statistics()
    hedged = [r.call_stats.hedges for r in results]
    # 2 tokens at start; every call adds 0.1 when it ends: the third hedge needs 10 more
    assert hedged == [1, 1] + [0] * 8
    assert stats.governance.hedges_suppressed_by_budget["chat"] == 8
    assert stats.governance.hedge_budget["chat"] == pytest.approx(1.0)


async def test_ten_refills_of_a_tenth_are_a_token(autojump_clock: trio.testing.MockClock) -> None:
    """Review finding: 0.1 added ten times is 0.9999999999999999, which the bucket did
    not take for a token, so the 11th call could not hedge (91 hedges per 1,000 calls
    where the ratio promises 100)."""
    a = FakeUpstream(Reply(first_token_s=20, tokens=1))
    b = FakeUpstream(Reply(first_token_s=1, tokens=1))
    hedge = polygate.Hedge(after_s=8, budget_burst=1, budget_ratio=0.1)
    async with polygate.session(_settings(hedge=hedge), transport=Router({"a": a, "b": b})) as s:
        hedged = [(await s.chat(MESSAGES)).call_stats.hedges for _ in range(11)]
    assert hedged == [1] + [0] * 9 + [1]


async def test_hedging_off_never_hedges(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=60))
    b = FakeUpstream(Reply())
    settings = _settings(hedge=polygate.Hedge())
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.hedges == 0 and b.requests == []


async def test_adaptive_threshold_learns_the_quantile(autojump_clock: trio.testing.MockClock) -> None:
    # a answers in 1-2 s; once learnt, a 6 s first token is late (q=0.9 of 1-2 s, clamped to >= 3)
    a = FakeUpstream([*[Reply(first_token_s=1 + i / 40) for i in range(40)], Reply(first_token_s=60)])
    b = FakeUpstream(Reply(first_token_s=1))
    hedge = polygate.Hedge(after_quantile=0.9, min_after_s=3, max_after_s=20, budget_burst=10)
    settings = _settings(hedge=hedge, source_kw={"b": {"weight": 1e-9}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        for _ in range(40):
            assert (await s.chat(MESSAGES)).call_stats.hedges == 0
        r = await s.chat(MESSAGES)
    assert r.call_stats.hedge_won
    assert b.requests[0].started_at - a.requests[-1].started_at == pytest.approx(3)


async def test_a_call_exactly_as_slow_as_the_quantile_is_not_hedged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """'Hedges when a path is slower than that quantile' (SPEC §4): a probe found a
    source answering at a constant 1.0 s hedged at 0.99 s on every call once learnt,
    the sketch's answer being up to 1 % under the samples of its bucket."""
    a = FakeUpstream(Reply(first_token_s=1.0))
    b = FakeUpstream(Reply(first_token_s=1.0))
    hedge = polygate.Hedge(after_quantile=0.95, max_after_s=20, budget_burst=10)
    settings = _settings(hedge=hedge, source_kw={"b": {"weight": 1e-9}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        hedges = [(await s.chat(MESSAGES)).call_stats.hedges for _ in range(40)]
    assert hedges == [0] * 40 and b.requests == []


async def test_a_refusal_in_a_fallback_scope_counts_in_that_scope(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """hedges_suppressed_by_budget is per scope: a call refused a hedge in x, moved to
    its fallback y and refused there too counts once in each (a probe found y's missing:
    one flag per call, not per scope)."""
    def sources(scope: str) -> list[polygate.Source]:
        return [polygate.Source(name="a", base_url=f"http://a{scope}/v1", weight=1.0, ttft_timeout_s=5),
                polygate.Source(name="b", base_url=f"http://b{scope}/v1", weight=1e-9, ttft_timeout_s=5)]

    hedge = polygate.Hedge(after_s=2, budget_burst=0.5, budget_ratio=0)  # never a whole token
    settings = polygate.Settings(scopes={
        "x": polygate.Scope(sources=sources("x"), hedge=hedge, retry=polygate.Retry(max_attempts=1),
                            fallback="y"),
        "y": polygate.Scope(sources=sources("y"), hedge=hedge, retry=polygate.Retry(max_attempts=1)),
    })
    ups = {n: FakeUpstream(Reply(first_token_s=90)) for n in ("ax", "bx", "ay", "by")}
    async with polygate.session(settings, transport=Router(ups)) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES, scope="x")
        suppressed = (await s.statistics()).governance.hedges_suppressed_by_budget
    assert suppressed == {"x": 1, "y": 1}
    assert (len(ups["bx"].requests), len(ups["by"].requests)) == (0, 0)


async def test_every_attempt_carries_the_logical_call_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=20))
    b = FakeUpstream(Reply(first_token_s=1))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    ids = {req.headers["x-polygate-call-id"] for req in a.requests + b.requests}
    assert ids == {r.call_stats.logical_call_id}


async def test_budget_refusals_count_calls_not_rechecks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hung primary re-checks its trigger every after_s; an empty budget refuses
    each re-check, but the counter counts the call once (it is named for calls)."""
    a = FakeUpstream(Reply(first_token_s=90))
    b = FakeUpstream(Reply(first_token_s=90))
    hedge = polygate.Hedge(after_s=8, budget_burst=1, budget_ratio=0.0)
    settings = _settings(hedge=hedge, source_kw={"b": {"weight": 1e-9}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        first = await s.chat(MESSAGES)   # takes the only token
        second = await s.chat(MESSAGES)  # refused at 8, 16, …, 88 s: eleven re-checks
        stats = await s.statistics()
    assert (first.call_stats.hedges, second.call_stats.hedges) == (1, 0)
    assert stats.governance.hedges_suppressed_by_budget["chat"] == 1


class _RoundTrips(MemoryBackend):
    """Like the Redis backend: each admission and budget take is a shielded round trip,
    and an admission first checks for a pending cancellation (nothing sent then)."""

    async def _trip(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.sleep(0.5)

    async def admit(self, request: Any) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        await self._trip()
        return await super().admit(request)

    async def budget_take(self, scope: str, burst: float) -> bool:
        await self._trip()
        return await super().budget_take(scope, burst)


async def test_a_call_cancelled_while_its_hedge_asks_admission_gives_the_token_back(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: the call was cancelled after its hedge took a budget token and while the
    hedge's admission round trip was in flight: the cancellation left through
    ``try_admit`` and the refund after it never ran.  No hedge was sent, yet the
    budget (burst 1) stayed spent: 0.1 (the call's refill) instead of 1."""
    import polygate._session as session_mod

    backend = _RoundTrips()
    monkeypatch.setattr(session_mod, "_backend_for", lambda settings: backend)
    a = FakeUpstream(Reply(first_token_s=100))
    b = FakeUpstream(Reply(first_token_s=100))
    settings = two_source_settings(
        weights=FIRST_A, hedge=polygate.Hedge(after_s=2, budget_burst=1, budget_ratio=0.1),
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        # the primary's admission 0-0.5, the hedge's trigger at 2.5, its budget take
        # until 3.0: cancelled at 2.75, inside that round trip; the admission after it
        # sees the cancellation at once
        with trio.move_on_after(2.75):
            await s.chat(MESSAGES)
        stats = await s.statistics()
    assert b.requests == []  # no hedge was sent
    assert stats.governance.hedge_budget["chat"] == pytest.approx(1.0)


# the order of failures ------------------------------------------------------------------


async def test_a_hedged_rounds_errors_are_listed_in_the_order_they_happened(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the round listed its errors in the order its paths were launched.  The
    hedge b (sent at 8) fails at 9, the primary a at 10: b's error comes first, as
    concepts.md says (and as embed's every_error already did)."""
    a = FakeUpstream(Reply(status=500, headers_delay_s=10))
    b = FakeUpstream(Reply(status=502, headers_delay_s=1))
    settings = _settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    assert [e.source for e in info.value.errors] == ["b", "a"]


async def test_the_next_round_starts_on_the_least_recently_failed_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """b failed at 9, a at 10: the next round starts on b (admission.md, picking: the
    sources that failed in this call come last, least recently failed first)."""
    a = FakeUpstream([Reply(status=500, headers_delay_s=10), Reply(first_token_s=1)])
    b = FakeUpstream([Reply(status=502, headers_delay_s=1), Reply(first_token_s=1)])
    settings = _settings(retry=polygate.Retry(max_attempts=2, backoff_base_s=0))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "b" and len(a.requests) == 1 and len(b.requests) == 2


async def test_a_source_failing_again_in_a_round_moves_behind_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rounds 1 and 2 fail on a, then b; round 3's primary c hangs.  Its first hedge
    goes to a (the least recently failed), which fails again at once: the second hedge
    goes to b, not back to a (a source that failed in this round kept the place of its
    earlier failure)."""
    a = FakeUpstream([Reply(status=500), Reply(status=500, headers_delay_s=1)])
    b = FakeUpstream([Reply(status=500), Reply(first_token_s=1)])
    c = FakeUpstream(Reply(first_token_s=100))
    settings = _settings(
        names=("a", "b", "c"), hedge=polygate.Hedge(after_s=8, max_extra=2),
        source_kw={"b": {"weight": 1e-4}}, retry=polygate.Retry(max_attempts=3, backoff_base_s=0),
    )
    # (A fixed draw: with the weights alone, round 1 went to b about once in 4,500
    # runs, and CI met it once.)
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c}),
                                rng=random.Random(0)) as s:
        r = await s.chat(MESSAGES)
    assert (r.source, r.call_stats.hedges) == ("b", 2)
    assert (len(a.requests), len(b.requests), len(c.requests)) == (2, 2, 1)


async def test_an_exhausted_call_says_how_many_attempts_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: a hedged round whose two paths both failed made "all 1 attempt(s)
    failed" (the rounds counted), where its statistics and errors hold two attempts."""
    bad = Reply(status=500, headers_delay_s=2)
    settings = _settings(hedge=polygate.Hedge(after_s=1), retry=polygate.Retry(max_attempts=1))
    async with polygate.session(
        settings, transport=Router({"a": FakeUpstream(bad), "b": FakeUpstream(bad)})
    ) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    assert info.value.call_stats.attempts == 2 and len(info.value.errors) == 2
    assert "all 2 attempt(s) failed in scope 'chat'" in str(info.value), str(info.value)


class _RoundTripBackend(MemoryBackend):
    """The memory backend, with a settle that yields as a shared backend's network
    round trip does (Redis)."""

    async def settle(self, request: Any) -> None:
        await trio.sleep(0.010)
        await super().settle(request)


class _Rows:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def attempt(self, ctx: Any, record: Any) -> None:
        self.rows.append((record.source, record.role, record.outcome.value))

    def call(self, *args: Any, **kwargs: Any) -> None:
        pass


async def test_a_loser_that_finishes_while_the_winner_settles_is_still_a_loser(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review: the win was decided after the winner's settle, so with a settle that
    yields (Redis's) a path whose answer completed meanwhile also settled as ``ok``:
    reported ok, and fed to the breaker and the source's health as a success, though
    it lost.  The first complete answer claims the win before it settles."""
    import polygate._session

    monkeypatch.setattr(polygate._session, "_backend_for", lambda settings: _RoundTripBackend())
    # a (primary) answers whole at 9.000 s; b (hedge, sent at 8 s) at 9.005 s, while a
    # is settling; b has two consecutive failures behind it, which its loss keeps.
    a = FakeUpstream([Reply(status=500), Reply(status=500), Reply(first_token_s=9, tokens=1)])
    b = FakeUpstream([Reply(status=500), Reply(status=500), Reply(first_token_s=1.005, tokens=1)])
    settings = _settings(hedge=polygate.Hedge(after_s=8),
                         retry=polygate.Retry(max_attempts=2, backoff_base_s=0))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        for _ in range(2):
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
        rows = _Rows()
        s._runtime.recorder = rows  # type: ignore[assignment]
        r = await s.chat(MESSAGES)
        stats = await s.statistics()
    assert r.source == "a" and r.call_stats.hedges == 1 and not r.call_stats.hedge_won
    assert sorted(rows.rows) == [("a", "primary", "ok"), ("b", "hedge", "hedge_cancelled")]
    assert _source(stats, "a").consecutive_failures == 0
    assert _source(stats, "b").consecutive_failures == 2  # a loser feeds no breaker
