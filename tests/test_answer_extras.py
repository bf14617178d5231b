"""A provider's fields beside an answer (Azure's ``content_filter_results`` on a
choice, ``prompt_filter_results`` on the body) reach a stream's reader by every route:
a streamed cache hit as the miss's stream had them, and a source that cannot stream
even when the answer it filtered holds no content token.  An outside review (one
answer through many routes, 2026-12-05) found both lost."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.serve import open_server

from .conftest import MESSAGES

KEY = "sk-gw-test-0123456789"
FILTERED = {"hate": {"filtered": True, "severity": "high"}}
HEADER = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m1"}
EMPTY = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m1",
         "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}],
         "choices": [{"index": 0, "finish_reason": "content_filter", "logprobs": None,
                      "content_filter_results": FILTERED,
                      "message": {"role": "assistant", "content": "", "refusal": None}}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}}


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


EVENTS = [
    {**HEADER, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {**HEADER, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
    {**HEADER, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                            "content_filter_results": FILTERED}]},
    {**HEADER, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
]


def _filters(raws: list[dict[str, Any]]) -> list[Any]:
    return [c["content_filter_results"] for raw in raws for c in raw.get("choices", [])
            if isinstance(c, dict) and "content_filter_results" in c]


async def test_a_streamed_cache_hit_keeps_a_choices_fields(autojump_clock: trio.testing.MockClock) -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)}, cache="memory")
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse(EVENTS)))
    seen: list[list[dict[str, Any]]] = []
    async with polygate.session(settings, transport=transport) as s:
        for _ in range(2):
            async with s.stream_chat(MESSAGES) as stream:
                seen.append([chunk.raw async for chunk in stream])
            assert stream.response is not None
    assert stream.response.call_stats.cached
    assert _filters(seen[0]) == _filters(seen[1]) == [FILTERED]


async def test_a_filtered_empty_answer_from_a_source_that_cannot_stream_is_one_chunk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=EMPTY))
    async with polygate.session(settings, transport=transport) as s:
        async with s.stream_chat(MESSAGES) as stream:
            chunks = [chunk async for chunk in stream]
    assert [c.text for c in chunks] == [""]
    assert _filters([chunks[0].raw]) == [FILTERED] and "prompt_filter_results" in chunks[0].raw
    assert stream.response is not None and stream.response.finish_reason == "content_filter"


def _through_gateway(settings: polygate.Settings, transport: httpx.MockTransport,
                     streams: tuple[bool, ...]) -> list[str]:
    async def main() -> list[str]:
        async with open_server(settings, port=0, transport=transport) as server:
            def client() -> list[str]:
                return [httpx.post(server.base_url + "/chat/completions",
                                   headers={"authorization": f"Bearer {KEY}"},
                                   json={"model": "chat", "messages": MESSAGES, "stream": stream}).text
                        for stream in streams]
            return await trio.to_thread.run_sync(client)

    return trio.run(main)


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_the_gateways_streamed_hit_keeps_a_choices_fields() -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)},
        cache="memory", serve=polygate.Serve(api_keys=[KEY]))
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse(EVENTS)))
    miss, hit, whole = _through_gateway(settings, transport, (True, True, False))
    assert _filters(_events(miss)) == _filters(_events(hit)) == [FILTERED]
    assert json.loads(whole)["choices"][0]["content_filter_results"] == FILTERED


def test_the_gateways_stream_of_a_filtered_empty_json_answer_keeps_its_fields() -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", streaming=False)])},
        serve=polygate.Serve(api_keys=[KEY]))
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=EMPTY))
    whole, streamed = _through_gateway(settings, transport, (False, True))
    assert json.loads(whole)["choices"][0]["content_filter_results"] == FILTERED
    events = _events(streamed)
    assert [c.get("finish_reason") for e in events for c in e["choices"]][-1] == "content_filter"
    assert _filters(events) == [FILTERED]
    assert any("prompt_filter_results" in e for e in events)


async def test_reasoning_sent_as_reasoning_reads_the_same_by_either_route(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same review: an answer whose reasoning came as ``reasoning`` (Ollama,
    OpenRouter) had ``reasoning_content`` in its message when streamed (SPEC §1), and
    not from a source that cannot stream (a KeyError for the caller who reads it)."""
    body = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m1",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "4", "refusal": None,
                                     "reasoning": "2+2 is 4"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    events = [
        {**HEADER, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**HEADER, "choices": [{"index": 0, "delta": {"reasoning": "2+2 is 4"}, "finish_reason": None}]},
        {**HEADER, "choices": [{"index": 0, "delta": {"content": "4"}, "finish_reason": None}]},
        {**HEADER, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**HEADER, "choices": [], "usage": body["usage"]},
    ]

    answers = await _by_either_route(body, events)
    messages = {streaming: answer.message for streaming, answer in answers.items()}
    assert messages[False] == messages[True]
    assert messages[False]["reasoning_content"] == messages[False]["reasoning"] == "2+2 is 4"


