"""Follow-ups of the fixes of 2026-12-02, found by a review of their diff: what they
broke or left half done (each test failed before its fix)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pydantic
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import SECRET
from .test_failover import ANSWER, MESSAGES, WORDS, _continuing, _scopes

# ------------------------------------------------------------------ (1) breakers / fallback


async def test_open_breakers_in_a_chain_whose_fallback_is_down_longer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """2b06ed6: a call whose scope's breakers are all open moves to the fallback at once.
    When the fallback's breakers are open too (and for longer), the call now waits out
    the *fallback's* open period (15-30 s here, past the 10 s deadline) instead of the
    asked scope's (<= 1 s), whose probe would have answered: the call fails where it
    used to succeed.  Moving on "at once" only helps when the fallback can take it."""
    a_up = FakeUpstream([Reply(status=500), Reply(text="a is back")])
    b_up = FakeUpstream(Reply(status=500))
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "large", "retry": polygate.Retry(max_attempts=1),
              "breaker": polygate.Breaker(failures=1, open_s=1.0, max_open_s=1.0),
              "call_deadline_s": 10},
        large={"sources": {"b": {}}, "retry": polygate.Retry(max_attempts=1),
               "breaker": polygate.Breaker(failures=1, open_s=30.0, max_open_s=30.0)},
    )
    async with polygate.session(settings, transport=Router({"a": a_up, "b": b_up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)  # a fails (its breaker opens), b fails (opens)
        # a recovers (its next reply); b is still down
        r = await s.chat(MESSAGES)
    assert r.text == "a is back"


# ------------------------------------------------------------------ (2) deadline statistics


async def test_a_deadline_cutting_a_resumed_stream_keeps_the_whole_streams_statistics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """652c14d: a deadline that cuts a committed stream reports "as a streamed winner, up
    to the failure" (docs/statistics.md), as a resumed stream's other errors do ("every
    resumed segment included", docs/reference.md).  For a resumed stream it takes the
    last segment alone: ttft is the continuation's own (3 s after *its* request), not
    the stream's first token (1 s), and generation leaves out the first segment."""
    a = FakeUpstream(Reply(text=ANSWER, first_token_s=1, inter_token_s=0.1,
                           fault="truncated", fault_after=10))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[10:]), first_token_s=3, inter_token_s=1))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True), "call_deadline_s": 8,
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
    stats = info.value.call_stats
    assert stats is not None and stats.resumes == 1 and stats.source == "b"
    assert stats.ttft_ms == pytest.approx(1000)  # the stream's first token, from a
    # a: 1 s + 0.9 s of tokens before the cut; b: from its request to the deadline
    assert stats.generation_ms > 7000


# ------------------------------------------------------------------ (3) TextParts in extras


