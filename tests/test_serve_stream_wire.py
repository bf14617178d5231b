"""``polygate serve``'s SSE answers against what OpenAI sends and what clients
assemble (outside review, 2026-12-02: each test failed before its fix)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import polygate
from polygate._resume import CONTINUE_PROMPT
from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply

from ._raw_server import raw_server
from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, gateway, http
from .conftest import TRANSCRIPTS

pytestmark = pytest.mark.integration


def _reply_with(data: bytes, ctype: bytes = b"text/event-stream") -> Any:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype
            + b"\r\ncontent-length: %d\r\n\r\n" % len(data) + data)

    return reply


def _replay(name: str) -> Any:
    ctype = b"text/event-stream" if name.endswith(".sse") else b"application/json"
    return _reply_with((TRANSCRIPTS / name).read_bytes(), ctype)


def _events(body: bytes) -> list[Any]:
    out = []
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:]
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def _through_gateway(name: str, body: dict[str, Any]) -> Any:
    return await _through(_replay(name), body)


async def _through(reply: Any, body: dict[str, Any]) -> Any:
    async with raw_server(reply) as up:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=up.url)],
                retry=polygate.Retry(max_attempts=1))},
            serve=polygate.Serve(api_keys=[GATEWAY_KEY]))
        async with open_server(settings, port=0) as server:
            return await http(server, "POST", "/v1/chat/completions", body, AUTH)


async def test_a_streamed_reasoning_signature_reaches_the_client() -> None:
    """OpenRouter (Anthropic thinking) sends the reasoning block's ``signature`` in a
    chunk of its own: ``content: ""``, ``reasoning: null``, ``reasoning_details``
    carrying only the signature.  The JSON answer of the same transcript keeps it;
    the stream dropped the chunk (no content token), so a client streaming through the
    gateway could not send the signed thinking back on its next turn."""
    name = "15-openrouter-stream-reasoning-details-usage.sse"
    whole = await _through_gateway(name, {**CHAT})
    [detail] = whole.json()["choices"][0]["message"]["reasoning_details"]
    assert detail["signature"].startswith("Et0B")  # the JSON answer has it

    streamed = await _through_gateway(name, {**CHAT, "stream": True})
    signatures = [d.get("signature") for e in _events(streamed.body) if isinstance(e, dict)
                  for c in e.get("choices") or [] for d in c["delta"].get("reasoning_details") or []]
    assert any(s and s.startswith("Et0B") for s in signatures), signatures


WORDS = [f"w{i}" for i in range(20)]


def _cut_then_continued(request: Any, rng: Any) -> Reply:
    if request.body["messages"][-1]["content"] == CONTINUE_PROMPT:
        return Reply(text=" " + " ".join(WORDS[10:]))
    return Reply(text=" ".join(WORDS), fault="truncated", fault_after=10)


async def test_a_resumed_stream_keeps_one_completion_id() -> None:
    """docs/failover.md: with resume "the caller sees one stream".  Through the
    gateway, the continuation's chunks carry the second upstream's ``id``, and the
    gateway's finish and usage chunks go back to the first: three id changes in what
    an OpenAI stream keeps as one completion id (clients key the message by it)."""
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with gateway(FakeUpstream(_cut_then_continued), sources=2,
                       stream=polygate.StreamWatch(resume=True)) as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions", body, AUTH)
    events = [e for e in _events(answer.body) if isinstance(e, dict)]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == " ".join(WORDS)  # resumed and stitched
    ids = [e["id"] for e in events]
    assert len(set(ids)) == 1, sorted(set(ids))


async def _miss_then_hit(name: str, body: dict[str, Any]) -> tuple[Any, Any]:
    async with raw_server(_replay(name)) as up:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=up.url)],
                retry=polygate.Retry(max_attempts=1), cache_ttl_s=60)},
            serve=polygate.Serve(api_keys=[GATEWAY_KEY]), cache="memory")
        async with open_server(settings, port=0) as server:
            miss = await http(server, "POST", "/v1/chat/completions", body, AUTH)
            hit = await http(server, "POST", "/v1/chat/completions", body, AUTH)
        assert len(up.requests) == 1  # the second was a hit
    return miss, hit


def _deltas(answer: Any, key: str) -> list[Any]:
    return [c.get(key) if key == "logprobs" else c["delta"].get(key)
            for e in _events(answer.body) if isinstance(e, dict) for c in e["choices"]
            if (c.get(key) if key == "logprobs" else c["delta"].get(key)) is not None]


async def test_a_streamed_cache_hit_keeps_the_logprobs_the_client_asked_for() -> None:
    """A hit returns the same choices: ``logprobs: true`` is part of the key; the JSON
    hit had the logprobs (the entry holds them), the miss streamed them, but the stream
    replay of the hit had none (OpenAI SDK: choice.logprobs None)."""
    body = {**CHAT, "stream": True, "logprobs": True}
    miss, hit = await _miss_then_hit("04-openai-stream-content-logprobs.sse", body)
    assert _deltas(miss, "logprobs")  # the miss streamed them
    assert _deltas(hit, "logprobs"), hit.body.decode()[:500]


async def test_a_streamed_cache_hit_keeps_the_providers_reasoning_field() -> None:
    """Ollama (and OpenRouter) stream reasoning as ``delta.reasoning``; the miss
    relayed it so, the hit replayed it renamed ``delta.reasoning_content``: a client
    reading the field its provider uses saw reasoning on a miss and none on a hit."""
    miss, hit = await _miss_then_hit("26-ollama-stream-reasoning-field-usage.sse", {**CHAT, "stream": True})
    assert "".join(_deltas(miss, "reasoning")).startswith("We need to answer")
    assert "".join(_deltas(hit, "reasoning")).startswith("We need to answer"), hit.body.decode()[:500]


def _synthetic(tmp_name: str, events: list[tuple[dict[str, Any], str | None]]) -> Any:
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    data = "".join(
        "data: " + json.dumps({**base, "choices": [
            {"index": 0, "delta": d, "logprobs": None, "finish_reason": fr}]}) + "\n\n"
        for d, fr in events).encode() + b"data: [DONE]\n\n"

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"content-length: %d\r\n\r\n" % len(data) + data)

    return reply


async def _json_and_assembled(reply: Any, **params: Any) -> tuple[Any, Any]:
    """The gateway's JSON answer, and its stream as the OpenAI SDK's stream helper
    assembles it, for the same upstream ``reply``."""
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    async with raw_server(reply) as up:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url=up.url)])},
            serve=polygate.Serve(api_keys=[GATEWAY_KEY]))
        async with open_server(settings, port=0) as server:
            def both() -> tuple[Any, Any]:
                with openai.OpenAI(base_url=server.base_url, api_key=GATEWAY_KEY, max_retries=0) as client:
                    whole = client.chat.completions.create(
                        model="chat", messages=CHAT["messages"], **params)
                    state = ChatCompletionStreamState()
                    for chunk in client.chat.completions.create(
                            model="chat", messages=CHAT["messages"], stream=True, **params):
                        state.handle_chunk(chunk)
                    return whole, state.current_completion_snapshot
            return await trio.to_thread.run_sync(both)


async def test_reasoning_then_tool_calls_assembles_to_content_null() -> None:
    """docs/serve.md: the role chunk's content "is null when the choice begins with tool
    calls or a refusal ... so that a client assembling the stream gets the JSON
    answer's content: null".  A reasoning model (DeepSeek-reasoner, Qwen3 on vLLM)
    reasons first, then calls a tool, with no content: its upstream role chunk says
    ``content: null`` and the gateway's JSON answer says null, but the gateway's role
    chunk says ``""`` (decided from the first forwarded delta: reasoning), so the
    OpenAI SDK assembled ``content == ""``."""
    reply = _synthetic("rt", [
        ({"role": "assistant", "content": None, "reasoning_content": ""}, None),
        ({"content": None, "reasoning_content": "Think"}, None),
        ({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                          "function": {"name": "f", "arguments": ""}}]}, None),
        ({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, None),
        ({}, "tool_calls"),
    ])
    json_answer, stream_answer = await _json_and_assembled(reply)
    whole, assembled = json_answer.choices[0].message, stream_answer.choices[0].message
    assert whole.content is None
    assert assembled.tool_calls and assembled.tool_calls[0].function.arguments == "{}"
    assert assembled.content == whole.content  # (it was "" against None)


async def test_n_choices_finish_in_chunks_of_their_own_as_openai_sends_them() -> None:
    """OpenAI (transcript 06, n=3) ends each choice with a finish chunk of its own,
    one choice per chunk, as every chunk of its stream is.  The gateway puts the three
    finishes in one chunk: a client that reads ``chunk.choices[0]`` (one choice per
    chunk, as OpenAI sends) never sees choices 1 and 2 finish."""
    name = "06-openai-stream-n3-choices-usage.sse"
    upstream = [json.loads(line[6:]) for line in (TRANSCRIPTS / name).read_text().splitlines()
                if line.startswith("data: {")]
    assert all(len(e["choices"]) <= 1 for e in upstream)
    answer = await _through_gateway(name, {**CHAT, "stream": True, "n": 3})
    events = [e for e in _events(answer.body) if isinstance(e, dict)]
    assert max(len(e["choices"]) for e in events) <= 1, [
        e["choices"] for e in events if len(e["choices"]) > 1]


async def test_azure_async_filter_annotations_reach_a_serve_client() -> None:
    """docs/serve.md (7ff843d): "a chunk with no content token that carries data is
    relayed too (... Azure's content_filter_results ...)".  Azure's asynchronous filter
    sends its annotations as chunks whose choice has no ``delta`` (transcript 10).  The
    library now forwards them, but StreamShape.chunk re-shapes any choice without a
    ``delta`` from ``chunk.delta`` (``{}``): the client gets two empty chunks
    (``delta: {}``, ``finish_reason: null``) after the answer's text and no annotation."""
    data = (TRANSCRIPTS / "10-azure-stream-async-filter-annotations.sse").read_bytes()
    answer = await _through(_reply_with(data), {**CHAT, "stream": True})
    events = [e for e in _events(answer.body) if isinstance(e, dict)]
    offsets = [c for e in events for c in e["choices"] if "content_filter_offsets" in c]
    assert offsets, json.dumps(events)[:3000]


async def test_a_relayed_finish_chunk_with_usage_is_not_followed_by_a_second_usage() -> None:
    """A finish chunk that carries an extra (OpenRouter's native_finish_reason, Azure's
    annotations) and the usage (DeepSeek/Mistral put usage on the finish chunk) is
    relayed raw; with include_usage the client then gets a usage object twice."""
    base = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    evs = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop",
                              "native_finish_reason": "end_turn"}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
    ]
    data = ("".join("data: " + json.dumps(e) + "\n\n" for e in evs) + "data: [DONE]\n\n").encode()
    answer = await _through(_reply_with(data), {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = [e for e in _events(answer.body) if isinstance(e, dict)]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["stop"], events
    usages = [e for e in events if e.get("usage")]
    assert len(usages) == 1, usages


async def test_a_relayed_finish_chunk_has_no_usage_the_client_did_not_ask_for() -> None:
    base = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    evs = [
        {**base, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop",
                              "native_finish_reason": "end_turn"}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
    ]
    data = ("".join("data: " + json.dumps(e) + "\n\n" for e in evs) + "data: [DONE]\n\n").encode()
    answer = await _through(_reply_with(data), {**CHAT, "stream": True})
    events = [e for e in _events(answer.body) if isinstance(e, dict)]
    assert not [e for e in events if e.get("usage")], events


def _calls(completion: Any) -> list[tuple[Any, ...]]:
    return [(c.index, [(t.id, t.function.name, t.function.arguments)
                       for t in c.message.tool_calls or []]) for c in completion.choices]


async def test_tool_calls_streamed_without_an_index_reach_an_sdk_client() -> None:
    """Review: Gemini's OpenAI-compatible endpoint streams tool calls without
    ``index``.  Relayed as they came, the OpenAI SDK's stream helper raised a
    TypeError, while the gateway's JSON answer had both calls.  An arguments fragment
    without index, id or name continues the call before it (it was a second call
    with no id and no name)."""
    reply = _synthetic("ix", [
        ({"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}},
        ]}, None),
        ({"tool_calls": [{"function": {"arguments": '{"q":1}'}}]}, None),
        ({"tool_calls": [{"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
         None),
        ({}, "tool_calls"),
    ])
    whole, assembled = await _json_and_assembled(reply)
    assert _calls(whole) == [(0, [("c1", "f", '{"q":1}'), ("c2", "g", "{}")])]
    assert _calls(assembled) == _calls(whole)


async def test_a_tool_call_id_and_name_repeated_on_every_delta_are_sent_once() -> None:
    """Review: a server that repeats a call's id and name on every delta (the
    library keeps one of each) reached an SDK client as "c1c1" and "lookuplookup"."""
    def call(arguments: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                "function": {"name": "lookup", "arguments": arguments}}]}

    reply = _synthetic("rp", [
        ({"role": "assistant", "content": None}, None), (call('{"q"'), None), (call(":1}"), None),
        ({}, "tool_calls"),
    ])
    whole, assembled = await _json_and_assembled(reply)
    assert _calls(whole) == [(0, [("c1", "lookup", '{"q":1}')])]
    assert _calls(assembled) == _calls(whole)


@asynccontextmanager
async def _over_a_plain_source(body: bytes) -> AsyncIterator[Any]:
    """A gateway in front of a source that cannot stream, which answers ``body``."""
    async with raw_server(_reply_with(body, b"application/json")) as up:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=up.url, streaming=False)])},
            serve=polygate.Serve(api_keys=[GATEWAY_KEY]))
        async with open_server(settings, port=0) as server:
            yield server


