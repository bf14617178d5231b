"""Logical calls through the fake transport under MockClock: retries, deadlines,
timeouts, watchdogs, statistics.  Times asserted here are exact virtual times."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, SECRET, one_source_settings, two_source_settings


def _router(**upstreams: FakeUpstream) -> Router:
    return Router(upstreams)


async def test_success_statistics_exact(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(first_token_s=1.5, inter_token_s=0.1, tokens=10, stall_at=5, stall_s=3.0))
    async with polygate.session(one_source_settings(), transport=_router(a=up)) as s:
        r = await s.chat(MESSAGES)
    st = r.call_stats
    assert r.text.count(" ") >= 1
    assert st.attempts == 1 and st.hedges == 0 and not st.hedge_won
    assert st.source == "a"
    assert st.ttft_ms == pytest.approx(1500)
    # 10 tokens: first at 1.5, then every 0.1, token 5 delayed by 3.0
    assert st.stall_count == 1
    assert st.stall_ms == pytest.approx(3100)
    # span 0.9 + 3.0 s, minus the one 3.1 s gap: 0.8 s of decoding
    assert st.active_generation_ms == pytest.approx(800)
    assert st.generation_ms == pytest.approx(1500 + 900 + 3000)
    assert st.total_latency_ms == pytest.approx(st.generation_ms)
    assert r.usage is not None and r.usage.completion_tokens == 10


async def test_failover_to_other_source_on_5xx(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=500))
    b = FakeUpstream(Reply())
    async with polygate.session(two_source_settings(), transport=_router(a=a, b=b)) as s:
        for _ in range(5):
            r = await s.chat(MESSAGES)
            assert r.source == "b"
            assert r.call_stats.attempts in (1, 2)
    assert all(req.path.endswith("/chat/completions") for req in b.requests)


async def test_fatal_error_raised_at_once(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=400))
    b = FakeUpstream(Reply(status=400))
    async with polygate.session(two_source_settings(), transport=_router(a=a, b=b)) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.chat(MESSAGES)
    assert info.value.status_code == 400
    assert len(a.requests) + len(b.requests) == 1


async def test_exhausted_carries_every_error(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=503))
    b = FakeUpstream(Reply(status=502))
    settings = two_source_settings(retry=polygate.Retry(max_attempts=3))
    async with polygate.session(settings, transport=_router(a=a, b=b)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    error = info.value
    assert len(error.errors) == 3
    assert all(isinstance(e, polygate.TransientUpstreamError) for e in error.errors)
    assert {e.source for e in error.errors[:2]} == {"a", "b"}  # fresh source first
    assert error.call_stats is not None and error.call_stats.attempts == 3


async def test_backoff_only_once_every_source_failed(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream([Reply(status=503), Reply()])
    b = FakeUpstream(Reply(status=503))
    settings = two_source_settings(
        retry=polygate.Retry(max_attempts=3, backoff_base_s=1.0), weights=FIRST_A
    )
    async with polygate.session(settings, transport=_router(a=a, b=b)) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        # a then b failed back to back (no sleep), then one full-jitter sleep in [0, 2] s
        # before a, the least recently failed source, is tried again
        assert 0 < trio.current_time() - start <= 2.0
    assert r.call_stats.attempts == 3
    assert r.source == "a"
    assert [len(a.requests), len(b.requests)] == [2, 1]


async def test_dead_source_cools_down(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=401))
    b = FakeUpstream(Reply())
    # a first while it can be picked (an even draw missed it in 10 calls, once in a
    # thousand runs, and the test failed).
    settings = two_source_settings(weights=FIRST_A)
    async with polygate.session(settings, transport=_router(a=a, b=b)) as s:
        for _ in range(10):
            assert (await s.chat(MESSAGES)).source == "b"
        stats = await s.statistics()
    assert len(a.requests) == 1  # dead after the first 401: never picked again
    state_a = next(x.state for x in stats.governance.sources if x.state.source == "a")
    assert state_a.dead
    assert state_a.tokens_in_window == 0  # a dead source settles 0


async def test_rate_limit_is_free_and_honours_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream([Reply(status=429, retry_after_s=2), Reply(status=429, retry_after_s=3), Reply()])
    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=_router(a=a)) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        assert trio.current_time() - start == pytest.approx(5.0)
    assert r.call_stats.attempts == 3
    assert r.call_stats.total_latency_ms == pytest.approx(5000)
    assert r.call_stats.generation_ms == pytest.approx(0)  # the fake answers instantly


async def test_rate_limit_without_deadline_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=429, retry_after_s=30))
    settings = one_source_settings(retry=polygate.Retry(rate_limit_wait_s=60))
    async with polygate.session(settings, transport=_router(a=a)) as s:
        start = trio.current_time()
        with pytest.raises(polygate.AllSourcesExhausted,
                           match="every source still rate limited after rate_limit_wait_s=60") as info:
            await s.chat(MESSAGES)
        assert trio.current_time() - start <= 60
    assert all(isinstance(e, polygate.RateLimitedError) for e in info.value.errors)


async def test_a_429_after_rate_limit_wait_s_does_not_end_a_call_another_source_takes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: no deadline; a answers 502 after 70 s, the retry on b gets a 429.  The
    call ended with "every source still rate limited after rate_limit_wait_s=60",
    though a was not rate limited and admitted at once, with attempts left: the bound
    was checked against the clock whatever the sources' state.  It bounds only the
    waiting out of cooldowns; admission decides."""
    a = FakeUpstream([Reply(status=502, headers_delay_s=70), Reply(text="from a")])
    b = FakeUpstream(Reply(status=429, retry_after_s=1))
    settings = two_source_settings(
        retry=polygate.Retry(max_attempts=3, backoff_base_s=0, backoff_max_s=0), weights=FIRST_A,
    )
    async with polygate.session(settings, transport=_router(a=a, b=b)) as s:
        r = await s.chat(MESSAGES)
        assert r.source == "a" and r.text == "from a"
        assert trio.current_time() == pytest.approx(70)
        assert r.call_stats.attempts == 3


