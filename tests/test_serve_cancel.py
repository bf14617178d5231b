"""A client that leaves cancels its logical call (SPEC §8.5): the upstream sees its
connection closed within 100 ms, quota and permits are settled, and the telemetry row
says ``cancelled`` -- whether the call was waiting for a first token, for admission,
or streaming.  Raw sockets against a loopback FakeUpstream, real clock."""

from __future__ import annotations

import json
import socket
import sqlite3
from pathlib import Path

import pytest
import trio

import polygate
from polygate.serve import Server
from polygate.testing import FakeUpstream, Reply

from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, gateway, http, request_bytes, wait_for

pytestmark = pytest.mark.integration

ABANDON_LIMIT_S = 0.1  # the bound: the upstream sees the close within 100 ms


async def _open_request(server: Server, body: object) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    await stream.send_all(request_bytes("POST", "/v1/chat/completions", body, AUTH))
    return stream


async def _settled(server: Server) -> None:
    """Every admission of the session is settled: no permit, no open reservation."""
    stats = await server.session.statistics()
    for record in stats.governance.sources:
        state = record.state
        assert state.in_flight == 0, state
        assert state.tokens_reserved == 0, state
        assert state.reserved_total == state.settled_total + state.released_total, state


async def _left(server: Server, upstream: FakeUpstream, client: trio.SocketStream) -> None:
    """The client leaves: its upstream request is abandoned within the bound, and the
    server's call settles everything it held."""
    left_at = trio.current_time()
    await client.aclose()
    await wait_for(lambda: upstream.requests[0].outcome is not None)
    ended_at = upstream.requests[0].ended_at
    assert upstream.requests[0].outcome == "client_closed"
    assert ended_at is not None and ended_at - left_at < ABANDON_LIMIT_S
    await wait_for(lambda: server.statistics().in_flight == 0)
    await _settled(server)


def _results(server: Server) -> dict[str, int]:
    """``polygate_serve_calls_total`` by result (every call is counted, however it ended)."""
    out: dict[str, int] = {}
    for (*_, result), n in server.metrics.calls.items():
        out[result] = out.get(result, 0) + n
    return out


def _call_rows(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT logical_call_id, outcome FROM calls").fetchall()
    conn.close()
    return rows


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_waiting_for_the_first_token(tmp_path: Path, stream: bool) -> None:
    db = tmp_path / "t.db"
    upstream = FakeUpstream(Reply(first_token_s=30))
    async with gateway(upstream, telemetry=f"sqlite:///{db}") as (server, _):
        client = await _open_request(server, {**CHAT, "stream": stream})
        await wait_for(lambda: upstream.in_flight == 1)
        await _left(server, upstream, client)
        call_id = upstream.requests[0].headers["x-polygate-call-id"]
        # The call is in /metrics too, with the attempt it made (which reached the upstream).
        assert _results(server) == {"client_closed": 1}
        assert server.metrics.attempts == {"chat": 1}
    assert _call_rows(db) == [(call_id, "cancelled")]
    assert server.metrics.disconnects == 1


async def test_disconnect_during_an_embeddings_call() -> None:
    upstream = FakeUpstream(Reply(headers_delay_s=30))
    async with gateway(upstream) as (server, _):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        await client.send_all(
            request_bytes("POST", "/v1/embeddings", {"model": "chat", "input": ["x"]}, AUTH))
        await wait_for(lambda: upstream.in_flight == 1)
        await _left(server, upstream, client)
        assert _results(server) == {"client_closed": 1}
        assert server.metrics.requests == {("/v1/embeddings", 499): 1}
    assert server.metrics.disconnects == 1


async def test_disconnect_mid_stream(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    upstream = FakeUpstream(Reply(tokens=200, inter_token_s=0.02))
    async with gateway(upstream, telemetry=f"sqlite:///{db}") as (server, _):
        client = await _open_request(server, {**CHAT, "stream": True})
        received = b""
        with trio.fail_after(5):
            while received.count(b"data: ") < 4:  # role chunk and three tokens
                received += await client.receive_some(65536)
        await _left(server, upstream, client)
        assert _results(server) == {"client_closed": 1}
        assert server.metrics.attempts == {"chat": 1}
    assert [outcome for _, outcome in _call_rows(db)] == ["cancelled"]


async def test_disconnect_while_waiting_for_admission(tmp_path: Path) -> None:
    """Two calls, one permit: the second waits for admission, with keep-alive comments
    on its stream; when its client leaves, it never reaches the upstream."""
    db = tmp_path / "t.db"
    upstream = FakeUpstream(Reply(first_token_s=30))
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], sse_keepalive_s=0.1)
    async with upstream.serve() as url:
        import attrs

        from polygate.serve import open_server

        from ._serve_kit import settings_for

        settings = settings_for(url, serve=serve, telemetry=f"sqlite:///{db}")
        chat = settings.scopes["chat"]
        settings = attrs.evolve(settings, scopes={**settings.scopes, "chat": attrs.evolve(
            chat, sources=[attrs.evolve(chat.sources[0], max_in_flight=1)])})
        async with open_server(settings, port=0) as server:
            first = await _open_request(server, CHAT)
            await wait_for(lambda: upstream.in_flight == 1)
            waiting = await _open_request(server, {**CHAT, "stream": True})
            head = b""
            with trio.fail_after(5):
                while head.count(b": keep-alive") < 2:
                    head += await waiting.receive_some(65536)
            assert head.startswith(b"HTTP/1.1 200")
            assert b"x-polygate-call-id" in head
            await waiting.aclose()
            await wait_for(lambda: server.statistics().in_flight == 1)
            assert len(upstream.requests) == 1
            await first.aclose()
            await wait_for(lambda: server.statistics().in_flight == 0)
            await wait_for(lambda: upstream.in_flight == 0)
            await _settled(server)
    assert sorted(outcome for _, outcome in _call_rows(db)) == ["cancelled", "cancelled"]


