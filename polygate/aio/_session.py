"""``polygate.aio.session()``: a polygate session for asyncio code.

The bridge is thin on purpose: every call is the trio ``polygate.Session``'s own
method, run in a trio task of a nursery the session owns (a task parked after its
call takes the next one: see ``_Owner._spawn``; no thread per call), its result or
error handed to the awaiting asyncio task through an asyncio future.  No logic of
polygate lives here.

Forwarding, so that a new ``polygate.Session`` method needs one line or none:

* ``chat = _forward(polygate.Session.chat)``: one line per coroutine method gives it
  its exact signature for type checkers and ``help()``;
* anything else public on ``polygate.Session`` is found by ``__getattr__`` (at run
  time only: a type checker sees the lines above, so a misspelt name is its error):
  coroutine methods are bridged the same way, synchronous ones are called directly
  (same thread: the trio run is a guest of this loop), and a result that is an async
  context manager *and* an async iterator (a stream) is wrapped in
  :class:`ChatStream`.  ``tests/test_aio.py`` checks that every public method of
  ``polygate.Session`` is reachable here with the same parameters.

Cancellation, both ways (the invariants):

* asyncio → trio: a cancelled asyncio task cancels its call's cancel scope and waits
  until the trio task has *finished* (every path settled, the upstream connection
  closed) before ``CancelledError`` goes on.  ``asyncio.timeout()`` is such a
  cancellation, so it behaves like ``call_deadline_s``: a ``TimeoutError`` once
  everything is settled.
* trio → asyncio: a call's error reaches asyncio as itself (polygate raises one
  error, never a group).  Leaving the session cancels the calls still in flight; each
  caller gets ``PolygateError`` (the session was closed), after its call settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import random
import threading
import types
import warnings
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import httpx
import outcome
import trio

import polygate
from polygate import PolygateError
from polygate._session import (
    STREAM_BUFFER,
    OneUse,
    StreamDone,
    StreamFailed,
    StreamItem,
    own_arguments,
    twin_error,
)

from ._host import ENDED, FORKED, Host, acquire, forks, release, resolve, settle, settleable

if TYPE_CHECKING:
    from polygate import ChatResponse, SessionStatistics, Settings, StreamChunk

__all__ = ["ChatStream", "Session", "session"]

P = ParamSpec("P")
T = TypeVar("T")

_CLOSED = "this session is closed"
_BLOCK_LEFT = "this stream was closed before it finished (its block exited)"
_CLOSED_IN_FLIGHT = "the session was closed while this call was in flight"
#: The name of a bridged call's trio task (trio would otherwise format one per call).
_TASK_NAME = "polygate.aio call"
#: Worker tasks kept parked for the next calls (see _Owner._spawn); more concurrent
#: calls than this spawn tasks that end with their call.  A woken task runs its next
#: call in that caller's context through trio's ``Task.context`` (the context trio
#: steps a task in): a trio without it as a settable field gets a task per call.
_IDLE_WORKERS = 128 if "context" in getattr(trio.lowlevel.Task, "__slots__", ()) else 0


class _Job:
    """One bridged call: the asyncio future its caller awaits, and its trio side."""

    __slots__ = (
        "args",
        "cancel_requested",
        "context",
        "done",
        "fn",
        "fut",
        "kwargs",
        "scope",
        "waiter",
    )

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                 kwargs: dict[str, Any], fut: asyncio.Future[Any]) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.fut = fut
        # The caller's context variables (request ids, the current span) go with the
        # call.  Set only when the job is handed over later, from another context (see
        # Host.start_job); otherwise the job starts in the caller's own context.
        self.context: contextvars.Context | None = None
        self.scope: trio.CancelScope | None = None
        self.cancel_requested = False
        self.done = False
        self.waiter: asyncio.Future[None] | None = None

    def cancel(self) -> None:
        # trio context.  A finished job is left alone: its worker's scope (see
        # _Owner._work) may already carry the next call, and a cancellation handed
        # over through trio's entry queue can arrive after the job ended.
        if self.done:
            return
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()


def _forward(
    method: Callable[Concatenate[polygate.Session, P], Awaitable[T]], own: str | None = None,
) -> Callable[Concatenate[Session, P], Coroutine[object, object, T]]:
    """An asyncio method running the trio ``method`` of the session (one line per
    method: ``chat = _forward(polygate.Session.chat)``).  ``own``: the kind of call
    whose messages and parameters are copied as it is made (``own_arguments``), as
    the trio method copies them before its first checkpoint: here the trio method
    starts after two yields, and the caller may change them meanwhile."""

    async def forward(self: Session, /, *args: P.args, **kwargs: P.kwargs) -> T:
        # (Session._call inlined: one coroutine frame fewer a call.)
        self._check_open()
        if own is not None:
            args, kwargs = own_arguments(own, args, kwargs)  # type: ignore[assignment]
        job = _Job(method, (self._session, *args), kwargs, self._loop.create_future())
        try:
            await _checkpoint()
        except asyncio.CancelledError:
            self._start_cancelled(job)
            await self._cancel(job)
            raise
        # Closed (or forked) meanwhile: said so, as before the yields.  (Not the
        # running loop again: this task runs on the loop it ran on before them.)
        if self._owner.closing or self._host.process != forks.count:
            self._check_open()
        try:
            self._host.start_job(self._owner.start_job, job)
        except KeyboardInterrupt:
            self._abandon(job)
            raise
        try:
            return await job.fut  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            await self._cancel(job)
            raise
        except BaseException:
            # The call's error: its traceback holds this frame, whose job holds the
            # future that holds the error (a cycle only the cyclic collector frees).
            del job
            raise

    functools.update_wrapper(forward, method)
    forward.__qualname__ = f"Session.{method.__name__}"
    forward.__module__ = "polygate.aio"
    return forward


@types.coroutine
def _checkpoint() -> Generator[None, None, None]:
    """What a trio call's first checkpoint is to it: a cancellation already due lands
    here, before the call starts and anything is sent.  An asyncio.timeout() whose
    deadline passed before the call (its timer due, or its callback queued, but not yet
    run by the loop) is one: started at once instead, in the caller's step, the call
    was written to the wire and billed, its answer thrown away.  Two yields: the
    first lets the loop run what is queued, and the second what the loop found due
    (asyncio moves due timers to its queue behind a task that yielded before them).
    (It also keeps a loop of cache hits from starving the other tasks.)  Each bare
    ``yield`` is what ``asyncio.sleep(0)`` does (its ``__sleep0``): the task goes
    behind what is queued, and a cancellation lands there; one generator frame for
    both, not four coroutine frames."""
    yield
    yield


def _forward_stream(
    method: Callable[Concatenate[polygate.Session, P], polygate.ChatStream],
) -> Callable[Concatenate[Session, P], ChatStream]:
    def forward(self: Session, /, *args: P.args, **kwargs: P.kwargs) -> ChatStream:
        self._check_open()
        # Validation happens here, synchronously, exactly as in trio: same errors.
        return ChatStream(self, method(self._session, *args, **kwargs))

    functools.update_wrapper(forward, method)
    forward.__qualname__ = f"Session.{method.__name__}"
    forward.__module__ = "polygate.aio"
    return forward


class Session:
    """The asyncio face of a :class:`polygate.Session`; obtain one with
    ``async with polygate.aio.session(...)``.  Same methods, arguments, results and
    errors; share one among any number of asyncio tasks."""

    def __init__(self, host: Host, owner: _Owner, trio_session: polygate.Session) -> None:
        self._host = host
        self._owner = owner
        self._session = trio_session
        self._loop = host.loop
        #: The block that opened it (see SessionBlock.__aenter__).
        self._block: SessionBlock | None = None

    def __repr__(self) -> str:
        return repr(self._session).replace("polygate.Session", "polygate.aio.Session", 1)

    @property
    def settings(self) -> Settings:
        return self._session.settings

    # One line per method.  (mypy wants a positional-only ``self`` for Concatenate and
    # says so, yet infers the exact signature: hence the ignores.)
    chat = _forward(polygate.Session.chat, "chat")  # type: ignore[arg-type]
    embed = _forward(polygate.Session.embed, "embed")  # type: ignore[arg-type]
    _statistics = _forward(polygate.Session.statistics)

    async def statistics(self) -> SessionStatistics:
        """As :meth:`polygate.Session.statistics`; after the session's block was left,
        its final figures (the last telemetry flush included)."""
        # The loop first: from another thread, waiting for the close would touch this
        # loop's futures (not thread-safe) and fail with asyncio's own error.
        _check_loop(self._host, "this session", "open one per loop")
        if self._host.broken(self._owner.closed):
            raise PolygateError(ENDED)  # (its figures went with the run)
        if self._owner.closing:
            await settle(self._owner.closed)
            if self._owner.final is not None:
                return self._owner.final
        return await self._statistics()
    ocr = _forward(polygate.Session.ocr, "ocr")  # type: ignore[arg-type]
    stream_chat = _forward_stream(polygate.Session.stream_chat)  # type: ignore[arg-type]

    if not TYPE_CHECKING:  # to a type checker a misspelt name is an error, not Any

        def __getattr__(self, name: str) -> Any:
            # Public methods of polygate.Session without a line above (new ones).
            if name.startswith("_"):
                raise AttributeError(name)
            target = getattr(self._session, name)
            method = getattr(type(self._session), name, None)
            if inspect.iscoroutinefunction(method):
                return functools.partial(_forward(method), self)
            if callable(target):

                @functools.wraps(target)
                def call(*args: Any, **kwargs: Any) -> Any:
                    self._check_open()
                    result = target(*args, **kwargs)
                    if hasattr(result, "__aenter__") and hasattr(result, "__anext__"):
                        return ChatStream(self, result)
                    return result

                return call
            return target

    # ------------------------------------------------------------------ the bridge

    def _check_open(self) -> None:
        if self._owner.closing:
            raise PolygateError(_CLOSED)
        _check_loop(self._host, "this session", "open one per loop")

    def _start_cancelled(self, job: _Job) -> None:
        """A call cancelled at its entry checkpoint starts all the same, cancelled: it
        sends nothing, and it has its one outcome on the trio side too (its telemetry
        row says ``cancelled``, as a trio call's cancelled at its first checkpoint).
        A session closed meanwhile has nothing to start."""
        job.cancel_requested = True
        try:
            self._host.start_job(self._owner.start_job, job)
        except PolygateError:
            job.done = True

    def _abandon(self, job: _Job) -> None:
        """A Ctrl-C held back during the job's first steps (see _interrupt) was raised
        as they ended, in the caller's task, which it ends: the call goes with it,
        cancelled without waiting (the interrupt goes on at once), its answer or
        error never retrieved."""
        job.fut.add_done_callback(_retrieved)
        if not job.done:
            with contextlib.suppress(PolygateError):
                self._host.submit(job.cancel)

    async def _cancel(self, job: _Job) -> None:
        """The caller was cancelled: cancel the trio side and wait until every path of
        it has settled."""
        if not job.done:
            job.waiter = self._loop.create_future()
            try:
                self._host.submit(job.cancel)
            except PolygateError:
                # The trio run ended under the call without settling it (it broke:
                # Ctrl-C forced into its scheduler, see Host._finished): nothing is
                # left to wait for, and the cancellation goes on as itself.
                _retrieved(job.fut)
                return
            await settle(job.waiter)
        _retrieved(job.fut)


def _check_loop(host: Host, what: str, advice: str) -> None:
    """A PolygateError unless the running loop is ``host``'s, in its process."""
    if host.process != forks.count:
        # A forked child (asyncio says the loop it inherited is not running there):
        # the calls would go on the parent's sockets, leaving would stop its run.
        raise PolygateError(f"{what} belongs to another process: {FORKED}")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is None and threading.get_ident() == host.thread:
        # (Between two run_until_complete() calls, say: not another loop, no loop.)
        raise PolygateError(
            f"no event loop is running here: use {what} from a coroutine running on the "
            "loop that opened the session")
    if running is not host.loop:
        raise PolygateError(f"{what} belongs to another event loop (or thread); {advice}")


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark an answer the caller will not see (it was cancelled at the yield point
    after it) as seen: asyncio would log an error it held as never retrieved."""
    if fut.done() and not fut.cancelled():
        fut.exception()


def _refuse(job: _Job) -> None:
    """A job that never started: the session is closed."""
    job.done = True
    resolve(job.fut, outcome.Error(PolygateError(_CLOSED)))
    if job.waiter is not None:
        resolve(job.waiter, outcome.Value(None))


#: The most closing a caller's transport may take when the session closes.
_TRANSPORT_CLOSE_S = 5.0


class _Owner:
    """The trio task that owns one trio session and the nursery of its calls."""

    def __init__(
        self, host: Host, open_session: Callable[[], Any],
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.host = host
        self.open_session = open_session
        self.transport = transport
        loop = host.loop
        self.opened: asyncio.Future[polygate.Session] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.closing = False
        self.close_requested = trio.Event()
        self.calls: trio.Nursery | None = None
        #: Worker tasks parked between calls, the most recently parked last.
        self._idle: list[trio.lowlevel.Task] = []
        # The session's statistics once it has closed (its telemetry flushed): what
        # statistics() answers from then on, as the trio session's does.
        self.final: SessionStatistics | None = None

    async def run(self) -> None:
        """Open the session, run calls until asked to close, close.  Never raises
        an Exception: its outcome goes to asyncio through ``opened`` / ``closed``."""
        result: outcome.Outcome[None] = outcome.Value(None)
        try:
            async with self.open_session() as trio_session, trio.open_nursery() as calls:
                self.calls = calls
                resolve(self.opened, outcome.Value(trio_session))
                await self.close_requested.wait()
                calls.cancel_scope.cancel()
            try:
                self.final = await trio_session.statistics()
            except Exception:  # a backend that needs its closed connections: no figures
                self.final = None
            if self.transport is not None:
                # The caller's transport holds trio sockets now: only this run can close
                # them (from asyncio, httpcore's close fails).  Bounded like a session's
                # own closing.
                with trio.move_on_after(_TRANSPORT_CLOSE_S):
                    await self.transport.aclose()
        except Exception as exc:
            result = outcome.Error(exc)
        finally:
            # Also on the way out of a cancelled run (host loop shut down, Ctrl-C).
            self.calls = None
            self.closing = True
            if not self.opened.done():
                resolve(self.opened, result if isinstance(result, outcome.Error)
                        else outcome.Error(PolygateError(_CLOSED)))
                result = outcome.Value(None)
            resolve(self.closed, result)

    def request_close(self) -> None:
        # trio context (before run() started, too: it then closes at once)
        self.close_requested.set()

    def start_job(self, job: _Job) -> None:
        # trio context: a call starts, or is refused when the session is closing.
        if self.calls is None or self.close_requested.is_set():
            _refuse(job)
            return
        # The caller's context variables (request ids, the current span) go with it:
        # this runs in the caller's context, or in a copy of it taken at submission.
        try:
            if job.context is None:
                self._spawn(job)
            else:
                job.context.run(self._spawn, job)
        except RuntimeError:
            # The calls' nursery has closed under us (the session's block was
            # cancelled from outside and is still closing): refused like a closed one.
            _refuse(job)

    def _spawn(self, job: _Job) -> None:
        idle = self._idle
        if idle:
            # An idle worker takes the call: waking a parked task costs a fraction of
            # spawning one (a coroutine, a Task, a context copy, the nursery's
            # bookkeeping, and its exit).  It runs the call in a copy of this
            # (the caller's) context, as a task spawned here would.
            task = idle.pop()
            task.context = contextvars.copy_context()
            trio.lowlevel.reschedule(task, outcome.Value(job))
            return
        assert self.calls is not None
        self.calls.start_soon(self._work, job, name=_TASK_NAME)

    async def _work(self, job: _Job) -> None:
        """Run ``job``, then park, idle, for the next call (up to ``_IDLE_WORKERS``
        parked at once); the calls' nursery ends the idle ones when the session
        closes."""
        task = trio.lowlevel.current_task()
        idle = self._idle

        def abort(_: Any) -> trio.lowlevel.Abort:
            # (Not there only if an interrupt landed between a pop and its wake-up.)
            with contextlib.suppress(ValueError):
                idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        # One cancel scope for the worker's life, not one a call: cancelling a call
        # cancels its worker's scope, and the worker then ends with that call instead
        # of parking with its scope cancelled.  (A scope a call cost ~4 µs.)
        with trio.CancelScope() as scope:
            while True:
                await self._run_job(job, scope)
                if scope.cancel_called or len(idle) >= _IDLE_WORKERS \
                        or self.close_requested.is_set():
                    return
                # Parked, it holds nothing of the call it ran: not the job (its
                # future holds the answer, its arguments the prompt), not its
                # caller's context variables.
                job = None  # type: ignore[assignment]
                task.context = contextvars.Context()
                idle.append(task)
                job = await trio.lowlevel.wait_task_rescheduled(abort)

    async def _run_job(self, job: _Job, scope: trio.CancelScope) -> None:
        fut = job.fut
        try:
            job.scope = scope
            if job.cancel_requested:
                scope.cancel()
            try:
                value = await job.fn(*job.args, **job.kwargs)
            except trio.Cancelled:
                raise  # (the call's cancellation, or the session's close: see below)
            except BaseException as exc:
                # A KeyboardInterrupt or SystemExit out of the call (a transport or a
                # validator of the caller's) is the caller's, as from trio: raised from
                # its await, the session going on.  Let out of this task, it ended the
                # session: the call got "closed while in flight", every other call
                # was cancelled, and asyncio.run() raised it after all.
                if isinstance(exc, PolygateError):
                    # Raised from the caller's await, with the frames from there: this
                    # frame's, which the traceback would hold, holds the future that
                    # holds the error (a cycle only the cyclic collector frees).
                    exc.__traceback__ = None
                if settleable(fut):
                    fut.set_exception(exc)
            else:
                if settleable(fut):
                    fut.set_result(value)
        finally:
            job.done = True
            # A stream's job is its method, which holds the stream, which holds the job.
            job.fn, job.args, job.kwargs = _spent, (), {}
            if not fut.done():
                # Cancelled from outside this job's scope: the session is closing.
                resolve(fut, outcome.Error(PolygateError(_CLOSED_IN_FLIGHT)))
            if job.waiter is not None:
                resolve(job.waiter, outcome.Value(None))
            if self.host.driver is None:  # (linger's own first test, without a call)
                self.host.linger()


async def _spent() -> None:
    """A job's function once it has run (see ``_Owner._run_job``)."""
    raise AssertionError("a job runs once")


# --------------------------------------------------------------------------- streams


class _End:
    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Handover:
    """The trio stream's sink (``polygate.ChatStream._deliver_into``): what its call
    delivers goes straight into the asyncio side's buffer, which holds at most
    ``STREAM_BUFFER`` items, as trio's channel does; a reader that has taken it down
    to half wakes the call again (one hand-over between the two loops per half a
    buffer, not per chunk)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: ChatStream) -> None:
        self._stream = stream

    def send_nowait(self, item: StreamItem, /) -> None:
        stream = self._stream
        if stream._held() >= STREAM_BUFFER:
            raise trio.WouldBlock
        stream._take(item)

    async def send(self, item: StreamItem, /) -> None:
        # As trio's channel: a checkpoint whether or not it waits, and a send that
        # raised (cancelled while waiting) has put nothing.
        await trio.lowlevel.checkpoint_if_cancelled()
        stream = self._stream
        if stream._held() < STREAM_BUFFER:
            stream._take(item)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        while stream._held() >= STREAM_BUFFER:
            space = stream._space = trio.Event()
            try:
                await space.wait()
            finally:
                stream._space = None
        stream._take(item)

    def close(self) -> None:
        stream = self._stream
        if not stream._ended:
            failure = stream._stream._end_unsent()
            if failure is not None:
                stream._push(_End(failure))
            else:
                stream._cut_off()


class ChatStream:
    """Async context manager and async iterator of :class:`polygate.StreamChunk`, the
    asyncio face of :class:`polygate.ChatStream`.

    Its trio side enters the trio stream in a task of the session; the call puts its
    chunks straight into this side's bounded buffer (a slow consumer holds the call
    back at the same 32 chunks as in trio).  Leaving the block early, or a cancellation, cancels the call;
    ``__aexit__`` returns once every path has settled.  The job's future resolves
    when the trio stream has been *entered*; the iteration goes on after it.
    """

    def __init__(self, owner_session: Session, trio_stream: Any) -> None:
        self._session = owner_session
        self._stream = trio_stream
        self._loop = owner_session._loop
        self._chunks: deque[StreamChunk | _End] = deque()
        self._failure: BaseException | None = None  # the end a reader took, when it failed
        # One wake-up per reader waiting: two tasks may read one stream, as in trio.
        self._waiters: list[asyncio.Future[None]] = []
        # Readers woken by a chunk that have not run yet: what they will take is theirs
        # already, as trio's channel hands a chunk to a waiting reader outside its
        # buffer, so it takes none of the buffer's room (see _held).
        self._promised = 0
        self._leaving = False  # the stream's own block is being left
        self._exited = False  # ... or has been: reading on is an error, as in trio
        self._space: trio.Event | None = None
        self._job: _Job | None = None
        self._finished = False
        self._ended = False
        self._trio_response: ChatResponse | None = None
        self.response: ChatResponse | None = None

    @property
    def text(self) -> str:
        """The first choice's content handed to this stream so far (see polygate.ChatStream.text)."""
        return str(self._stream.text)

    @property
    def text_parts(self) -> list[str]:
        return self._stream.text_parts  # type: ignore[no-any-return]

    if not TYPE_CHECKING:  # as above: a misspelt name is an error to a type checker

        def __getattr__(self, name: str) -> Any:
            # Attributes the trio stream may grow (read-only, same thread).
            if name.startswith("_"):
                raise AttributeError(name)
            return getattr(self._stream, name)

    async def __aenter__(self) -> ChatStream:
        if self._job is not None:
            raise PolygateError("a ChatStream can be entered only once")
        session = self._session
        session._check_open()
        job = self._job = _Job(self._iterate, (), {}, self._loop.create_future())
        try:
            await _checkpoint()  # (see _forward)
        except asyncio.CancelledError:
            session._start_cancelled(job)
            await self._entry_failed(job)
            raise
        try:
            session._check_open()  # (closed meanwhile: said so, as before the yields)
        except PolygateError:
            job.done = True
            self._exited = True
            raise
        try:
            session._host.start_job(session._owner.start_job, job)
        except KeyboardInterrupt:
            self._exited = True
            session._abandon(job)
            raise
        try:
            await job.fut
        except BaseException:
            await self._entry_failed(job)
            raise
        return self

    async def _entry_failed(self, job: _Job) -> None:
        # The block never ran (``async with`` calls no __aexit__ after a failed
        # __aenter__): the stream is left as a block is, and a read of it refused,
        # whatever the trio side had buffered.
        self._exited = True
        await self._settle()
        _retrieved(job.fut)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session._host.process != forks.count and exc is not None:
            return  # a forked child on its way out: as SessionBlock.__aexit__
        self._check_loop()
        if self._job is None:  # (as polygate.ChatStream)
            raise PolygateError("this ChatStream was never entered ('async with' enters it)")
        self._exited = True
        await self._settle()

    def _check_loop(self) -> None:
        # A stream is its session's loop's: from another thread it would hand trio
        # work from the wrong thread and leave the session stuck.
        _check_loop(self._session._host, "this stream", "read it where its session was opened")

    async def _settle(self) -> None:
        """Cancel the trio side unless it has finished, and wait until it has."""
        job = self._job
        if job is None or job.done:
            return
        self._leaving = True
        job.waiter = self._loop.create_future()
        try:
            self._session._host.submit(job.cancel)
        except PolygateError:
            return  # the run broke under the stream (see Session._cancel): nothing to wait for
        await settle(job.waiter)

    async def _iterate(self) -> None:
        # trio side: the job's task.  It enters the trio stream, whose call puts its
        # chunks straight into this side's buffer (``_Handover``), and stays in its
        # block until that call has ended.
        job = self._job
        assert job is not None
        entered = False
        self._ended = False
        stream = self._stream
        stream._deliver_into(_Handover(self))
        try:
            async with stream:
                entered = True
                resolve(job.fut, outcome.Value(None))
                await stream._until_ended()
        except Exception as exc:
            if entered and not self._ended:  # (a failure of leaving the block)
                self._push(_End(exc))
            elif not entered:
                raise  # the job delivers it to __aenter__
        finally:
            # Nothing waits for space any more: a reader must not wake a trio run that
            # may have ended meanwhile (its submit would raise, a chunk taken and lost).
            self._space = None
            if entered and not self._ended:  # (the sink's close said it already)
                self._cut_off()

    def _cut_off(self) -> None:
        # The call ended with no end for the reader: cancelled from outside, as the
        # stream's block was left or the session closed under the stream.
        self._push(_End(PolygateError(_BLOCK_LEFT if self._leaving else _CLOSED_IN_FLIGHT)))

    def _take(self, item: StreamItem) -> None:
        if isinstance(item, StreamDone):
            self._trio_response = item.response
            self._push(_End(None))
        elif isinstance(item, StreamFailed):
            self._push(_End(item.error))
        else:
            self._push(item)

    def _held(self) -> int:
        """The items the buffer holds for readers still to come (its bound's measure)."""
        return len(self._chunks) - self._promised

    def _push(self, item: StreamChunk | _End) -> None:
        if isinstance(item, _End):
            self._ended = True
        self._chunks.append(item)
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            self._promised += len(waiters)
            for waiter in waiters:
                resolve(waiter, outcome.Value(None))

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._job is None:
            raise PolygateError("use 'async with session.stream_chat(...) as stream' first")
        self._check_loop()
        if self._finished:
            if self._failure is not None:  # it failed: every reader hears so, as in trio
                raise twin_error(self._failure)
            raise StopAsyncIteration
        if self._exited:
            # Whatever was buffered when the block was left is not handed out (trio's
            # stream says the same, whether or not its call had finished).
            raise PolygateError(_BLOCK_LEFT)
        while not self._chunks:
            if self._finished:  # another reader took the end
                if self._failure is not None:
                    raise twin_error(self._failure)
                raise StopAsyncIteration
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:  # cancelled while waiting
                    self._waiters.remove(waiter)
                else:  # woken: it takes its chunk now, with no yield (or waits again)
                    self._promised -= 1
        item = self._chunks.popleft()
        space = self._space
        if space is not None and len(self._chunks) <= STREAM_BUFFER // 2:
            self._space = None
            self._session._host.submit(space.set)
        if isinstance(item, _End):
            self._finished = True
            error = item.error
            del item
            if error is not None:
                # Later readers get copies of a copy: this stream must not hold what
                # its reader raises, whose traceback holds this frame, which holds the
                # stream (a cycle only the cyclic collector frees).
                self._failure = twin_error(error)
                try:
                    raise error
                finally:
                    del error
            self.response = self._trio_response
            raise StopAsyncIteration
        return item


