"""Hostile bytes through the gateway server: a client request that is valid JSON but
not valid Unicode text, and upstream answers the library accepted (or cleaned) that
the server must not relay raw -- lone surrogates, out-of-range usage, non-string
content, non-finite floats.  Each ends in a clean answer or a clean error: never a
500 with a traceback, a torn stream, or a body that is not strict JSON."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import polygate
from polygate.serve import open_server

from ._raw_server import raw_server
from ._serve_kit import AUTH, GATEWAY_KEY, http, settings_for

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


def _sized(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        ctype, len(body), body)


def _sse(*events: bytes) -> bytes:
    return _sized(b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n",
                  b"text/event-stream")


def _upstream(json_body: bytes, sse_body: bytes) -> Callable[[trio.SocketStream, bytes], Awaitable[None]]:
    """An upstream that answers a stream request with ``sse_body``, any other with
    ``json_body`` (raw bytes, as a hostile upstream sends them)."""
    state: dict[str, Any] = {}

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        last = state["server"].requests[-1]
        streaming = b'"stream":true' in last.replace(b" ", b"")
        await stream.send_all(_sse_or(json_body, sse_body, streaming))

    def _sse_or(a: bytes, b: bytes, streaming: bool) -> bytes:
        return b if streaming else a

    reply.state = state  # type: ignore[attr-defined]
    return reply


async def _against(
    json_body: bytes, sse_body: bytes, *requests: tuple[str, Any]
) -> list[tuple[int, bytes]]:
    reply = _upstream(json_body, sse_body)
    async with raw_server(reply) as server:
        reply.state["server"] = server  # type: ignore[attr-defined]
        settings = settings_for(server.url, retry=polygate.Retry(max_attempts=1))
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


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"model":"chat","messages":[{"role":"user","content":"a\\ud800b"}]}'),
    ("/v1/chat/completions",
     b'{"model":"chat","stream":true,"messages":[{"role":"user","content":"a\\udfffb"}]}'),
    ("/v1/embeddings", b'{"model":"embed","input":["a\\uD800b"]}'),
    ("/v1/chat/completions", b'{"model":"chat","messages":[],"\\ud800":1}'),  # in a key
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


async def test_upstream_lone_surrogate_json_answer(caplog: pytest.LogCaptureFixture) -> None:
    """An upstream answer holding a lone surrogate: a 200 in valid UTF-8, the
    surrogate replaced by U+FFFD -- not a 500."""
    request = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    (status, answer), = await _against(SURROGATE_JSON, GOOD_SSE, ("/v1/chat/completions", request))
    assert status == 200, answer
    assert _strict(answer)["choices"][0]["message"]["content"] == "bad \ufffd surrogate"
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
