"""The server's one task that watches the clients of every request being answered
(polygate/serve/_hangups.py): what a watcher task per request did, on real sockets.

The disconnect tests (test_serve_cancel.py) show the whole path: a client that leaves
cancels its call, the upstream sees it.  These pin the set itself: end of file and a
reset cancel, pipelined bytes are kept for the next request and stop being read at the
cap, a socket that would stay readable leaves the set (which then never wakes its task
for nothing), and a request on a socket starts no task of its own to be watched."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

import polygate
from polygate.serve._hangups import Hangups
from polygate.serve._http import _MAX_PIPELINED, Connection
from polygate.testing import Reply

from ._serve_kit import AUTH, CHAT, gateway, read_answer, request_bytes, wait_for

pytestmark = pytest.mark.skipif(not Hangups.supported(), reason="epoll is Linux's")


def _connection(server_side: socket.socket) -> Connection:
    """The server's Connection on one end of a socketpair."""
    return Connection(trio.SocketStream(trio.socket.from_stdlib_socket(server_side)),
                      polygate.Serve())


@asynccontextmanager
async def watched(
    *, tcp: bool = False,
) -> AsyncIterator[tuple[Hangups, Connection, socket.socket, list[str]]]:
    """A running set watching one server-side connection; the client's socket; and the
    log of on_close calls.  A socketpair, or with ``tcp`` a loopback TCP connection
    (only TCP has resets)."""
    server_side, client = _tcp_pair() if tcp else socket.socketpair()
    conn = _connection(server_side)
    fd = conn.fileno()
    assert fd is not None
    closed: list[str] = []
    hangups = Hangups()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hangups.run)
            hangups.watch(conn, fd, lambda: closed.append("closed"))
            yield hangups, conn, client, closed
            nursery.cancel_scope.cancel()
    finally:
        hangups.close()
        client.close()
        server_side.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server_side, _ = listener.accept()
    server_side.setblocking(False)
    return server_side, client


def _idle(hangups: Hangups) -> bool:
    """Whether the set's own descriptor is quiet: nothing would wake its task."""
    readable, _, _ = select.select([hangups._epoll.fileno()], [], [], 0)
    return not readable


async def test_end_of_file_cancels_once_and_leaves_the_set() -> None:
    async with watched() as (hangups, conn, client, closed):
        await trio.testing.wait_all_tasks_blocked()
        assert closed == [] and len(hangups) == 1
        client.close()
        await wait_for(lambda: closed == ["closed"])
        assert conn.client_gone and len(hangups) == 0
        assert _idle(hangups)
        await trio.testing.wait_all_tasks_blocked()
        assert closed == ["closed"]


async def test_a_half_close_counts_as_leaving() -> None:
    """As the watcher task did: end of file, whichever way it came."""
    async with watched() as (hangups, _, client, closed):
        client.shutdown(socket.SHUT_WR)
        await wait_for(lambda: closed == ["closed"])
        assert len(hangups) == 0


async def test_a_reset_cancels() -> None:
    """A reset makes the read raise (ECONNRESET), not return end of file."""
    async with watched(tcp=True) as (hangups, conn, client, closed):
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        await wait_for(lambda: closed == ["closed"])
        assert conn.client_gone and len(hangups) == 0


async def test_pipelined_bytes_are_kept_and_still_watched() -> None:
    async with watched() as (hangups, conn, client, closed):
        client.sendall(b"GET /healthz HTTP/1.1\r\nhost: g\r\n\r\n")
        await wait_for(lambda: bool(conn.h11.trailing_data[0]))
        assert conn.h11.trailing_data[0] == b"GET /healthz HTTP/1.1\r\nhost: g\r\n\r\n"
        assert closed == [] and len(hangups) == 1
        await trio.testing.wait_all_tasks_blocked()
        assert _idle(hangups)
        client.close()  # and a leaving after them is still seen
        await wait_for(lambda: closed == ["closed"])


async def test_past_the_pipelining_cap_reading_stops_nothing_spins_and_leaving_still_counts() -> None:
    """Past the cap the watcher task stopped reading, and so never saw its client
    leave.  Here the socket stays in the set for a hang-up only: its unread bytes
    would keep a level-triggered set readable for ever (a spinning task) if it were
    still watched for input."""
    async with watched() as (hangups, conn, client, closed):
        client.setblocking(False)
        chunk = b"x" * 65536
        with trio.fail_after(10):
            while conn.pipelined <= _MAX_PIPELINED:
                try:
                    client.send(chunk)
                except BlockingIOError:
                    await trio.sleep(0.001)
                else:
                    await trio.lowlevel.checkpoint()
        read = conn.pipelined
        assert closed == [] and not conn.client_gone and len(hangups) == 1
        with contextlib.suppress(BlockingIOError):
            client.send(chunk)  # unread bytes: the socket itself stays readable
        fd = conn.fileno()
        assert fd is not None and select.select([fd], [], [], 0)[0]
        await trio.testing.wait_all_tasks_blocked()
        assert _idle(hangups) and conn.pipelined == read  # no more reads, no wake-ups
        assert closed == [] and len(hangups) == 1  # and still watched for leaving
        client.close()
        await wait_for(lambda: closed == ["closed"])
        assert conn.client_gone and len(hangups) == 0 and _idle(hangups)


