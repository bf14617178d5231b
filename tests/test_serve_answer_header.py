"""An answer's ``id``, ``created`` and ``model`` have OpenAI's types, whatever the
upstream's chunks said of them (an outside review, the gateway's answers against the
openai package's own types, strictly)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import polygate

from ._raw_server import answering
from ._serve_kit import AUTH, CHAT, http, raw_gateway


def _chunks(head: dict[str, Any]) -> bytes:
    deltas = [({"role": "assistant", "content": ""}, None), ({"content": "Hi"}, None), ({}, "stop")]
    return b"".join(
        b"data: " + json.dumps({**head, "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"
        for delta, finish in deltas) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("head", [
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"},
    {"object": "chat.completion.chunk", "created": 1700000000, "model": "m"},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": ""},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": True, "model": "m"},
    {"id": 12345, "object": "chat.completion.chunk", "created": 1700000000, "model": 7},
], ids=["created-0", "no-created", "no-id", "model-empty", "created-true", "int-id-and-model"])
async def test_an_answer_says_its_id_created_and_model_as_openai_types_them(
    head: dict[str, Any],
) -> None:
    """The JSON answer assembled from such chunks said ``created: null`` (or ``id``,
    ``model``), which a client typing them rejects; the stream passed a bool
    ``created`` and numbers as ``id`` and ``model`` on to every chunk."""
    async with raw_gateway(answering(_chunks(head)), retry=polygate.Retry(max_attempts=1)) as (server, _):
        whole = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        streamed = await http(server, "POST", "/v1/chat/completions", {**CHAT, "stream": True}, AUTH)
    assert whole.status == 200 and streamed.status == 200
    answer = ChatCompletion.model_validate(whole.json(), strict=True)
    assert answer.choices[0].message.content == "Hi"
    events = [line[6:] for line in streamed.body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e), strict=True) for e in events[:-1]]
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    if isinstance(head.get("id"), str):
        assert answer.id == chunks[0].id == head["id"]