@pytest.mark.parametrize("retry_after_s", [100.0, 10.0])
async def test_rate_limit_wait_past_deadline_fails_fast(
    autojump_clock: trio.testing.MockClock, retry_after_s: float,
) -> None:
    """(Outside review, every limit at N-1, N, N+1: a Retry-After that ends with the
    deadline itself was waited out whole, then DeadlineExceeded: a 504 where a 429 was
    due.  The call is cancelled at that instant, so nothing can admit it then.)"""
    a = FakeUpstream(Reply(status=429, retry_after_s=retry_after_s))
    settings = one_source_settings(call_deadline_s=10)
    async with polygate.session(settings, transport=_router(a=a)) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
        assert trio.current_time() < 1


async def test_a_deadline_that_cuts_a_stream_says_where_its_text_came_from(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a stream the deadline cut mid-way raised DeadlineExceeded whose
    statistics had no source, no first token and no generation time, although the
    caller had read five tokens from ``a`` (the telemetry row said the same)."""
    a = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=20))
    async with polygate.session(one_source_settings(call_deadline_s=5.5), transport=_router(a=a)) as s:
        shown = []
        with pytest.raises(polygate.DeadlineExceeded) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    shown.append(chunk.text)
    stats = info.value.call_stats
    assert stats is not None and "".join(shown)
    assert stats.source == "a" and stats.attempts == 1
    assert stats.ttft_ms == pytest.approx(1000)
    assert stats.generation_ms == pytest.approx(5500)
    assert stats.total_latency_ms == pytest.approx(5500)


async def test_deadline_cuts_a_hang(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=90))
    async with polygate.session(one_source_settings(call_deadline_s=10), transport=_router(a=a)) as s:
        start = trio.current_time()
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await s.chat(MESSAGES)
        assert trio.current_time() - start == pytest.approx(10)
        assert isinstance(info.value, TimeoutError)
        assert info.value.call_stats is not None
        assert info.value.call_stats.attempts == 1
        assert info.value.call_stats.total_latency_ms == pytest.approx(10_000)
        # per-call override
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES, call_deadline_s=3)
        assert trio.current_time() - start == pytest.approx(13)
        stats = await s.statistics()
    assert a.in_flight == 0
    assert all(src.state.in_flight == 0 for src in stats.governance.sources)


async def test_deadline_none_disables_scope_deadline(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=30))
    async with polygate.session(one_source_settings(call_deadline_s=10), transport=_router(a=a)) as s:
        r = await s.chat(MESSAGES, call_deadline_s=None)
    assert r.call_stats.ttft_ms == pytest.approx(30_000)


async def test_ttft_timeout_then_other_source(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=50, keepalive_s=1))  # keep-alives reset nothing
    b = FakeUpstream(Reply(first_token_s=1))
    settings = two_source_settings(source_kw={"ttft_timeout_s": 5}, weights=FIRST_A)
    async with polygate.session(settings, transport=_router(a=a, b=b)) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.attempts == 2
    assert r.source == "b"
    assert r.call_stats.total_latency_ms == pytest.approx(5000 + 1000)
    assert r.call_stats.generation_ms == pytest.approx(1000)
    assert r.call_stats.ttft_ms == pytest.approx(1000)


async def test_whole_attempt_timeout(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=100))
    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", timeout_s=20)],
        retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=_router(a=a)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
        assert trio.current_time() == pytest.approx(20)
    (error,) = info.value.errors
    assert isinstance(error, polygate.TransientUpstreamError)
    assert "timeout_s" in str(error)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("reply", [
    Reply(first_token_s=1, inter_token_s=1, tokens=3),  # the last token at 3 s
    Reply(first_token_s=3, tokens=1),  # the only one at 3 s
])
async def test_an_answer_exactly_at_timeout_s_is_in_time(
    autojump_clock: trio.testing.MockClock, reply: Reply, streaming: bool
) -> None:
    """Outside review (2026-12-02): the docs say every watchdog, ``timeout_s``
    included, fires a hair past its limit, so that what arrives exactly at it is in
    time; ``timeout_s`` fired at the limit itself (every attempt failed at 3.000 s)."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", timeout_s=3,
                                 streaming=streaming)],
        retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=_router(a=FakeUpstream(reply))) as s:
        response = await s.chat(MESSAGES)
    assert response.call_stats.attempts == 1
    assert response.call_stats.generation_ms == pytest.approx(3000)


