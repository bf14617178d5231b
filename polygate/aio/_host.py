"""The trio run that carries polygate on an asyncio loop: one per loop, shared.

An asyncio application keeps its own loop (asyncio, uvloop, uvicorn's).  polygate is
trio code, so something must run trio beside it.  The chosen mechanism, measured in
``benchmarks/aio_mechanisms.py`` and explained in docs/asyncio.md, is trio's *guest
mode*: ``trio.lowlevel.start_guest_run`` unrolls trio's scheduler into callbacks on
the running asyncio loop, in the same thread.  trio tasks and asyncio tasks then
take turns on one thread: a trio task may resolve an asyncio future directly, the
asyncio side may call the session's synchronous methods directly, and nothing runs
behind the application's back when its loop stops.  trio's I/O wait runs on the
loop too where trio's I/O manager can be polled by it (Linux, macOS: see
:mod:`._guest_io`); elsewhere in trio's helper thread, only while trio is idle.

Invariants:

* One guest run per loop, shared by every ``polygate.aio.session()`` on it
  (trio allows one run per thread).  It starts with the first session and stops
  when the last one closes; ``stop()`` returns once the run has finished.
* Under trio-asyncio's loop trio is already running in this thread: no guest run
  is started, the sessions' tasks run as system tasks of that run.
* A loop closed while a guest run was still active (a session that was never
  left) cannot be driven any more; the next ``acquire()`` in the same thread
  finishes that run synchronously (every call cancelled, every connection closed)
  and warns with a ``ResourceWarning``, so trio stays usable in the thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import queue
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio

from .. import PolygateError
from . import _interrupt
from ._guest_io import LoopDriver, driver_for, lend_hooks, return_hooks

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Host", "acquire", "resolve", "settleable"]

#: How long finishing an abandoned run (its loop closed under it) may take.
_RESCUE_LIMIT_S = 10.0

#: trio ticks the scheduler stays on the loop's thread after a result went to asyncio
#: (see Host.linger).  Measured: 2 beats 1, 4 and 8 (benchmarks/aio.py).
_LINGER_TICKS = 2


ENDED = "polygate's trio run has ended (its loop is shutting down)"


def settleable(fut: asyncio.Future[Any]) -> bool:
    """Whether ``fut`` still takes a result: not done (cancelled from asyncio) and its
    loop not closed (the waiter is gone: there is nobody to tell)."""
    return not fut.done() and not fut.get_loop().is_closed()


def resolve(fut: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
    """Settle ``fut`` if it is :func:`settleable`."""
    if not settleable(fut):
        return
    if isinstance(result, outcome.Value):
        fut.set_result(result.value)
    elif isinstance(result, outcome.Error):
        fut.set_exception(result.error)


class Host:
    """A trio run on one asyncio loop, and a way to start trio tasks in it.

    ``submit(fn, *args)`` has trio context call the synchronous ``fn(*args)``.  With
    trio's I/O wait on this loop (``driver``) that is now, in this thread, between two
    of trio's ticks, with one tick scheduled to act on it.  Otherwise submissions made
    in one asyncio tick are handed over in one ``run_sync_soon``: one wake-up of
    trio's helper thread per batch, not per call.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, guest: bool) -> None:
        self.loop = loop
        self.guest = guest
        #: The process it runs in (see forks): a forked child inherits this object,
        #: not the run behind it.
        self.process = forks.count
        #: The thread its loop runs in.
        self.thread = threading.get_ident()
        self.users = 0
        self.accepting = True
        self.token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._batch: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        self._wake_pending = False
        self._lingering = False
        # Set when trio's I/O wait runs on this loop (see _guest_io): no helper thread
        # to wake, so work is handed to trio directly and there is nothing to linger for.
        self.driver: LoopDriver | None = None
        self._first_tick_seen = False
        self.ready: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        self._done = False
        self._run_outcome: outcome.Outcome[None] | None = None
        # Callbacks handed to the loop that have not run yet.  Only read when the
        # loop closed under the run (then they never will, and the rescue runs them).
        self._queued: set[_Queued] = set()
        self._orphans: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._rescuing = False
        self._give_up = 0.0  # (monotonic) when the rescue stops trying
        self._lock = threading.Lock()
        #: The guest run's async-generator hooks (trio's, chained to the loop's), as
        #: its start installed them.  A loop that stops and runs again drops them (its
        #: run_forever restores the hooks it found), and async generators that trio
        #: tasks start would then belong to asyncio: its shutdown_asyncgens, or its
        #: finalizer, would close them from an asyncio task, in the middle of trio's
        #: work.  So they are put back before each of trio's steps while the run lasts.
        self.hooks: Any = None
        #: This run took SIGINT over from Python's default handler (see _interrupt).
        self._sigint = False

    # ------------------------------------------------------------ asyncio side

    def _live_driver(self) -> LoopDriver | None:
        """The loop driver, when work is handed to trio directly (same thread, trio
        between ticks); None when it goes through trio's entry queue."""
        driver = self.driver
        if driver is None or self._rescuing:
            return None
        if driver.ended:
            raise PolygateError(ENDED)
        return driver

    def broken(self, closed: asyncio.Future[None]) -> bool:
        """Whether the run ended without settling a session (``closed`` unresolved):
        it broke (a Ctrl-C forced into trio's scheduler, see _finished)."""
        return self._done and not closed.done()

    def _check_usable(self) -> None:
        if self._done:  # (trio's entry queue of a broken run may fail otherwise: OSError)
            raise PolygateError(ENDED)
        if self.process != forks.count:
            # A forked child (its asyncio.run() shutdown cancelling a call it inherited,
            # say): the run is the parent's, on sockets and an epoll they share.
            raise PolygateError(f"this session belongs to another process: {FORKED}")

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        self._check_usable()
        driver = self._live_driver()
        if driver is not None:
            driver.hand_over(fn, *args)
            return
        self._batch.append((fn, args))
        if not self._wake_pending:
            assert self.token is not None
            try:
                self.token.run_sync_soon(self._drain)
            except trio.RunFinishedError:
                self._batch.clear()
                raise PolygateError(ENDED) from None
            self._wake_pending = True
        if _interrupt.held.pending:  # (a Ctrl-C held in the hand-over: now, here)
            _interrupt.deliver()

    def start_job(self, start: Callable[[Any], object], job: Any) -> None:
        """``submit(start, job)`` for a call's job, where ``start`` spawns its task.

        Handed to trio here and now (the loop driver), ``start`` runs in the caller's
        own context, so the task it spawns copies the caller's context variables.
        Handed over later, from trio's entry queue, it would run in another context:
        then the job carries a copy of the caller's (``job.context``)."""
        self._check_usable()
        driver = self._live_driver()
        if driver is not None:
            driver.hand_over(start, job, system_context=False)
            return
        job.context = contextvars.copy_context()
        self.submit(start, job)

    def _drain(self) -> None:
        # trio context (the run's entry queue); same thread as the asyncio side.
        self._wake_pending = False
        batch = self._batch
        while batch:
            fn, args = batch.popleft()
            fn(*args)

    def linger(self) -> None:
        """In trio context, when a result has just gone to asyncio: keep trio's
        scheduler busy on this thread for ``_LINGER_TICKS`` ticks.

        Only with trio's helper thread (no :class:`LoopDriver`): an idle guest run
        waits for I/O in that thread, and waking it (the next call's submission)
        costs two thread hand-offs, each with a GIL hand-off.  The caller's next call
        usually comes within a loop iteration or two of its result, so a short,
        bounded linger lets it start inline.  One linger at a time; it never outlasts
        its ticks.  With the driver an idle run wakes in the loop's own poll, and a
        linger would only add ticks.
        """
        if self.driver is None and not self._lingering and self._nursery is not None:
            self._lingering = True
            # In a context of its own: started from a call's task, it would hold that
            # caller's context variables for as long as it lingers.
            contextvars.Context().run(self._nursery.start_soon, self._linger)

    async def _linger(self) -> None:
        try:
            for _ in range(_LINGER_TICKS):
                await trio.lowlevel.checkpoint()
        finally:
            self._lingering = False

    def start_task(
        self, fn: Callable[[], Awaitable[None]], context: contextvars.Context | None = None
    ) -> None:
        """In trio context: run ``fn()`` as a task of this run (it must not raise), in
        a copy of ``context`` (a session's: its opener's, as a trio-native session's
        tasks run in their opener's), else in trio's system context."""
        if self._nursery is not None:
            if context is None:
                self._nursery.start_soon(fn)
            else:
                context.run(self._nursery.start_soon, fn)  # (it copies the current one)
        else:  # under trio-asyncio: the run belongs to someone else
            trio.lowlevel.spawn_system_task(fn, context=context)

    # ------------------------------------------------------------ guest run

    def start(self) -> None:
        """Start the guest run; ``ready`` resolves once it accepts tasks."""
        # In a context of its own: trio's system context is a copy of the one it starts
        # in, and the first session's opener (a request's task) would otherwise lend
        # its context variables to every later session's work, and keep them alive as
        # long as the run lives.
        # Before trio looks at SIGINT: where Python's default handler has it, trio would
        # take it over (see _interrupt).
        self._sigint = _interrupt.install()
        try:
            contextvars.Context().run(
                trio.lowlevel.start_guest_run,
                self._main,
                run_sync_soon_threadsafe=self._post_threadsafe,
                run_sync_soon_not_threadsafe=self._post,
                done_callback=self._finished,
                # asyncio (and uvloop, uvicorn) own the process's signal wake-up fd.
                host_uses_signal_set_wakeup_fd=True,
            )
        except BaseException:
            self._give_back_sigint()
            raise
        self.token = trio.lowlevel.current_trio_token()
        self.hooks = sys.get_asyncgen_hooks()  # (installed by start_guest_run, just now)
        if self.driver is not None:  # (made by the first tick's hand-over, inside it)
            self.driver.hooks = self.hooks

    async def _main(self) -> None:
        if self._stop is None:  # (else stopped before this ran: see _set_stop)
            self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            resolve(self.ready, outcome.Value(None))
            await self._stop.wait()
            # Every session has closed (or the run is being abandoned): nothing of
            # ours is left in the nursery but what is being cancelled.
            nursery.cancel_scope.cancel()

    def stop(self) -> None:
        """Ask the guest run to end (the last session closed); ``finished`` resolves
        when it has."""
        self.accepting = False
        if self.guest and self.token is not None and not self._done:
            # (Not once the run has ended -- early, as a failed start does: its token
            # refuses with trio's RunFinishedError, which would hide the start's error.)
            self.token.run_sync_soon(self._set_stop)
        else:
            resolve(self.finished, outcome.Value(None))
        if _interrupt.held.pending:
            _interrupt.deliver()

    def _set_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        elif self._nursery is None:  # stopped before _main ran: it ends at once
            self._stop = trio.Event()
            self._stop.set()

    def _give_back_sigint(self) -> None:
        if self._sigint:
            self._sigint = False
            _interrupt.uninstall()

    def _finished(self, run_outcome: outcome.Outcome[None]) -> None:
        self._done = True
        self._give_back_sigint()
        self.hooks = None  # trio put back the hooks it found: nothing of its to restore
        if self.driver is not None:
            self.driver.hooks = None
        self._run_outcome = run_outcome
        if not self.ready.done():
            resolve(self.ready, outcome.Error(PolygateError("polygate's trio run ended early")))
        resolve(self.finished, outcome.Value(None))
        if isinstance(run_outcome, outcome.Error) and not self._rescuing:
            error = _leaf(run_outcome.error)
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                # Ctrl-C reached trio (its handler was installed): every call was
                # cancelled on the way out; now it ends the host loop as it would have.
                raise error
            interrupt = _interrupt_behind(error)
            if interrupt is not None:
                # Ctrl-C raised inside trio's scheduler (asyncio.run's second press
                # raises wherever the thread is; trio's protection is off under a
                # host's handler) broke the run: TrioInternalError.  The calls it held
                # will not settle; Ctrl-C ends the host loop, as it meant to.
                raise interrupt

    # The loop's own queues, with a record of what has not run yet (see _queued).

    def _post(self, fn: Callable[[], object]) -> None:
        if not self._first_tick_seen:
            # trio hands its first tick over once, from start_guest_run: take over
            # its ticks when its I/O wait can run on this loop.
            self._first_tick_seen = True
            driver = driver_for(self.loop, fn, self._post, self._rescue_left)
            if driver is not None:
                try:
                    fn = driver.start()
                except (NotImplementedError, OSError, ValueError):
                    pass  # a loop that cannot watch trio's descriptor: the helper thread
                else:
                    self.driver = driver
        self._post_threadsafe(fn, threadsafe=False)

    def _post_threadsafe(self, fn: Callable[[], object], *, threadsafe: bool = True) -> None:
        with self._lock:  # against rescue() taking its snapshot
            if self._rescuing:
                self._orphans.put(fn)
                return
            item = _Queued(fn, self._queued, self)
            self._queued.add(item)
        if not threadsafe:
            self.loop.call_soon(item)
            return
        try:
            self.loop.call_soon_threadsafe(item)
        except RuntimeError:  # the loop is closed: the rescue will run it
            pass

    # ------------------------------------------------------------ rescue

    def _rescue_left(self) -> float | None:
        """None while the loop runs the run; during a rescue, the seconds it has left."""
        if not self._rescuing:
            return None
        return max(0.0, self._give_up - time.monotonic())

    def rescue(self) -> None:
        """Finish a guest run whose loop closed under it, here and now.

        Runs in the thread of that run (trio's run state is thread-local).  Every
        callback the closed loop dropped is run again, every session of the run is
        cancelled (their calls settle, their connections close), and trio's ticks
        are driven from a plain queue until the run has finished, or for at most
        ``_RESCUE_LIMIT_S`` (``done`` then says whether it did).
        """
        give_up = time.monotonic() + _RESCUE_LIMIT_S
        with self._lock:
            self._give_up = give_up
            self._rescuing = True
            dropped = [item.fn for item in self._queued]
            self._queued.clear()
        for fn in dropped:
            self._orphans.put(fn)
        if self.driver is not None:
            self.driver.prod()  # an idle run waited on the closed loop: poll here now
        if self.token is not None and self._nursery is not None:
            nursery = self._nursery
            try:
                self.token.run_sync_soon(nursery.cancel_scope.cancel)
            except trio.RunFinishedError:
                # The run's main task is done (the last session had asked it to stop
                # when the loop closed): only its last steps are left, and the dropped
                # callbacks below drive them.
                pass
        while not self._done:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                break
            try:
                fn = self._orphans.get(timeout=remaining)
            except queue.Empty:
                break
            fn()
        if _interrupt.held.pending:
            _interrupt.deliver()