def _entry(token: str, raw: list[int]) -> dict[str, Any]:
    return {"token": token, "logprob": -0.2, "bytes": raw, "top_logprobs": []}


#: A token that is part of a character: OpenAI streams it with ``"content": ""`` and
#: its logprobs entry; the next token ends the character.
LOGPROB_EVENTS = [
    {**HEADER, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": {"content": [], "refusal": None}, "finish_reason": None}]},
    {**HEADER, "choices": [{"index": 0, "delta": {"content": "Hi "}, "finish_reason": None,
                            "logprobs": {"content": [_entry("Hi", [72, 105]), _entry(" ", [32])]}}]},
    {**HEADER, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None,
                            "logprobs": {"content": [_entry("bytes:\\xe4\\xbd", [228, 189])]}}]},
    {**HEADER, "choices": [{"index": 0, "delta": {"content": "你"}, "finish_reason": None,
                            "logprobs": {"content": [_entry("bytes:\\xa0", [160])]}}]},
    {**HEADER, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None}]},
]
TOKENS = ["Hi", " ", "bytes:\\xe4\\xbd", "bytes:\\xa0"]


def _tokens(raws: list[dict[str, Any]]) -> list[str]:
    return [t["token"] for raw in raws for c in raw.get("choices", []) if type(c) is dict
            for t in ((c.get("logprobs") or {}).get("content") or [])]


async def test_a_logprob_without_text_reaches_a_streams_reader(autojump_clock: trio.testing.MockClock) -> None:
    """A chunk whose only news is a logprobs entry (a token inside a character, vLLM's
    last) reached neither a stream's reader nor the gateway's client, while the
    assembled answer had it: the two disagreed."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse(LOGPROB_EVENTS)))
    async with polygate.session(settings, transport=transport) as s:
        async with s.stream_chat(MESSAGES, logprobs=True) as stream:
            raws = [chunk.raw async for chunk in stream]
    assert stream.response is not None
    assert [t["token"] for t in stream.response.choices[0]["logprobs"]["content"]] == TOKENS
    assert _tokens(raws) == TOKENS


def test_the_gateways_stream_carries_a_logprob_without_text() -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])}, serve=polygate.Serve(api_keys=[KEY]))
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse(LOGPROB_EVENTS)))
    (streamed,) = _through_gateway(settings, transport, (True,))
    assert _tokens(_events(streamed)) == TOKENS


async def _by_either_route(body: dict[str, Any], events: list[dict[str, Any]]) -> dict[bool, Any]:
    """The answer of a streaming source sent ``events`` and of one that cannot stream
    sent ``body``, by streaming."""
    def answer(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse(events))
        return httpx.Response(200, json=body)

    out = {}
    for streaming in (True, False):
        settings = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=streaming)],
            retry=polygate.Retry(max_attempts=1))})
        async with polygate.session(settings, transport=httpx.MockTransport(answer)) as s:
            out[streaming] = await s.chat(MESSAGES)
    return out


def _route_pair(message: dict[str, Any], delta: dict[str, Any], finish: Any = "stop",
                **choice: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m1",
            "choices": [{"index": 0, "finish_reason": finish, "message": message, **choice}]}
    events = [{**HEADER, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
              {**HEADER, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}]
    return body, events


@pytest.mark.parametrize("role", ["absent", None, 5])
async def test_a_json_answer_without_a_string_role_is_the_assistants(
    role: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (the result types under hostile values): a source that cannot
    stream answered ``{"content": "hi"}`` (no role, null, 5) and the message came back
    so; the streamed answer says "assistant".  An agent loop that appends the message
    to its history then had its next call refused as its own error."""
    message = {"content": "hi"} if role == "absent" else {"role": role, "content": "hi"}
    answers = await _by_either_route(*_route_pair(message, message))
    assert answers[False].message["role"] == answers[True].message["role"] == "assistant"
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    body = _route_pair(message, message)[0]
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        history = [*MESSAGES, answers[False].message, {"role": "user", "content": "and?"}]
        assert (await s.chat(history)).text == "hi"  # the next turn, the answer in it


