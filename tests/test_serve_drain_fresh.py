"""A drain and the connections accepted just before it.

Found running two replicas with every real backend and a SIGTERM mid-load: a client's
connect was accepted, the drain began, and the request it then wrote met a closed
connection (an EOF or a reset, nothing counted, no telemetry row), although the grace
period had seconds left.  The drain closed every connection waiting for a request,
those that had never sent one too.  Now one accepted less than ``_FIRST_REQUEST_S``
ago may still begin its request, which is then in flight and answered; idle
keep-alive connections, and older silent ones, are closed at once as before."""

from __future__ import annotations

import contextlib

import pytest
import trio

import polygate.serve._server as server_module
from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply

from ._serve_kit import AUTH, CHAT, read_until_closed, request_bytes, settings_for, wait_for

pytestmark = pytest.mark.timeout(120)


async def test_a_request_written_just_after_its_connect_is_answered_through_a_drain() -> None:
    """Scheduling-aware: the drain begins 0-3 passes of the scheduler after the accept,
    and the client writes its request 0-3 passes after the drain began.  Before, every
    case where the connection's task had not yet read when the drain began (two or
    more passes) ended unanswered."""
    upstream = FakeUpstream(Reply(tokens=2))
    outcomes: dict[tuple[int, int], bytes] = {}
    async with upstream.serve() as url:
        for accepted in range(4):
            for written in range(4):
                async with open_server(settings_for(url), port=0) as server:
                    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
                    for _ in range(accepted):
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(server.shutdown, 5)
                        for _ in range(written):
                            await trio.lowlevel.cancel_shielded_checkpoint()
                        await stream.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, AUTH))
                        outcomes[accepted, written] = await read_until_closed(stream)
                    await stream.aclose()
                    assert server.statistics().connections == 0
    unanswered = {case: got[:40] for case, got in outcomes.items() if not got.startswith(b"HTTP/1.1 200")}
    assert not unanswered, unanswered
    assert all(b"connection: close" in got.lower() for got in outcomes.values())


@pytest.mark.parametrize("silent_for", [0.0, 0.3])
async def test_a_connection_that_sends_nothing_holds_the_drain_at_most_its_moment(
    monkeypatch: pytest.MonkeyPatch, silent_for: float,
) -> None:
    """Silent, it is closed unanswered once its moment has passed: the drain, with
    nothing in flight, ends within it, not at the end of the grace period; and at once
    for one silent longer than that (a client's pool that opened it long ago: idle,
    as a kept-alive one is)."""
    monkeypatch.setattr(server_module, "_FIRST_REQUEST_S", 0.2)
    upstream = FakeUpstream(Reply())
    async with upstream.serve() as url:
        async with open_server(settings_for(url), port=0) as server:
            silent = await trio.open_tcp_stream("127.0.0.1", server.port)
            await wait_for(lambda: server.statistics().connections == 1)
            await trio.sleep(silent_for)  # (ages it, not a race)
            start = trio.current_time()
            with trio.fail_after(10):
                await server.shutdown(grace_s=30)
            took = trio.current_time() - start
            assert await read_until_closed(silent, limit_s=5) == b""
            await silent.aclose()
    assert took < (0.15 if silent_for else 0.2 + 0.5), took


async def test_two_drains_at_once_both_end_when_the_last_call_lands() -> None:
    """Review: each wait for the drain's state made an event of its own, and a second
    drain's replaced the first's, which then waited out the whole grace period."""
    upstream = FakeUpstream(Reply(first_token_s=0.3, tokens=2))
    async with upstream.serve() as url:
        async with open_server(settings_for(url), port=0) as server:
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            await stream.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, AUTH))
            await wait_for(lambda: server.statistics().in_flight == 1)
            took: list[float] = []

            async def drain() -> None:
                start = trio.current_time()
                await server.shutdown(grace_s=20)
                took.append(trio.current_time() - start)

            with trio.fail_after(40):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain)
                    await trio.sleep(0.05)  # (the second begins while the first waits)
                    nursery.start_soon(drain)
                    got = await read_until_closed(stream)
            await stream.aclose()
    assert got.startswith(b"HTTP/1.1 200")
    assert len(took) == 2 and max(took) < 3.0, took


@pytest.mark.parametrize(("moment", "older_by", "writes_at"), [
    # Review: while one fresh connection was open, every silent one was kept as long
    # as it, one silent since before the drain too, and a request it then wrote was
    # answered.
    (0.5, 0.7, 0.2),
    # Review: then each was kept until the newest one's moment ended, so an older one
    # whose moment passed during the drain's wait was still answered.
    (1.0, 0.6, 0.8),
])
async def test_a_silent_connection_past_its_moment_is_closed_beside_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, moment: float, older_by: float, writes_at: float,
) -> None:
    """A connection opened ``older_by`` seconds before a fresh one (and the drain)
    writes its request ``writes_at`` seconds into the drain, past its own ``moment``:
    it meets a closed connection, as the fresh one, silent, does."""
    monkeypatch.setattr(server_module, "_FIRST_REQUEST_S", moment)
    upstream = FakeUpstream(Reply(tokens=2))
    async with upstream.serve() as url:
        async with open_server(settings_for(url), port=0) as server:
            old = await trio.open_tcp_stream("127.0.0.1", server.port)
            await trio.sleep(older_by)  # (ages, not a race)
            new = await trio.open_tcp_stream("127.0.0.1", server.port)
            await wait_for(lambda: server.statistics().connections == 2)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.shutdown, 30)
                await trio.sleep(writes_at)
                with contextlib.suppress(trio.BrokenResourceError):
                    await old.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, AUTH))
                got = await read_until_closed(old)
                assert await read_until_closed(new) == b""
            await old.aclose()
            await new.aclose()
    assert not got.startswith(b"HTTP/"), got[:60]
