"""The response cache through the fake transport under MockClock: hits and their
statistics (seed 000 matrix ⑩), what is and is not stored, per-call overrides, TTL,
stream replay, embeddings per input, coalescing, telemetry rows, statistics."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.cache._backend import CacheBackendError
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, SECRET


def cache_settings(
    *, ttl: float | None = 60.0, cache: str = "memory", rpm: int | None = None,
    names: tuple[str, ...] = ("a",), **scope: Any,
) -> polygate.Settings:
    sources = [
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, rpm=rpm,
                        weight=FIRST_A.get(n, 1.0))
        for n in names
    ]
    return polygate.Settings(
        scopes={
            "chat": polygate.Scope(sources=sources, cache_ttl_s=ttl, **scope),
            "embed": polygate.Scope(sources=sources, cache_ttl_s=ttl),
        },
        cache=cache,
    )


def _sent(up: FakeUpstream) -> int:
    return len([r for r in up.requests if r.path.endswith(("/chat/completions", "/embeddings"))])


class Capture:
    """A recorder that keeps every call row (what telemetry would write)."""

    def __init__(self) -> None:
        self.calls: list[tuple[polygate.CallStats, BaseException | None, bool]] = []

    def attempt(self, ctx: Any, record: Any) -> None:
        return None

    def call(self, ctx: Any, stats: polygate.CallStats, usage: Any, error: BaseException | None,
             output: Mapping[str, Any] | None = None) -> None:
        self.calls.append((stats, error, ctx.streaming_to_caller))


async def _outcome_at(
    out: dict[str, Any], name: str, at: float, call: Callable[[], Awaitable[Any]],
    ended: dict[str, float] | None = None,
) -> None:
    """``call()`` from ``at``: its answer or its polygate error in ``out[name]`` (and,
    with ``ended``, when it ended)."""
    await trio.sleep(at)
    try:
        out[name] = await call()
    except polygate.PolygateError as exc:
        out[name] = exc
    if ended is not None:
        ended[name] = trio.current_time()


# --------------------------------------------------------------------------- hits


async def test_second_identical_call_is_a_hit(autojump_clock: trio.testing.MockClock) -> None:
    """Seed 000 matrix ⑩: a second call with the same key has generation_ms == 0 and
    attempts == 0 — and returns the same content as the first."""
    up = FakeUpstream(Reply(first_token_s=2.0, inter_token_s=0.1, tokens=6))
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        first = await s.chat(MESSAGES)
        start = trio.current_time()
        second = await s.chat(MESSAGES)
        assert trio.current_time() == start  # no upstream time at all
        stats = await s.statistics()
    assert first.call_stats.attempts == 1 and not first.call_stats.cached
    assert first.call_stats.generation_ms > 0
    st = second.call_stats
    assert st.cached is True
    assert st.attempts == 0 and st.hedges == 0 and not st.hedge_won
    assert st.generation_ms == 0 and st.ttft_ms is None
    assert st.stall_ms is None and st.stall_count is None and st.active_generation_ms is None
    assert st.total_latency_ms == 0
    assert st.logical_call_id != first.call_stats.logical_call_id
    for field in ("text", "message", "choices", "usage", "model", "finish_reason", "source", "raw"):
        assert getattr(second, field) == getattr(first, field), field
    assert st.source == first.source == "a"
    assert _sent(up) == 1
    assert stats.cache.hits == 1 and stats.cache.misses == 1 and stats.cache.coalesced == 0
    assert stats.cache.backend == "memory" and stats.cache.hit_rate == 0.5


async def test_a_hit_uses_no_quota(autojump_clock: trio.testing.MockClock) -> None:
    """rpm=1: a second upstream call would wait a minute for the window; a hit does not
    wait and is not admitted at all."""
    up = FakeUpstream(Reply())
    async with polygate.session(cache_settings(rpm=1), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
        before = (await s.statistics()).governance.sources[0].state
        start = trio.current_time()
        for _ in range(5):
            assert (await s.chat(MESSAGES)).call_stats.cached
        assert trio.current_time() == start
        after = (await s.statistics()).governance.sources[0].state
    assert after.admissions == before.admissions == 1
    assert after.requests_in_window == 1
    assert after.reserved_total == before.reserved_total


async def test_hits_are_fresh_copies(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="stable answer"))
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        first = await s.chat(MESSAGES)
        second = await s.chat(MESSAGES)
        second.message["content"] = "tampered"
        second.choices.append({"index": 9})
        third = await s.chat(MESSAGES)
    assert third.message["content"] == first.text == "stable answer"
    assert third.choices == first.choices


async def test_key_follows_the_answer(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply())
    reordered = [{"content": "hello there", "role": "user"}]
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES, temperature=0.5)
        assert (await s.chat(reordered, temperature=0.5)).call_stats.cached  # key order
        assert (await s.chat(MESSAGES, temperature=0.5, user="bob", metadata={"x": "1"},
                             stream_options={"include_usage": False})).call_stats.cached
        assert not (await s.chat(MESSAGES, temperature=0.7)).call_stats.cached
        assert not (await s.chat(MESSAGES, temperature=0.5, max_tokens=5)).call_stats.cached
        assert not (await s.chat([{"role": "user", "content": "hello"}], temperature=0.5)).call_stats.cached
        other = [{"role": "system", "content": "hello there"}]
        assert not (await s.chat(other, temperature=0.5)).call_stats.cached
    assert _sent(up) == 5


# --------------------------------------------------------------------------- what is stored


def _in_schema_order(request: Any, rng: Any) -> Reply:
    """As guided decoding does: the properties in the order the schema lists them."""
    rf = request.body.get("response_format") or {}
    properties = rf.get("json_schema", {}).get("schema", {}).get("properties", {})
    return Reply(text=json.dumps({k: f"the {k}" for k in properties}))


def _two_properties(first: str, second: str) -> dict[str, Any]:
    return {"type": "object", "properties": {first: {"type": "string"}, second: {"type": "string"}}}


@pytest.mark.parametrize("how", ["schema", "response_format"])
async def test_a_schema_listing_its_properties_in_another_order_is_another_key(
    autojump_clock: trio.testing.MockClock, how: str,
) -> None:
    """Review: the key sorted every object's keys, a schema's ``properties`` too; but a
    model writes the properties in the schema's order (a schema asking for its
    ``reasoning`` before its ``answer`` gets it first, and another answer), so the
    reasoning-first call was served the answer-first call's answer.  The same schema
    in the same order is still one key."""
    up = FakeUpstream(_in_schema_order)

    def asked(first: str, second: str) -> dict[str, Any]:
        schema = _two_properties(first, second)
        if how == "schema":
            return {"schema": schema}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}

    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        first = await s.chat(MESSAGES, **asked("answer", "reasoning"))
        second = await s.chat(MESSAGES, **asked("reasoning", "answer"))
        again = await s.chat(MESSAGES, **asked("reasoning", "answer"))
    assert list(json.loads(first.text)) == ["answer", "reasoning"]
    assert list(json.loads(second.text)) == ["reasoning", "answer"]
    assert not second.call_stats.cached and again.call_stats.cached and _sent(up) == 2


class _Text(str):
    """A str subclass, as numpy's ``str_`` (a pandas column's values) is."""


async def test_a_str_subclass_is_the_text_it_equals(autojump_clock: trio.testing.MockClock) -> None:
    """Review: an embedding input (or a scope name) that is a str subclass with
    non-ASCII text was written in the key with ASCII escapes (msgspec refuses the
    subclass; the fallback escaped it), so it never hit what the plain text stored."""
    up = FakeUpstream(Reply())
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        await s.embed(["café"])
        again = await s.embed([_Text("café")])
        await s.chat([{"role": "user", "content": "café"}])
        chat_again = await s.chat([{"role": "user", "content": "café"}], scope=_Text("chat"))
    assert again.call_stats.cached and chat_again.call_stats.cached and _sent(up) == 2


async def test_failures_are_not_stored(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream([Reply(status=400), Reply(status=500), Reply(status=500), Reply(status=500),
                       Reply(text="finally")])
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
        r = await s.chat(MESSAGES)
        assert r.text == "finally" and not r.call_stats.cached
        assert (await s.chat(MESSAGES)).call_stats.cached
    assert _sent(up) == 5


async def test_a_stalled_committed_stream_is_not_stored(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream([Reply(tokens=6, stall_at=3, stall_s=50.0), Reply(text="whole")])
    settings = cache_settings(stream=polygate.StreamWatch(stall_timeout_s=5.0))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StreamStalled):
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
        r = await s.chat(MESSAGES)
    assert r.text == "whole" and not r.call_stats.cached


async def test_cache_false_and_refresh(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream([Reply(text=f"answer {i}") for i in range(1, 8)])
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        assert (await s.chat(MESSAGES, cache=False)).text == "answer 1"   # not written
        assert (await s.chat(MESSAGES, cache=False)).text == "answer 2"   # not read
        assert (await s.chat(MESSAGES)).text == "answer 3"                # miss, written
        assert (await s.chat(MESSAGES)).text == "answer 3"                # hit
        assert (await s.chat(MESSAGES, cache=False)).text == "answer 4"   # not read
        refreshed = await s.chat(MESSAGES, cache="refresh")              # not read, written
        assert refreshed.text == "answer 5" and not refreshed.call_stats.cached
        hit = await s.chat(MESSAGES)
        assert hit.text == "answer 5" and hit.call_stats.cached
        stats = (await s.statistics()).cache
    assert stats.hits == 2 and stats.misses == 2 and stats.writes == 2


async def test_scopes_without_ttl_and_cache_off_never_cache(autojump_clock: trio.testing.MockClock) -> None:
    for settings in (cache_settings(ttl=None), cache_settings(cache="off")):
        up = FakeUpstream(Reply())
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            for _ in range(3):
                assert not (await s.chat(MESSAGES)).call_stats.cached
            stats = (await s.statistics()).cache
        assert _sent(up) == 3
        assert stats.hits == stats.misses == 0


async def test_entries_expire_after_the_ttl(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply())
    async with polygate.session(cache_settings(ttl=10.0), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
        await trio.sleep(9.9)
        assert (await s.chat(MESSAGES)).call_stats.cached
        await trio.sleep(0.1)  # 10 s after the answer was stored: gone
        assert not (await s.chat(MESSAGES)).call_stats.cached
    assert _sent(up) == 2


@pytest.mark.parametrize("value", [None, 1, "yes", "REFRESH", 0.0, [], "off"])
async def test_bad_cache_argument_before_any_io(value: Any, autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply())
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="cache must be True, False or 'refresh'"):
            await s.chat(MESSAGES, cache=value)
        with pytest.raises(polygate.ConfigError, match="cache must be"):
            s.stream_chat(MESSAGES, cache=value)
        with pytest.raises(polygate.ConfigError, match="cache must be"):
            await s.embed(["x"], cache=value)
    assert _sent(up) == 0


# --------------------------------------------------------------------------- streams


async def test_stream_replays_a_hit_as_chunks(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(tokens=6, reasoning_tokens=3, first_token_s=1.0))
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        first = await s.chat(MESSAGES)
        start = trio.current_time()
        async with s.stream_chat(MESSAGES) as stream:
            chunks = [c async for c in stream]
        assert trio.current_time() == start
    assert len(chunks) >= 2
    assert "".join(c.text for c in chunks) == first.text == stream.text
    assert "".join(c.reasoning for c in chunks) == first.message["reasoning_content"]
    assert chunks[0].delta["role"] == "assistant"
    assert chunks[-1].raw["choices"][0]["finish_reason"] == first.finish_reason
    response = stream.response
    assert response is not None
    assert response.call_stats.cached and response.call_stats.attempts == 0
    assert response.message == first.message and response.usage == first.usage
    assert _sent(up) == 1


def _many_choices(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={
        "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": i, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": f"answer {i}"}} for i in range(60)],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    })


@pytest.mark.parametrize("leave", ["break", "cancelled"])
async def test_a_replay_left_early_is_still_a_hit_and_ok(
    autojump_clock: trio.testing.MockClock, leave: str,
) -> None:
    """Outside review (feature pairs): a hit replayed in more chunks than the stream
    holds ahead of its reader (60 choices here), left after one chunk, counted no hit
    and wrote a ``cancelled`` row with ``cached=False``; with fewer chunks, left at the
    same point, a hit and ``ok``.  The answer is complete before the replay begins."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)],
        cache_ttl_s=60)}, cache="memory")
    capture = Capture()
    async with polygate.session(settings, transport=httpx.MockTransport(_many_choices)) as s:
        s._runtime.recorder = capture
        await s.chat(MESSAGES, n=60)
        with trio.CancelScope() as outer:
            async with s.stream_chat(MESSAGES, n=60) as stream:
                async for _ in stream:
                    if leave == "break":
                        break
                    outer.cancel()
                    await trio.lowlevel.checkpoint()
        stats = await s.statistics()
    assert stats.cache is not None and stats.cache.hits == 1, stats.cache
    (replayed, error, streamed) = capture.calls[1]
    assert streamed and error is None
    assert replayed.cached and replayed.source == "a" and replayed.attempts == 0


