"""The byte-level SSE decoder against httpx-sse (the maintained reference decoder),
over random event streams cut into random pieces, with every kind of line end."""

from __future__ import annotations

from typing import Any

import pytest
from httpx_sse._decoders import SSEDecoder as ReferenceDecoder
from httpx_sse._decoders import SSELineDecoder
from hypothesis import given
from hypothesis import strategies as st

import polygate
from polygate.transport._assemble import ChatAssembler, has_content
from polygate.transport._sse import SSEDecoder

text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=30
)
events = st.lists(
    st.fixed_dictionaries({
        "comment": st.one_of(st.none(), text),
        "event": st.one_of(st.none(), st.sampled_from(["error", "message", "ping"])),
        "data": st.lists(text, min_size=0, max_size=3),
    }),
    max_size=8,
)


def _serialize(evs: list[dict[str, object]], eol: str) -> bytes:
    out = []
    for ev in evs:
        if ev["comment"] is not None:
            out.append(f":{ev['comment']}{eol}")
        if ev["event"] is not None:
            out.append(f"event: {ev['event']}{eol}")
        for line in ev["data"]:  # type: ignore[attr-defined]
            out.append(f"data: {line}{eol}")
        out.append(eol)
    return "".join(out).encode()


def _reference(body: bytes) -> list[tuple[str, str]]:
    lines = SSELineDecoder().decode(body.decode()) + SSELineDecoder().flush()
    decoder = ReferenceDecoder()
    got = []
    for line in [*lines, ""]:
        sse = decoder.decode(line)
        if (sse is not None and sse.data != "") or (sse is not None and sse.event not in ("", "message")):
            got.append((sse.event, sse.data))
    return [(e, d) for e, d in got if d != ""]


def _ours(body: bytes, cuts: list[int]) -> list[tuple[str, str]]:
    decoder = SSEDecoder(max_body=1 << 30, max_line=1 << 30, source="x")
    got = []
    start = 0
    for cut in [*sorted({c % (len(body) + 1) for c in cuts}), len(body)]:
        got += [(e.event, e.data.decode()) for e in decoder.feed(body[start:cut])]
        start = cut
    got += [(e.event, e.data.decode()) for e in decoder.flush()]
    return [(e, d) for e, d in got if d != ""]


@given(events, st.sampled_from(["\n", "\r\n", "\r"]), st.lists(st.integers(0, 10_000), max_size=6))
def test_matches_the_reference_decoder(evs: list[dict[str, object]], eol: str, cuts: list[int]) -> None:
    body = _serialize(evs, eol)
    ours = [(e if e != "message" else "", d) for e, d in _ours(body, cuts)]
    ref = [(e if e != "message" else "", d) for e, d in _reference(body)]
    assert ours == ref


def test_common_case_fast_path() -> None:
    decoder = SSEDecoder(max_body=1000, max_line=1000, source="x")
    got = list(decoder.feed(b'data: {"a":1}\n\ndata: [DONE]\n\n'))
    assert [e.data for e in got] == [b'{"a":1}', b"[DONE]"]


def test_crlf_split_between_pieces() -> None:
    decoder = SSEDecoder(max_body=1000, max_line=1000, source="x")
    got = list(decoder.feed(b"data: a\r")) + list(decoder.feed(b"\n\r\n"))
    assert [e.data for e in got] == [b"a"]


def test_caps() -> None:
    decoder = SSEDecoder(max_body=100, max_line=10, source="src")
    with pytest.raises(polygate.TransientUpstreamError, match="line cap"):
        for _ in range(3):
            list(decoder.feed(b"data: 0123"))
    decoder = SSEDecoder(max_body=20, max_line=1000, source="src")
    with pytest.raises(polygate.TransientUpstreamError, match="body cap"):
        list(decoder.feed(b"data: x\n\n" * 3))


deltas = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["assistant", None]),
    "content": st.one_of(st.none(), st.sampled_from(["", "hi"])),
    "reasoning_content": st.one_of(st.none(), st.sampled_from(["", "hm"])),
    "reasoning": st.one_of(st.none(), st.sampled_from(["", "hm"])),
    "refusal": st.one_of(st.none(), st.sampled_from(["", "no"])),
    "tool_calls": st.one_of(st.none(), st.just([]), st.just([{"index": 0, "function": {"arguments": "{"}}])),
    "extra": st.integers(),
})
chunks = st.fixed_dictionaries({}, optional={
    "id": st.just("x"),
    "choices": st.lists(st.fixed_dictionaries({"index": st.integers(0, 2), "delta": deltas},
                                              optional={"finish_reason": st.sampled_from([None, "stop"])}),
                        max_size=3),
    "usage": st.one_of(st.none(), st.just({"prompt_tokens": 1, "completion_tokens": 2})),
})


