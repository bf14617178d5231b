"""trio's I/O wait on the host loop itself: a guest run with no helper thread.

trio's guest mode (``trio.lowlevel.start_guest_run``) runs trio's scheduler as
callbacks of the asyncio loop, but waits for trio's own I/O in a helper thread
whenever trio is idle.  Every wake-up of an idle guest run (a call submitted, an
upstream answer arriving) is then a hand-off between two threads, and a sequential
call from asyncio pays several: measured here, +650 µs a call over trio-native.

On Linux and the BSDs trio's I/O manager is an ``epoll`` / ``kqueue`` object, whose
descriptor is itself pollable: it reads as ready when trio has I/O events waiting.
:class:`LoopDriver` registers that descriptor with the host loop (``add_reader``,
which asyncio and uvloop both offer) and the next deadline as a host-loop timer, and
runs trio's ticks itself.  An idle trio then wakes in the loop's own ``epoll_wait``,
in the loop's thread: no thread, no GIL hand-off.

This drives trio's ``GuestState`` (the object whose ``guest_tick`` trio hands to the
host loop) step by step, exactly as ``GuestState.guest_tick`` does, but for where the
I/O wait happens.  Those are trio internals, so :func:`driver_for` checks every one
it uses and returns None when anything differs (a trio that changed them, Windows'
IOCP, which is not pollable): the run then keeps trio's own tick and helper thread,
unchanged.  ``tests/test_aio_guest_io.py`` fails if the installed trio stops
qualifying, so an upgrade cannot silently lose the fast path.

Invariants:

* The descriptor stays registered for the run's whole life (no register / unregister
  per wait); readiness is ignored while a tick is already scheduled.  Level
  triggering means an event that lands between trio's last poll and the loop's next
  one is never lost.
* At most one tick is scheduled at a time (``runner.guest_tick_scheduled``, the
  flag trio's own wake-ups test).
* :meth:`LoopDriver.prod` schedules a tick before the loop's thread hands trio work
  directly, so that trio does not wake itself through its wake-up socket.
  :meth:`LoopDriver.hand_over` (a call submitted from asyncio) goes further when trio
  is idle: trio steps right there, inside the caller's callback, so that a call
  starts (and, if it needs no I/O, ends) without a loop iteration of its own.  Never
  from inside a tick (no re-entry).
* While trio has work ready, up to ``_CHAINED_STEPS`` steps run in one callback;
  then the next goes to the back of the loop's queue.
* One deadline timer at a time, kept across waits while it fires no later than the
  current wait ends (within ``_SLACK_S``); when it fires early it is re-armed, and trio is not woken.
* When the run ends, the descriptor and the timer are released before trio's done
  callback runs.
* An error raised between two of trio's steps (a KeyboardInterrupt that lands in
  this driver, or a bug in it) leaves with the next step scheduled: it reaches its
  caller or the loop, and trio is never left waiting for a step nobody will run.
* A host loop that has closed (the rescue in :mod:`._host`) cannot wait: the driver
  then waits for trio's I/O in the calling thread, blocking, as ``trio.run`` would,
  but never past the rescue's time limit.
* trio reads an empty poll result as "the wait's timeout expired" (it then wakes
  ``wait_all_tasks_blocked`` waiters, or jumps a ``MockClock``).  Only the deadline
  timer's wake-up may hand trio an empty result; a wake-up for work handed over, or
  for the descriptor, hands an empty result as a ``_Woken`` (empty, but true), as
  trio's own wake-up socket would.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Callable
from typing import Any

import outcome
import sniffio
import trio

from . import _interrupt

__all__ = ["LoopDriver", "driver_for", "lend_hooks", "return_hooks"]

try:  # trio internals: checked one by one in driver_for()
    from trio._core import _run as _trio_run
except ImportError:  # pragma: no cover - a trio without them runs the helper thread
    _trio_run = None  # type: ignore[assignment]

#: trio steps run back to back in one loop callback while trio has work ready
#: (see LoopDriver.tick).  A call takes ~4-6 steps; a step of ready tasks is short.
_CHAINED_STEPS = 8

#: trio caps a wait at 24 hours (a farther deadline, or none, arrives as exactly that).
_MAX_WAIT_S = 24 * 60 * 60

#: How much later than trio's next deadline the kept timer may fire.  One deadline
#: (a session's 5 s tidier) seen from successive waits converts to loop times a few
#: microseconds apart, each a hair earlier: re-armed for each, the timer would be a
#: handle, a heap push and a cancellation a wait again.
_SLACK_S = 0.001


class _Woken(list[Any]):
    """No I/O events, but not a timeout: the run was woken (see the invariants)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return True


