"""Hostile bytes through the gateway server: a client request that is valid JSON but
not valid Unicode text, and upstream answers the library accepted (or cleaned) that
the server must not relay raw -- lone surrogates, out-of-range usage, non-string
content, non-finite floats.  Each ends in a clean answer or a clean error: never a
500 with a traceback, a torn stream, or a body that is not strict JSON."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio

import polygate
import polygate.testing
from polygate.serve import open_server

from ._raw_server import answering, raw_server, sized
from ._serve_kit import AUTH, GATEWAY_KEY, http, raw_gateway

pytestmark = pytest.mark.integration

HEADERS = {**AUTH, "content-type": "application/json"}


def _strict(body: bytes) -> Any:
    """The body as JSON, refusing NaN/Infinity tokens and invalid UTF-8 as a strict
    client (a browser's JSON.parse, serde_json) would."""

    def refuse(token: str) -> Any:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(body.decode("utf-8"), parse_constant=refuse)


def _events(body: bytes) -> list[Any]:
    out: list[Any] = []
    for frame in body.split(b"\n\n"):
        if frame.startswith(b"data: ") and frame != b"data: [DONE]":
            out.append(_strict(frame[len(b"data: "):]))
    return out


def _sse(*events: bytes) -> bytes:
    return sized(b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n",
                  b"text/event-stream")


async def _against(
    json_body: bytes, sse_body: bytes, *requests: tuple[str, Any]
) -> list[tuple[int, bytes]]:
    """Send ``requests`` to a gateway whose upstream answers raw bytes, as a hostile
    upstream sends them: model ``chat`` is a streaming source answered ``sse_body``
    (a JSON answer is then assembled from it), model ``whole`` and ``embed`` a
    non-streaming one answered ``json_body``."""

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        path = head.split(b" ")[1]
        await stream.send_all(sse_body if path.startswith(b"/sse/") else sized(json_body))

    async with raw_server(reply) as server:
        def source(kind: str, model: str) -> polygate.Source:
            return polygate.Source(name=kind, base_url=f"http://127.0.0.1:{server.port}/{kind}/v1",
                                   model=model, streaming=kind == "sse")

        settings = polygate.Settings(
            scopes={name: polygate.Scope(sources=[source(kind, name)], retry=polygate.Retry(max_attempts=1))
                    for name, kind in (("chat", "sse"), ("whole", "json"), ("embed", "json"))},
            serve=polygate.Serve(api_keys=[GATEWAY_KEY]),
        )
        async with open_server(settings, port=0) as gw:
            out = []
            for path, body in requests:
                answer = await http(gw, "POST", path, body, HEADERS)
                out.append((answer.status, answer.body))
            return out


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


GOOD = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
GOOD_SSE = _sse(b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}')


# --------------------------------------------------------------------------- lone surrogates


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", b'{"model":"chat","messages":[{"role":"user","content":"a\\ud800b"}]}'),
    ("/v1/chat/completions",
     b'{"model":"chat","stream":true,"messages":[{"role":"user","content":"a\\udfffb"}]}'),
    ("/v1/embeddings", b'{"model":"embed","input":["a\\uD800b"]}'),
    ("/v1/chat/completions", b'{"model":"chat","messages":[],"\\ud800":1}'),  # in a key
    # Not an escape: UTF-8-shaped bytes of a surrogate, which json.loads decodes
    # with surrogatepass.
    ("/v1/chat/completions",
     b'{"model":"chat","messages":[{"role":"user","content":"a\xed\xa0\x80b"}]}'),
])
async def test_client_lone_surrogate_is_a_400(
    path: str, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """JSON that parses but holds a lone surrogate escape is not Unicode text: a 400
    naming the problem, before any upstream work."""
    (status, answer), = await _against(GOOD, GOOD_SSE, (path, body))
    assert status == 400, answer
    error = _strict(answer)["error"]
    assert error["code"] == "invalid_json"
    assert "surrogate" in error["message"]
    _no_traceback(caplog)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


@pytest.mark.parametrize("body", [
    # In a parameter, in a message, as the model: every depth from well past the
    # limit to just under Python's recursion limit (a 500 there, found by a probe).
    b'{"model":"chat","messages":[{"role":"user","content":"x"}],"p":%s}' % _nested(300),
    b'{"model":"chat","messages":[{"role":"user","content":"x"}],"p":%s}' % _nested(984),
    b'{"model":"chat","messages":[{"role":"user","content":"x","extra":%s}]}' % _nested(985),
    b'{"model":%s,"messages":[{"role":"user","content":"x"}]}' % _nested(985),
    b'{"model":"embed","input":["x"],"p":%s}' % _nested(990),
    b'{"model":"chat","messages":[{"role":"user","content":"x"}],"p":%s}' % _nested(5000),
])
async def test_a_request_nested_too_deeply_is_a_400(body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """A body nested deeper than 256 levels is refused as invalid JSON before it is
    read: just under the interpreter's recursion limit it parsed, and the next walk of
    it (the arguments' check, the model's name in an error) raised a 500."""
    path = "/v1/embeddings" if b'"embed"' in body else "/v1/chat/completions"
    (status, answer), = await _against(GOOD, GOOD_SSE, (path, body))
    assert status == 400, answer
    error = _strict(answer)["error"]
    assert error["code"] == "invalid_json" and "256" in error["message"]
    _no_traceback(caplog)


async def test_a_request_nested_at_the_limit_is_read() -> None:
    body = b'{"model":"chat","messages":[{"role":"user","content":"x"}],"p":%s}' % _nested(250)
    (status, answer), = await _against(GOOD, GOOD_SSE, ("/v1/chat/completions", body))
    assert status == 200, answer


async def test_client_surrogate_pair_is_text() -> None:
    """A proper pair (an emoji, escaped) is valid text and goes through."""
    body = b'{"model":"chat","messages":[{"role":"user","content":"\\ud83d\\ude00"}]}'
    (status, answer), = await _against(GOOD, GOOD_SSE, ("/v1/chat/completions", body))
    assert status == 200, answer


SURROGATE_JSON = (b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,'
                  b'"message":{"role":"assistant","content":"bad \\ud800 surrogate"},'
                  b'"finish_reason":"stop"}]}')
SURROGATE_SSE = _sse(b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"bad \\ud800"}}]}',
                     b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":" end"}}]}')


