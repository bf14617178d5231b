"""The gateway's relay of streamed tool calls against the library's assembler: what
the OpenAI SDK's stream helper builds from the relayed chunks is what the library's
JSON answer holds, for any mix of indexed and indexless deltas, repeated ids and
names, and name fragments."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming._deltas import accumulate_delta

import polygate
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


def _relay_chunks(chunks: list[StreamChunk]) -> list[dict[str, Any]]:
    shape = StreamShape()
    out = b"".join(shape.chunk(chunk) for chunk in chunks)
    return [json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]


def test_an_indexless_call_that_names_a_new_call_is_a_new_call_next_to_explicit_indexes() -> None:
    """Review: docs/reference.md: a call delta without an index that names a call (an id not
    the last call's, a name) 'starts a new call'.  indexless_call gives it
    len(calls) as its index, which an explicit index already holds when the
    explicit indexes are not 0..n-1 (here an upstream that counts from 1): the two
    calls are merged into one, id overwritten, names joined ("f1f2")."""
    chunks = [
        {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "a", "type": "function", "function": {"name": "f1", "arguments": "{}"}}]}}]},
        {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"id": "b", "type": "function", "function": {"name": "f2", "arguments": "{}"}}]}}]},
    ]
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    calls = assembler.build()["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"]) for c in calls] == [("a", "f1"), ("b", "f2")], calls


def test_the_relay_keeps_tool_call_names_compact_like_the_assembler() -> None:
    """Review: a hostile upstream sends a tool name in many small fragments.  The library's
    assembler holds them joined as it goes (TextParts: ~1 byte a character, the
    documented reason streams stay affordable); StreamShape's _Name keeps every
    fragment as its own str in a plain list for the whole stream (~45 bytes a
    character): a 32 MiB body holds ~60 MiB in the gateway, per stream."""
    fragments = 40_000
    first = {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "ab", "arguments": ""}}]}}]}
    body = json.dumps({**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"name": "字x"}}] * 50}}]})

    def held(make: Any, feed: Any) -> int:
        tracemalloc.start()
        obj = make()
        feed(obj, first)
        for _ in range(fragments // 50):
            feed(obj, json.loads(body))
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del obj
        return size

    library = held(ChatAssembler, lambda a, c: a.add(c))
    relay = held(StreamShape, lambda s, c: s.chunk(StreamChunk(text="", delta={}, raw=c)))
    characters = 2 * fragments
    assert relay < 4 * characters + library, (relay, library, characters)


def _non_streamed_source_stream(body: dict[str, Any]) -> tuple[list[StreamChunk], Any]:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key="sk-x", streaming=False)])})

    async def main() -> tuple[list[StreamChunk], Any]:
        async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
            async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
                got = [c async for c in stream]
            return got, stream.response

    return trio.run(main)


def test_a_whole_answer_whose_calls_carry_one_index_reaches_the_client_as_the_json_answer() -> None:
    """Review: a source that cannot stream answers with two tool calls that both say
    "index": 0 (message_delta keeps an index that is there): the JSON answer has two
    calls; the relayed whole-answer chunk makes the SDK merge them into one."""
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [
                    {"index": 0, "id": "a", "type": "function", "function": {"name": "f1", "arguments": "{}"}},
                    {"index": 0, "id": "b", "type": "function", "function": {"name": "f2", "arguments": "{}"}},
                ]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    chunks, response = _non_streamed_source_stream(body)
    library = [(c["id"], c["function"]["name"], c["function"]["arguments"])
               for c in response.message["tool_calls"]]
    assert _sdk_calls(_relay_chunks(chunks)) == library


def test_two_entries_of_one_choice_in_a_chunk_keep_their_own_tool_calls() -> None:
    """Review: a chunk listing choice 0 twice (the library folds both entries in, in order).
    retooled is keyed by choice index, so _reshaped gives the second entry's
    shaped calls to both entries: the SDK gets call b twice and never call a."""
    chunks = [StreamChunk(text="", delta={}, raw={**BASE, "choices": [
        {"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "a", "type": "function", "function": {"name": "f1", "arguments": "{}"}}]}},
        {"index": 0, "delta": {"tool_calls": [
            {"id": "b", "type": "function", "function": {"name": "f2", "arguments": "{}"}}]}},
    ]})]
    assembler = ChatAssembler()
    assembler.add(chunks[0].raw)
    library = [(c["id"], c["function"]["name"], c["function"]["arguments"])
               for c in assembler.build()["choices"][0]["message"]["tool_calls"]]
    assert _sdk_calls(_relay_chunks(chunks)) == library


def test_a_null_delta_entry_of_a_choice_whose_role_is_dropped_does_not_break_the_relay() -> None:
    """Review: OpenRouter repeats the role on every delta; a chunk that also listed
    choice 0 a second time with a null delta made the relay raise AttributeError
    mid-stream (the client's connection closed with no error event, no [DONE])."""
    chunks = [
        {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]},
        {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "b"}},
                             {"index": 0, "delta": None}]},
    ]
    texts = [c["delta"].get("content") for event in _relay(chunks) for c in event["choices"]]
    assert [t for t in texts if t] == ["a", "b"]