#: (trio only iterates and tests the events it is handed: one instance serves.)
_WOKEN = _Woken()


def _guest_tick() -> Any:
    state_type = getattr(_trio_run, "GuestState", None)
    return getattr(state_type, "guest_tick", None)


def _pollable_fd(io_manager: Any) -> int | None:
    """The descriptor that reads as ready when trio's I/O manager has events."""
    for name in ("_epoll", "_kqueue"):
        poller = getattr(io_manager, name, None)
        fileno = getattr(poller, "fileno", None)
        if callable(fileno):
            fd = fileno()
            return fd if isinstance(fd, int) and fd >= 0 else None
    return None


def driver_for(
    loop: asyncio.AbstractEventLoop, tick: Callable[[], object],
    post: Callable[[Callable[[], object]], None], rescue_left: Callable[[], float | None],
) -> LoopDriver | None:
    """A driver for the guest run whose first tick trio just handed to the host loop,
    or None when ``tick`` is not trio's ``GuestState.guest_tick`` or anything the
    driver relies on is missing (the run then keeps trio's helper thread)."""
    guest_tick = _guest_tick()
    if guest_tick is None or getattr(tick, "__func__", None) is not guest_tick:
        return None
    state = getattr(tick, "__self__", None)
    runner = getattr(state, "runner", None)
    io_manager = getattr(runner, "io_manager", None)
    if not all(
        hasattr(state, name)
        for name in ("unrolled_run_gen", "unrolled_run_next_send", "done_callback")
    ) or not all(
        hasattr(runner, name) for name in ("guest_tick_scheduled", "main_task_outcome", "is_guest")
    ):
        return None
    if not callable(getattr(io_manager, "get_events", None)):
        return None
    fd = _pollable_fd(io_manager)
    if fd is None or not hasattr(loop, "add_reader"):
        return None
    return LoopDriver(loop, state, fd, post, rescue_left)


def lend_hooks(hooks: Any) -> Any:
    """Install a guest run's async-generator hooks (see ``Host.hooks``) for one of its
    steps, if others are in place: the loop's, which its ``run_forever()`` put back,
    or the application's own (a tracer wrapping them after the session opened).
    Returns the hooks to put back after the step (:func:`return_hooks`), None when
    there is nothing to put back: between its steps the application's hooks are the
    ones in force, as without polygate.  (A generator takes its finalizer when first
    iterated, and trio's are first iterated in trio's steps.)"""
    if hooks is None:
        return None
    current = sys.get_asyncgen_hooks()
    if current == hooks:
        return None
    sys.set_asyncgen_hooks(*hooks)
    return current


def return_hooks(saved: Any) -> None:
    """Put back the hooks :func:`lend_hooks` found."""
    if saved is not None:
        sys.set_asyncgen_hooks(*saved)