# --------------------------------------------------------------------------- session()


def session(
    settings: Settings | None = None,
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    rng: random.Random | None = None,
) -> SessionBlock:
    """Open a polygate session from asyncio code (asyncio, uvloop, uvicorn, or
    trio-asyncio's loop): ``async with polygate.aio.session(...) as s``.  Same
    arguments and behaviour as :func:`polygate.session`: leaving it flushes and closes
    everything, and cancels calls still in flight.  A ``transport`` passed in is closed
    with it: its connections are trio's, which asyncio code cannot close."""
    # (The trio session is opened through a closure, whose repr shows nothing: no
    # frame of the opening holds ``env``, which a crash reporter would show beside a
    # configuration error.)
    return SessionBlock(OneUse(
        _open(lambda: polygate.session(settings, env=env, transport=transport, rng=rng), transport),
        "polygate.aio.session()",
    ))


class SessionBlock:
    """The ``async with`` of :func:`session`: left only on the loop that opened it
    (anywhere else a PolygateError that changes nothing, as for the session's calls)."""

    def __init__(self, opening: contextlib.AbstractAsyncContextManager[Session]) -> None:
        self._opening = opening
        self._host: Host | None = None
        #: Its ``__aexit__`` has begun (a session closed otherwise was dropped).
        self.left = False

    async def __aenter__(self) -> Session:
        handle = await self._opening.__aenter__()
        self._host = handle._host
        # Held by the session it opened: ``s = await polygate.aio.session().__aenter__()``
        # (a notebook's way to keep a session across cells) drops the block at once,
        # and its opening generator, collected, would close the session under ``s``.
        handle._block = self
        return handle

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._host is not None:
            if self._host.process != forks.count and exc is not None:
                # A forked child leaving the block it inherited on its way out
                # (sys.exit, an error): that goes on as itself; the parent's session
                # is left alone (and the opening generator too: see _open).
                return None
            _check_loop(self._host, "this session", "leave it on the loop that opened it")
        self.left = True
        return await self._opening.__aexit__(exc_type, exc, tb)