def test_a_null_delta_beside_a_finish_reason_reaches_a_client_as_an_empty_delta() -> None:
    """Review: an entry ``{"delta": null, "finish_reason": "stop"}`` (relayed: it
    finishes the choice) went out with its null delta; the OpenAI SDK's stream helper
    reads every entry's delta as an object (AttributeError)."""
    chunks = [
        {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]},
        {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "b"}},
                             {"index": 0, "delta": None, "finish_reason": "stop"}]},
    ]
    events = _relay(chunks)
    entries = [c for event in events for c in event["choices"]]
    assert all(type(c.get("delta")) is dict for c in entries), events
    assert [c["finish_reason"] for c in entries if c.get("finish_reason")] == ["stop"]


def test_tool_calls_counted_from_1_or_with_gaps_reach_a_client_at_their_places() -> None:
    """Review: the OpenAI SDK's stream helper takes a tool call's index as its place
    in a list: calls counted from 1 (a bridge passing on Anthropic's content-block
    index) or with gaps raised an IndexError there.  The client gets each call's
    place, in the order the calls began; an id sent again is not."""
    def chunk(calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]}

    chunks = [
        chunk([{"index": 1, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}]),
        chunk([{"index": 1, "id": "a", "function": {"arguments": "{}"}}]),
        chunk([{"index": 3, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]),
    ]
    assembler = ChatAssembler()
    for c in chunks:
        assembler.add(c)
    library = [(c["id"], c["function"]["name"], c["function"]["arguments"])
               for c in assembler.build()["choices"][0]["message"]["tool_calls"]]
    events = _relay(chunks)
    indexes = [call["index"] for e in events for c in e["choices"]
               for call in (c.get("delta") or {}).get("tool_calls") or []]
    assert indexes == [0, 0, 1]
    assert library == [("a", "f", "{}"), ("b", "g", "{}")]
    assert _sdk_calls(events) == library


def test_parallel_calls_each_whole_at_index_0_with_their_own_ids_stay_apart() -> None:
    """Review: Ollama's OpenAI endpoint sends each of parallel calls whole, every one
    at index 0, each with its own id: the library (and the relay) merged them into one
    call, its arguments two JSON objects run together, the second id lost.  A delta at
    an index whose call has another id begins a new call, which the index then means."""
    def chunk(calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]}

    chunks = [
        chunk([{"index": 0, "id": "call_a", "type": "function",
                "function": {"name": "file_write", "arguments": '{"path":'}}]),
        chunk([{"index": 0, "function": {"arguments": ' "a.py"}'}}]),
        chunk([{"index": 0, "id": "call_b", "type": "function",
                "function": {"name": "file_write", "arguments": '{"path": "b.py"}'}}]),
    ]
    assembler = ChatAssembler()
    for c in chunks:
        assembler.add(c)
    library = [(c["id"], c["function"]["name"], c["function"]["arguments"])
               for c in assembler.build()["choices"][0]["message"]["tool_calls"]]
    assert library == [("call_a", "file_write", '{"path": "a.py"}'),
                       ("call_b", "file_write", '{"path": "b.py"}')]
    assert _sdk_calls(_relay(chunks)) == library