@pytest.mark.parametrize(("model", "text"), [("whole", "bad \ufffd surrogate"), ("chat", "bad \ufffd end")])
async def test_upstream_lone_surrogate_json_answer(
    model: str, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An upstream answer holding a lone surrogate (a whole body, or a stream the
    library assembled): a 200 in valid UTF-8, the surrogate replaced by U+FFFD --
    not a 500."""
    request = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    (status, answer), = await _against(SURROGATE_JSON, SURROGATE_SSE, ("/v1/chat/completions", request))
    assert status == 200, answer
    assert _strict(answer)["choices"][0]["message"]["content"] == text
    _no_traceback(caplog)


async def test_upstream_lone_surrogate_stream(caplog: pytest.LogCaptureFixture) -> None:
    """The same in a stream: every event valid UTF-8, the stream whole to [DONE]."""
    request = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    (status, answer), = await _against(GOOD, SURROGATE_SSE, ("/v1/chat/completions", request))
    assert status == 200, answer
    assert answer.endswith(b"data: [DONE]\n\n")
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in _events(answer) if c.get("choices"))
    assert text == "bad \ufffd end"
    _no_traceback(caplog)


# --------------------------------------------------------------------------- what the library cleaned

CHAT_REQUEST = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
WHOLE_REQUEST = {**CHAT_REQUEST, "model": "whole"}
STREAM_REQUEST = {**CHAT_REQUEST, "stream": True, "stream_options": {"include_usage": True}}
#: One answer each way: a whole upstream body, one assembled from a stream, a stream.
THREE = (("/v1/chat/completions", WHOLE_REQUEST), ("/v1/chat/completions", CHAT_REQUEST),
         ("/v1/chat/completions", STREAM_REQUEST))


def _answer(usage: Any, content: Any = "GOOD") -> bytes:
    return json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": usage, "system_fingerprint": "fp_1"}).encode()


def _usage_sse(usage: Any) -> bytes:
    return _sse(b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"GOOD"}}]}',
                b'{"id":"x","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
                json.dumps({"id": "x", "model": "m", "choices": [], "usage": usage}).encode())


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 1e300, "completion_tokens": 1e300, "total_tokens": 1e300},
    {"prompt_tokens": -5, "completion_tokens": 2, "total_tokens": -3},
    {"prompt_tokens": "3", "completion_tokens": "x"},
])
async def test_refused_upstream_usage_is_not_relayed(usage: Any) -> None:
    """Usage the library refused as not believable is not a count: the JSON answer
    has none and the stream's usage chunk says null (docs/serve.md), never the raw
    numbers -- the rest of the body still goes through."""
    (status, body), (a_status, a_body), (s_status, s_body) = await _against(
        _answer(usage), _usage_sse(usage), *THREE)
    assert (status, a_status, s_status) == (200, 200, 200), (body, a_body, s_body)
    whole = _strict(body)
    assert whole.get("usage") is None
    assert whole["system_fingerprint"] == "fp_1"  # provider extras pass through
    assert whole["choices"][0]["message"]["content"] == "GOOD"
    assert _strict(a_body).get("usage") is None
    events = _events(s_body)
    assert events[-1]["choices"] == [] and events[-1]["usage"] is None


async def test_reported_usage_keeps_its_extras_and_validated_counts() -> None:
    """Believable usage goes out as the library read it, with the provider's extra
    fields (``prompt_tokens_details``) kept; an inconsistent total is the library's."""
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 3}}
    (status, body), (_, a_body), (_, s_body) = await _against(
        _answer(usage), _usage_sse(usage), *THREE)
    assert status == 200
    assert _strict(body)["usage"] == usage
    assert _strict(a_body)["usage"] == usage
    assert _events(s_body)[-1]["usage"] == usage


