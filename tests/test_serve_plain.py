"""A client's request read without h11 (polygate/serve/_http.py, ``_plain_request``),
held to h11's own reading.

The server reads the usual request -- HTTP/1.1, CRLF lines, one Host, at most one
Content-Length, all of it in one read -- itself, and hands anything else to h11, so
that every smuggling shape, every refusal and every oddity is still h11's to judge.
The property is one-sided: whatever it reads, h11 reads the same (method, target,
headers, body, and the bytes left for the next request).  The plain shapes real
clients send must be read here; the odd ones must be left to h11.  Through the
server: keep-alive, pipelining and a request after a plain one."""

from __future__ import annotations

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from polygate.serve._http import _MAX_HEAD, _plain_request
from polygate.testing import Reply

from ._serve_kit import AUTH, CHAT, gateway, read_answer, request_bytes


def h11_reads(data: bytes) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes, bytes] | None:
    """What h11's server makes of ``data``: method, target, headers, body and the
    bytes after the request; None when it does not read a whole request from it."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
    conn.receive_data(data)
    try:
        event = conn.next_event()
        if type(event) is not h11.Request:
            return None
        body = b""
        while True:
            part = conn.next_event()
            if type(part) is h11.Data:
                body += part.data
            elif type(part) is h11.EndOfMessage:
                break
            else:
                return None
    except h11.RemoteProtocolError:
        return None
    return (event.method, event.target, list(event.headers), body, conn.trailing_data[0])


def ours(data: bytes) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes, bytes] | None:
    found = _plain_request(data)
    if found is None:
        return None
    request, after = found
    return request.method, request.target, request.headers, request.body, after


_LINES = [
    b"POST /v1/chat/completions HTTP/1.1", b"GET /v1/models HTTP/1.1", b"HEAD /healthz HTTP/1.1",
    b"GET /v1/models?x=1 HTTP/1.1", b"GET http://gw/v1/models HTTP/1.1", b"POST / HTTP/1.0",
    b"POST  / HTTP/1.1", b"post / HTTP/1.1", b"POST /\x7f HTTP/1.1", b"GET / HTTP/2.0",
    b"POST /a b HTTP/1.1", b"POST / HTTP/1.1 ", b"BAD\x00 / HTTP/1.1",
]
_FIELDS = [
    b"host: gw", b"Host: gw:8000", b"content-type: application/json", b"content-length: 2",
    b"Content-Length: 2", b"content-length: 02", b"content-length: 2, 2", b"content-length: x",
    b"transfer-encoding: chunked", b"expect: 100-continue", b"upgrade: h2c",
    b"connection: keep-alive", b"Connection: close", b"authorization: Bearer sk-x",
    b"Authorization: Bearer sk-y", b"x-empty:", b"x-tab:\tv", b"bad name: 1", b": x",
    b"x-ctl: a\x01b", b" folded", b"user-agent: OpenAI/Python 1.0",
]
_BODIES = [b"", b"{}", b"{}POST", b"{", b"{}GET / HTTP/1.1\r\nhost: gw\r\n\r\n"]


@st.composite
def requests_(draw: st.DrawFn) -> bytes:
    lines = [draw(st.sampled_from(_LINES)), *draw(st.lists(st.sampled_from(_FIELDS), max_size=6))]
    ending = draw(st.sampled_from([b"\r\n"] * 8 + [b"\n"]))
    return ending.join(lines) + ending + ending + draw(st.sampled_from(_BODIES))


@settings(max_examples=4000, deadline=None)
@given(requests_())
def test_what_it_reads_h11_reads_the_same(data: bytes) -> None:
    read = ours(data)
    if read is not None:
        assert h11_reads(data) == read


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from([b"POST /v1/chat/completions", b"POST /v1/embeddings", b"GET /v1/models",
                     b"GET /healthz", b"HEAD /healthz"]),
    st.lists(st.sampled_from([
        b"content-type: application/json", b"authorization: Bearer sk-gw", b"accept: */*",
        b"user-agent: OpenAI/Python 1.54.0", b"x-stainless-lang: python",
        b"connection: keep-alive", b"accept-encoding: gzip, deflate",
    ]), max_size=7),
    st.sampled_from([b"", b'{"model":"chat","messages":[]}']),
)
def test_the_plain_shapes_are_read_here(line: bytes, fields: list[bytes], body: bytes) -> None:
    data = b"\r\n".join([line + b" HTTP/1.1", b"host: gw", *fields,
                         b"content-length: %d" % len(body)]) + b"\r\n\r\n" + body
    read = ours(data)
    assert read is not None
    assert h11_reads(data) == read


@pytest.mark.parametrize("data", [
    b"POST / HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n{}",
    b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n{}",
    b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 2, 2\r\n\r\n{}",
    b"POST / HTTP/1.1\r\nhost: gw\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n{}",
    b"GET / HTTP/1.1\r\nhost: gw\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",  # no Host: h11 refuses it
    b"GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
    b"GET / HTTP/1.0\r\nhost: gw\r\n\r\n",
    b"GET / HTTP/1.1\nhost: gw\n\n",
    b"GET / HTTP/1.1\r\nhost: gw\r\n folded\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 10\r\n\r\n{}",  # the body is not all here
    b"GET / HTTP/1.1\r\nhost: gw",  # nor the head
    b"GET / HTTP/1.1\r\nhost: gw\r\nx: " + b"a" * _MAX_HEAD + b"\r\n\r\n",
])
def test_what_is_not_plain_is_left_to_h11(data: bytes) -> None:
    assert _plain_request(data) is None


async def test_plain_requests_keep_alive_and_pipeline_through_the_server() -> None:
    # Three requests in one write: the first is read here, the two after it are
    # pipelined (h11 reads them); then one more, plain again, on the same connection.
    one = request_bytes("POST", "/v1/chat/completions", CHAT, AUTH)
    assert _plain_request(one) is not None
    async with gateway(Reply(tokens=2)) as (server, upstream):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            statuses = []
            for batch in (one * 3, one):
                await stream.send_all(batch)
                for _ in range(batch.count(b"POST")):
                    conn.send(h11.Request(method="POST", target="/", headers=[
                        ("host", "g"), ("content-length", "0")]))
                    conn.send(h11.EndOfMessage())
                    statuses.append((await read_answer(stream, conn)).status)
                    conn.start_next_cycle()
    assert statuses == [200, 200, 200, 200]
    assert len(upstream.requests) == 4


@pytest.mark.parametrize("connection", [b"", b"connection: keep-alive\r\n"], ids=["plain", "keep-alive"])
async def test_an_http10_answer_says_it_closes_and_does(connection: bytes) -> None:
    # h11 keeps no HTTP/1.0 connection alive; an answer without "connection: close"
    # to a client that asked for keep-alive read as persistent, and its next request
    # met a closed socket.
    async with gateway(Reply(tokens=2)) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.0\r\nhost: gw\r\n" + connection + b"\r\n")
            data = b""
            with trio.fail_after(5):
                while got := await stream.receive_some():
                    data += got
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"\r\nconnection: close" in head.lower()
    assert body == b'{"status":"ok"}'
