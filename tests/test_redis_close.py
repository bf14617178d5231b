"""A session on Redis closing under calls it did not see finish (outside review,
2026-12-02): calls that outlive their session (in tasks outside its block: the
caller's mistake) neither hold their shared permits until their leases run out nor
retry their settles against a closed client past their deadlines, and the figures
of a closed session stay readable.  Real redis-server, real clock."""

from __future__ import annotations

import asyncio
import gc
import secrets
from typing import Any

import pytest
import trio

import polygate
import polygate.aio
from polygate.governance._redis import RedisBackend, parse_redis_url
from polygate.testing import FakeUpstream, Reply

from . import _redis_server
from ._redis_server import RedisServer

pytestmark = pytest.mark.integration
redis_server = _redis_server.redis_server  # the fixture

MESSAGES = [{"role": "user", "content": "hi"}]


def _settings(url: str) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)])}, backend=url)


def _url(redis_server: RedisServer) -> str:
    return f"{redis_server.url}?prefix=close{secrets.token_hex(4)}"


async def _held(url: str) -> tuple[int, int]:
    """(in_flight, tokens_reserved) as another process sees them."""
    backend = RedisBackend(parse_redis_url(url))
    await backend.start()
    try:
        snapshot = await backend.snapshot("chat", "a")
    finally:
        await backend.aclose()
    return snapshot.in_flight, snapshot.tokens_reserved


async def test_a_call_that_outlives_its_session_returns_its_permit(redis_server: RedisServer) -> None:
    """The call's answer comes at 0.5 s; its session closed at 0.1 s.  Its settle was
    retried against the closed client for ``settle_s`` (past the 0.8 s deadline), and
    its permit stayed held in Redis, for every process, until its lease ran out."""
    url = _url(redis_server)
    up = FakeUpstream(Reply(tokens=2, headers_delay_s=0.5))
    result: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        async with polygate.session(_settings(url), transport=up.transport()) as s:

            async def call() -> None:
                start = trio.current_time()
                result["answer"] = await s.chat(MESSAGES, call_deadline_s=0.8)
                result["took"] = trio.current_time() - start

            nursery.start_soon(call)
            with trio.fail_after(5):
                while not up.requests:  # noqa: ASYNC110 - the fake's record: no event
                    await trio.sleep(0.01)
        assert await _held(url) == (0, 0)  # settled as the session closed
    gc.collect()  # (a leaked client's streams would warn here: an error in this suite)
    assert isinstance(result["answer"], polygate.ChatResponse)
    assert result["took"] < 0.8
    assert await _held(url) == (0, 0)


async def test_the_figures_of_a_closed_session_stay_readable(redis_server: RedisServer) -> None:
    url = _url(redis_server)
    async with polygate.session(_settings(url), transport=FakeUpstream(Reply()).transport()) as s:
        await s.chat(MESSAGES)
        live = await s.statistics()
    after = await s.statistics()
    assert after.governance.sources[0].state.requests_in_window == 1
    assert after.governance == live.governance


def test_an_aio_session_on_redis_closes_cleanly(redis_server: RedisServer) -> None:
    """The asyncio door reads the closed trio session's statistics: the closed backend
    built a connection on its exited pool for it (never closed: ResourceWarnings)."""
    url = _url(redis_server)

    async def main() -> Any:
        async with polygate.aio.session(_settings(url), transport=FakeUpstream(Reply()).transport()) as s:
            await s.chat(MESSAGES)
        return await s.statistics()

    final = asyncio.run(main())
    gc.collect()
    assert final.governance.sources[0].state.requests_in_window == 1