async def test_an_unwatched_socket_leaves_the_set() -> None:
    """The answer ends (unwatch) in the same batch as the client leaves: the socket
    is out of the set, so its end of file neither cancels anything nor keeps the
    level-triggered set readable."""
    async with watched() as (hangups, conn, client, closed):
        fd = conn.fileno()
        assert fd is not None
        client.close()
        hangups.unwatch(fd, conn)
        hangups.unwatch(fd, conn)  # twice is harmless
        await trio.testing.wait_all_tasks_blocked()
        assert closed == [] and _idle(hangups)


async def test_a_request_on_a_socket_starts_no_task_to_be_watched() -> None:
    """The cost this set removes: a watcher task per request (~80 µs of ~680 µs of
    CPU).  During answers on a socket, the server starts no watch_close task and the
    request's socket is in the set."""
    spawned: list[str] = []

    class Names(trio.abc.Instrument):
        def task_spawned(self, task: trio.lowlevel.Task) -> None:
            spawned.append(task.name)

    async with gateway(Reply(first_token_s=0.2)) as (server, upstream):
        hangups = server._hangups
        assert hangups is not None
        trio.lowlevel.add_instrument(Names())
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, AUTH))
            await wait_for(lambda: upstream.in_flight == 1)
            assert len(hangups) == 1
            answer = await read_answer(stream)
        assert answer.status == 200
        await wait_for(lambda: len(hangups) == 0)
    assert spawned and not [name for name in spawned if "watch_close" in name]


async def test_a_socket_the_set_cannot_take_is_watched_by_a_task_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel may refuse a registration (out of memory, say): that request is
    still answered, and its client still watched -- by a task of its own."""
    async with gateway(Reply(first_token_s=30)) as (server, upstream):
        hangups = server._hangups
        assert hangups is not None
        monkeypatch.setattr(hangups, "_epoll", _Refusing(hangups._epoll))
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, AUTH))
        await wait_for(lambda: upstream.in_flight == 1)
        assert len(hangups) == 0
        await stream.aclose()
        await wait_for(lambda: upstream.requests[0].outcome is not None)
        assert upstream.requests[0].outcome == "client_closed"


class _Refusing:
    """An epoll set whose register() fails; the rest is the real set's."""

    def __init__(self, real: select.epoll) -> None:
        self._real = real

    def register(self, fd: int, events: int) -> None:
        raise OSError(12, "Cannot allocate memory")

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def test_a_closed_set_takes_nothing() -> None:
    hangups = Hangups()
    a, b = socket.socketpair()
    with a, b:
        conn = _connection(a)
        hangups.close()
        assert hangups.watch(conn, a.fileno(), lambda: None) is False
        hangups.unwatch(a.fileno(), conn)  # harmless


async def test_a_late_unwatch_leaves_the_next_owner_of_the_number_alone() -> None:
    """Found by review, not reachable through the server today (it unwatches before it
    closes): a socket closed while watched frees its number, a new connection gets
    it, and the old request's unwatch must not take the new one out of the set."""
    hangups = Hangups()
    closed: list[str] = []
    a_server, a_client = socket.socketpair()
    old = _connection(a_server)
    fd = a_server.fileno()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hangups.run)
            assert hangups.watch(old, fd, lambda: closed.append("old"))
            a_server.close()
            b_server, b_client = socket.socketpair()
            with b_server, b_client:
                if b_server.fileno() != fd:
                    pytest.skip("the kernel did not reuse the descriptor's number")
                new = _connection(b_server)
                assert hangups.watch(new, fd, lambda: closed.append("new"))
                hangups.unwatch(fd, old)  # the old request's finally
                assert len(hangups) == 1
                b_client.close()
                await wait_for(lambda: closed == ["new"])
            nursery.cancel_scope.cancel()
    finally:
        hangups.close()
        a_client.close()


async def test_no_epoll_set_at_start_means_a_task_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: out of descriptors at start, the set could not be made and the
    server did not start at all.  It starts, and watches each client with a task."""
    import polygate.serve._hangups as module

    def refuse() -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(module.select, "epoll", refuse)
    async with gateway(Reply(first_token_s=30)) as (server, upstream):
        assert server._hangups is None
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, AUTH))
        await wait_for(lambda: upstream.in_flight == 1)
        await stream.aclose()
        await wait_for(lambda: upstream.requests[0].outcome is not None)
        assert upstream.requests[0].outcome == "client_closed"


def test_reading_pipelined_bytes_costs_no_copy_of_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: each read while a request is answered asked h11 for
    trailing_data, a copy of its whole buffer, so a client trickling bytes up to the
    1 MiB cap cost a copy per read of up to 1 MiB: quadratic.  The cap still holds."""
    import h11

    copies = 0
    real = h11.Connection.trailing_data

    def counted(self: h11.Connection) -> tuple[bytes, bool]:
        nonlocal copies
        copies += 1
        return real.fget(self)  # type: ignore[no-any-return,attr-defined]

    a, b = socket.socketpair()
    with a, b:
        conn = _connection(a)
        monkeypatch.setattr(h11.Connection, "trailing_data", property(counted))
        piece = b"x" * 1024
        reads = 0
        while conn.took(piece, lambda: None):
            reads += 1
        assert reads == _MAX_PIPELINED // len(piece)
        assert copies == 0
