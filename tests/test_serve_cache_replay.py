"""A cached answer replayed as a stream through ``polygate serve``, read by the OpenAI
SDK's own stream helper, assembles as the miss did (outside review, 2026-12-02: each
test failed before its fix)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio
from openai.lib.streaming.chat import ChatCompletionStreamState

import polygate
from polygate.serve import open_server

from ._raw_server import raw_server
from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, http, settings_for
from .conftest import TRANSCRIPTS

pytestmark = pytest.mark.integration

BASE = {"object": "chat.completion.chunk", "created": 1, "model": "m"}
USAGE = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def _ev(choices: list[Any], usage: Any = None) -> bytes:
    body: dict[str, Any] = {**BASE, "id": "c1", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _sse(data: bytes) -> Any:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"content-length: %d\r\n\r\n" % len(data) + data)
    return reply


def _events(body: bytes) -> list[Any]:
    out = []
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                out.append("[DONE]" if line[6:] == b"[DONE]" else json.loads(line[6:]))
    return out


async def _miss_then_hit_with_sdk(data: bytes, **params: Any) -> tuple[Any, Any, Any]:
    """The same streamed request twice through a caching gateway (a miss, then a hit),
    each assembled by the OpenAI SDK's own stream helper, then a JSON hit."""
    async with raw_server(_sse(data)) as up:
        settings = settings_for(up.url, cache="memory", retry=polygate.Retry(max_attempts=1),
                                cache_ttl_s=60)
        async with open_server(settings, port=0) as server:
            def run() -> list[Any]:
                with openai.OpenAI(base_url=server.base_url, api_key=GATEWAY_KEY, max_retries=0) as client:
                    out = []
                    for _ in range(2):
                        state = ChatCompletionStreamState()
                        for chunk in client.chat.completions.create(
                                model="chat", messages=CHAT["messages"], stream=True, **params):
                            state.handle_chunk(chunk)
                        out.append(state.current_completion_snapshot)
                    out.append(client.chat.completions.create(
                        model="chat", messages=CHAT["messages"], **params))
                    return out
            miss, hit, whole = await trio.to_thread.run_sync(run)
        assert len(up.requests) == 1  # the second and third were hits
    return miss, hit, whole


def _lp(token: str) -> dict[str, Any]:
    return {"content": [{"token": token, "logprob": -0.5, "bytes": list(token.encode()),
                         "top_logprobs": []}], "refusal": None}


