"""Worker threads under MockClock: the autojumper waits instead of spinning."""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import trio
import trio.testing

import polygate
from polygate._threads import run_sync
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, two_source_settings


async def test_a_thread_under_a_zero_threshold_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The thread's work takes no virtual time, runs at full speed (the event loop
    does not spin against it for the GIL), and the threshold comes back after."""

    def work() -> float:
        started = time.perf_counter()
        total = 0
        for i in range(200_000):  # pure Python: needs the GIL throughout
            total += i
        return time.perf_counter() - started

    before = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(run_sync, work)
    assert trio.current_time() == before
    assert autojump_clock.autojump_threshold == 0
    started = time.perf_counter()
    took = await run_sync(work)
    assert took < 0.5 and time.perf_counter() - started < 1.0


async def test_telemetry_keeps_up_with_a_mock_clock_run(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A virtual-time run with SQLite telemetry (the demo's case): every row is written
    well within a tight close bound — a spinning autojumper once starved the sink's
    thread until the bound dropped most of them."""
    db = tmp_path / "t.db"
    settings = attrs.evolve(two_source_settings(), telemetry=f"sqlite:///{db}",
                            telemetry_close_timeout_s=2.0)
    router = Router({"a": FakeUpstream(Reply(first_token_s=0.2)), "b": FakeUpstream(Reply())})
    async with polygate.session(settings, transport=router) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(200):
                nursery.start_soon(s.chat, MESSAGES)
    stats = (await s.statistics()).telemetry
    assert stats.written == 400 and stats.dropped == 0