_NAMES = st.sampled_from([
    "id", "object", "created", "model", "system_fingerprint", "obfuscation", "error", "usage",
    "choices", "x_vendor", "service_tier", "index", "delta", "message", "finish_reason",
    "logprobs", "content_filter_results",
])
_VALUES = st.one_of(st.none(), st.integers(0, 3), st.sampled_from(["", "v", "stop"]),
                    st.just([1]), st.just({"k": 1}))
rich_chunks = st.tuples(chunks, st.dictionaries(_NAMES, _VALUES, max_size=4),
                        st.dictionaries(_NAMES, _VALUES, max_size=4)).map(
    lambda t: {**t[1], **t[0], "choices": [{**t[2], **c} for c in t[0].get("choices", [])]})


def _assembled(sequence: list[dict[str, object]]) -> dict[str, object] | str:
    assembler = ChatAssembler()
    try:
        for chunk in sequence:
            assembler.add(chunk)
    except polygate.TransientUpstreamError as exc:
        return str(exc)
    return assembler.malformed or assembler.build()


def _without_nones(chunk: dict[str, object]) -> dict[str, object]:
    out = {k: v for k, v in chunk.items() if v is not None}
    if type(out.get("choices")) is list:
        out["choices"] = [{k: v for k, v in c.items() if v is not None} if type(c) is dict else c
                          for c in out["choices"]]  # type: ignore[attr-defined]
    return out


@given(st.lists(rich_chunks, max_size=6))
def test_a_key_set_to_null_changes_nothing(sequence: list[dict[str, object]]) -> None:
    # null is "not sent": a chunk or a choice with any key set to null assembles as
    # one without that key (the assembler skips them before it looks at the name).
    assert _assembled(sequence) == _assembled([_without_nones(c) for c in sequence])


@given(st.lists(rich_chunks, min_size=1, max_size=6))
def test_a_chunks_own_keys_never_become_extras(sequence: list[dict[str, object]]) -> None:
    # Keys every chunk carries (its id, object, model...) are the answer's header or
    # nothing; any other key a chunk carries (not null) is kept in the answer.
    body = _assembled(sequence)
    if isinstance(body, str):
        return
    assert "obfuscation" not in body and "error" not in body
    assert body["object"] == "chat.completion"
    for name in ("x_vendor", "service_tier", "index", "delta", "finish_reason", "logprobs"):
        if any(c.get(name) is not None for c in sequence):
            assert name in body, name


@given(st.lists(chunks, max_size=6))
def test_assembler_agrees_with_has_content(sequence: list[dict[str, object]]) -> None:
    assembler = ChatAssembler()
    for chunk in sequence:
        assert assembler.add(chunk) == has_content(chunk)
    body = assembler.build()
    assert body["choices"]


@given(st.lists(st.text(max_size=5), max_size=300))
def test_text_parts_compact_without_changing_the_text(pieces: list[str]) -> None:
    from polygate.transport import TextParts

    parts = TextParts()
    for appended, piece in enumerate(pieces, 1):
        parts.append(piece)
        # A base-16 counter: one piece per unit of each digit, at most 15 a level
        # (log16 levels; a flat "< 16" meant rejoining the whole text: quadratic).
        assert len(parts) == sum(int(digit, 16) for digit in f"{appended:x}")
    assert "".join(parts) == "".join(pieces)
    assert bool(parts) == bool(pieces)


def test_reasoning_sent_under_both_names_is_assembled_once() -> None:
    """A probe found 'Think hard.' assembled as 'ThinkThink hard. hard.' from deltas that
    carry the same text as reasoning_content and reasoning (LightLLM, a vLLM PR)."""
    assembler = ChatAssembler()
    for piece in ("Think", " hard."):
        assert assembler.add({"choices": [{"index": 0, "delta": {
            "reasoning_content": piece, "reasoning": piece}}]})
    assembler.add({"choices": [{"index": 0, "delta": {"content": "42"}, "finish_reason": "stop"}]})
    message = assembler.build()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Think hard.", "42")
    # an empty reasoning_content beside a reasoning: the reasoning counts
    lone = ChatAssembler()
    assert lone.add({"choices": [{"index": 0, "delta": {"reasoning_content": "", "reasoning": "x"}}]})


