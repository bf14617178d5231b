"""polygate against real loopback HTTP servers: the real clock, real sockets.

The FakeUpstream servers run inside the test's own ``trio.run`` (so cancellation and
time are real and MockClock is never mixed with sockets); one test drives a server in
a separate process, as users would.  Margins are generous: these tests assert order
and bounds, never tight timings.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply

from .conftest import MESSAGES, SECRET, TRANSCRIPTS

pytestmark = pytest.mark.integration


@asynccontextmanager
async def serving(**upstreams: FakeUpstream) -> AsyncIterator[dict[str, str]]:
    urls: dict[str, str] = {}
    async with trio.open_nursery() as nursery:
        for name, up in upstreams.items():
            ready = trio.Event()

            async def run(up: FakeUpstream = up, name: str = name, ready: trio.Event = ready) -> None:
                async with up.serve() as url:
                    urls[name] = url
                    ready.set()
                    await trio.sleep_forever()

            nursery.start_soon(run)
            await ready.wait()
        try:
            yield urls
        finally:
            nursery.cancel_scope.cancel()


def settings_for(urls: dict[str, str], *, weights: dict[str, float] | None = None,
                 source: dict[str, Any] | None = None, **scope: Any) -> polygate.Settings:
    w = weights or {}
    sources = [
        polygate.Source(name=n, base_url=u, api_key=SECRET, weight=w.get(n, 1.0), **(source or {}))
        for n, u in urls.items()
    ]
    return polygate.Settings(scopes={
        "chat": polygate.Scope(sources=sources, **scope),
        "embed": polygate.Scope(sources=sources, embed_batch_size=4),
    })


async def wait_until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    with trio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110 - a counter of the fake: no event to wait on
            await trio.sleep(0.01)


async def test_chat_stream_and_embed_over_real_sockets() -> None:
    up = FakeUpstream(Reply(text="hello over the wire", first_token_s=0.05, inter_token_s=0.01))
    async with serving(a=up) as urls, polygate.session(settings_for(urls)) as s:
        r = await s.chat(MESSAGES)
        assert r.text == "hello over the wire"
        assert r.usage is not None and r.usage.source == "upstream"
        assert r.call_stats.ttft_ms is not None and r.call_stats.ttft_ms >= 40
        async with s.stream_chat(MESSAGES) as stream:
            texts = [c.text async for c in stream]
        assert "".join(texts) == "hello over the wire"
        e = await s.embed([f"x{i}" for i in range(10)])
        assert len(e.vectors) == 10 and e.call_stats.attempts == 3
    assert up.in_flight == 0
    assert up.requests[0].headers["authorization"] == f"Bearer {SECRET}"


async def test_connections_are_reused() -> None:
    up = FakeUpstream(Reply(tokens=3))
    async with serving(a=up) as urls, polygate.session(settings_for(urls)) as s:
        for _ in range(30):
            await s.chat(MESSAGES)
        assert up.statistics().connections <= 2


async def test_hedge_over_real_sockets_cancels_the_loser() -> None:
    slow = FakeUpstream(Reply(first_token_s=30))
    fast = FakeUpstream(Reply(first_token_s=0.05, tokens=4))
    async with serving(a=slow, b=fast) as urls:
        settings = settings_for(urls, weights={"a": 1.0, "b": 1e-9}, hedge=polygate.Hedge(after_s=0.3))
        async with polygate.session(settings) as s:
            with trio.fail_after(10):
                r = await s.chat(MESSAGES)
            await wait_until(lambda: slow.in_flight == 0)  # the server sees the disconnect
    assert r.call_stats.hedge_won and r.source == "b"
    assert 250 <= r.call_stats.total_latency_ms < 5000
    assert slow.requests[0].outcome == "client_closed"


async def test_deadline_closes_the_connection() -> None:
    up = FakeUpstream(Reply(fault="silent"))
    async with serving(a=up) as urls:
        async with polygate.session(settings_for(urls, call_deadline_s=0.5)) as s:
            start = trio.current_time()
            with pytest.raises(polygate.DeadlineExceeded):
                await s.chat(MESSAGES)
            assert trio.current_time() - start < 5
        await wait_until(lambda: up.in_flight == 0)
    assert up.requests[0].outcome == "client_closed"


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        (Reply(fault="reset", fault_after=2), "transport error"),
        (Reply(fault="truncated", fault_after=2), "truncated"),
        (Reply(fault="truncated", stream=False), "transport error"),
        (Reply(fault="html"), "not JSON"),
        (Reply(status=502), "HTTP 502"),
        (Reply(fault="oversized", oversized_bytes=300_000, fault_after=1), "line cap"),
    ],
)
async def test_faults_over_real_sockets(reply: Reply, needle: str) -> None:
    up = FakeUpstream(reply)
    async with serving(a=up) as urls:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=urls["a"])],
                retry=polygate.Retry(max_attempts=1))},
            max_line_bytes=100_000,
        )
        async with polygate.session(settings) as s:
            with trio.fail_after(10), pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
        await wait_until(lambda: up.in_flight == 0)
    (error,) = info.value.errors
    assert isinstance(error, polygate.TransientUpstreamError)
    assert needle in str(error)


async def test_ttft_timeout_with_keepalives_over_real_sockets() -> None:
    up = FakeUpstream(Reply(first_token_s=30, keepalive_s=0.05))
    async with serving(a=up) as urls:
        settings = settings_for(urls, source={"ttft_timeout_s": 0.5}, retry=polygate.Retry(max_attempts=1))
        async with polygate.session(settings) as s:
            start = trio.current_time()
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
            assert 0.4 < trio.current_time() - start < 5  # keep-alives did not extend it


async def test_transcript_over_real_http() -> None:
    body = (TRANSCRIPTS / "12-deepseek-stream-reasoning-content-usage.sse").read_bytes()

    async def handler(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        head, _, rest = request.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + body
        )
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        urls = {"a": f"http://127.0.0.1:{port}/v1"}
        async with polygate.session(settings_for(urls)) as s:
            r = await s.chat(MESSAGES)
        nursery.cancel_scope.cancel()
    assert r.text == "Hello there! 😊 How can I help you today?"
    assert r.usage is not None and r.usage.completion_tokens == 212


async def test_out_of_process_server() -> None:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "polygate.testing.serve", "--port", "0", "--reply", '{"tokens": 4}'],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(1)
        url = line.decode().strip().removeprefix("listening on ")
        async with polygate.session(settings_for({"a": url})) as s:
            results = [await s.chat(MESSAGES) for _ in range(5)]
        assert all(r.text for r in results)
    finally:
        proc.terminate()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()