@pytest.mark.parametrize("content", [42, [{"type": "text", "text": "hi"}], {"a": 1}])
async def test_non_string_content_goes_out_as_a_string(content: Any) -> None:
    """Content that is not a string (the library reads it as no text) is blank in the
    JSON answer and in every streamed delta: an SDK concatenating deltas must not
    meet an int or a list."""
    raw = json.dumps(content).encode()
    sse = _sse(b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":' + raw + b'}}]}',
               b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"ok"}}]}')
    (status, body), (a_status, a_body), (s_status, s_body) = await _against(
        _answer({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, content), sse,
        *THREE)
    assert (status, a_status, s_status) == (200, 200, 200), (body, a_body, s_body)
    # Typed parts are text (Mistral streams them; the library reads their text parts),
    # a number or an object none.
    text = "hi" if isinstance(content, list) else ""
    assert _strict(body)["choices"][0]["message"]["content"] == text
    assert _strict(a_body)["choices"][0]["message"]["content"] == text + "ok"
    deltas = [c["choices"][0]["delta"] for c in _events(s_body) if c.get("choices")]
    assert all(isinstance(d.get("content", ""), str) for d in deltas), deltas
    assert "".join(d.get("content") or "" for d in deltas) == text + "ok"


# --------------------------------------------------------------------------- non-finite floats


async def test_non_finite_extras_in_a_chat_answer_are_a_clean_502(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``NaN`` in an answer's extras (Python's json accepts it; JSON has no such
    token): a strict-JSON 502, never a body a strict client cannot parse."""
    nan = (b'{"choices":[{"index":0,"message":{"role":"assistant","content":"GOOD"},'
           b'"finish_reason":"stop","logprobs":{"x":NaN,"y":1e400}}],"model":"m"}')
    (status, body), = await _against(nan, GOOD_SSE, ("/v1/chat/completions", WHOLE_REQUEST))
    assert status == 502, body
    assert _strict(body)["error"]["code"] == "upstream_error"
    _no_traceback(caplog)


async def test_non_finite_floats_in_a_streamed_chunk_end_it_with_an_error_event() -> None:
    sse = _sse(b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}',
               b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"b"}}]}',
               b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"c"}}]}',
               b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"d"},'
               b'"logprobs":{"x":NaN}}]}')
    (status, body), = await _against(GOOD, sse, ("/v1/chat/completions", STREAM_REQUEST))
    assert status == 200
    events = _events(body)  # every event strict JSON
    assert events[-1]["error"]["code"] == "upstream_error"
    # The chunks before it (sent in one write with it: one burst) still go out first
    # (a review found the whole burst dropped).
    assert "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", [])) == "abc"


@pytest.mark.parametrize("encoding", ["float", "base64"])
async def test_non_finite_embeddings_never_make_invalid_json(encoding: str) -> None:
    """Vectors holding NaN/Infinity (base64 floats decode to them): the body is
    strict JSON either way.  The library refuses such vectors as malformed (the
    attempt fails, the sources are exhausted): a 502, never a bare NaN token."""
    vectors = json.dumps({"object": "list", "model": "emb", "data": [
        {"object": "embedding", "index": 0, "embedding": "AADAfwAAgH8="}],
        "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()
    request = {"model": "embed", "input": ["a"], "encoding_format": encoding}
    (status, body), = await _against(vectors, GOOD_SSE, ("/v1/embeddings", request))
    answer = _strict(body)
    assert status == 502, body
    assert answer["error"]["code"] in ("sources_exhausted", "upstream_error")


async def test_a_float_beyond_float32_is_no_infinity_in_a_base64_answer() -> None:
    """Review: a finite float too large for 32 bits (1e39, from an upstream that
    ignored encoding_format) packed silently to infinity in the base64 answer: the
    gateway said a number nobody sent.  A 502 upstream_error, as for a NaN."""
    vectors = json.dumps({"object": "list", "model": "emb", "data": [
        {"object": "embedding", "index": 0, "embedding": [0.5, 1e39]}],
        "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()
    request = {"model": "embed", "input": ["a"], "encoding_format": "base64"}
    (status, body), = await _against(vectors, GOOD_SSE, ("/v1/embeddings", request))
    assert status == 502, body
    assert _strict(body)["error"]["code"] == "upstream_error"
    request = {"model": "embed", "input": ["a"], "encoding_format": "float"}
    (status, body), = await _against(vectors, GOOD_SSE, ("/v1/embeddings", request))
    assert status == 200 and _strict(body)["data"][0]["embedding"] == [0.5, 1e39]



@pytest.mark.parametrize("reason", [42, ["stop"], {"a": 1}, True])
async def test_non_string_finish_reason_goes_out_as_a_string(reason: Any) -> None:
    """A ``finish_reason`` that is not a string (the library reads it as none) never
    reaches the client as it came: the JSON answer says ``"stop"``, and a streamed
    chunk carries ``null`` until the stream's own finish chunk says ``"stop"`` -- an SDK
    typing it as a string enum must not meet an int or a list."""
    raw = json.dumps(reason).encode()
    whole = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": reason}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
    sse = _sse(b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"hi"},'
               b'"finish_reason":' + raw + b'}]}')
    (status, body), (a_status, a_body), (s_status, s_body) = await _against(whole, sse, *THREE)
    assert (status, a_status, s_status) == (200, 200, 200), (body, a_body, s_body)
    assert _strict(body)["choices"][0]["finish_reason"] == "stop"
    assert _strict(a_body)["choices"][0]["finish_reason"] == "stop"
    reasons = [c["choices"][0].get("finish_reason") for c in _events(s_body) if c.get("choices")]
    assert all(r is None or isinstance(r, str) for r in reasons), reasons
    assert reasons[-1] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in _events(s_body)
                   if c.get("choices")) == "hi"


@pytest.mark.parametrize("usage", [
    None, "absent", {"prompt_tokens": -5, "total_tokens": -5}, {"prompt_tokens": 1e300, "total_tokens": 1e300}])
async def test_embeddings_without_a_believable_usage_have_none(usage: Any) -> None:
    """As for chat (docs/serve.md, "Answers"): an embeddings answer whose upstream
    reported no usage, or numbers the library refused, has no ``usage`` -- the
    library's estimate is never passed off as a count."""
    body: dict[str, Any] = {"object": "list", "model": "emb", "data": [
        {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}]}
    if usage != "absent":
        body["usage"] = usage
    request = {"model": "embed", "input": ["a"]}
    (status, answer), = await _against(json.dumps(body).encode(), GOOD_SSE, ("/v1/embeddings", request))
    assert status == 200, answer
    parsed = _strict(answer)
    assert parsed["data"][0]["embedding"] == [0.5, 0.25]
    assert "usage" not in parsed, parsed


async def test_embeddings_relay_the_reported_usage() -> None:
    body = {"object": "list", "model": "emb", "data": [
        {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
        "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    request = {"model": "embed", "input": ["a"]}
    (status, answer), = await _against(json.dumps(body).encode(), GOOD_SSE, ("/v1/embeddings", request))
    assert status == 200, answer
    assert _strict(answer)["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


# --------------------------------------------------------------------------- choice indexes


@pytest.mark.parametrize("index", [b"1.0", b'"1"', b"null", b"false"])
async def test_a_choice_index_that_is_no_natural_number_is_never_relayed(index: bytes) -> None:
    """A streamed choice whose index is no natural number: the library refuses the
    stream (it was read as choice 0, its text spliced into the answer), so the
    assembled JSON answer is a 502 and a stream ends with an error event; the client
    never meets the index, nor the text."""
    sse = _sse(b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"GOOD"}}]}',
               b'{"id":"x","model":"m","choices":[{"index":' + index + b',"delta":{"content":"EVIL"}}]}',
               b'{"id":"x","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}')
    (a_status, a_body), (s_status, s_body) = await _against(
        GOOD, sse, ("/v1/chat/completions", CHAT_REQUEST), ("/v1/chat/completions", STREAM_REQUEST))
    assert a_status == 502, a_body
    assert b"EVIL" not in a_body
    assert s_status == 200 and b"EVIL" not in s_body
    events = _events(s_body)
    assert events[-1]["error"]["code"] == "upstream_error", events
    indexes = [c["index"] for e in events for c in e.get("choices") or []]
    assert indexes and all(type(i) is int and i >= 0 for i in indexes), indexes


async def test_every_choice_of_a_stream_gets_its_role_first() -> None:
    """Review finding: with n=2 only choice 0 was given a role chunk (the library
    forwards content, not the upstream's role-only chunks), so the OpenAI SDK's stream
    helper assembled choice 1 with role None.  Each choice's first event now carries
    its role, from a streaming source and from a non-streaming one alike."""
    two = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
        for i, t in ((0, "A"), (1, "B"))]}).encode()
    sse = _sse(
        b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}},'
        b'{"index":1,"delta":{"role":"assistant","content":""}}]}',
        b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"A"}}]}',
        b'{"id":"x","model":"m","choices":[{"index":1,"delta":{"content":"B"}}]}',
        b'{"id":"x","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"},'
        b'{"index":1,"delta":{},"finish_reason":"stop"}]}')
    request = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
    answers = await _against(two, sse, ("/v1/chat/completions", {**request, "model": "chat"}),
                             ("/v1/chat/completions", {**request, "model": "whole"}))
    for status, body in answers:
        assert status == 200, body
        first: dict[int, Any] = {}
        text: dict[int, str] = {0: "", 1: ""}
        for event in _events(body):
            for choice in event["choices"]:
                first.setdefault(choice["index"], choice["delta"])
                text[choice["index"]] += choice["delta"].get("content") or ""
        assert set(first) == {0, 1}
        assert all(delta.get("role") == "assistant" for delta in first.values()), first
        assert text == {0: "A", 1: "B"}, body


