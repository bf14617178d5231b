"""polygate/_child.py: a child process started on polygate's own thread limiter (not
trio's default one, which the application's threads share), its pipes as trio
streams, its exit waited on by pidfd or, without one, in a thread.  Real processes,
real clock."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import trio

from polygate import _child

ECHO = [sys.executable, "-I", "-c",
        "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1]); sys.exit(7)"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(params=["pidfd", "thread"])
def waits_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "thread":  # (a kernel before 5.3, or not Linux)
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    elif not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd here")
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
    await child.aclose()
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
        await child.aclose()


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
    await child.aclose()


async def test_a_wait_takes_no_token_of_polygates_own_threads(waits_by: str) -> None:
    """A discarded renderer is killed and waited for under a shield: that wait must
    not queue for a thread behind polygate's other work (every own token taken)."""
    from polygate._threads import own_limiter

    child = await _child.start([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
    limiter = own_limiter()
    total, holder = limiter.total_tokens, object()
    limiter.total_tokens = 1
    await limiter.acquire_on_behalf_of(holder)
    try:
        child.kill()
        with trio.fail_after(30):
            assert await child.wait() == -signal.SIGKILL
    finally:
        limiter.release_on_behalf_of(holder)
        limiter.total_tokens = total
        child.kill()
        await child.aclose()
