"""A hostile upstream, on real loopback sockets through the default LeanTransport:
every attack ends in a typed error within its attempt, with memory bounded by the
caps and no secret in any message (docs/security.md)."""

from __future__ import annotations

import gzip
import json
import logging
import time
import tracemalloc
import zlib

import pytest
import trio

import polygate
from polygate.transport import LeanTransport

from ._raw_server import OK_EVENTS, RawServer, chunk, raw_server, sse_head

pytestmark = pytest.mark.integration

KEY = "sk-proj-SECRET-8d1f0e77b2c94a3c9e1d5f60a7b8c9d0"
MiB = 1024 * 1024
MESSAGES = [{"role": "user", "content": "hi"}]


def settings(server: RawServer, **kw: object) -> polygate.Settings:
    source_kw = {k: kw.pop(k) for k in list(kw) if k in ("timeout_s",)}
    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=server.url, api_key=KEY, **source_kw)],  # type: ignore[arg-type]
            retry=polygate.Retry(max_attempts=1),
        )},
        **kw,  # type: ignore[arg-type]
    )


async def one_error(server: RawServer, **kw: object) -> polygate.UpstreamError:
    async with polygate.session(settings(server, **kw)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    (error,) = info.value.errors
    assert KEY not in repr(info.value) and KEY[:12] not in str(error)
    return error


def sized(head: bytes, body: bytes) -> bytes:
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


# --------------------------------------------------------------------- F5 content coding


def _two_gzip_layers(size: int) -> bytes:
    inner = zlib.compressobj(9, zlib.DEFLATED, 31)
    layer = b"".join(inner.compress(b"\0" * MiB) for _ in range(size // MiB)) + inner.flush()
    return gzip.compress(layer, 9)


@pytest.mark.parametrize("status", [200, 500, 401])
@pytest.mark.parametrize("coding", [b"gzip, gzip", b"gzip", b"deflate", b"br"])
async def test_a_content_coded_body_is_refused_unread(status: int, coding: bytes) -> None:
    bomb = _two_gzip_layers(64 * MiB)  # a few hundred bytes: 64 MiB after two layers

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sized(sse_head(b"content-encoding: " + coding + b"\r\n", status), bomb))

    async with raw_server(reply) as server:
        tracemalloc.start()
        try:
            error = await one_error(server, max_body_bytes=MiB)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert isinstance(error, (polygate.TransientUpstreamError, polygate.SourceDeadError))
    assert "content-encoding" in str(error)
    assert error.status_code == (None if status == 200 else status)  # the status still classifies
    assert peak < 4 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert b"\r\naccept-encoding: identity\r\n" in server.requests[0].lower()


# --------------------------------------------------------------------- F8 endless 1xx


async def test_endless_interim_responses_end_at_their_cap() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        while True:
            await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n" * 100)

    async with raw_server(reply) as server:
        start = time.perf_counter()
        with trio.fail_after(20):
            error = await one_error(server, timeout_s=30)
    assert "interim (1xx)" in str(error) and "cap" in str(error)
    assert time.perf_counter() - start < 10


async def test_a_few_interim_responses_are_fine() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n" * 3 + sized(sse_head(), OK_EVENTS))

    async with raw_server(reply) as server, polygate.session(settings(server)) as s:
        assert (await s.chat(MESSAGES)).text == "hi"


# --------------------------------------------------------------------- F7 assembler


def _stream(events: list[bytes]) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("shape", ["choices", "tool_calls"])
async def test_an_index_flood_is_a_malformed_stream(shape: str) -> None:
    if shape == "choices":
        events = [json.dumps({"choices": [
            {"index": i * 100 + j, "delta": {"content": "x"}} for j in range(100)
        ]}).encode() for i in range(20)]
    else:
        events = [json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i * 100 + j, "function": {"name": "f"}} for j in range(100)
        ]}}]}).encode() for i in range(20)]
    body = _stream(events)

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sized(sse_head(), body))

    async with raw_server(reply) as server:
        error = await one_error(server)
    assert isinstance(error, polygate.TransientUpstreamError)
    assert ("malformed stream: choice index 128, over the 128 choices" if shape == "choices"
            else "malformed stream: more than 128") in str(error)


async def test_indexes_that_carry_nothing_cost_nothing() -> None:
    """A flood of empty choices (``{"index": N}``) is valid JSON that says nothing:
    the call succeeds and holds none of it (it held 25-60x the body before)."""
    events, size, i = [], 0, 0
    while size < MiB - 64 * 1024:
        event = b'{"choices":[' + b",".join(b'{"index":%d}' % (i * 500 + j) for j in range(500)) + b"]}"
        events.append(event)
        size += len(event) + 8
        i += 1
    events.insert(0, b'{"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}')
    body = _stream(events)

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sized(sse_head(), body))

    async with raw_server(reply) as server, polygate.session(
        settings(server, max_body_bytes=MiB, max_line_bytes=MiB)
    ) as s:
        tracemalloc.start()
        try:
            response = await s.chat(MESSAGES)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert response.text == "ok" and len(response.choices) == 1
    assert peak < 4 * MiB, f"peak {peak / MiB:.1f} MiB for a {len(body) / MiB:.2f} MiB body"


