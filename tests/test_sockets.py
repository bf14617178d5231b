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
from polygate._sockets import write_now
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
