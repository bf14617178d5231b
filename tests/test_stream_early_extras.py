"""Data a stream sends before its first content token (outside review, the OpenAI SDK
through the gateway, 2026-12-03: each test failed before its fix).

Such a chunk (OpenRouter's encrypted reasoning block, Azure On Your Data's citations;
before this session an audio-only answer's every chunk too) carries no content token, so it commits nothing:
it was relayed only from a committed path, and before the commit there is none, so
it was dropped.  It is now held by its path and reaches the caller, in order, when
that path commits or wins; a path that loses takes its chunks with it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
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

    def __init__(self, events: list[dict[str, Any]], pause_after: int = 0, pause_s: float = 0.0,
                 done: bool = True) -> None:
        self.events, self.pause_after, self.pause_s, self.done = events, pause_after, pause_s, done

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for i, event in enumerate(self.events):
                if i == self.pause_after and self.pause_s:
                    await trio.sleep(self.pause_s)
                yield ("data: " + json.dumps(event) + "\n\n").encode()
            if self.done:
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
    """An audio-only answer's stream showed the caller nothing of it: its deltas were
    no content tokens, so it never committed.  A piece of audio (its data or its
    transcript) is model output, a content token as text is; its id or expiry alone
    is data."""
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


async def test_a_long_run_of_data_before_any_token_is_not_held_past_the_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix: held as parsed chunks, thousands of data-only chunks before a
    token cost 5-11 times their bytes (350 MB for one stream at the body cap).  At most
    64 are held; the rest are left out of the stream, and the answer has them all."""
    from polygate import _hedge

    cap = _hedge._EARLY_CAP
    data = [{"x_part": [i]} for i in range(3 * cap)]
    events = [_chunk(d) for d in data] + [_chunk({"content": "end"}, "stop")]
    transport = httpx.MockTransport(lambda r: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse(events)))
    stream, chunks = await _stream(_one_source(), Router({"a": transport}))
    assert [c.delta for c in chunks] == [*data[:cap], {"content": "end"}]
    assert stream.response is not None
    assert stream.response.message["x_part"] == list(range(3 * cap))


async def test_audio_is_watched_as_content_and_never_resumed(autojump_clock: trio.testing.MockClock) -> None:
    """Review of the fix: an audio stream is a committed stream like a text one: its
    first piece is the first token (ttft_ms), a silence after it is a stall
    (StreamStalled), and a cut is never continued on another source (half an
    utterance in another voice): with resume on, it fails as cut."""
    audio = [_chunk({"audio": {"data": f"A{i:03d}"}}) for i in range(5)]
    silent = _Paced([*audio, _chunk({}, "stop")], pause_after=5, pause_s=100)
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", ttft_timeout_s=10)],
        stream=polygate.StreamWatch(stall_timeout_s=5))})
    shown = []
    with pytest.raises(polygate.StreamStalled):
        async with polygate.session(settings, transport=Router({"a": silent})) as s:
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    shown.append(chunk.delta["audio"]["data"])
    assert shown == [f"A{i:03d}" for i in range(5)]

    cut = _Paced(audio, done=False)
    other = _Paced([_chunk({"audio": {"data": "B000"}}), _chunk({}, "stop")])
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        stream=polygate.StreamWatch(resume=True))})
    shown = []
    with pytest.raises(polygate.TransientUpstreamError):
        async with polygate.session(settings, transport=Router({"a": cut, "b": other})) as s:
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    shown.append(chunk.delta["audio"]["data"])
    assert shown == [f"A{i:03d}" for i in range(5)]


async def test_an_audio_answers_first_piece_is_its_first_token(autojump_clock: trio.testing.MockClock) -> None:
    a = _Paced([_chunk({"role": "assistant"}), _chunk({"audio": {"id": "au"}}),
                _chunk({"audio": {"data": "AAAA"}}), _chunk({}, "stop")], pause_after=2, pause_s=3.0)
    async with polygate.session(_one_source(), transport=Router({"a": a})) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.ttft_ms == 3000.0
    assert r.message["audio"] == {"id": "au", "data": "AAAA"}


async def test_an_audio_only_whole_answer_reaches_a_stream_caller(autojump_clock: trio.testing.MockClock) -> None:
    """Review of the audio fix: a whole JSON answer to a stream call becomes one chunk
    when it holds a content token, and audio was not among the fields looked at: an
    audio-only answer from a source that cannot stream showed the caller nothing."""
    audio = {"id": "au", "data": "AAAA", "transcript": "Hi", "expires_at": 9}
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": None, "audio": audio},
         "finish_reason": "stop"}]}
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json=body))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    stream, chunks = await _stream(settings, Router({"a": transport}))
    assert [c.delta.get("audio") for c in chunks] == [audio]
    assert stream.response is not None and stream.response.message["audio"] == audio