# --------------------------------------------------------------------- JSON nesting


@pytest.mark.parametrize("where", ["json", "sse"])
@pytest.mark.parametrize("depth", [129, 100_000])
async def test_deep_json_is_refused_quietly(
    where: str, depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    nested = b"[" * depth + b"]" * depth
    if where == "json":
        payload = sized(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n", nested)
    else:
        payload = sized(sse_head(), b"data: " + nested + b"\n\n")

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(payload)

    caplog.set_level(logging.DEBUG)
    async with raw_server(reply) as server:
        error = await one_error(server)
    assert "nested deeper than 128" in str(error)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_json_at_the_depth_cap_is_fine() -> None:
    deep = {"x": 1}
    for _ in range(120):
        deep = {"x": deep}
    event = json.dumps({"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}],
                        "provider_extra": deep}).encode()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sized(sse_head(), _stream([event])))

    async with raw_server(reply) as server, polygate.session(settings(server)) as s:
        assert (await s.chat(MESSAGES)).text == "ok"


# --------------------------------------------------------------------- F3 redact, then cut


def _with_key_at(limit: int, prefix: str) -> str:
    """A text whose first ``limit`` characters end with all of KEY but its last."""
    return prefix + "y" * (limit - len(prefix) - len(KEY) + 1) + KEY + " (echoed)"


@pytest.mark.parametrize(("body", "ctype"), [
    (_with_key_at(200, "bad authorization: ").encode(), b"text/plain"),
    (json.dumps({"error": {"message": _with_key_at(300, "Incorrect API key: ")}}).encode(),
     b"application/json"),
    (json.dumps({"error": {"message": {"detail": _with_key_at(300, "k: ")}}}).encode(),
     b"application/json"),
    (json.dumps({"error": {"message": "key " + json.dumps(KEY + "\\")}}).encode(), b"application/json"),
])
async def test_an_echoed_key_is_redacted_before_the_message_is_cut(body: bytes, ctype: bytes) -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sized(b"HTTP/1.1 401 No\r\ncontent-type: " + ctype + b"\r\n", body))

    async with raw_server(reply) as server:
        error = await one_error(server)
    text = str(error)
    shown = max(n for n in range(len(KEY) + 1) if KEY[:n] in text)
    assert shown < 4, f"{shown} characters of the key in {text[-90:]!r}"
    assert isinstance(error, polygate.SourceDeadError)


async def test_an_excerpt_cut_mid_key_does_not_show_the_first_part() -> None:
    body = b"x" * (65536 - 20) + KEY.encode() + b"z" * 1000  # the read stops inside the key

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sized(b"HTTP/1.1 500 X\r\ncontent-type: text/plain\r\n", body))

    async with raw_server(reply) as server:
        error = await one_error(server)
    assert KEY[:8] not in str(error)


# --------------------------------------------------------------------- body caps


async def test_a_body_without_content_length_is_read_only_up_to_the_cap() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n[")
        while True:  # close-delimited, never ends
            await stream.send_all(b"1," * 32768)

    async with raw_server(reply) as server:
        with trio.fail_after(20):
            error = await one_error(server, max_body_bytes=MiB)
    assert f"exceeds the {MiB}-byte cap" in str(error)


async def test_a_declared_length_over_the_cap_is_refused_before_the_body() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 99999999\r\n\r\n{"
        )
        await trio.sleep_forever()  # the rest never comes: only the header can end this

    async with raw_server(reply) as server:
        with trio.fail_after(10):
            error = await one_error(server, max_body_bytes=MiB, timeout_s=30)
    assert "of 99999999 bytes exceeds" in str(error)


async def test_a_stream_over_the_body_cap_ends_at_the_cap() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sse_head(b"transfer-encoding: chunked\r\n") + b"\r\n")
        while True:
            await stream.send_all(chunk(b": keep-alive " + b"x" * 4000 + b"\n\n"))

    async with raw_server(reply) as server:
        with trio.fail_after(20):
            error = await one_error(server, max_body_bytes=MiB)
    assert "body cap" in str(error)


# --------------------------------------------------------------------- SSE ends


async def test_a_last_event_without_its_blank_line_completes_the_answer() -> None:
    body = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n')

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sized(sse_head(), body))

    async with raw_server(reply) as server, polygate.session(settings(server)) as s:
        response = await s.chat(MESSAGES)
    assert response.text == "hi" and response.call_stats.attempts == 1


