"""polygate.aio: trio's I/O wait on the host loop (``polygate.aio._guest_io``).

Every test of ``tests/test_aio.py`` already runs with the driver and with trio's own
helper thread.  These check what is particular to the driver: that the installed trio
qualifies for it, that an idle run then wakes without any thread (from sockets, from
its deadlines, from another thread), and that trio's descriptor is released with the
run.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from trio._core import _run as trio_run

import polygate
import polygate.aio
from polygate.aio import _guest_io, _host
from polygate.testing import FakeUpstream, Reply

from ._aio_support import BACKENDS, loopback, messages, settings_for, trio_kept_busy
from .conftest import ROOT

pytestmark = [
    pytest.mark.anyio,
    # A broken driver loses wake-ups inside loop callbacks, where asyncio swallows
    # pytest-timeout's signal: the thread method ends the run instead of hanging it.
    pytest.mark.timeout(60, method="thread"),
    pytest.mark.skipif(sys.platform == "win32", reason="IOCP is not pollable: the helper thread"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(params=["loop-io", "thread-io"])
def io_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "thread-io":
        monkeypatch.setattr(_guest_io, "_guest_tick", lambda: None)
    return str(request.param)


@pytest.fixture
def helper_threads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every I/O wait trio hands to its helper thread (guest mode's only use of it)."""
    started: list[Any] = []
    original = trio_run.start_thread_soon

    def counting(fn: Any, deliver: Any, name: str | None = None) -> None:
        started.append(fn)
        original(fn, deliver, name)

    monkeypatch.setattr(trio_run, "start_thread_soon", counting)
    return started


def host_of_running_loop() -> _host.Host:
    return _host._hosts.by_loop[asyncio.get_running_loop()]


async def test_the_installed_trio_runs_its_io_wait_on_the_loop() -> None:
    """If a trio upgrade changes the internals the driver relies on, this fails (the
    sessions would still work, on the helper thread, but slower)."""
    async with polygate.aio.session(settings_for("http://a/v1"),
                                    transport=FakeUpstream().transport()) as s:
        assert host_of_running_loop().driver is not None
        assert (await s.chat(messages("x"))).text


async def test_an_idle_run_wakes_without_a_thread(io_mode: str, helper_threads: list[Any]) -> None:
    """Sequential calls over real sockets: trio goes idle waiting for each answer.
    With the driver no I/O wait ever goes to a thread; with the fallback they all do
    (which shows the count can see them)."""
    up = FakeUpstream(Reply(text="hi", headers_delay_s=0.002))
    with loopback(up) as url:
        async with polygate.aio.session(settings_for(url)) as s:
            for i in range(20):
                # (bounded: a lost wake-up fails here instead of hanging)
                assert (await asyncio.wait_for(s.chat(messages(f"m{i}")), 10)).text == "hi"
                await asyncio.sleep(0.001)  # the loop idles between calls, too
    if io_mode == "loop-io":
        assert helper_threads == []
    else:
        assert len(helper_threads) >= 20


async def test_deadlines_fire_while_idle(io_mode: str) -> None:
    """A run with nothing to do but wait for a deadline is woken by the loop's timer:
    the call ends at its deadline, not never."""
    up = FakeUpstream(Reply(headers_delay_s=3600))
    with loopback(up) as url:
        async with polygate.aio.session(settings_for(url, call_deadline_s=0.3)) as s:
            t0 = time.monotonic()
            with pytest.raises(polygate.DeadlineExceeded):
                await asyncio.wait_for(s.chat(messages("slow")), 10)
            assert 0.25 <= time.monotonic() - t0 < 5