def test_the_relay_reshapes_a_chunk_with_an_index_that_is_no_natural_number() -> None:
    """The relay's own guard (the session refuses such a chunk before it gets here):
    a choice index of 1.0 or false is re-shaped as choice 0 from the chunk's delta,
    never relayed as it came, and never taken for choice 0's finish."""
    from polygate._types import StreamChunk
    from polygate.serve._sse import StreamShape

    shape = StreamShape()
    for bad in (1.0, False):
        raw = {"id": "x", "model": "m", "choices": [
            {"index": bad, "delta": {"content": "EVIL"}, "finish_reason": "stop"}]}
        out = shape.chunk(StreamChunk(text="", delta={"content": "GOOD"}, raw=raw))
        (event,) = [e for e in _events(out) if e["choices"][0]["delta"].get("content")]
        assert event["choices"] == [{"index": 0, "delta": {"content": "GOOD"}, "finish_reason": None}]
    assert shape._finished == set()


async def test_a_huge_choice_index_costs_the_gateway_nothing() -> None:
    """Outside review: one upstream chunk of choice 60000 held the gateway's event loop
    2.7 s (a role chunk for every index below it, in a list copied at each step) and
    sent the client 4.8 MB of empty choices.  The library refuses the index (over the
    cap on choices); the client gets a small error, at once."""
    import time

    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 60_000, "delta": {"role": "assistant", "content": "hi"},
                          "finish_reason": None}]}
    done = {**chunk, "choices": [{"index": 60_000, "delta": {}, "finish_reason": "stop"}]}
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (chunk, done))
    data += b"data: [DONE]\n\n"

    async with raw_gateway(answering(data), retry=polygate.Retry(max_attempts=1)) as (server, _):
        for stream in (False, True):
            started = time.monotonic()
            answer = await http(server, "POST", "/v1/chat/completions",
                                {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                 "stream": stream}, AUTH)
            assert time.monotonic() - started < 2
            assert answer.status == 502 and len(answer.body) < 2_000, (answer.status, answer.body[:200])
            assert b"over the 128 choices" in answer.body


