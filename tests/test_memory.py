"""A finished call is freed by reference counting, not left to the cyclic collector.

A gateway runs calls by the hundred thousand.  A call that leaves a reference cycle
behind keeps everything reachable from it (its round, nursery, tasks, channel, records)
until a collection of the generation it has reached, and the oldest generation is
collected rarely: such garbage sets the process's RSS, not the calls in flight
(benchmarks/streams.py --churn).  With the cyclic collector off, no polygate object
of a finished call may be found unreachable by a collection afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ._collector import collector_off
from .conftest import FIRST_A, MESSAGES, one_source_settings, two_source_settings


@contextmanager
def cyclic_garbage() -> Iterator[list[str]]:
    """The names of the polygate types found only by a collection of what ran in the
    block (filled when the block ends)."""
    found: list[str] = []
    with collector_off() as garbage:
        yield found
    found.extend(sorted({type(o).__qualname__ for o in garbage
                         if type(o).__module__.startswith("polygate")}))


async def _stream(s: polygate.Session) -> None:
    async with s.stream_chat(MESSAGES) as stream:
        async for _ in stream:
            pass
    assert stream.response is not None


async def _chat(s: polygate.Session) -> None:
    await s.chat(MESSAGES)


async def _runs(s: polygate.Session, call: Callable[[polygate.Session], Awaitable[None]]) -> list[str]:
    await call(s)  # warm-up: first-use caches, lazily made objects
    with cyclic_garbage() as found:
        for _ in range(3):
            await call(s)
    return found


async def test_a_finished_stream_leaves_no_cycle() -> None:
    up = FakeUpstream(Reply(tokens=5))
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        assert await _runs(s, _stream) == []


async def test_a_finished_hedged_stream_leaves_no_cycle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The committed path's callback closes over the round that holds it."""
    up = FakeUpstream(Reply(tokens=5))
    settings = two_source_settings(weights=FIRST_A, hedge=polygate.Hedge(after_s=30))
    async with polygate.session(settings, transport=Router({"a": up, "b": up})) as s:
        assert await _runs(s, _stream) == []


async def test_a_hedge_race_leaves_no_cycle(autojump_clock: trio.testing.MockClock) -> None:
    """A hedge launched, the slow primary cancelled: both paths are freed."""
    a = FakeUpstream(Reply(first_token_s=20, tokens=4))
    b = FakeUpstream(Reply(first_token_s=1, tokens=4))
    settings = two_source_settings(weights=FIRST_A, hedge=polygate.Hedge(after_s=2))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        assert await _runs(s, _stream) == []
        assert b.requests  # the hedge really ran


async def test_a_finished_chat_with_a_stall_trigger_leaves_no_cycle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """chat()'s first-token waker closes over the round too."""
    up = FakeUpstream(Reply(tokens=5))
    settings = two_source_settings(
        weights=FIRST_A, hedge=polygate.Hedge(after_s=30, stall_after_s=10))
    async with polygate.session(settings, transport=Router({"a": up, "b": up})) as s:
        assert await _runs(s, _chat) == []


async def test_a_stream_left_early_leaves_no_cycle(autojump_clock: trio.testing.MockClock) -> None:
    """The caller stops reading after two chunks: the producer is cancelled."""
    up = FakeUpstream(Reply(tokens=50, inter_token_s=0.01))

    async def left(s: polygate.Session) -> None:
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                if chunk.text:
                    break

    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        assert await _runs(s, left) == []