@asynccontextmanager
async def _open(
    opener: Callable[[], Any],
    transport: httpx.AsyncBaseTransport | None,
) -> AsyncIterator[Session]:
    host = await acquire()
    try:
        owner = _Owner(host, opener, transport=transport)
        host.submit(host.start_task, owner.run, contextvars.copy_context())
        try:
            trio_session = await asyncio.shield(owner.opened)
        except asyncio.CancelledError:
            host.submit(owner.request_close)
            try:
                await settle(owner.closed)
            finally:
                # (Even when settle re-raises a cancellation that came meanwhile:
                # anyio cancels again at each loop iteration.)
                if owner.opened.done() and not owner.opened.cancelled():
                    # Retrieved: an opening that failed after the cancellation is not
                    # news to anyone ("Future exception was never retrieved" otherwise).
                    owner.opened.exception()
            raise
        except BaseException:
            await settle(owner.closed)
            raise
        handle = Session(host, owner, trio_session)
        # (In a forked child, asyncio's shutdown_asyncgens closing the generator it
        # inherited: the session, its run and sockets are the parent's, and nothing
        # here may touch them.)
        try:
            yield handle
        except GeneratorExit:
            if host.process == forks.count:
                await _close(host, owner, leaving=True)
                if handle._block is not None and not handle._block.left:
                    # Never left: asyncio closed this generator (the session and its
                    # block were both dropped, or the loop shut its generators down).
                    warnings.warn(
                        "a polygate.aio session that was never left has been closed by "
                        "asyncio (the session and its block were dropped, or the loop "
                        "shut down its async generators): use `async with "
                        "polygate.aio.session(...)`, or keep the block and leave it with "
                        "its `__aexit__`",
                        ResourceWarning,
                        stacklevel=1,
                    )
            raise
        except BaseException:
            if host.process == forks.count:
                await _close(host, owner, leaving=True)
            raise
        else:
            if host.process == forks.count:
                await _close(host, owner, leaving=False)
    finally:
        if host.process == forks.count:
            await release(host)


async def _close(host: Host, owner: _Owner, *, leaving: bool) -> None:
    """Leave a session's block (``leaving``: with an exception of the block's own on
    its way out): close the trio session and wait until it has."""
    owner.closing = True
    if host.broken(owner.closed):
        # What the session held went with its run; raised only when nothing else is
        # on its way out (a Ctrl-C, a cancellation: kept as they are).
        if not leaving:
            raise PolygateError(ENDED)
        return
    if not owner.closed.done():
        # (Done already: the trio run it lived in ended -- the application's own guest
        # run, say -- and closed it; nothing is left to ask, and a submission to a
        # finished run would fail.)
        host.submit(owner.request_close)
    await settle(owner.closed)
    owner.closed.result()  # an error closing the trio session, as itself
