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
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply
from polygate.transport._eyeballs import DELAY_S, connect, ordered

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

MSG = [{"role": "user", "content": "hi"}]


def default_limiter_taken() -> AbstractAsyncContextManager[None]:
    """Every token of trio's default thread limiter held, as 40 application threads
    waiting on polygate's calls hold them."""
    return limiter_taken(trio.to_thread.current_default_thread_limiter())


@asynccontextmanager
async def limiter_taken(limiter: trio.CapacityLimiter) -> AsyncIterator[None]:
    """Every token of ``limiter`` held while inside."""
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


def _target(ip: str, port: int = 0) -> tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[str, int]]:
    return (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))


def _port() -> int:
    """A port free on 127.0.0.1 and 127.0.0.2 (two addresses of one name, one port)."""
    while True:
        with socket.socket() as one:
            one.bind(("127.0.0.1", 0))
            port = one.getsockname()[1]
            with socket.socket() as two:
                try:
                    two.bind(("127.0.0.2", port))
                except OSError:
                    continue
                return int(port)


def _listener(ip: str, port: int, backlog: int = 5) -> socket.socket:
    sock = socket.socket()
    sock.bind((ip, port))
    sock.listen(backlog)
    return sock


async def test_a_refused_address_gives_way_to_the_next_at_once() -> None:
    port = _port()
    with _listener("127.0.0.2", port) as live:  # (nothing on 127.0.0.1: refused)
        t0 = time.monotonic()
        stream = await connect("name", port, [_target("127.0.0.1"), _target("127.0.0.2")])
        elapsed = time.monotonic() - t0
        async with stream:
            assert stream.socket.getpeername() == live.getsockname()
    assert elapsed < DELAY_S  # (a failure starts the next attempt without the delay)


async def test_a_black_holed_address_gives_way_after_the_delay_and_is_closed() -> None:
    """A connect that hangs (here: a listener whose accept queue is full drops the
    SYN) does not hold the next address up for more than the delay, and loses."""
    port = _port()
    with _listener("127.0.0.1", port, backlog=0) as full, _listener("127.0.0.2", port) as live, \
            socket.create_connection(full.getsockname()):
        t0 = time.monotonic()
        stream = await connect("name", port, [_target("127.0.0.1"), _target("127.0.0.2")])
        elapsed = time.monotonic() - t0
        async with stream:
            assert stream.socket.getpeername() == live.getsockname()
    assert DELAY_S * 0.9 <= elapsed < 2.0, elapsed


async def test_when_every_address_fails_the_error_is_trios() -> None:
    """``OSError("all attempts to connect to HOST:PORT failed")`` from a group of each
    attempt's error, as trio's ``open_tcp_stream`` raises it (polygate's error
    reports look through that shape for the operating system's reasons)."""
    port = _port()
    with pytest.raises(OSError, match=rf"^all attempts to connect to name:{port} failed$") as caught:
        await connect("name", port, [_target("127.0.0.1"), _target("127.0.0.2")])
    group = caught.value.__cause__
    assert isinstance(group, ExceptionGroup)
    assert [type(e) for e in group.exceptions] == [ConnectionRefusedError, ConnectionRefusedError]
    with pytest.raises(OSError, match=rf"to \[::1\]:{port} failed"):
        await connect("::1", port, [_target("127.0.0.1")])


async def test_the_port_is_the_one_asked_for() -> None:
    """The addresses of a name's lookup carry the port it was asked with; a connect
    to another port of that name goes to that port."""
    port = _port()
    with _listener("127.0.0.1", port) as live:
        stream = await connect("name", port, [_target("127.0.0.1", port + 1 if port < 65535 else 1)])
        async with stream:
            assert stream.socket.getpeername() == live.getsockname()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_cancelled_connect_leaves_no_socket_open() -> None:
    port = _port()
    with _listener("127.0.0.1", port, backlog=0) as full, socket.create_connection(full.getsockname()):
        before = _open_descriptors()
        with trio.move_on_after(DELAY_S * 3):
            await connect("name", port, [_target("127.0.0.1"), _target("127.0.0.1")])
        assert _open_descriptors() == before


async def test_two_sources_on_one_host_name_reach_their_own_ports() -> None:
    """Review: the addresses a name's lookup found carry the port it was asked with,
    and were reused for any port: a second source on the same name (vLLM on :8000
    and :8001, chat and embeddings on two ports) got the first one's server."""
    a, b = FakeUpstream(Reply(text="from A")), FakeUpstream(Reply(text="from B"))
    async with a.serve() as url_a, b.serve() as url_b:
        settings = polygate.Settings(scopes={
            "a": polygate.Scope(sources=[polygate.Source(name="a", base_url=url_a.replace("127.0.0.1", "localhost"), model="m")]),
            "b": polygate.Scope(sources=[polygate.Source(name="b", base_url=url_b.replace("127.0.0.1", "localhost"), model="m")]),
        })
        with trio.fail_after(20):
            async with polygate.session(settings) as s:
                answers = [(await s.chat(MSG, scope=scope, call_deadline_s=10)).text for scope in "abab"]
    assert answers == ["from A", "from B", "from A", "from B"]