async def test_a_streamed_answer_is_stored(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(tokens=5))
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            text = "".join([c.text async for c in stream])
        hit = await s.chat(MESSAGES)
    assert hit.call_stats.cached and hit.text == text
    assert _sent(up) == 1


def _tool_body(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={
        "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [
            {"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None,
                "tool_calls": [{"id": "t1", "type": "function",
                                "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}},
            {"index": 1, "finish_reason": "stop", "message": {"role": "assistant", "content": "second"}},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    })


async def test_replay_of_tool_calls_and_other_choices(autojump_clock: trio.testing.MockClock) -> None:
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)],
            cache_ttl_s=60)},
        cache="memory",
    )
    async with polygate.session(settings, transport=httpx.MockTransport(_tool_body)) as s:
        first = await s.chat(MESSAGES, n=2)
        async with s.stream_chat(MESSAGES, n=2) as stream:
            chunks = [c async for c in stream]
    assert first.message["tool_calls"][0]["function"]["name"] == "f"
    calls = [c.delta["tool_calls"] for c in chunks if "tool_calls" in c.delta]
    assert calls == [[{"index": 0, **first.message["tool_calls"][0]}]]
    others = [c.raw["choices"][0] for c in chunks if c.raw["choices"][0]["index"] == 1]
    assert others[0]["delta"]["content"] == "second" and others[0]["finish_reason"] == "stop"
    assert all(c.text == "" for c in chunks)  # the first choice has no content
    assert stream.response is not None and stream.response.choices == first.choices


# --------------------------------------------------------------------------- embeddings


async def test_embed_sends_only_the_misses(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply())
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        plain = await s.embed(["a", "b", "c"], cache=False)
        first = await s.embed(["a", "b"])
        second = await s.embed(["b", "c", "a", "c"])
        third = await s.embed(["c", "a"])
        stats = (await s.statistics()).cache
    bodies = [r.body["input"] for r in up.requests]
    assert bodies == [["a", "b", "c"], ["a", "b"], ["c"]]
    assert first.vectors == plain.vectors[:2]
    assert second.vectors == [plain.vectors[1], plain.vectors[2], plain.vectors[0], plain.vectors[2]]
    assert not second.call_stats.cached and second.call_stats.attempts == 1
    assert third.call_stats.cached and third.call_stats.attempts == 0
    assert third.call_stats.generation_ms == 0
    assert third.vectors == [plain.vectors[2], plain.vectors[0]]
    assert third.usage is not None and first.usage is not None
    # usage of a fully cached call: the stored shares of its inputs' batches
    assert third.usage.prompt_tokens > 0
    assert stats.hits == 2 + 2 and stats.misses == 2 + 1  # per distinct input


async def test_embed_statistics_name_the_scope(autojump_clock: trio.testing.MockClock) -> None:
    """CallStats.scope is the scope for every embed outcome (it was None for a miss
    and a partial hit, set for a hit)."""
    up = FakeUpstream(Reply())
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        uncached = await s.embed(["x"], cache=False)
        miss = await s.embed(["a"])
        partial = await s.embed(["a", "b"])
        hit = await s.embed(["a", "b"])
    assert [r.call_stats.scope for r in (uncached, miss, partial, hit)] == ["embed"] * 4


async def test_embed_usage_shares_add_up(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply())
    texts = ["short", "a much longer input text", "mid length"]
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        first = await s.embed(texts)
        again = await s.embed(texts)
    assert again.call_stats.cached
    assert first.usage is not None and again.usage is not None
    assert again.usage.prompt_tokens == first.usage.prompt_tokens