async def test_stall_in_chat_is_transient_and_retried(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=1, tokens=10, stall_at=3, stall_s=55))
    b = FakeUpstream(Reply(first_token_s=1))
    settings = two_source_settings(stream=polygate.StreamWatch(stall_timeout_s=5), weights=FIRST_A)
    async with polygate.session(settings, transport=_router(a=a, b=b)) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.attempts == 2
    assert r.source == "b"
    # a: first token at 1 s, silent from 1 s (token 3 due at 56 s), cut at 1 + 5 s
    assert r.call_stats.total_latency_ms == pytest.approx(6000 + 1000)


async def test_committed_stream_stall_raises_stream_stalled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text="one two three four five", first_token_s=1, stall_at=3, stall_s=55))
    settings = one_source_settings(stream=polygate.StreamWatch(stall_timeout_s=5))
    async with polygate.session(settings, transport=_router(a=a)) as s:
        got = []
        with pytest.raises(polygate.StreamStalled) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    got.append(chunk.text)
        assert trio.current_time() == pytest.approx(1 + 5)
    assert info.value.text == "".join(got) == "one two three"
    assert isinstance(info.value, TimeoutError)
    assert info.value.call_stats is not None
    assert a.in_flight == 0


async def test_stream_chat_response_and_stats(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=2, inter_token_s=0.5, tokens=5))
    async with polygate.session(one_source_settings(), transport=_router(a=a)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            texts = [chunk.text async for chunk in stream]
    assert stream.response is not None
    assert "".join(texts) == stream.response.text
    assert len(texts) == 5
    assert stream.response.call_stats.ttft_ms == pytest.approx(2000)
    assert stream.response.call_stats.active_generation_ms == pytest.approx(2000)


async def test_leaving_a_stream_early_cancels_and_settles(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=50))
    async with polygate.session(one_source_settings(), transport=_router(a=a)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _chunk in stream:
                break
        stats = await s.statistics()
    assert a.in_flight == 0
    (src,) = stats.governance.sources
    assert src.state.in_flight == 0
    assert src.state.tokens_reserved == 0
    assert src.state.settled_total == src.state.reserved_total  # cancelled: estimate kept


async def test_external_cancellation_leaves_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=100))
    async with polygate.session(one_source_settings(), transport=_router(a=a)) as s:
        with trio.move_on_after(5) as scope:
            await s.chat(MESSAGES)
        assert scope.cancelled_caught
        stats = await s.statistics()
    (src,) = stats.governance.sources
    assert src.state.in_flight == 0 and src.state.tokens_reserved == 0
    assert src.state.breaker.value == "closed" and src.state.consecutive_failures == 0
    assert a.in_flight == 0


async def test_bad_arguments_before_any_io(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply())
    async with polygate.session(one_source_settings(), transport=_router(a=a)) as s:
        with pytest.raises(polygate.ConfigError, match="unknown scope"):
            await s.chat(MESSAGES, scope="nope")
        with pytest.raises(ValueError, match="empty"):
            await s.chat([])
        with pytest.raises(polygate.ConfigError):
            await s.chat("hello")  # type: ignore[arg-type]
        with pytest.raises(polygate.ConfigError):
            await s.chat([{"content": "no role"}])
        with pytest.raises(polygate.ConfigError):
            await s.chat(MESSAGES, call_deadline_s=-1)
        with pytest.raises(polygate.ConfigError):
            await s.chat(MESSAGES, call_deadline_s=math.nan)
        with pytest.raises(polygate.ConfigError):
            await s.chat(MESSAGES, stream=True)
        with pytest.raises(polygate.ConfigError):
            await s.chat(MESSAGES, temperature=object())
        with pytest.raises(polygate.ConfigError):
            s.stream_chat([])
        with pytest.raises(polygate.ConfigError):
            await s.embed([], scope="chat")
    assert a.requests == []
    with pytest.raises(polygate.PolygateError, match="closed"):
        await s.chat(MESSAGES)