@pytest.mark.parametrize("index", [7, 60_000])
async def test_a_choice_carrying_nothing_at_a_huge_index_is_not_relayed(index: int) -> None:
    """A choice that carries nothing is ignored by the library whatever its index; one
    riding along a content chunk is not relayed (a client looks choices up by index),
    and costs the relay nothing (before: a role chunk for each of 60,000 indexes; and
    under the cap, review: choices 1-7 made up with roles, never to finish)."""
    import time

    events = [
        {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}, {"index": index}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    async with raw_gateway(answering(data)) as (server, _):
        started = time.monotonic()
        answer = await http(server, "POST", "/v1/chat/completions",
                            {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                             "stream": True}, AUTH)
        assert time.monotonic() - started < 2
    assert answer.status == 200 and len(answer.body) < 2_000, len(answer.body)
    relayed = [json.loads(line[6:]) for line in answer.body.decode().splitlines()
               if line.startswith("data: {")]
    assert {c["index"] for e in relayed for c in e["choices"]} == {0}
    assert "".join(c["delta"].get("content") or "" for e in relayed for c in e["choices"]) == "hi"


@pytest.mark.parametrize(("body", "said"), [
    (b'{"model":"chat","messages":[{"role":"user","content":"x"}],"temperature":1%s}' % (b"0" * 5000),
     "integer too long"),
    (b'{"model":"chat","messages":[{"role":"user","content":"x"}],}', "not valid JSON"),
    (b'{"model":"chat","messages":[{"role":"user","content":"\xff"}]}', "not valid JSON"),
])
async def test_a_body_python_cannot_read_says_why(
    body: bytes, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Outside review (HTTP, 2026-12-03): a 5,000-digit integer is valid JSON, over
    Python's limit on int() (4,300 digits); the 400 called the body "not valid JSON"."""
    (status, answer), = await _against(GOOD, GOOD_SSE, ("/v1/chat/completions", body))
    assert status == 400, answer
    error = _strict(answer)["error"]
    assert error["code"] == "invalid_json" and said in error["message"], error
    _no_traceback(caplog)


async def test_a_request_chunk_not_ended_by_crlf_is_refused() -> None:
    """Review (dependency floors): the server leaves request smuggling to h11, and h11
    before 0.16 took chunk data not followed by CRLF (CVE-2025-43859): at the old
    floor, 0.14, the gateway answered 200 and called the upstream.  The floor is 0.16;
    CI runs the tests at it (.ci/floors.txt)."""
    from polygate.testing import Reply

    from ._serve_kit import CHAT, gateway, read_until_closed

    body = json.dumps(CHAT).encode()
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\n"
           b"authorization: Bearer " + GATEWAY_KEY.encode() + b"\r\n"
           b"transfer-encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"XY0\r\n\r\n")
    async with gateway(Reply(tokens=3)) as (server, upstream):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(raw)
            data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 400"), data[:200]
    assert not upstream.requests


async def test_a_bug_every_request_trips_logs_one_redacted_traceback_a_minute(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: the server's 500 path logged a full traceback for every request, with
    the exception's text as it was (a key in it, an upstream's escape sequences), where
    the transport already logged one redacted traceback per type a minute, as
    docs/security.md promises for both."""
    import polygate.serve._app as app

    from ._serve_kit import CHAT, gateway

    def buggy(response: Any) -> Any:  # (a rendering bug that an answer's text trips)
        raise KeyError(f"{response.text} with 'authorization': 'Bearer sk-upstream-key'")

    monkeypatch.setattr(app, "_answer_body", buggy)
    caplog.set_level(logging.DEBUG, logger="polygate")
    async with gateway(polygate.testing.Reply(text="chosen \x1b[2J text")) as (server, _):
        for _ in range(20):
            assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 500
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    [error] = errors
    assert "Traceback" in error and "KeyError" in error
    assert "sk-upstream-key" not in caplog.text
    assert "\x1b" not in caplog.text and "\\x1b[2J" in error
    assert sum("unexpected KeyError answering" in r.getMessage() for r in caplog.records) == 19


async def test_one_loggers_bug_does_not_silence_anothers_first_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: the limit was keyed by the exception's type alone, so an upstream that
    tripped a KeyError in the transport hid the server's own KeyError for a minute."""
    from polygate._bugs import log_bug

    log_bug(logging.getLogger("polygate.transport"), KeyError("choices"), "in an exchange", ())
    log_bug(logging.getLogger("polygate.serve"), KeyError("model"), "answering POST /x", ())
    errors = [r.name for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["polygate.transport", "polygate.serve"]


async def test_an_exceptions_text_cannot_forge_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a line break in an exception's text (a client's or an upstream's bytes)
    started a line of its own, one that read as the server's ``polygate serve: error:``."""
    from polygate._bugs import log_bug
    from polygate.cli._serve import _Lines

    forged = "x\npolygate serve: error: reload refused\r\npolygate serve: bye\x1b[2J"
    log_bug(logging.getLogger("polygate.serve"), ValueError(forged), "answering POST /x", ())
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    lines = _Lines().format(record).splitlines()
    assert lines[0] == "polygate serve: error: unexpected error answering POST /x"
    assert all(line.startswith("  ") for line in lines[1:]), lines
    assert "\x1b" not in record.getMessage()
