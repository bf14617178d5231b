"""Hostile bytes and arguments at the core: text that is not valid Unicode, vectors
and indexes that are not what they claim, usage that does not add up.  Each ends
in a typed error (or a documented, safe reading) — never a bare exception."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ._raw_server import OK_EVENTS, RawServer, raw_server
from .conftest import MESSAGES, SECRET

LONE = "a\ud800b"


def _embed_settings() -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1", api_key="sk-x")
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[source]),
                                     "embed": polygate.Scope(sources=[source])})


# --------------------------------------------------------------------- lone surrogates


@pytest.mark.parametrize("call", [
    lambda s: s.chat([{"role": "user", "content": LONE}]),
    lambda s: s.chat([{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
    lambda s: s.chat([{"role": "user", LONE: "x"}]),
    lambda s: s.chat(MESSAGES, user=LONE),
    lambda s: s.chat(MESSAGES, metadata={"k": [LONE]}),
    lambda s: s.embed([LONE], scope="embed"),
    lambda s: s.embed(["ok", "ok", LONE], scope="embed"),
    lambda s: s.embed(["ok"], scope="embed", user=LONE),
])
async def test_a_lone_surrogate_from_the_caller_is_a_config_error_before_any_io(
    call: Any, autojump_clock: trio.testing.MockClock
) -> None:
    up = FakeUpstream(Reply())
    async with polygate.session(_embed_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="not valid Unicode") as info:
            await call(s)
        assert "\ud800" not in str(info.value)
        with pytest.raises(polygate.ConfigError, match="not valid Unicode"):
            async with s.stream_chat([{"role": "user", "content": LONE}]) as stream:
                async for _ in stream:
                    pass
    assert up.statistics().requests == 0


async def test_valid_non_ascii_and_escaped_pairs_still_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply())
    async with polygate.session(_embed_settings(), transport=Router({"a": up})) as s:
        await s.chat([{"role": "user", "content": "é 😀 \U0001f600 ✓"}], user="ü")
        await s.embed(["😀", "plain"], scope="embed")
    assert up.statistics().requests == 2


def _answers_sse(body: bytes) -> Any:
    """A raw server's reply: ``body`` as one event stream, whatever was asked."""

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"content-length: %d\r\n\r\n" % len(body) + body)

    return reply


def _one_source(server: RawServer, **source: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url=server.url, api_key="sk-x", **source)])})


def _sized(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(body) + body)


async def test_an_answer_with_a_lone_surrogate_reads_as_text() -> None:
    """The upstream's ``\\ud800`` escape is valid JSON but no Unicode text: the library
    reads it as U+FFFD, as a UTF-8 decoder with ``errors="replace"`` reads a bad byte.
    So the answer prints, encodes, and goes back into the next call (a re-ask here; a
    chat history in general) instead of failing there as a ConfigError, or as a bare
    UnicodeEncodeError while building the next body."""
    bad = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"bad \\ud800 x"},"finish_reason":"stop"}]}'
    good = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"{\\"ok\\": 1}"},"finish_reason":"stop"}]}'

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sized(bad if len(server.requests) in (1, 3) else good))

    async with raw_server(reply) as server:
        async with polygate.session(_one_source(server, streaming=False)) as s:
            response = await s.chat(MESSAGES, schema={"type": "object"})
            first = await s.chat(MESSAGES, cache=False)  # the bad answer again, alone
            # ... and back into a conversation, as a caller appends an answer
            await s.chat([*MESSAGES, first.message, {"role": "user", "content": "go on"}])
    assert response.parsed == {"ok": 1}
    reask = _body(server, 1)
    assert json.loads(reask)["messages"][1]["content"] == "bad \ufffd x"
    assert first.text == "bad \ufffd x"
    assert json.loads(_body(server, 3))["messages"][1]["content"] == "bad \ufffd x"


def _json_answer(content: str, model: str = "m") -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion", "model": model, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-16", "utf-32"])
async def test_a_lone_surrogate_in_a_utf16_or_utf32_body_reads_as_text(
    encoding: str, tmp_path: Any
) -> None:
    """An outside review (2026-12-05): the body reader's fallback (``json.loads``) reads
    UTF-16 and UTF-32 too, where the search for an escaped surrogate, made on the
    bytes, found none.  The lone surrogate reached the answer and the telemetry row of
    an error's text, where SQLite refused it and dropped the whole batch: the other
    calls' rows with it."""
    bodies = iter([
        json.dumps(_json_answer("fine")).encode(),
        json.dumps(_json_answer("a\ud800b", model="m\udfff")).encode(encoding),
        json.dumps({"error": {"message": "bad \ud800 thing", "type": "server_error"}}).encode(encoding),
        json.dumps(_json_answer("fine")).encode(),
    ])
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "application/json"}, content=next(bodies)))
    db = tmp_path / "t.db"
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)],
        retry=polygate.Retry(max_attempts=1),
    )}, telemetry=f"sqlite:///{db}", log_content=True)
    async with polygate.session(settings, transport=transport) as s:
        await s.chat(MESSAGES)
        odd = await s.chat(MESSAGES)
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
        await s.chat(MESSAGES)
    assert (odd.text, odd.model) == ("a\ufffdb", "m\ufffd")
    assert "bad \ufffd thing" in str(info.value)
    telemetry = (await s.statistics()).telemetry
    assert (telemetry.dropped, telemetry.written) == (0, 8)


