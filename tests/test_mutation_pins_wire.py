"""Behaviour of the upstream wire (the SSE decoder, bodies, Retry-After, the request
body) no other test pinned, found by mutating it: each test fails on the mutation its
docstring names and passes on the code as it is."""
from __future__ import annotations

import json

import httpx
import pytest
import trio

import polygate
from polygate.transport._sse import SSEDecoder
from polygate.transport._wire import (
    Endpoint,
    chat_body,
    check_encoding,
    parse_retry_after,
    raise_for_status,
    read_capped,
)


def decode(pieces, max_line=1 << 20, max_body=1 << 30):
    decoder = SSEDecoder(max_body=max_body, max_line=max_line, source="s")
    out = [e.data for p in pieces for e in decoder.feed(p)]
    return out + [e.data for e in decoder.flush()]


def test_fast_path_event_one_byte_over_the_line_cap_is_refused() -> None:
    """Mutation: the one-event fast path's ``len(piece) - 2 <= max_line`` loosened:
    an event over the line cap must be refused however it arrives."""
    event = b"data: 12345"  # 11 bytes
    assert decode([event + b"\n\n"], max_line=11) == [b"12345"]
    with pytest.raises(polygate.TransientUpstreamError, match="line cap"):
        decode([event + b"\n\n"], max_line=10)
    with pytest.raises(polygate.TransientUpstreamError, match="line cap"):
        decode([event + b"\n\n"], max_line=9)


def test_a_zero_width_no_break_space_mid_stream_is_kept() -> None:
    """Mutation: the decoder stays 'fresh' after the first piece, so every piece
    that starts with EF BB BF (U+FEFF in the text, cut at a read) loses it."""
    feff = "\ufeff".encode()
    assert decode([b"data: a", feff + b"b\n\n"]) == [b"a" + feff + b"b"]
    assert decode([b"data: x\n\ndata: a", feff + feff + b"\n\n"]) == [b"x", b"a" + feff + feff]


def test_retry_after_ms_with_blanks_is_read() -> None:
    """Mutation: ``ms.strip()`` dropped (the plain Retry-After is stripped)."""
    assert parse_retry_after({"retry-after-ms": " 1500 "}) == 1.5
    assert parse_retry_after({"retry-after": " 2 "}) == 2.0


def _response(status: int, body: bytes, *, length: bool = True, headers=()) -> httpx.Response:
    if length:
        return httpx.Response(status, content=body, headers=list(headers))

    return httpx.Response(status, stream=_Stream([body]), headers=list(headers))


class _Stream(httpx.AsyncByteStream):
    """Pieces, then the end (or, with ``stall``, a wait forever)."""

    def __init__(self, pieces, stall: bool = False) -> None:
        self._pieces = list(pieces)
        self._stall = stall

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if self._pieces:
            return self._pieces.pop(0)
        if self._stall:
            await trio.sleep_forever()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


async def test_a_body_of_exactly_the_cap_without_a_length_is_read() -> None:
    """Mutation: read_capped ``size > limit`` -> ``>=``."""
    body = b"x" * 100
    assert await read_capped(_response(200, body, length=False), 100, "s", ()) == body
    with pytest.raises(polygate.TransientUpstreamError, match="cap"):
        await read_capped(_response(200, body, length=False), 99, "s", ())


async def test_a_declared_length_of_exactly_the_cap_is_read() -> None:
    """Mutation: check_readable ``int(declared) > limit`` -> ``>=``."""
    body = b"x" * 100
    response = _response(200, body)
    assert response.headers["content-length"] == "100"
    assert await read_capped(response, 100, "s", ()) == body
    with pytest.raises(polygate.TransientUpstreamError, match="100 bytes exceeds"):
        await read_capped(_response(200, body), 99, "s", ())


async def test_a_stalled_error_body_takes_at_most_half_the_time_left(autojump_clock) -> None:
    """Mutation: the excerpt's bound ``min(1.0, left / 2)`` -> ``min(1.0, left)``: a
    400 whose body stalls became a timeout of the call instead of its 400."""
    endpoint = Endpoint(name="s", url="http://x/v1")
    start = trio.current_time()
    raised = None
    with trio.move_on_after(1.0):
        try:
            stalls = _Stream([b'{"error": {"message": "bad request'], stall=True)
            await raise_for_status(httpx.Response(400, stream=stalls), endpoint)
        except polygate.FatalUpstreamError as exc:
            raised = exc
    assert raised is not None, "the 400 was lost to the deadline"
    assert trio.current_time() - start == pytest.approx(0.5)


async def test_a_300_is_no_answer() -> None:
    """Mutation: ``200 <= status < 300`` -> ``<= 300``: a 300 read as an answer."""
    endpoint = Endpoint(name="s", url="http://x/v1")
    with pytest.raises(polygate.UpstreamError):
        await raise_for_status(httpx.Response(300, content=b"{}"), endpoint)


def test_a_non_streamed_request_carries_no_stream_options() -> None:
    """Mutation: ``body.pop("stream_options")`` dropped: OpenAI refuses
    stream_options on a request that does not stream (400)."""
    endpoint = Endpoint(name="s", url="http://x/v1", model="m", streaming=False)
    body = json.loads(chat_body(endpoint, "[]", {"stream_options": {"include_usage": True}}, False))
    assert "stream_options" not in body and "stream" not in body


def test_identity_in_any_case_is_accepted() -> None:
    """Mutation: ``coding.lower()`` dropped: content-encoding is case-insensitive
    (RFC 9110 8.4.1)."""
    response = httpx.Response(200, content=b"{}", headers=[("content-encoding", "Identity")])
    assert check_encoding(response, "s", ()) is None
    assert check_encoding(httpx.Response(200, headers=[("content-encoding", "GZIP")]), "s", ())


@pytest.mark.parametrize("coding", ["identity, identity", "identity,", ", identity", "identity, ,"])
def test_a_list_of_nothing_but_identity_is_no_coding(coding: str) -> None:
    """Review (compression): Content-Encoding is a list (RFC 9110 8.4, 5.6.1.2: empty
    items are ignored), and two ``identity`` lines arrive joined; read as one string,
    such a plain answer was refused and fed the source's breaker.  The gateway's own
    request check already read it as a list."""
    assert check_encoding(httpx.Response(200, headers=[("content-encoding", coding)]), "s", ()) is None


@pytest.mark.parametrize("coding", ["identity, gzip", "gzip, identity", ", br"])
def test_a_list_with_any_real_coding_is_refused(coding: str) -> None:
    assert check_encoding(httpx.Response(200, headers=[("content-encoding", coding)]), "s", ())


def test_two_identity_lines_are_no_coding() -> None:
    headers = [("content-encoding", "identity"), ("content-encoding", "identity")]
    assert check_encoding(httpx.Response(200, headers=headers), "s", ()) is None
