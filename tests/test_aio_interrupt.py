"""A trio run broken under polygate.aio (docs/asyncio.md: "Ctrl-C is handled as
usual").  asyncio.run()'s second Ctrl-C raises wherever the thread is; landing in
trio's run loop, it ends the run in TrioInternalError.  The program then hung (the
call waited for a run that was gone) or, when the timing let it out, ended with
``PolygateError: polygate's trio run has ended`` and exit status 1.  It now ends as
Ctrl-C ends it: KeyboardInterrupt.  Real processes (tests/_aio_ki_child.py), bounded."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "tests._aio_ki_child", *argv],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("the program did not end: it waited for a trio run that was gone")


@pytest.mark.parametrize(("loop", "mode", "scenario"), [
    ("asyncio", "loop-io", "call"), ("uvloop", "loop-io", "call"),
    ("asyncio", "thread-io", "call"),
    ("asyncio", "loop-io", "stream"), ("asyncio", "thread-io", "stream"),
])
def test_ctrl_c_that_breaks_the_trio_run_ends_the_program_as_ctrl_c(
    loop: str, mode: str, scenario: str,
) -> None:
    """(A review: in the helper-thread mode trio's entry queue of the broken run raised
    OSError, and an open stream's exit waited on the run: both came out as polygate's
    or the OS's error in asyncio.run()'s shutdown.)"""
    done = _run(loop, mode, scenario)
    assert done.stdout == "open\n"
    assert done.returncode in (-signal.SIGINT, 128 + signal.SIGINT), done.stderr[-3000:]
    assert "PolygateError" not in done.stderr
    assert "unhandled exception during asyncio.run() shutdown" not in done.stderr


@pytest.mark.parametrize("mode", ["loop-io", "thread-io"])
def test_the_statistics_of_a_session_whose_run_broke_are_an_error_not_a_hang(mode: str) -> None:
    """A review: statistics() waited, through cancellation, for a close the broken run
    would never make (asyncio.wait_for could not end it)."""
    done = _run("asyncio", mode, "stats")
    assert done.stdout == "open\nstatistics: polygate's trio run has ended (its loop is shutting down)\n", done.stderr[-3000:]


def test_a_bug_that_breaks_the_run_while_a_ctrl_c_is_handled_is_no_new_ctrl_c() -> None:
    """A review: the Ctrl-C the application had handled was the bug's ``__context__``,
    and the host raised it again as if it were new."""
    done = _run("asyncio", "loop-io", "bug")
    assert done.stdout.startswith("open\n") and "outcome: KeyboardInterrupt" not in done.stdout, (
        done.stdout, done.stderr[-3000:])


@pytest.mark.parametrize("mode", ["loop-io", "thread-io"])
def test_leaving_a_block_whose_run_broke_says_so_inside_an_except_clause_too(mode: str) -> None:
    """A review: the block's exit took ``sys.exc_info()`` for what was leaving it, and
    inside the application's own ``except`` clause that is the handled exception: the
    broken run went unreported.  (On Python 3.12+ the clause's exception is not seen
    there; on 3.10 and 3.11 it is.)"""
    done = _run("asyncio", mode, "left")
    assert done.stdout == "open\nleft: polygate's trio run has ended (its loop is shutting down)\n", (
        done.stdout, done.stderr[-3000:])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("raised", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_raised_inside_a_call_is_the_callers_as_from_trio(loop: str, raised: str) -> None:
    """Outside review (KeyboardInterrupt through every layer): raised by the caller's
    own code inside a call (its transport, a validator), it ended the whole session:
    the call got ``PolygateError`` ("closed while in flight"), the call beside it was
    cancelled, the next said the session was closed, and asyncio.run() raised it after
    all.  From trio the call raises it as itself and the session goes on: the same."""
    done = subprocess.run([sys.executable, "-m", "tests._aio_raise_child", loop, raised],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.stdout.splitlines() == [
        f"raised {raised}", "beside ok ok", "next ok ok", "run returned"], done.stdout + done.stderr[-2000:]