def test_a_rows_text_is_text_whatever_reached_it() -> None:
    """The row's own guard, for any text an error carries: a lone surrogate read as
    U+FFFD (no sink's encoder takes one: the batch with it)."""
    from polygate.telemetry._recorder import error_text

    assert error_text(RuntimeError("x \ud800 y"), ()) == "x \ufffd y"
    assert error_text(RuntimeError("\U0001f600 ok"), ()) == "\U0001f600 ok"


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\uDBFF", "\\ud83d"])
async def test_a_streamed_lone_surrogate_reads_as_text(escape: str) -> None:
    """The same in a stream: each delta, the assembled text, and a key, with a proper
    escaped pair (an emoji) left whole."""
    def event(content: str) -> bytes:
        return (b'data: {"choices":[{"index":0,"delta":{"content":"' + content.encode()
                + b'"},"x_' + escape.encode() + b'":1}]}\n\n')

    body = event("a" + escape + "b") + event("\\ud83d\\ude00") + b"data: [DONE]\n\n"

    async with raw_server(_answers_sse(body)) as server, polygate.session(_one_source(server)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            deltas = [chunk.text async for chunk in stream]
        response = stream.response
    assert deltas == ["a\ufffdb", "\U0001f600"]
    assert response.text == "a\ufffdb\U0001f600"
    response.text.encode()
    json.dumps(response.raw, ensure_ascii=False).encode()


def _body(server: RawServer, n: int) -> bytes:
    return server.requests[n].partition(b"\r\n\r\n")[2]


def test_chat_body_escapes_a_lone_surrogate_as_json_does() -> None:
    from polygate.transport._wire import Endpoint, chat_body, embeddings_body

    endpoint = Endpoint.__new__(Endpoint)
    object.__setattr__(endpoint, "model", None)
    body = chat_body(endpoint, json.dumps([{"role": "assistant", "content": "x\udfff"}], ensure_ascii=False), {}, False)
    assert json.loads(body) == json.loads(json.dumps({"messages": [{"role": "assistant", "content": "x\udfff"}]}))
    assert json.loads(embeddings_body(endpoint, ["\ud800"], {}))["input"] == ["\ud800"]


# --------------------------------------------------------------------- linear assembly


class _Copies:
    """Characters the assembler's joins copy (its ``_join`` seam), counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from polygate import _types

        self.copied = 0
        real_join = "".join

        def counting_join(pieces: Any) -> str:
            joined = real_join(pieces)
            self.copied += len(joined)
            return joined

        monkeypatch.setattr(_types, "_join", counting_join)


def test_text_parts_copies_each_character_a_logarithmic_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/security.md promises work linear in the bytes received: the assembler must
    not rejoin the whole answer every few pieces (quadratic in the answer's length).
    Counted in characters copied by joins, not in time, so it cannot flake."""
    from polygate.transport import _assemble

    copies = _Copies(monkeypatch)
    parts = _assemble.TextParts()
    n = 50_000
    for i in range(n):
        parts.append(str(i % 10))
    assert "".join(parts) == "".join(str(i % 10) for i in range(n))
    assert copies.copied <= 5 * n  # log16(50 000) < 4 levels; quadratic would be ~n²/32
    assert len(parts) <= 15 * 4 + 1  # still a few pieces, not one per token


@pytest.mark.parametrize("shape", ["tool_call", "function_call", "indexed_extra", "tool_call_name",
                                   "function_call_name"])
def test_fragmented_arguments_and_extras_are_joined_in_linear_work(
    monkeypatch: pytest.MonkeyPatch, shape: str,
) -> None:
    """Review: a tool call's arguments (and a legacy function_call's, and an indexed
    extra's text such as OpenRouter's reasoning_details) grew by ``+=`` on a string a
    dict also held: every fragment copied all before it.  640,000 one-character
    fragments took 10 s of the event loop.  They go through the same linear joiner
    as the content (each character copied a logarithmic number of times)."""
    from polygate.transport import _assemble

    copies = _Copies(monkeypatch)
    delta: dict[str, Any] = {
        "tool_call": {"tool_calls": [{"index": 0, "function": {"arguments": "x"}}]},
        "function_call": {"function_call": {"arguments": "x"}},
        "indexed_extra": {"reasoning_details": [{"index": 0, "type": "reasoning.text", "text": "x"}]},
        # (review: the name still grew by +=: a 32 MiB body of one-character name
        # fragments held the loop for 3.2 s)
        # (the same fragment twice would read as the name repeated whole)
        "tool_call_name": {"tool_calls": [{"index": 0, "function": {"name": "{}"}}]},
        "function_call_name": {"function_call": {"name": "{}"}},
    }[shape]
    assembler = _assemble.ChatAssembler()
    n = 50_000
    for i in range(n):
        piece = json.loads(json.dumps(delta).replace("{}", "xy"[i % 2])) if "name" in shape else delta
        assembler.add({"choices": [{"index": 0, "delta": piece}]})
    message = assembler.build()["choices"][0]["message"]
    text = {
        "tool_call": lambda: message["tool_calls"][0]["function"]["arguments"],
        "function_call": lambda: message["function_call"]["arguments"],
        "indexed_extra": lambda: message["reasoning_details"][0]["text"],
        "tool_call_name": lambda: message["tool_calls"][0]["function"]["name"],
        "function_call_name": lambda: message["function_call"]["name"],
    }[shape]()
    assert text == ("xy" * (n // 2) if "name" in shape else "x" * n)
    assert n <= copies.copied <= 5 * n  # through the joiner, each character ~log16(n) times
    assert assembler.build()["choices"][0]["message"] == message  # a second build: the same


def test_the_assembler_still_builds_the_whole_text() -> None:
    from polygate.transport import ChatAssembler

    assembler = ChatAssembler()
    for i in range(5000):
        assembler.add({"choices": [{"index": 0, "delta": {"content": f"{i},"}}]})
    message = assembler.build()["choices"][0]["message"]
    assert message["content"] == "".join(f"{i}," for i in range(5000))


# --------------------------------------------------------------------- embedding vectors


class _Named:
    name = "a"
    secrets = ("sk-x",)


def _f32(*values: float) -> str:
    import base64
    from array import array

    return base64.b64encode(array("f", values).tobytes()).decode()


_HUGE = json.loads("1" + "0" * 400)  # an int no float can hold


@pytest.mark.parametrize("data", [
    [{"index": 0, "embedding": [_HUGE, 1.0]}],
    [{"index": 0, "embedding": [-_HUGE]}],
    [{"index": 0, "embedding": _f32(float("nan"), 1.0)}],
    [{"index": 0, "embedding": _f32(1.0, float("inf"))}],
    [{"index": 0, "embedding": []}],
    [{"index": 0, "embedding": ""}],
    [{"index": 0, "embedding": [0.1]}, {"index": 1, "embedding": [0.1, 0.2]}],
    [{"index": 0, "embedding": _f32(0.1)}, {"index": 1, "embedding": [0.1, 0.2]}],
    [{"index": False, "embedding": [0.1]}, {"index": True, "embedding": [0.2]}],
], ids=["huge-int", "huge-negative-int", "b64-nan", "b64-inf", "empty", "b64-empty",
        "ragged", "ragged-mixed", "bool-index"])
def test_a_malformed_embeddings_body_is_refused(data: list[dict[str, Any]]) -> None:
    from polygate.transport._exchange import _vectors

    with pytest.raises(polygate.TransientUpstreamError, match="malformed embedding") as info:
        _vectors({"data": data}, len(data), _Named())  # type: ignore[arg-type]
    assert info.value.source == "a"


_SCALARS = st.one_of(
    st.integers(min_value=-(10**400), max_value=10**400), st.floats(), st.booleans(), st.none(),
    st.text(max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_SCALARS, max_size=8))
def test_a_json_vector_is_taken_exactly_when_every_value_is_a_finite_number(values: list[Any]) -> None:
    """The vector check (msgspec's, for its speed: a loop over 256 vectors of 3,072
    held the event loop ~0.23 s) takes what the plain rule takes: numbers only (not a
    bool, a string or null), each as a float, an integer no float holds refused, the
    whole finite, and not empty."""
    from polygate.transport._exchange import _vector

    try:
        expected: list[float] | None = [float(x) for x in values] if all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in values) else None
    except OverflowError:
        expected = None
    if not expected or not math.isfinite(sum(expected)):
        expected = None
    if expected is None:
        with pytest.raises(polygate.TransientUpstreamError, match="malformed embedding vector"):
            _vector(values, _Named())  # type: ignore[arg-type]
    else:
        got = _vector(values, _Named())  # type: ignore[arg-type]
        assert got == expected and all(type(x) is float for x in got)


def test_well_formed_vectors_still_pass() -> None:
    from polygate.transport._exchange import _vectors

    data = [{"index": 1, "embedding": [1, 2.5]}, {"index": 0, "embedding": _f32(0.5, -1.0)}]
    assert _vectors({"data": data}, 2, _Named()) == [[0.5, -1.0], [1.0, 2.5]]  # type: ignore[arg-type]


async def test_a_huge_integer_in_a_vector_is_a_quiet_upstream_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = b'{"data":[{"index":0,"embedding":[1' + b"0" * 400 + b',0.5]}]}'

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sized(body))

    async with raw_server(reply) as server:
        source = polygate.Source(name="a", base_url=server.url, api_key="sk-x")
        scope = polygate.Scope(sources=[source], retry=polygate.Retry(max_attempts=1))
        async with polygate.session(polygate.Settings(scopes={"embed": scope})) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.embed(["x"], scope="embed")
    (error,) = info.value.errors
    assert isinstance(error, polygate.TransientUpstreamError)
    assert "malformed embedding vector" in str(error)
    assert not [r for r in caplog.records if r.levelno >= 40], caplog.text


# --------------------------------------------------------------------- error codes


@pytest.mark.parametrize("status", [500, 200])  # an HTTP error; an error inside a 200 body
@pytest.mark.parametrize("field", ["code", "type"])
async def test_an_echoed_key_in_the_error_code_is_redacted(status: int, field: str) -> None:
    body = json.dumps({"error": {"message": "nope", field: SECRET}}).encode()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sized(body).replace(b"200 OK", b"%d X" % status, 1))

    async with raw_server(reply) as server:
        source = polygate.Source(name="a", base_url=server.url, api_key=SECRET, streaming=False)
        scope = polygate.Scope(sources=[source], retry=polygate.Retry(max_attempts=1))
        async with polygate.session(polygate.Settings(scopes={"chat": scope})) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
    (error,) = info.value.errors
    assert error.code is not None, "the code is kept, redacted"
    assert SECRET not in error.code and SECRET[:12] not in repr(error)