async def test_an_embedding_call_with_a_schema_and_an_unentered_stream_are_clear_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: ``embed(schema=...)`` went upstream as a vendor field (``ocr()`` refuses
    it); leaving a ChatStream never entered raised a bare AttributeError."""
    a = FakeUpstream(Reply())
    async with polygate.session(one_source_settings(), transport=_router(a=a)) as s:
        with pytest.raises(polygate.ConfigError, match="embed\\(\\) takes no schema"):
            await s.embed(["x"], scope="chat", schema={"type": "object"})
        with pytest.raises(polygate.PolygateError, match="never entered"):
            await s.stream_chat(MESSAGES).__aexit__(None, None, None)
    assert a.requests == []


async def test_a_deadline_no_float_holds_is_refused_before_any_io(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: ``call_deadline_s=10**400`` raised a bare OverflowError from every call."""
    a = FakeUpstream(Reply())
    async with polygate.session(one_source_settings(), transport=_router(a=a)) as s:
        with pytest.raises(polygate.ConfigError, match="call_deadline_s must be a finite number"):
            await s.chat(MESSAGES, call_deadline_s=10**400)
        with pytest.raises(polygate.ConfigError, match="call_deadline_s must be a finite number"):
            s.stream_chat(MESSAGES, call_deadline_s=10**400)
        with pytest.raises(polygate.ConfigError, match="call_deadline_s must be a finite number"):
            await s.embed(["x"], scope="chat", call_deadline_s=10**400)
    assert a.requests == []


@pytest.mark.parametrize(("kw", "message"), [
    ({"transport": object()}, "transport must be an httpx.AsyncBaseTransport, got object"),
    ({"transport": httpx.HTTPTransport()}, "got HTTPTransport"),
    ({"rng": 5}, "rng must be a random.Random, got int"),
    ({"env": "POLYGATE__CHAT__A__BASE_URL=x"}, "env must be a mapping"),
    ({"env": {"POLYGATE__CHAT__A__TIMEOUT_S": 5}}, "env POLYGATE__CHAT__A__TIMEOUT_S: must be a string"),
    ({"env": {"POLYGATE__CHAT__A__BASE_URL": None}}, "must be a string, got NoneType"),
])
async def test_session_arguments_of_the_wrong_type_are_config_errors(
    kw: dict[str, Any], message: str
) -> None:
    """Review: a transport that is not an async one (httpx's sync HTTPTransport is the
    easy mistake) opened a session whose every attempt failed with an AttributeError,
    logged and fed to the breaker; a wrong ``rng`` or ``env`` failed later with a bare
    AttributeError."""
    settings = one_source_settings() if "env" not in kw else None
    with pytest.raises(polygate.ConfigError, match=message):
        async with polygate.session(settings, **kw):
            pass



@pytest.mark.parametrize("env", [["x"], "POLYGATE__CHAT__A__BASE_URL=x", {"K": 5}])
async def test_a_wrong_env_beside_settings_is_refused_too(env: Any) -> None:
    """A docs sweep of concepts.md (a wrong ``env`` is a ConfigError before anything
    opens): beside settings, which leave it unused, it was taken silently, where a
    wrong transport or rng was refused either way."""
    with pytest.raises(polygate.ConfigError, match="env"):
        async with polygate.session(one_source_settings(), env=env):
            pass
    from polygate.serve import open_server

    with pytest.raises(polygate.ConfigError, match="env"):  # (review: the server's too)
        async with open_server(one_source_settings(), port=0, env=env):
            pass


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_non_finite_numbers_are_refused_before_any_io(
    autojump_clock: trio.testing.MockClock, value: float
) -> None:
    """NaN and ±Infinity are not JSON: once sent upstream as bare NaN/Infinity tokens.
    A ConfigError (a ValueError) naming the parameter, for every kind of call, nested
    values and messages too."""
    up = FakeUpstream(Reply())
    scope = polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])
    settings = polygate.Settings(scopes={"chat": scope, "embed": scope, "ocr": scope})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="'temperature'"):
            await s.chat(MESSAGES, temperature=value)
        with pytest.raises(ValueError, match="'max_tokens'"):
            await s.chat(MESSAGES, max_tokens=value)
        with pytest.raises(polygate.ConfigError, match="'logit_bias'"):
            await s.chat(MESSAGES, logit_bias={"50256": value})
        with pytest.raises(polygate.ConfigError, match="'extra'"):
            await s.chat(MESSAGES, temperature=0.5, extra={"a": [1, {"b": value}]})
        with pytest.raises(polygate.ConfigError, match="messages"):
            await s.chat([{"role": "user", "content": "x", "weight": value}])
        with pytest.raises(polygate.ConfigError, match="'top_p'"):
            s.stream_chat(MESSAGES, top_p=value)
        with pytest.raises(polygate.ConfigError, match="'dimensions'"):
            await s.embed(["x"], dimensions=value)
        with pytest.raises(polygate.ConfigError, match="'temperature'"):
            await s.ocr(b"not read", temperature=value)
    assert up.requests == []


