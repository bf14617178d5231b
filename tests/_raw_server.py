"""A loopback HTTP/1.1 server whose replies are raw bytes: for upstreams that break
the protocol in ways FakeUpstream will not (stacked codings, endless 1xx, bytes past
the end of a response, a body left open after ``[DONE]``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable

import trio

Reply = Callable[[trio.SocketStream, bytes], Awaitable[None]]


class RawServer:
    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[bytes] = []  # each request's head and body, as received
        self.connections = 0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        data = b""
        try:
            while True:  # requests on this connection, one after another
                while b"\r\n\r\n" not in data:
                    more = await stream.receive_some(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(data) < length:
                    more = await stream.receive_some(65536)
                    if not more:
                        return
                    data += more
                body, data = data[:length], data[length:]
                self.requests.append(head + b"\r\n\r\n" + body)
                await self.reply(stream, head)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.aclose()


@contextlib.asynccontextmanager
async def raw_server(reply: Reply) -> AsyncIterator[RawServer]:
    server = RawServer(reply)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, server._serve, 0, host="127.0.0.1")
        )
        server.port = listeners[0].socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()


def sized(body: bytes, ctype: bytes = b"application/json") -> bytes:
    """A 200 answer of ``body``, framed by its Content-Length."""
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        ctype, len(body), body)


def answering(data: bytes) -> Reply:
    """A reply that answers every request with the event stream ``data``, sized."""
    async def reply(stream: trio.SocketStream, _head: bytes) -> None:
        await stream.send_all(sized(data, b"text/event-stream"))
    return reply


def sse_head(extra: bytes = b"", status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: text/event-stream\r\n%s" % (status, extra)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


OK_EVENTS = (
    b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
