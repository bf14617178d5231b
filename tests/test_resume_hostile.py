"""A stream resumed on another source when a segment carries values the assembler
ignores for their type (outside review, 2026-12-07, eleventh: each case failed before
its fix).  Such a value is no refusal and no tool call to the answer and to the
gateway's relay, so it neither turns resuming off nor counts as something shown."""

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

BASE = {"object": "chat.completion.chunk", "created": 1, "model": "m"}
WORDS = ["I like", " cats", " and", " dogs"]


def _ch(cid: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**BASE, "id": cid, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _sse(events: list[dict[str, Any]], done: bool) -> bytes:
    return ("".join("data: " + json.dumps(e) + "\n\n" for e in events)
            + ("data: [DONE]\n\n" if done else "")).encode()


async def _resumed(first: list[dict[str, Any]], rest: list[dict[str, Any]]) -> Any:
    """The stream whose first segment (from a) is cut before its end and whose rest
    comes from b; (its chunks' text, the stream)."""
    def answer(request: httpx.Request) -> httpx.Response:
        last = json.loads(request.content)["messages"][-1]
        continuing = last["role"] == "assistant" or last["content"] == CONTINUE_PROMPT
        data = _sse(rest, True) if continuing else _sse(first, False)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    transport = httpx.MockTransport(answer)
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        stream=polygate.StreamWatch(resume=True))})
    async with polygate.session(settings, transport=Router({"a": transport, "b": transport})) as s:
        async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
            shown = "".join([chunk.text async for chunk in stream])
    return shown, stream


@pytest.mark.parametrize("junk", [
    {"refusal": 5}, {"refusal": ["x"]}, {"tool_calls": "f"}, {"tool_calls": {"x": 1}},
    {"tool_calls": [{"index": 0}]}, {"tool_calls": [{"index": 0, "function": None}]},
    {"function_call": "auto"}, {"function_call": {"arguments": ""}},
])
async def test_a_value_that_is_no_refusal_or_call_leaves_the_stream_resumable(
    junk: dict[str, Any], autojump_clock: trio.testing.MockClock,
) -> None:
    """A first segment whose text came with ``refusal: 5``, ``tool_calls: "f"``, an
    empty call delta … was taken for one that showed a refusal or a call: never
    resumed, the caller got the cut's ``TransientUpstreamError``."""
    first = [_ch("one", {"role": "assistant", "content": ""}), _ch("one", {"content": WORDS[0], **junk})]
    first += [_ch("one", {"content": word}) for word in WORDS[1:]]
    rest = [_ch("two", {"role": "assistant", "content": ""}), _ch("two", {"content": ", birds"}),
            _ch("two", {}, "stop")]
    shown, stream = await _resumed(first, rest)
    assert stream.response is not None
    assert shown == stream.text == stream.response.text == "I like cats and dogs, birds"
    assert (stream.response.call_stats.resumes, stream.response.call_stats.source) == (1, "b")


async def test_a_value_that_is_nothing_shown_leaves_the_restatement_to_the_stitcher(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A continuation that restates " cats and dogs" over two chunks, each with a
    ``refusal: 5``: the value was counted as something shown, so the stitcher decided
    before it could see the restatement, and the caller read it twice."""
    first = [_ch("one", {"role": "assistant", "content": ""})] + [_ch("one", {"content": w}) for w in WORDS]
    rest = [_ch("two", {"role": "assistant", "content": ""}),
            _ch("two", {"content": " cats and", "refusal": 5}),
            _ch("two", {"content": " dogs, birds", "refusal": 5}), _ch("two", {}, "stop")]
    shown, stream = await _resumed(first, rest)
    assert shown == stream.text == "I like cats and dogs, birds"


@pytest.mark.parametrize("extra", [{"x_flag": False}, {"x_n": 0}, {"reasoning": None}])
async def test_a_field_that_shows_nothing_leaves_the_restatement_to_the_stitcher(
    extra: dict[str, Any], autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix above: a ``false`` or a ``0`` beside the restated text was
    counted as something shown (it was not, before the fix)."""
    first = [_ch("one", {"role": "assistant", "content": ""})] + [_ch("one", {"content": w}) for w in WORDS]
    rest = [_ch("two", {"role": "assistant", "content": ""}),
            _ch("two", {"content": " cats and", **extra}),
            _ch("two", {"content": " dogs, birds", **extra}), _ch("two", {}, "stop")]
    shown, stream = await _resumed(first, rest)
    assert shown == stream.text == "I like cats and dogs, birds"
