"""The event loop's own stalls: an attempt's clocks fire only after it had a look.

An application that blocks its event loop (a synchronous call, a long computation, a
garbage collection), or a process paused whole (``SIGSTOP``, a laptop asleep, a
virtual machine or container frozen), stops trio from looking at its sockets.  What an
upstream sent meanwhile waits in the kernel.  But when the loop comes back, trio
expires every deadline that passed *in the same pass* that finds those sockets
readable, before any reader has run: an attempt's watchdog (``stall_timeout_s``,
``ttft_timeout_s``, ``timeout_s``) cut a stream whose tokens were there to be read,
and fed its source's breaker.  One pause of a few seconds with streams running opened
every breaker of a scope, and the gateway answered 502 for their open time after it.

:class:`LoopLag`, a trio instrument, sees a stall right after trio's I/O poll and
before trio expires deadlines: the time since the last poll ended, less the wait this
one was planned to take (the tasks' turn, and how far the poll ended past its plan).
Past :data:`STALL_MIN_S`, every running attempt whose clock is due by now gets a look
first (``AttemptControl.stalled``), as long as the stall was, :data:`LAG_MIN_S` at
least and :data:`LOOK_MAX_S` at most (:func:`look_end`): its deadline moves to then,
its readers read what came during the stall, over as many reads and passes as it
takes, and a token they find moves the watchdog as ever.  A few times for each due time at most
(``AttemptControl.LOOKS``): a loop busy turn after turn still times a hung upstream
out (a few turns late), and a silence that began before a stall fires after its look
(a stall late).  The clocks are not moved by the stall -- nothing can tell when,
within it, the bytes read after it came -- except an attempt's whose request had not
gone yet (a connect), up to one of its limits in all: its upstream had not begun.

The stall that counts is short (:data:`STALL_MIN_S`) because the race is there
whatever the stall's length: a process frozen while its loop waited in the poll (a
container's CPU quota spent, ``SIGSTOP``) comes back a little past the deadline the
poll was planned for, and a token that came during the freeze, before that deadline,
was cut with it.  Counted only past 50 ms, a freeze that ended 20 ms after a due clock
cut 15-42 of 200 on-time streams under a 20 % CPU quota.  A freeze that ends within
the threshold of a due time still can: the race is then one nothing here can see.

One instrument serves every session of a trio run (a :class:`trio.lowlevel.RunVar`),
added by the first session to open and removed by the last to close: its one hook
reads the clock, ~0.6 µs a loop iteration with trio's dispatch.  Not under a
:class:`trio.testing.MockClock`: its jumps are the time a test makes pass, which the
clocks must see.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Final, Protocol

import trio

__all__ = ["LAG_MIN_S", "LOOK_MAX_S", "STALL_MIN_S", "Lagging", "LoopLag", "look_end"]

#: The shortest stretch without a look at the sockets counted as a stall of the loop:
#: past a poll's timer granularity (epoll rounds its wait up to a millisecond), so
#: that a clock that fires on time is not given a look.  The shorter, the fewer
#: freezes end inside the window where a token that came in time is still cut: under
#: a 20 % CPU quota, 0-13 of 200 on-time streams were cut at 2 ms, 20-34 at 5 ms.
STALL_MIN_S: Final = 0.002
#: The shortest look a due clock is given after a stall: a few scheduler passes for
#: what came during it to be read, on a loaded machine.
LAG_MIN_S: Final = 0.05
#: The longest look: what a stall leaves to read is bounded by the kernel's socket
#: buffers, not by the stall's length, and is read in milliseconds a connection.  A
#: look as long as the stall held a hung upstream's attempt, and a hedge due during
#: the stall, as long again after it: a process paused 10 minutes (a virtual machine
#: migrated, ``docker pause``, a laptop asleep) kept every call on a hung upstream 10
#: minutes more, with no call deadline to end it.  Reads that take longer than this
#: (thousands of streams) are turns of the loop that stall it again: more looks.
LOOK_MAX_S: Final = 2.0


def look_end(now: float, stall: float) -> float:
    """The end of the look a stall of ``stall`` seconds, ended ``now``, gives a clock
    due in it: as long as the stall, :data:`LAG_MIN_S` at least and :data:`LOOK_MAX_S`
    at most."""
    if stall < LAG_MIN_S:
        return now + LAG_MIN_S
    return now + (stall if stall < LOOK_MAX_S else LOOK_MAX_S)


class Lagging(Protocol):
    """An attempt whose clocks run (``AttemptControl``)."""

    def stalled(self, now: float, stall: float) -> None: ...


class LoopLag(trio.abc.Instrument):
    """The running attempts of a trio run, and the loop's stalls that give them a look."""

    def __init__(self, clock: trio.abc.Clock) -> None:
        self._clock = clock
        self._last = clock.current_time()  # the last poll's end
        #: The attempts whose clocks run, by identity.
        self.attempts: set[Lagging] = set()
        #: The last stall: when it began and ended (see :meth:`look_after`).
        self.last_stall = (-1.0, -1.0)
        self._users = 0
        self._next_deadline = _deadline_peek()

    def after_io_wait(self, timeout: float) -> None:
        # Called by trio's run loop after each I/O poll, before deadlines expire.  The
        # time since the last poll ended, less the wait this one was planned to take:
        # the tasks' turn and how far the poll ended past its plan (a process stopped
        # meanwhile, or a host loop late, in guest mode).  A poll that a socket ended
        # early makes it less, but then no deadline has passed: the one planned for
        # is still ahead.  (One hook, not a pair around the poll: half the cost.)
        clock = self._clock
        now = clock.current_time()
        stall = now - self._last - timeout
        if stall > STALL_MIN_S:
            self.last_stall = (now - stall, now)
            # A short stall (a loop at work has many) matters only to a clock due now:
            # trio's own heap says whether one is, at a fraction of a look through
            # thousands of streams.  A long one moves the clocks of requests not yet
            # sent, due or not.
            if stall > LAG_MIN_S or self.clock_due():
                for attempt in list(self.attempts):  # (a copy: nothing here may change it, all the same)
                    attempt.stalled(now, stall)
                now = clock.current_time()  # (this step's own time is no turn of the tasks')
        self._last = now

    def clock_due(self) -> bool:
        """Whether a deadline of the run is due (trio expires it next): a peek at trio's
        deadline heap where this trio has one to peek at; its public statistics
        otherwise, which also count every descriptor the I/O manager holds (~0.3 ms
        with 8,000 sockets: on every busy pass, 11-23 % of a loop's passes)."""
        if self._next_deadline is not None:
            return self._next_deadline() <= self._clock.current_time()
        return trio.lowlevel.current_statistics().seconds_to_next_deadline <= 0

    def look_after(self, due: float) -> float:
        """``due``, or, when it fell inside the last stall, the end of the look that
        stall gives (as long as the stall, up to :data:`LOOK_MAX_S`): for a trigger of
        the round's own (a hedge), as ``AttemptControl.stalled`` gives an attempt's
        clocks.  (A stall "begins" where the poll was planned to end, the trigger's own time when the
        poll was planned for it: that trigger is in the stall too.)"""
        began, ended = self.last_stall
        return look_end(ended, ended - began) if began <= due <= ended else due

    @classmethod
    def acquire(cls) -> LoopLag | None:
        """The run's instrument, added if it was not (a user more); None under a clock
        that is not trio's own (see the module's docstring)."""
        clock = trio.lowlevel.current_clock()
        # (A MockClock exists only once trio.testing is imported: polygate's start-up
        # does not import it to ask.)
        testing = sys.modules.get("trio.testing")
        if testing is not None and isinstance(clock, testing.MockClock):
            return None
        try:
            lag = _RUN_LAG.get()
        except LookupError:
            lag = cls(clock)
            _RUN_LAG.set(lag)
        if lag._users == 0:
            trio.lowlevel.add_instrument(lag)
            lag._last = clock.current_time()
        lag._users += 1
        return lag

    def release(self) -> None:
        """A user fewer; the instrument leaves the run with its last one."""
        self._users -= 1
        if self._users == 0:
            try:
                trio.lowlevel.remove_instrument(self)
            except KeyError:  # (trio removed it itself: a hook that raised)
                pass


_RUN_LAG: trio.lowlevel.RunVar[LoopLag] = trio.lowlevel.RunVar("polygate_loop_lag")


def _deadline_peek() -> Callable[[], float] | None:
    """The running trio's ``Deadlines.next_deadline`` (private: checked here, and
    ``None`` where this trio has no such thing, for the public statistics instead)."""
    try:
        from trio._core import _run
    except ImportError:  # pragma: no cover - a trio without it
        return None
    runner = getattr(getattr(_run, "GLOBAL_RUN_CONTEXT", None), "runner", None)
    peek = getattr(getattr(runner, "deadlines", None), "next_deadline", None)
    if not callable(peek):
        return None
    try:
        due = peek()
    except Exception:  # pragma: no cover - not the method it was
        return None
    return peek if isinstance(due, float) else None
