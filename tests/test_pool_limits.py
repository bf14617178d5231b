"""LeanTransport's limits and hand-offs on real loopback sockets: bytes past a
response's end, idle limits and expiry, closing with requests queued, what the
request writer refuses, and when a request counts as sent."""

from __future__ import annotations

import h11
import httpx
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

import polygate
from polygate.transport import LeanTransport
from polygate.transport._pool import _encode

from ._raw_server import OK_EVENTS, raw_server, sse_head

pytestmark = pytest.mark.integration

KEY = "sk-test-SECRET-0123456789abcdef"


async def get(transport: LeanTransport, url: str) -> httpx.Response:
    request = httpx.Request("GET", url)
    response = await transport.handle_async_request(request)
    response.request = request
    try:
        await response.aread()
    finally:
        await response.aclose()
    return response


def answers(*replies: bytes):  # type: ignore[no-untyped-def]
    """A reply function giving ``replies`` in turn, one per request."""
    queue = list(replies)

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(queue.pop(0))

    return reply


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


# --------------------------------------------------------------------------- R7


@pytest.mark.parametrize("first", [
    b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale",
])
async def test_bytes_past_a_response_are_never_the_next_answer(first: bytes) -> None:
    async with raw_server(answers(first, OK, OK)) as server, LeanTransport() as transport:
        await get(transport, server.url)
        second = await get(transport, server.url)
        third = await get(transport, server.url)
    assert second.content == b"ok" and third.content == b"ok"


async def test_stray_bytes_arriving_after_a_response_close_its_connection() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(OK)
        await trio.sleep(0.05)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")

    async with raw_server(reply) as server, LeanTransport() as transport:
        await get(transport, server.url)
        await trio.sleep(0.5)  # the stray bytes arrive while the connection is idle
        second = await get(transport, server.url)
        stats = transport.statistics()
    assert second.content == b"ok"
    assert stats.opened == 2


# --------------------------------------------------------------------------- idle


async def test_the_idle_limit_is_honoured() -> None:
    release = trio.Event()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await release.wait()
        await stream.send_all(OK)

    async with raw_server(reply) as server, LeanTransport(max_idle_connections=1) as transport:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(get, transport, server.url)
            with trio.fail_after(10):
                while server.connections < 3:  # noqa: ASYNC110 - a counter, no event to wait on
                    await trio.sleep(0.01)
            release.set()
        stats = transport.statistics()
    assert stats.opened == 3
    assert stats.idle == 1 and stats.open == 1


async def test_an_expired_idle_connection_is_not_reused(mock_clock: trio.testing.MockClock) -> None:
    async with raw_server(answers(OK, OK, OK)) as server, LeanTransport(keepalive_expiry=30) as transport:
        await get(transport, server.url)
        mock_clock.jump(29)
        await get(transport, server.url)
        assert transport.statistics().reused == 1
        mock_clock.jump(30)
        await get(transport, server.url)
        stats = transport.statistics()
    assert stats.opened == 2 and stats.open == 1 and stats.idle == 1


async def test_expired_connections_at_the_bottom_of_the_stack_are_closed(
    mock_clock: trio.testing.MockClock,
) -> None:
    release = trio.Event()
    both = trio.Event()
    arrived = 0

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        nonlocal arrived
        arrived += 1
        if arrived == 2:
            both.set()
        if arrived <= 2:
            await release.wait()
        await stream.send_all(OK)

    # The mock clock moves only when told: waits here are on events, never sleeps.
    async with raw_server(reply) as server, LeanTransport(keepalive_expiry=30) as transport:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(get, transport, server.url)
            await both.wait()
            release.set()
        assert transport.statistics().idle == 2
        mock_clock.jump(20)
        await get(transport, server.url)  # the top one; the bottom one sits unused
        mock_clock.jump(15)  # the bottom one has now been idle 35 s
        await get(transport, server.url)
        stats = transport.statistics()
    assert stats.idle == 1 and stats.open == 1


# --------------------------------------------------------------------------- aclose


async def test_closing_with_a_queued_request_frees_no_phantom_slot() -> None:
    release = trio.Event()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await release.wait()

    outcomes: list[str] = []

    async def attempt(transport: LeanTransport, url: str) -> None:
        try:
            await get(transport, url)
        except (RuntimeError, httpx.TransportError) as exc:
            outcomes.append(type(exc).__name__)

    async with raw_server(reply) as server:
        transport = LeanTransport(max_connections=1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attempt, transport, server.url)
            with trio.fail_after(10):
                while server.connections < 1:  # noqa: ASYNC110 - a counter, no event to wait on
                    await trio.sleep(0.01)
            nursery.start_soon(attempt, transport, server.url)
            with trio.fail_after(10):
                while transport.statistics().waiting < 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            await transport.aclose()
        release.set()
        stats = transport.statistics()
    assert sorted(outcomes) == ["ReadError", "RuntimeError"]
    assert stats.open == 0 and stats.waiting == 0