async def test_another_thread_wakes_an_idle_run(io_mode: str, tmp_path: Path) -> None:
    """A worker thread's result (the SQLite cache reads in one) reaches an idle run:
    trio's wake-up from another thread is seen by the loop."""
    settings = settings_for("http://a/v1", cache_ttl_s=60)
    settings = polygate.Settings(scopes=settings.scopes, cache=f"sqlite:///{tmp_path / 'c.db'}")
    up = FakeUpstream(Reply(text="stored"))
    async with polygate.aio.session(settings, transport=up.transport()) as s:
        first = await asyncio.wait_for(s.chat(messages("q")), 10)
        second = await asyncio.wait_for(s.chat(messages("q")), 10)
        assert (first.text, second.text) == ("stored", "stored")
        assert second.call_stats.cached and len(up.requests) == 1


async def test_a_call_on_an_idle_run_starts_in_the_callers_step() -> None:
    """trio steps on a call submitted to an idle run inside the caller's own loop
    callback: a call that needs no I/O (the in-process fake) is answered there, and
    costs only its checkpoint's two loop iterations (two yields before it starts, so
    that a cancellation already due lands first: aio._session._checkpoint), not a
    scheduled trio tick and the caller's wake-up on top."""
    loop = asyncio.get_running_loop()
    async with polygate.aio.session(settings_for("http://a/v1"),
                                    transport=FakeUpstream(Reply(text="ok")).transport()) as s:
        await s.chat(messages("warm"))
        for i in range(5):
            iterations = [0]

            def count(iterations: list[int] = iterations) -> None:
                if iterations[0] >= 0:
                    iterations[0] += 1
                    loop.call_soon(count)

            loop.call_soon(count)
            assert (await s.chat(messages(f"x{i}"))).text == "ok"
            counted, iterations[0] = iterations[0], -100
            assert counted == 2


async def test_answers_that_need_no_io_do_not_starve_the_loop() -> None:
    """A call answered inside the caller's step still yields to the loop once, as
    every trio call checkpoints: a loop of them lets other tasks run, and its own
    timeout fires."""
    async with polygate.aio.session(settings_for("http://a/v1"),
                                    transport=FakeUpstream(Reply(text="ok")).transport()) as s:
        other = 0

        async def elsewhere() -> None:
            nonlocal other
            while True:
                await asyncio.sleep(0)
                other += 1

        async def calls_for_ever() -> None:
            give_up = time.monotonic() + 5  # (bounded: a starved timeout fails, not hangs)
            while time.monotonic() < give_up:
                await s.chat(messages("again"))

        task = asyncio.ensure_future(elsewhere())
        t0 = time.monotonic()
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(calls_for_ever(), 0.2)
        finally:
            task.cancel()
        assert time.monotonic() - t0 < 2
        assert other > 10


async def test_a_hand_over_that_raises_does_not_strand_trio() -> None:
    """Work handed to an idle trio that raises (a closed nursery) still gets the
    trio step it was promised: the next call is answered, and trio's descriptor does
    not spin the loop."""
    async with polygate.aio.session(settings_for("http://a/v1"),
                                    transport=FakeUpstream(Reply(text="ok")).transport()) as s:
        await s.chat(messages("warm"))
        host = host_of_running_loop()

        def boom() -> None:
            raise RuntimeError("Nursery is closed to new arrivals")

        with pytest.raises(RuntimeError):
            host.submit(boom)
        assert (await asyncio.wait_for(s.chat(messages("next")), 5)).text == "ok"


