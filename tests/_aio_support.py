"""Helpers shared by the polygate.aio tests (asyncio side; no async fixtures, so the
anyio plugin and pytest-trio's trio mode never compete for one)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import trio

import polygate
from polygate.aio import _host
from polygate.testing import FakeUpstream

from .conftest import SECRET

#: anyio's pytest plugin runs the asyncio tests; on plain asyncio and on uvloop.  The
#: loop class is named: importing trio_asyncio (anywhere in the process) replaces
#: what ``asyncio.new_event_loop()`` returns.
BACKENDS = [
    pytest.param(("asyncio", {"loop_factory": asyncio.SelectorEventLoop}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]


def settings_for(*urls: str, embed: bool = True, **scope: Any) -> polygate.Settings:
    sources = [polygate.Source(name=chr(ord("a") + i), base_url=url, api_key=SECRET)
               for i, url in enumerate(urls)]
    scopes = {"chat": polygate.Scope(sources=sources, **scope)}
    if embed:
        scopes["embed"] = polygate.Scope(sources=sources)
    return polygate.Settings(scopes=scopes)


@contextmanager
def redis_that_never_answers() -> Iterator[polygate.Settings]:
    """Settings whose Redis backend accepts connections and never answers: a session's
    opening waits on it until cancelled or timed out."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        yield polygate.Settings(scopes=settings_for("http://a/v1").scopes,
                                backend=f"redis://127.0.0.1:{port}/0")


def messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": tag}]


@contextmanager
def trio_kept_busy() -> Iterator[None]:
    """While the block runs, the running loop's trio run always has a task ready (one
    that never blocks): trio is never idle, so work handed to it waits for its next
    step, which the loop runs after whatever was queued before it."""
    host = _host._hosts.by_loop[asyncio.get_running_loop()]
    spinning = True

    async def spin() -> None:
        while spinning:
            await trio.lowlevel.checkpoint()

    host.submit(host.start_task, spin)
    try:
        yield
    finally:
        spinning = False


def request_for(upstream: FakeUpstream, tag: str) -> Any:
    """The upstream's record of the (only) request whose last message says ``tag``."""
    found = [r for r in upstream.requests
             if isinstance(r.body, dict) and r.body.get("messages", [{}])[-1].get("content") == tag]
    assert len(found) == 1, (tag, len(found))
    return found[0]


async def wait_until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll a condition of another thread or process (no event to wait on), bounded."""
    give_up = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def governance_idle(s: Any) -> None:
    """Permits and reservations all returned: no call holds anything any more."""
    stats = await s.statistics()
    for source in stats.governance.sources:
        state = source.state
        assert state.in_flight == 0, state
        assert state.tokens_reserved == 0, state
        assert state.reserved_total == state.settled_total + state.released_total, state


def loopback(upstream: FakeUpstream) -> AbstractContextManager[str]:
    """Serve ``upstream`` on 127.0.0.1 from a trio run in a thread of its own (real
    sockets, a separate scheduler: what a remote upstream looks like); yields its
    base URL.  (polygate.testing's own ``serve_in_thread``.)"""
    return upstream.serve_in_thread()


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.SelectorEventLoop()  # (not the policy's: anything may have replaced it)


def _run(coro: Any, kind: str = "asyncio") -> Any:
    """``asyncio.run()`` on a loop of the given kind (its own code on 3.11+)."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=lambda: _new_loop(kind)) as runner:
            return runner.run(coro)
    loop = _new_loop(kind)
    try:
        return loop.run_until_complete(coro)
    finally:  # what asyncio.run() does on the way out
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:  # (an empty gather() would take the thread's current loop on 3.10)
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
