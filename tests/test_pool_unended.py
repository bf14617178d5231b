"""A streamed answer whose chunked end (``0\\r\\n\\r\\n``) comes a moment after its
``data: [DONE]`` (outside review, 2026-12-06: "upstreams that close kept-alive
connections").  uvicorn (and so vLLM, SGLang, LiteLLM), hypercorn, aiohttp and Go
write that end on its own; the pool dropped every connection whose end had not come
when the answer was read: 50 sequential calls opened 50 connections with the end 1 ms
late, 185 of 200 out of process.  Now such a connection is parked idle and its end
read before it serves again; one whose end is not yet here is passed over, not
dropped.

The servers here hold each end until an event the test controls (no sleep decides
anything): real loopback sockets, real clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

import polygate

from ._raw_server import raw_server

pytestmark = pytest.mark.integration

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_CHUNK = (b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
          b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}')
END = b"0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


ANSWER = HEAD + _chunk(b"data: " + _CHUNK + b"\n\n") + _chunk(b"data: [DONE]\n\n")
MESSAGES = [{"role": "user", "content": "hi"}]


def _settings(url: str) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url=url, api_key="k", model="m")],
        retry=polygate.Retry(max_attempts=1))})


def _pool(s: polygate.Session) -> Any:
    return s._runtime.transport


def _held_ends(after: Callable[[int], bytes] = lambda _: END) -> tuple[Any, list[trio.Event], list[trio.Event]]:
    """A reply that sends each answer up to ``[DONE]``, then waits for its own
    ``release`` event before it sends ``after(n)`` (the end, or what stands for it)
    and sets its ``sent`` event."""
    release: list[trio.Event] = []
    sent: list[trio.Event] = []

    async def reply(stream: trio.SocketStream, _head: bytes) -> None:
        n = len(release)
        release.append(trio.Event())
        sent.append(trio.Event())
        await stream.send_all(ANSWER)
        await release[n].wait()
        rest = after(n)
        if rest:
            await stream.send_all(rest)
        else:
            await stream.aclose()
        sent[n].set()

    return reply, release, sent


async def test_an_end_that_came_after_the_answer_is_read_and_the_connection_reused() -> None:
    reply, release, sent = _held_ends()
    async with raw_server(reply) as server, polygate.session(_settings(server.url)) as s:
        assert (await s.chat(MESSAGES)).text == "hi"
        release[0].set()
        await sent[0].wait()  # the end is on the wire, after the call returned
        assert (await s.chat(MESSAGES)).text == "hi"
        release[1].set()
        assert server.connections == 1
        assert _pool(s).statistics().reused == 1


async def test_back_to_back_calls_take_turns_on_two_connections() -> None:
    """Each end comes only once the next request has arrived: no call finds its
    predecessor's end, and each finds the one before that, on the other connection."""
    release: list[trio.Event] = []
    sent: list[trio.Event] = []

    async def reply(stream: trio.SocketStream, _head: bytes) -> None:
        if release:
            release[-1].set()  # the previous answer's end goes now, before this answer
            await sent[-1].wait()
        mine, done = trio.Event(), trio.Event()
        release.append(mine)
        sent.append(done)
        await stream.send_all(ANSWER)
        await mine.wait()
        await stream.send_all(END)
        done.set()

    async with raw_server(reply) as server, polygate.session(_settings(server.url)) as s:
        for _ in range(10):
            assert (await s.chat(MESSAGES)).text == "hi"
        release[-1].set()
    assert server.connections == 2


@pytest.mark.parametrize("instead", [
    b"5\r\nhello\r\n" + END,  # more data after [DONE]
    b"0\r\nx-trailer: 1\r\n\r\n",  # an end with a trailer: h11's to read, not ours
    END + b"HTTP/1.1 200 OK\r\n",  # a stray answer after the end
    b"",  # the server closes instead
])
async def test_what_is_not_the_plain_end_costs_the_connection_not_an_answer(instead: bytes) -> None:
    reply, release, sent = _held_ends(lambda n: instead if n == 0 else END)
    async with raw_server(reply) as server, polygate.session(_settings(server.url)) as s:
        assert (await s.chat(MESSAGES)).text == "hi"
        release[0].set()
        await sent[0].wait()
        assert (await s.chat(MESSAGES)).text == "hi"
        release[1].set()
        assert server.connections == 2
        assert _pool(s).statistics().reused == 0


async def test_an_end_that_never_comes_is_given_up_by_the_idle_sweep() -> None:
    reply, release, _ = _held_ends()
    async with raw_server(reply) as server, polygate.session(_settings(server.url)) as s:
        assert (await s.chat(MESSAGES)).text == "hi"
        pool = _pool(s)
        assert pool.statistics().idle == 1 and pool.close_idle() == 0  # parked, waiting
        for stack in pool._idle.values():
            for conn in stack:
                conn.idle_since -= 1.0  # parked a second ago (the sweep's bound)
        assert pool.close_idle() == 1
        release[0].set()
    assert server.connections == 1


def test_the_end_still_due_is_what_follows_wherever_the_read_stopped() -> None:
    from polygate._chunked import ChunkedDecoder

    done = _chunk(b"data: [DONE]\n\n")
    body = done + END
    for cut in range(len(done) - 2, len(done) + 3):  # in the CRLF after the data, or in "0\r"
        decoder = ChunkedDecoder()
        data, last = decoder.decode(body[:cut])
        assert last is None and data == b"data: [DONE]\n\n"
        assert decoder.end_due() == body[cut:], cut
    decoder = ChunkedDecoder()
    decoder.decode(done[:-5])  # mid-data: no end can be due yet
    assert decoder.end_due() is None


async def test_no_more_than_two_wait_for_their_end_at_once() -> None:
    """Review: a server whose ends came late had every request read every parked
    connection (~330 reads a call at 8 callers); two are all the turns need."""
    reply, release, _ = _held_ends()
    async with raw_server(reply) as server, polygate.session(_settings(server.url)) as s:
        for _ in range(6):
            assert (await s.chat(MESSAGES)).text == "hi"
        pool = _pool(s)
        parked = [c for stack in pool._idle.values() for c in stack if c.end_due is not None]
        assert len(parked) == 2 and pool.statistics().open == 2
        assert server.connections == 6
        for event in release:
            event.set()