def test_calls_first_seen_out_of_index_order_are_listed_as_they_began() -> None:
    """Review: the relay gives calls their places in the order they began, and the
    library listed them by index: a client of the gateway's stream and the JSON
    answer (and a later cache hit, replayed by position) disagreed on the order."""
    def chunk(index: int, cid: str) -> dict[str, Any]:
        return {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": index, "id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            "finish_reason": None}]}

    chunks = [chunk(1, "b"), chunk(0, "a")]
    assembler = ChatAssembler()
    for c in chunks:
        assembler.add(c)
    library = [(c["id"], c["function"]["name"], c["function"]["arguments"])
               for c in assembler.build()["choices"][0]["message"]["tool_calls"]]
    assert [cid for cid, _, _ in library] == ["b", "a"]
    assert _sdk_calls(_relay(chunks)) == library


def test_a_call_whose_argument_deltas_carry_a_fresh_id_stays_one_call() -> None:
    """Review: Poolside's API sends a call's first delta with its id and name, then
    each argument fragment with another id (mlx-openai-server a fresh one on every
    delta): the rule for Ollama's parallel calls split it into a call per fragment,
    and a long call was refused as over 128 calls.  A changed id begins a call only
    with a name, after arguments that look complete."""
    def chunk(call: dict[str, Any]) -> dict[str, Any]:
        return {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}

    fragments = ['{"path":', ' "a', '.py"', "}"] + [" "] * 200
    chunks = [chunk({"index": 0, "id": "call_A", "type": "function",
                     "function": {"name": "read_file", "arguments": ""}})]
    chunks += [chunk({"index": 0, "id": f"call_{n}", "function": {"arguments": piece}})
               for n, piece in enumerate(fragments)]
    assembler = ChatAssembler()
    for c in chunks:
        assembler.add(c)
    library = [(c["id"], c["function"]["name"], c["function"]["arguments"])
               for c in assembler.build()["choices"][0]["message"]["tool_calls"]]
    assert library == [("call_A", "read_file", "".join(fragments))]
    assert _sdk_calls(_relay(chunks)) == library


def test_ollama_parallel_calls_after_a_call_without_parameters_stay_apart() -> None:
    """Review: a call without parameters whose arguments are ``null`` (some Ollama
    versions) never looked complete, so the next parallel call at index 0 was merged
    into it (``null{"c":"x"}``)."""
    def chunk(cid: str, name: str, arguments: str) -> dict[str, Any]:
        return {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            "finish_reason": None}]}

    chunks = [chunk("call_1", "now", "null"), chunk("call_2", "weather", '{"c":"x"}')]
    assembler = ChatAssembler()
    for c in chunks:
        assembler.add(c)
    library = [(c["id"], c["function"]["name"], c["function"]["arguments"])
               for c in assembler.build()["choices"][0]["message"]["tool_calls"]]
    assert library == [("call_1", "now", "null"), ("call_2", "weather", '{"c":"x"}')]
    assert _sdk_calls(_relay(chunks)) == library