def _sse(*chunks: dict[str, Any]) -> bytes:
    out = b""
    for c in chunks:
        out += b"data: " + json.dumps(c).encode() + b"\n\n"
    return out + b"data: [DONE]\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_an_indexed_extra_whose_text_turns_into_a_list_is_not_a_type_error() -> None:
    """e255ee8: joined text of an indexed extra is held as TextParts, a *list*
    subclass; a later fragment whose value for that field is a list is merged into it
    as list items (_merge_fields checks ``isinstance(old, list)`` first), and the join
    then meets a dict: a bare TypeError out of the call.  Before, a string followed by
    a list was "last wins" (docs: scalars last wins, lists accumulate)."""
    body = _sse(
        _chunk({"role": "assistant", "content": "hi",
                "reasoning_details": [{"index": 0, "type": "reasoning.text", "text": "a"}]}),
        _chunk({"reasoning_details": [{"index": 0, "text": "b"}]}),
        _chunk({"reasoning_details": [{"index": 0, "text": [{"x": 1}]}]}),
        _chunk({}, finish="stop"),
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    settings = _scopes(chat={"sources": {"a": {}}, "retry": polygate.Retry(max_attempts=1)})
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        # (now: AllSourcesExhausted, "[a] malformed upstream body (TypeError):
        # sequence item 2: expected str instance, dict found": a breaker failure)
        r = await s.chat(MESSAGES)
    assert r.text == "hi"


# ------------------------------------------------------------------ (4) _bounded_open


async def test_a_sink_opened_after_an_outside_cancel_is_closed() -> None:
    """316ed99: a sink the bound gave up on is closed by the thread that opened it.
    When the opening is cancelled from *outside* (the session's opening cancelled:
    a startup timeout, an aio task cancelled, Ctrl-C), ``given_up`` is never set, and
    the sink the thread opens afterwards is held for the process's life."""
    from polygate.telemetry import _open

    release = threading.Event()
    closed: list[bool] = []

    class FakeSink:
        def close(self) -> None:
            closed.append(True)

    def opener() -> FakeSink:
        release.wait(10)
        return FakeSink()

    done = threading.Event()
    real = _open.run_sync if hasattr(_open, "run_sync") else None
    assert real is not None

    async def run_sync_tracking(fn: Any, **kw: Any) -> Any:
        def tracked() -> Any:
            try:
                return fn()
            finally:
                done.set()
        return await real(tracked, **kw)

    _open.run_sync = run_sync_tracking  # type: ignore[assignment]
    try:
        with trio.move_on_after(0.2):  # the caller's own bound, not _bounded_open's
            await _open._bounded_open("sqlite:///x.db", opener)
        release.set()
        assert await trio.to_thread.run_sync(done.wait, 10)
    finally:
        _open.run_sync = real  # type: ignore[assignment]
        release.set()
    assert closed == [True]


# ------------------------------------------------------------------ (6) re-ask start


class Answer(pydantic.BaseModel):
    city: str
    population: int


GOOD = '{"city": "Paris", "population": 2100000}'
NOT_JSON = "Paris, about two million people."
CONTEXT_400 = Reply(status=400, error_body={"error": {
    "message": "This model's maximum context length is 8192 tokens.",
    "type": "invalid_request_error", "code": "context_length_exceeded"}})


async def test_a_reask_started_past_the_asked_scope_still_demotes_its_failed_sources(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """f5d366f: a re-ask now starts in the first scope that did not refuse the context,
    but the sources it puts at the back are still computed for the *asked* scope
    (``_failed_sources(ctx, scope_name)``): b1, which failed in this call in round 1,
    is asked first again in round 2 (docs: a re-ask starts behind the sources that
    already failed in this call)."""
    small = FakeUpstream(CONTEXT_400)
    b1 = FakeUpstream(Reply(status=503))
    b2 = FakeUpstream([Reply(text=NOT_JSON), Reply(text=GOOD)])
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(
            name="a", base_url="http://a/v1", api_key=SECRET, model="m-8k")], fallback="big"),
        "big": polygate.Scope(sources=[
            polygate.Source(name="b1", base_url="http://b1/v1", api_key=SECRET, model="m-128k",
                            weight=1.0),
            polygate.Source(name="b2", base_url="http://b2/v1", api_key=SECRET, model="m-128k",
                            weight=1e-9),
        ], retry=polygate.Retry(max_attempts=3)),
    })
    async with polygate.session(settings, transport=Router({"a": small, "b1": b1, "b2": b2})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed is not None and r.call_stats.reasks == 1
    # round 1: a (400), b1 (503), b2 (invalid); round 2 should start with b2
    assert len(b1.requests) == 1, "the re-ask asked b1 first again"


# ------------------------------------------------------------------ (7) serve SSE


def test_a_resumed_stream_whose_continuation_reuses_the_id_keeps_one_model_and_created() -> None:
    """81937f4 (docs/serve.md: "every chunk carries the stream's one id, created and
    model: a stream resumed on another source goes on under the first segment's").
    The rewrite is keyed on the id alone: a continuation whose chunks carry the same
    id (servers with fixed or counter ids: "chatcmpl-123"; the fake upstream's
    "chatcmpl-fake-0" on two hosts) keeps its own model and created."""
    from polygate import StreamChunk
    from polygate.serve._sse import StreamShape

    def chunk(text: str, model: str, created: int) -> StreamChunk:
        raw = {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": created,
               "model": model, "choices": [{"index": 0, "delta": {"content": text},
                                            "finish_reason": None}]}
        return StreamChunk(text=text, delta={"content": text}, raw=raw)

    shape = StreamShape()
    out = shape.chunk(chunk("first ", "small-model", 1000))
    out += shape.chunk(chunk("rest", "large-model", 2000))  # the continuation
    events = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert {e["model"] for e in events} == {"small-model"}, [e["model"] for e in events]
    assert {e["created"] for e in events} == {1000}


# ------------------------------------------------------------------ (8) cache replay


async def test_a_streamed_hit_replays_reasoning_content_beside_an_empty_reasoning(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """6bf39d7: the replay picks ``reasoning`` whenever the message has that field as a
    string, then replays nothing when it is empty: a stored answer whose message has
    ``"reasoning": ""`` beside ``"reasoning_content": "..."`` (a JSON answer that
    carries both names) streamed its reasoning on the miss's JSON and loses it on a
    hit.  Before the commit the hit replayed ``reasoning_content``."""
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": "42", "reasoning": "",
                "reasoning_content": "think think"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET,
                                 streaming=False)], cache_ttl_s=60)}, cache="memory")
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        first = await s.chat(MESSAGES)
        assert first.message.get("reasoning_content") == "think think"
        reasoning = ""
        async with s.stream_chat(MESSAGES) as stream:
            async for c in stream:
                reasoning += c.reasoning
        assert stream.response is not None and stream.response.call_stats.cached
    assert reasoning == "think think"