async def test_an_answer_is_not_held_by_a_body_left_open_after_done() -> None:
    """A proxy keeps the chunked body open after ``[DONE]``: the answer returns at
    once (it waited up to 1 s before).  Its connection waits idle for the body's end
    (tests/test_pool_unended.py), never given another request while the end is
    missing, and the idle sweep closes it once its end is a second late."""
    released = trio.Event()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(sse_head(b"transfer-encoding: chunked\r\n") + b"\r\n" + chunk(OK_EVENTS))
        await released.wait()

    async with raw_server(reply) as server, LeanTransport() as transport:
        async with polygate.session(settings(server), transport=transport) as s:
            start = trio.current_time()
            response = await s.chat(MESSAGES)
            took = trio.current_time() - start
            assert (await s.chat(MESSAGES)).text == "hi"
            assert server.connections == 2  # the first is passed over, its end missing
            for stack in transport._idle.values():
                for conn in stack:
                    conn.idle_since -= 1.0  # both parked a second ago
            assert transport.close_idle() == 2
            stats = transport.statistics()
        released.set()
    assert response.text == "hi"
    assert took < 0.5, f"held {took:.2f}s"
    assert response.call_stats.total_latency_ms < 500
    assert stats.idle == 0 and stats.open == 0


async def test_a_body_ended_with_done_keeps_its_connection() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(
            sse_head(b"transfer-encoding: chunked\r\n") + b"\r\n" + chunk(OK_EVENTS) + b"0\r\n\r\n"
        )

    async with raw_server(reply) as server, LeanTransport() as transport:
        async with polygate.session(settings(server), transport=transport) as s:
            for _ in range(3):
                assert (await s.chat(MESSAGES)).text == "hi"
            assert transport.statistics().opened == 1


# --------------------------------------------------------------------- review findings


@pytest.mark.parametrize("split", [0, 1, 2, 3])
@pytest.mark.parametrize("labelled", [True, False])
async def test_a_byte_order_mark_before_a_stream_is_ignored(labelled: bool, split: int) -> None:
    """A UTF-8 BOM before the first event made its first field b"\\xef\\xbb\\xbfdata":
    labelled, the event was dropped without a word (chat() answered "" and a stream
    showed nothing); unlabelled, the body was read as JSON.  WHATWG ignores one.
    ``split``: the mark's bytes in a write of their own (a read may end inside it)."""
    body = b"\xef\xbb\xbf" + OK_EVENTS
    head = sse_head() if labelled else b"HTTP/1.1 200 X\r\n"

    async def reply(stream: trio.SocketStream, request: bytes) -> None:
        await stream.send_all(head + b"transfer-encoding: chunked\r\n\r\n")
        if split:
            await stream.send_all(chunk(body[:split]))
            await trio.sleep(0.05)  # (so that the rest comes in a read of its own)
        await stream.send_all(chunk(body[split:]) + chunk(b""))

    async with raw_server(reply) as server, polygate.session(settings(server)) as s:
        assert (await s.chat(MESSAGES)).text == "hi"
        async with s.stream_chat(MESSAGES) as stream:
            assert [c.text async for c in stream] == ["hi"]


@pytest.mark.parametrize(("status", "kind"), [
    (400, polygate.FatalUpstreamError),
    (401, polygate.SourceDeadError),
    (429, polygate.RateLimitedError),
])
async def test_an_error_whose_body_stalls_is_still_classified_by_its_status(
    status: int, kind: type[polygate.UpstreamError]
) -> None:
    """The excerpt of an error body was read with no bound of its own: a body that
    stalls turned a 400 (raised at once), a 401 (the source dead) or a 429 (its
    Retry-After) into a timeout of the attempt, retried, after timeout_s each."""

    async def reply(stream: trio.SocketStream, request: bytes) -> None:
        await stream.send_all(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\nretry-after: 7\r\n"
            b'content-length: 100\r\n\r\n{"error": {"message": "no' % status)
        await trio.sleep_forever()

    async with raw_server(reply) as server:
        scope = polygate.Scope(
            sources=[polygate.Source(name="a", base_url=server.url, api_key=KEY, timeout_s=30)],
            # (a 429 is retried free of max_attempts: only while a wait this short lasts)
            retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=0.1))
        start = time.perf_counter()
        async with polygate.session(polygate.Settings(scopes={"chat": scope})) as s:
            with pytest.raises(polygate.PolygateError) as info, trio.fail_after(20):
                await s.chat(MESSAGES)
    error = info.value
    if isinstance(error, polygate.AllSourcesExhausted):
        (error,) = error.errors
    assert type(error) is kind, error
    assert error.status_code == status
    if status == 429:
        assert error.retry_after_s == 7
    assert time.perf_counter() - start < 10  # a bounded excerpt (1 s), not timeout_s