async def test_embed_upstream_usage_is_what_went_upstream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``usage`` covers every input; ``upstream_usage`` only what this call's own
    requests spent: the same without a cache, the misses' shares on a partial hit,
    nothing on a whole hit, nothing for an input another call's request answered."""
    up = FakeUpstream(Reply(first_token_s=2.0))
    texts = ["short", "a much longer input text", "mid length"]
    out: dict[str, polygate.EmbeddingResponse] = {}
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        plain = await s.embed(texts, cache=False)
        first = await s.embed(texts[:2])
        partial = await s.embed(texts)
        hit = await s.embed(texts)

        async def one(name: str, inputs: list[str], delay: float) -> None:
            await trio.sleep(delay)
            out[name] = await s.embed(inputs)

        async with trio.open_nursery() as nursery:  # "w" is led by one, joined by other
            nursery.start_soon(one, "leader", ["w"], 0.0)
            nursery.start_soon(one, "joined", ["w"], 0.5)
    assert plain.upstream_usage == plain.usage
    assert first.upstream_usage == first.usage
    assert partial.usage is not None and partial.upstream_usage is not None
    assert partial.usage.total_tokens == plain.usage.total_tokens  # type: ignore[union-attr]
    assert 0 < partial.upstream_usage.total_tokens < partial.usage.total_tokens
    assert partial.upstream_usage.total_tokens == (
        partial.usage.total_tokens - first.usage.total_tokens)  # type: ignore[union-attr]
    assert hit.upstream_usage is not None and hit.upstream_usage.total_tokens == 0
    assert out["leader"].upstream_usage == out["leader"].usage
    assert out["joined"].upstream_usage is not None
    assert out["joined"].upstream_usage.total_tokens == 0


# --------------------------------------------------------------------------- coalescing


async def test_identical_calls_in_flight_share_one_upstream_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(first_token_s=5.0, text="shared"))
    results: list[polygate.ChatResponse] = []
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def one(delay: float) -> None:
            await trio.sleep(delay)
            results.append(await s.chat(MESSAGES))

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(one, i * 0.5)
        stats = (await s.statistics()).cache
    assert _sent(up) == 1
    assert all(r.text == "shared" for r in results)
    leaders = [r for r in results if not r.call_stats.cached]
    assert len(leaders) == 1 and leaders[0].call_stats.attempts == 1
    for r in results:
        if r.call_stats.cached:
            assert r.call_stats.attempts == 0 and r.call_stats.generation_ms == 0
    # each waiter's total latency is its own wait: they joined 0.5 s apart
    assert sorted(r.call_stats.total_latency_ms for r in results) == pytest.approx(
        [3000, 3500, 4000, 4500, 5000])
    assert stats.coalesced == 4 and stats.misses == 1 and stats.in_flight == 0


async def test_a_cancelled_waiter_does_not_cancel_the_leader(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(first_token_s=10.0, text="done"))
    capture = Capture()
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        s._runtime.recorder = capture
        leader: list[polygate.ChatResponse] = []

        async def lead() -> None:
            leader.append(await s.chat(MESSAGES))

        async def wait_then_give_up() -> None:
            await trio.sleep(1.0)
            with trio.move_on_after(2.0):
                await s.chat(MESSAGES)
            assert trio.current_time() == pytest.approx(3.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            nursery.start_soon(wait_then_give_up)
    assert leader[0].text == "done" and leader[0].call_stats.attempts == 1
    assert leader[0].call_stats.total_latency_ms == pytest.approx(10_000)
    assert [r.outcome for r in up.requests] == ["complete"]
    errors = [type(e).__name__ for _, e, _ in capture.calls if e is not None]
    assert errors == ["Cancelled"]  # the waiter's own row


async def test_a_cancelled_leader_hands_over_to_a_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(first_token_s=10.0, text="answer"))
    got: list[polygate.ChatResponse] = []
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def lead() -> None:
            with trio.move_on_after(4.0):
                await s.chat(MESSAGES)

        async def wait(delay: float) -> None:
            await trio.sleep(delay)
            got.append(await s.chat(MESSAGES))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            nursery.start_soon(wait, 1.0)
            nursery.start_soon(wait, 2.0)
        stats = (await s.statistics()).cache
    # the leader's request was closed at t=4; one waiter took over (t=4..14)
    assert [r.outcome for r in up.requests] == ["client_closed", "complete"]
    assert all(r.text == "answer" for r in got)
    new_leader = [r for r in got if not r.call_stats.cached]
    assert len(new_leader) == 1
    assert new_leader[0].call_stats.attempts == 1
    # its total latency counts its wait on the first flight too
    assert new_leader[0].call_stats.total_latency_ms in (pytest.approx(13_000), pytest.approx(12_000))
    assert stats.misses == 2 and stats.coalesced == 1


async def test_a_leader_past_its_deadline_hands_over(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(first_token_s=3.0, text="slow"))
    got: list[polygate.ChatResponse] = []
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def lead() -> None:
            with pytest.raises(polygate.DeadlineExceeded):
                await s.chat(MESSAGES, call_deadline_s=2.0)

        async def wait() -> None:
            await trio.sleep(1.0)
            got.append(await s.chat(MESSAGES))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            nursery.start_soon(wait)
    assert got[0].text == "slow" and got[0].call_stats.attempts == 1
    assert trio.current_time() == pytest.approx(5.0)


async def test_a_waiter_keeps_its_own_deadline(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(first_token_s=10.0))
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        results: list[Any] = []

        async def lead() -> None:
            results.append(await s.chat(MESSAGES))

        async def wait() -> None:
            await trio.sleep(1.0)
            with pytest.raises(polygate.DeadlineExceeded) as info:
                await s.chat(MESSAGES, call_deadline_s=2.0)
            assert trio.current_time() == pytest.approx(3.0)
            stats = info.value.call_stats
            assert stats is not None and stats.attempts == 0
            assert stats.total_latency_ms == pytest.approx(2000)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            nursery.start_soon(wait)
    assert results[0].call_stats.attempts == 1
    assert [r.outcome for r in up.requests] == ["complete"]


async def test_a_fatal_answer_is_every_waiters_error(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(status=400, headers_delay_s=2.0))
    errors: list[BaseException] = []
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def one(delay: float) -> None:
            await trio.sleep(delay)
            try:
                await s.chat(MESSAGES)
            except polygate.FatalUpstreamError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i * 0.5)
    assert _sent(up) == 1
    assert len(errors) == 3 and len({id(e) for e in errors}) == 3
    assert all(e.status_code == 400 for e in errors)  # type: ignore[attr-defined]
    waiters = [e for e in errors if e.call_stats is not None and e.call_stats.attempts == 0]  # type: ignore[attr-defined]
    assert len(waiters) == 2


def _prose_then_json(request: Any, rng: Any) -> Reply:
    """A first round answers prose; a re-asked round (one with the answer in its
    history) valid JSON."""
    reasked = any(m["role"] == "assistant" for m in request.body["messages"])
    return Reply(text='{"x": 1}' if reasked else "not json", first_token_s=1.0)