@pytest.mark.parametrize("finish", ["", 5, ["stop"]])
async def test_a_finish_reason_that_says_none_is_none_by_either_route(
    finish: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    """``""`` (StepFun's, Zhipu's), a number or a list say no reason: the streamed
    answer's ``finish_reason`` was None, the JSON one's ``""`` (or None beside a
    choice that still said 5)."""
    answers = await _by_either_route(*_route_pair(
        {"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "hi"}, finish))
    assert answers[False].finish_reason is None and answers[True].finish_reason is None


async def test_a_json_answers_typed_parts_read_as_the_streamed_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mistral's magistral models answer with typed parts (thinking, then text): the
    streamed answer's message had the text as ``content`` and the thinking as
    ``reasoning_content``, the JSON one the list itself."""
    parts = [{"type": "thinking", "thinking": [{"type": "text", "text": "hmm"}]},
             {"type": "text", "text": "Answer"}]
    answers = await _by_either_route(*_route_pair(
        {"role": "assistant", "content": parts}, {"role": "assistant", "content": parts}))
    for answer in answers.values():
        assert answer.text == answer.message["content"] == "Answer"
        assert answer.message["reasoning_content"] == "hmm"


async def test_a_json_choice_without_an_index_is_choice_0(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A server that omits the index sends one choice, which the library reads as
    choice 0: its choices now say so, as the streamed answer's do."""
    body, events = _route_pair({"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "hi"})
    del body["choices"][0]["index"]
    answers = await _by_either_route(body, events)
    assert answers[False].choices[0]["index"] == answers[True].choices[0]["index"] == 0


@pytest.mark.parametrize("field", ["id", "type", "index"])
async def test_a_tool_call_field_that_is_an_object_never_replaces_the_calls_own(
    field: str, autojump_clock: trio.testing.MockClock,
) -> None:
    """A tool-call delta whose ``id``, ``type`` or ``index`` is an object was merged
    as a provider's object: it replaced the call's id (``{"x": 1}`` for "c1"), its
    type (``{}``), or added an ``index`` to it."""
    first = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    later: dict[str, Any] = {"index": 0, "function": {"arguments": "}"}, field: {"x": 1}}
    if field == "index":
        later = {"id": "c1", "function": {"arguments": "}"}, "index": {"x": 1}}
    events = [{**HEADER, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in (
        {"role": "assistant", "content": None, "tool_calls": [first]}, {"tool_calls": [later]})]
    events.append({**HEADER, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=httpx.MockTransport(lambda request: httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=_sse(events)))) as s:
        answer = await s.chat(MESSAGES)
    [call] = answer.message["tool_calls"]
    assert call == {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_a_chunks_reasoning_is_the_first_that_is_text() -> None:
    chunk = polygate.StreamChunk(text="", delta={"reasoning_content": 5, "reasoning": "think"}, raw={})
    assert chunk.reasoning == "think"


@pytest.mark.parametrize("extra", [{"refusal": 5}, {"refusal": ["no"]}, {"tool_calls": "x"},
                                   {"tool_calls": [5]}, {"function_call": 5}])
async def test_a_json_answers_fields_of_the_wrong_type_read_as_the_streamed_ones(
    extra: dict[str, Any], autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (OCR and structured output under hostile answers): a source that
    cannot stream answered ``refusal: 5``, ``tool_calls: "x"`` … and the message kept
    them (the stream's assembler ignores them), and ``chat(schema=)`` took them for the
    model declining: ``parsed=None``, no re-ask.  Now both routes give the same message,
    and the structured call is re-asked as the streamed one is."""
    message = {"role": "assistant", "content": None, **extra}
    answers = await _by_either_route(*_route_pair(message, message))
    for key in ("refusal", "tool_calls", "function_call"):
        assert answers[False].message.get(key) == answers[True].message.get(key) is None
    assert "tool_calls" not in answers[False].message and "function_call" not in answers[False].message
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = _route_pair(message, message)[0]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=body)

    async with polygate.session(settings, transport=httpx.MockTransport(answer)) as s:
        with pytest.raises(polygate.StructuredOutputError):
            await s.chat(MESSAGES, schema=schema)
    assert len(sent) == 3  # asked again (twice, the default), as any answer not the schema's is


@pytest.mark.parametrize("streaming", [True, False])
async def test_typed_refusal_and_reasoning_parts_are_no_answer_text(
    streaming: bool, autojump_clock: trio.testing.MockClock,
) -> None:
    """OpenAI's ``refusal`` part is the message's refusal (it was dropped, and a
    structured call re-asked a refusal), and a ``reasoning`` part is reasoning, not
    the answer's text (it was joined into it)."""
    parts = [{"type": "reasoning", "text": "thoughts "}, {"type": "text", "text": "PAGE"},
             {"type": "refusal", "refusal": "no more"}]
    answers = await _by_either_route(*_route_pair(
        {"role": "assistant", "content": parts}, {"role": "assistant", "content": parts}))
    answer = answers[streaming]
    assert answer.text == answer.message["content"] == "PAGE"
    assert answer.message["reasoning_content"] == "thoughts "
    assert answer.message["refusal"] == "no more"


async def test_a_tool_call_beside_blank_content_is_no_answer_to_validate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A tool parser that leaves ``"\\n\\n"`` before the calls: the answer is the tool
    call (``parsed=None``, returned as it came), not blank JSON to re-ask."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = _route_pair({"role": "assistant", "content": "\n\n", "tool_calls": [call]}, {})[0]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        answer = await s.chat(MESSAGES, schema={"type": "object"})
    assert answer.parsed is None and answer.message["tool_calls"] == [call]


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "tool_calls": [{}]},
    {"role": "assistant", "content": None, "tool_calls": [{"function": "f"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"index": 0, "function": None}]},
    {"role": "assistant", "content": None, "function_call": {"name": 5}},
    {"role": "assistant", "content": None, "function_call": {"name": "", "arguments": ""}},
])
async def test_a_json_answers_empty_calls_are_no_calls(
    message: dict[str, Any], autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix above: calls that carry nothing (the assembler keeps none)
    were still kept from a whole answer, and a structured call took them for the model
    choosing a tool: ``parsed=None``, no re-ask."""
    answers = await _by_either_route(*_route_pair(message, message))
    for key in ("tool_calls", "function_call"):
        assert answers[False].message.get(key) is None is answers[True].message.get(key)
    body = _route_pair(message, message)[0]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        with pytest.raises(polygate.StructuredOutputError):
            await s.chat(MESSAGES, schema={"type": "object", "required": ["a"]})


@pytest.mark.parametrize(("field", "value", "want"), [
    ("content", 5, ""), ("content", {"x": 1}, ""),
    ("reasoning_content", 5, "think"), ("reasoning_content", "", "think"),
])
async def test_a_json_answers_text_fields_of_the_wrong_type_read_as_the_streamed_ones(
    field: str, value: Any, want: str, autojump_clock: trio.testing.MockClock,
) -> None:
    message = {"role": "assistant", "content": "", "reasoning": "think", field: value}
    answers = await _by_either_route(*_route_pair(message, message))
    got = [answers[streaming].message.get(field) for streaming in (False, True)]
    assert got == [want, want]


async def test_a_json_answers_call_reads_as_the_assembled_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (the JSON answer read by strict clients): a whole answer's call
    with an ``id`` of 7, no ``type``, a ``name`` of 5 and ``arguments`` as an object
    reached the caller (and the gateway's JSON clients) so; an agent loop's
    ``json.loads(arguments)`` raised TypeError.  The arguments object is its JSON."""
    call = {"id": 7, "function": {"name": 5, "arguments": {"city": "Paris"}}}
    body = _route_pair({"role": "assistant", "content": None, "tool_calls": [call]}, {})[0]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        answer = await s.chat(MESSAGES)
    [got] = answer.message["tool_calls"]
    assert got == {"id": None, "type": "function", "function": {"name": "", "arguments": '{"city": "Paris"}'}}
    assert json.loads(got["function"]["arguments"]) == {"city": "Paris"}


async def test_a_json_answers_parts_that_hold_more_than_text_are_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: typed parts were flattened in the body itself, so an image part or a
    text part's annotations were lost from the answer and the gateway's JSON."""
    parts = [{"type": "text", "text": "See", "annotations": [{"type": "url_citation"}]},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    body = _route_pair({"role": "assistant", "content": parts}, {})[0]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        answer = await s.chat(MESSAGES)
    assert answer.text == "See" and answer.message["content"] == parts
    assert answer.raw["choices"][0]["message"]["content"] == parts


@pytest.mark.parametrize("logprobs", [[], "x", {"content": "x"}, {"refusal": 5}])
async def test_a_json_answers_logprobs_of_the_wrong_type_are_left_out(
    logprobs: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    """As the stream's relay leaves them out: a client's list of tokens never meets a
    string."""
    body = _route_pair({"role": "assistant", "content": "hi"}, {}, logprobs=logprobs)[0]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        answer = await s.chat(MESSAGES)
    kept = answer.choices[0]["logprobs"]
    assert kept is None or all(type(v) is list for k, v in kept.items() if k in ("content", "refusal"))


async def test_two_json_choices_at_one_index_are_numbered_by_their_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A bridge that gives every choice index 0 (or none): a client keyed them by index
    and kept one, and the stream of the answer showed choice 0's text twice."""
    body = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m1", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
        for text in ("one", "two")]}
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        answer = await s.chat(MESSAGES)
        async with s.stream_chat(MESSAGES) as stream:
            chunks = [chunk async for chunk in stream]
    assert [(c["index"], c["message"]["content"]) for c in answer.choices] == [(0, "one"), (1, "two")]
    assert "".join(chunk.text for chunk in chunks) == "one"


async def _whole(body: dict[str, Any]) -> Any:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(settings, transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))) as s:
        return await s.chat(MESSAGES)


async def test_reasoning_and_refusal_parts_beside_richer_parts_are_still_no_text(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix above: with a part that holds more than text beside them
    (annotations), the parts were kept whole, and the reasoning part's text became the
    answer's ("SECRET-THOUGHTAnswer")."""
    annotated = {"type": "text", "text": "Answer", "annotations": [{"type": "url_citation"}]}
    parts = [{"type": "reasoning", "text": "SECRET-THOUGHT"}, annotated,
             {"type": "refusal", "refusal": "not that"}]
    answer = await _whole(_route_pair({"role": "assistant", "content": parts}, {})[0])
    assert answer.text == "Answer"
    assert answer.message["content"] == [annotated]
    assert answer.message["reasoning_content"] == "SECRET-THOUGHT"
    assert answer.message["refusal"] == "not that"


async def test_choices_sharing_an_index_keep_the_index_order_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: indexes [1, 0, 1] were renumbered by the body's order, so the upstream's
    choice 1 became the answer."""
    body = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m1", "choices": [
        {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
        for i, text in ((1, "one-a"), (0, "zero"), (1, "one-b"))]}
    answer = await _whole(body)
    assert answer.text == "zero"
    assert [(c["index"], c["message"]["content"]) for c in answer.choices] == [
        (0, "zero"), (1, "one-a"), (2, "one-b")]


async def test_a_json_calls_odd_fields_read_as_the_assembled_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: content of 5 beside a call is null (as assembled), not ""; a name that
    is a list is "" (only arguments are JSON text); an id of 7 or "" is null."""
    calls = [{"id": 7, "type": "function", "function": {"name": ["f"], "arguments": "{}"}},
             {"id": "", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    answer = await _whole(_route_pair({"role": "assistant", "content": 5, "tool_calls": calls}, {})[0])
    assert answer.message["content"] is None
    assert [(c["id"], c["function"]["name"]) for c in answer.message["tool_calls"]] == [(None, ""), (None, "g")]


@pytest.mark.parametrize("empty", [{"type": "text", "text": None}, {"type": "text"}])
async def test_a_text_part_without_text_leaves_the_content_plain(
    empty: dict[str, Any], autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a text part whose ``text`` is null or missing kept the whole content a
    list (sent back upstream so on the next turn), where the stream reads "A"."""
    parts = [{"type": "thinking", "thinking": "T"}, {"type": "text", "text": "A"}, empty]
    answer = await _whole(_route_pair({"role": "assistant", "content": parts}, {})[0])
    assert answer.message["content"] == answer.text == "A"


async def test_a_json_call_without_an_id_has_a_null_one_as_assembled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer = await _whole(_route_pair({"role": "assistant", "content": None, "tool_calls": [call]}, {})[0])
    assert answer.message["tool_calls"][0]["id"] is None