@pytest.mark.parametrize("depth", [300, 600, 985, 5000])
@pytest.mark.parametrize("cache", ["off", "memory"])
async def test_arguments_nested_too_deeply_are_refused_before_any_io(
    autojump_clock: trio.testing.MockClock, depth: int, cache: str
) -> None:
    """Found by a probe: a parameter or message nested past what Python's recursive
    JSON walks can take raised a bare RecursionError (from the cache key, from the
    check's encoder).  A ConfigError past 256 levels, the gateway's limit too."""
    value: object = 1
    for _ in range(depth):
        value = [value]
    up = FakeUpstream(Reply())
    scope = polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)
    settings = polygate.Settings(scopes={"chat": scope, "embed": scope}, cache=cache)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match=r"'tools'.*256"):
            await s.chat(MESSAGES, tools=value)
        with pytest.raises(polygate.ConfigError, match=r"messages.*256"):
            await s.chat([{"role": "user", "content": "x", "extra": value}])
        with pytest.raises(polygate.ConfigError, match="256"):
            s.stream_chat(MESSAGES, tools=value)
        with pytest.raises(polygate.ConfigError, match="256"):
            await s.embed(["x"], extra=value)
    assert up.requests == []


async def test_messages_may_be_any_mapping(autojump_clock: trio.testing.MockClock) -> None:
    """The signature takes Sequence[Mapping]: a probe found a MappingProxyType message
    (or parameter value) refused as 'not JSON-serialisable'.  It goes out as its items,
    and is cached under the same key as the dict."""
    import types

    up = FakeUpstream(Reply(text="ok"))
    scope = polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)
    settings = polygate.Settings(scopes={"chat": scope}, cache="memory")
    frozen = [types.MappingProxyType(dict(m)) for m in MESSAGES]
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        first = await s.chat(frozen, response_format=types.MappingProxyType({"type": "text"}))
        again = await s.chat(MESSAGES, response_format={"type": "text"})
    assert first.text == "ok" and again.call_stats.cached
    assert up.requests[0].body["messages"] == [dict(m) for m in MESSAGES]
    assert up.requests[0].body["response_format"] == {"type": "text"}


async def test_messages_may_be_any_sequence(autojump_clock: trio.testing.MockClock) -> None:
    """Outside review (fuzzing the library's arguments): a ``deque`` of messages (the
    signature takes any Sequence, as ``embed`` takes any Sequence of inputs) was
    refused as 'not JSON-serialisable'.  It goes out as a list."""
    import collections

    up = FakeUpstream(Reply(text="ok"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(collections.deque(MESSAGES))
        async with s.stream_chat(collections.deque(MESSAGES)) as stream:
            text = "".join([chunk.text async for chunk in stream])
    assert r.text == text == "ok"
    assert [request.body["messages"] for request in up.requests] == [list(MESSAGES)] * 2


async def test_params_pass_through(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, model="m1")])})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    async with polygate.session(settings, transport=_router(a=a)) as s:
        await s.chat(MESSAGES, temperature=0.2, tools=tools, response_format={"type": "json_object"})
    body = a.requests[0].body
    assert body["model"] == "m1"
    assert body["temperature"] == 0.2 and body["tools"] == tools
    assert body["response_format"] == {"type": "json_object"}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert a.requests[0].headers["authorization"] == f"Bearer {SECRET}"


async def test_non_streaming_source_sends_plain_json(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=2, tokens=4))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=_router(a=a)) as s:
        r = await s.chat(MESSAGES)
    assert "stream" not in a.requests[0].body
    assert r.call_stats.ttft_ms is None and r.call_stats.stall_ms is None
    assert r.call_stats.generation_ms == pytest.approx(2000)


async def test_stream_request_answered_with_json(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(stream=False, tokens=3))
    async with polygate.session(one_source_settings(), transport=_router(a=a)) as s:
        r = await s.chat(MESSAGES)
    assert r.text and r.call_stats.ttft_ms is None


async def test_an_empty_string_to_embed_is_a_config_error_before_any_io() -> None:
    """Outside review: an empty input was sent upstream (OpenAI refuses it with a 400
    after the round trip)."""
    up = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=up.transport()) as s:
        for inputs in ([""], ["ok", ""]):
            with pytest.raises(polygate.ConfigError, match=r"inputs\[\d\] is an empty string"):
                await s.embed(inputs)
    assert not up.requests


