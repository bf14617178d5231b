"""The event loop's own stalls, kept off the upstreams' account.

An application that blocks its event loop (a synchronous call, a long computation, a
garbage collection), or a process paused whole (``SIGSTOP``, a laptop asleep, a
virtual machine or container frozen), stops trio from looking at its sockets.  What an
upstream sent meanwhile waits in the kernel.  But when the loop comes back, trio
expires every deadline that passed *in the same pass* that finds those sockets
readable, before any reader has run: an attempt's watchdog (``stall_timeout_s``,
``ttft_timeout_s``, ``timeout_s``) cut a stream whose tokens were there to be read,
fed its source's breaker, and counted the pause as the source's latency and silence.
One pause of a few seconds with streams running opened every breaker of a scope, and
the gateway answered 502 for the breakers' open time after it.

The time the loop did not look is the caller's, as a slow consumer's hold is
(``AttemptControl.hold_while``).  :class:`LoopLag`, a trio instrument, sees it right
after trio's I/O poll and before trio expires deadlines: the tasks' turn since the
last poll, and all of a poll that ended far past the wait planned for it.  Past
:data:`LAG_MIN_S`, it moves the
clocks of every running attempt by that time (and the attempt's timeline leaves it
out, as it leaves out a hold), so a deadline that passed only while nobody looked has
not passed; one that passed while the loop was polling fires as ever.

One instrument serves every session of a trio run (a :class:`trio.lowlevel.RunVar`),
added by the first session to open and removed by the last to close: its two hooks
read the clock once each, ~1.2 µs a loop iteration with trio's dispatch.  Not under a
:class:`trio.testing.MockClock`: its jumps are the time a test makes pass, which the
clocks must see.
"""

from __future__ import annotations

from typing import Final, Protocol

import trio
import trio.testing

__all__ = ["LAG_MIN_S", "Lagging", "LoopLag"]

#: The shortest stretch without a poll counted as a stall of the loop: below it, a
#: busy loop's ordinary turn (a batch of ready tasks takes milliseconds at load).
#: Moving every running attempt's clocks is a step per attempt; a stall is rare.
LAG_MIN_S: Final = 0.05


class Lagging(Protocol):
    """An attempt whose clocks run (``AttemptControl``)."""

    def lagged(self, lag: float, now: float) -> None: ...


class LoopLag(trio.abc.Instrument):
    """The running attempts of a trio run, and the loop's stalls that move their clocks."""

    def __init__(self, clock: trio.abc.Clock) -> None:
        self._clock = clock
        self._last = self._polled = clock.current_time()  # the last poll's end, the next's start
        #: The attempts whose clocks run, by identity.
        self.attempts: set[Lagging] = set()
        self._users = 0

    def before_io_wait(self, timeout: float) -> None:
        self._polled = self._clock.current_time()

    def after_io_wait(self, timeout: float) -> None:
        # Called by trio's run loop after each I/O poll, before deadlines expire.  Not
        # looking: the tasks' turn since the last poll; and a poll that ended far past
        # its plan (a process stopped, or a host loop late, in guest mode) was stopped
        # at some point of its wait that nothing tells: all of it, then (a source is
        # not blamed for a silence that may be the caller's).
        now = self._clock.current_time()
        polled = self._polled
        lag = polled - self._last
        if now - polled - timeout > LAG_MIN_S:
            lag += now - polled
        self._last = now
        if lag > LAG_MIN_S and self.attempts:
            for attempt in list(self.attempts):  # (a clock moved may end nothing: a copy all the same)
                attempt.lagged(lag, now)

    @classmethod
    def acquire(cls) -> LoopLag | None:
        """The run's instrument, added if it was not (a user more); None under a clock
        that is not trio's own (see the module's docstring)."""
        clock = trio.lowlevel.current_clock()
        if isinstance(clock, trio.testing.MockClock):
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
