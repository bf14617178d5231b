"""Primary attempts waiting for admission, in the order they came.

A change of the governance state (a permit back, a settle, a cooldown set) used to wake
every waiting call, and each asked the backend again: with N calls waiting, N admission
passes for each permit, O(N^2) in all (9 ms of CPU a call with 2,000 calls waiting on
four permits), and the call that had waited longest was as likely to lose the race as
the one that had just come (trio runs a woken batch forwards or backwards).

A call refused for reasons that hold for every call alike (a full set of permits, an
rpm window, a cooldown, an open breaker, a dead source) stands in its scope's line in
this process (one line per set of excluded sources).  Only the first in the line
watches the backend for changes and its refusals' end times -- they are everyone's.
When it is admitted, or leaves from the front (given up, cancelled), the next one asks
at once: a change may have room for several.  The others sleep until their turn or
their own time limit.  What the first learns that makes others give up (every source
cooling down past their limits, open breakers for a call with a fallback) wakes those
others to ask once for themselves, and a failure of the backend wakes every waiter.

A call refused because of its own estimate (a tpm window, an estimate too large for a
source) does not stand in the line: another call's estimate may fit where its does
not, and its end times are its own, so it waits as every waiter did before, woken by
every change and at its own end times.

Between processes on a shared backend there is no line: each process's first waiter asks
on its own, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

import trio

__all__ = ["Line", "Waiter"]


class Waiter:
    """One call in a line: its limits (read by :meth:`Line.wake_if`) and its alarm."""

    __slots__ = ("_alarm", "cooldown_give_up_at", "give_up_at", "mark", "wait_for_breakers")

    def __init__(self, give_up_at: float, cooldown_give_up_at: float, wait_for_breakers: bool) -> None:
        self.give_up_at = give_up_at
        self.cooldown_give_up_at = cooldown_give_up_at
        self.wait_for_breakers = wait_for_breakers
        self._alarm = trio.Event()
        #: The backend's change mark it sleeps on while first in the line (set by a
        #: change: a permit back), else None.
        self.mark: object = None

    def pending(self) -> bool:
        """Woken (its turn came, or a change it watches as the first), and not yet
        asking again."""
        mark = self.mark
        if mark is not None:  # the first, watching the backend: its alarm is not read
            return isinstance(mark, trio.Event) and mark.is_set()
        return self._alarm.is_set()

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

    __slots__ = ("_told", "_waiters")

    def __init__(self) -> None:
        self._waiters: OrderedDict[Waiter, None] = OrderedDict()
        # What the first waiter last told the others (see wake_if): told once each.
        self._told: frozenset[object] = frozenset()

    def __len__(self) -> int:
        return len(self._waiters)

    def join(self, waiter: Waiter) -> None:
        self._waiters[waiter] = None

    def first(self) -> Waiter | None:
        return next(iter(self._waiters), None)

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` is out (admitted, given up, cancelled, or refused because of its
        own estimate; no checkpoint here): if it was first, the next one's turn has
        come."""
        was_first = self.first() is waiter
        self._waiters.pop(waiter, None)
        if was_first:
            following = self.first()
            if following is not None:
                following.wake()

    def wake_if(self, news: Iterable[Hashable], gives_up: Callable[[Waiter], bool]) -> None:
        """Wake the waiters behind the first for whom ``gives_up`` holds, once for
        each piece of ``news`` (what the first was refused with, which holds for
        them too): they ask once more for themselves and leave if they find what it
        found.  (One that joined since heard the same news when it asked on
        arrival.)"""
        told = frozenset(news)  # (the refusals come in picking order: random)
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