# --------------------------------------------------------------------- choice indexes


#: Present indexes that are no natural number: each was read as choice 0 (or, for a
#: negative one, sorted before it), splicing another choice's text into the answer.
NOT_AN_INDEX = [-1, -(10**30), True, False, 1.0, 0.0, "1", "0", None, {"i": 1}, [0]]


@pytest.mark.parametrize("index", NOT_AN_INDEX)
def test_a_choice_index_that_is_no_natural_number_is_a_malformed_stream(index: object) -> None:
    from polygate.transport import ChatAssembler, has_content

    # add() is total (the shared review's fuzz test: any chunk folds in): the bad index
    # is noted, never folded, and the exchange ends the attempt on it (the end-to-end
    # tests below: AllSourcesExhausted, "choice index").
    assembler = ChatAssembler(source="a")
    assembler.add({"choices": [{"index": 0, "delta": {"content": "GOOD"}}]})
    chunk = {"choices": [{"index": index, "delta": {"content": "EVIL"}}]}
    assert assembler.add(chunk) is has_content(chunk) is True  # content, as has_content says
    assert assembler.malformed is not None and "choice index" in assembler.malformed
    assert [c["message"]["content"] for c in assembler.build()["choices"]] == ["GOOD"]


def test_choice_indexes_in_range_still_assemble_in_order() -> None:
    from polygate.transport import ChatAssembler

    assembler = ChatAssembler()
    assembler.add({"choices": [{"index": 1, "delta": {"content": "one"}}]})
    assembler.add({"choices": [{"index": 0, "delta": {"content": "zero"}}, {"index": 127, "delta": {"content": "x"}}]})
    assembler.add({"choices": [{"index": 10**30}]})  # carries nothing: ignored, whatever its index
    assembler.add({"choices": [{"delta": {"content": "!"}}]})  # no index: the first choice
    choices = assembler.build()["choices"]
    assert [c["message"]["content"] for c in choices] == ["zero!", "one", "x"]