@pytest.mark.parametrize(("fragments", "name"), [
    (["get_", "weather", "get_weather"], "get_weather"),  # fragments, then the whole again
    (["get_weather", "get_weather", "get_weather"], "get_weather"),  # repeated whole
    (list("get_weather"), "get_weather"),
    (list("llm_lookup"), "llm_lookup"),  # review: "lm_lookup"
    (list("aardvark"), "aardvark"),  # review: "ardvark"
    (["l", "lm_lookup"], "llm_lookup"),  # review: "lm_lookup" (a longer piece after one letter)
    (["s", "sh_exec"], "ssh_exec"),
])
def test_a_tool_calls_name_is_assembled_from_fragments_or_repeats(fragments: list[str], name: str) -> None:
    """A one-character fragment equal to the name so far read as the whole name
    repeated, and a doubled first letter was lost."""
    from polygate.transport import ChatAssembler

    assembler = ChatAssembler()
    for i, piece in enumerate(fragments):
        call: dict[str, Any] = {"index": 0, "function": {"name": piece}}
        if i == 0:
            call.update(id="c1", type="function")
        assembler.add({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    assembler.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    assert assembler.build()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == name


@pytest.mark.parametrize(
    ("function_call", "content"),
    [({}, False), ({"arguments": ""}, False), ({"name": None}, False),
     ({"name": "get_weather"}, True), ({"arguments": "{\""}, True)],
)
def test_an_empty_legacy_function_call_is_no_content(
    function_call: dict[str, object], content: bool
) -> None:
    # Empty deltas are no content tokens: they move no hedging timer and commit no
    # stream.  An empty function_call dict counted, and put a function_call with no
    # name into the answer.
    chunk = {"choices": [{"index": 0, "delta": {"function_call": function_call}}]}
    assembler = ChatAssembler()
    assert has_content(chunk) is content
    assert assembler.add(chunk) is content
    assert ("function_call" in assembler.build()["choices"][0]["message"]) is content


@pytest.mark.parametrize(
    ("call", "content"),
    [({"index": 0}, False), ({}, False), ({"index": 0, "type": "function"}, False),
     ({"index": 0, "function": {"arguments": ""}}, False),
     ({"index": 0, "function": {"name": None, "arguments": ""}}, False),
     ({"index": 0, "id": "call_1"}, True),
     ({"index": 0, "function": {"name": "get_weather"}}, True),
     ({"index": 0, "function": {"arguments": "{\""}}, True),
     ({"index": 0, "type": "custom", "custom": {"input": "x"}}, True)],
)
def test_an_empty_tool_call_fragment_is_no_content(call: dict[str, object], content: bool) -> None:
    # An outside review (the seeds' acceptance, 2026-12-05): a first delta of
    # ``tool_calls: [{"index": 0}]`` counted as a content token, so it stopped the
    # hedge's first-token timer and would commit a stream, with no model output yet.
    # Empty deltas are no content tokens, as for the legacy function_call above.
    chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
    assembler = ChatAssembler()
    assert has_content(chunk) is content
    assert assembler.add(chunk) is content


def test_a_delta_objects_streamed_text_is_joined_and_a_choices_is_not() -> None:
    """An outside review (the OpenAI SDK through the gateway, 2026-12-03) found a
    streamed audio answer assembled as its last pieces: ``audio.data`` "BBBB" for
    "AAAABBBB", ``transcript`` "lo" for "Hello".  A delta's object comes in pieces, as
    its content does: strings join (its id does not).  A choice's object is a report
    sent again (Azure's ``content_filter_results``): its strings stay the last sent."""
    assembler = ChatAssembler()
    for delta, filters in [
        ({"role": "assistant", "audio": {"id": "au_1", "data": "AAAA", "transcript": "Hel"}},
         {"hate": {"severity": "safe"}}),
        ({"audio": {"id": "au_1", "data": "BBBB", "transcript": "lo"}}, {"hate": {"severity": "low"}}),
        ({"audio": {"expires_at": 1}}, {}),
    ]:
        assembler.add({"choices": [{"index": 0, "delta": delta, "content_filter_results": filters}]})
    [choice] = assembler.build()["choices"]
    assert choice["message"]["audio"] == {"id": "au_1", "data": "AAAABBBB", "transcript": "Hello",
                                          "expires_at": 1}
    assert choice["content_filter_results"] == {"hate": {"severity": "low"}}
    # An answer of audio alone has no text: null, as OpenAI's non-streamed one (it was "").
    assert choice["message"]["content"] is None


def test_a_delta_object_other_than_audio_keeps_the_last_string_sent() -> None:
    """Review of the audio fix: joining every delta object's strings doubled a value
    sent again whole -- Gemini's ``extra_content.google.thought_signature`` on two
    deltas became one corrupt signature, an ``intent`` '["w"]["w"]'."""
    assembler = ChatAssembler()
    for _ in range(2):
        assembler.add({"choices": [{"index": 0, "delta": {
            "extra_content": {"google": {"thought_signature": "c2ln"}},
            "context": {"intent": '["w"]'}}}]})
    message = assembler.build()["choices"][0]["message"]
    assert message["extra_content"] == {"google": {"thought_signature": "c2ln"}}
    assert message["context"] == {"intent": '["w"]'}
