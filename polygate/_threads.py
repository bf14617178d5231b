"""Worker threads (and processes) that also behave under trio's ``MockClock``.

``trio.to_thread.run_sync`` is how polygate runs blocking work (SQLite, image encoding,
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

:func:`patient_clock` is the same loan for other waits on real work: OCR's renderer
processes (``polygate._ocr_renderers``) lend ``math.inf`` — no jump at all while a
renderer works, since its answer always comes in bounded real time, and a process
start (a few hundred milliseconds) would otherwise let the clock jump to every timer
of the run, a call's deadline included.  While several loans overlap the clock keeps
the smallest threshold lent.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio

__all__ = ["patient_clock", "run_sync"]

T = TypeVar("T")

_PATIENT_THRESHOLD_S = 0.001
# clock -> (the thresholds lent now, one entry per wait; the threshold to restore)
_lent: weakref.WeakKeyDictionary[Any, tuple[list[float], float]] = weakref.WeakKeyDictionary()


@contextmanager
def patient_clock(threshold: float = _PATIENT_THRESHOLD_S) -> Iterator[None]:
    """While inside, a ``MockClock`` whose autojump threshold is 0 has ``threshold``
    instead (the smallest of the loans in force); any other clock is left alone."""
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
        entry = _lent[clock] = ([], clock.autojump_threshold)
    loans = entry[0]
    loans.append(threshold)
    clock.autojump_threshold = min(loans)
    try:
        yield
    finally:
        loans.remove(threshold)
        if loans:
            clock.autojump_threshold = min(loans)
        else:
            del _lent[clock]
            clock.autojump_threshold = entry[1]


async def run_sync(
    fn: Callable[..., T],
    *args: Any,
    abandon_on_cancel: bool = False,
    limiter: trio.CapacityLimiter | None = None,
) -> T:
    """``trio.to_thread.run_sync``, patient with a zero-threshold ``MockClock``."""
    with patient_clock():
        return await trio.to_thread.run_sync(
            fn, *args, abandon_on_cancel=abandon_on_cancel, limiter=limiter
        )
