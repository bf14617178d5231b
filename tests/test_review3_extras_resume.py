"""Data-only chunks of a committed stream across a resume (outside review of 7ff843d, 2026-12-02: each test failed before its fix)."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate._resume import CONTINUE_PROMPT
from polygate.testing import Router

from .test_failover import _read as read_stream

BASE = {"object": "chat.completion.chunk", "created": 1, "model": "m"}
ANNOTATION = {"choices": [{"content_filter_offsets": {"check_offset": 1, "start_offset": 1, "end_offset": 9},
                           "content_filter_results": {"hate": {"filtered": False, "severity": "safe"}},
                           "finish_reason": None, "index": 0}],
              "created": 0, "id": "", "model": "", "object": ""}


def _sse(events: list[dict[str, Any]], done: bool = True) -> bytes:
    out = "".join("data: " + json.dumps(e) + "\n\n" for e in events)
    return (out + ("data: [DONE]\n\n" if done else "")).encode()


def _chunk(cid: str, delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {**BASE, "id": cid, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish, **choice}]}


def _first_segment() -> bytes:
    words = ["I like", " cats", " and", " dogs"]
    return _sse([_chunk("one", {"role": "assistant", "content": ""})]
                + [_chunk("one", {"content": w}) for w in words], done=False)  # cut: no finish


def _transport(continuation: list[dict[str, Any]]) -> Router:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        last = body["messages"][-1]
        if last["role"] == "assistant" or last["content"] == CONTINUE_PROMPT:
            data = _sse(continuation)
        else:
            data = _first_segment()
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    t = httpx.MockTransport(handler)
    return Router({"a": t, "b": t})


def _settings() -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        stream=polygate.StreamWatch(resume=True))})


async def _read(continuation: list[dict[str, Any]]) -> tuple[Any, list[polygate.StreamChunk]]:
    async with polygate.session(_settings(), transport=_transport(continuation)) as s:
        return await read_stream(s)


async def test_a_continuations_held_text_is_not_lost_to_a_trailing_annotation_chunk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The continuation's text " and" is held by the Stitcher (it may be the start of
    the restated tail " and dogs").  Azure's asynchronous filter then sends its
    annotation chunks (no delta) after the finish chunk (transcript 10).  Since 7ff843d
    such a chunk reaches ResumedForward.offer, which keeps it as ``_last`` in place of
    the chunk holding the text; at the end the held text is written into a chunk with no
    delta -- and is lost: the caller never sees " and", though the response says it."""
    continuation = [
        _chunk("two", {"role": "assistant", "content": ""}),
        _chunk("two", {"content": " and"}),
        _chunk("two", {}, "stop"),
        ANNOTATION,
    ]
    stream, chunks = await _read(continuation)
    shown = "".join(c.text for c in chunks)
    assert stream.response is not None
    assert shown == stream.text == stream.response.text, (shown, stream.text, stream.response.text)
    assert shown == "I like cats and dogs and"


async def test_an_annotation_chunk_while_the_stitcher_holds_text_reaches_the_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/concepts.md: once a path has committed, a chunk that carries data without a
    content token "reaches the caller too".  On a resumed stream, one that comes while
    the stitcher holds the continuation's first text is swallowed (kept as ``_last``,
    then replaced by the next content chunk): the caller never sees it."""
    continuation = [
        _chunk("two", {"role": "assistant", "content": ""}),
        _chunk("two", {"content": " and"}),
        ANNOTATION,
        _chunk("two", {"content": " birds too"}),
        _chunk("two", {}, "stop"),
    ]
    _stream, chunks = await _read(continuation)
    assert "".join(c.text for c in chunks) == "I like cats and dogs and birds too"
    assert any("content_filter_offsets" in (c.raw.get("choices") or [{}])[0] for c in chunks), [
        c.raw for c in chunks]


FINISH_WITH_EXTRAS = _chunk("two", {}, "stop", native_finish_reason="stop")  # OpenRouter's


FILLER = [f" w{i}" for i in range(40)]


async def _read_slowly(continuation: list[dict[str, Any]]) -> tuple[Any, list[polygate.StreamChunk]]:
    """As ``_read``, with a caller so far behind that the stream's buffer (32 chunks) is
    full when the continuation finishes: each chunk then waits to be handed over."""
    first = _sse([_chunk("one", {"role": "assistant", "content": ""})]
                 + [_chunk("one", {"content": w}) for w in ["I like cats", *FILLER, " and", " dogs"]],
                 done=False)

    def handler(request: httpx.Request) -> httpx.Response:
        last = json.loads(request.content)["messages"][-1]
        data = _sse(continuation) if last["role"] == "assistant" or last["content"] == CONTINUE_PROMPT else first
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    chunks = []
    t = httpx.MockTransport(handler)
    async with polygate.session(_settings(), transport=Router({"a": t, "b": t})) as s:
        async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
            await trio.sleep(100)
            async for chunk in stream:
                chunks.append(chunk)
                await trio.sleep(1)
    return stream, chunks


def _finish_at(chunks: list[polygate.StreamChunk]) -> int:
    return next(i for i, c in enumerate(chunks)
                if ((c.raw.get("choices") or [{}])[0]).get("finish_reason"))


@pytest.mark.parametrize("read", [_read, _read_slowly], ids=["prompt", "behind"])
@pytest.mark.parametrize("after", [[], [{**BASE, "id": "two", "choices": [],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                                   "total_tokens": 3}}]], ids=["", "usage"])
async def test_a_continuations_finish_chunk_follows_its_held_text(
    autojump_clock: trio.testing.MockClock, read: Any, after: list[dict[str, Any]],
) -> None:
    """review: the continuation's " and" is held while the stitcher decides (it may
    restate " and dogs"); a finish chunk the caller is shown (it carries a vendor field)
    went on at once, and the held text after it -- content after the chunk that says the
    answer finished, which polygate serve relays to its clients as it is."""
    continuation = [
        _chunk("two", {"role": "assistant", "content": ""}),
        _chunk("two", {"content": " and"}),
        FINISH_WITH_EXTRAS,
        *after,
    ]
    stream, chunks = await read(continuation)
    assert "".join(c.text for c in chunks) == stream.text
    assert stream.text.startswith("I like cats") and stream.text.endswith(" and dogs and")
    finished = _finish_at(chunks)
    assert [c.text for c in chunks[finished:] if c.text] == []
    assert chunks[finished].raw["choices"][0]["native_finish_reason"] == "stop"
    assert sum(c.resumed for c in chunks) == 1
