"""Behaviour no other test pinned, found by mutating the code: each test fails on
the mutation its docstring names and passes on the code as it is."""
from __future__ import annotations

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

SECRET = "sk-test-SECRET-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "hello there"}]


async def test_retry_after_is_the_first_source_free_not_the_last(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (min -> max in the rate_limit_wait_s give-up): X's only 429 is a's
    (Retry-After 30); b, which X never asked, is cooling after another call's 429
    until t=5.5.  X gives up at t=2 (past rate_limit_wait_s=1): the caller may come
    back when b is free (3.5 s), not when a is (30 s)."""
    a = FakeUpstream(Reply(status=429, retry_after_s=30, headers_delay_s=2))
    b = FakeUpstream(Reply(status=429, retry_after_s=5))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, weight=1.0,
                            max_in_flight=1),
            polygate.Source(name="b", base_url="http://b/v1", api_key=SECRET, weight=1e-9),
        ],
        retry=polygate.Retry(rate_limit_wait_s=1, max_attempts=5),
    )})
    got: list[BaseException] = []
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:

        async def x() -> None:
            try:
                await s.chat(MESSAGES)
            except polygate.AllSourcesExhausted as exc:
                got.append(exc)

        async def y() -> None:
            with trio.move_on_after(2.5):
                try:
                    await s.chat(MESSAGES)
                except polygate.PolygateError:
                    pass

        async with trio.open_nursery() as n:
            n.start_soon(x)
            await trio.sleep(0.5)
            n.start_soon(y)
    assert len(got) == 1
    exc = got[0]
    assert [e.source for e in exc.errors] == ["a"]
    assert exc.retry_after_s == pytest.approx(3.5, abs=0.01)


def _scopes(**scopes):
    built = {}
    for name, spec in scopes.items():
        spec = dict(spec)
        sources = [polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, **kw)
                   for n, kw in spec.pop("sources").items()]
        built[name] = polygate.Scope(sources=sources, **spec)
    return polygate.Settings(scopes=built)


async def test_a_fallback_breaker_due_this_instant_takes_the_call_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``breaker_open_until > now`` -> ``>=`` in _fallback_admits): the asked
    scope's breaker is open until t=10, its fallback's until t=5.  A call at exactly
    t=5 finds the fallback's probe due (the backend half-opens at ``now >= until``):
    it goes there at once, not wait 5 s for the asked scope's probe."""
    a_up = FakeUpstream([Reply(status=500), Reply(text="from a")])
    b_up = FakeUpstream([Reply(status=500), Reply(text="from b")])
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "large", "retry": polygate.Retry(max_attempts=1),
              "breaker": polygate.Breaker(failures=1, open_s=10.0, max_open_s=10.0)},
        large={"sources": {"b": {}}, "retry": polygate.Retry(max_attempts=1),
               "breaker": polygate.Breaker(failures=1, open_s=5.0, max_open_s=5.0)},
    )
    async with polygate.session(settings, transport=Router({"a": a_up, "b": b_up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)  # both fail at t=0: a open until 10, b until 5
        await trio.sleep_until(5.0)
        r = await s.chat(MESSAGES)
        assert r.text == "from b"
        assert trio.current_time() == pytest.approx(5.0)


def _src(name: str, weight: float = 1.0, **kw) -> polygate.Source:
    return polygate.Source(name=name, base_url=f"http://{name}/v1", api_key=SECRET, weight=weight, **kw)


async def test_retry_after_is_when_the_first_source_may_admit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``min(known)`` -> ``max(known)`` in _rate_limited_for): a and b both answer
    429 (Retry-After 10 and 50); the deadline (5 s) is before either cooldown ends, so
    the call fails at once, and its retry_after_s is when the *first* source may
    take it again (10 s), not the last (50 s)."""
    a = FakeUpstream(Reply(status=429, retry_after_s=10))
    b = FakeUpstream(Reply(status=429, retry_after_s=50))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)], call_deadline_s=5)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
        assert trio.current_time() == 0
    assert {e.source for e in info.value.errors} == {"a", "b"}
    assert info.value.retry_after_s == pytest.approx(10)


async def test_a_same_source_cooldown_ending_at_the_wait_bound_is_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``retry_at > give_up_at`` -> ``>=`` in _same_source): a's 429 cools it
    until exactly rate_limit_wait_s after the call began; the same-source retry may
    wait that long (the bound is inclusive, as admission's is), so a answers at t=10
    and b is never asked."""
    a = FakeUpstream([Reply(status=429, retry_after_s=10), Reply(tokens=2)])
    b = FakeUpstream(Reply(tokens=2))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)],
        retry=polygate.Retry(same_source_retries=1, rate_limit_wait_s=10))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "a" and b.requests == []
    assert trio.current_time() == 10


WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)


async def _read(s: polygate.Session, **params) -> polygate.ChatResponse:
    async with s.stream_chat(MESSAGES, **params) as stream:
        async for _ in stream:
            pass
    assert stream.response is not None
    return stream.response


async def test_a_second_continuation_goes_to_the_least_recently_failed_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (the failed source put first, not last, of the continuation's demote list):
    a is cut, b continues and is cut too; the next continuation goes to a (failed
    least recently), not back to b, which just failed."""
    a = FakeUpstream([Reply(text=ANSWER, fault="truncated", fault_after=10)],
                     then=Reply(text=" " + " ".join(WORDS[20:])))
    b = FakeUpstream([Reply(text=" " + " ".join(WORDS[10:]), fault="truncated", fault_after=10)],
                     then=Reply(text=" " + " ".join(WORDS[20:])))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)],
        stream=polygate.StreamWatch(resume=True, max_resumes=3))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await _read(s)
    assert r.text == ANSWER and r.call_stats.resumes == 2
    assert (len(a.requests), len(b.requests)) == (2, 1)
    assert r.source == "a"


async def test_a_continuation_is_never_asked_for_fewer_than_one_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``max(1, limit - spent)`` -> ``limit - spent``): a segment that showed
    more than the caller's max_tokens (estimated at four characters a token: long
    tokens, or an upstream that overran) leaves the continuation max_tokens=1, never
    0 or a negative number (a 400 from any provider)."""
    long_words = [f"antidisestablishment{i:02d}" for i in range(10)]
    a = FakeUpstream(Reply(text=" ".join(long_words), fault="truncated", fault_after=3))
    b = FakeUpstream(Reply(text=" " + long_words[3]))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)], stream=polygate.StreamWatch(resume=True))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await _read(s, max_tokens=5)
    assert r.call_stats.resumes == 1
    assert b.requests[0].body.get("max_tokens") == 1, b.requests[0].body
