"""Real providers' successful answers, each read as what it is (review, provider by
provider: each case below was misread; the comment above each says what it was).
The bytes are each provider's documented or recorded ones, served through
httpx.MockTransport (tests/_provider_kit.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

import polygate

from ._provider_kit import MESSAGES, TimedTransport, chat, relay, settings, sse, stream

# ----------------------------------------------------------------------
# StepFun's documented stream sends ``"finish_reason": ""`` (not null) on every
# non-final chunk, with cumulative usage on every chunk (platform.stepfun.com,
# chat-completion-create, the SSE sample); Zhipu's GLM streams (and resellers that pass
# them on, SenseNova) send ``""`` too.  polygate takes the first ``""`` for the answer's
# finish: from the first chunk on, the answer counts as complete.

STEPFUN_HEAD = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "step-2-mini"}


def _chunk(text: str, finish: str, n: int) -> dict[str, Any]:
    return {**STEPFUN_HEAD, "choices": [{"index": 0, "delta": {"role": "", "content": text},
                                 "finish_reason": finish}],
            "usage": {"prompt_tokens": 84, "completion_tokens": n, "total_tokens": 84 + n}}


WORDS = [f"w{i} " for i in range(30)]


def _ev(d: dict) -> bytes:
    return f"data: {json.dumps(d)}\n\n".encode()


async def test_a_slow_stepfun_stream_is_read_to_its_end(autojump_clock: trio.testing.MockClock) -> None:
    pieces = [(0.1, _ev(_chunk(w, "", i + 1))) for i, w in enumerate(WORDS)]
    pieces.append((0.1, _ev(_chunk("", "stop", 30))))
    pieces.append((0.0, b"data: [DONE]\n\n"))
    async with polygate.session(settings(), transport=TimedTransport(pieces)) as s:
        r = await s.chat(MESSAGES)
    assert r.text == "".join(WORDS), r.text
    assert r.finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 30


async def test_a_stepfun_stream_cut_midway_is_truncated_not_complete() -> None:
    # The body ends after 5 chunks: no real finish_reason, no [DONE].
    body = sse([_chunk(w, "", i + 1) for i, w in enumerate(WORDS[:5])], done=False)
    with pytest.raises(polygate.AllSourcesExhausted) as info:
        await chat(body)
    assert isinstance(info.value.errors[0], polygate.TransientUpstreamError)


async def test_the_truncated_answer_is_not_cached(autojump_clock: trio.testing.MockClock) -> None:
    pieces = [(0.1, _ev(_chunk(w, "", i + 1))) for i, w in enumerate(WORDS)]
    pieces.append((0.1, _ev(_chunk("", "stop", 30))))
    pieces.append((0.0, b"data: [DONE]\n\n"))
    cfg = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        retry=polygate.Retry(max_attempts=1), cache_ttl_s=600)}, cache="memory")
    async with polygate.session(cfg, transport=TimedTransport(pieces)) as s:
        await s.chat(MESSAGES)
        second = await s.chat(MESSAGES)
    assert not (second.call_stats.cached and second.text != "".join(WORDS)), (
        f"cached truncated answer: {second.text!r} (finish {second.finish_reason!r})")


# ----------------------------------------------------------------------
# The gateway relay of a StepFun stream (finish_reason "" on non-final chunks), all
# of it arriving at once: the library's answer ends with "stop", the SSE client's does not.

async def test_sse_client_gets_the_final_finish_reason() -> None:
    body = sse([_chunk(w, "", i + 1) for i, w in enumerate(WORDS[:5])] + [_chunk("", "stop", 5)])
    out = await relay(body)
    assert out["json"]["choices"][0]["finish_reason"] == "stop"
    finishes = [c.get("finish_reason") for e in out["events"] for c in e.get("choices", [])]
    assert out["sdk"]["choices"][0]["finish_reason"] == "stop", (out["sdk"]["choices"][0]["finish_reason"], finishes)


# ----------------------------------------------------------------------
# A stream whose finish_reason comes before its content ends (OpenAI-compatible
# proxies: Open WebUI before its fix sent finish_reason "stop" on an Ollama reasoning
# model's first chunk, open-webui#23921; gcli2api sent it on every chunk, gcli2api#403),
# the content going on for seconds, then [DONE].  docs/concepts.md (the table of
# outcomes) bounds the *silence* after every finish_reason by 1 s; the code bounds the
# whole rest of the stream by 1 s from the first finish, however much keeps coming.

def _pieces() -> list[tuple[float, bytes]]:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [(0.0, _ev({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": "stop"}]}))]
    for i in range(30):  # 30 tokens, 0.1 s apart: 3 s of text, never 1 s silent
        out.append((0.1, _ev({**head, "choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                                   "finish_reason": "stop"}]})))
    out.append((0.0, b"data: [DONE]\n\n"))
    return out


async def test_content_after_a_finish_is_not_cut_while_it_flows(autojump_clock: trio.testing.MockClock) -> None:
    async with polygate.session(settings(), transport=TimedTransport(_pieces())) as s:
        r = await s.chat(MESSAGES)
    assert r.text == "".join(f"w{i} " for i in range(30)), r.text


# ----------------------------------------------------------------------
# Perplexity streams send the whole ``citations`` and ``search_results`` lists again on
# every chunk (LangChain review of PR #29176: "citations come back with every chunk";
# LiteLLM #13777: "Citations are still available in each chunk"), and cumulative usage.
# A non-streamed Perplexity answer holds each list once.

CITES = ["https://a.example/1", "https://b.example/2", "https://c.example/3"]
RESULTS = [{"title": f"t{i}", "url": u, "date": None, "snippet": "s" * 40} for i, u in enumerate(CITES)]


def _body() -> bytes:
    pieces = ["There", " are", " about", " 100 billion", " stars[1][2]."]
    events = []
    text = ""
    for i, p in enumerate(pieces):
        text += p
        last = i == len(pieces) - 1
        events.append({
            "id": "d14cd700", "model": "sonar-pro", "created": 1755887465,
            "usage": {"prompt_tokens": 14, "completion_tokens": i + 1, "total_tokens": 15 + i,
                      "search_context_size": "low"},
            "citations": CITES, "search_results": RESULTS,
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop" if last else None,
                         "message": {"role": "assistant", "content": text},
                         "delta": {"role": "assistant", "content": p}}],
        })
    return sse(events, done=False)


async def test_chat_keeps_citations_once() -> None:
    r = await chat(_body())
    assert r.text == "There are about 100 billion stars[1][2]."
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.raw["usage"]["search_context_size"] == "low"
    # As the non-streamed answer holds them: once.
    assert r.raw["citations"] == CITES, len(r.raw["citations"])
    assert r.raw["search_results"] == RESULTS, len(r.raw["search_results"])


async def test_stream_response_keeps_citations_once() -> None:
    chunks, response = await stream(_body())
    assert "".join(c.text for c in chunks) == "There are about 100 billion stars[1][2]."
    assert response.raw["citations"] == CITES, len(response.raw["citations"])


async def test_gateway_json_answer_keeps_citations_once() -> None:
    out = await relay(_body())
    assert out["json"]["choices"][0]["message"]["content"] == "There are about 100 billion stars[1][2]."
    assert out["json"]["citations"] == CITES, len(out["json"]["citations"])


# ----------------------------------------------------------------------
# Zhipu (docs.bigmodel.cn, chat completions, finish_reason): "'network_error' 表示模型
# 推理异常" -- the model's inference failed; Zhipu signals a failure mid-stream this way
# rather than with an error event.  polygate treats OpenRouter's finish_reason "error"
# as an error event (docs/concepts.md), but takes "network_error" for a complete answer:
# the half answer is returned (and would be cached), never retried elsewhere.

ZHIPU_HEAD = {"id": "2025", "object": "chat.completion.chunk", "created": 1, "model": "glm-4.5"}


async def test_network_error_finish_is_a_failed_attempt() -> None:
    body = sse([
        {**ZHIPU_HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "The answer is"}}]},
        {**ZHIPU_HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": "network_error"}],
         "usage": {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}},
    ])
    with pytest.raises(polygate.AllSourcesExhausted) as info:
        await chat(body)
    assert isinstance(info.value.errors[0], polygate.TransientUpstreamError)


# ----------------------------------------------------------------------
# Review of the fixes above: content after a finish re-arms the grace, but never past
# the attempt's timeout_s (a stream that went on after its "stop" ran until
# max_body_bytes); and the grace waits for a caller who is behind, as every clock of
# the attempt does (a usage chunk that came in time was cut, its usage estimated).


def _stop_on_every_chunk(n: int, gap: float) -> list[tuple[float, bytes]]:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [(gap, _ev({**head, "choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                            "finish_reason": "stop"}]})) for i in range(n)]
    return [*out, (0.0, b"data: [DONE]\n\n")]


async def test_timeout_s_bounds_content_after_a_finish(autojump_clock: trio.testing.MockClock) -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", timeout_s=5)],
        retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=TimedTransport(_stop_on_every_chunk(2000, 0.5))) as s:
        r = await s.chat(MESSAGES)
        assert trio.current_time() < 5.01  # (the answer as far as it came: complete)
        async with s.stream_chat(MESSAGES) as stream:
            chunks = [chunk async for chunk in stream]
    assert r.text.startswith("w0 w1 ") and len(r.text.split()) < 12
    assert len(chunks) < 12 and trio.current_time() < 10.02


async def test_the_end_grace_waits_for_a_slow_caller(autojump_clock: trio.testing.MockClock) -> None:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    burst = b"".join(_ev({**head, "choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                              "finish_reason": None}]}) for i in range(40))
    burst += _ev({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    filtered = {"hate": {"filtered": False, "severity": "safe"}}
    pieces = [
        (0.0, burst),
        # Azure's annotation after the finish (no content token), then the usage
        (0.01, _ev({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                         "content_filter_results": filtered}]})),
        (0.01, _ev({**head, "choices": [], "usage": {
            "prompt_tokens": 7, "completion_tokens": 40, "total_tokens": 47}})),
        (0.0, b"data: [DONE]\n\n"),
    ]
    async with polygate.session(settings(), transport=TimedTransport(pieces)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                await trio.sleep(2)  # the caller is slow
    assert stream.response is not None
    usage = stream.response.usage
    assert (usage.source, usage.total_tokens) == ("upstream", 47)


async def test_the_gateway_relays_an_empty_finish_reason_as_none() -> None:
    """A client that types the reason as an enum (async-openai) must not meet ""."""
    out = await relay(sse([_chunk("a ", "", 1), _chunk("b ", "", 2), _chunk("", "stop", 2)]))
    reasons = [c.get("finish_reason") for e in out["events"] for c in e.get("choices", [])]
    assert "" not in reasons and "stop" in reasons


def _watched(stall: float | None) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", timeout_s=60)],
        stream=polygate.StreamWatch(stall_timeout_s=stall),
        retry=polygate.Retry(max_attempts=1))})


@pytest.mark.parametrize("stall", [None, 3])
async def test_a_stall_watch_does_not_cut_content_after_a_finish(
    autojump_clock: trio.testing.MockClock, stall: float | None
) -> None:
    """Review: the stall watchdog's deadline, left in place at the finish, read as a
    bound on the content after it: 20 words 0.5 s apart came back as 6, complete."""
    async with polygate.session(_watched(stall), transport=TimedTransport(
            _stop_on_every_chunk(20, 0.5))) as s:
        r = await s.chat(MESSAGES)
        async with s.stream_chat(MESSAGES) as stream:
            chunks = [chunk async for chunk in stream]
    assert len(r.text.split()) == 20 and len(chunks) == 20