# --------------------------------------------------------------------------- the writer


def _h11_bytes(request: httpx.Request) -> bytes:
    conn = h11.Connection(h11.CLIENT)
    data = conn.send(h11.Request(method=request.method, target=request.url.raw_path,
                                 headers=request.headers.raw))
    return data + (conn.send(h11.Data(data=request.content)) or b"") + (conn.send(h11.EndOfMessage()) or b"")


@given(st.binary(max_size=12))
def test_the_fast_writer_writes_only_what_h11_would(value: bytes) -> None:
    request = httpx.Request("POST", "http://h/v1/chat/completions", content=b"{}",
                            headers={"authorization": b"Bearer " + value, "x-v": value})
    fast = _encode(request.method, request.url.raw_path, request.headers.raw, request.content)
    if fast is not None:
        assert fast == _h11_bytes(request)  # and h11 accepted it: edge blanks go to h11


@pytest.mark.parametrize("value", [b"Bearer sk-SECRET-\x00-abcdef", b"Bearer sk-SECRET-abcdef ", b"Bearer sk-SECRET-\x0b-abc"])
async def test_a_refused_header_value_is_never_quoted(value: bytes) -> None:
    request = httpx.Request("POST", "http://127.0.0.1:9/v1", content=b"{}",
                            headers={"authorization": value})
    async with LeanTransport() as transport:
        with pytest.raises(httpx.LocalProtocolError) as info:
            await transport.handle_async_request(request)
    error = info.value
    assert "authorization" in str(error)
    assert b"SECRET" not in repr(error).encode() and "SECRET" not in str(error)
    assert error.__context__ is None and error.__cause__ is None


# --------------------------------------------------------------------------- sent_at


async def test_a_request_cancelled_while_waiting_for_a_connection_was_not_sent() -> None:
    """RPM/TPM keep nothing for a request that never left (it was settled as sent
    when it was still queued in the pool)."""
    release = trio.Event()

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await release.wait()
        await stream.send_all(sse_head() + b"content-length: %d\r\n\r\n" % len(OK_EVENTS) + OK_EVENTS)

    async with raw_server(reply) as server, LeanTransport(max_connections=1) as transport:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=server.url, api_key=KEY, rpm=100)])})
        async with polygate.session(settings, transport=transport) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.chat, [{"role": "user", "content": "one"}])
                with trio.fail_after(10):
                    while server.connections < 1:  # noqa: ASYNC110 - a counter
                        await trio.sleep(0.01)
                with trio.CancelScope() as waiting:
                    nursery.start_soon(_cancel_when_queued, transport, waiting)
                    await s.chat([{"role": "user", "content": "two"}])
                assert waiting.cancelled_caught
                (source,) = (await s.statistics()).governance.sources
                in_window = source.state.requests_in_window
                release.set()
    assert in_window == 1  # only the request that was written


async def _cancel_when_queued(transport: LeanTransport, scope: trio.CancelScope) -> None:
    with trio.fail_after(10):
        while transport.statistics().waiting < 1:  # noqa: ASYNC110 - a counter
            await trio.sleep(0.01)
    scope.cancel()


async def test_time_to_first_token_excludes_the_wait_for_a_connection() -> None:
    first = True

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        nonlocal first
        if first:
            first = False
            await trio.sleep(1.0)  # holds the only connection
        await stream.send_all(sse_head() + b"content-length: %d\r\n\r\n" % len(OK_EVENTS) + OK_EVENTS)

    results: list[polygate.ChatResponse] = []

    async def call(s: polygate.Session) -> None:
        results.append(await s.chat([{"role": "user", "content": "hi"}]))

    async with raw_server(reply) as server, LeanTransport(max_connections=1) as transport:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=server.url, api_key=KEY)])})
        async with polygate.session(settings, transport=transport) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, s)
                with trio.fail_after(10):
                    while server.connections < 1:  # noqa: ASYNC110 - a counter
                        await trio.sleep(0.01)
                nursery.start_soon(call, s)
    waited = results[1].call_stats
    assert waited.total_latency_ms > 900  # it did wait for the connection
    assert waited.ttft_ms is not None and waited.ttft_ms < 500, waited
    assert waited.generation_ms < 500