def _sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _streamed_through_the_library(
    upstream: list[dict[str, Any]] | dict[str, Any], *, cache: bool = False
) -> tuple[list[dict[str, Any]], Any]:
    """What a client of the gateway's stream gets (the relay of what ``stream_chat``
    yields, and its ending), and the library's answer (the gateway's JSON body), for
    an upstream that streams ``upstream`` (chunks) or answers it whole (a body).  With
    ``cache``, the stream is a replayed hit of the answer."""
    whole = isinstance(upstream, dict)

    async def handler(request: httpx.Request) -> httpx.Response:
        if whole:
            return httpx.Response(200, json=upstream)
        assert isinstance(upstream, list)
        return httpx.Response(200, content=_sse(upstream), headers={"content-type": "text/event-stream"})

    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key="sk-x", streaming=not whole)],
        cache_ttl_s=60 if cache else None)}, cache="memory" if cache else "off")

    async def main() -> tuple[list[dict[str, Any]], Any]:
        async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
            answer = await s.chat([{"role": "user", "content": "hi"}])
            shape = StreamShape()
            out = b""
            async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
                async for chunk in stream:
                    out += shape.chunk(chunk)
            assert stream.response is not None and stream.response.call_stats.cached is cache
            out += shape.ending(stream.response, include_usage=True)
            return ([json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")],
                    answer)

    return trio.run(main)


def _contents(events: list[dict[str, Any]]) -> dict[int, Any]:
    """Each choice's content as a client assembling the stream has it."""
    acc: dict[int, dict[Any, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            acc[choice["index"]] = accumulate_delta(acc.get(choice["index"], {}), choice["delta"])
    return {index: message.get("content") for index, message in acc.items()}


_CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


_REASONED = {"role": "assistant", "content": None, "reasoning_content": "hm"}
_DETAILS = {"reasoning_details": [{"type": "reasoning.encrypted", "data": "x"}]}


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize(("role_content", "deltas"), [
    ("", [{"tool_calls": [_CALL]}]),  # vLLM's tool-call stream
    ("", [{"refusal": "no"}]),
    ("", [{"reasoning_content": "hm"}]),
    (None, [{"reasoning_content": "hm"}]),  # a reasoning model cut before its answer
    ("", [{"reasoning_content": "hm"}, {"tool_calls": [_CALL]}]),
    (None, [{"tool_calls": [_CALL]}]),  # OpenAI's: null stays null
    ("", [{"content": "a"}, {"tool_calls": [_CALL]}]),
    (None, [{"function_call": {"name": "f", "arguments": "{}"}}]),  # the legacy call: null
    ("", [{"role": "assistant", "tool_calls": [_CALL]}]),  # the role again (OpenRouter's)
    (None, [_REASONED]),  # the role with the reasoning, cut before the answer
    (None, [_DETAILS, {"tool_calls": [_CALL]}]),  # data before the first token, then calls
    (None, [_DETAILS]),
])
def test_a_client_assembling_the_stream_gets_the_json_answers_content(
    role_content: str | None, deltas: list[dict[str, Any]], cache: bool
) -> None:
    """Review: a stream whose role chunk said ``"content": ""`` and then only tool
    calls (vLLM's), a refusal or reasoning: the gateway's JSON answer has "" (as the
    upstream said, and as the OpenAI SDK assembles it), but the relay's role chunk said
    null and nothing after it made it a string, so a client assembling the stream got
    None.  (Only the role-only chunk said "", and the library forwards none.)  And the
    other way: a role chunk said "" before data that was not text, then tool calls,
    where the answer has null.  So for a cache hit replayed as a stream, whose first
    chunk carries the role."""
    finish = "tool_calls" if any("tool_calls" in d for d in deltas) else "stop"
    chunks = [{**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": role_content},
                                    "finish_reason": None}]}]
    chunks += [{**BASE, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    events, answer = _streamed_through_the_library(chunks, cache=cache)
    assert _contents(events) == {0: answer.message["content"]}, events
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == [finish]


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "", "tool_calls": [_CALL]},
    {"role": "assistant", "content": None, "tool_calls": [_CALL]},
    {"role": "assistant", "content": "", "reasoning_content": "hm"},
    {"role": "assistant", "content": None},
    {"role": "assistant", "content": ""},
])
def test_a_source_that_cannot_stream_reaches_a_streaming_client_with_the_json_answers_content(
    message: dict[str, Any],
) -> None:
    """Review: a whole answer whose content is null and that carries nothing else (no
    chunk is forwarded for it) got a role chunk that said ""."""
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": i, "message": message, "finish_reason": "stop"} for i in (0, 1)],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    events, answer = _streamed_through_the_library(body)
    want = {c["index"]: c["message"]["content"] for c in answer.choices}
    assert _contents(events) == want, events