def _index_sse(index: object) -> bytes:
    """A stream whose second chunk is choice ``index`` ("EVIL"), around choice 0."""
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "GOOD"}}]},
        {"choices": [{"index": index, "delta": {"content": "EVIL"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("index", [-1, 1.0, 0.0, "1", None])
async def test_a_streamed_choice_index_that_is_no_natural_number_cannot_join_the_answer(
    index: object,
) -> None:
    await _refused_as_bad_index(_answers_sse(_index_sse(index)), index, streaming=True)


@pytest.mark.parametrize("index", [-1, 1.0, "1", None])
async def test_a_choice_index_that_is_no_natural_number_in_a_json_body_is_malformed(
    index: object,
) -> None:
    body = json.dumps({"choices": [
        {"index": index, "message": {"role": "assistant", "content": "EVIL"}, "finish_reason": "stop"},
        {"index": 0, "message": {"role": "assistant", "content": "GOOD"}, "finish_reason": "stop"},
    ]}).encode()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sized(body))

    await _refused_as_bad_index(reply, index, streaming=False)


@pytest.mark.parametrize("shape", ["stream", "stream-extras", "json"])
@pytest.mark.parametrize("index", [128, 60_000])
async def test_a_choice_index_over_the_cap_on_choices_is_malformed(shape: str, index: int) -> None:
    """Outside review: the cap on choices counted distinct choices only, so one chunk of
    choice 60000 was an answer, and the gateway's relay gave it a role chunk for every
    index below (seconds of its event loop, megabytes to the client).  Indexes run from
    0 to n - 1: one at or over the cap says more choices than an answer may hold."""
    if shape == "json":
        body = json.dumps({"choices": [
            {"index": 0, "message": {"role": "assistant", "content": "GOOD"}, "finish_reason": "stop"},
            {"index": index, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"},
        ]}).encode()

        async def reply(stream: trio.SocketStream, head: bytes) -> None:
            await stream.send_all(_sized(body))
    else:
        events = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "GOOD"}}]},
            {"choices": [{"index": index, "delta": {"content": "EVIL"} if shape == "stream" else {},
                          "content_filter_results": {"hate": {"filtered": False}}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
        reply = _answers_sse(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                             + b"data: [DONE]\n\n")
    async with raw_server(reply) as server:
        source = polygate.Source(name="a", base_url=server.url, api_key="sk-x",
                                 streaming=shape != "json")
        scope = polygate.Scope(sources=[source], retry=polygate.Retry(max_attempts=1))
        async with polygate.session(polygate.Settings(scopes={"chat": scope})) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
    (error,) = info.value.errors
    assert isinstance(error, polygate.TransientUpstreamError), error
    assert f"choice index {index}, over the 128 choices one answer may hold" in str(error)


async def test_a_json_body_listing_choice_1_first_answers_with_choice_0() -> None:
    """A JSON body whose choices are not in index order: the answer is choice 0, as an
    assembled stream's is (the first listed was taken, so index 1 answered)."""
    body = json.dumps({"choices": [
        {"index": 1, "message": {"role": "assistant", "content": "SECOND"}, "finish_reason": "stop"},
        {"index": 0, "message": {"role": "assistant", "content": "FIRST"}, "finish_reason": "length"},
    ]}).encode()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sized(body))

    async with raw_server(reply) as server:
        source = polygate.Source(name="a", base_url=server.url, api_key="sk-x", streaming=False)
        async with polygate.session(polygate.Settings(scopes={"chat": polygate.Scope(sources=[source])})) as s:
            response = await s.chat(MESSAGES)
    assert (response.text, response.finish_reason) == ("FIRST", "length")
    assert [c["index"] for c in response.choices] == [0, 1]


async def _refused_as_bad_index(reply: Any, index: object, *, streaming: bool) -> None:
    """One attempt against ``reply``: it fails as a malformed answer (choice ``index``)."""
    async with raw_server(reply) as server:
        source = polygate.Source(name="a", base_url=server.url, api_key="sk-x", streaming=streaming)
        scope = polygate.Scope(sources=[source], retry=polygate.Retry(max_attempts=1))
        async with polygate.session(polygate.Settings(scopes={"chat": scope})) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
    (error,) = info.value.errors
    shown = "null" if index is None else repr(index)
    assert isinstance(error, polygate.TransientUpstreamError), error
    assert f"choice index {shown} (not a natural number)" in str(error)


async def test_a_committed_stream_never_shows_a_choice_index_read_as_0() -> None:
    """``0.0 == 0`` in Python: the stream's first-choice pick showed choice 0.0's text
    to the caller as the answer's.  The attempt now fails at that chunk, and the
    caller has seen choice 0 only."""
    shown: list[str] = []
    async with raw_server(_answers_sse(_index_sse(0.0))) as server:
        scope = polygate.Scope(sources=[polygate.Source(name="a", base_url=server.url)],
                               retry=polygate.Retry(max_attempts=1))
        async with polygate.session(polygate.Settings(scopes={"chat": scope})) as s:
            with pytest.raises(polygate.PolygateError, match=r"choice index 0\.0"):
                async with s.stream_chat(MESSAGES) as stream:
                    async for chunk in stream:
                        shown.append(chunk.text)
    assert shown == ["GOOD"]


async def test_the_streams_first_choice_is_index_0_by_the_one_rule() -> None:
    """The stream's pick of choice 0 in a chunk (the exchange refuses a bad index
    before it offers a chunk; the pick holds on its own): false and 0.0 are not 0."""
    from polygate._session import _Sink

    send, receive = trio.open_memory_channel[Any](8)
    sink = _Sink(send, [])
    for bad in (False, 0.0, "0", None):
        sink.offer({"choices": [{"index": bad, "delta": {"content": "EVIL"}},
                                {"index": 0, "delta": {"content": "GOOD"}}]})
    sink.offer({"choices": [{"delta": {"content": "!"}}]})  # no index: choice 0
    assert [receive.receive_nowait().text for _ in range(5)] == ["GOOD"] * 4 + ["!"]


# --------------------------------------------------------------------- usage


@pytest.mark.parametrize(("wire", "expected"), [
    ({"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 99_999_999}, (5, 5, 10)),
    ({"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 3}, (5, 5, 10)),
    ({"prompt_tokens": 5, "total_tokens": 99_999_999}, (5, 0, 5)),  # embeddings: no completion
    ({"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}, (5, 5, 10)),
    ({"prompt_tokens": 5, "completion_tokens": 5}, (5, 5, 10)),
    ({"total_tokens": 42}, (0, 0, 42)),  # only a total: nothing to check it against
    # 10.0 is the number 10 in JSON: an outside review (2026-12-05) found a usage
    # written with whole floats refused, the call settled at its estimate.
    ({"prompt_tokens": 10.0, "completion_tokens": 2.0, "total_tokens": 12.0}, (10, 2, 12)),
    ({"total_tokens": 42.0}, (0, 0, 42)),
])
def test_the_total_is_the_sum_of_the_reported_parts(
    wire: dict[str, int], expected: tuple[int, int, int]
) -> None:
    usage = polygate.Usage.from_wire(wire)
    assert usage is not None and usage.source == "upstream"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == expected


@pytest.mark.parametrize("wire", [
    {}, {"total_tokens": "12"}, {"total_tokens": -5}, {"total_tokens": 1e300},
    {"total_tokens": None}, {"total_tokens": True}, {"total_tokens": 1.5},
    {"total_tokens": float("nan")}, {"total_tokens": float("inf")}, {"prompt_tokens": 2.5},
    {"prompt_tokens": -1.0},
])
def test_a_usage_with_no_believable_number_is_no_usage(wire: dict[str, Any]) -> None:
    """Review: an object with no number, or only a total that is no count, read as 0
    tokens *reported by the upstream*: TPM windows settled 0 (an embedding upstream
    escaped its quota) and the gateway showed clients ``usage`` 0 (docs/serve.md: an
    answer whose numbers were refused has no usage)."""
    assert polygate.Usage.from_wire(wire) is None


async def test_an_embedding_whose_usage_is_no_count_is_estimated_and_reserved() -> None:
    """The same through a call: the estimate stands, and the TPM window keeps it."""
    def handle(request: httpx.Request) -> httpx.Response:
        inputs = json.loads(request.content)["input"]
        return httpx.Response(200, json={"object": "list", "model": "emb", "usage": {
            "total_tokens": "1000"}, "data": [
            {"object": "embedding", "index": i, "embedding": [0.5, 0.25]} for i in range(len(inputs))]})

    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="e", base_url="http://e/v1", model="emb", tpm=1_000_000)])})
    async with polygate.session(settings, transport=httpx.MockTransport(handle)) as s:
        r = await s.embed(["hello world, a longer text"])
        snapshot = (await s.statistics()).governance.sources[0].state
    assert r.usage is not None and r.usage.source == "estimated" and r.usage.total_tokens > 0
    assert snapshot.tokens_in_window == r.usage.total_tokens


async def test_an_inflated_total_does_not_lock_the_token_quota() -> None:
    body = json.dumps({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 99_999_999},
    }).encode()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sized(body))

    async with raw_server(reply) as server:
        source = polygate.Source(name="a", base_url=server.url, api_key="sk-x", streaming=False,
                                 tpm=1_000_000)
        scope = polygate.Scope(sources=[source], retry=polygate.Retry(max_attempts=1))
        async with polygate.session(polygate.Settings(scopes={"chat": scope})) as s:
            first = await s.chat(MESSAGES)
            state = (await s.statistics()).governance.sources[0].state
            await s.chat(MESSAGES)  # admitted: the window holds 10 tokens, not 99,999,999
    assert first.usage.total_tokens == 10
    assert state.tokens_in_window == 10


@pytest.mark.parametrize(("status", "body"), [
    (b"200 OK", b'{"choices":[{"index":0,"message":{"role":"assistant","content":"a\xed\xa0\x80b"},'
                b'"finish_reason":"stop"}]}'),  # the raw UTF-8-shaped bytes of U+D800
    (b"400 Bad Request", b'{"error":{"message":"bad \\udc00 input","code":"x\\ud800"}}'),
])
async def test_lone_surrogates_in_a_json_body_or_an_error_read_as_text(status: bytes, body: bytes) -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n" % len(body) + body)

    async with raw_server(reply) as server:
        async with polygate.session(_one_source(server, streaming=False)) as s:
            if status.startswith(b"200"):
                assert (await s.chat(MESSAGES)).text == "a\ufffdb"
                return
            with pytest.raises(polygate.FatalUpstreamError) as info:
                await s.chat(MESSAGES)
    assert "bad \ufffd input" in str(info.value)
    assert info.value.code == "x\ufffd"


@pytest.mark.parametrize("done", [b"data: [DONE] \n\n", b"data:  [DONE]\n\n"])
async def test_a_done_with_spaces_ends_the_stream(done: bytes) -> None:
    """openai-python accepts '[DONE]' with spaces around it; so does polygate (it read
    it as JSON and threw the finished answer away)."""
    body = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
            + done)

    async with raw_server(_answers_sse(body)) as server, polygate.session(_one_source(server)) as s:
        response = await s.chat(MESSAGES)
    assert response.text == "hi" and len(server.requests) == 1