class LoopDriver:
    """Runs one guest run's ticks on the host loop, its I/O wait included.

    ``post`` schedules a callback on the host loop (the host's own, which keeps what
    a closed loop dropped); ``rescue_left()`` is None while the loop runs, and once it
    has closed and the run is being finished synchronously, the seconds the rescue has
    left.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, state: Any, fd: int,
        post: Callable[[Callable[[], object]], None], rescue_left: Callable[[], float | None],
    ) -> None:
        self._loop = loop
        self._state = state
        self._runner = state.runner
        self._io = state.runner.io_manager
        self._fd = fd
        self._post = post
        self._rescue_left = rescue_left
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # (loop time) when _timer fires
        self._wait_until = 0.0  # (loop time) when trio's current I/O wait ends
        self._idle = False
        self._ticking = False
        self.ended = False  # also: the descriptor is no longer registered
        #: The run's async-generator hooks, put back before a step when the loop has
        #: dropped them (see Host.hooks); None: nothing to watch.
        self.hooks: Any = None

    def start(self) -> Callable[[], None]:
        """Register trio's descriptor; the returned callback is the run's first tick."""
        self._loop.add_reader(self._fd, self._ready)
        return self.tick

    # ------------------------------------------------------------ ticks

    def tick(self, events: Any = None) -> None:
        """Steps of trio's run loop, then schedule the next or go idle.

        The first step is sent ``events`` (a poll's result) or, without them, the
        outcome the tick was scheduled with (``unrolled_run_next_send``).

        While trio has work ready (its timeout is 0, or I/O events are waiting) the
        next step runs here too, up to ``_CHAINED_STEPS`` in a row: a loop iteration
        per step (a poll, a callback) is what trio's own loop does not pay, and a call
        takes several steps.  After that the next step goes to the back of the loop's
        queue, so that asyncio's callbacks are never held up by more than that.
        """
        try:
            self._tick(events)
        except BaseException:
            self._recover()
            raise

    def _recover(self) -> None:
        """Something raised between two of trio's steps (a KeyboardInterrupt that
        landed in this driver, or a bug in it): its caller or the loop gets the
        error, and trio, which is waiting for its next step, gets one -- scheduled, a
        poll first.  Left as it was, no wake-up would step trio again: its descriptor
        would stay readable (the loop spinning on it) and every call would hang."""
        if self.ended:
            return
        self._idle = False
        self._runner.guest_tick_scheduled = True
        try:
            self._post(self._poll_and_tick)
        except BaseException:  # (a closed loop: the rescue, which resumes a run, is next)
            self._idle = True

    def _tick(self, events: Any) -> None:
        state, runner, gen = self._state, self._runner, self._state.unrolled_run_gen
        saved = lend_hooks(self.hooks)
        self._ticking = True
        # While trio runs its own steps it is not a guest: its "is_guest" branches
        # exist to wake a run that is waiting while the host changes a deadline or
        # reschedules a task, and here trio is not waiting (its next step, or its
        # next wait, sees every change).  Left on, every deadline change of a call
        # (~20 a call) would look up trio's next deadline twice for nothing.
        runner.is_guest = False
        previous, sniffio.thread_local.name = sniffio.thread_local.name, "trio"
        # What the next step is sent: the outcome the tick was scheduled with, then
        # plain poll results (an outcome only for a poll that raised).
        first: outcome.Outcome[Any] | None = state.unrolled_run_next_send if events is None else None
        try:
            for step in range(_CHAINED_STEPS):
                try:
                    if first is not None:
                        timeout = first.send(gen)
                        first = None
                    else:
                        timeout = gen.send(events)
                except StopIteration:
                    self._end()
                    state.done_callback(runner.main_task_outcome)
                    return
                except trio.TrioInternalError as exc:
                    self._end()
                    state.done_callback(outcome.Error(exc))
                    return
                if timeout <= 0 and step < _CHAINED_STEPS - 1:
                    # trio has tasks ready: the next step runs them at once.  I/O that
                    # became ready meanwhile is polled for before the chain ends or
                    # trio waits (within _CHAINED_STEPS steps), not before every step.
                    events = _WOKEN
                    runner.guest_tick_scheduled = True
                    continue
                try:
                    events = self._io.get_events(0)
                except BaseException as exc:  # trio's own loop hands it to trio, too
                    first = outcome.Error(exc)
                else:
                    if not (timeout <= 0 or events):
                        break
                runner.guest_tick_scheduled = True
            else:
                state.unrolled_run_next_send = first if first is not None else outcome.Value(events)
                self._post(self.tick)
                return
        finally:
            self._ticking = False
            runner.is_guest = True
            sniffio.thread_local.name = previous
            return_hooks(saved)
        runner.guest_tick_scheduled = False
        left = self._rescue_left()
        if left is not None:
            self._wait_here(timeout, left)
            return
        self._idle = True
        # trio caps its timeout at 24 hours (a farther deadline arrives as exactly
        # that), so a timer is always armed: an empty wake after 24 hours is what
        # trio's own loop would see, and it then recomputes.
        until = self._wait_until = self._loop.time() + min(timeout, _MAX_WAIT_S)
        if self._timer is None or self._timer_at > until + _SLACK_S:
            self._arm(until)
        # else the armed timer fires first (trio's next deadline moved later, as it
        # does after every call): it then finds the wait not over and re-arms.  A
        # timer per wait would cost a handle and a heap push and a cancellation for
        # each of the two waits of every call.

    def _ready(self) -> None:
        # trio's descriptor is readable: resume if idle (while a tick is scheduled,
        # that tick polls anyway).
        if self._idle:
            self._wake()
            self._poll_and_tick()
        if _interrupt.held.pending:  # (a Ctrl-C that came during trio's steps: now)
            _interrupt.deliver()

    def _deadline(self) -> None:
        # A timer fired.  It may be one armed for an earlier wait: while trio is busy
        # (it is left armed then), or for a wait that ends sooner than this one.
        self._timer = None
        if not self._idle:
            pass
        elif self._timer_at < self._wait_until:
            self._arm(self._wait_until)
        else:
            # trio's wait timed out: the one wake-up that may hand trio an empty result.
            self._wake()
            self._poll_and_tick(timed_out=True)
        if _interrupt.held.pending:
            _interrupt.deliver()

    def _arm(self, until: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = until
        # In a context of its own: the loop copies the current one into the handle --
        # a caller's, when this runs in its callback chain -- and a timer armed a day
        # ahead (trio idle) would keep that caller's variables alive as long.
        self._timer = self._loop.call_at(until, self._deadline, context=contextvars.Context())

    def prod(self) -> None:
        """The loop's thread is about to hand trio work directly (start a task, cancel
        a scope): schedule a tick now, so that trio's own wake-up (a write to its
        wake-up socket, a poll, a read) is not needed."""
        if self._idle:
            self._wake()
            self._post(self._poll_and_tick)

    def hand_over(self, fn: Callable[..., object], *args: Any,
                  system_context: bool = True) -> None:
        """From the loop's thread, outside trio: ``fn(*args)`` (it starts a task,
        cancels a scope) in trio's system context, or with ``system_context=False``
        in the caller's, and trio steps on it.

        When trio is idle its steps run here and now, inside the caller's own loop
        callback: a call's first steps (and all of one that needs no I/O) then cost
        no loop iteration of their own.  Otherwise a step is already scheduled (or
        running, further up this stack) and will see the work.  Also when the caller
        is handling an exception: trio's tasks, stepped inside its frame, would see
        that exception as their own context (``sys.exc_info()``, the ``__context__``
        of what they raise); one loop iteration is the cheaper price.
        """
        here = self._idle and not self._ticking and sys.exc_info()[1] is None
        if here:
            self._wake()
        else:
            self.prod()
        try:
            if system_context:
                self.run_in_system_context(fn, *args)
            else:
                fn(*args)
        finally:
            if here:
                # (Even when ``fn`` raised: the tick marked scheduled must run, or
                # trio would wait for it forever.)  No poll first: trio has a task to
                # run now, and I/O that is ready is polled for before trio waits or
                # its chain of steps ends (see tick).
                self.tick(_WOKEN)
        if _interrupt.held.pending:
            # A Ctrl-C came during these steps, run in the caller's own step: raised
            # there, as the default handler's would have been (not posted to the loop,
            # whose run may end in this iteration: a later run would get it).
            _interrupt.deliver()

    def _poll_and_tick(self, *, timed_out: bool = False) -> None:
        if self.ended:  # (a step posted by _recover, after the run ended after all)
            return
        try:
            events = self._io.get_events(0)
        except BaseException as exc:  # handed to trio, as its own loop would
            self._state.unrolled_run_next_send = outcome.Error(exc)
            self.tick()
            return
        # Empty: "timed out" only for the deadline timer (see the invariants).
        self.tick(events if events or timed_out else _WOKEN)

    def run_in_system_context(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` in (a copy of) trio's system context, as trio's entry queue
        would run it: tasks it starts do not inherit the asyncio caller's context."""
        self._runner.system_context.copy().run(fn, *args)

    def _wake(self) -> None:
        # The timer stays armed (see tick): if it fires while trio is busy, it is
        # ignored.
        self._idle = False
        self._runner.guest_tick_scheduled = True

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wait_here(self, timeout: float, left: float) -> None:
        """The host loop is gone: wait for trio's I/O in this thread, then go on; or,
        when the rescue's time runs out first, leave the run where it is (the rescue
        gives up, and says so)."""
        wait = max(0.0, min(timeout, left))
        events = outcome.capture(self._io.get_events, wait)
        if wait < timeout and isinstance(events, outcome.Value) and not events.value:
            self._idle = True  # a later rescue's prod() resumes it
            return

        def resume() -> None:
            self._state.unrolled_run_next_send = events
            self._runner.guest_tick_scheduled = True
            self.tick()

        self._post(resume)

    def _end(self) -> None:
        self.ended = True
        self._idle = False
        self._cancel_timer()
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)


# A Ctrl-C inside these waits for the end of trio's step (see _interrupt): raised in
# the middle of one, it would leave trio's scheduler half-way.
_interrupt.guard(
    LoopDriver.tick, LoopDriver.hand_over, LoopDriver.prod, LoopDriver._ready,
    LoopDriver._deadline, LoopDriver._poll_and_tick,
)