async def test_client_that_stops_reading_is_dropped() -> None:
    """A stream whose client never reads fills the socket buffers; after
    ``send_timeout_s`` the gateway gives up on it and cancels the call."""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], send_timeout_s=0.3)
    # 3,000 tokens of 1,000 characters at full speed: more than any socket buffers.
    text = " ".join(["z" * 1000] * 3000)
    upstream = FakeUpstream(Reply(tokens=3000, text=text))
    async with gateway(upstream, serve=serve) as (server, _):
        client = await _open_request(server, {**CHAT, "stream": True})
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await wait_for(lambda: upstream.in_flight == 1)
        await wait_for(lambda: server.statistics().in_flight == 0, limit_s=20)
        assert server.metrics.disconnects == 1
        await wait_for(lambda: upstream.in_flight == 0)
        assert upstream.requests[0].outcome == "client_closed"  # cut, not finished
        await client.aclose()


def _whole(received: bytes) -> bool:
    """A response with a Content-Length, all here."""
    head, sep, body = received.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
               if line.lower().startswith(b"content-length:")]
    return bool(sep) and bool(lengths) and len(body) >= lengths[0]


async def _read_slowly(client: trio.SocketStream, *, size: int, pause_s: float, limit_s: float) -> bytes:
    """Everything until the server closes or ends the body: ``size`` bytes a read, one
    read every ``pause_s`` (a slow, steady reader, never silent for long)."""
    received = bytearray()
    with trio.fail_after(limit_s):
        while not received.endswith(b"\r\n0\r\n\r\n") and not _whole(received):
            try:
                data = await client.receive_some(size)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            received += data
            await trio.sleep(pause_s)  # pacing the reader, not a race
    return bytes(received)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("buffer", "size", "pause_s"), [(4096, 16384, 0.01), (None, 4096, 0.02)])
