"""Primary attempts waiting for admission, in the order they came.

A change of the governance state (a permit back, a settle, a cooldown set) used to wake
every waiting call, and each asked the backend again: with N calls waiting, N admission
passes for each permit, O(N^2) in all (9 ms of CPU a call with 2,000 calls waiting on
four permits), and the call that had waited longest was as likely to lose the race as
the one that had just come (trio runs a woken batch forwards or backwards).

Waiters of one scope (with one set of excluded sources) stand in a line in this process.
Only the first watches the backend for changes and its refusals' end times.  After each
pass of admission a waiter wakes the one behind it when that one may now be admitted
where it was not:

* admitted: the next in line (the change may have room for more than one);
* refused for reasons that hold for every call alike (a full set of permits, an rpm
  window, a cooldown, a breaker): nobody -- nobody behind would be admitted either;
* refused because of its own estimate (a tpm window, an estimate too large for a
  source), or given up: the next one whose estimate is smaller (a larger one would be
  refused the same way; tpm and "too large" only get stricter with the estimate).

While the first's refusals hold for every call alike, its wake-ups are everyone's, and
the others sleep until woken or their own time limit.  When they depend on its estimate,
each waiter also wakes at the end times of its own refusals.  What the first learns that
makes others give up (every source cooling down past their limits, open breakers for a
call with a fallback) wakes those others to ask once for themselves, and the failure of
the backend wakes every waiter.

Between processes on a shared backend there is no line: each process's first waiter asks
on its own, as before.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import trio

__all__ = ["Line", "Waiter"]


class Waiter:
    """One call in a line: its estimate and limits, and its alarm."""

    __slots__ = ("_alarm", "cooldown_give_up_at", "give_up_at", "tokens", "wait_for_breakers")

    def __init__(
        self, tokens: int, give_up_at: float, cooldown_give_up_at: float, wait_for_breakers: bool
    ) -> None:
        self.tokens = tokens
        self.give_up_at = give_up_at
        self.cooldown_give_up_at = cooldown_give_up_at
        self.wait_for_breakers = wait_for_breakers
        self._alarm = trio.Event()

    def arm(self) -> trio.Event:
        """The alarm to sleep on after the pass of admission about to start: taken
        before it, so that a wake-up during its round trip is not lost."""
        if self._alarm.is_set():
            self._alarm = trio.Event()
        return self._alarm

    def wake(self) -> None:
        self._alarm.set()


class Line:
    """The waiters of one scope, first come first."""

    __slots__ = ("_told", "_waiters", "uniform")

    def __init__(self) -> None:
        self._waiters: OrderedDict[Waiter, None] = OrderedDict()
        # What the first waiter last told the others (see wake_if): told once each.
        self._told: tuple[object, ...] = ()
        #: The first's last refusals hold for every call alike (see the module's text).
        self.uniform = True

    def __len__(self) -> int:
        return len(self._waiters)

    def join(self, waiter: Waiter) -> None:
        self._waiters[waiter] = None

    def first(self) -> Waiter | None:
        return next(iter(self._waiters), None)

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` is out (admitted, given up or cancelled; no checkpoint here): if it
        was first, the next one's turn has come."""
        was_first = self.first() is waiter
        self._waiters.pop(waiter, None)
        if was_first:
            following = self.first()
            if following is not None:
                following.wake()

    def pass_on(self, after: Waiter, below: float = math.inf) -> None:
        """Wake the first waiter behind ``after`` whose estimate is below ``below``."""
        behind = False
        for waiter in self._waiters:
            if behind and waiter.tokens < below:
                waiter.wake()
                return
            behind = behind or waiter is after

    def wake_if(self, news: Sequence[object], gives_up: Callable[[Waiter], bool]) -> None:
        """Wake the waiters behind the first for whom ``gives_up`` holds, once for
        each piece of ``news`` (what the first was refused with): they ask once more
        for themselves and leave if they find what it found.  (One that joined since
        heard the same news when it asked on arrival.)"""
        told = tuple(news)
        if told == self._told:
            return
        self._told = told
        waiters = iter(self._waiters)
        next(waiters, None)
        for waiter in waiters:
            if gives_up(waiter):
                waiter.wake()

    def wake_all(self) -> None:
        """Every waiter asks again (the backend failed: each finds out for itself, at
        once, instead of one after another as turns pass)."""
        for waiter in self._waiters:
            waiter.wake()
