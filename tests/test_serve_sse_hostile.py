"""The gateway's stream relay against upstream values of the wrong type, checked the
way a client reads it: every event is a ``ChatCompletionChunk`` to the OpenAI SDK,
its stream helper (``ChatCompletionStreamState``) takes every one without raising,
and what it builds is the JSON answer (outside review, 2026-12-07, eleventh: each case
failed before its fix, most of them with an exception inside the client)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

import polygate
from polygate.serve import open_server
from polygate.serve._app import _answer_body

from ._raw_server import raw_server
from ._serve_kit import GATEWAY_KEY, settings_for
from .test_serve_sse_tools import _streamed_through_the_library

BASE = {"id": "cid", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def _c(*choices: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {**BASE, "choices": list(choices), **top}


def _end(*indexes: int, reason: str = "stop") -> dict[str, Any]:
    return _c(*({"index": i, "delta": {}, "finish_reason": reason} for i in indexes or (0,)))


_CALL = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

CASES: dict[str, list[dict[str, Any]]] = {
    # A server that leaves the index out (one choice): the helper raised TypeError.
    "no-index": [_c({"delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}),
                 _c({"delta": {"content": " there"}, "finish_reason": None}),
                 _c({"delta": {}, "finish_reason": "stop"})],
    # Two entries of a new choice in one chunk, both naming the role: the role was
    # lost (dropped from both by the choice's index), or the helper raised.
    "one-choice-twice-with-roles": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None},
           {"index": 0, "delta": {"role": "assistant", "content": "b"}, "finish_reason": None}),
        _end()],
    "two-choices-twice-with-roles": [
        _c({"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None},
           {"index": 0, "delta": {"role": "assistant", "refusal": "no"}, "finish_reason": None}),
        _c({"index": 1, "delta": {"role": "assistant"}, "finish_reason": None},
           {"index": 1, "delta": {"role": "assistant", "tool_calls": [_CALL]}, "finish_reason": None}),
        _c({"index": 0, "delta": {}, "finish_reason": "stop"},
           {"index": 1, "delta": {}, "finish_reason": "tool_calls"})],
    # The fingerprint only on the finish chunk (not forwarded): the JSON answer had it,
    # the stream's client not.
    "fingerprint-on-the-finish-chunk": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None}),
        _c({"index": 0, "delta": {}, "finish_reason": "stop"}, system_fingerprint="fp_1")],
    # A fingerprint that is no string, first seen on a later chunk: relayed as it came.
    "fingerprint-not-a-string": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None}),
        _c({"index": 0, "delta": {"content": "b"}, "finish_reason": None}, system_fingerprint=5),
        _end()],
    # Delta fields the library ignores for their type, relayed as they came.
    "tool-calls-an-object": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a", "tool_calls": {"x": 1}},
            "finish_reason": None}), _end()],
    "tool-calls-a-string": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a", "tool_calls": "f"},
            "finish_reason": None}), _end()],
    "refusal-a-number": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a", "refusal": 5}, "finish_reason": None}),
        _c({"index": 0, "delta": {"content": "b", "refusal": 5}, "finish_reason": None}), _end()],
    "role-a-number": [
        _c({"index": 0, "delta": {"role": 1, "content": "a"}, "finish_reason": None}), _end()],
    "function-call-a-string": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a", "function_call": "auto"},
            "finish_reason": None}), _end()],
    "reasoning-a-list": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a", "reasoning_content": ["x"]},
            "finish_reason": None}), _end()],
    "logprobs-a-list": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a"}, "logprobs": [],
            "finish_reason": None}), _end()],
    "logprobs-content-a-string": [
        _c({"index": 0, "delta": {"role": "assistant", "content": "a"}, "logprobs": {"content": "x"},
            "finish_reason": None}), _end()],
    "tool-call-id-a-number": [
        _c({"index": 0, "delta": {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": 7, "type": "function", "function": {"name": "f", "arguments": "{"}}]},
            "finish_reason": None}),
        _c({"index": 0, "delta": {"tool_calls": [{"index": 0, "id": 7, "function": {"arguments": "}"}}]},
            "finish_reason": None}),
        _end(reason="tool_calls")],
}


def _calls(message: Any) -> list[tuple[Any, str, str]]:
    out = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        out.append((call.get("id") if isinstance(call.get("id"), str) else None,
                    function.get("name") or "", function.get("arguments") or ""))
    return out


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sdks_stream_helper_builds_the_json_answer(case: str, cache: bool) -> None:
    events, answer = _streamed_through_the_library(CASES[case], cache=cache)
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    built = state.get_final_completion()
    body = _answer_body(answer)
    want = sorted(body["choices"], key=lambda c: c["index"])
    assert [c.index for c in built.choices] == [c["index"] for c in want]
    for got, choice in zip(built.choices, want, strict=True):
        message = choice["message"]
        assert got.message.role == "assistant"
        assert (got.message.content or "") == (message.get("content") or "")
        assert got.message.refusal == message.get("refusal")
        assert got.finish_reason == choice["finish_reason"]
        assert [(c.id, c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == (
            _calls(message))
    fingerprint = body.get("system_fingerprint")
    assert built.system_fingerprint == (fingerprint if isinstance(fingerprint, str) else None)
    assert all(type(c["index"]) is int for e in events for c in e["choices"])


def test_a_null_fingerprint_is_relayed_as_it_came() -> None:
    """Review of the fix above: a stream whose every chunk says ``"system_fingerprint":
    null`` went down the header's rewrite on every chunk (two copies of it, ~25 % of
    the relay's time a chunk), for nothing a client can see."""
    from polygate._types import StreamChunk
    from polygate.serve._sse import StreamShape, _event

    shape = StreamShape()
    first = _c({"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None},
               system_fingerprint=None)
    shape.chunk(StreamChunk(text="a", delta=first["choices"][0]["delta"], raw=first))
    later = _c({"index": 0, "delta": {"content": "b"}, "finish_reason": None}, system_fingerprint=None)
    assert shape.chunk(StreamChunk(text="b", delta=later["choices"][0]["delta"], raw=later)) == _event(later)


@pytest.mark.parametrize("case", ["no-index", "tool-calls-an-object", "refusal-a-number",
                                  "fingerprint-on-the-finish-chunk", "tool-call-id-a-number"])
async def test_through_a_real_gateway_the_sdks_stream_helper_builds_the_json_answer(case: str) -> None:
    """The same, end to end: a loopback upstream, ``polygate serve``, and the OpenAI
    SDK's own client (``chat.completions.stream`` against ``create``)."""
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in CASES[case]) + b"data: [DONE]\n\n"

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"content-length: %d\r\n\r\n" % len(data) + data)

    asked = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    async with raw_server(reply) as up, open_server(
            settings_for(up.url, retry=polygate.Retry(max_attempts=1)), port=0) as server:
        def run() -> tuple[Any, Any]:
            with openai.OpenAI(base_url=server.base_url, api_key=GATEWAY_KEY, max_retries=0) as client:
                whole = client.chat.completions.create(**asked)  # type: ignore[call-overload]
                with client.chat.completions.stream(**asked) as stream:  # type: ignore[arg-type]
                    for _ in stream:
                        pass
                    return whole, stream.get_final_completion()

        whole, built = await trio.to_thread.run_sync(run)

    def seen(completion: Any) -> list[tuple[Any, ...]]:
        return [(c.index, c.message.role, c.message.content or "", c.message.refusal, c.finish_reason,
                 [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []])
                for c in completion.choices]

    assert seen(built) == seen(whole)
    assert built.system_fingerprint == whole.system_fingerprint


@pytest.mark.parametrize("streaming", [True, False])
def test_the_json_answers_object_and_header_are_typed(streaming: bool) -> None:
    """Outside review (the JSON answer read by strict clients): the body's ``object``
    was the upstream's (missing, 5, "text_completion"), and a ``system_fingerprint``
    or ``service_tier`` that is no string went through where the stream leaves it out."""
    if streaming:
        upstream: Any = [_c({"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None},
                            system_fingerprint=5, service_tier=[]), _end()]
    else:
        upstream = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
                    "system_fingerprint": 5, "service_tier": [],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "a"}}]}
    events, answer = _streamed_through_the_library(upstream)
    body = _answer_body(answer)
    assert body["object"] == "chat.completion"
    assert "system_fingerprint" not in body and "service_tier" not in body
    assert all("system_fingerprint" not in e and "service_tier" not in e for e in events)
