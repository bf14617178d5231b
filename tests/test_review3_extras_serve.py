"""Data-only chunks through `polygate serve` (outside review of 7ff843d, 2026-12-02: each test failed before its fix)."""
from __future__ import annotations

import json
from typing import Any

import trio

import polygate
from polygate.serve import open_server

from ._raw_server import raw_server
from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, http
from .conftest import TRANSCRIPTS


def _reply_with(data: bytes) -> Any:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"content-length: %d\r\n\r\n" % len(data) + data)
    return reply


def _events(body: bytes) -> list[Any]:
    out = []
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:]
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def _through(data: bytes, body: dict[str, Any]) -> Any:
    async with raw_server(_reply_with(data)) as up:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=up.url)],
                retry=polygate.Retry(max_attempts=1))},
            serve=polygate.Serve(api_keys=[GATEWAY_KEY]))
        async with open_server(settings, port=0) as server:
            return await http(server, "POST", "/v1/chat/completions", body, AUTH)


async def test_azure_async_filter_annotations_reach_a_serve_client() -> None:
    """docs/serve.md (7ff843d): "a chunk with no content token that carries data is
    relayed too (... Azure's content_filter_results ...)".  Azure's asynchronous filter
    sends its annotations as chunks whose choice has no ``delta`` (transcript 10).  The
    library now forwards them, but StreamShape.chunk re-shapes any choice without a
    ``delta`` from ``chunk.delta`` (``{}``): the client gets two empty chunks
    (``delta: {}``, ``finish_reason: null``) after the answer's text and no annotation."""
    data = (TRANSCRIPTS / "10-azure-stream-async-filter-annotations.sse").read_bytes()
    answer = await _through(data, {**CHAT, "stream": True})
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
    answer = await _through(data, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
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
    answer = await _through(data, {**CHAT, "stream": True})
    events = [e for e in _events(answer.body) if isinstance(e, dict)]
    assert not [e for e in events if e.get("usage")], events