# --------------------------------------------------------------------- stream labels


def _labelled(ctype: bytes | None, body: bytes) -> Any:
    """A raw server's reply: 200, ``body`` under content-type ``ctype`` (or none)."""
    label = b"" if ctype is None else b"content-type: " + ctype + b"\r\n"

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\n" + label
                              + b"content-length: %d\r\n\r\n" % len(body) + body)

    return reply


@pytest.mark.parametrize("ctype", [
    None, b"text/event-stream; charset=utf-8", b"text/event-stream;charset=UTF-8",
    b"Text/Event-Stream", b"application/x-ndjson", b"application/json", b"text/plain",
])
async def test_an_answer_to_a_stream_request_that_starts_as_sse_is_read_as_sse(
    ctype: bytes | None,
) -> None:
    """openai-python reads a stream request's answer as SSE whatever its label; an
    unlabelled or mislabelled stream failed here as 'not JSON' (and was paid for
    again on every retry)."""
    async with raw_server(_labelled(ctype, OK_EVENTS)) as server:
        async with polygate.session(_one_source(server)) as s:
            response = await s.chat(MESSAGES)
            async with s.stream_chat(MESSAGES) as stream:
                texts = [chunk.text async for chunk in stream]
    assert (response.text, texts, len(server.requests)) == ("hi", ["hi"], 2)
    assert response.call_stats.ttft_ms is not None  # read as a stream, timed as one