async def test_embed_batches_in_order(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(first_token_s=1))
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], embed_batch_size=3)})
    inputs = [f"text {i}" for i in range(10)]
    async with polygate.session(settings, transport=_router(a=up)) as s:
        start = trio.current_time()
        e = await s.embed(inputs)
        assert trio.current_time() - start == pytest.approx(1)  # batches run concurrently
        single = [(await s.embed([text])).vectors[0] for text in inputs]
    assert len(up.requests) == 4 + 10
    assert e.vectors == single
    assert e.call_stats.attempts == 4
    assert e.call_stats.generation_ms == pytest.approx(4000)  # the sum of the batches
    assert e.call_stats.ttft_ms is None
    assert e.usage is not None and e.usage.prompt_tokens > 0


async def test_stream_chat_over_a_json_upstream_yields_the_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text="whole answer at once", first_token_s=2))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=_router(a=a)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            chunks = [c async for c in stream]
    assert [c.text for c in chunks] == ["whole answer at once"]
    assert stream.response is not None and stream.response.text == "whole answer at once"


async def test_committed_stream_failure_carries_statistics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text="one two three four", first_token_s=1, fault="reset", fault_after=2))
    b = FakeUpstream(Reply())
    settings = two_source_settings(weights=FIRST_A)
    async with polygate.session(settings, transport=_router(a=a, b=b)) as s:
        got = []
        with pytest.raises(polygate.TransientUpstreamError) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    got.append(chunk.text)
    assert "".join(got) == "one two"
    assert b.requests == []  # content was shown: no silent retry elsewhere
    stats = info.value.call_stats
    assert stats is not None and stats.source == "a" and stats.ttft_ms == pytest.approx(1000)


async def test_stream_stalled_statistics_name_the_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=1, inter_token_s=0.5, tokens=6, stall_at=3, stall_s=60))
    settings = one_source_settings(stream=polygate.StreamWatch(stall_timeout_s=4))
    async with polygate.session(settings, transport=_router(a=a)) as s:
        with pytest.raises(polygate.StreamStalled) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
    stats = info.value.call_stats
    assert stats is not None
    assert (stats.source, stats.attempts) == ("a", 1)
    assert stats.ttft_ms == pytest.approx(1000)
    assert stats.generation_ms == pytest.approx((2.0 + 4.0) * 1000)  # sent -> cut


async def test_retry_after_on_503_is_honoured(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream([Reply(status=503, retry_after_s=3), Reply()])
    settings = one_source_settings(retry=polygate.Retry(backoff_base_s=0.01, backoff_max_s=0.01))
    async with polygate.session(settings, transport=_router(a=a)) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.attempts == 2
    assert a.requests[1].started_at == pytest.approx(3.0, abs=0.02)


async def test_permit_waits_are_not_bounded_by_rate_limit_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=100))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)],
        retry=polygate.Retry(rate_limit_wait_s=60))})
    done: list[float] = []
    async with polygate.session(settings, transport=_router(a=a)) as s:

        async def one() -> None:
            await s.chat(MESSAGES)
            done.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
    assert done == [pytest.approx(100), pytest.approx(200)]
    assert a.peak_in_flight == 1