@pytest.mark.parametrize("n", [1, 2])
async def test_a_source_that_cannot_stream_keeps_its_logprobs_in_a_stream(n: int) -> None:
    """Review: with ``Source(streaming=False)`` the whole answer becomes one chunk
    made from each choice's message, and its logprobs were left out: the JSON answer
    had them, the SDK's assembled stream had none."""
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    def logprobs(token: str) -> dict[str, Any]:
        return {"content": [{"token": token, "bytes": list(token.encode()), "logprob": -0.1,
                             "top_logprobs": []}], "refusal": None}

    body = json.dumps({
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": i, "message": {"role": "assistant", "content": f"Hi{i}"},
                     "logprobs": logprobs(f"Hi{i}"), "finish_reason": "stop"} for i in range(n)],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }).encode()
    async with _over_a_plain_source(body) as server:
        def streamed() -> Any:
            with openai.OpenAI(base_url=server.base_url, api_key=GATEWAY_KEY, max_retries=0) as client:
                state = ChatCompletionStreamState()
                for chunk in client.chat.completions.create(
                        model="chat", messages=CHAT["messages"], stream=True, n=n, logprobs=True):
                    state.handle_chunk(chunk)
                return state.current_completion_snapshot
        assembled = await trio.to_thread.run_sync(streamed)
    got = sorted((c.index, c.message.content, c.logprobs.content[0].token if c.logprobs else None)
                 for c in assembled.choices)
    assert got == [(i, f"Hi{i}", f"Hi{i}") for i in range(n)]


