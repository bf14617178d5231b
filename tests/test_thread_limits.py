"""polygate never needs a token of trio's default thread limiter, and its connects race
a name's addresses as trio's own do (``polygate/transport/_eyeballs.py``).

The application's threads share trio's default limiter (40 tokens): a FastAPI ``def``
endpoint on anyio's trio backend, or any thread that calls polygate through
``trio.from_thread.run``, holds one while it waits for its call.  Review (trio web
applications): 40 such threads waiting took every token, and the thread their calls
needed -- trio's own lookup of a source's host name before its connect, a SQLite
cache's read, the telemetry store's opening -- never started: every call waited for
ever (or for its deadline).  Loopback servers, real clock."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply
from polygate.transport._eyeballs import DELAY_S, connect, ordered

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

MSG = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def default_limiter_taken() -> AsyncIterator[None]:
    """Every token of trio's default thread limiter held, as 40 application threads
    waiting on polygate's calls hold them."""
    limiter = trio.to_thread.current_default_thread_limiter()
    total = limiter.total_tokens
    holder = object()
    limiter.total_tokens = 1
    await limiter.acquire_on_behalf_of(holder)
    try:
        yield
    finally:
        limiter.release_on_behalf_of(holder)
        limiter.total_tokens = total


@pytest.mark.parametrize("case", ["a host name", "a SQLite cache", "SQLite telemetry"])
async def test_a_call_needs_no_token_of_trios_default_thread_limiter(case: str, tmp_path: Path) -> None:
    up = FakeUpstream(Reply(text="answered"))
    async with up.serve() as url:
        host = "localhost" if case == "a host name" else "127.0.0.1"
        scope = polygate.Scope(
            sources=[polygate.Source(name="a", base_url=url.replace("127.0.0.1", host), model="m")],
            cache_ttl_s=60 if case == "a SQLite cache" else None,
        )
        settings = polygate.Settings(
            scopes={"chat": scope},
            cache=f"sqlite:///{tmp_path / 'cache.db'}" if case == "a SQLite cache" else "off",
            telemetry=f"sqlite:///{tmp_path / 'telemetry.db'}" if case == "SQLite telemetry" else "off",
        )
        async with default_limiter_taken():
            with trio.fail_after(20):  # (before: for ever, the session's opening included)
                async with polygate.session(settings) as s:
                    r = await s.chat(MSG, call_deadline_s=10)
    assert r.text == "answered"


def test_ordered_puts_the_first_address_of_the_other_family_second() -> None:
    """RFC 6555, section 5.4, as trio orders them: the second attempt is of the other
    family, so a name whose IPv6 addresses black-hole connects over IPv4 in 250 ms."""
    v6 = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (f"::{i}", 80, 0, 0)) for i in (1, 2, 3)]
    v4 = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.0.0.{i}", 80)) for i in (1, 2)]
    assert ordered([*v6, *v4]) == [v6[0], v4[0], v6[1], v6[2], v4[1]]
    assert ordered([v4[0], v6[0], v4[1]]) == [v4[0], v6[0], v4[1]]
    assert ordered(v4) == v4
    assert ordered([]) == []


def _target(sock: socket.socket) -> tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[str, int]]:
    return (socket.AF_INET, socket.SOCK_STREAM, 6, "", sock.getsockname())


def _listener(backlog: int = 5) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


def _closed_port() -> socket.socket:
    """A bound socket that does not listen: a connect to it is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def test_a_refused_address_gives_way_to_the_next_at_once() -> None:
    with _closed_port() as dead, _listener() as live:
        t0 = time.monotonic()
        stream = await connect("name", 1, [_target(dead), _target(live)])
        elapsed = time.monotonic() - t0
        async with stream:
            assert stream.socket.getpeername() == live.getsockname()
    assert elapsed < DELAY_S  # (a failure starts the next attempt without the delay)


async def test_a_black_holed_address_gives_way_after_the_delay_and_is_closed() -> None:
    """A connect that hangs (here: a listener whose accept queue is full drops the
    SYN) does not hold the next address up for more than the delay, and loses."""
    with _listener(backlog=0) as full, _listener() as live, socket.create_connection(full.getsockname()):
        t0 = time.monotonic()
        stream = await connect("name", 1, [_target(full), _target(live)])
        elapsed = time.monotonic() - t0
        async with stream:
            assert stream.socket.getpeername() == live.getsockname()
    assert DELAY_S * 0.9 <= elapsed < 2.0, elapsed


async def test_when_every_address_fails_the_error_is_trios() -> None:
    """``OSError("all attempts to connect to HOST:PORT failed")`` from a group of each
    attempt's error, as trio's ``open_tcp_stream`` raises it (polygate's error
    reports look through that shape for the operating system's reasons)."""
    with _closed_port() as one, _closed_port() as two:
        with pytest.raises(OSError, match=r"^all attempts to connect to name:1 failed$") as caught:
            await connect("name", 1, [_target(one), _target(two)])
    group = caught.value.__cause__
    assert isinstance(group, ExceptionGroup)
    assert [type(e) for e in group.exceptions] == [ConnectionRefusedError, ConnectionRefusedError]
    with _closed_port() as one, pytest.raises(OSError, match=r"to \[::1\]:2 failed"):
        await connect("::1", 2, [_target(one)])


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_cancelled_connect_leaves_no_socket_open() -> None:
    with _listener(backlog=0) as full, socket.create_connection(full.getsockname()):
        before = _open_descriptors()
        with trio.move_on_after(DELAY_S * 3):
            await connect("name", 1, [_target(full), _target(full)])
        assert _open_descriptors() == before
