"""Behaviour of a streamed answer's assembly no other test pinned, found by mutating it: each test fails on the mutation its
docstring names and passes on the code as it is."""
from __future__ import annotations

import json

import httpx

from polygate.transport import ChatAssembler
from polygate.transport._exchange import _read_chat_json
from polygate.transport._wire import Endpoint, Limits


def chunk(*choices):
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": list(choices)}


def test_the_first_reasoning_name_is_the_one_kept() -> None:
    """Mutation: ``reasoning_name`` set on every piece (the last name wins)."""
    a = ChatAssembler()
    a.add(chunk({"index": 0, "delta": {"reasoning": "a"}}))
    a.add(chunk({"index": 0, "delta": {"reasoning_content": "b"}}))
    a.add(chunk({"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}))
    message = a.build()["choices"][0]["message"]
    assert message["reasoning_content"] == "ab" and message.get("reasoning") == "ab"
    b = ChatAssembler()
    b.add(chunk({"index": 0, "delta": {"reasoning_content": "a"}}))
    b.add(chunk({"index": 0, "delta": {"reasoning": "b"}}))
    assert "reasoning" not in b.build()["choices"][0]["message"]


def test_a_tool_calls_first_id_stays() -> None:
    """Mutation: ``slot["id"] is None`` dropped: a server that sends the id again,
    changed, on a later delta of the same call replaced the id clients saw first."""
    a = ChatAssembler()
    a.add(chunk({"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\""}}]}}))
    a.add(chunk({"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_b", "function": {"arguments": ": 1}"}}]}}))
    a.add(chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}))
    calls = a.build()["choices"][0]["message"]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_a"]
    assert calls[0]["function"]["arguments"] == '{"x": 1}'


def test_an_unfinished_extra_choice_keeps_the_stream_open() -> None:
    """Mutation: all_finished without ``finishes == len(choices)``: an upstream that
    sends more choices than ``n`` had the rest of its answer cut by the end grace."""
    a = ChatAssembler()
    a.add(chunk({"index": 0, "delta": {"content": "x"}}, {"index": 1, "delta": {"content": "y"}}))
    a.add(chunk({"index": 0, "delta": {}, "finish_reason": "stop"}))
    assert not a.all_finished(1)
    a.add(chunk({"index": 1, "delta": {}, "finish_reason": "stop"}))
    assert a.all_finished(1) and a.all_finished(2)


def test_a_finish_reason_sent_twice_counts_once() -> None:
    """Mutation: ``unfinished and`` dropped: a finish_reason repeated on a later
    chunk (the usage chunk, a second empty delta) counted as another choice's end,
    so an answer of n=2 was taken as finished while its second choice still ran."""
    a = ChatAssembler()
    a.add(chunk({"index": 0, "delta": {"content": "x"}}, {"index": 1, "delta": {"content": "y"}}))
    a.add(chunk({"index": 0, "delta": {}, "finish_reason": "stop"}))
    a.add(chunk({"index": 0, "delta": {}, "finish_reason": "stop"}))
    assert a.finishes == 1
    assert not a.all_finished(2)


async def test_a_json_bodys_reasoning_is_also_its_reasoning_content() -> None:
    """Mutation: the JSON body's ``reasoning`` no longer mirrored as
    ``reasoning_content`` (SPEC 1: as the assembled stream's message has it)."""
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": "x", "reasoning": "think"}}]}
    endpoint = Endpoint(name="s", url="http://x/v1", streaming=False)
    payload = await _read_chat_json(httpx.Response(200, content=json.dumps(body).encode()),
                                    endpoint, Limits(), "application/json")
    assert payload["choices"][0]["message"]["reasoning_content"] == "think"