async def test_a_failed_embed_batch_raises_one_error(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream([Reply(), Reply(status=500)], then=Reply(status=500))
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], embed_batch_size=2,
        retry=polygate.Retry(max_attempts=2, backoff_base_s=0))})
    async with polygate.session(settings, transport=_router(a=up)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.embed([f"t{i}" for i in range(4)])
    assert type(info.value) is polygate.AllSourcesExhausted  # not an ExceptionGroup
    assert info.value.call_stats is not None
    assert up.in_flight == 0


async def test_a_failed_embed_call_carries_every_batchs_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (third round): AllSourcesExhausted.errors held only the failing
    batch's errors; another batch's failed attempt (retried, then answered) was counted
    in call_stats.attempts but missing.  Every failed attempt of the call, in order."""
    seen: dict[str, int] = {}

    def behaviour(request: Any, rng: Any) -> Reply:
        text = request.body["input"][0]
        seen[text] = seen.get(text, 0) + 1
        if text == "x0" and seen[text] == 1:
            return Reply(status=503)  # batch 0: fails once, then answers
        if text == "x1":
            return Reply(status=500, headers_delay_s=1)  # batch 1: always fails, later
        return Reply()

    up = FakeUpstream(behaviour)
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], embed_batch_size=1,
        retry=polygate.Retry(backoff_base_s=0.5))})
    async with polygate.session(settings, transport=_router(a=up)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.embed(["x0", "x1"])
    failed = [r for r in up.requests if r.status >= 500]
    errors = info.value.errors
    assert len(errors) == len(failed) == info.value.call_stats.attempts - 1  # x0's second answered
    assert [e.status_code for e in errors] == [503, 500, 500, 500]  # type: ignore[attr-defined]


def _ignores_dimensions(request: httpx.Request) -> httpx.Response:
    """An upstream whose model has one size: 8 dimensions, whatever was asked."""
    inputs = json.loads(request.content)["input"]
    data = [{"object": "embedding", "index": i, "embedding": [0.5] * 8} for i in range(len(inputs))]
    return httpx.Response(200, json={"object": "list", "data": data, "model": "e",
                                     "usage": {"prompt_tokens": 2, "total_tokens": 2}})


async def test_vectors_not_of_the_dimensions_asked_for_are_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (2026-12-02): ``embed(dimensions=4)`` from a source that ignores
    ``dimensions`` returned its 8-dimension vectors as the answer.  Not what was asked
    (a vector store of 4 would refuse them later): a FatalUpstreamError naming both
    sizes, as for sources of different models -- not a failure of the source's health
    (review of that fix: as a transient error, two calls opened its breaker for every
    other call)."""
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=_router(a=httpx.MockTransport(_ignores_dimensions))) as s:
        for _ in range(6):
            with pytest.raises(polygate.FatalUpstreamError, match="8 dimensions to dimensions=4"):
                await s.embed(["x"], dimensions=4)
        unasked = await s.embed(["x", "y"])  # without dimensions, any size is the model's
        state = (await s.statistics()).governance.sources[0].state
    assert {len(v) for v in unasked.vectors} == {8}
    assert state.consecutive_failures == 0 and unasked.call_stats.attempts == 1


@pytest.mark.parametrize("dimensions", [4.0, "4", True, 0, -3])
async def test_dimensions_that_are_not_a_whole_number_are_refused(dimensions: object) -> None:
    """The vectors are held to ``dimensions``: it must be a number to hold them to."""
    async with polygate.session(one_source_settings(), transport=_router(a=FakeUpstream(Reply()))) as s:
        with pytest.raises(polygate.ConfigError, match="dimensions must be a whole number"):
            await s.embed(["x"], scope="chat", dimensions=dimensions)


async def test_embed_batches_of_different_dimensions_are_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (third round): one batch failed over to a source serving another
    model, and the call returned vectors of 8 and of 4 dimensions side by side.  Within
    a batch mixed lengths were already refused; across the batches of a call too now,
    with a message naming both."""

    def a_behaviour(request: Any, rng: Any) -> Reply:
        return Reply(status=503) if "x3" in request.body["input"] else Reply(embedding_dim=8)

    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        embed_batch_size=2)})
    ups = _router(a=FakeUpstream(a_behaviour), b=FakeUpstream(Reply(embedding_dim=4)))
    async with polygate.session(settings, transport=ups) as s:
        with pytest.raises(polygate.FatalUpstreamError, match=r"8 \(source 'a'\), 4 \(source 'b'\)") as info:
            await s.embed([f"x{i}" for i in range(6)])
        same = await s.embed(["x0", "x1", "x2"])  # one source, one dimension: fine
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 4
    assert {len(v) for v in same.vectors} == {8}


async def test_a_cache_partial_hit_of_another_dimension_is_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: with the cache on, a stored vector (8 dimensions, from a) and a fresh
    one from a failover (4, from b) were returned side by side: the check covered the
    batches of one upstream run, not what the cache layer puts together."""

    def a_behaviour(request: Any, rng: Any) -> Reply:
        return Reply(status=503) if "y" in request.body["input"] else Reply(embedding_dim=8)

    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        cache_ttl_s=600)}, cache="memory")
    ups = _router(a=FakeUpstream(a_behaviour), b=FakeUpstream(Reply(embedding_dim=4)))
    async with polygate.session(settings, transport=ups) as s:
        assert len((await s.embed(["x"])).vectors[0]) == 8  # stored, from a
        with pytest.raises(polygate.FatalUpstreamError, match=r"8 \(source 'a'\), 4 \(source 'b'\)") as info:
            await s.embed(["x", "y"])  # x a hit (8); y: a's 503, then b (4)
    # x's stored vector disagreed with y's fresh one, so it was fetched again (a bad
    # entry is a miss): from a, 8 again -- the sources disagree, not the cache.
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 3


def _total_only(request: httpx.Request) -> httpx.Response:
    inputs = json.loads(request.content)["input"]
    return httpx.Response(200, json={
        "object": "list", "model": "e",
        "data": [{"object": "embedding", "index": i, "embedding": [1.0, 2.0]} for i in range(len(inputs))],
        "usage": {"total_tokens": 5 * len(inputs)},
    })