@pytest.mark.parametrize("first", [
    {"role": "assistant", "content": None},
    {"role": "assistant", "content": ""},  # (a content filter's blank)
])
def test_a_whole_answer_whose_first_choice_is_empty_still_shows_the_other_choices(
    first: dict[str, Any],
) -> None:
    """Review: a source that cannot stream answered n = 2 with nothing in choice 0 and
    text in choice 1: the stream showed no chunk (only choice 0 was looked at), so a
    client of the gateway's stream never got choice 1's text."""
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": first, "finish_reason": "content_filter"},
                        {"index": 1, "message": {"role": "assistant", "content": "t"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    events, answer = _streamed_through_the_library(body)
    assert _contents(events) == {0: first["content"], 1: "t"}, events
    assert {c["index"]: c["message"]["content"] for c in answer.choices} == {0: first["content"], 1: "t"}


_LOGPROBS = {"content": [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}], "refusal": None}


@pytest.mark.parametrize("whole", [False, True])
def test_choices_reach_the_sdk_helper_in_index_order_when_a_later_one_has_logprobs(whole: bool) -> None:
    """Review: choice 0 named its role in its own delta (no role chunk made), choice 1
    had logprobs (a role chunk of its own, sent before the chunk): the client met
    choice 1 before choice 0, and the OpenAI SDK's stream helper raised IndexError."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    upstream: list[dict[str, Any]] | dict[str, Any]
    if whole:  # a source that cannot stream: its answer, one chunk
        upstream = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": "t"}, "finish_reason": "stop",
             "logprobs": _LOGPROBS}]}
    else:
        upstream = [
            {**BASE, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None},
                {"index": 1, "delta": {"role": "assistant", "content": "t"}, "finish_reason": None,
                 "logprobs": _LOGPROBS}]},
            {**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"},
                                 {"index": 1, "delta": {}, "finish_reason": "stop"}]},
        ]
    events, answer = _streamed_through_the_library(upstream)
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    snapshot = state.current_completion_snapshot
    assert [c.message.content for c in snapshot.choices] == ["a", "t"]
    assert [c["message"]["content"] for c in answer.choices] == ["a", "t"]
    assert snapshot.choices[1].logprobs is not None and len(snapshot.choices[1].logprobs.content or []) == 1


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_custom_tools_streamed_call_keeps_its_name_and_input() -> None:
    """Review: OpenAI's custom tools (``{"type": "custom"}``, GPT-5) stream their calls
    as ``{"type": "custom", "custom": {"name", "input"}}``; the assembler gave every
    call an empty ``function`` and kept only that, so the answer (and a cached one,
    and the gateway's JSON answer) lost the tool's name and input."""
    chunks = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "custom",
                                "custom": {"name": "shell", "input": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "custom": {"input": "echo"}}]}),
        _chunk({"tool_calls": [{"index": 0, "custom": {"name": "shell", "input": " hé"}}]}),
        _chunk({}, "tool_calls"),
    ]
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    [call] = assembler.build()["choices"][0]["message"]["tool_calls"]
    assert call == {"id": "call_1", "type": "custom", "custom": {"name": "shell", "input": "echo hé"}}
    # The relay: the SDK's accumulator builds the same call (the name sent again, once).
    acc: dict[str, Any] = {}
    for event in _relay(chunks):
        acc = accumulate_delta(acc, event["choices"][0]["delta"])
    [relayed] = acc["tool_calls"]
    assert {k: relayed[k] for k in ("id", "type", "custom")} == call


def test_a_function_call_keeps_its_empty_function_and_ignores_an_object_for_a_string() -> None:
    """The payload's text fields are there from the call's first delta, as in a
    non-streamed answer; ``arguments: {}`` where a string belongs is ignored, as it
    always was."""
    chunks = [
        _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function"}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": {}}}]}),
        _chunk({}, "tool_calls"),
    ]
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    [call] = assembler.build()["choices"][0]["message"]["tool_calls"]
    assert call == {"id": "c1", "type": "function", "function": {"name": "", "arguments": ""}}


@pytest.mark.parametrize("later_type", ["absent", None, ""])
@pytest.mark.parametrize("first_type", ["absent", None])
def test_a_call_streamed_without_a_type_reaches_the_sdks_stream_helper_typed(
    first_type: Any, later_type: Any,
) -> None:
    """Review: Azure AI Foundry and Mistral stream tool calls without a ``type``, and a
    server that writes every field sends ``"type": null`` on later deltas.  The
    library's answer says ``"function"``; the relay passed the deltas on as they
    came, so the SDK's stream helper built a call of type None (agent code checking
    for "function" skipped it), or, given a later null, failed its own assertion."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    def call(**fields: Any) -> dict[str, Any]:
        kind = first_type if "id" in fields else later_type
        return {"index": 0, **({} if kind == "absent" else {"type": kind}), **fields}

    chunks = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"tool_calls": [call(id="c1", function={"name": "f", "arguments": ""})]}),
        _chunk({"tool_calls": [call(function={"arguments": '{"a": '})]}),
        _chunk({"tool_calls": [call(function={"arguments": "1}"})]}),
        _chunk({}, "tool_calls"),
    ]
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    [whole] = assembler.build()["choices"][0]["message"]["tool_calls"]
    assert whole["type"] == "function"
    state = ChatCompletionStreamState()
    for event in _relay(chunks):
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    [built] = state.get_final_completion().choices[0].message.tool_calls or []
    assert (built.type, built.id, built.function.name, built.function.arguments) == (
        "function", "c1", "f", '{"a": 1}')