@pytest.mark.parametrize("ctype", [None, b"application/json", b"application/json; charset=utf-8",
                                   b"text/plain"])
async def test_a_json_body_to_a_stream_request_is_still_read_as_json(ctype: bytes | None) -> None:
    """An upstream that ignored ``stream`` (a whole answer), or an error object inside
    a 200: read as JSON, labelled or not, as before."""
    answer = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"},
                                      "finish_reason": "stop"}]}).encode()
    error = json.dumps({"error": {"message": "bad request", "code": 400}}).encode()
    async with raw_server(_labelled(ctype, answer)) as server:
        async with polygate.session(_one_source(server)) as s:
            response = await s.chat(MESSAGES)
    assert response.text == "whole" and response.call_stats.ttft_ms is None
    async with raw_server(_labelled(ctype, b"\n " + error)) as server:
        async with polygate.session(_one_source(server)) as s:
            with pytest.raises(polygate.FatalUpstreamError, match="bad request"):
                await s.chat(MESSAGES)


async def test_an_unlabelled_body_is_told_apart_across_small_pieces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The body decides by its first bytes past blank lines, however they are cut; a
    body that is neither SSE nor JSON is a malformed one, as before."""
    def upstream(pieces: list[bytes]) -> httpx.MockTransport:
        async def body() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        return httpx.MockTransport(lambda request: httpx.Response(200, content=body()))

    source = polygate.Source(name="a", base_url="http://a/v1", api_key="sk-x")
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[source], retry=polygate.Retry(max_attempts=1))})
    sse = [b"\r", b"\n\n", b"  ", b"da", b"ta", b": " + OK_EVENTS[6:]]
    async with polygate.session(settings, transport=upstream(sse)) as s:
        assert (await s.chat(MESSAGES)).text == "hi"
    async with polygate.session(settings, transport=upstream([b"\n", b"<html>", b"</html>"])) as s:
        with pytest.raises(polygate.AllSourcesExhausted, match="not JSON"):
            await s.chat(MESSAGES)


@pytest.mark.parametrize(("done", "ends"), [
    (b"data: [DONE] trailing\n\n", True), (b"data: [done]\n\n", False), (b"data: [Done]\n\n", False),
])
async def test_done_is_read_as_openai_python_reads_it(done: bytes, ends: bool) -> None:
    """openai-python ends a stream on data that starts with '[DONE]' and reads any
    other data as JSON: '[done]' is no end but a malformed event there (a
    JSONDecodeError) and here."""
    body = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
            + done)
    async with raw_server(_labelled(b"text/event-stream", body)) as server:
        async with polygate.session(_one_source(server)) as s:
            if ends:
                assert (await s.chat(MESSAGES)).text == "hi"
                return
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
    assert all("malformed" in str(e) for e in info.value.errors), info.value.errors


_FINISHED = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"hello"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n',
]


@pytest.mark.parametrize("cut", ["no chunked terminator", "short content-length", "cut before finish"])
@pytest.mark.parametrize("api", ["chat", "stream_chat"])
async def test_a_finished_stream_cut_before_done_is_complete(cut: str, api: str) -> None:
    """SPEC §3: a stream with its finish_reason but no [DONE] is complete.  A probe found
    it thrown away (and paid for again) when the connection then broke mid-frame: a
    chunked body without its terminator, or shorter than its Content-Length.  Cut
    before the finish_reason, it is still truncated."""
    events = _FINISHED if cut != "cut before finish" else _FINISHED[:1]

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        if cut == "short content-length":
            body = b"".join(events)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                  b"content-length: %d\r\n\r\n" % (len(body) + 100) + body)
        else:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                  b"transfer-encoding: chunked\r\n\r\n"
                                  + b"".join(b"%x\r\n" % len(e) + e + b"\r\n" for e in events))
        await stream.aclose()

    async with raw_server(reply) as server:
        settings = _one_source(server)
        settings = attrs.evolve(settings, scopes={"chat": attrs.evolve(
            settings.scopes["chat"], retry=polygate.Retry(max_attempts=1))})
        async with polygate.session(settings) as s:
            if cut == "cut before finish":
                with pytest.raises((polygate.AllSourcesExhausted, polygate.TransientUpstreamError)):
                    await _answer(s, api)
                return
            response = await _answer(s, api)
    assert (response.text, response.finish_reason) == ("hello", "stop")
    assert response.usage is not None and response.usage.total_tokens == 4


async def _answer(s: polygate.Session, api: str) -> polygate.ChatResponse:
    if api == "chat":
        return await s.chat(MESSAGES)
    async with s.stream_chat(MESSAGES) as stream:
        async for _ in stream:
            pass
    assert stream.response is not None
    return stream.response


async def test_a_stream_of_typed_content_parts_is_assembled() -> None:
    """Mistral's magistral models stream ``delta.content`` as a list of typed parts
    (thinking, then text), as their non-streamed message has it.  A probe found the
    text dropped (``""``), no content token seen (no ttft; the watchdog would kill a
    source that is answering), and stream_chat() yielding nothing."""

    def part(kind: str, text: str) -> bytes:
        content = ([{"type": "thinking", "thinking": [{"type": "text", "text": text}]}]
                   if kind == "thinking" else [{"type": "text", "text": text}])
        return b"data: " + json.dumps(
            {"choices": [{"index": 0, "delta": {"content": content}}]}).encode() + b"\n\n"

    body = (part("thinking", "Let me think. ") + part("text", "Hello") + part("text", " world")
            + b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
            + b"data: [DONE]\n\n")
    async with raw_server(_answers_sse(body)) as server, polygate.session(_one_source(server)) as s:
        answer = await s.chat(MESSAGES)
        async with s.stream_chat(MESSAGES) as stream:
            texts = [chunk.text async for chunk in stream]
    assert answer.text == "Hello world" == answer.message["content"]
    assert answer.message.get("reasoning_content") == "Let me think. "
    assert answer.call_stats.ttft_ms is not None
    assert "".join(texts) == "Hello world"


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
    {"role": "assistant", "content": "", "reasoning": "thinking..."},
])
async def test_a_json_answer_with_only_a_function_call_or_reasoning_is_one_chunk(
    message: dict[str, Any],
) -> None:
    """stream_chat() over an upstream that answers JSON yields the whole answer as one
    chunk; a probe found none for these two content tokens (docs/concepts.md)."""
    body = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": message, "finish_reason": "stop"}]}).encode()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sized(body))

    async with raw_server(reply) as server, polygate.session(_one_source(server)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            chunks = [chunk async for chunk in stream]
    assert len(chunks) == 1
    assert stream.response is not None


@pytest.mark.parametrize("shape", ["json", "sse"])
async def test_a_429_inside_a_200_keeps_the_responses_retry_after(shape: str) -> None:
    """An error with code 429 inside a 200 (a JSON body, an SSE error event) is the
    429 it says; a probe found the response's Retry-After ignored (1 s, not 30 s)."""
    error = {"error": {"message": "slow down", "type": "rate_limit_error", "code": 429}}
    if shape == "json":
        body, ctype = json.dumps(error).encode(), b"application/json"
    else:
        body, ctype = b"data: " + json.dumps(error).encode() + b"\n\n", b"text/event-stream"

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\nretry-after: 30\r\n"
                              b"content-length: %d\r\n\r\n" % len(body) + body)

    async with raw_server(reply) as server:
        settings = _one_source(server, streaming=shape == "sse")
        settings = attrs.evolve(settings, scopes={"chat": attrs.evolve(
            settings.scopes["chat"], retry=polygate.Retry(max_attempts=1), call_deadline_s=5)})
        async with polygate.session(settings) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
    (error_,) = info.value.errors
    assert isinstance(error_, polygate.RateLimitedError)
    assert error_.retry_after_s == 30.0
