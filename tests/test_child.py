"""polygate/_child.py: a child process started on polygate's own thread limiter (not
trio's default one, which the application's threads share), its pipes as trio
streams, its exit waited on by pidfd or, without one, in a thread.  Real processes,
real clock."""

from __future__ import annotations

import errno
import os
import signal
import sys

import pytest
import trio
import trio.testing

import polygate
from polygate import _child

ECHO = [sys.executable, "-I", "-c",
        "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1]); sys.exit(7)"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def close_pipes(child: _child.Child | trio.Process) -> None:
    for stream in (child.stdin, child.stdout):
        assert stream is not None
        await stream.aclose()


@pytest.fixture(params=["pidfd", "thread", "trio"])
def waits_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if not _child.pidfds():
        pytest.skip("no pidfds here: trio's own start, tested as 'trio'")
    if request.param == "thread":  # (a pidfd that could not be opened: out of descriptors)
        def refused(pid: int, flags: int = 0) -> int:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(os, "pidfd_open", refused)
    elif request.param == "trio":  # (macOS, Windows, Linux before 5.3: trio's start)
        monkeypatch.setattr(_child, "_pidfds", False)
    return str(request.param)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
async def test_a_child_talks_over_its_pipes_and_its_exit_is_waited_for(waits_by: str) -> None:
    before = open_fds()
    child = await _child.start(ECHO)
    assert child.returncode is None
    await child.stdin.send_all(b"abc")
    await child.stdin.aclose()  # its end of file
    got = b""
    while part := await child.stdout.receive_some():
        got += part
    with trio.fail_after(30):
        assert await child.wait() == 7
    assert (got, child.returncode) == (b"cba", 7)
    assert await child.wait() == 7  # (again: at once)
    await close_pipes(child)
    assert open_fds() == before  # the pipes and the pidfd closed


async def test_a_killed_child_is_reaped_and_a_cancelled_wait_can_wait_again(waits_by: str) -> None:
    child = await _child.start([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
    try:
        with trio.move_on_after(0.2) as cut:
            await child.wait()
        assert cut.cancelled_caught and child.returncode is None
        child.kill()
        with trio.fail_after(30):
            assert await child.wait() == -signal.SIGKILL
        child.kill()  # (reaped: its pid may be another process's now; nothing is sent)
        child.send_signal(signal.SIGTERM)
    finally:
        child.kill()
        await close_pipes(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
async def test_a_child_that_cannot_start_raises_oserror_and_leaks_nothing() -> None:
    before = open_fds()
    with pytest.raises(FileNotFoundError):
        await _child.start(["/nonexistent/polygate-renderer"])
    assert open_fds() == before


async def test_its_start_waits_for_polygates_own_threads_not_trios() -> None:
    """The application's threads hold every token of trio's default limiter (40
    threads waiting on polygate's calls): a start does not wait for them."""
    from .test_thread_limits import default_limiter_taken

    async with default_limiter_taken():
        with trio.fail_after(30):
            child = await _child.start([sys.executable, "-I", "-c", "pass"])
            assert await child.wait() == 0
    await close_pipes(child)


async def test_a_wait_takes_no_token_of_polygates_own_threads(waits_by: str) -> None:
    """A discarded renderer is killed and waited for under a shield: that wait must
    not queue for a thread behind polygate's other work (every own token taken)."""
    from polygate._threads import own_limiter

    from .test_thread_limits import limiter_taken

    child = await _child.start([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
    try:
        async with limiter_taken(own_limiter()):
            child.kill()
            with trio.fail_after(30):
                assert await child.wait() == -signal.SIGKILL
    finally:
        child.kill()
        await close_pipes(child)


async def test_two_waits_at_once_both_see_the_exit(waits_by: str) -> None:
    """Review: two waits on one pidfd at once raised ``BusyResourceError``."""
    child = await _child.start([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
    codes: list[int] = []

    async def wait() -> None:
        codes.append(await child.wait())

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                child.kill()
        assert codes == [-signal.SIGKILL] * 2
    finally:
        child.kill()
        await close_pipes(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
async def test_a_renderer_that_cannot_be_waited_for_is_killed_and_closed_and_so_are_the_others() -> None:
    """Review: a discarded renderer's wait that could not start its thread (no pidfd,
    the thread limit reached) left its pipes open, and the session's close stopped
    there, leaving the other renderers running.  It is killed, its pipes closed, and
    the close goes on without an error (Python reaps it once it is collected)."""
    from polygate import _ocr_renderers
    from polygate._threads import NoThread

    before = open_fds()
    pool = _ocr_renderers._Pool(2, _ocr_renderers._ProcessWorker.start)
    workers = [await _ocr_renderers._ProcessWorker.start() for _ in range(2)]
    real_wait = workers[0].process.wait

    async def no_thread() -> int:
        raise NoThread

    workers[0].process.wait = no_thread  # type: ignore[method-assign]
    pool.idle.extend(workers)
    pool.everyone.update(workers)
    await pool.aclose()
    # killed and reaped, the one without a thread to wait in too (review: left a
    # zombie, and its Popen warned "still running" when collected)
    assert [w.process.returncode for w in workers] == [-signal.SIGKILL] * 2
    assert await real_wait() == -signal.SIGKILL
    assert open_fds() == before  # every pipe closed


async def test_a_session_whose_renderer_cannot_be_waited_for_closes_with_the_blocks_own_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: that failure, at the session's close, left the block as a bare trio
    group in place of the application's own error, and the thread renderers open."""
    if not _child.pidfds():
        pytest.skip("no pidfds here")
    from polygate import _threads
    from polygate.testing import FakeUpstream, Reply, Router

    from .test_ocr import make_pdf, ocr_settings

    class Own(Exception):
        pass

    up = FakeUpstream(Reply(text="x"))
    renderers = None
    with pytest.raises(Own):
        async with polygate.session(ocr_settings(max_concurrent_pages=2), transport=Router({"a": up})) as s:
            renderers = s._runtime.renderers
            await renderers.request("process", 1, ("open", 1), make_pdf([(100, 100)]))
            await renderers.request("thread", 2, ("open", 2), make_pdf([(100, 100)]))
            [worker] = renderers._pool("process").idle
            child = worker.process
            assert isinstance(child, _child.Child) and child._pidfd is not None
            os.close(child._pidfd)  # (as if it could not be opened: its wait takes a thread)
            child._pidfd = None

            async def no_thread(*args: object, **kwargs: object) -> None:
                raise _threads.NoThread

            monkeypatch.setattr(_child, "run_sync", no_thread)
            raise Own
    assert renderers is not None
    assert all(pool.closed and not pool.idle for pool in renderers._pools.values())
    monkeypatch.undo()
    with trio.fail_after(30):
        assert await child.wait() == -signal.SIGKILL  # (killed at the close)
