"""Behaviour no other test pinned, found by mutating the code: each test fails on
the mutation its docstring names and passes on the code as it is."""
from __future__ import annotations

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .test_failover import _Sink

SECRET = "sk-test-SECRET-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "hello there"}]


def _settings() -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", api_key=SECRET, weight=1e-9)],
        stream=polygate.StreamWatch(resume=True))})


async def test_a_reask_after_a_cut_in_the_reasoning_is_estimated_as_the_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (continuation_messages without its ``if not shown`` early return): a stream
    cut in its reasoning is asked again as it was (b gets the caller's messages), so
    its prompt estimate is the call's; the mutant estimated it as the messages plus
    an empty assistant message and the continue prompt, so the summed usage of the
    two segments (neither reported any) over-counts the prompt."""
    plain = FakeUpstream(Reply(text="x", usage=False))
    async with polygate.session(_settings(), transport=Router({"a": plain, "b": plain})) as s:
        one = (await s.chat(MESSAGES)).usage
    assert one is not None and one.source == "estimated"
    a = FakeUpstream(Reply(text="never shown", reasoning_tokens=10, fault="truncated", fault_after=5))
    b = FakeUpstream(Reply(text="the answer", usage=False))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    r = stream.response
    assert r is not None and r.call_stats.resumes == 1 and r.text == "the answer"
    assert b.requests[0].body["messages"] == MESSAGES  # asked again as it was
    assert r.usage is not None and r.usage.source == "estimated"
    assert r.usage.prompt_tokens == 2 * one.prompt_tokens


def _sse(*deltas, finish_last: bool = False, done: bool = False) -> bytes:
    import json
    out = b""
    for i, d in enumerate(deltas):
        finish = "stop" if finish_last and i == len(deltas) - 1 else None
        d = dict(d)
        extra = d.pop("_choice", {})
        body = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": d, "finish_reason": finish, **extra}]}
        out += b"data: " + json.dumps(body).encode() + b"\n\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


async def _resumed_text(cut: bytes, rest: bytes) -> tuple[str, list[str]]:
    import httpx

    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"},
        content=cut if request.url.host == "a" else rest))
    texts: list[str] = []
    async with polygate.session(_settings(), transport=transport) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                texts.append(chunk.text)
    assert stream.response is not None and stream.response.call_stats.resumes == 1
    return stream.response.text, texts


async def test_an_empty_delta_inside_a_restatement_does_not_end_the_decision(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (``stitcher.holding and _ends_text(chunk)`` -> ``stitcher.holding``): a
    data-only chunk (an empty delta with Azure's choice-level content_filter_results)
    arriving while the continuation's restatement is
    held is passed on and the stitcher keeps deciding; the mutant flushed the
    decision on it, with half the restatement held: no overlap found, the
    restatement shown twice."""
    cut = _sse({"role": "assistant", "content": "alpha beta gamma"},
               {"content": " delta epsilon zeta"})
    filt = {"_choice": {"content_filter_results": {"hate": {"filtered": False}}}}
    rest = _sse({"role": "assistant", "content": " delta epsilon"}, filt, {"content": " zeta"},
                {"content": " eta theta"}, {}, finish_last=True, done=True)
    text, _ = await _resumed_text(cut, rest)
    assert text == "alpha beta gamma delta epsilon zeta eta theta"


def _lp_chunk(text: str, tokens: list[str] | None) -> dict:
    lp = None if tokens is None else {"content": [
        {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens
    ], "refusal": None}
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    if lp is not None:
        choice["logprobs"] = lp
    return {"choices": [choice]}


def test_a_held_chunk_ending_exactly_at_the_restatements_end_gives_no_logprobs() -> None:
    """Mutation (``at <= dropped`` -> ``at < dropped`` in _kept_logprobs): a held chunk
    whose text ends exactly where the dropped restatement ends is wholly dropped, its
    logprob entries with it -- also when its tokens do not spell its text (byte-level
    tokens); the mutant kept them for text the caller never saw."""
    from polygate._resume import ResumedForward, Stitcher

    sink = _Sink()
    forward = ResumedForward(sink, Stitcher(" one two three four"))  # type: ignore[arg-type]
    for text, tokens in [(" two three", ["b1"]), (" four", ["b2"]), (" five", [" five"])]:
        assert forward.offer(_lp_chunk(text, tokens))
    trio.run(forward.finish)
    assert "".join(c["choices"][0]["delta"]["content"] for c in sink.chunks) == " five"
    shown = [e["token"] for c in sink.chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert shown == [" five"]


async def test_a_source_that_refused_the_prefill_is_asked_again_without_it_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation (the prefill-refusing source left among the failed sources): a is cut; the
    continuation goes to b (a prefill source) whose 400 refuses the prefill -- not the
    request.  b is asked again without one, before c (a source that has not failed),
    as docs say ("the same source is asked again without the prefill"); the mutant
    kept b demoted, and c took the continuation."""
    from polygate._resume import CONTINUE_PROMPT

    words = [f"w{i}" for i in range(60)]
    answer = " ".join(words)
    rest = " " + " ".join(words[40:])
    a = FakeUpstream(Reply(text=answer, fault="truncated", fault_after=40))

    def picky(request, rng) -> Reply:
        if request.body.get("continue_final_message"):
            return Reply(status=400, error_body={"error": {
                "message": "Unsupported parameter: continue_final_message",
                "type": "invalid_request_error", "code": "invalid_request_error"}})
        return Reply(text=rest)

    b = FakeUpstream(picky)
    c = FakeUpstream(Reply(text=rest))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", api_key=SECRET, weight=1e-6,
                                 prefill=True),
                 polygate.Source(name="c", base_url="http://c/v1", api_key=SECRET, weight=1e-12)],
        stream=polygate.StreamWatch(resume=True))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    assert stream.response is not None and stream.response.text == answer
    assert [r.status for r in b.requests] == [400, 200] and c.requests == []
    assert b.requests[1].body["messages"][-1]["content"] == CONTINUE_PROMPT
