"""Worker threads under MockClock: the autojumper waits instead of spinning."""

from __future__ import annotations

import functools
import io
import threading
import time
from pathlib import Path

import attrs
import pytest
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


async def test_no_virtual_time_passes_while_a_thread_works(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A thread slower than any autojump threshold (20 ms of wall time) still takes no
    virtual time: a pending timer does not fire meanwhile (a 1 ms loan let the clock
    jump to it — a call's deadline, in the probe)."""
    woke: list[float] = []

    async def sleeper() -> None:
        await trio.sleep(5.0)
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)
        await trio.lowlevel.checkpoint()
        before = trio.current_time()
        for _ in range(3):
            await run_sync(time.sleep, 0.02)
            assert trio.current_time() == before and not woke
    assert woke == [before + 5.0]
    assert autojump_clock.autojump_threshold == 0


async def test_a_thread_abandoned_under_a_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancellation still abandons a thread (abandon_on_cancel) while virtual time
    holds, and the clock's threshold comes back at once."""
    release = threading.Event()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def cancel_when_blocked() -> None:
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()

            nursery.start_soon(cancel_when_blocked)
            await run_sync(release.wait, 30.0, abandon_on_cancel=True)
    release.set()
    assert scope.cancelled_caught
    assert autojump_clock.autojump_threshold == 0


async def test_background_threads_never_freeze_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stuck background thread (a telemetry sink on a hung database) lets virtual
    time go on, yet a hold taken meanwhile still keeps the clock still."""
    release = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(run_sync, release.wait, 30.0, abandon_on_cancel=True,
                              background=True)
        )
        woke = trio.Event()

        async def sleeper() -> None:
            await trio.sleep(5.0)
            woke.set()

        nursery.start_soon(sleeper)
        await trio.lowlevel.checkpoint()
        before = trio.current_time()
        await run_sync(time.sleep, 0.02)  # held despite the background loan
        assert trio.current_time() == before and not woke.is_set()
        await trio.sleep(7.0)  # virtual time passes beside the stuck thread
        assert trio.current_time() == before + 7.0 and woke.is_set()
        release.set()
    assert autojump_clock.autojump_threshold == 0


async def test_ocr_calls_take_no_virtual_time_under_a_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Repeated OCR calls (document reading and page encoding in threads) never hit a
    spurious DeadlineExceeded: no virtual time passes while a thread works (this
    failed about one call in ten)."""
    pdfium = pytest.importorskip("pypdfium2")
    pdf = pdfium.PdfDocument.new()
    for _ in range(4):
        pdf.new_page(612, 792).close()
    out = io.BytesIO()
    pdf.save(out)
    pdf.close()
    scope = polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                           call_deadline_s=60.0)
    up = FakeUpstream(Reply(text="t"))
    async with polygate.session(polygate.Settings(scopes={"ocr": scope}),
                                transport=Router({"a": up})) as s:
        for _ in range(30):
            before = trio.current_time()
            r = await s.ocr(out.getvalue())
            assert trio.current_time() == before and len(r.pages) == 4


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


@pytest.mark.parametrize("or_inline", [False, True])
async def test_work_that_fails_to_start_its_own_thread_is_not_taken_for_the_limit(
    or_inline: bool,
) -> None:
    """The work ran in its thread and itself raised the interpreter's "can't start new
    thread": that is the work's error, raised as it is, and the work is not run a
    second time on the loop (it once was, with ``or_inline``)."""
    runs: list[str] = []

    def work() -> None:
        runs.append(threading.current_thread().name)
        raise RuntimeError("can't start new thread")

    with pytest.raises(RuntimeError, match="can't start new thread") as caught:
        await run_sync(work, or_inline=or_inline)
    assert type(caught.value) is RuntimeError  # not NoThread: the thread did start
    assert len(runs) == 1 and runs[0] != threading.current_thread().name