async def test_a_socket_that_cannot_be_made_is_that_addresss_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: ``socket()`` was made outside the attempt's error handling, so a
    kernel without IPv6 (or a process out of descriptors: the pool then closes its
    idle connections and tries again) failed the whole connect with a bare group,
    where trio's race goes on to the next address."""
    make = trio.socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: object, **kwargs: object) -> trio.socket.SocketType:
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return make(family, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trio.socket, "socket", no_ipv6)
    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))
    port = _port()
    with _listener("127.0.0.1", port) as live:
        stream = await connect("dual", port, [v6, _target("127.0.0.1")])
        async with stream:
            assert stream.socket.getpeername() == live.getsockname()
    with pytest.raises(OSError, match=f"all attempts to connect to dual:{port} failed") as caught:
        await connect("dual", port, [v6])
    assert isinstance(caught.value.__cause__, ExceptionGroup)
    assert caught.value.__cause__.exceptions[0].errno == 97


def test_a_host_name_under_a_mock_clock() -> None:
    """Review: the lookup's thread ran without holding a ``MockClock`` still, so under
    ``autojump_threshold=0`` (how users test) virtual time jumped to the call's
    deadline while the resolver answered: a source by name always timed out."""
    import trio.testing

    async def main() -> list[str]:
        up = FakeUpstream(Reply(text="ok"))
        async with up.serve() as url:
            settings = polygate.Settings(scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=url.replace("127.0.0.1", "localhost"), model="m")])})
            results: list[str] = []
            async with polygate.session(settings) as s:
                async def one() -> None:
                    try:
                        results.append((await s.chat(MSG, call_deadline_s=30)).text)
                    except polygate.PolygateError as exc:
                        results.append(type(exc).__name__)

                for _ in range(2):
                    async with trio.open_nursery() as nursery:
                        for _ in range(5):
                            nursery.start_soon(one)
                    await trio.sleep(10)  # (virtual: past the addresses' reuse)
        return results

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == ["ok"] * 10


def test_a_lookup_that_never_answers_does_not_hold_a_mock_clocks_deadline_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: the lookup held a ``MockClock`` still for as long as the resolver took,
    and a resolver that never answers held the call's deadline back for ever.  It
    holds the clock for a second of real time, then virtual time goes on."""
    import threading

    import trio.testing

    release = threading.Event()
    real = socket.getaddrinfo

    def hanging(host: str, *args: object, **kwargs: object) -> object:
        if host == "hang.example":
            release.wait(30)  # (a resolver that does not answer)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://hang.example:9/v1", model="m")])})

    async def main() -> tuple[str, float]:
        async with polygate.session(settings) as s:
            start = trio.current_time()
            try:
                await s.chat(MSG, call_deadline_s=5)
            except polygate.PolygateError as exc:
                return type(exc).__name__, trio.current_time() - start
        return "answered", 0.0

    t0 = time.monotonic()
    try:
        outcome, virtual = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        release.set()
    assert (outcome, virtual) == ("DeadlineExceeded", pytest.approx(5.0))
    assert time.monotonic() - t0 < 10


async def test_an_ocr_renderer_process_starts_with_every_default_token_taken() -> None:
    """Review (trio web applications): trio starts a process from a thread of its
    default limiter, so an OCR call's renderer waited for one of the application's
    threads to finish -- under a shield, past its deadline: for ever."""
    from polygate.testing import Router

    from .test_ocr import make_pdf, ocr_settings

    up = FakeUpstream(Reply(text="page"))
    async with default_limiter_taken():
        with trio.fail_after(30):  # (before: for ever)
            async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
                r = await s.ocr(make_pdf([(100, 100)]), call_deadline_s=20)
    assert [page.text for page in r.pages] == ["page"]


async def test_a_renderer_process_start_waiting_for_a_thread_is_cancellable() -> None:
    """No unbounded shield: a start that waits for a thread (every one of polygate's
    own taken) is cut by its call's cancellation, and no process is left behind."""
    from polygate import _ocr_renderers
    from polygate._threads import own_limiter

    async with limiter_taken(own_limiter()):
        with trio.move_on_after(0.5) as cut:
            await _ocr_renderers._ProcessWorker.start()
    assert cut.cancelled_caught
