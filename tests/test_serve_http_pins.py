"""Behaviours of the gateway server's HTTP handling that no other test pinned.

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through."""

from __future__ import annotations

import json

import attrs
import pytest
import trio

import polygate
from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply
from tests._serve_kit import (
    AUTH,
    CHAT,
    GATEWAY_KEY,
    gateway,
    read_answer,
    request_bytes,
    settings_for,
    wait_for,
)

pytestmark = pytest.mark.integration


def _chat_of_length(n: int) -> bytes:
    """A valid chat body of exactly ``n`` bytes."""
    base = json.dumps({**CHAT, "pad": ""}).encode()
    body = json.dumps({**CHAT, "pad": "x" * (n - len(base))}).encode()
    assert len(body) == n
    return body


async def _post(port: int, body: bytes) -> int:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(request_bytes("POST", "/v1/chat/completions", body, AUTH))
        return (await read_answer(stream)).status


async def test_a_body_of_exactly_max_request_bytes_is_taken() -> None:
    """``max_request_bytes`` is the largest body taken (docs/serve.md: a body *over*
    it is 413): one of exactly that size is answered, one byte more is refused."""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], max_request_bytes=1000)
    async with gateway(Reply(tokens=2), serve=serve) as (server, upstream):
        assert await _post(server.port, _chat_of_length(1000)) == 200
        assert await _post(server.port, _chat_of_length(1001)) == 413
    assert len(upstream.requests) == 1


async def test_a_reload_lowers_the_body_cap_of_a_connection_already_waiting() -> None:
    """A connection kept alive across a reload, waiting for its next request as the
    reload comes, reads that request under the reload's ``max_request_bytes``: the
    413 is decided with the limits ``admit`` brought, not those read_request began with."""
    upstream = FakeUpstream(Reply(tokens=2))
    async with upstream.serve() as url:
        serve = polygate.Serve(api_keys=[GATEWAY_KEY], max_request_bytes=100_000)
        async with open_server(settings_for(url, serve=serve), port=0) as server:
            async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
                body = _chat_of_length(2000)
                await stream.send_all(request_bytes("POST", "/v1/chat/completions", body, AUTH))
                assert (await read_answer(stream)).status == 200
                await wait_for(lambda: len(server._idle) == 1)  # waiting for the next
                await server.reload(settings_for(url, serve=attrs.evolve(serve, max_request_bytes=1000)))
                await stream.send_all(request_bytes("POST", "/v1/chat/completions", body, AUTH))
                answer = await read_answer(stream)
    assert answer.status == 413, answer.body
    assert answer.json()["error"]["code"] == "request_too_large"
    assert len(upstream.requests) == 1


async def test_a_reload_while_a_head_arrives_sets_that_request_s_body_cap() -> None:
    """"The request's body is read under the limits in force when its head came"
    (Server._connection's admit): a reload between a request's first byte and the end
    of its head reaches that request's 413."""
    upstream = FakeUpstream(Reply(tokens=2))
    async with upstream.serve() as url:
        serve = polygate.Serve(api_keys=[GATEWAY_KEY], max_request_bytes=100_000)
        async with open_server(settings_for(url, serve=serve), port=0) as server:
            async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
                data = request_bytes("POST", "/v1/chat/completions", _chat_of_length(2000), AUTH)
                await stream.send_all(data[:10])  # the head's first bytes
                await wait_for(lambda: server.statistics().in_flight == 1 and not server._idle)
                await server.reload(settings_for(url, serve=attrs.evolve(serve, max_request_bytes=1000)))
                await stream.send_all(data[10:])
                answer = await read_answer(stream)
    assert answer.status == 413, answer.body
    assert not upstream.requests


async def test_a_pipelined_partial_head_has_header_timeout_s_not_idle_timeout_s() -> None:
    """A kept-alive connection whose next request's first bytes came pipelined behind
    the last one: its first byte is here, so the head has ``header_timeout_s`` (docs:
    ``idle_timeout_s`` only before its first byte) -- a stalled one is 408 then, not
    after the idle period."""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], idle_timeout_s=30, header_timeout_s=0.5)
    async with gateway(Reply(tokens=2), serve=serve) as (server, _):
        async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
            first = request_bytes("POST", "/v1/chat/completions", CHAT, AUTH)
            await stream.send_all(first + b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\n")
            assert (await read_answer(stream)).status == 200
            start = trio.current_time()
            with trio.fail_after(5):
                late = await read_answer(stream)
            assert late.status == 408
            assert trio.current_time() - start < 3
