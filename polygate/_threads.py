"""Worker threads (and processes) that also behave under trio's ``MockClock``.

``trio.to_thread.run_sync`` is how polygate runs blocking work (SQLite, image encoding,
large validations) off the event loop.  Under ``MockClock(autojump_threshold=0)`` —
how polygate's own tests, the users' tests and ``polygate demo`` run virtual time — a
run whose every task waits for a thread looks idle, and trio's autojumper then jumps
the clock to the next timer (often a call's deadline: a spurious DeadlineExceeded),
or, with nothing to jump to, loops without pause holding the GIL the thread needs.

:func:`run_sync` holds such a clock still while the thread works: it lends it an
infinite autojump threshold, so the clock does not jump at all until the thread is
done.  Virtual time does not move while the thread works (as if the work took no
time), which is also the deterministic answer.  The loop meanwhile waits for the
thread's wake-up like for any I/O, and cancellation is unchanged (an abandoned thread
returns the loan when ``run_sync`` returns).  A finite loan (once 1 ms) is not enough:
any thread slower than it in wall time — a GIL switch interval, a busy machine — let
the clock jump.  Any other clock is left alone; the check costs a dictionary lookup.

The hold is for work bounded in real time that a task waits for.  ``background=True``
is for work no call waits for and that may stall without bound (the telemetry sink's
writes to a database that hangs): it lends only 1 ms — the autojumper waits instead
of spinning against the thread for the GIL, yet virtual time goes on past a stuck
sink.  While loans overlap the clock keeps the largest: a hold is kept even while
background work runs.

:func:`patient_clock` is the same loan for other waits on real work, e.g. OCR's
renderer processes (``polygate._ocr_renderers``): a renderer's answer always comes in
bounded real time, and a process start (a few hundred milliseconds) would otherwise
let the clock jump to every timer of the run.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio

__all__ = [
    "NoThread", "cpu_limiter", "mock_clock", "no_thread", "own_limiter", "patient_clock", "run_sync",
]

T = TypeVar("T")

_HOLD_S = math.inf  # no jump at all while the real work runs
_BACKGROUND_S = 0.001  # jump after 1 ms of real idleness: a stuck thread holds nothing
# clock -> (the thresholds lent now, one entry per wait; the threshold to restore)
_lent: weakref.WeakKeyDictionary[Any, tuple[list[float], float]] = weakref.WeakKeyDictionary()


#: Threads at once, per trio run, for work that holds the interpreter's lock all along
#: (a large answer's validation, a big schema's compile: pure Python, or Rust that keeps
#: the GIL): more of them only take turns with each other and with the event loop.
#: On trio's default limiter (40 threads, shared with name resolution and the SQLite
#: cache) 100 large validations at once held the loop up to 2.6 s (8 threads: 0.28 s,
#: 2 threads: 0.29 s), and 40 compiles abandoned by cancelled calls took every token
#: for 7-14 s: a DNS lookup waited 14.8 s.  Not 2: a check that runs its whole budget
#: (a hostile answer, up to a minute) or a compile that cannot stop holds its thread,
#: and two of them held up every other call's check.
CPU_THREADS = 8
_cpu: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("polygate_cpu_threads")


#: Threads at once, per trio run, for polygate's other blocking work (SQLite, files,
#: image encoding) when no limiter is named: as many as trio's default limiter has, but
#: not that one.  The application's threads share trio's: 40 of them waiting on
#: polygate's calls (``trio.from_thread.run``, a FastAPI ``def`` endpoint on anyio's
#: trio backend) held every token, and a call that needed a thread (a SQLite cache's
#: read, the telemetry store's opening) waited for one of them to finish: for ever.
OWN_THREADS = 40
_own: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("polygate_threads")


def own_limiter() -> trio.CapacityLimiter:
    """This run's limiter for polygate's blocking work (see ``OWN_THREADS``)."""
    return _per_run(_own, OWN_THREADS)


def cpu_limiter() -> trio.CapacityLimiter:
    """This run's limiter for work that holds the GIL (see ``CPU_THREADS``)."""
    return _per_run(_cpu, CPU_THREADS)


