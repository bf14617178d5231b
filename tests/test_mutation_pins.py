"""Behaviour of the core that no other test pinned, found by mutating it: each test
fails on the mutation its docstring names (a changed comparison, a dropped condition
or call) and passes on the code as it is.  Hedging's first-token trigger and early
data, admission's waits and probes, the retry loop's order and waits."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

MESSAGES = [{"role": "user", "content": "hi"}]


def _src(name: str, weight: float = 1.0, **kw: Any) -> polygate.Source:
    return polygate.Source(name=name, base_url=f"http://{name}/v1", weight=weight, **kw)


def _two(kw: dict[str, dict[str, Any]] | None = None, **scope: Any) -> polygate.Settings:
    """a (weight 1) and b (weight 1e-9): a first whenever it can admit."""
    kw = kw or {}
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a", 1.0, **kw.get("a", {})), _src("b", 1e-9, **kw.get("b", {}))],
        **scope)})


# --------------------------------------------------------------------------- hedging


class _SlowToConnectA(httpx.AsyncBaseTransport):
    """Says itself when it writes (REPORTS_SENT); host a takes 3 s to "connect", so the
    request to a is sent 3 s after its attempt started."""

    polygate_reports_sent = True

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            await trio.sleep(3)
        return await self.inner.handle_async_request(request)


async def test_the_first_token_trigger_counts_from_the_send_not_the_connect(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An attempt is late when it has no first token ``after_s`` after it was *sent*. a
    is sent at t=3 and has its first token 4 s later (t=7): never late for after_s=5
    (late at t=8). Counted from the attempt's start (t=0, late at t=5), a hedge went
    to b. (Fails with the trigger counted from the attempt's start.)"""
    a = FakeUpstream(Reply(first_token_s=4, tokens=2))
    b = FakeUpstream(Reply(first_token_s=1, tokens=2))
    settings = _two(hedge=polygate.Hedge(after_s=5))
    async with polygate.session(settings, transport=_SlowToConnectA(Router({"a": a, "b": b}))) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "a"
    assert r.call_stats.hedges == 0 and b.requests == []


BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CONTEXT = {"context": {"citations": [{"title": "doc", "content": "the source"}], "intent": "q"}}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_data_of_an_answer_without_any_content_token_reaches_the_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream that wins without a content token (data and no output: citations, then
    the finish) hands what it held to the caller before the stream ends. (Fails with
    the early data's delivery dropped.)"""
    events = [_chunk({"role": "assistant", "content": ""}), _chunk(CONTEXT), _chunk({}, "stop")]
    body = ("".join("data: " + json.dumps(e) + "\n\n" for e in events) + "data: [DONE]\n\n").encode()
    transport = httpx.MockTransport(lambda r: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=body))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    chunks = []
    async with polygate.session(settings, transport=Router({"a": transport})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    assert [c.delta for c in chunks] == [CONTEXT]


# --------------------------------------------------------------------------- admission


async def test_a_cooldown_beside_a_full_permit_set_is_not_bounded_by_rate_limit_wait_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``rate_limit_wait_s`` bounds a wait only when cooldowns are *all* there is to
    wait for (docs/admission.md step 3: "in-flight limits free up by themselves, so
    without a deadline a call waits for them"). a is cooling down for 120 s after a
    429; b's only permit is held by a call that ends at ~t=100. A call without a
    deadline waits for b's permit and is answered; with ``any`` it gave up at
    rate_limit_wait_s=60 with AllSourcesExhausted. (Fails with ``all`` cooldowns made
    ``any``.)"""
    a = FakeUpstream([Reply(status=429, retry_after_s=120), Reply(tokens=2)])
    b = FakeUpstream([Reply(first_token_s=100, tokens=2), Reply(tokens=2)])
    settings = _two({"b": {"max_in_flight": 1}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        first: list[polygate.ChatResponse] = []

        async def holder() -> None:
            first.append(await s.chat(MESSAGES))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await trio.sleep(1)
            assert len(a.requests) == 1 and len(b.requests) == 1  # a 429'd, b holds the permit
            start = trio.current_time()
            r = await s.chat(MESSAGES)
        waited = trio.current_time() - start
    assert r.source == "b" and 90 < waited < 110
    assert first[0].source == "b"


async def test_giving_up_before_the_deadline_on_a_cooldown_says_timed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A call that gives up because no source can admit it before its deadline (a
    cooldown ending after it) raises AllSourcesExhausted with ``timed=True``
    (docs/reference.md: a caller with more time might still be answered; the cache
    hands the flight over on it). No test read ``timed`` at all. (Fails with
    ``timed=False``.)"""
    a = FakeUpstream([Reply(status=429, retry_after_s=100), Reply(tokens=2)])
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        try:
            await s.chat(MESSAGES, call_deadline_s=10)
        except polygate.AllSourcesExhausted as exc:
            caught = exc
        else:
            raise AssertionError("answered")
    assert trio.current_time() < 1  # given up at once, not at the deadline
    assert caught.timed is True
    assert caught.retry_after_s is not None and 99 <= caught.retry_after_s <= 100


async def test_a_breaker_is_probed_first_at_the_very_instant_its_open_period_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A source seen open whose period is over leads the order (admission.md, picking
    step 5) -- over from ``breaker_open_until`` itself (the backend admits the probe
    then). b opens at t=0 until t=10; a call at exactly t=10 probes b. With ``<`` it
    went to a (by weight). (Fails with the probe's due time compared with ``<``.)"""
    a = FakeUpstream([Reply(status=429, retry_after_s=5), Reply(), Reply()])
    b = FakeUpstream([Reply(status=503), Reply()])
    settings = _two(breaker=polygate.Breaker(failures=1, open_s=10))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        first = await s.chat(MESSAGES)  # a: 429 (5 s); b: 503, opens; seen open; a at 5 s
        assert first.source == "a"
        stats = await s.statistics()
        until = next(r.state for r in stats.governance.sources if r.state.source == "b").breaker_open_until
        assert until is not None
        await trio.sleep_until(until)
        probe = await s.chat(MESSAGES)
    assert probe.source == "b"


async def test_only_an_open_breaker_is_probed_first_not_a_cooldown_that_ended(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only a source seen with an *open breaker* leads the order once its period is over
    (admission.md, picking step 5). b (weight 1e-9) is seen cooling down after a 429;
    long after, a call is picked by weight again: a. With every refusal's retry time
    recorded as a probe due, b led the order. (Fails with the open-breaker condition
    dropped.)"""
    a = FakeUpstream([Reply(first_token_s=20, tokens=2), Reply(tokens=2)])
    b = FakeUpstream([Reply(status=429, retry_after_s=5), Reply(tokens=2)])
    settings = _two({"a": {"max_in_flight": 1}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.chat, MESSAGES)  # holds a's only permit for 20 s
            await trio.sleep(1)
            try:  # a: in flight; b: 429 (5 s), then seen cooling down; ends at t=4
                await s.chat(MESSAGES, call_deadline_s=3)
            except (polygate.AllSourcesExhausted, polygate.DeadlineExceeded):
                pass
            else:
                raise AssertionError("answered")
        await trio.sleep_until(30)
        later = await s.chat(MESSAGES)
    assert len(b.requests) == 1
    assert later.source == "a"


# --------------------------------------------------------------------------- the retry loop


async def test_a_call_that_moved_to_its_fallback_refills_its_first_scopes_hedge_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every finished chat call refills the hedge budget of every scope it asked -- the
    one it started in as well as the fallback it moved to (ctx.scope_name is the last
    one by then). Call 1 hedges in ``main`` (2 -> 1, refill -> 1.5); call 2 fails in
    ``main`` and is answered by ``fb``: ``main`` is refilled to 2. (Fails with only
    the last scope refilled (killed before only by a slow interplay test).)"""
    a = FakeUpstream([Reply(first_token_s=5, tokens=2), Reply(status=500), Reply(status=500)])
    b = FakeUpstream([Reply(first_token_s=0.5, tokens=2), Reply(status=500), Reply(status=500)])
    c = FakeUpstream(Reply(tokens=2))
    settings = polygate.Settings(scopes={
        "main": polygate.Scope(
            sources=[_src("a"), _src("b", 1e-9)],
            hedge=polygate.Hedge(after_s=1, budget_burst=2, budget_ratio=0.5),
            retry=polygate.Retry(max_attempts=2), fallback="fb"),
        "fb": polygate.Scope(sources=[_src("c")]),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c})) as s:
        r1 = await s.chat(MESSAGES, scope="main")
        assert r1.call_stats.hedges == 1
        assert (await s.statistics()).governance.hedge_budget["main"] == 1.5
        r2 = await s.chat(MESSAGES, scope="main")
        assert r2.source == "c" and r2.call_stats.scope == "fb"
        budget = (await s.statistics()).governance.hedge_budget["main"]
    assert budget == 2.0


async def test_a_fallback_that_does_not_take_exhausted_does_not_stop_a_wait_for_breakers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only a call whose fallback takes ``exhausted`` leaves open breakers for it
    (admission.md step 2). ``main`` falls back only on ``context_length``: its call
    waits out a's open period (10 s) and is answered by a's probe. Keyed on
    ``fallback is None`` alone, it raised AllSourcesExhausted. (Fails with keyed on
    ``fallback is None`` alone.)"""
    a = FakeUpstream([Reply(status=500), Reply(tokens=2)])
    c = FakeUpstream(Reply(tokens=2))
    settings = polygate.Settings(scopes={
        "main": polygate.Scope(
            sources=[_src("a")], breaker=polygate.Breaker(failures=1, open_s=10),
            fallback="fb", fallback_on=("context_length",)),
        "fb": polygate.Scope(sources=[_src("c")]),
    })
    async with polygate.session(settings, transport=Router({"a": a, "c": c})) as s:
        r = await s.chat(MESSAGES, scope="main")
    assert r.source == "a" and 9 <= trio.current_time() <= 16
    assert c.requests == []


class _TopJitter(random.Random):
    """Backoff at its ceiling every time (full_jitter draws with ``uniform``)."""

    def uniform(self, a: float, b: float) -> float:
        return b


async def test_a_same_source_retry_after_a_429_waits_its_retry_after_not_a_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A same-source retry after a 429 waits out the source's cooldown (Retry-After) and
    no backoff on top: a answers at t=1. Backing off (10 s here) before the cooldown
    wait delayed it to t=10. (Fails with a backoff before every same-source retry.)"""
    a = FakeUpstream([Reply(status=429, retry_after_s=1), Reply(tokens=2)])
    b = FakeUpstream(Reply(tokens=2))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)],
        retry=polygate.Retry(same_source_retries=1, backoff_base_s=10, backoff_max_s=10))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b}), rng=_TopJitter(1)) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "a" and b.requests == []
    assert trio.current_time() == 1


async def test_a_source_that_fails_again_moves_behind_the_one_that_failed_before_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The next round prefers the sources that failed least recently (the module
    docstring; as within a round). a fails, b fails, a fails again: the fourth round
    asks b, not a. (Fails with the failed sources' order reversed (killed before only
    by a slow schedule test).)"""
    a = FakeUpstream([Reply(status=500), Reply(status=500), Reply(tokens=2)])
    b = FakeUpstream([Reply(status=500), Reply(tokens=2)])
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)], retry=polygate.Retry(max_attempts=4))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert len(a.requests) == 2 and len(b.requests) == 2
    assert r.source == "b"
