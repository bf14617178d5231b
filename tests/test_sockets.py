"""Writes without trio's scheduler pass (polygate/_sockets.py), and the two senders
that use them: the pool's request and the server's answer.

What they must keep of ``send_all``: every byte, in order, however much the kernel
takes at once; trio's own error for a peer that has gone; and no byte written for a
request that is already cancelled.  What they drop: the scheduler pass after a write
the kernel took whole."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

import polygate
import polygate._sockets
import polygate.testing
from polygate._sockets import receive_when_readable, write_now
from polygate.serve._http import Connection as ServerConnection
from polygate.transport._pool import _Connection as PoolConnection


def _stream(sock: socket.socket) -> trio.SocketStream:
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


async def test_a_write_the_kernel_takes_is_whole() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        stream = _stream(ours)
        assert write_now(stream, b"hello") == 5
        assert theirs.recv(100) == b"hello"


async def test_a_full_buffer_takes_part_or_nothing() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        stream = _stream(ours)
        data = b"x" * (4 << 20)
        written = write_now(stream, data)
        assert 0 < written < len(data)
        assert write_now(stream, data[written:]) == 0  # full: nothing more, no error


async def test_a_gone_peer_writes_nothing_and_send_all_raises_as_trio_does() -> None:
    ours, theirs = socket.socketpair()
    with ours:
        theirs.close()
        stream = _stream(ours)
        assert write_now(stream, b"hello") == 0
        with pytest.raises(trio.BrokenResourceError):
            await stream.send_all(b"hello")


async def test_a_stream_that_is_not_a_socket_is_left_to_send_all() -> None:
    send, _ = trio.testing.memory_stream_pair()
    assert write_now(send, b"hello") == 0  # type: ignore[arg-type]


async def test_a_closed_socket_is_left_to_send_all() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        stream = _stream(ours)
        await stream.aclose()
        assert write_now(stream, b"hello") == 0


async def _read_all(sock: socket.socket, size: int) -> bytes:
    got = bytearray()
    trio_sock = trio.socket.from_stdlib_socket(sock)
    while len(got) < size:
        piece = await trio_sock.recv(1 << 20)
        assert piece
        got += piece
    return bytes(got)


@pytest.mark.parametrize("sender", ["pool", "server"])
async def test_more_than_the_buffer_arrives_whole_and_in_order(sender: str) -> None:
    # The kernel takes a first part at once; send_all sends the rest.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        data = bytes(range(256)) * (8 << 12)  # 8 MiB, every offset distinct mod 256
        async with trio.open_nursery() as nursery:
            received: list[bytes] = []

            async def read() -> None:
                received.append(await _read_all(theirs, len(data)))

            nursery.start_soon(read)
            if sender == "pool":
                await PoolConnection(("http", "h", 80), _stream(ours), None).send(data, 10)  # type: ignore[arg-type]
            else:
                await ServerConnection(_stream(ours), polygate.Serve())._send(data)
        assert received == [data]


@pytest.mark.parametrize("sender", ["pool", "server"])
async def test_a_cancelled_send_writes_nothing(sender: str) -> None:
    # A request whose attempt was cancelled (a hedge loser, a deadline) before its
    # bytes went out must not reach the upstream: cancellation is checked first.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        with trio.CancelScope() as scope:
            scope.cancel()
            if sender == "pool":
                await PoolConnection(("http", "h", 80), _stream(ours), None).send(b"POST / HTTP/1.1\r\n\r\n", None)  # type: ignore[arg-type]
            else:
                await ServerConnection(_stream(ours), polygate.Serve())._send(b"HTTP/1.1 200 OK\r\n\r\n")
        assert scope.cancelled_caught
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(100)


@pytest.mark.parametrize("sender", ["pool", "server"])
async def test_a_write_taken_whole_costs_no_scheduler_pass(sender: str) -> None:
    # Another task made runnable before the send has not run when the send returns:
    # the send did not yield (trio's send_all would have, once).  Two of these per
    # gateway request were ~30 µs of its CPU.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ran: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _note(ran))
            if sender == "pool":
                await PoolConnection(("http", "h", 80), _stream(ours), None).send(b"GET / HTTP/1.1\r\n\r\n", None)  # type: ignore[arg-type]
            else:
                await ServerConnection(_stream(ours), polygate.Serve())._send(b"HTTP/1.1 200 OK\r\n\r\n")
            assert ran == []
        assert ran == ["ran"]
        assert theirs.recv(100).startswith(b"GET" if sender == "pool" else b"HTTP")


async def _note(ran: list[str]) -> None:
    ran.append("ran")


# ------------------------------------------------------------ receive_when_readable
#
# A read whose bytes cannot be there yet (an answer to a request just written, the
# next request on a connection just answered) waits, then reads once; trio's
# receive_some would first try a read bound to fail.  What it must keep of
# receive_some: the bytes, b"" at the end, trio's errors, and a checkpoint.


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


async def test_a_read_that_waits_brings_what_was_sent_then_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    real_read = polygate._sockets.os.read

    def counted(fd: int, n: int) -> bytes:
        reads.append(fd)
        return real_read(fd, n)

    monkeypatch.setattr(polygate._sockets.os, "read", counted)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        stream = _stream(ours)
        async with trio.open_nursery() as nursery:
            got: list[bytes] = []

            async def read() -> None:
                got.append(await receive_when_readable(stream, 100))
                got.append(await receive_when_readable(stream, 100))

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # waiting: nothing was there
            assert reads == []  # and no read tried before the wait
            theirs.send(b"answer")
            await trio.testing.wait_all_tasks_blocked()
            theirs.close()
        assert got == [b"answer", b""]
        assert reads == [ours.fileno()] * 2  # one read a wait


async def test_bytes_already_there_come_too() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.send(b"early")
        assert await receive_when_readable(_stream(ours), 100) == b"early"


async def test_a_reset_connection_is_broken_as_trio_says() -> None:
    client, server = _tcp_pair()
    with client, server:
        # SO_LINGER 0: close sends a reset, and the next read fails ECONNRESET.
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        server.close()
        stream = _stream(client)
        with pytest.raises(trio.BrokenResourceError) as ours:
            await receive_when_readable(stream, 100)
    client2, server2 = _tcp_pair()
    with client2, server2:
        server2.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        server2.close()
        with pytest.raises(trio.BrokenResourceError) as theirs:
            await _stream(client2).receive_some(100)
    assert str(ours.value) == str(theirs.value)


async def test_a_closed_socket_raises_as_trio_says() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        stream = _stream(ours)
        await stream.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await receive_when_readable(stream, 100)


async def test_a_socket_closed_while_it_waits_ends_the_wait() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        stream = _stream(ours)
        raised: list[BaseException] = []
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                try:
                    await receive_when_readable(stream, 100)
                except trio.ClosedResourceError as exc:
                    raised.append(exc)

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await stream.aclose()
        assert len(raised) == 1


async def test_a_cancelled_read_takes_nothing() -> None:
    # A checkpoint first, as receive_some's: a cancelled caller's bytes stay for the
    # next reader, even when they are already there.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.send(b"kept")
        stream = _stream(ours)
        with trio.CancelScope() as scope:
            scope.cancel()
            await receive_when_readable(stream, 100)
        assert scope.cancelled_caught
        assert await stream.receive_some(100) == b"kept"


async def test_a_read_that_waits_is_cancellable_while_it_waits() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        with trio.move_on_after(0.01) as scope:
            await receive_when_readable(_stream(ours), 100)
        assert scope.cancelled_caught


async def test_a_stream_that_is_not_a_socket_is_left_to_receive_some() -> None:
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(b"memory")
    assert await receive_when_readable(receive, 100) == b"memory"


async def test_the_pool_and_the_server_wait_before_their_first_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where the read is bound to wait: an upstream's answer to the request just
    # written, and a kept-alive client's next request once its last was answered.
    from polygate.serve import _http as serve_http
    from polygate.transport import _pool

    used: list[str] = []

    def recorder(where: str):  # type: ignore[no-untyped-def]
        async def receive(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes:
            used.append(where)
            return await receive_when_readable(stream, max_bytes)
        return receive

    monkeypatch.setattr(_pool, "receive_when_readable", recorder("pool"))
    monkeypatch.setattr(serve_http, "receive_when_readable", recorder("server"))
    upstream = polygate.testing.FakeUpstream(polygate.testing.Reply(text="hi", tokens=2))
    async with upstream.serve() as url:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url=url)])},
        )
        from polygate.serve import open_server

        async with open_server(settings, port=0) as server:
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            async with stream:
                body = b'{"model":"chat","messages":[{"role":"user","content":"hi"}]}'
                request = (
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                    b"application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                    + body)
                for _ in range(2):
                    await stream.send_all(request)
                    answer = b""
                    while b'"choices"' not in answer:
                        answer += await stream.receive_some(65536)
                    assert answer.startswith(b"HTTP/1.1 200")
    assert used.count("pool") == 2  # each request's answer
    assert used.count("server") >= 1  # the second request, on the kept-alive connection


@pytest.mark.parametrize("size", [0, -1])
async def test_a_size_below_one_is_refused_as_trio_refuses_it(size: int) -> None:
    # 0 would read b"", which says "the end": trio refuses it, and so does this.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.send(b"waiting")
        with pytest.raises(ValueError):
            await _stream(ours).receive_some(size)
        with pytest.raises(ValueError):
            await receive_when_readable(_stream(ours), size)


async def test_after_a_read_that_emptied_the_socket_the_next_waits_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pool's reads of a body: a read that brought less than it asked for emptied
    # the socket, so the next (a stream's next token) waits before it tries; after a
    # full read more may be there, and it tries first.
    from polygate.transport import _pool

    waited: list[int] = []

    async def recorded(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes:
        waited.append(max_bytes)
        return await receive_when_readable(stream, max_bytes)

    monkeypatch.setattr(_pool, "receive_when_readable", recorded)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        conn = PoolConnection(("http", "h", 80), _stream(ours), None)  # type: ignore[arg-type]
        conn.read_size = 4
        theirs.send(b"0123456789")
        assert await conn.receive(None) == b"0123"  # full: more may be there
        assert await conn.receive(None) == b"4567"
        assert waited == []
        assert await conn.receive(None) == b"89"  # short: the socket is empty
        assert waited == []
        theirs.send(b"ab")
        assert await conn.receive(None) == b"ab"
        assert waited == [4]  # this one waited first
        theirs.close()
        assert await conn.receive_answer(None) == b""
        assert waited == [4, 4]  # an answer's first read always waits first