async def test_the_callers_exception_stays_its_own() -> None:
    """trio steps inside the caller's frame only when the caller is not handling an
    exception: otherwise every trio task stepped there (other callers' calls too)
    would chain its errors to that exception."""
    slow = FakeUpstream(Reply(headers_delay_s=3600))
    fast = FakeUpstream(Reply(text="ok"))
    async with polygate.aio.session(settings_for("http://b/v1", call_deadline_s=0.05),
                                    transport=slow.transport()) as sb, \
            polygate.aio.session(settings_for("http://a/v1"), transport=fast.transport()) as sa:
        await sa.chat(messages("warm"))
        b = asyncio.ensure_future(sb.chat(messages("b")))
        await asyncio.sleep(0.01)  # b is in flight; trio waits for b's deadline
        # The loop is blocked past that deadline, on purpose: trio steps on it next.
        time.sleep(0.15)  # noqa: ASYNC251
        try:
            raise ValueError("the caller's own error")
        except ValueError:
            assert (await sa.chat(messages("a"))).text == "ok"
        with pytest.raises(polygate.DeadlineExceeded) as caught:
            await b
        chain: list[BaseException] = []
        error: BaseException | None = caught.value
        while error is not None and len(chain) < 20:
            chain.append(error)
            error = error.__context__
        assert not [e for e in chain if isinstance(e, ValueError)], chain


async def test_a_busy_trio_still_polls_for_io() -> None:
    """trio steps back to back while it has tasks ready, polling for I/O only before
    it waits or before a chain of steps ends: a task that never blocks must not
    starve a call waiting on a socket."""
    up = FakeUpstream(Reply(text="hi"))
    with loopback(up) as url:
        async with polygate.aio.session(settings_for(url)) as s:
            with trio_kept_busy():
                for i in range(5):
                    assert (await asyncio.wait_for(s.chat(messages(f"m{i}")), 10)).text == "hi"


async def test_the_wait_timer_is_armed_once_not_per_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two waits a call (its answer, then the next call): a timer per wait would be a
    handle, a heap push and a cancellation each.  The armed timer is kept while it
    fires no later than trio's next deadline."""
    armed: list[float] = []
    original = _guest_io.LoopDriver._arm

    def counting(self: Any, until: float) -> None:
        armed.append(until)
        original(self, until)

    monkeypatch.setattr(_guest_io.LoopDriver, "_arm", counting)
    up = FakeUpstream(Reply(text="hi"))
    with loopback(up) as url:
        async with polygate.aio.session(settings_for(url)) as s:
            for i in range(30):
                assert (await asyncio.wait_for(s.chat(messages(f"m{i}")), 10)).text == "hi"
    assert 1 <= len(armed) <= 5, len(armed)


async def test_an_early_timer_is_not_a_timeout() -> None:
    """The kept timer may fire before trio's current wait ends (it was armed for an
    earlier deadline that went away).  That must not reach trio as "the wait timed
    out": trio would then wake ``wait_all_tasks_blocked`` waiters before their
    cushion, or jump a MockClock."""
    async with polygate.aio.session(settings_for("http://a/v1"),
                                    transport=FakeUpstream().transport()):
        host = host_of_running_loop()
        assert host.driver is not None
        loop = asyncio.get_running_loop()
        scopes: list[trio.CancelScope] = []
        waited: asyncio.Future[float] = loop.create_future()

        async def short_deadline() -> None:
            with trio.CancelScope() as scope:
                scopes.append(scope)
                await trio.sleep(0.05)  # trio goes idle with a timer armed for this

        async def long_wait() -> None:
            scopes[0].cancel()  # that deadline goes away before it fires
            t0 = trio.current_time()
            await trio.testing.wait_all_tasks_blocked(cushion=0.3)
            waited.set_result(trio.current_time() - t0)

        host.submit(host.start_task, short_deadline)
        await asyncio.sleep(0.01)
        assert host.driver._timer is not None
        host.submit(host.start_task, long_wait)
        # (the loop's clock and trio's differ by a few µs: a margin, far above 0.05)
        assert await asyncio.wait_for(waited, 10) >= 0.25


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_the_descriptor_is_released_with_the_run(kind: str) -> None:
    """trio's descriptor is registered once, for the run's life (not once per wait),
    and removed before the run's end is reported: the loop keeps nothing of it."""
    if kind == "uvloop":
        import uvloop

        base: Any = uvloop.Loop
    else:
        base = asyncio.SelectorEventLoop
    calls: list[tuple[str, int]] = []

    class Spy(base):  # type: ignore[misc, valid-type]
        def add_reader(self, fd: Any, *args: Any) -> None:
            calls.append(("add", fd))
            super().add_reader(fd, *args)

        def remove_reader(self, fd: Any) -> Any:
            calls.append(("remove", fd))
            return super().remove_reader(fd)

    async def main() -> int:
        async with polygate.aio.session(settings_for("http://a/v1"),
                                        transport=FakeUpstream().transport()) as s:
            driver = host_of_running_loop().driver
            assert driver is not None
            for i in range(10):
                await s.chat(messages(f"x{i}"))
                await asyncio.sleep(0.001)
            return driver._fd

    loop = Spy()
    try:
        fd = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [c for c in calls if c[1] == fd] == [("add", fd), ("remove", fd)]
    assert not trio.lowlevel.in_trio_run()