def _per_run(var: trio.lowlevel.RunVar[trio.CapacityLimiter], tokens: int) -> trio.CapacityLimiter:
    try:
        return var.get()
    except LookupError:
        limiter = trio.CapacityLimiter(tokens)
        var.set(limiter)
        return limiter


def mock_clock() -> Any:
    """The run's clock when it is trio's ``MockClock``, else ``None``."""
    # A MockClock exists only if trio.testing was imported; importing it here would
    # cost every program ~0.2 s (it imports pytest when pytest is installed).
    testing = sys.modules.get("trio.testing")
    clock = trio.lowlevel.current_clock()
    return clock if testing is not None and isinstance(clock, testing.MockClock) else None


@contextmanager
def patient_clock(threshold: float = _HOLD_S) -> Iterator[None]:
    """While inside, a ``MockClock`` whose autojump threshold is 0 has ``threshold``
    instead (the largest of the loans in force); any other clock is left alone."""
    clock = mock_clock()
    if clock is None:
        yield
        return
    entry = _lent.get(clock)
    if entry is None:
        if clock.autojump_threshold != 0:
            yield
            return
        entry = _lent[clock] = ([], clock.autojump_threshold)
    loans = entry[0]
    loans.append(threshold)
    clock.autojump_threshold = max(loans)
    try:
        yield
    finally:
        loans.remove(threshold)
        if loans:
            clock.autojump_threshold = max(loans)
        else:
            del _lent[clock]
            clock.autojump_threshold = entry[1]


async def run_sync(
    fn: Callable[..., T],
    *args: Any,
    abandon_on_cancel: bool = False,
    limiter: trio.CapacityLimiter | None = None,
    background: bool = False,
    or_inline: bool = False,
) -> T:
    """``trio.to_thread.run_sync`` (on :func:`own_limiter` unless ``limiter`` is
    given); a zero-threshold ``MockClock`` holds still while
    the thread works (``background``: only waits 1 ms of real idleness to jump).
    No thread can start (see :func:`no_thread`): :class:`NoThread`; or, with
    ``or_inline``, for work bounded in time (a render, an image's encoding), the work
    done on the loop, as it would be without threads, rather than fail what waits
    for it."""
    ran = False

    def work() -> T:
        # Whether the thread started, so that ``fn``'s own "can't start new thread"
        # (work that starts threads) is raised as it is: not taken for ours, and the
        # work not run a second time on the loop.
        nonlocal ran
        ran = True
        return fn(*args)

    try:
        with patient_clock(_BACKGROUND_S if background else _HOLD_S):
            return await trio.to_thread.run_sync(
                work, abandon_on_cancel=abandon_on_cancel,
                limiter=own_limiter() if limiter is None else limiter,
            )
    except RuntimeError as exc:
        if ran or not no_thread(exc):
            raise
        if not or_inline:
            raise NoThread from None
    return fn(*args)


class NoThread(RuntimeError):
    """No thread could start for :func:`run_sync`'s work: the process's thread limit."""

    def __init__(self) -> None:
        super().__init__("this process ran out of threads (can't start new thread)")


def no_thread(exc: BaseException) -> bool:
    """Whether ``exc`` is the interpreter's failure to start a thread (the process's
    or the user's limit, ``RLIMIT_NPROC``, reached; or its memory): a plain
    ``RuntimeError`` that says so (3.10 to 3.13).  Taken for a source's failure, a
    spell of it opened the breaker of every source reached by name (trio looks names
    up in threads), which stayed open after it."""
    return isinstance(exc, NoThread) or (
        type(exc) is RuntimeError and str(exc).startswith("can't start new thread"))
