"""Every recorded provider response in ../shared/transcripts parses correctly.

Each transcript is served byte for byte (status and content type as recorded) through
httpx.MockTransport, to ``chat()`` and — for streams — to ``stream_chat()``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

import polygate

from .conftest import TRANSCRIPTS, one_source_settings

# file -> (text, finish_reason, (prompt, completion) or None when the upstream sent no usage)
EXPECTED: dict[str, tuple[str, str, tuple[int, int] | None]] = {
    "01-openai-stream-refusal-usage.sse": ("", "stop", (79, 11)),
    "02-openai-stream-parallel-tool-calls-usage.sse": ("", "tool_calls", (149, 60)),
    "03-openai-stream-tool-call-usage.sse": ("", "tool_calls", (44, 16)),
    "04-openai-stream-content-logprobs.sse": ("Foo!", "stop", (9, 2)),
    "05-openai-stream-refusal-logprobs.sse": ("", "stop", (79, 12)),
    "07-openai-stream-finish-length.sse": ('{"', "length", (79, 1)),
    "09-azure-stream-content-filter.sse": ("Hallo Welt!", "stop", None),
    "10-azure-stream-async-filter-annotations.sse": ("Kindness", "stop", None),
    "11-deepseek-stream-tool-call-usage-on-finish.sse": (
        "I'll check the current weather in Tokyo for you.", "tool_calls", (161, 25)),
    "12-deepseek-stream-reasoning-content-usage.sse": (
        "Hello there! 😊 How can I help you today?", "stop", (6, 212)),
    "15-openrouter-stream-reasoning-details-usage.sse": ("2 + 2 = 4", "stop", (43, 36)),
    "16-vllm-stream-continuous-usage-stats.sse": (
        "Hello Sam. It's nice to meet you. Is there something I can help you with or would you like to chat?",
        "stop", (46, 26)),
    "18-azure-stream-tool-calls-obfuscation-usage.sse": ("", "tool_calls", (66, 17)),
    "25-ollama-stream-empty-content-finish-stop.sse": ("", "stop", None),
    "26-ollama-stream-reasoning-field-usage.sse": ("51", "stop", (31, 31)),
    "29-llamacpp-stream-tool-call-timings-crlf-as-documented.sse": ("", "tool_calls", (292, 25)),
    "34-openai-stream-2026-obfuscation-service-tier-tool-call-usage.sse": ("", "tool_calls", (66, 16)),
    "08-openai-nonstream-parallel-tool-calls.json": ("", "tool_calls", (149, 60)),
    "17-vllm-nonstream-chat-completion.json": (
        "Random Number Generator Produces Smallest Possible Result", "stop", (146, 10)),
    "19-azure-nonstream-tool-calls-prompt-filter.json": ("", "tool_calls", (194, 19)),
    "22-openai-nonstream-o1-mini-wire-pretty.json": (
        "The capital of France is **Paris**.", "stop", (14, 84)),
    "28-llamacpp-nonstream-timings.json": (None, "stop", (127, 31)),  # type: ignore[dict-item]
    "30-llamacpp-nonstream-reasoning-content.json": (None, "stop", (183, 63)),  # type: ignore[dict-item]
    "27-llamacpp-stream-timings-usage-crlf-as-documented.sse": (None, "stop", (127, 36)),  # type: ignore[dict-item]
    "31-cloudflare-workers-ai-vllm-stream-reasoning-tool-call-continuous-usage.sse": (
        "\n\n", "tool_calls", (192, 127)),
    "06-openai-stream-n3-choices-usage.sse": (None, "stop", (79, 42)),  # type: ignore[dict-item]
}

ERRORS: dict[str, tuple[int, type[polygate.UpstreamError], str]] = {
    "13-openrouter-stream-processing-comments-midstream-error.sse": (
        200, polygate.FatalUpstreamError, "Token limit reached"),
    "14-groq-stream-event-error-midstream.sse": (200, polygate.FatalUpstreamError, "Tool call validation failed"),
    "21-openai-error-400-unsupported-parameter.json": (400, polygate.FatalUpstreamError, "Unsupported parameter"),
    "23-openai-error-404-model-not-found.json": (404, polygate.SourceDeadError, "does not exist"),
    "24-openrouter-error-401.json": (401, polygate.SourceDeadError, "No cookie auth credentials"),
    "33-vllm-error-400-object-error-doc-example.json": (400, polygate.FatalUpstreamError, "matryoshka"),
}

CHAT_FILES = sorted(p.name for p in TRANSCRIPTS.iterdir() if p.suffix in (".sse", ".json")
                    and "embeddings" not in p.name)


def test_every_transcript_has_an_expectation() -> None:
    assert set(CHAT_FILES) == set(EXPECTED) | set(ERRORS)


def _serve(name: str, status: int = 200) -> httpx.MockTransport:
    data = (TRANSCRIPTS / name).read_bytes()
    ctype = "text/event-stream" if name.endswith(".sse") else "application/json"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers={"content-type": ctype}, content=data)

    return httpx.MockTransport(handler)


async def _chat(name: str, status: int = 200) -> polygate.ChatResponse:
    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=_serve(name, status)) as s:
        return await s.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_transcript_parses(name: str) -> None:
    text, finish, usage = EXPECTED[name]
    r = await _chat(name)
    if text is not None:
        assert r.text == text
    assert r.finish_reason == finish
    assert r.source == "a"
    assert r.call_stats.attempts == 1
    if usage is None:
        assert r.usage is not None and r.usage.source == "estimated"
    else:
        assert r.usage is not None and r.usage.source == "upstream"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == usage
    assert r.message["role"] == "assistant"
    assert r.message is r.choices[0]["message"]
    # Statistics: streamed answers with content have a first token, JSON ones never.
    if name.endswith(".json"):
        assert r.call_stats.ttft_ms is None
        assert r.call_stats.stall_ms is None


def _wire_message(name: str) -> dict[str, Any]:
    return json.loads((TRANSCRIPTS / name).read_text())["choices"][0]["message"]


async def test_streamed_tool_calls_are_joined() -> None:
    r = await _chat("02-openai-stream-parallel-tool-calls-usage.sse")
    calls = r.message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["GetWeatherArgs", "get_stock_price"]
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Edinburgh", "country": "GB", "units": "c"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"ticker": "AAPL", "exchange": "NASDAQ"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert r.message["content"] is None
    # The non-streamed recording of the same request has the same shape.
    wire = _wire_message("08-openai-nonstream-parallel-tool-calls.json")
    assert set(wire) <= set(r.message) | {"parsed"}
    assert [c["function"]["arguments"] for c in wire["tool_calls"]] == [
        c["function"]["arguments"] for c in calls]


async def test_llamacpp_tool_call_arguments() -> None:
    r = await _chat("29-llamacpp-stream-tool-call-timings-crlf-as-documented.sse")
    (call,) = r.message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"code": "print('Hello, World!')"}
    assert len(call["id"]) == 32
    assert "timings" in r.raw


async def test_refusal_is_assembled() -> None:
    r = await _chat("01-openai-stream-refusal-usage.sse")
    assert r.message["refusal"] == "I'm sorry, I can't assist with that request."
    assert r.message["content"] is None
    assert r.call_stats.ttft_ms is not None  # a refusal is model output


async def test_reasoning_content_counts_and_is_kept() -> None:
    r = await _chat("12-deepseek-stream-reasoning-content-usage.sse")
    assert r.message["reasoning_content"].startswith('Hmm, the user just said "Hello".')
    # DeepSeek puts usage on the finish chunk; prompt-cache extras stay in raw usage.
    assert r.raw["usage"]["prompt_cache_hit_tokens"] == 0


async def test_ollama_reasoning_field() -> None:
    r = await _chat("26-ollama-stream-reasoning-field-usage.sse")
    expected = 'We need to answer with the number only: 17 * 3 = 51. So output "51".'
    assert r.message["reasoning"] == expected
    assert r.message["reasoning_content"] == expected


async def test_openrouter_reasoning_details_and_comments() -> None:
    r = await _chat("15-openrouter-stream-reasoning-details-usage.sse")
    assert r.raw["provider"]
    assert r.raw["usage"]["cost"] > 0
    # Review: every streamed fragment was kept as its own entry; a non-streamed
    # answer has one entry per index, its text whole, with its signature and format.
    [detail] = r.message["reasoning_details"]
    assert detail["text"] == r.message["reasoning_content"]
    assert detail["signature"] and detail["format"] == "anthropic-claude-v1"
    assert (detail["type"], detail["index"]) == ("reasoning.text", 0)


@pytest.mark.parametrize(("name", "categories"), [
    ("09-azure-stream-content-filter.sse", {"hate", "self_harm", "sexual", "violence"}),
    ("10-azure-stream-async-filter-annotations.sse",
     {"hate", "self_harm", "sexual", "violence", "protected_material_code", "protected_material_text"}),
])
async def test_azure_content_filter_results_are_merged_not_replaced(name: str, categories: set[str]) -> None:
    """Review: the finish chunk's empty ``{}`` (09), or a later annotation of other
    categories (10), replaced the filter results whole, so the assembled choice said
    nothing about hate or violence (SPEC §1: filter results are kept in raw)."""
    r = await _chat(name)
    assert set(r.raw["choices"][0]["content_filter_results"]) == categories
    assert set(r.choices[0]["content_filter_results"]) == categories


async def test_merging_extras_never_changes_the_chunks_a_stream_handed_out() -> None:
    """The merges work on copies: a chunk's raw, handed to a stream's caller, keeps
    what its upstream sent (here the first fragment's dict would otherwise become the
    held entry, and its text "x" the joined "xy")."""
    events = [
        {"choices": [{"index": 0, "delta": {"content": "a", "reasoning_details": [{"index": 0, "text": "x"}]},
                      "content_filter_results": {"hate": {"filtered": False}}}]},
        {"choices": [{"index": 0, "delta": {"content": "b", "reasoning_details": [{"index": 0, "text": "y"}]},
                      "content_filter_results": {"violence": {"filtered": False}}, "finish_reason": "stop"}]},
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s, s.stream_chat(
        [{"role": "user", "content": "hi"}]
    ) as stream:
        chunks = [c.raw async for c in stream]
    # (looked at once the stream has ended: after every merge)
    assert chunks == events
    assert stream.response is not None
    assert stream.response.message["reasoning_details"] == [{"index": 0, "text": "xy"}]
    assert set(stream.response.choices[0]["content_filter_results"]) == {"hate", "violence"}


async def test_n3_choices() -> None:
    r = await _chat("06-openai-stream-n3-choices-usage.sse")
    assert [c["index"] for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        parsed = json.loads(choice["message"]["content"])
        assert parsed["city"] == "San Francisco"
        assert choice["finish_reason"] == "stop"


async def test_logprobs_are_joined() -> None:
    r = await _chat("04-openai-stream-content-logprobs.sse")
    tokens = [entry["token"] for entry in r.choices[0]["logprobs"]["content"]]
    assert "".join(tokens) == "Foo!"


async def test_azure_filter_annotations_are_kept_not_errors() -> None:
    r = await _chat("10-azure-stream-async-filter-annotations.sse")
    assert r.raw["prompt_filter_results"]
    assert "content_filter_offsets" in r.choices[0]


async def test_vllm_continuous_usage_takes_the_last() -> None:
    r = await _chat("16-vllm-stream-continuous-usage-stats.sse")
    assert r.usage is not None and r.usage.total_tokens == 72


async def test_ollama_empty_stream_has_no_first_token() -> None:
    r = await _chat("25-ollama-stream-empty-content-finish-stop.sse")
    assert r.text == ""
    assert r.message["content"] == ""
    assert r.call_stats.ttft_ms is None
    assert r.call_stats.stall_ms is None


async def test_crlf_stream() -> None:
    r = await _chat("27-llamacpp-stream-timings-usage-crlf-as-documented.sse")
    assert r.text.startswith("Hello! It's nice to meet you.")
    assert r.raw["timings"]["predicted_n"] == 36


async def test_utf8_nonstream() -> None:
    r = await _chat("30-llamacpp-nonstream-reasoning-content.json")
    assert "’" in r.text and "—" in r.text
    assert r.message["reasoning_content"]


@pytest.mark.parametrize("name", sorted(ERRORS))
async def test_error_transcripts(name: str) -> None:
    status, cls, needle = ERRORS[name]
    with pytest.raises(polygate.PolygateError) as info:
        await _chat(name, status)
    error = info.value
    if isinstance(error, polygate.AllSourcesExhausted):
        (error,) = error.errors  # type: ignore[assignment]
    assert type(error) is cls
    assert needle in str(error)


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.endswith(".sse")))
async def test_transcript_streams(name: str) -> None:
    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=_serve(name)) as s:
        async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
            chunks = [chunk async for chunk in stream]
    assert stream.response is not None
    assert "".join(c.text for c in chunks) == stream.response.text
    assert stream.response.message == (await _chat(name)).message


def test_fixture_dir_exists() -> None:
    assert Path(TRANSCRIPTS).is_dir()


def _events(data: bytes) -> list[bytes]:
    """A recorded SSE body as its events, each with its blank line (LF or CRLF)."""
    parts = data.replace(b"\r\n", b"\n").split(b"\n\n")
    return [p + b"\n\n" for p in parts if p.strip()]


_FINISHED_THEN_MORE = sorted(
    name for name in EXPECTED
    if name.endswith(".sse") and any(
        b'"finish_reason":"' in e and i < len(_events((TRANSCRIPTS / name).read_bytes())) - 1
        for i, e in enumerate(_events((TRANSCRIPTS / name).read_bytes()))
    )
)


@pytest.mark.parametrize("name", _FINISHED_THEN_MORE)
async def test_a_finished_stream_cut_inside_its_next_event_is_complete(name: str) -> None:
    """Review: a stream cut in the middle of the event after its finish chunk (the
    usage event, say) failed as a malformed body: the half event was flushed and read
    as JSON.  SPEC §3: a stream that has its finish_reason but no [DONE] is complete;
    an event never completed is not dispatched (WHATWG)."""
    events = _events((TRANSCRIPTS / name).read_bytes())
    # After the last choice's finish (with n > 1, an earlier one's leaves the others
    # mid-answer: truncated, tests/test_bad_upstream.py).
    k = max(i for i, e in enumerate(events) if b'"finish_reason":"' in e) + 1
    cut = b"".join(events[:k]) + events[k][: len(events[k]) // 2]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=cut)

    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        r = await s.chat([{"role": "user", "content": "hi"}])
    assert r.finish_reason == EXPECTED[name][1]


async def test_an_unfinished_stream_cut_inside_an_event_is_still_transient() -> None:
    """The other side: with no finish_reason yet, the half event is malformed and
    the stream truncated: a transient failure, as before."""
    events = _events((TRANSCRIPTS / "04-openai-stream-content-logprobs.sse").read_bytes())
    cut = events[0] + events[1][: len(events[1]) // 2]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=cut)

    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat([{"role": "user", "content": "hi"}])
    assert isinstance(info.value.errors[0], polygate.TransientUpstreamError)



def test_many_indexed_extra_items_fold_in_bounded_time() -> None:
    """Review of the merge per index: each indexed item scanned everything held, so a
    stream whose 30,000 chunks each carry a new index took ~15 s of event-loop CPU
    (quadratic; the extend before it, ~0.05 s).  The look back is bounded: linear.
    (The bound is 20× what linear takes on this machine's slow phase.)"""
    import time

    from polygate.transport._assemble import ChatAssembler

    assembler = ChatAssembler()
    started = time.perf_counter()
    for i in range(30_000):
        assembler.add({"choices": [{"index": 0, "delta": {
            "content": "x", "reasoning_details": [{"type": "reasoning.text", "text": "t", "index": i}]}}]})
    took = time.perf_counter() - started
    assert len(assembler.build()["choices"][0]["message"]["reasoning_details"]) == 30_000
    assert took < 6.0, f"{took:.1f} s"