def _top_level(events: list[Any], key: str) -> list[Any]:
    return [e[key] for e in events if isinstance(e, dict) and key in e]


@pytest.mark.parametrize(("name", "key"), [
    ("09-azure-stream-content-filter.sse", "prompt_filter_results"),
    ("27-llamacpp-stream-timings-usage-crlf-as-documented.sse", "timings"),
    ("29-llamacpp-stream-tool-call-timings-crlf-as-documented.sse", "timings"),
])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_streams_top_level_provider_fields_reach_a_serve_client(
    name: str, key: str, include_usage: bool
) -> None:
    """Outside review (transcripts through the gateway, 2026-12-03): Azure's
    ``prompt_filter_results`` (a leading chunk with no choices) and llama.cpp's
    ``timings`` (on its finish chunk) were in the JSON answer and never in the stream:
    chunks without a content token are not relayed, and the stream's own finish chunk
    carried only the header.  They now go out once, on the stream's last chunk (the
    usage chunk, or the last finish chunk), as the JSON answer assembles them."""
    whole = (await _through_gateway(name, {**CHAT})).json()
    assert key in whole  # the JSON answer keeps it
    request: dict[str, Any] = {**CHAT, "stream": True}
    if include_usage:
        request["stream_options"] = {"include_usage": True}
    streamed = _events((await _through_gateway(name, request)).body)
    assert _top_level(streamed, key) == [whole[key]]
    last = [e for e in streamed if isinstance(e, dict)][-1]
    assert last[key] == whole[key]
    assert ("usage" in last) == include_usage


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_source_that_cannot_stream_keeps_its_provider_fields_in_a_stream(include_usage: bool) -> None:
    """Outside review (transcripts through the gateway, 2026-12-03): a whole answer
    shown as one chunk kept only each choice's message and logprobs, dropping the
    body's provider fields (llama.cpp's ``timings``, Azure's ``prompt_filter_results``)
    and the choice's (Azure's ``content_filter_results``, vLLM's ``stop_reason``),
    which the JSON answer of the same body keeps."""
    filters = {"hate": {"filtered": False, "severity": "safe"}}
    body = json.dumps({
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": filters}],
        "timings": {"predicted_n": 1},
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                     "content_filter_results": filters, "stop_reason": 7,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }).encode()
    async with _over_a_plain_source(body) as server:
        request = {**CHAT, "stream": True}
        if include_usage:
            request["stream_options"] = {"include_usage": True}
        answer = await http(server, "POST", "/v1/chat/completions", request, AUTH)
    events = _events(answer.body)
    assert _top_level(events, "timings") == [{"predicted_n": 1}]
    assert _top_level(events, "prompt_filter_results") == [
        [{"prompt_index": 0, "content_filter_results": filters}]]
    choices = [c for e in events if isinstance(e, dict) for c in e.get("choices") or []]
    assert [c["content_filter_results"] for c in choices if "content_filter_results" in c] == [filters]
    assert [c["stop_reason"] for c in choices if "stop_reason" in c] == [7]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Hi"
