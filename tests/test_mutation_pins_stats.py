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
WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)


def _src(name: str, weight: float = 1.0, **kw) -> polygate.Source:
    return polygate.Source(name=name, base_url=f"http://{name}/v1", api_key=SECRET, weight=weight, **kw)


async def test_a_deadline_during_a_continuations_first_token_wait_counts_the_resume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``max(len(segments), ctx.resumes)`` -> ``len(segments)``): a is cut after
    ten tokens, the continuation on b sends nothing, and the deadline ends the call
    while it waits.  The stream was resumed once: its DeadlineExceeded statistics
    say resumes=1 (the mutant: 0, the cut segment being the committed record)."""
    a = FakeUpstream(Reply(text=ANSWER, first_token_s=1, inter_token_s=0.1,
                           fault="truncated", fault_after=10))
    b = FakeUpstream(Reply(text=ANSWER, first_token_s=1000))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)],
        stream=polygate.StreamWatch(resume=True), call_deadline_s=8)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
    assert len(b.requests) == 1
    stats = info.value.call_stats
    assert stats is not None and stats.resumes == 1, stats


def _scopes(**scopes) -> polygate.Settings:
    built = {}
    for name, spec in scopes.items():
        spec = dict(spec)
        sources = [_src(n, **kw) for n, kw in spec.pop("sources").items()]
        built[name] = polygate.Scope(sources=sources, **spec)
    return polygate.Settings(scopes=built)


async def test_a_stream_no_fallback_could_continue_reports_the_scope_of_its_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (the statistics' scope always the call's current scope): a committed stream
    on a (scope chat, its only source) is cut; its continuation moves to the fallback
    scope, whose source fails; the caller's error is the stream's own failure, with
    the stream's statistics: source a, so scope chat (the mutant: source a in scope
    "large", a pair that never was)."""
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=10))
    b = FakeUpstream(Reply(status=500))
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "large", "stream": polygate.StreamWatch(resume=True),
              "retry": polygate.Retry(max_attempts=1)},
        large={"sources": {"b": {}}, "retry": polygate.Retry(max_attempts=1)},
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.UpstreamError) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
    assert len(b.requests) == 1
    stats = info.value.call_stats
    assert stats is not None and (stats.source, stats.scope) == ("a", "chat"), stats


def _sse(*deltas, end: bool) -> bytes:
    import json
    out = b""
    for i, d in enumerate(deltas):
        finish = "stop" if end and i == len(deltas) - 1 else None
        body = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}
        out += b"data: " + json.dumps(body).encode() + b"\n\n"
    return out + (b"data: [DONE]\n\n" if end else b"")


async def test_a_resumed_streams_reasoning_field_holds_every_segments_reasoning(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``"reasoning" in message`` dropped): a streams its thoughts as
    reasoning_content and is cut; the continuation comes from b, a source that cannot
    stream, whose JSON message carries its thoughts in both reasoning_content and
    reasoning (vLLM sends both).  The answer's message keeps every segment's
    reasoning, as shown, in reasoning_content -- and in the "reasoning" field the last
    segment brought too; the mutant left that field with b's thoughts alone."""
    import httpx

    cut = _sse({"role": "assistant", "reasoning_content": "Think A. "},
               {"content": "alpha beta gamma"}, end=False)
    rest = {"id": "c", "object": "chat.completion", "model": "m", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": " delta",
            "reasoning_content": "Think B. ", "reasoning": "Think B. "}}]}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=cut)
        return httpx.Response(200, json=rest)

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9, streaming=False)],
        stream=polygate.StreamWatch(resume=True))})
    async with polygate.session(settings, transport=httpx.MockTransport(answer)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    r = stream.response
    assert r is not None and r.call_stats.resumes == 1 and r.text == "alpha beta gamma delta"
    message = r.raw["choices"][0]["message"]
    assert message["reasoning_content"] == "Think A. Think B. "
    assert message.get("reasoning") == "Think A. Think B. ", message


def _event(delta, usage=None, finish=None) -> bytes:
    import json
    body = {"id": "c", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def test_a_last_segment_reporting_no_completion_for_its_text_is_estimated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``usage.prompt_tokens and (usage.completion_tokens or not shown_tokens)`` ->
    ``usage.prompt_tokens``): the continuation showed " gamma delta epsilon" and its
    final usage chunk reports its prompt but no completion (completion_tokens 0).
    The summed usage counts that segment's completion as estimated from what it
    showed (five tokens at four characters a token), never as 0; the mutant took the
    0 as reported, and called the sum "upstream"."""
    import httpx

    cut = _event({"role": "assistant", "content": "alpha beta"},
                 {"prompt_tokens": 46, "completion_tokens": 2, "total_tokens": 48})
    rest = (_event({"role": "assistant", "content": " gamma delta epsilon"})
            + _event({}, None, "stop")
            + b'data: {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [], '
              b'"usage": {"prompt_tokens": 60, "completion_tokens": 0, "total_tokens": 60}}\n\n'
            + b"data: [DONE]\n\n")
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"},
        content=cut if request.url.host == "a" else rest))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[_src("a"), _src("b", 1e-9)], stream=polygate.StreamWatch(resume=True))})
    async with polygate.session(settings, transport=transport) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    r = stream.response
    assert r is not None and r.call_stats.resumes == 1 and r.text == "alpha beta gamma delta epsilon"
    shown_b = (len(" gamma delta epsilon") + 3) // 4
    assert r.usage is not None and r.usage.source == "estimated", r.usage
    assert r.usage.completion_tokens >= 3 + shown_b, r.usage