class _Queued:
    """A callback on the loop's queue that removes itself from ``pending`` when run,
    with the run's async-generator hooks in place (see :attr:`Host.hooks`)."""

    __slots__ = ("fn", "host", "pending")

    def __init__(self, fn: Callable[[], object], pending: set[_Queued], host: Host) -> None:
        self.fn = fn
        self.pending = pending
        self.host = host

    def __call__(self) -> None:
        if self in self.pending:
            self.pending.discard(self)
            saved = lend_hooks(self.host.hooks)
            try:
                self.fn()
            finally:
                return_hooks(saved)
            if _interrupt.held.pending:
                _interrupt.deliver()


# A Ctrl-C inside these waits for the end of trio's step (see _interrupt): each of
# them runs one, or hands trio work that schedules one.
_interrupt.guard(
    _Queued.__call__, Host.start, Host.stop, Host.submit, Host.start_job, Host.rescue,
)


def _interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C a ``TrioInternalError`` was raised from (trio raises it ``from`` what
    broke its run), if it was.  Not its ``__context__``: a Ctrl-C the application had
    handled before a trio bug would make that bug a Ctrl-C."""
    cause = error.__cause__
    return cause if isinstance(cause, KeyboardInterrupt) else None


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


# --------------------------------------------------------------------------- fork


class _Forks:
    """How many times this process's line was forked: a Host records it, and a child
    (which inherits the Host, its trio run's state and its sockets, but not the
    threads and the run itself) sees its own count differ.  A counter bumped by an
    ``os.register_at_fork`` hook, not ``os.getpid()`` per call (a system call)."""

    count = 0


forks = _Forks()


def _forked() -> None:
    forks.count += 1


if hasattr(os, "register_at_fork"):  # (not on Windows: no fork there)
    os.register_at_fork(after_in_child=_forked)

#: What a child forked while a session was open is told (acquire, Host._check_usable
#: and the session's _check_loop).
FORKED = (
    "this process was forked while a polygate.aio session of its parent was open; "
    "what it inherited (the session's trio run, its sockets) is the parent's. Open "
    "sessions after forking (as gunicorn's --preload allows), or start processes with "
    "multiprocessing's 'spawn' or 'forkserver' method"
)


# --------------------------------------------------------------------------- registry


class _Hosts(threading.local):
    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, Host] = {}


_hosts = _Hosts()


async def acquire() -> Host:
    """The host of the running loop, started if needed, with one more user.

    Pair every successful ``acquire()`` with ``release()``."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise PolygateError(
            "polygate.aio.session() runs on an asyncio event loop, and none is running "
            "here; from trio, use polygate.session()"
        ) from None
    by_loop = _hosts.by_loop
    if any(h.process != forks.count and not h._done for h in by_loop.values()):
        # The parent's run state came with the fork (trio believes a run is on in
        # this thread): no run can start here, and the parent's is not ours to use.
        raise PolygateError(f"polygate.aio cannot start: {FORKED}")
    for stale_loop, stale in list(by_loop.items()):
        if stale_loop.is_closed():
            if stale.guest and not stale._done:
                # The abandoned run ends here, inside this loop's run, and trio then
                # restores the async-generator hooks it found when it started: the
                # closed loop's.  This loop keeps its own.
                hooks = sys.get_asyncgen_hooks()
                try:
                    stale.rescue()
                finally:
                    sys.set_asyncgen_hooks(*hooks)
                if not stale._done:
                    # Kept: the next acquire() in this thread tries again.
                    raise PolygateError(
                        "polygate.aio cannot start in this thread: a session was still "
                        "open when its event loop closed, and its calls did not finish "
                        f"within {_RESCUE_LIMIT_S:g} s of being cancelled"
                    )
                warnings.warn(
                    "a polygate.aio session was still open when its event loop closed; "
                    "its calls were cancelled and it was closed now",
                    ResourceWarning,
                    stacklevel=2,
                )
            del by_loop[stale_loop]
    while True:
        host = by_loop.get(loop)
        if host is None:
            if trio.lowlevel.in_trio_run() and any(h.guest and not h._done for h in by_loop.values()):
                raise PolygateError(
                    "polygate.aio cannot start on this event loop: the sessions of another "
                    "event loop in this thread are still open (that loop was stopped, not "
                    "closed); leave them, or close that loop, first"
                )
            host = Host(loop, guest=not trio.lowlevel.in_trio_run())
            if host.guest:
                host.start()
            else:
                # trio is already running in this thread: trio-asyncio's loop (or the
                # application's own guest run) is driven by this asyncio loop.
                host.token = trio.lowlevel.current_trio_token()
                resolve(host.ready, outcome.Value(None))
            # (Registered once started: a Ctrl-C raised before would leave a host that
            # never starts, and every later session on this loop waiting for it.)
            by_loop[loop] = host
        if not host.accepting:
            # The last session of this loop is shutting its run down: wait, then anew.
            await asyncio.shield(host.finished)
            if by_loop.get(loop) is host:
                del by_loop[loop]
            continue
        host.users += 1
        if _interrupt.held.pending:
            # A Ctrl-C held in the run's start: raised here, now (its first step,
            # posted, would raise it in the loop's next run: a later cell).  The run
            # is asked to stop, unless another session uses it, and ends on its own
            # (a later acquire waits for that); waiting here would hold the Ctrl-C.
            try:
                _interrupt.deliver()
            except KeyboardInterrupt:
                host.users -= 1
                if host.users == 0:
                    host.stop()
                raise
        try:
            await asyncio.shield(host.ready)
        except BaseException:
            await release(host)
            raise
        return host


async def release(host: Host) -> None:
    """One user fewer; the last one stops the run and waits until it has finished."""
    host.users -= 1
    if host.users > 0:
        return
    host.stop()
    try:
        await settle(host.finished)
    finally:
        # (settle raises only once the run has finished: a cancellation that came
        # meanwhile, anyio's again each loop iteration.  The entry goes all the same,
        # or the loop, closed, stays referenced until this thread's next acquire.)
        if _hosts.by_loop.get(host.loop) is host:
            del _hosts.by_loop[host.loop]


async def settle(fut: asyncio.Future[Any]) -> None:
    """Wait for ``fut`` even through cancellation (bounded by what it waits for: trio
    settling work it has already cancelled); a cancellation is re-raised after."""
    cancelled: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        raise cancelled
