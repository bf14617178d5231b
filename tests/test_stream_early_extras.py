"""Data a stream sends before its first content token (outside review, the OpenAI SDK
through the gateway, 2026-12-03: each test failed before its fix).

Such a chunk (OpenRouter's encrypted reasoning block, Azure On Your Data's citations,
every chunk of an audio-only answer) carries no content token, so it commits nothing:
it was relayed only from a committed path, and before the commit there is none, so
it was dropped.  It is now held by its path and reaches the caller, in order, when
that path commits or wins; a path that loses takes its chunks with it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio
import trio.testing

import polygate
from polygate.testing import Router

BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
MESSAGES = [{"role": "user", "content": "hi"}]
SIGNED = {"reasoning_details": [{"index": 0, "type": "reasoning.encrypted", "data": "EncRypt=="}]}
CONTEXT = {"context": {"citations": [{"title": "doc", "content": "the source"}], "intent": "q"}}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _sse(events: list[dict[str, Any]]) -> bytes:
    return ("".join("data: " + json.dumps(e) + "\n\n" for e in events) + "data: [DONE]\n\n").encode()


class _Paced(httpx.AsyncBaseTransport):
    """Answers with ``events``, waiting ``pause_s`` (trio's clock) after the first
    ``pause_after`` of them."""

    def __init__(self, events: list[dict[str, Any]], pause_after: int = 0, pause_s: float = 0.0) -> None:
        self.events, self.pause_after, self.pause_s = events, pause_after, pause_s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for i, event in enumerate(self.events):
                if i == self.pause_after and self.pause_s:
                    await trio.sleep(self.pause_s)
                yield ("data: " + json.dumps(event) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


async def _stream(settings: polygate.Settings, transport: httpx.AsyncBaseTransport
                  ) -> tuple[polygate.ChatStream, list[polygate.StreamChunk]]:
    chunks = []
    async with polygate.session(settings, transport=transport) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    return stream, chunks


def _one_source() -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})


async def test_data_before_the_first_token_reaches_the_caller_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "", **SIGNED}),
        _chunk(CONTEXT),
        _chunk({"content": "Hello"}),
        _chunk({"content": " there"}, "stop"),
    ]
    transport = httpx.MockTransport(lambda r: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse(events)))
    stream, chunks = await _stream(_one_source(), Router({"a": transport}))
    assert [c.delta for c in chunks[:2]] == [{"content": "", **SIGNED}, CONTEXT]
    assert "".join(c.text for c in chunks) == "Hello there" == stream.text
    assert stream.response is not None
    assert stream.response.message["reasoning_details"] == SIGNED["reasoning_details"]


async def test_an_audio_only_answer_reaches_the_caller(autojump_clock: trio.testing.MockClock) -> None:
    """Audio deltas are no content tokens (SPEC §4's list): such an answer never
    commits, and its stream showed the caller nothing of it."""
    audio = [{"id": "au_1", "data": "AAAA", "transcript": "Hel"}, {"data": "BBBB", "transcript": "lo"},
             {"expires_at": 9}]
    events = [_chunk({"role": "assistant", "content": None})] + [
        _chunk({"audio": a}) for a in audio] + [_chunk({}, "stop")]
    transport = httpx.MockTransport(lambda r: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse(events)))
    stream, chunks = await _stream(_one_source(), Router({"a": transport}))
    assert [c.delta.get("audio") for c in chunks] == audio
    assert stream.response is not None
    assert stream.response.message["audio"] == {
        "id": "au_1", "data": "AAAABBBB", "transcript": "Hello", "expires_at": 9}


async def test_a_losing_paths_early_data_never_reaches_the_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """a sends its citations, then hangs before its first token; b, the hedge, answers
    first and commits: only b's citations reach the caller, and before its text."""
    mine = {"context": {"citations": [{"title": "a's"}]}}
    theirs = {"context": {"citations": [{"title": "b's"}]}}
    a = _Paced([_chunk(mine), _chunk({"content": "from a"}, "stop")], pause_after=1, pause_s=100)
    b = _Paced([_chunk(theirs), _chunk({"content": "from b"}, "stop")])
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        hedge=polygate.Hedge(after_s=2.0))})
    stream, chunks = await _stream(settings, Router({"a": a, "b": b}))
    assert [c.delta for c in chunks] == [theirs, {"content": "from b"}]
    assert stream.response is not None and stream.response.call_stats.hedge_won


async def test_a_long_run_of_data_before_any_token_commits_instead_of_piling_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix: held as parsed chunks, thousands of data-only chunks before a
    token cost 5-11 times their bytes (350 MB for one stream at the body cap).  At 64
    the path commits on them: they reach the caller in order, and the hedge that would
    have raced it never launches."""
    from polygate import _hedge

    data = [{"audio": {"data": f"{i:04d}"}} for i in range(3 * _hedge._EARLY_CAP)]
    a = _Paced([_chunk(d) for d in data] + [_chunk({"content": "end"}, "stop")],
               pause_after=_hedge._EARLY_CAP + 5, pause_s=5.0)
    b = _Paced([_chunk({"content": "from b"}, "stop")])
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        hedge=polygate.Hedge(after_s=2.0))})
    stream, chunks = await _stream(settings, Router({"a": a, "b": b}))
    assert [c.delta for c in chunks] == [*data, {"content": "end"}]
    assert stream.response is not None
    assert (stream.response.source, stream.response.call_stats.hedges) == ("a", 0)