async def test_a_slow_steady_reader_gets_the_whole_answer(
    stream: bool, buffer: int | None, size: int, pause_s: float
) -> None:
    """``send_timeout_s`` is for a client that stops reading: one that reads a large
    answer slowly but steadily (a small read every 10 or 20 ms, with a small receive
    buffer or the system's) gets it whole, however much longer than the timeout the
    answer takes.  (The timeout used to bound each write whole: the answer was cut
    after ~0.5 s, counted a disconnect.  Then, review: progress counted only as the
    socket turned writable, after ~128 KiB read on loopback, which a reader of
    ~100 KiB per timeout never made.)"""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], send_timeout_s=0.5)
    # 10 tokens of 60,000 characters: 600 KB, streamed in bursts larger than a frame
    # the kernel takes at once.
    text = " ".join(["y" * 60_000] * 10)
    upstream = FakeUpstream(Reply(tokens=10, text=text))
    async with gateway(upstream, serve=serve) as (server, _):
        client = trio.SocketStream(trio.socket.socket())
        if buffer is not None:
            client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        await client.socket.connect(("127.0.0.1", server.port))
        await client.send_all(request_bytes("POST", "/v1/chat/completions", {**CHAT, "stream": stream}, AUTH))
        started = trio.current_time()
        received = await _read_slowly(client, size=size, pause_s=pause_s, limit_s=30)
        took = trio.current_time() - started
        await client.aclose()
        assert server.metrics.disconnects == 0
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    if stream:
        assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    else:
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        assert len(body) == length
        assert json.loads(body)["choices"][0]["message"]["content"] == text
    assert took > 2 * serve.send_timeout_s  # the test means something: slower than the timeout


async def test_a_reader_of_a_byte_now_and_then_is_a_client_that_stopped_reading() -> None:
    """The other side of a slow reader: one that takes a byte every 0.1 s never lets the
    server write more (its side acknowledges nothing new): dropped after
    ``send_timeout_s``, counted a disconnect, its call cancelled."""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], send_timeout_s=0.5)
    text = " ".join(["y" * 60_000] * 10)
    upstream = FakeUpstream(Reply(tokens=10, text=text))
    async with gateway(upstream, serve=serve) as (server, _):
        client = trio.SocketStream(trio.socket.socket())
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await client.socket.connect(("127.0.0.1", server.port))
        await client.send_all(request_bytes("POST", "/v1/chat/completions", {**CHAT, "stream": True}, AUTH))
        with trio.move_on_after(10):
            while True:
                try:
                    if not await client.receive_some(1):
                        break
                except trio.BrokenResourceError:
                    break
                await trio.sleep(0.1)  # pacing the reader, not a race
        await client.aclose()
        await wait_for(lambda: server.statistics().in_flight == 0)
        assert server.metrics.disconnects == 1
        await _settled(server)


async def test_grace_end_tells_a_started_stream_why() -> None:
    """A stream already answered 200 (keep-alive comments while it waits) that the
    drain's grace period cuts ends with a ``shutting_down`` error event."""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], sse_keepalive_s=0.05)
    upstream = FakeUpstream(Reply(first_token_s=30))
    async with gateway(upstream, serve=serve) as (server, _):
        client = await _open_request(server, {**CHAT, "stream": True})
        received = b""
        with trio.fail_after(5):
            while b": keep-alive" not in received:
                received += await client.receive_some(65536)
        with trio.fail_after(10):
            await server.shutdown(grace_s=0.2)
        with trio.fail_after(5):
            while b"0\r\n\r\n" not in received:
                data = await client.receive_some(65536)
                if not data:
                    break
                received += data
        await client.aclose()
        await _settled(server)
    assert b'"code":"shutting_down"' in received
    assert upstream.requests[0].outcome == "client_closed"
    assert _results(server) == {"shutting_down": 1}
    assert server.metrics.attempts == {"chat": 1}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "stream"])
async def test_a_json_call_cut_by_the_drain_is_counted(path: str) -> None:
    """A JSON call (chat or embeddings, or a stream before its head) that the drain's
    grace period cuts is answered 503 ``shutting_down`` and counted so in /metrics,
    with the attempt it made; the answer's headers say so too (review: they said no
    attempt)."""
    upstream = FakeUpstream(Reply(first_token_s=30, headers_delay_s=30))
    body: object = {"model": "chat", "input": ["x"]} if path == "/v1/embeddings" else CHAT
    if path == "stream":
        path, body = "/v1/chat/completions", {**CHAT, "stream": True}
    async with gateway(upstream) as (server, _):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        await client.send_all(request_bytes("POST", path, body, AUTH))
        await wait_for(lambda: upstream.in_flight == 1)
        with trio.fail_after(10):
            await server.shutdown(grace_s=0.2)
        received = b""
        with trio.fail_after(5):
            while data := await client.receive_some(65536):
                received += data
        await client.aclose()
    assert received.startswith(b"HTTP/1.1 503")
    head = received.partition(b"\r\n\r\n")[0].lower()
    assert b"\r\nx-polygate-attempts: 1\r\n" in head  # (no source: nothing won)
    assert _results(server) == {"shutting_down": 1}
    assert server.metrics.attempts == {"chat": 1}