@pytest.mark.parametrize("leader", ["chat", "stream_chat"])
async def test_a_failed_structured_answer_binds_only_waiters_with_no_more_reasks(
    leader: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A leader's ``StructuredOutputError`` is its waiters' answer when the leader had
    as many re-asks as they may make (identical calls would end the same way; asking
    one after another would only queue them: tests/interplay/
    test_f_cache_handover_serialises.py).  A ``stream_chat`` leader never re-asks, so
    a ``chat(schema=...)`` waiter is not handed its error: it leads its own call,
    re-asks and all, as it would alone (docs/cache.md, "Coalescing")."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    up = FakeUpstream(_prose_then_json)
    settings = cache_settings(structured=polygate.Structured(max_reasks=0 if leader == "chat" else 2))
    out: dict[str, Any] = {}
    async with polygate.session(settings, transport=Router({"a": up})) as s:

        async def lead() -> None:
            with pytest.raises(polygate.StructuredOutputError):
                if leader == "chat":
                    await s.chat(MESSAGES, schema=schema)
                    return
                async with s.stream_chat(MESSAGES, schema=schema) as stream:
                    async for _ in stream:
                        pass

        async def wait() -> None:
            await trio.sleep(0.5)
            try:
                out["waiter"] = await s.chat(MESSAGES, schema=schema)
            except polygate.StructuredOutputError as exc:
                out["waiter"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            nursery.start_soon(wait)
    waiter = out["waiter"]
    if leader == "stream_chat":
        assert isinstance(waiter, polygate.ChatResponse), waiter
        assert waiter.parsed == {"x": 1} and waiter.call_stats.reasks == 1
        assert _sent(up) == 3  # the stream's round, the waiter's round and its re-ask
    else:  # max_reasks=0 for both: the leader's verdict is the waiter's
        assert isinstance(waiter, polygate.StructuredOutputError), waiter
        assert waiter.call_stats is not None and waiter.call_stats.attempts == 0
        assert _sent(up) == 1


async def test_embed_calls_coalesce_per_input(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(first_token_s=2.0))
    out: dict[str, polygate.EmbeddingResponse] = {}
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def one(name: str, inputs: list[str], delay: float) -> None:
            await trio.sleep(delay)
            out[name] = await s.embed(inputs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first", ["x", "y"], 0.0)
            nursery.start_soon(one, "second", ["y", "z"], 0.5)
        plain = await s.embed(["x", "y", "z"], cache=False)
    assert [r.body["input"] for r in up.requests][:2] == [["x", "y"], ["z"]]
    assert out["first"].vectors == plain.vectors[:2]
    assert out["second"].vectors == plain.vectors[1:]


def _embed_cache_settings(**scope: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", model="emb")],
        cache_ttl_s=600, **scope)}, cache="memory")


@pytest.mark.parametrize("batch_size", [16, 1])
async def test_an_embed_waiter_is_not_failed_by_another_inputs_refusal(
    autojump_clock: trio.testing.MockClock, batch_size: int
) -> None:
    """Outside review (2026-12-02): call A embeds ["bad", "y"], and the upstream
    refuses any request holding "bad" (400); call B embeds ["y"] while A's run is in
    flight, joining A's flight for "y".  A's 400 was B's answer too, though B's own
    request is valid (and with one input a request, though "y" had been answered).
    The 400 is a verdict on A's request, not on "y": B asks for "y" itself."""

    def behaviour(request: Any, _rng: Any) -> Reply:
        if "bad" in request.body["input"]:
            return Reply(status=400, headers_delay_s=1)
        return Reply(headers_delay_s=0.5)

    up = FakeUpstream(behaviour)
    out: dict[str, Any] = {}
    settings = _embed_cache_settings(embed_batch_size=batch_size,
                                     retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_outcome_at, out, "a", 0.0, partial(s.embed, ["bad", "y"]))
            nursery.start_soon(_outcome_at, out, "b", 0.1, partial(s.embed, ["y"]))
        plain = await s.embed(["y"], cache=False)
    assert isinstance(out["a"], polygate.FatalUpstreamError)
    assert isinstance(out["b"], polygate.EmbeddingResponse), out["b"]
    assert out["b"].vectors == plain.vectors


@pytest.mark.parametrize("status", [400, 500])
async def test_identical_embed_calls_of_several_inputs_share_one_request_and_its_error(
    autojump_clock: trio.testing.MockClock, status: int
) -> None:
    """Review of the fix above: identical calls still make one upstream request, and
    its error (a refusal: they would send the same batch; an outage: any inputs) is
    every one's, after that one request."""
    up = FakeUpstream(Reply(status=status, headers_delay_s=1))
    out: dict[str, Any] = {}
    ended: dict[str, float] = {}
    settings = _embed_cache_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": up})) as s:

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(_outcome_at, out, f"c{i}", 0.1 * i,
                                   partial(s.embed, ["x", "y"]), ended)
    assert len(out) == 3 and len({type(e) for e in out.values()}) == 1
    assert len(up.requests) == 1
    assert max(ended.values()) == pytest.approx(1.0)


async def test_an_embed_waiter_never_reads_another_callers_input_in_a_shared_outage(
    autojump_clock: trio.testing.MockClock, tmp_path: Any
) -> None:
    """Outside review: call A embeds [shared, private], call B embeds [shared] and
    waits on A's flight.  Every attempt of A's run fails with a 500 quoting an input
    of its request: that outage was B's error too, quote and all -- A's private input
    in B's exception and in B's telemetry row (log_content=False).  An outage of a run
    of several inputs binds only a waiter that would send them all; B asks for its
    own."""
    import sqlite3

    private, shared = "patient ZQXMARKER4242 notes", "an ordinary shared sentence"

    def behaviour(request: Any, _rng: Any) -> Reply:
        quoted = request.body["input"][-1]
        return Reply(status=500, headers_delay_s=1,
                     error_body={"error": {"message": f"internal error embedding '{quoted}'"}})

    up = FakeUpstream(behaviour)
    out: dict[str, Any] = {}
    db = tmp_path / "t.db"
    settings = attrs.evolve(_embed_cache_settings(retry=polygate.Retry(max_attempts=1)),
                            telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_outcome_at, out, "a", 0.0, partial(s.embed, [shared, private]))
            nursery.start_soon(_outcome_at, out, "b", 0.1, partial(s.embed, [shared]))
    assert isinstance(out["b"], polygate.AllSourcesExhausted)
    assert "ZQXMARKER4242" not in str(out["b"]) and shared in str(out["b"])  # its own request's
    assert len(up.requests) == 2
    with contextlib.closing(sqlite3.connect(db)) as conn:  # (a bare `with` only commits)
        messages = [m for (m,) in conn.execute(
            "SELECT error_message FROM calls UNION ALL SELECT error_message FROM attempts")]
    assert messages and not any("ZQXMARKER4242" in (m or "") for m in messages), messages


async def test_an_embed_waiter_shares_a_refusal_of_its_input_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request of one input refused: that is a verdict on the input, and every
    call waiting for it gets it (one upstream request, not one each)."""
    up = FakeUpstream(Reply(status=400, headers_delay_s=1))
    out: dict[str, Any] = {}
    settings = _embed_cache_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": up})) as s:

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(_outcome_at, out, f"c{i}", 0.1 * i, partial(s.embed, ["bad"]))
    assert all(isinstance(e, polygate.FatalUpstreamError) for e in out.values()) and len(out) == 3
    assert len(up.requests) == 1


# --------------------------------------------------------------------------- telemetry


@pytest.mark.parametrize("kind", ["embed", "chat", "stream"])
async def test_a_call_cancelled_in_flight_counts_its_attempt_in_its_row(
    autojump_clock: trio.testing.MockClock, kind: str
) -> None:
    """Outside review (hypothesis properties, 2026-12-02): a cached ``embed()``
    cancelled by its caller while its request was in flight wrote a call row with
    ``attempts=0`` beside its attempt row (a run with no statistics of its own, once
    ended, was counted nowhere).  Every kind of call counts the attempt it started."""
    up = FakeUpstream(Reply(first_token_s=1.0, tokens=3))
    capture = Capture()
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        s._runtime.recorder = capture
        with trio.move_on_after(0.2):
            if kind == "embed":
                await s.embed(["hi"])
            elif kind == "chat":
                await s.chat(MESSAGES)
            else:
                async with s.stream_chat(MESSAGES) as stream:
                    async for _ in stream:
                        pass
    assert len(up.requests) == 1
    ((stats, error, _),) = capture.calls
    assert isinstance(error, trio.Cancelled)
    assert stats.attempts == 1


async def test_hits_have_cached_telemetry_rows(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply())
    capture = Capture()
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        s._runtime.recorder = capture
        await s.chat(MESSAGES)
        await s.chat(MESSAGES)
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
        await s.embed(["q"])
        await s.embed(["q"])
    cached = [(st.cached, err, streamed) for st, err, streamed in capture.calls]
    assert cached == [(False, None, False), (True, None, False), (True, None, True),
                      (False, None, False), (True, None, False)]
    assert all(st.attempts == 0 for st, _, _ in capture.calls if st.cached)



@pytest.mark.parametrize("cache", ["memory", "sqlite"])
async def test_a_cancelled_caller_is_not_served_a_hit_and_gets_a_row(
    autojump_clock: trio.testing.MockClock, cache: str, tmp_path: Any,
) -> None:
    """A hit takes a schedule point like any trio operation: a caller already cancelled
    is not served (no hit counted) and still has its call row, saying cancelled."""
    url = "memory" if cache == "memory" else f"sqlite://{tmp_path}/c.db"
    up = FakeUpstream(Reply())
    capture = Capture()
    async with polygate.session(cache_settings(cache=url), transport=Router({"a": up})) as s:
        s._runtime.recorder = capture
        await s.chat(MESSAGES)
        await s.chat(MESSAGES)  # a hit: the entry is readable
        with trio.CancelScope() as scope:
            scope.cancel()
            await s.chat(MESSAGES)
        stats = (await s.statistics()).cache
    assert scope.cancelled_caught
    assert stats.hits == 1
    assert [(st.cached, type(err).__name__) for st, err, _ in capture.calls][-1] == (False, "Cancelled")
    assert _sent(up) == 1


async def test_an_entry_that_does_not_decode_is_a_counted_miss(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A damaged entry on the memory backend: counted in errors, the call goes upstream
    and its answer replaces the entry."""
    up = FakeUpstream(Reply())
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
        backend: Any = s._cache.backend  # type: ignore[union-attr]
        ((key, (_, expires_at)),) = backend._data.items()
        backend._data[key] = (b'{"f": 1, "k": "chat"}', expires_at)
        again = await s.chat(MESSAGES)
        third = await s.chat(MESSAGES)
        stats = (await s.statistics()).cache
    assert not again.call_stats.cached and third.call_stats.cached
    assert (stats.hits, stats.misses, stats.errors) == (1, 2, 1)
    assert _sent(up) == 2

async def test_session_statistics_default_to_off(autojump_clock: trio.testing.MockClock) -> None:
    async with polygate.session(cache_settings(cache="off"), transport=Router({"a": FakeUpstream()})) as s:
        stats = (await s.statistics()).cache
    assert stats.backend == "off" and stats.hit_rate is None


def test_cached_chat_key_ignores_noise_in_the_body() -> None:
    """What the upstream saw does carry the excluded parameters: they are only left
    out of the key."""
    from polygate.cache import EXCLUDED_PARAMS

    assert {"user", "metadata", "stream_options"} <= EXCLUDED_PARAMS
    assert "temperature" not in EXCLUDED_PARAMS and "seed" not in EXCLUDED_PARAMS
    json.dumps(sorted(EXCLUDED_PARAMS))


async def test_an_answer_that_cannot_be_stored_hands_over(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defensive: should an answer fail to encode, its waiters are not left waiting
    for a value that never comes — each asks upstream for itself — and nothing fails."""
    import polygate._cached

    def broken(response: Any) -> bytes:
        raise TypeError("not storable")

    monkeypatch.setattr(polygate._cached, "encode_chat", broken)
    up = FakeUpstream(Reply(first_token_s=1.0, text="unstored"))
    got: list[polygate.ChatResponse] = []
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def one() -> None:
            got.append(await s.chat(MESSAGES))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(one)
        stats = (await s.statistics()).cache
    assert [r.text for r in got] == ["unstored"] * 3
    assert not any(r.call_stats.cached for r in got)
    assert _sent(up) == 3 and stats.errors == 3 and stats.in_flight == 0


async def test_an_answer_too_big_for_the_memory_store_is_a_dropped_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (third round): an answer bigger than the memory backend's whole
    ``max_bytes`` is not stored (docs/cache.md), yet ``writes`` counted it.  It is a
    dropped write, and the next identical call goes upstream."""
    up = FakeUpstream(Reply(text="word " * 1200))
    async with polygate.session(cache_settings(cache="memory?max_bytes=4000"),
                                transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
        again = await s.chat(MESSAGES)
        stats = (await s.statistics()).cache
    assert not again.call_stats.cached and _sent(up) == 2
    assert (stats.writes, stats.writes_dropped, stats.hits, stats.misses) == (0, 2, 0, 2)


async def test_an_embed_waiter_leads_an_abandoned_input_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (third round): a call that led some inputs and waited on others
    looked at the flights it joined only after its own upstream batch: when their leader
    was cancelled, the hand-over waited for that batch, and the call's two upstream
    requests ran one after the other (done at 4.5 s instead of 3 s)."""
    up = FakeUpstream(Reply(embedding_dim=3, first_token_s=2))  # every request takes 2 s
    done: dict[str, float] = {}
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def leader() -> None:  # t=0: leads "a" and "b"; cancelled at t=1
            with trio.move_on_after(1):
                await s.embed(["a", "b"])

        async def waiter() -> None:  # t=0.5: leads "c", waits on "b"
            await trio.sleep(0.5)
            response = await s.embed(["b", "c"])
            assert len(response.vectors) == 2
            done["waiter"] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)
            nursery.start_soon(waiter)
        stats = (await s.statistics()).cache
    assert [(r.body["input"], r.started_at) for r in up.requests] == [
        (["a", "b"], 0), (["c"], 0.5), (["b"], 1)]
    assert done["waiter"] == pytest.approx(3.0)
    assert (stats.misses, stats.coalesced) == (4, 0)


async def test_an_embed_call_that_fails_waiting_still_counts_its_own_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (ninth round): an embed call that sent its misses upstream and then
    ran out of its deadline waiting on another call's input reported attempts=0 (its
    row too), though its own request had gone out and been answered."""
    def slow_for_b(request: Any, rng: Any) -> Reply:
        return Reply(embedding_dim=3, first_token_s=100 if "b" in request.body["input"] else 1)

    up = FakeUpstream(slow_for_b)
    capture = Capture()
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        s._runtime.recorder = capture

        async def leader() -> None:  # leads "b", which takes 100 s
            with trio.move_on_after(50):
                await s.embed(["b"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)
            await trio.sleep(0.5)
            with pytest.raises(polygate.DeadlineExceeded) as info:
                await s.embed(["b", "c"], call_deadline_s=5)  # leads "c" (1 s), waits on "b"
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 1
    rows = [st for st, err, _ in capture.calls if isinstance(err, polygate.DeadlineExceeded)]
    assert [st.attempts for st in rows] == [1]


# --------------------------------------------------------------------------- a waiter that takes over: one clock


def _call_rows(db: Any) -> dict[str, dict[str, Any]]:
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as conn:  # (a bare `with` only commits)
        conn.row_factory = sqlite3.Row
        return {r["logical_call_id"]: dict(r) for r in conn.execute("SELECT * FROM calls")}


async def _leader_cancelled_at_5_waiter_from_1(
    s: polygate.Session, call: Any,
) -> dict[str, Any]:
    """A leader cancelled at t=5, and a waiter that joined its flight at t=1 and
    then leads: what the waiter got (``"r"`` or ``"e"``) and when (``"t"``, from the
    start)."""
    got: dict[str, Any] = {}
    start = trio.current_time()

    async def lead() -> None:
        with trio.move_on_after(5.0):
            await call()

    async def wait() -> None:
        await trio.sleep(1.0)
        try:
            got["r"] = await call()
        except polygate.PolygateError as exc:
            got["e"] = exc
        got["t"] = trio.current_time() - start

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lead)
        nursery.start_soon(wait)
    return got


async def test_a_waiter_that_leads_counts_from_its_own_start_everywhere(
    autojump_clock: trio.testing.MockClock, tmp_path: Any,
) -> None:
    """Review: a waiter that took over an abandoned flight ran its upstream call as a
    new call from the handover: its statistics were patched on success only, so its
    telemetry row started at the handover (total 2 s where the response said 6 s), and
    a DeadlineExceeded named the time that was left ("deadline of 6.0 s", total 6 s)
    instead of the caller's 10 s.  One clock now: the call's own start."""
    db = tmp_path / "t.db"
    up = FakeUpstream([Reply(first_token_s=100.0, tokens=1), Reply(first_token_s=2.0, tokens=1)])
    settings = attrs.evolve(cache_settings(), telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        got = await _leader_cancelled_at_5_waiter_from_1(s, lambda: s.chat(MESSAGES))
    stats = got["r"].call_stats
    assert got["t"] == pytest.approx(7.0) and stats.total_latency_ms == pytest.approx(6000)
    row = _call_rows(db)[stats.logical_call_id]
    assert row["total_latency_ms"] == pytest.approx(6000)
    assert row["outcome"] == "ok"

    db2 = tmp_path / "t2.db"
    up = FakeUpstream(Reply(first_token_s=100.0, tokens=1))
    settings = attrs.evolve(cache_settings(call_deadline_s=10.0), telemetry=f"sqlite://{db2}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        got = await _leader_cancelled_at_5_waiter_from_1(s, lambda: s.chat(MESSAGES))
    error = got["e"]
    assert isinstance(error, polygate.DeadlineExceeded)
    assert got["t"] == pytest.approx(11.0)  # the waiter's own deadline: 1 + 10
    assert "deadline of 10.0 s" in str(error)
    assert error.call_stats is not None and error.call_stats.total_latency_ms == pytest.approx(10_000)
    assert _call_rows(db2)[error.call_stats.logical_call_id]["total_latency_ms"] == pytest.approx(10_000)


async def test_an_embed_waiter_that_leads_counts_from_its_own_start(
    autojump_clock: trio.testing.MockClock, tmp_path: Any,
) -> None:
    """The same for embed: a waiter from t=1 that leads at t=5 and gets a 503 at t=7
    reported 2 s (its call from the handover) in its error and its row."""
    db = tmp_path / "t.db"
    up = FakeUpstream([Reply(first_token_s=100.0), Reply(status=503, headers_delay_s=2.0)])
    settings = attrs.evolve(cache_settings(retry=polygate.Retry(max_attempts=1)), telemetry=f"sqlite://{db}")
    embed_scope = attrs.evolve(settings.scopes["embed"], retry=polygate.Retry(max_attempts=1))
    settings = attrs.evolve(settings, scopes={**settings.scopes, "embed": embed_scope})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        got = await _leader_cancelled_at_5_waiter_from_1(s, lambda: s.embed(["x"]))
    error = got["e"]
    assert isinstance(error, polygate.AllSourcesExhausted) and got["t"] == pytest.approx(7.0)
    assert error.call_stats is not None and error.call_stats.total_latency_ms == pytest.approx(6000)
    assert _call_rows(db)[error.call_stats.logical_call_id]["total_latency_ms"] == pytest.approx(6000)


@pytest.mark.parametrize("fatal", [False, True])
async def test_an_embed_that_leads_and_waits_counts_its_own_attempt_however_it_ends(
    autojump_clock: trio.testing.MockClock, fatal: bool,
) -> None:
    """Review: a call that sends some inputs and waits on another call's flight for the
    others, and ends while its own request is in flight (its deadline; the flight's
    fatal error, which it shares), reported ``attempts=0`` in its error and its row,
    though its request reached the upstream (SPEC §5: attempts started count)."""

    def behaviour(rec: Any, rng: Any) -> Reply:
        if rec.body["input"] == ["a"]:
            return Reply(status=400, headers_delay_s=5.0) if fatal else Reply(headers_delay_s=10.0)
        return Reply(headers_delay_s=10.0)

    up = FakeUpstream(behaviour)
    capture = Capture()
    got: dict[str, BaseException] = {}
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        s._runtime.recorder = capture  # type: ignore[attr-defined]

        async def first() -> None:
            with contextlib.suppress(polygate.PolygateError):
                await s.embed(["a"])

        async def second() -> None:
            await trio.sleep(1.0)
            try:
                await s.embed(["a", "b"], call_deadline_s=None if fatal else 3.0)
            except polygate.PolygateError as exc:
                got["e"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            nursery.start_soon(second)
        stats = await s.statistics()
    error = got["e"]
    assert isinstance(error, polygate.FatalUpstreamError if fatal else polygate.DeadlineExceeded)
    assert [r.body["input"] for r in up.requests] == [["a"], ["b"]]
    assert up.requests[1].outcome == "client_closed"
    assert error.call_stats is not None and error.call_stats.attempts == 1
    [row] = [st for st, e, _ in capture.calls if e is not None and type(e) is type(error)
             and st.logical_call_id == error.call_stats.logical_call_id]
    assert row.attempts == 1
    assert all(src.state.in_flight == 0 and src.state.tokens_reserved == 0
               for src in stats.governance.sources)
    assert stats.cache.in_flight == 0


async def _leader_with_a_deadline_and_a_patient_waiter(
    leader: Any, waiter: Any,
) -> dict[str, Any]:
    """The leader from t=0 and a waiter joining at 0.5; what each call gave."""
    got: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_outcome_at, got, "leader", 0.0, leader)
        nursery.start_soon(_outcome_at, got, "waiter", 0.5, waiter)
    return got


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_a_leader_out_of_its_own_time_is_no_verdict_for_a_patient_waiter(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    """Review: a 429 cooling the only source down for 20 s; the leader (deadline 5 s)
    gave up at once with AllSourcesExhausted, and that error went to the waiter (no
    deadline) as a verdict, though alone it waits the cooldown out and is answered.
    A refusal only because of the leader's time limit hands the flight over."""
    up = FakeUpstream([Reply(status=429, retry_after_s=20, headers_delay_s=1.0), Reply(text="answer")])
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        if kind == "chat":
            got = await _leader_with_a_deadline_and_a_patient_waiter(
                lambda: s.chat(MESSAGES, call_deadline_s=5.0), lambda: s.chat(MESSAGES))
        else:
            got = await _leader_with_a_deadline_and_a_patient_waiter(
                lambda: s.embed(["x"], call_deadline_s=5.0), lambda: s.embed(["x"]))
    assert isinstance(got["leader"], polygate.AllSourcesExhausted)
    answer = polygate.ChatResponse if kind == "chat" else polygate.EmbeddingResponse
    assert isinstance(got["waiter"], answer), got
    assert len(up.requests) == 2  # the waiter's own try, after the cooldown


async def test_a_leader_past_its_rate_limit_wait_hands_over_to_a_later_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Without deadlines: rate_limit_wait_s counts from each call's start, so a waiter
    that joined later has more of it left than the leader that gave up."""
    # the 429 at 5 cools a down until 11: past the leader's 0 + 10, not the waiter's 4 + 10
    up = FakeUpstream([Reply(status=429, retry_after_s=6, headers_delay_s=5.0), Reply(text="answer")])
    settings = cache_settings(retry=polygate.Retry(rate_limit_wait_s=10))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        got: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_outcome_at, got, "leader", 0.0, partial(s.chat, MESSAGES))
            nursery.start_soon(_outcome_at, got, "waiter", 4.0, partial(s.chat, MESSAGES))
    assert isinstance(got["leader"], polygate.AllSourcesExhausted)
    assert isinstance(got["waiter"], polygate.ChatResponse), got
    assert [r.started_at for r in up.requests] == [0.0, 11.0]


async def test_stored_vectors_of_another_length_are_misses_never_a_failed_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the model behind an unchanged source changed (a ``model=None`` source on
    vLLM or Ollama: the key holds ""), and a call with one input cached and one not
    failed with FatalUpstreamError (vectors of different dimensions) for the whole TTL.
    A stored vector of another length than the upstream's now is a counted miss: it is
    fetched again and stored over; a call whose inputs were all such hits is fetched
    again whole."""
    up = FakeUpstream(Reply(), embedding_dim=3)
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        await s.embed(["a"])
        await s.embed(["c"])
        up.embedding_dim = 8  # the same source, another model behind it
        await s.embed(["d"])
        partial = await s.embed(["a", "b"])
        again = await s.embed(["a"])
        mixed = await s.embed(["c", "d"])  # all hits, of two lengths
        stats = (await s.statistics()).cache
    assert [len(v) for v in partial.vectors] == [8, 8]
    assert [r.body["input"] for r in up.requests[2:]] == [["d"], ["b"], ["a"], ["c", "d"]]
    assert again.call_stats.cached and again.vectors == [partial.vectors[0]]
    assert [len(v) for v in mixed.vectors] == [8, 8] and not mixed.call_stats.cached
    assert stats.errors == 2  # one bad entry each time, counted
    assert stats.hits == 1  # "a" at last; the stale hits were not hits


def _attempt_rows(db: Any, logical_call_id: str) -> list[dict[str, Any]]:
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(
            "SELECT * FROM attempts WHERE logical_call_id = ? ORDER BY call_id", (logical_call_id,))]


async def _x_leads_p_and_then_q_after_y_leaves(
    s: polygate.Session, x_from: float,
) -> dict[str, Any]:
    """Y leads q from 0 and is cancelled at 2; X (from ``x_from``) leads p and waits on
    q, then leads q itself: two upstream runs of one logical call.  What X got."""
    got: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        y_scope = trio.CancelScope()

        async def y() -> None:
            with y_scope:
                await s.embed(["q"])

        async def x() -> None:
            await trio.sleep(x_from)
            try:
                got["x"] = await s.embed(["p", "q"])
            except polygate.PolygateError as exc:
                got["x"] = exc

        nursery.start_soon(y)
        nursery.start_soon(x)
        await trio.sleep(2)
        y_scope.cancel()
    return got


async def test_an_embeds_upstream_runs_number_their_attempts_as_one_call(
    autojump_clock: trio.testing.MockClock, tmp_path: Any,
) -> None:
    """Review: each upstream run of a cached embed numbered its attempts from 1, so
    one logical call wrote two attempt rows with the same id ("<call>.1")."""
    db = tmp_path / "t.db"
    up = FakeUpstream(Reply(first_token_s=5))
    settings = attrs.evolve(cache_settings(), telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        got = await _x_leads_p_and_then_q_after_y_leaves(s, 1.0)
    stats = got["x"].call_stats
    assert stats.attempts == 2
    ids = [r["call_id"] for r in _attempt_rows(db, stats.logical_call_id)]
    assert ids == [f"{stats.logical_call_id}.1", f"{stats.logical_call_id}.2"]


async def test_an_embed_that_fails_counts_its_runs_still_in_flight(
    autojump_clock: trio.testing.MockClock, tmp_path: Any,
) -> None:
    """Review: X's run of p failed (a 400 at 3.5) while its run of q (led again after Y
    left) was in flight: the error's statistics and the call row said 1 attempt, with
    2 attempt rows (the fatal one and the cancelled one)."""
    db = tmp_path / "t.db"

    def behaviour(request: Any, rng: Any) -> Reply:
        if "p" in request.body["input"]:
            return Reply(status=400, headers_delay_s=3)
        return Reply(first_token_s=10)

    up = FakeUpstream(behaviour)
    settings = attrs.evolve(cache_settings(), telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        got = await _x_leads_p_and_then_q_after_y_leaves(s, 0.5)
    error = got["x"]
    assert isinstance(error, polygate.FatalUpstreamError)
    stats = error.call_stats
    attempts = _attempt_rows(db, stats.logical_call_id)
    assert sorted(r["error"] for r in attempts) == ["cancelled", "fatal"]
    assert stats.attempts == len(attempts) == _call_rows(db)[stats.logical_call_id]["attempts"]


class _Stops(list[str]):
    pass


class _Pair(tuple[str, str]):
    pass


async def test_list_and_tuple_subclasses_are_cached_as_the_lists_they_are_sent_as(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: the key took only exact lists and tuples, so with the cache on a call with
    a list subclass (a NamedTuple, a list type of the caller's) failed with a bare
    TypeError, where the same call without a cache was sent as JSON arrays."""
    from typing import NamedTuple

    class Pair(NamedTuple):
        a: str
        b: str

    up = FakeUpstream(Reply(text="ok"))
    parts = _Stops([{"type": "text", "text": "hi"}])  # type: ignore[list-item]
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        for stop in (_Stops(["\n"]), Pair("x", "y"), _Pair(("x", "y"))):
            first = await s.chat(MESSAGES, stop=stop)
            again = await s.chat(MESSAGES, stop=list(stop))  # the same request on the wire
            assert first.text == again.text == "ok" and again.call_stats.cached
        assert (await s.chat([{"role": "user", "content": parts}])).text == "ok"
        async with s.stream_chat([{"role": "user", "content": parts}]) as stream:
            assert "".join([c.text async for c in stream]) == "ok"
        assert (await s.embed(["a"], extra=_Stops(["x"]))).vectors
    assert [r.body.get("stop") for r in up.requests if "stop" in r.body] == [["\n"], ["x", "y"]]


def _with_fallback(path: Any, large_model: str, *, fallback: bool = True) -> polygate.Settings:
    return polygate.Settings(
        scopes={
            "chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://a/v1", model="small")],
                fallback="large" if fallback else None, cache_ttl_s=3600,
                retry=polygate.Retry(max_attempts=1),
            ),
            "large": polygate.Scope(
                sources=[polygate.Source(name="b", base_url="http://b/v1", model=large_model)],
            ),
        },
        cache=f"sqlite://{path}",
    )


async def test_pointing_a_fallback_scope_at_another_model_is_a_new_key(tmp_path: Any) -> None:
    """review: the key held the asked scope's models only, so an answer its fallback
    scope gave was served after that scope was pointed at another model."""
    path = tmp_path / "c.db"
    down = FakeUpstream(Reply(status=500))
    old = FakeUpstream(Reply(text="from the old model"))
    async with polygate.session(_with_fallback(path, "large-v1"), transport=Router({"a": down, "b": old})) as s:
        first = await s.chat(MESSAGES)
        assert first.call_stats.scope == "large"
        assert (await s.chat(MESSAGES)).call_stats.cached  # (the same models: a hit)
    new = FakeUpstream(Reply(text="from the new model"))
    async with polygate.session(_with_fallback(path, "large-v2"), transport=Router({"a": down, "b": new})) as s:
        again = await s.chat(MESSAGES)
    assert again.text == "from the new model" and not again.call_stats.cached


def test_a_scope_without_a_fallback_keeps_its_key() -> None:
    """Only a scope with a fallback has the chain's models in its key: every other
    scope's entries stay valid across this change."""
    from polygate.cache import Cache
    from polygate.cache._memory import MemoryBackend

    cache = Cache(MemoryBackend(10, 10_000))
    scopes = _with_fallback("/x.db", "large-v1", fallback=False).scopes
    assert cache.models("chat", scopes) == ["small"]
    cache = Cache(MemoryBackend(10, 10_000))
    assert cache.models("chat", _with_fallback("/x.db", "large-v1").scopes) == ["small", "fallback large: large-v1"]


def _strict_about_integers(request: Any, rng: Any) -> Reply:
    """OpenAI's answer to ``"max_tokens": 100.0``: a 400 (an integer is expected)."""
    if isinstance(request.body.get("max_tokens"), float):
        return Reply(status=400, headers_delay_s=1.0, error_body={"error": {
            "message": "Invalid type for 'max_tokens': expected an integer, but got a "
                       "decimal number instead.", "type": "invalid_request_error"}})
    return Reply(text="fine", first_token_s=1.0)


@pytest.mark.parametrize(("leader", "waiter", "shared"), [
    (100.0, 100, False),   # one key, two requests on the wire: the refusal is not the waiter's
    (100.0, 100.0, True),  # the same request: the verdict is shared (one upstream call)
])
async def test_a_refusal_binds_only_a_waiter_that_sends_the_same_bytes(
    autojump_clock: trio.testing.MockClock, leader: float, waiter: float, shared: bool,
) -> None:
    """review: ``max_tokens=100.0`` and ``100`` share a key (a number is its value), and a
    waiter took the leader's FatalUpstreamError as its own though its request, sent
    alone, is answered."""
    up = FakeUpstream(_strict_about_integers)
    out: dict[str, Any] = {}
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:

        async def one(name: str, delay: float, max_tokens: float) -> None:
            await trio.sleep(delay)
            try:
                out[name] = await s.chat(MESSAGES, max_tokens=max_tokens)
            except polygate.PolygateError as exc:
                out[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "leader", 0.0, leader)
            nursery.start_soon(one, "waiter", 0.1, waiter)
    assert isinstance(out["leader"], polygate.FatalUpstreamError)
    if shared:
        assert isinstance(out["waiter"], polygate.FatalUpstreamError) and _sent(up) == 1
    else:
        assert isinstance(out["waiter"], polygate.ChatResponse) and out["waiter"].text == "fine"
        assert [r.body["max_tokens"] for r in up.requests] == [100.0, 100]


async def test_waiters_refused_for_another_request_ask_at_once_not_in_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review of the fix above: it compared every parameter, so five callers asking the
    same thing for five end users (``user`` is left out of the key) each led in turn
    after the previous refusal, and the later ones ran out of their deadline.  The
    refusal is not theirs (a left-out parameter may be what was refused, and the
    refusal may quote it: see the next test), so each asks for itself: all at once
    when the leader's refusal comes, never one after another."""
    def refuse(request: Any, rng: Any) -> Reply:
        return Reply(status=400, headers_delay_s=1.0, error_body={"error": {
            "message": "Invalid value for 'temperature'", "type": "invalid_request_error"}})

    up = FakeUpstream(refuse)
    ended: dict[int, tuple[str, float]] = {}
    async with polygate.session(cache_settings(call_deadline_s=3.0), transport=Router({"a": up})) as s:

        async def one(n: int) -> None:
            await trio.sleep(0.01 * n)
            try:
                await s.chat(MESSAGES, temperature=9, user=f"end-user-{n}",
                             metadata={"n": str(n)})
            except polygate.PolygateError as exc:
                ended[n] = (type(exc).__name__, trio.current_time())

        async with trio.open_nursery() as nursery:
            for n in range(5):
                nursery.start_soon(one, n)
    assert {kind for kind, _ in ended.values()} == {"FatalUpstreamError"}
    assert max(t for _, t in ended.values()) == pytest.approx(2.0) and _sent(up) == 5


def _asking(s: polygate.Session, kind: str) -> Callable[..., Awaitable[Any]]:
    """``ask(text, **params)``: a chat of one message, or an embedding of one input."""
    def ask(text: str, **params: Any) -> Awaitable[Any]:
        if kind == "chat":
            return s.chat([{"role": "user", "content": text}], **params)
        return s.embed([text], **params)

    return ask


def _failing_when(
    fails: Callable[[Any], bool], status: int, error: Callable[[Any], Mapping[str, Any]],
) -> Callable[[Any, Any], Reply]:
    """An upstream that answers ``status`` with ``error(body)`` (after 1 s, so that
    others join the flight) to a request whose body ``fails``, and "fine" to others."""
    def behave(request: Any, _rng: Any) -> Reply:
        if isinstance(request.body, dict) and fails(request.body):
            return Reply(status=status, headers_delay_s=1.0, error_body={"error": error(request.body)})
        return Reply(text="fine", first_token_s=1.0)

    return behave


#: OpenAI's own 400 for ``metadata`` without ``store``, quoting nothing else.
_refuse_metadata_without_store = _failing_when(
    lambda body: body.get("metadata") and not body.get("store"), 400,
    lambda body: {"message": f"'metadata' {body['metadata']} is only allowed when 'store' is enabled.",
                  "type": "invalid_request_error", "param": "metadata"})


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_a_refusal_of_a_left_out_parameter_is_not_a_waiters_with_a_valid_request(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    """Outside review (feature pairs): the key leaves out ``metadata`` and ``store``
    (they do not change an answer), but they decide whether a request is taken.
    Alice's ``metadata`` without ``store`` is refused; Bob, the same prompt with
    ``store=True``, joined her flight and got her refusal (quoting her ``metadata``),
    where alone he is answered.  A refusal binds only a waiter that sends the same
    JSON, every parameter included."""
    up = FakeUpstream(_refuse_metadata_without_store)
    out: dict[str, Any] = {}
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        ask = _asking(s, kind)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_outcome_at, out, "alice", 0.0,
                               partial(ask, "hi", metadata={"tenant": "alice-private"}))
            nursery.start_soon(_outcome_at, out, "bob", 0.1,
                               partial(ask, "hi", metadata={"tenant": "bob"}, store=True))
            # A waiter that sends the same JSON as its leader still shares its refusal.
            for who in ("carol", "dave"):
                nursery.start_soon(_outcome_at, out, who, 0.2,
                                   partial(ask, "other", metadata={"tenant": "shared"}))
    assert isinstance(out["alice"], polygate.FatalUpstreamError)
    assert not isinstance(out["bob"], BaseException), out["bob"]
    assert "alice-private" not in repr(out["bob"])
    assert isinstance(out["carol"], polygate.FatalUpstreamError)
    assert isinstance(out["dave"], polygate.FatalUpstreamError)
    assert _sent(up) == 3  # alice, bob, and one for carol and dave


#: An upstream that fails only for Alice's end user, and says whom it failed for (a
#: per-user budget, an account in trouble).
_fail_for_alices_user = _failing_when(
    lambda body: body.get("user") == "alice-private-7731", 500,
    lambda body: {"message": "internal failure for user alice-private-7731", "type": "server_error"})


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_an_outage_binds_only_a_waiter_that_sends_the_same_json(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    """Outside review (tenants of one gateway): Alice's call failed on every attempt
    (AllSourcesExhausted), and Bob, the same prompt with another ``user``, joined her
    flight and got her error, quoting her ``user`` three times, where alone he is
    answered.  As a refusal, an outage with an upstream's failure in it binds only a
    waiter that sends the same JSON."""
    up = FakeUpstream(_fail_for_alices_user)
    out: dict[str, Any] = {}
    settings = cache_settings(retry=polygate.Retry(max_attempts=2, backoff_base_s=0.0))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        ask = _asking(s, kind)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_outcome_at, out, "alice", 0.0,
                               partial(ask, "hi", user="alice-private-7731"))
            nursery.start_soon(_outcome_at, out, "bob", 0.1, partial(ask, "hi", user="bob"))
            # An identical call still shares the outage: nobody queues to hear it again.
            nursery.start_soon(_outcome_at, out, "alice again", 0.2,
                               partial(ask, "hi", user="alice-private-7731"))
    assert isinstance(out["alice"], polygate.AllSourcesExhausted)
    assert "alice-private-7731" in str(out["alice"])
    assert not isinstance(out["bob"], BaseException), out["bob"]
    assert isinstance(out["alice again"], polygate.AllSourcesExhausted), out["alice again"]
    users = [r.body.get("user") for r in up.requests]
    assert users.count("bob") == 1 and set(users) == {"alice-private-7731", "bob"}, users


async def test_a_waiter_that_asks_for_itself_leads_a_flight_identical_calls_join(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix above: a chat waiter that a refusal did not bind asked without
    a flight, so an identical call that came meanwhile asked upstream again (embed's
    did join)."""
    up = FakeUpstream(_refuse_metadata_without_store)
    out: dict[str, Any] = {}
    async with polygate.session(cache_settings(), transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_outcome_at, out, "alice", 0.0,
                               partial(s.chat, MESSAGES, metadata={"t": "a"}))
            nursery.start_soon(_outcome_at, out, "bob", 0.1,
                               partial(s.chat, MESSAGES, metadata={"t": "b"}, store=True))
            nursery.start_soon(_outcome_at, out, "carol", 1.5,  # while bob asks
                               partial(s.chat, MESSAGES, metadata={"t": "b"}, store=True))
        stats = (await s.statistics()).cache
    assert isinstance(out["alice"], polygate.FatalUpstreamError)
    assert out["bob"].text == out["carol"].text == "fine"
    assert out["carol"].call_stats.cached and _sent(up) == 2
    assert stats is not None and (stats.misses, stats.coalesced) == (2, 1)


async def test_embeddings_keep_their_key_when_a_fallback_chat_model_changes(tmp_path: Any) -> None:
    """review of the fix above: embeddings never fall back (vectors of another model do
    not compare), so the fallback chain's models are not in their keys."""
    path = tmp_path / "c.db"
    for model in ("large-v1", "large-v2"):
        settings = _with_fallback(path, model)
        scopes = {**settings.scopes, "embed": attrs.evolve(settings.scopes["chat"])}
        up = FakeUpstream(Reply())
        async with polygate.session(attrs.evolve(settings, scopes=scopes),
                                    transport=Router({"a": up})) as s:
            r = await s.embed(["a"])
        assert r.call_stats.cached == (model == "large-v2")


class _Down:
    """A cache backend that fails every lookup until ``up``."""

    name = "down"
    write_behind = False

    def __init__(self) -> None:
        self.up = False

    async def start(self) -> str | None:
        return None

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        await trio.lowlevel.checkpoint()
        if not self.up:
            raise CacheBackendError("down: connection refused")
        return [None] * len(keys)

    async def set_many(self, entries: Any) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        pass


async def test_the_end_of_a_logged_outage_is_said_once_even_after_a_bad_entrys_warning(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a bad entry's warning during an outage (an answer that could not be
    stored: the backend is not at fault) cleared the mark of the outage, and its end
    went unsaid."""
    from polygate.cache._cache import Cache

    caplog.set_level(logging.INFO, logger="polygate.cache")
    backend = _Down()
    cache = Cache(backend)  # type: ignore[arg-type]
    assert await cache.get_many(["k"]) == [None]  # the outage: "fails open"
    await trio.sleep(11)
    cache.failed("an answer could not be stored (TypeError)", pause=False)
    await trio.sleep(31)
    backend.up = True
    assert await cache.get_many(["k"]) == [None]
    assert await cache.get_many(["k"]) == [None]
    said = [r.getMessage() for r in caplog.records if r.name == "polygate.cache"]
    assert sum(line.startswith("the cache answers again") for line in said) == 1, said


async def test_a_second_outage_soon_after_the_first_ends_is_said(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """An incidents review: the outage warning was limited to one every 10 s alone, so
    a second outage within 10 s of the first's logged end went unsaid, and the log's
    last word was that the cache answered while every lookup failed open."""
    from polygate.cache._cache import Cache

    caplog.set_level(logging.INFO, logger="polygate.cache")
    backend = _Down()
    cache = Cache(backend)  # type: ignore[arg-type]
    for _ in range(2):  # down, up, down again within 10 s, up again
        backend.up = False
        assert await cache.get_many(["k"]) == [None]
        await trio.sleep(1)  # (the pause after a failure)
        backend.up = True
        assert await cache.get_many(["k"]) == [None]
        await trio.sleep(1)
    said = [r.getMessage() for r in caplog.records if r.name == "polygate.cache"]
    kinds = ["down" if "fails open" in line else "up" for line in said]
    assert kinds == ["down", "up", "down", "up"], said


_DEEP_UNDER_A_LOW_LIMIT = """
import sys, trio, polygate
from polygate.testing import FakeUpstream, Reply
settings = polygate.Settings(cache="memory", scopes={"chat": polygate.Scope(
    sources=[polygate.Source(name="a", base_url="http://u/v1", model="m")], cache_ttl_s=60)})
value = 1
for _ in range(250):
    value = [value]
messages = [{"role": "user", "content": [{"type": "text", "text": "x", "extra": value}]}]
async def main():
    async with polygate.session(settings, transport=FakeUpstream(Reply(text="ok")).transport()) as s:
        sys.setrecursionlimit(500)
        print((await s.chat(messages)).text)
        print(len((await s.embed(["hello"], scope="chat", extra=value)).vectors))
trio.run(main)
"""


def test_messages_nested_near_a_lowered_recursion_limit_are_answered_uncached() -> None:
    """Review (interpreter flags): nested 250 levels (under the 256 allowed) with the
    recursion limit lowered to 500, the cache key's walk (two frames a level before
    Python 3.12) raised a bare RecursionError out of chat(), and (review of the fix)
    out of embed() with such parameters."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DEEP_UNDER_A_LOW_LIMIT], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["ok", "1"], done.stderr[-1500:]