@pytest.mark.parametrize("cache", ["off", "memory"])
async def test_an_embedding_usage_of_total_tokens_alone_is_its_prompt_tokens(cache: str) -> None:
    """Review: an upstream that reports only ``total_tokens`` (Voyage AI) gave
    ``completion_tokens=10, prompt_tokens=0`` (embeddings have no completion), and with
    the cache on the usage was lost altogether (its per-input shares split only
    ``prompt_tokens``): 0 tokens, for the call and every later hit."""
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)}, cache=cache)
    async with polygate.session(settings, transport=httpx.MockTransport(_total_only)) as s:
        first = await s.embed(["x", "y"])
        again = await s.embed(["x", "y"])
    for r in (first, again):
        assert r.usage is not None and r.usage.source == "upstream"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (10, 0, 10)


async def test_embed_honours_ttft_timeout_s_over_the_whole_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: embed() ignored ``Source.ttft_timeout_s``, which bounds the whole of an
    answer that is not streamed (docs/configuration.md), as chat() with a source that
    cannot stream does: a's 60 s answer was waited for in full."""
    settings = polygate.Settings(scopes={"embed": polygate.Scope(sources=[
        polygate.Source(name=n, base_url=f"http://{n}/v1", ttft_timeout_s=5, weight=w)
        for n, w in (("a", 1.0), ("b", 1e-9))])})
    ups = _router(a=FakeUpstream(Reply(headers_delay_s=60)), b=FakeUpstream(Reply(headers_delay_s=1)))
    async with polygate.session(settings, transport=ups) as s:
        r = await s.embed(["x"])
    assert r.source == "b" and trio.current_time() == pytest.approx(6.0)


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_a_call_refused_for_quota_says_when_to_retry(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    """AllSourcesExhausted.retry_after_s: admission refused the call (every source over
    its RPM quota until past the deadline) and says when the first may admit it; None
    when attempts failed for another reason."""
    source = polygate.Source(name="a", base_url="http://a/v1", rpm=1)
    scope = polygate.Scope(sources=[source], call_deadline_s=1.0,
                           retry=polygate.Retry(max_attempts=1))
    settings = polygate.Settings(scopes={kind: scope})
    up = FakeUpstream([Reply(), Reply(status=500)])

    async def once(s: polygate.Session) -> Any:
        return await (s.chat(MESSAGES, scope=kind) if kind == "chat" else s.embed(["x"], scope=kind))

    async with polygate.session(settings, transport=_router(a=up)) as s:
        await once(s)
        await trio.sleep(30)
        with pytest.raises(polygate.AllSourcesExhausted) as refused:
            await once(s)
        await trio.sleep(60)
        with pytest.raises(polygate.AllSourcesExhausted) as failed:
            await once(s)  # admitted; the upstream answers 500
    assert refused.value.errors == []
    assert refused.value.retry_after_s == pytest.approx(30.0)  # refused at once: its window frees at 60 s
    assert failed.value.retry_after_s is None and len(failed.value.errors) == 1


@pytest.mark.parametrize("status", [402, 407])
async def test_a_source_out_of_credit_fails_over_and_is_taken_out(
    autojump_clock: trio.testing.MockClock, status: int
) -> None:
    """Review: a 402 (the source's key is out of credit) or 407 was 'the request is
    wrong': about half the calls failed at once with FatalUpstreamError, forever, while
    source b answered the same request.  It is the source that cannot serve: b answers,
    and a is taken out for the dead cooldown (one request, not one per call)."""
    a = FakeUpstream(Reply(status=status, error_body={"error": {"message": "Insufficient credits"}}))
    b = FakeUpstream(Reply(text="from b"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET) for n in "ab"])})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        texts = [(await s.chat(MESSAGES)).text for _ in range(20)]
    assert texts == ["from b"] * 20
    assert len(a.requests) <= 1


async def test_an_exhausted_call_says_what_the_upstreams_said(autojump_clock: trio.testing.MockClock) -> None:
    """Review: a call refused at admission after a 401 said "no source admitted the call
    (a: dead) after 1 failed attempt(s)", without the 401 nor the upstream's words ("the
    status and the upstream's own message", as docs/troubleshooting.md promises for
    `polygate chat`).  Every AllSourcesExhausted message ends with the last errors,
    the source's key redacted from them."""
    key = "sk-live-WRONGKEY-1234567890"
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=key)])})
    upstream = FakeUpstream(Reply(status=401, error_body={"error": {
        "message": f"Incorrect API key provided: {key}", "type": "invalid_request_error"}}))
    async with polygate.session(settings, transport=Router({"a": upstream})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    message = str(info.value)
    assert message.startswith("no source admitted the call (a: dead) after 1 failed attempt(s)")
    assert "[a] HTTP 401: Incorrect API key provided" in message
    assert key not in message