@pytest.mark.parametrize("cut", ["mid_head", "mid_body"])
async def test_a_client_that_leaves_mid_request_is_a_499(cut: str) -> None:
    """Review finding: the end of file in the middle of a head or a body reached h11,
    which called the cut message malformed: counted as a 400 (and one written to a
    closed socket), where docs/serve.md counts a client that left as a 499."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
    if cut == "mid_body":
        head += b"content-length: 100\r\n" + f"authorization: Bearer {GATEWAY_KEY}\r\n\r\n".encode()
        head += b'{"model":'
    async with gateway() as (server, _):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        await client.send_all(head)
        await wait_for(lambda: server.statistics().in_flight == 1)
        await client.aclose()
        await wait_for(lambda: server.statistics().connections == 0)
    label = "other" if cut == "mid_head" else "/v1/chat/completions"
    assert dict(server.metrics.requests) == {(label, 499): 1}
    assert server.metrics.disconnects == 1


@pytest.mark.parametrize("how", ["close", "half-close"])
async def test_a_client_that_leaves_while_its_stream_waits_to_be_read(how: str) -> None:
    """Outside review (2026-12-02): a client that stopped reading, then half-closed,
    left the gateway's frame write waiting out ``send_timeout_s`` (30 s here): its
    call was cancelled at once, but the request stayed in flight, its 499 uncounted,
    and its key's ``max_in_flight`` permit held -- the next request was refused with
    a 429.  A client gone is gone: the waiting write ends with it."""
    key = "sk-gw-limited-0123456789"
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], send_timeout_s=30,
                           keys={"team": polygate.ServeKey(key=key, max_in_flight=1)})
    auth = {"authorization": f"Bearer {key}"}
    upstream = FakeUpstream(Reply(tokens=3000, text=" ".join(["z" * 1000] * 3000)))
    async with gateway(upstream, serve=serve) as (server, _):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        try:
            client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await client.send_all(request_bytes(
                "POST", "/v1/chat/completions", {**CHAT, "stream": True}, auth))
            assert (await client.receive_some(1000)).startswith(b"HTTP/1.1 200")
            # The client reads no more: the buffers fill and a frame's write waits.
            await wait_for(lambda: bool(server._finishing), limit_s=10)
            left = trio.current_time()
            if how == "close":
                await client.aclose()
            else:
                client.socket.shutdown(socket.SHUT_WR)
            await wait_for(lambda: server.statistics().in_flight == 0)
            assert trio.current_time() - left < 1
            assert upstream.requests[0].outcome == "client_closed"
            assert dict(server.metrics.requests) == {("/v1/chat/completions", 499): 1}
            assert server.metrics.disconnects == 1
            with trio.fail_after(5):
                second = await http(server, "POST", "/v1/chat/completions", CHAT, auth)
            assert second.status == 200, second.body[:200]
        finally:
            await client.aclose()


async def test_a_client_that_leaves_before_reading_a_large_answer() -> None:
    """The same for a whole answer too large for the socket's buffers: whether the
    client half-closes before its write began or while it waits, the request ends at
    once (a 499), not after ``send_timeout_s``."""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], send_timeout_s=30)
    upstream = FakeUpstream(Reply(tokens=3000, text=" ".join(["z" * 1000] * 3000)))
    async with gateway(upstream, serve=serve) as (server, _):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        try:
            client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await client.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, AUTH))
            await wait_for(lambda: bool(upstream.requests) and upstream.requests[0].outcome is not None,
                           limit_s=10)
            left = trio.current_time()
            client.socket.shutdown(socket.SHUT_WR)
            await wait_for(lambda: server.statistics().in_flight == 0)
            assert trio.current_time() - left < 1
            assert dict(server.metrics.requests) == {("/v1/chat/completions", 499): 1}
        finally:
            await client.aclose()
