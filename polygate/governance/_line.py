"""Primary attempts waiting for admission, in the order they came.

A change of the governance state (a permit back, a settle, a cooldown set) used to wake
every waiting call, and each asked the backend again: with N calls waiting, N admission
passes for each permit, O(N^2) in all (9 ms of CPU a call with 2,000 calls waiting on
four permits), and the call that had waited longest was as likely to lose the race as
the one that had just come (trio runs a woken batch forwards or backwards).

Waiters of one scope (with one set of excluded sources) stand in a line in this process.
Only the first watches the backend for changes; each admission, and each waiter that
leaves from the front, hands the turn to the next, which asks at once (the change may
have room for more than one).  The others sleep until their turn or their own time
limit.  What the first learns that makes others give up (every source cooling down past
their limits, open breakers for a call with a fallback) wakes those others, so that they
ask once for themselves and fail as soon as they would have.

Between processes on a shared backend there is no line: each process's first waiter asks
on its own, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import trio

__all__ = ["Line", "Waiter"]


class Waiter:
    """One call in a line: its limits (read by :meth:`Line.wake_if`) and its alarm."""

    __slots__ = ("_alarm", "cooldown_give_up_at", "give_up_at", "wait_for_breakers")

    def __init__(self, give_up_at: float, cooldown_give_up_at: float, wait_for_breakers: bool) -> None:
        self.give_up_at = give_up_at
        self.cooldown_give_up_at = cooldown_give_up_at
        self.wait_for_breakers = wait_for_breakers
        self._alarm = trio.Event()

    def wake(self) -> None:
        self._alarm.set()

    async def sleep_until(self, deadline: float) -> None:
        """Until :meth:`wake` (since the last sleep) or ``deadline``."""
        if self._alarm.is_set():
            self._alarm = trio.Event()  # woken before: it has asked since
        with trio.move_on_at(deadline):
            await self._alarm.wait()


class Line:
    """The waiters of one scope, first come first."""

    __slots__ = ("_told", "_waiters")

    def __init__(self) -> None:
        self._waiters: OrderedDict[Waiter, None] = OrderedDict()
        # What the first waiter last told the others (see wake_if): told once each.
        self._told: tuple[object, ...] = ()

    def __bool__(self) -> bool:
        return bool(self._waiters)

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

    def wake_if(self, news: Sequence[object], gives_up: Callable[[float, float, bool], bool]) -> None:
        """Wake the waiters behind the first for whom ``gives_up(give_up_at,
        cooldown_give_up_at, wait_for_breakers)`` holds, once for each
        piece of ``news`` (what the first was refused with): they ask once more for
        themselves and leave if they find what it found.  (One that joined since heard
        the same news when it asked on arrival.)"""
        told = tuple(news)
        if told == self._told:
            return
        self._told = told
        waiters = iter(self._waiters)
        next(waiters, None)
        for waiter in waiters:
            if gives_up(waiter.give_up_at, waiter.cooldown_give_up_at, waiter.wait_for_breakers):
                waiter.wake()