def _choice(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def _two_choices(tokens: list[tuple[int, str]]) -> bytes:
    """An OpenAI stream of two choices with logprobs: the role chunks, ``tokens`` (choice,
    text) in that order, the finish chunks (stop, length) and the usage."""
    empty = {"content": [], "refusal": None}
    roles = b"".join(_ev([_choice(i, {"role": "assistant", "content": ""}, logprobs=empty)]) for i in (0, 1))
    content = b"".join(_ev([_choice(i, {"content": t}, logprobs=_lp(t))]) for i, t in tokens)
    ending = _ev([_choice(0, {}, "stop")]) + _ev([_choice(1, {}, "length")]) + _ev([], USAGE)
    return roles + content + ending + b"data: [DONE]\n\n"


async def test_a_streamed_hit_with_n_2_and_logprobs_assembles_as_the_miss_did() -> None:
    """docs/serve.md: "a role chunk ... before each choice's first chunk (with n > 1,
    every choice gets its own, as the OpenAI SDK's stream helper expects)".  The miss
    gets one; a streamed cache hit sends each choice as one chunk holding role, whole
    content and logprobs.  The OpenAI SDK's stream helper then counts the logprobs of
    choice 1 twice (it seeds a new choice from its first chunk, logprobs included,
    and then extends them with the same chunk's): the miss assembles X, Y; the hit
    X, Y, X, Y.  The JSON hit is right."""
    miss, hit, whole = await _miss_then_hit_with_sdk(_two_choices([(0, "A"), (1, "X"), (0, "B"), (1, "Y")]),
                                                     n=2, logprobs=True)

    def tokens(completion: Any) -> list[list[str]]:
        return [[t.token for t in c.logprobs.content] for c in completion.choices]

    assert tokens(miss) == [["A", "B"], ["X", "Y"]]
    assert tokens(whole) == tokens(miss)
    assert tokens(hit) == tokens(miss)  # was [["A", "B"], ["X", "Y", "X", "Y"]]


async def test_a_streamed_hit_of_a_refusal_keeps_its_logprobs() -> None:
    """A hit returns the same choices (SPEC §8.3).  OpenAI streams a refusal's logprobs
    under ``logprobs.refusal`` (transcript 05).  The miss relays them, and the JSON hit
    has them; the streamed hit drops them: the replay attaches a choice's logprobs only
    to a chunk that carries ``content`` (polygate/_cached.py, ``_replay``)."""
    data = (TRANSCRIPTS / "05-openai-stream-refusal-logprobs.sse").read_bytes()
    miss, hit, whole = await _miss_then_hit_with_sdk(data, logprobs=True)
    refused = [t.token for t in miss.choices[0].logprobs.refusal]
    assert refused[:2] == ["I'm", " very"]
    assert [t.token for t in whole.choices[0].logprobs.refusal] == refused
    assert hit.choices[0].logprobs is not None  # was None
    assert [t.token for t in hit.choices[0].logprobs.refusal] == refused


async def test_a_streamed_hit_keeps_the_messages_annotations() -> None:
    """OpenAI's search models stream ``url_citation`` annotations in a delta of their
    own.  The miss relays them and the SDK assembles ``message.annotations``; the JSON
    hit has them; the streamed hit replays reasoning, content, refusal and tool calls
    only, so the citations are gone (polygate/_cached.py, ``_replay``)."""
    annotations = [{"type": "url_citation", "url_citation": {
        "start_index": 0, "end_index": 5, "title": "Paris", "url": "https://example.com/paris"}}]
    data = (_ev([_choice(0, {"role": "assistant", "content": ""})])
            + _ev([_choice(0, {"content": "Paris"})])
            + _ev([_choice(0, {"annotations": annotations})])
            + _ev([_choice(0, {}, "stop")]) + _ev([], USAGE) + b"data: [DONE]\n\n")
    miss, hit, whole = await _miss_then_hit_with_sdk(data)
    cited = [a.url_citation.url for a in miss.choices[0].message.annotations or []]
    assert cited == ["https://example.com/paris"]
    assert [a.url_citation.url for a in whole.choices[0].message.annotations or []] == cited
    assert [a.url_citation.url for a in hit.choices[0].message.annotations or []] == cited  # was []


# --- a live stream's first chunks through serve (outside review, 2026-12-02): the
# role chunk of its own before a first chunk with logprobs, and every lower choice's
# role before a choice's first chunk (choice 1 first raised an IndexError in the SDK)


def _tokens(completion: Any) -> list[list[str]]:
    return [[t.token for t in c.logprobs.content] for c in completion.choices]


def _summary(c: Any) -> list[tuple[Any, ...]]:
    return [(ch.index, ch.message.role, ch.message.content, ch.finish_reason) for ch in c.choices]


async def test_live_first_chunk_with_role_content_and_logprobs() -> None:
    data = (_ev([_choice(0, {"role": "assistant", "content": "A"}, logprobs=_lp("A"))])
            + _ev([_choice(0, {"content": "B"}, logprobs=_lp("B"))])
            + _ev([_choice(0, {}, "stop")]) + _ev([], USAGE) + b"data: [DONE]\n\n")
    miss, hit, whole = await _miss_then_hit_with_sdk(data, logprobs=True)
    assert _tokens(miss) == [["A", "B"]]
    assert _summary(miss) == [(0, "assistant", "AB", "stop")]
    assert _tokens(hit) == _tokens(whole) == _tokens(miss)
    assert _summary(hit) == _summary(miss)


async def test_n2_first_chunks_in_one_event_with_role_and_logprobs() -> None:
    data = (_ev([_choice(0, {"role": "assistant", "content": "A"}, logprobs=_lp("A")),
                 _choice(1, {"role": "assistant", "content": "X"}, logprobs=_lp("X"))])
            + _ev([_choice(0, {"content": "B"}, logprobs=_lp("B")),
                   _choice(1, {"content": "Y"}, logprobs=_lp("Y"))])
            + _ev([_choice(0, {}, "stop"), _choice(1, {}, "stop")])
            + _ev([], USAGE) + b"data: [DONE]\n\n")
    miss, hit, whole = await _miss_then_hit_with_sdk(data, n=2, logprobs=True)
    assert _tokens(miss) == [["A", "B"], ["X", "Y"]]
    assert _summary(miss) == [(0, "assistant", "AB", "stop"), (1, "assistant", "XY", "stop")]
    assert _tokens(hit) == _tokens(whole) == _tokens(miss)
    assert _summary(hit) == _summary(miss)


async def test_n2_choice1_content_first() -> None:
    """OpenAI sends each choice's role chunk first; content of choice 1 may come before
    choice 0's.  serve drops the upstream's role chunks and adds its own lazily."""
    miss, hit, whole = await _miss_then_hit_with_sdk(_two_choices([(1, "X"), (0, "A"), (1, "Y"), (0, "B")]),
                                                     n=2, logprobs=True)
    assert _summary(whole) == [(0, "assistant", "AB", "stop"), (1, "assistant", "XY", "length")]
    assert _summary(miss) == _summary(whole)
    assert _tokens(miss) == [["A", "B"], ["X", "Y"]]
    assert _summary(hit) == _summary(whole)


async def test_an_answer_no_client_can_be_sent_is_not_cached() -> None:
    """An answer holding a NaN (a provider's extra field, a logprob) cannot be written
    as JSON: a 502.  It was stored, and every identical request until the entry
    expired got that 502 from the cache (``x-polygate-cached: true``), the upstream
    never asked again (outside review, 2026-12-07, eleventh)."""
    body = (b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
            b'"message":{"role":"assistant","content":"hey"},"finish_reason":"stop"}],"x":NaN}')

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n" % len(body) + body)

    async with raw_server(reply) as up:
        settings = settings_for(up.url, cache="memory", retry=polygate.Retry(max_attempts=1),
                                cache_ttl_s=3600)
        async with open_server(settings, port=0) as server:
            answers = [await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
                       for _ in range(2)]
            cache = (await server.session.statistics()).cache
    assert [a.status for a in answers] == [502, 502]
    assert [a.headers.get("x-polygate-cached") for a in answers] != ["false", "true"]
    assert len(up.requests) == 2  # asked again: nothing was stored
    assert cache is not None and cache.errors == 2  # counted: answers it could not store