def test_a_resumed_stream_keeps_one_fingerprint_and_tier() -> None:
    """Review: a stream resumed on another source went on under the first segment's
    id, time and model, but the continuation's chunks carried their own
    ``system_fingerprint`` and ``service_tier`` (and the gateway's finish chunk the
    first's again): one stream, three headers; the SDK keeps the last chunk's."""
    def chunk(cid: str, fp: str, tier: str, text: str) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m",
                "system_fingerprint": fp, "service_tier": tier,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}

    events = _relay([chunk("one", "fp_one", "default", "a"), chunk("two", "fp_two", "flex", "b"),
                     chunk("one", "fp_two", "default", "c")])
    assert {(e["id"], e["system_fingerprint"], e["service_tier"]) for e in events} == {
        ("one", "fp_one", "default")}


def test_a_fingerprint_first_sent_after_the_stream_began_is_the_streams_from_there() -> None:
    """Review: resumed from a source that sends no fingerprint (vLLM) onto one that
    does, the later chunks carried it and the gateway's finish chunk did not: the
    SDK's stream helper (which keeps the last chunk's) ended with None where the JSON
    answer says "fp_b".  From the first chunk that carries it, every chunk does."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    def chunk(text: str, fp: str | None, finish: str | None = None) -> dict[str, Any]:
        return {**BASE, **({"system_fingerprint": fp} if fp else {}),
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}

    chunks = [chunk("a", None), chunk("b", "fp_b"), chunk("c", None), chunk("d", "fp_b", "stop")]
    assembler = ChatAssembler()
    for c in chunks:
        assembler.add(c)
    answer = assembler.build()
    shape = StreamShape()
    out = b"".join(shape.chunk(StreamChunk(text="", delta={}, raw=c)) for c in chunks)
    response = polygate.ChatResponse(
        text="abcd", message=answer["choices"][0]["message"], choices=answer["choices"],
        usage=None, source="a", model="m", finish_reason="stop",
        call_stats=None, raw=answer)  # type: ignore[arg-type]
    out += shape.ending(response, include_usage=True)
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]
    fingerprints = [e.get("system_fingerprint") for e in events]
    first = fingerprints.index("fp_b")
    assert set(fingerprints[first:]) == {"fp_b"} and set(fingerprints[:first]) == {None}
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    assert state.get_final_completion().system_fingerprint == answer["system_fingerprint"] == "fp_b"


def test_a_vendor_object_on_a_calls_deltas_is_kept_once_and_never_typed_as_the_call() -> None:
    """Review of the custom tools' change: every object on a call's delta was joined
    as a payload, so a signature Gemini sends again whole on each delta
    (``extra_content``) became "SIGSIG", and a typeless call that lists it before its
    ``function`` (Gemini writes keys in alphabetical order) was typed
    "extra_content".  A vendor's object is kept as a message's extras are (the last
    string sent), and only ``function`` or ``custom`` types a typeless call."""
    sig = {"thought_signature": "SIG"}
    chunks = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"tool_calls": [{"index": 0, "extra_content": sig, "id": "c1",
                                "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}, "extra_content": sig}]}),
        # A delta with only a vendor object at a new index opens no call.
        _chunk({"tool_calls": [{"index": 1, "extra_content": sig}]}),
        _chunk({}, "tool_calls"),
    ]
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    [call] = assembler.build()["choices"][0]["message"]["tool_calls"]
    assert call == {"id": "c1", "type": "function", "extra_content": sig,
                    "function": {"name": "f", "arguments": "{}"}}
    acc: dict[str, Any] = {}
    for event in _relay(chunks):
        acc = accumulate_delta(acc, event["choices"][0]["delta"])
    [relayed] = acc["tool_calls"]
    assert (relayed["type"], relayed["id"], relayed["function"]) == ("function", "c1", call["function"])


@pytest.mark.parametrize(("first", "later"), [
    pytest.param({"function": None}, {"function": {"arguments": "{}"}}, id="first-function-null"),
    pytest.param({}, {"function": {"arguments": "{}"}}, id="first-no-function"),
    pytest.param({"function": {"name": "f", "arguments": ""}}, {"function": None}, id="later-function-null"),
    pytest.param({"function": {"name": "f", "arguments": ""}}, {}, id="later-no-function"),
    pytest.param({"function": {"name": None, "arguments": 5}}, {"function": {"arguments": "{}"}},
                 id="name-null-arguments-int"),
    pytest.param({"function": {"name": "f", "arguments": None}}, {"function": {"arguments": ["x"]}},
                 id="arguments-null-then-list"),
    pytest.param({"function": {"name": 7, "arguments": "{"}}, {"function": {"name": {}, "arguments": "}"}},
                 id="names-not-strings"),
    pytest.param({"index": 0.0, "function": {"name": "f", "arguments": ""}}, {"index": 0.0},
                 id="float-index"),
    pytest.param({"index": True, "function": {"name": "f", "arguments": ""}}, {"index": 1.0},
                 id="bool-then-float-index"),
])
def test_odd_payloads_reach_the_sdks_stream_helper_as_the_json_answer_has_them(
    first: dict[str, Any], later: dict[str, Any],
) -> None:
    """Outside review (JSON's corners): a tool-call delta whose ``function`` is null or
    missing, whose ``name`` or ``arguments`` is no string, or whose ``index`` is
    ``0.0``, was relayed as it came.  The OpenAI SDK's stream helper asserts that
    every delta of a function call has a ``function`` (an AssertionError in the
    client), keeps ``arguments`` of 5 or None where the JSON answer has ``""``
    (``json.loads`` then fails in agent code), and typed clients refuse an index of
    ``0.0``.  What the helper builds is now the JSON answer's call, and every relayed
    index is an integer."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    chunks = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", **first}]}),
        _chunk({"tool_calls": [{"index": 0, **later}]}),
        _chunk({}, "tool_calls"),
    ]
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    [whole] = assembler.build()["choices"][0]["message"]["tool_calls"]
    relayed = _relay(chunks)
    indexes = [call["index"] for event in relayed for choice in event["choices"]
               for call in (choice.get("delta") or {}).get("tool_calls") or []]
    assert indexes and all(type(i) is int for i in indexes)
    state = ChatCompletionStreamState()
    for event in relayed:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    [built] = state.get_final_completion().choices[0].message.tool_calls or []
    assert (built.type, built.id, built.function.name, built.function.arguments) == (
        whole["type"], whole["id"], whole["function"]["name"], whole["function"]["arguments"])


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("function", [None, "absent", {"name": None, "arguments": 5}])
def test_a_call_with_an_odd_payload_reaches_the_sdks_stream_helper_through_every_path(
    function: Any, whole: bool, cache: bool,
) -> None:
    """The same, through the library: a streaming upstream, a source that cannot
    stream (the relay makes the chunk from the whole answer), and a cache hit replayed
    as a stream."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    call: dict[str, Any] = {"id": "c1", "type": "function"}
    if function != "absent":
        call["function"] = function
    if whole:
        upstream: Any = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                         "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                             "role": "assistant", "content": None, "tool_calls": [call]}}]}
    else:
        upstream = [{**BASE, "choices": [{"index": 0, "delta": d, "finish_reason": f}]} for d, f in [
            ({"role": "assistant", "content": None}, None),
            ({"tool_calls": [{"index": 0, **call}]}, None),
            ({}, "tool_calls")]]
    events, answer = _streamed_through_the_library(upstream, cache=cache)
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    [built] = state.get_final_completion().choices[0].message.tool_calls or []
    [want] = answer.message["tool_calls"]
    # (A whole answer's JSON body keeps the upstream's own message, ``arguments`` of 5
    # too; a stream's client gets strings, as the assembler keeps only strings.)
    texts = {k: v if isinstance(v, str) else "" for k, v in (want.get("function") or {}).items()}
    assert (built.id, built.function.name, built.function.arguments) == (
        want["id"], texts.get("name", ""), texts.get("arguments", ""))
