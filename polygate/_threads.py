"""Worker threads that also behave under trio's ``MockClock``.

``trio.to_thread.run_sync`` is how polygate runs blocking work (SQLite, PDF rendering,
large validations) off the event loop.  Under ``MockClock(autojump_threshold=0)`` —
how polygate's own tests, the users' tests and ``polygate demo`` run virtual time — a
run whose every task waits for a thread has nothing to jump to, and trio's autojumper
then loops without pause, holding the GIL: the worker thread gets it back only every
switch interval, and a 2-row SQLite write took over a second (the telemetry flush at
close then ran out of its real-time bound and dropped rows).

:func:`run_sync` lends such a clock a 1 ms real-time threshold while threads run, so
the autojumper waits instead of spinning.  Virtual time does not move while the
thread works (as if the work took no time), which is also the deterministic answer.
Any other clock is left alone.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio

__all__ = ["run_sync"]

T = TypeVar("T")

_PATIENT_THRESHOLD_S = 0.001
# clock -> (threads waited on now, the threshold to restore)
_lent: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


@contextmanager
def _patient_clock() -> Iterator[None]:
    # A MockClock exists only if trio.testing was imported; importing it here would
    # cost every program ~0.2 s (it imports pytest when pytest is installed).
    testing = sys.modules.get("trio.testing")
    clock = trio.lowlevel.current_clock()
    if testing is None or not isinstance(clock, testing.MockClock):
        yield
        return
    entry = _lent.get(clock)
    if entry is None:
        if clock.autojump_threshold != 0:
            yield
            return
        entry = _lent[clock] = [0, clock.autojump_threshold]
        clock.autojump_threshold = _PATIENT_THRESHOLD_S
    entry[0] += 1
    try:
        yield
    finally:
        entry[0] -= 1
        if entry[0] == 0:
            del _lent[clock]
            clock.autojump_threshold = entry[1]


async def run_sync(
    fn: Callable[..., T],
    *args: Any,
    abandon_on_cancel: bool = False,
    limiter: trio.CapacityLimiter | None = None,
) -> T:
    """``trio.to_thread.run_sync``, patient with a zero-threshold ``MockClock``."""
    with _patient_clock():
        return await trio.to_thread.run_sync(
            fn, *args, abandon_on_cancel=abandon_on_cancel, limiter=limiter
        )