def test_a_loop_that_cannot_watch_descriptors_keeps_the_helper_thread() -> None:
    """A loop whose ``add_reader`` is not implemented (as on Windows' proactor) is not
    an error: the run keeps trio's helper thread."""

    class NoReaders(asyncio.SelectorEventLoop):
        def add_reader(self, fd: Any, *args: Any) -> None:
            raise NotImplementedError

    async def main() -> tuple[bool, str]:
        async with polygate.aio.session(settings_for("http://a/v1"),
                                        transport=FakeUpstream(Reply(text="ok")).transport()) as s:
            return host_of_running_loop().driver is None, (await s.chat(messages("x"))).text

    loop = NoReaders()
    try:
        assert loop.run_until_complete(main()) == (True, "ok")
    finally:
        loop.close()
    assert not trio.lowlevel.in_trio_run()


def test_a_foreign_tick_is_not_driven() -> None:
    """Only trio's own first tick is taken over; anything else stays as it is."""
    loop = asyncio.SelectorEventLoop()
    try:
        assert _guest_io.driver_for(loop, lambda: None, loop.call_soon, lambda: False) is None
    finally:
        loop.close()


_STRANDED = """
import asyncio, sys, time, warnings
import trio
import trio.testing
from polygate import PolygateError
from polygate.aio import _guest_io, _host

mode, kind = sys.argv[1], sys.argv[2]
if mode == "thread-io":
    _guest_io._guest_tick = lambda: None
_host._RESCUE_LIMIT_S = 0.5
warnings.simplefilter("ignore", ResourceWarning)

def new_loop():
    if kind == "uvloop":
        import uvloop
        return uvloop.new_event_loop()
    return asyncio.SelectorEventLoop()

async def first():
    host = await _host.acquire()

    async def stubborn():  # a call whose clean-up never ends (a shielded wait)
        with trio.CancelScope(shield=True):
            await trio.sleep_forever()

    host.submit(host.start_task, stubborn)
    await asyncio.sleep(0.05)

loop = new_loop()
loop.run_until_complete(first())
loop.close()  # the run is abandoned, with a task that will not finish

async def again():
    t0 = time.monotonic()
    try:
        await _host.acquire()
    except PolygateError as exc:
        return f"{time.monotonic() - t0:.2f}", "did not finish within 0.5 s" in str(exc)
    return "acquired", False

for _ in range(2):  # and again: the stranded run is tried again, not forgotten
    loop = new_loop()
    print(*loop.run_until_complete(again()))
    loop.close()
"""


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("mode", ["loop-io", "thread-io"])
def test_a_rescue_that_cannot_finish_gives_up_in_time(mode: str, kind: str) -> None:
    """A run abandoned by its closed loop, with a task whose clean-up never ends: the
    next session in the thread waits for it no longer than the rescue's limit, then
    says why it cannot start (trio's timeout there is 24 hours: the wait in the loop's
    thread must not take that)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _STRANDED, mode, kind], cwd=ROOT,
                          capture_output=True, text=True, timeout=30, check=False)
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 2 and all(flag == "True" for _, flag in lines), done.stdout + done.stderr
    assert all(0.4 <= float(took) < 5 for took, _ in lines), done.stdout


@pytest.mark.parametrize("in_except", [False, True])
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_work_handed_over_is_not_a_timeout(io_mode: str, kind: str, in_except: bool) -> None:
    """trio reads an empty poll result as its wait having timed out.  Work handed to an
    idle run (here: nothing to do at all) must not look like that: a
    ``wait_all_tasks_blocked(cushion)`` waiter in the run wakes after its cushion,
    not at the hand-over.  Handed over while the caller handles an exception, it
    wakes trio through a scheduled poll (``LoopDriver.prod``), whose empty result
    must not read as a timeout either."""

    async def main() -> float:
        host = await _host.acquire()
        try:
            loop = asyncio.get_running_loop()
            woke: asyncio.Future[float] = loop.create_future()
            started: asyncio.Future[float] = loop.create_future()

            async def waiter() -> None:
                started.set_result(time.perf_counter())
                await trio.testing.wait_all_tasks_blocked(cushion=0.5)
                woke.set_result(time.perf_counter())

            host.submit(host.start_task, waiter)
            t0 = await started
            for _ in range(5):
                await asyncio.sleep(0.02)
                if not in_except:
                    host.submit(lambda: None)
                    continue
                try:
                    raise ValueError("the caller's own")
                except ValueError:
                    host.submit(lambda: None)
            return await asyncio.wait_for(woke, 10) - t0
        finally:
            await _host.release(host)

    if kind == "uvloop":
        import uvloop

        waited = uvloop.run(main())
    else:
        waited = asyncio.run(main())
    assert waited >= 0.45


async def test_an_error_between_trio_steps_does_not_wedge_the_run() -> None:
    """Anything raised in the driver between two of trio's steps (a KeyboardInterrupt
    that lands there, or a bug) goes on to its caller or the loop, and trio keeps
    going: a step is scheduled before the error leaves.  Before, the run was wedged:
    trio's descriptor stayed readable with nothing left to step trio, so the loop
    spun at full CPU and every call hung."""
    up = FakeUpstream(Reply(text="hi"))
    with loopback(up) as url:
        async with polygate.aio.session(settings_for(url)) as s:
            assert (await s.chat(messages("warm"))).text == "hi"
            loop = asyncio.get_running_loop()
            logged: list[Any] = []
            loop.set_exception_handler(lambda _loop, context: logged.append(context.get("exception")))
            driver = host_of_running_loop().driver
            assert driver is not None
            original = driver._rescue_left  # asked every time trio is about to wait
            raised: list[bool] = []

            def failing() -> float | None:
                if not raised:
                    raised.append(True)
                    raise RuntimeError("a bug between two steps")
                return original()

            driver._rescue_left = failing  # type: ignore[method-assign]
            # The error reaches the call (raised in the step the call itself ran) or
            # the loop's handler (raised in a step of the loop's own), exactly once.
            (first,) = await asyncio.gather(asyncio.wait_for(s.chat(messages("a")), 5),
                                            return_exceptions=True)
            errors = [e for e in (first, *logged) if isinstance(e, RuntimeError)]
            assert [str(e) for e in errors] == ["a bug between two steps"]
            assert isinstance(first, RuntimeError) or first.text == "hi"
            for i in range(3):
                assert (await asyncio.wait_for(s.chat(messages(f"b{i}")), 5)).text == "hi"
            assert raised
            # Idle, trio's descriptor is not read as ready over and over.
            ready = 0
            original_ready = driver._ready

            def counting() -> None:
                nonlocal ready
                ready += 1
                original_ready()

            loop.remove_reader(driver._fd)
            loop.add_reader(driver._fd, counting)
            await asyncio.sleep(0.2)
            loop.remove_reader(driver._fd)
            loop.add_reader(driver._fd, original_ready)
            assert ready < 20, ready
