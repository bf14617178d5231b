"""The failover scenario suite on real loopback servers: one test per case, each
delivering the whole answer or, where none is possible, a clear typed error — never a
truncated success.

Real sockets and the real clock (FakeUpstream's server face).  Times are the
scenarios' own divided by ten (a 20 s first token is 2 s here, a 60 s outage 6 s), so
the suite runs in seconds; the MockClock tests in test_failover.py and
test_governance.py check the same behaviour at full scale with exact times.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import polygate
from polygate._resume import CONTINUE_PROMPT
from polygate.testing import FakeUpstream, Reply

from .conftest import MESSAGES, SECRET

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)
FAST = {"inter_token_s": 0.002}


@asynccontextmanager
async def serving(**upstreams: FakeUpstream) -> AsyncIterator[dict[str, str]]:
    urls: dict[str, str] = {}
    async with trio.open_nursery() as nursery:
        for name, up in upstreams.items():
            ready = trio.Event()

            async def run(up: FakeUpstream = up, name: str = name, ready: trio.Event = ready) -> None:
                async with up.serve() as url:
                    urls[name] = url
                    ready.set()
                    await trio.sleep_forever()

            nursery.start_soon(run)
            await ready.wait()
        try:
            yield urls
        finally:
            nursery.cancel_scope.cancel()


def _source(name: str, url: str, **kw: Any) -> polygate.Source:
    return polygate.Source(name=name, base_url=url, api_key=SECRET, **kw)


def _pair(urls: dict[str, str], *, b: dict[str, Any] | None = None, **scope: Any) -> polygate.Settings:
    """``a`` preferred, ``b`` the other source of the same scope."""
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        _source("a", urls["a"], weight=1.0),
        _source("b", urls["b"], weight=1e-9, **(b or {})),
    ], **scope)})


def _continuing(rest: str, **kw: Any) -> Any:
    def behaviour(request: Any, rng: Any) -> Reply:
        last = request.body["messages"][-1]
        if last["role"] == "assistant" or last["content"] == CONTINUE_PROMPT:
            return Reply(text=rest, **kw)
        return Reply(text=ANSWER, **kw)

    return behaviour


async def _stream(s: polygate.Session) -> polygate.ChatStream:
    async with s.stream_chat(MESSAGES) as stream:
        async for _ in stream:
            pass
    return stream


async def _chat_and_stream_answer(settings: polygate.Settings, expected_source: str) -> None:
    async with polygate.session(settings) as s:
        with trio.fail_after(30):
            r = await s.chat(MESSAGES)
            stream = await _stream(s)
        stats = await s.statistics()
    assert (r.text, r.source) == (ANSWER, expected_source)
    assert stream.response is not None and stream.response.text == stream.text == ANSWER
    for source in stats.governance.sources:  # every permit and reservation came back
        assert source.state.in_flight == 0 and source.state.tokens_reserved == 0


async def test_429_with_retry_after_once() -> None:
    a = FakeUpstream([Reply(status=429, retry_after_s=0.3)], then=Reply(text=ANSWER, **FAST))
    b = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        # the default fails over at once
        await _chat_and_stream_answer(_pair(urls), "b")
    a = FakeUpstream([Reply(status=429, retry_after_s=0.3)], then=Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        # same_source_retries waits out Retry-After on the preferred source
        settings = _pair(urls, retry=polygate.Retry(same_source_retries=1))
        async with polygate.session(settings) as s:
            t0 = trio.current_time()
            r = await s.chat(MESSAGES)
        assert (r.text, r.source) == (ANSWER, "a") and trio.current_time() - t0 >= 0.3


async def test_429_persistent() -> None:
    a = FakeUpstream(Reply(status=429, retry_after_s=5))
    b = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        await _chat_and_stream_answer(_pair(urls), "b")
    assert len(a.requests) == 1  # cooling down for 5 s: asked once


async def test_500_once() -> None:
    a = FakeUpstream([Reply(status=500)], then=Reply(text=ANSWER, **FAST))
    b = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        await _chat_and_stream_answer(_pair(urls), "b")


async def test_503_persistent_opens_the_breaker() -> None:
    a = FakeUpstream(Reply(status=503))
    b = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        settings = _pair(urls, breaker=polygate.Breaker(open_s=30, max_open_s=30))
        async with polygate.session(settings) as s:
            for _ in range(8):
                assert (await s.chat(MESSAGES)).source == "b"
            state = (await s.statistics()).governance.sources[0].state
    assert state.breaker.value == "open" and len(a.requests) == 5


async def test_tcp_reset() -> None:
    """Reset after three tokens: chat() restarts on b; a committed stream resumes."""
    a = FakeUpstream(Reply(text=ANSWER, fault="reset", fault_after=3, **FAST))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[3:]), **FAST))
    async with serving(a=a, b=b) as urls:
        await _chat_and_stream_answer(_pair(urls, stream=polygate.StreamWatch(resume=True)), "b")


async def test_no_response_at_all() -> None:
    """The primary accepts the connection and never answers: its first-token clock
    gives up and the call moves on."""
    a = FakeUpstream(Reply(fault="silent"))
    b = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            _source("a", urls["a"], weight=1.0, ttft_timeout_s=0.5),
            _source("b", urls["b"], weight=1e-9),
        ])})
        async with polygate.session(settings) as s:
            t0 = trio.current_time()
            r = await s.chat(MESSAGES)
            elapsed = trio.current_time() - t0
    assert (r.text, r.source) == (ANSWER, "b") and 0.5 <= elapsed < 5


async def test_a_20_s_first_token_is_hedged() -> None:
    a = FakeUpstream(Reply(text=ANSWER, first_token_s=2.0, **FAST))
    b = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        settings = _pair(urls, hedge=polygate.Hedge(after_s=0.3))
        async with polygate.session(settings) as s:
            t0 = trio.current_time()
            r = await s.chat(MESSAGES)
            elapsed = trio.current_time() - t0
    assert (r.text, r.source, r.call_stats.hedge_won) == (ANSWER, "b", True)
    assert elapsed < 1.8  # well before a's first token


async def test_a_stream_cut_at_token_40_of_60() -> None:
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40, **FAST))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[40:]), **FAST))
    async with serving(a=a, b=b) as urls:
        async with polygate.session(_pair(urls, stream=polygate.StreamWatch(resume=True))) as s:
            stream = await _stream(s)
    assert stream.response is not None and stream.text == stream.response.text == ANSWER
    assert stream.response.call_stats.resumes == 1


async def test_a_stream_that_stalls_after_20_tokens() -> None:
    a = FakeUpstream(Reply(text=ANSWER, stall_at=20, stall_s=30, **FAST))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[20:]), **FAST))
    async with serving(a=a, b=b) as urls:
        watch = polygate.StreamWatch(resume=True, stall_timeout_s=0.3, stall_threshold_ms=200)
        async with polygate.session(_pair(urls, stream=watch)) as s:
            with trio.fail_after(10):
                stream = await _stream(s)
    assert stream.response is not None and stream.text == stream.response.text == ANSWER
    # the caller did wait 0.3 s, and more while b took over: one stall, one resume
    assert (stream.response.call_stats.stall_count, stream.response.call_stats.resumes) == (1, 1)


async def test_a_malformed_event_at_token_10() -> None:
    a = FakeUpstream(Reply(text=ANSWER, fault="malformed_json", fault_after=10, **FAST))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[10:]), **FAST))
    async with serving(a=a, b=b) as urls:
        async with polygate.session(_pair(urls, stream=polygate.StreamWatch(resume=True))) as s:
            stream = await _stream(s)
            r = await s.chat(MESSAGES)  # chat(): nothing was shown, a clean restart
    assert stream.response is not None and stream.text == stream.response.text == ANSWER
    assert (r.text, r.source) == (ANSWER, "b")


async def test_a_stream_without_done_is_complete() -> None:
    """A finish_reason but no [DONE]: complete as it is, not retried, not resumed."""
    a = FakeUpstream(Reply(text=ANSWER, done=False, **FAST))
    b = FakeUpstream(Reply(text="never asked"))
    async with serving(a=a, b=b) as urls:
        await _chat_and_stream_answer(_pair(urls, stream=polygate.StreamWatch(resume=True)), "a")
    assert b.requests == []


async def test_a_400_for_context_length_moves_to_the_larger_model() -> None:
    small = FakeUpstream(Reply(status=400, error_body={"error": {
        "message": "This model's maximum context length is 8192 tokens.", "type":
        "invalid_request_error", "code": "context_length_exceeded"}}))
    large = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(small=small, large=large) as urls:
        settings = polygate.Settings(scopes={
            "chat": polygate.Scope(sources=[_source("small", urls["small"], model="m-8k")],
                                   fallback="large"),
            "large": polygate.Scope(sources=[_source("large", urls["large"], model="m-128k")]),
        })
        async with polygate.session(settings) as s:
            r = await s.chat(MESSAGES)
            stream = await _stream(s)
    assert (r.text, r.call_stats.scope) == (ANSWER, "large")
    assert stream.response is not None and stream.response.text == ANSWER
    assert len(small.requests) == 2  # once per call, never retried


async def test_a_400_for_content_policy_fails_cleanly() -> None:
    a = FakeUpstream(Reply(status=400, error_body={"error": {
        "message": "The response was filtered due to the prompt triggering the content "
                   "management policy.", "type": None, "code": "content_filter"}}))
    b = FakeUpstream(Reply(text="routed around"))
    async with serving(a=a, b=b) as urls:
        settings = polygate.Settings(scopes={
            "chat": polygate.Scope(sources=[_source("a", urls["a"])], fallback="other",
                                   fallback_on=("exhausted", "context_length", "fatal")),
            "other": polygate.Scope(sources=[_source("b", urls["b"])]),
        })
        async with polygate.session(settings) as s:
            with pytest.raises(polygate.FatalUpstreamError) as info:
                await s.chat(MESSAGES)
    assert info.value.code == "content_filter" and info.value.status_code == 400
    assert b.requests == []


async def test_a_cut_stream_whose_fallback_rejects_prefill() -> None:
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40, **FAST))
    rest = " " + " ".join(WORDS[40:])

    def picky(request: Any, rng: Any) -> Reply:
        if request.body.get("continue_final_message"):
            return Reply(status=400, error_body={"error": {
                "message": "unknown field continue_final_message", "type": "invalid_request_error"}})
        return _continuing(rest, **FAST)(request, rng)

    b = FakeUpstream(picky)
    async with serving(a=a, b=b) as urls:
        settings = _pair(urls, b={"prefill": True}, stream=polygate.StreamWatch(resume=True))
        async with polygate.session(settings) as s:
            stream = await _stream(s)
    assert stream.response is not None and stream.text == stream.response.text == ANSWER
    assert [r.status for r in b.requests] == [400, 200]


async def test_a_primary_that_flaps() -> None:
    """Down for 6 s, then healthy; a request every 0.4 s.  Every call gets its answer
    (from b while a is down), and a carries traffic again within 3 s of recovering."""
    start = trio.current_time()
    down_for = 6.0

    def flapping(request: Any, rng: Any) -> Reply:
        if request.started_at - start < down_for:
            return Reply(status=503)
        return Reply(text=ANSWER, **FAST)

    a = FakeUpstream(flapping)
    b = FakeUpstream(Reply(text=ANSWER, **FAST))
    async with serving(a=a, b=b) as urls:
        settings = _pair(urls, breaker=polygate.Breaker(open_s=0.5, max_open_s=2.0))
        served: list[tuple[float, str]] = []
        async with polygate.session(settings) as s:
            while trio.current_time() - start < 12:
                r = await s.chat(MESSAGES)
                assert r.text == ANSWER
                served.append((trio.current_time() - start, r.source))
                await trio.sleep(0.4)
    back = [t for t, source in served if source == "a" and t >= down_for]
    assert back and back[0] - down_for <= 3.0, served
    assert sum(1 for t, source in served if t > back[0] and source == "b") <= 2


async def test_usage_accounting_across_a_failover() -> None:
    """A resumed stream reports what both segments cost; the quotas settled every
    reservation (nothing held, nothing lost)."""
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40, **FAST))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[40:]), **FAST))
    async with serving(a=a, b=b) as urls:
        settings = _pair(urls, stream=polygate.StreamWatch(resume=True))
        async with polygate.session(settings) as s:
            stream = await _stream(s)
            sources = {x.state.source: x.state for x in (await s.statistics()).governance.sources}
    response = stream.response
    assert response is not None and response.usage is not None
    continuation = b.requests[0].reply
    assert continuation is not None
    assert response.usage.completion_tokens >= continuation.tokens + 10  # + the cut segment
    assert response.usage.source == "estimated"  # the cut segment reported no usage
    for state in sources.values():
        assert state.in_flight == 0 and state.tokens_reserved == 0
        assert state.reserved_total == state.settled_total + state.released_total
    assert sources["a"].admissions == 1 and sources["b"].admissions == 1
