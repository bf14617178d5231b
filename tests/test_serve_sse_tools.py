"""The gateway's relay of streamed tool calls against the library's assembler: what
the OpenAI SDK's stream helper builds from the relayed chunks is what the library's
JSON answer holds, for any mix of indexed and indexless deltas, repeated ids and
names, and name fragments."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming._deltas import accumulate_delta

from polygate._types import StreamChunk
from polygate.serve._sse import StreamShape
from polygate.transport import ChatAssembler

BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}

_names = st.sampled_from(["f", "lo", "lookup", "look", "up", "get_weather", "g"])
_ids = st.sampled_from([None, "c1", "c2", "c3"])
_args = st.sampled_from(["", "{", '"q"', ":1", "}", "{}"])


@st.composite
def _call(draw: Any) -> dict[str, Any]:
    call: dict[str, Any] = {}
    index = draw(st.one_of(st.none(), st.integers(0, 2)))
    if index is not None:
        call["index"] = index
    cid = draw(_ids)
    if cid is not None:
        call["id"] = cid
        call["type"] = "function"
    function: dict[str, Any] = {"arguments": draw(_args)}
    name = draw(st.one_of(st.none(), _names))
    if name is not None:
        function["name"] = name
    call["function"] = function
    return call


def _assembled_calls(chunks: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    message = assembler.build()["choices"][0]["message"]
    return [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []]


def _sdk_calls(events: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
    acc: dict[Any, Any] = {}
    for event in events:
        for choice in event.get("choices", []):
            if choice["index"] == 0 and choice.get("delta"):
                acc = accumulate_delta(acc, choice["delta"])
    return [(c.get("id"), c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
            for c in acc.get("tool_calls") or []]


def _relay(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    shape = StreamShape()
    out = b"".join(shape.chunk(StreamChunk(text="", delta={}, raw=chunk)) for chunk in chunks)
    return [json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_call(), min_size=1, max_size=2), min_size=1, max_size=6))
def test_the_sdk_assembles_the_relayed_tool_calls_as_the_library_does(deltas: Any) -> None:
    # Indexes given in order of first use, as servers send them (a first delta at
    # index 2 with no 0 and 1 is a malformed stream the SDK cannot build either).
    seen: set[int] = set()
    for calls in deltas:
        for call in calls:
            if "index" in call:
                call["index"] = min(call["index"], len(seen))
                seen.add(call["index"])
    chunks = [{**BASE, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]}
              for calls in deltas]
    library = _assembled_calls(chunks)
    relayed = _relay(chunks)
    sdk = _sdk_calls(relayed)
    # The library's answer says "" for a call that never got a name; the SDK None.
    assert [name or "" for _, name, _ in sdk] == [name for _, name, _ in library]
    assert [args for _, _, args in sdk] == [args for _, _, args in library]
    # A call given two different ids keeps the last in the library's answer, and the
    # SDK joins what it is sent: only the other calls' ids are compared.
    ids: dict[int, set[str]] = {}
    for event in relayed:
        for choice in event["choices"]:
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                if "id" in call:
                    ids.setdefault(call["index"], set()).add(call["id"])
    for index, ((sdk_id, _, _), (lib_id, _, _)) in enumerate(zip(sdk, library, strict=True)):
        if len(ids.get(index, ())) <= 1:
            assert sdk_id == lib_id
