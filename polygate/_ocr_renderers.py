"""Where OCR renders PDF pages: renderer processes (the default) or worker threads.

Why processes.  Rendering a page (PDFium), encoding it (Pillow) and its base64 take
tens of milliseconds, and parts of that hold the GIL.  In worker threads the event
loop's thread competes for the GIL with them: with the interpreter's 5 ms switch
interval the loop waited 8–14 ms at a time while a 20-page PDF rendered
(``benchmarks/ocr.py``).  A renderer process has its own GIL; the calling process only
moves bytes through a pipe.

Why not ``multiprocessing`` (or trio-parallel, built on it).  Its ``spawn`` and
``forkserver`` start methods import the caller's ``__main__`` module again in the
child: a script that calls ``ocr()`` without an ``if __name__ == "__main__":`` guard
runs twice — its requests included — and then fails in the child.  (``fork`` is
unsafe in a process with threads, and deprecated there.)  A library cannot ask that
of every script that OCRs a PDF.  So a renderer is ``python -I -c <boot>`` started
as ``trio.lowlevel.open_process`` starts one (``polygate/_child.py``): the child loads
``polygate/_ocr_render.py`` by its path and nothing else of the caller (not even the
``polygate`` package, whose imports take 0.2-0.6 s by the machine), with the caller's
``sys.path``; it speaks the frames described in ``_ocr_render``.

Lifetime (one :class:`Renderers` per session):

* started lazily, at most one per CPU the process may use, each rendering one page at
  a time; a page holds a renderer only while it renders, not while its request is in
  flight;
* reused most-recently-used first, preferring one that already holds the document
  (a document crosses to a renderer once, not once per page); the call's end tells the
  renderers holding its document to close it;
* retired after ``IDLE_S`` without work (killed at the next checkout; the process also
  exits by itself a little later if polygate never comes back), and all killed when
  the session closes;
* **killed on cancellation**: a request cut short (the call's deadline, a failed
  sibling page, Ctrl-C) leaves its renderer in an unknown state, so it is killed
  (SIGKILL) and reaped before the cancellation goes on — bounded, nothing rendering
  is left behind;
* a renderer that dies (a PDF that crashes PDFium, the OOM killer) fails the page with
  ``ConfigError`` naming its exit status; the calling process is unharmed;
* renderers run at nice +19, the lowest priority: where CPUs are short (2 renderers,
  the event loop and the upstream on 2 cores) the event loop's thread gets one first.
  In ``benchmarks/ocr.py`` (5 alternating runs each, one session) the loop's worst
  stall was 3.1-4.8 ms at +19 against 4.5-5.1 ms at +10 (+10 had cut it by ~1.5 ms
  from 0), at the same wall time; on a busy machine, OCR is what waits.

With ``Ocr.render_in="thread"`` the same requests are answered in worker threads of
the calling process (one lock around every PDFium call): for frozen applications and
sandboxes where starting ``sys.executable`` is not possible.

Under a zero-threshold ``MockClock`` every wait on a renderer (process or thread)
holds virtual time still (``_threads.patient_clock(math.inf)``): rendering takes no
virtual time, deterministically.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from . import _child, _ocr_render
from ._errors import ConfigError, PolygateError
from ._threads import NoThread, no_thread, patient_clock, run_sync

__all__ = ["IDLE_S", "RendererStatistics", "Renderers", "new_key"]

#: A renderer idle this long is retired; the process exits by itself later
#: (:func:`_exit_after`: polygate never sends to one idle past ``IDLE_S``, so the two
#: cannot cross).
IDLE_S = 60.0
_RENDER_FILE = os.path.abspath(_ocr_render.__file__)
#: The renderer module is loaded by its file, without the package (whose import costs
#: ~0.2 s a process); where it is no file (polygate imported from a zip: a zipapp, a
#: zipped vendored tree), by its name through the parent's sys.path, package and all.
_BOOT = (
    "import importlib.util as u,json,signal,sys;"
    "signal.signal(signal.SIGINT,signal.SIG_IGN);"  # Ctrl-C is the parent's to handle
    "import os;hasattr(os,'nice') and os.nice(19);"  # the event loop first (docstring)
    "sys.path[:]=json.loads(sys.argv[3]);"
    "s=sys.argv[1]!='-' and u.spec_from_file_location('_polygate_ocr_render',sys.argv[1]);"
    "m=u.module_from_spec(s) if s else __import__('polygate._ocr_render',fromlist=['serve']);"
    "s and (sys.modules.__setitem__(s.name,m),s.loader.exec_module(m));"
    "m.serve(float(sys.argv[2]))"
)
#: A render that needs a thread (or a process, which trio starts from one) at the
#: process's thread limit.
_NO_THREAD = ("cannot render the document's pages: this process ran out of threads "
              "(can't start new thread)")
_PIPE_BYTES = 1 << 20  # a page's messages cross in one or two reads, not dozens
_keys = itertools.count(1)


def _render_arg() -> str:
    """The renderer module's file for _BOOT, or "-" where it is no file (a zip)."""
    return _RENDER_FILE if os.path.isfile(_RENDER_FILE) else "-"  # (one stat: no I/O wait)


def _exit_after() -> float:
    """How long an idle renderer process waits before it exits by itself: well past
    ``IDLE_S``, so that it never exits while polygate could still send to it."""
    return max(2 * IDLE_S, IDLE_S + 30.0)


def new_key() -> int:
    """A key for a document opened for one call (renderers hold documents by key)."""
    return next(_keys)


def _cores() -> int:
    count = getattr(os, "process_cpu_count", None)  # 3.13: the CPUs this process may use
    if count is not None:
        return int(count() or 1)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@attrs.frozen
class RendererStatistics:
    """``started``: renderers started so far; ``stopped``: those stopped since (a
    request cut short, a renderer that died, retired idle, the session closed);
    ``alive``: renderer processes not yet reaped; ``idle``: renderers waiting for
    work; ``holding``: idle renderers that still hold a document; ``documents_sent``:
    how many times a document's bytes went to a renderer (once per renderer that
    worked on it, not once per page)."""

    started: int
    stopped: int
    alive: int
    idle: int
    holding: int
    documents_sent: int


class _Worker:
    """One renderer.  ``intact`` is False while a request is under way: a request
    cut short leaves the pipe mid-frame, and the renderer must go."""

    def __init__(self) -> None:
        self.key: int | None = None  # the document it holds
        self.idle_since = 0.0
        self.intact = True

    async def request(self, header: tuple[Any, ...], blob: bytes) -> tuple[tuple[Any, ...], bytes]:
        self.intact = False
        reply = await self._exchange(header, blob)
        self.intact = True
        return reply

    async def _exchange(self, header: tuple[Any, ...], blob: bytes) -> tuple[tuple[Any, ...], bytes]:
        raise NotImplementedError

    async def discard(self) -> None:
        """Release what it holds (a process: killed and reaped); bounded."""
        raise NotImplementedError

    async def drop(self, key: int) -> None:
        """Close ``key``'s document if it holds it (an idle renderer); bounded."""
        await self.request(("drop", key), b"")

    def alive(self) -> bool:
        """A renderer process that has not exited (a thread renderer: False)."""
        return False

    def dead(self) -> bool:
        """A renderer process that exited by itself (killed from outside, say)."""
        return False


class _ThreadWorker(_Worker):
    """A renderer in a worker thread of this process.  A request cut short abandons
    its thread (a deadline is not held up behind PDFium's lock): the thread closes
    the renderer itself when it finishes — whichever of the two comes second closes."""

    def __init__(self) -> None:
        super().__init__()
        self._renderer = _ocr_render.Renderer()
        self._lock = threading.Lock()
        self._busy = False
        self._abandoned = False

    def _handle(self, header: tuple[Any, ...], blob: bytes) -> tuple[tuple[Any, ...], bytes]:
        # Busy from here, in the thread, not from the request: a request cut short
        # before its thread started (trio checks for cancellation first) has no thread
        # to close the renderer, so discard() must find it idle and close it itself.
        with self._lock:
            if self._abandoned:  # discarded before this thread began: discard() closes
                return ("fail", "abandoned"), b""  # (nobody reads it)
            self._busy = True
        try:
            return _ocr_render.answer(self._renderer, header, blob)
        finally:
            with self._lock:
                self._busy = False
                abandoned = self._abandoned
            if abandoned:
                self._renderer.close()

    async def _exchange(self, header: tuple[Any, ...], blob: bytes) -> tuple[tuple[Any, ...], bytes]:
        # (run_sync holds virtual time still, as for a renderer process)
        try:
            return await run_sync(self._handle, header, blob, abandon_on_cancel=True)
        except NoThread:
            # Not rendered on the loop instead: a render takes PDFium's process-wide
            # lock, which a cut render's abandoned thread may hold for as long as a
            # hostile page takes, and the loop must never wait for it.
            raise ConfigError(_NO_THREAD) from None

    async def discard(self) -> None:
        with self._lock:
            self._abandoned = True
            busy = self._busy
        if not busy:  # else its thread closes it when done
            # Never waiting for the PDFium lock: another call's cut render may hold it
            # for seconds, and neither this call's end nor the session's close waits
            # for that (the lock's next leaver closes it).
            _ocr_render.close_soon(self._renderer, self._renderer.key)
        await trio.lowlevel.checkpoint()

    async def drop(self, key: int) -> None:
        if self._renderer.key == key:  # idle: no thread of its own runs
            _ocr_render.close_soon(self._renderer, key)
        await trio.lowlevel.checkpoint()


class _ProcessWorker(_Worker):
    def __init__(self, process: _child.Child | trio.Process) -> None:
        super().__init__()
        self.process = process

    @classmethod
    async def start(cls) -> _ProcessWorker:
        executable = sys.executable
        if not executable:
            raise ConfigError(
                "OCR renders PDF pages in a worker process, and this interpreter has no "
                "sys.executable to start one: set Ocr.render_in='thread'"
            )
        command = [executable, "-I", "-c", _BOOT, _render_arg(), repr(_exit_after()), json.dumps(sys.path)]
        try:
            # Not trio's open_process: it takes a token of trio's default thread
            # limiter, which the application's threads share (polygate/_child.py).
            # Cancellable while it waits for a thread; once started, a cancellation
            # reaches it at its first request (and kills it).
            with patient_clock(math.inf):
                process = await _child.start(command)
        except OSError as exc:
            raise ConfigError(
                f"cannot start an OCR renderer process ({exc.strerror or exc}): "
                "set Ocr.render_in='thread' to render in threads"
            ) from None
        except RuntimeError as exc:  # (trio starts the process from a thread)
            if not no_thread(exc):
                raise
            raise ConfigError(_NO_THREAD) from None
        for stream in (process.stdin, process.stdout):
            _grow_pipe(stream)
        return cls(process)

    async def _exchange(self, header: tuple[Any, ...], blob: bytes) -> tuple[tuple[Any, ...], bytes]:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        packed = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        with patient_clock(math.inf):
            try:
                await stdin.send_all(_ocr_render.FRAME.pack(len(packed), len(blob)) + packed)
                if blob:
                    await stdin.send_all(blob)
            except trio.BrokenResourceError:
                pass  # it died: its end of file (below) says so
            head = await _receive_exactly(stdout, _ocr_render.FRAME.size)
            header_len, blob_len = _ocr_render.FRAME.unpack(head) if head else (0, 0)
            if not head or header_len > _ocr_render.MAX_HEADER:
                raise await self._died()
            packed = await _receive_exactly(stdout, header_len)
            out = await _receive_exactly(stdout, blob_len) if blob_len else b""
            # Cut short (it died writing them: a page larger than the pipe is written
            # in pieces): its death, not half a page taken for a whole one.
            if len(packed) != header_len or len(out) != blob_len:
                raise await self._died()
        try:
            reply = pickle.loads(packed)
        except Exception:  # (whole, but not what a renderer writes)
            raise await self._died() from None
        return reply, out

    async def _died(self) -> ConfigError:
        """The error for a renderer whose output ended mid-conversation."""
        await self.discard()  # and the pool discards it again: no harm
        status = self.process.returncode
        how = f"killed by signal {-status}" if status is not None and status < 0 else f"exit status {status}"
        return ConfigError(f"the OCR renderer process died ({how}) while working on the document")

    async def discard(self) -> None:
        with trio.CancelScope(shield=True), patient_clock(math.inf):  # bounded: SIGKILL, reap
            try:
                if self.process.returncode is None:
                    self.process.kill()
                await self.process.wait()
            except RuntimeError as exc:
                # No thread to wait in (no pidfd, the process's thread limit): not a
                # failure of the call or the close that discards it (raised from a
                # session's close, it replaced the block's own error).  Reaped here if
                # it is gone within 0.1 s, as a SIGKILLed child is within milliseconds:
                # polled on the loop (no trio timer: a MockClock is held still here);
                # else Python's subprocess module reaps it once it is collected.
                if not no_thread(exc):
                    raise
                for _ in range(50):
                    if self.process.returncode is not None:
                        break
                    time.sleep(0.002)  # noqa: ASYNC251 - bounded, on purpose: see above
            finally:
                for stream in (self.process.stdin, self.process.stdout):
                    if stream is not None:
                        await stream.aclose()

    def alive(self) -> bool:
        return self.process.returncode is None

    def dead(self) -> bool:
        return self.process.returncode is not None


async def _receive_exactly(stream: Any, size: int) -> bytes:
    """``size`` bytes (fewer only at end of file)."""
    parts: list[bytes] = []
    while size:
        part = await stream.receive_some(size)
        if not part:
            break
        parts.append(part)
        size -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _grow_pipe(stream: Any) -> None:
    """Linux: a 1 MiB pipe, so a page's ~0.7 MB of messages is not 11 reads."""
    if sys.platform != "linux" or stream is None:
        return
    import fcntl

    try:
        fcntl.fcntl(stream.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (AttributeError, OSError):
        pass  # over /proc/sys/fs/pipe-max-size, or older Pythons: the default works too


class _Pool:
    def __init__(self, limit: int, start: Any) -> None:
        self.limiter = trio.CapacityLimiter(limit)
        self._start = start
        self.idle: list[_Worker] = []  # most recently used last
        self.everyone: set[_Worker] = set()
        self.started = 0
        self.stopped = 0
        self.documents_sent = 0
        self.closed = False

    @asynccontextmanager
    async def checkout(self, key: int | None) -> AsyncIterator[_Worker]:
        """A renderer for a page of ``key``'s document, held for the block; one cut
        short inside it is discarded (killed), never reused."""
        async with self.limiter:
            if self.closed:
                # A call from a task outside the session block outlived the session.
                raise PolygateError("this session is closed")
            await self._retire_idle()
            worker = self._take(key)
            if worker is None:
                worker = await self._start()
                self.started += 1
                self.everyone.add(worker)
            try:
                yield worker
            finally:
                if worker.intact and not self.closed:
                    worker.idle_since = time.monotonic()
                    self.idle.append(worker)
                else:
                    await self._discard(worker)

    def _take(self, key: int | None) -> _Worker | None:
        for at in range(len(self.idle) - 1, -1, -1):
            if key is not None and self.idle[at].key == key:
                return self.idle.pop(at)
        return self.idle.pop() if self.idle else None

    async def _retire_idle(self) -> None:
        # Real time, not trio's clock: this is the life of a process, not of a call.
        now = time.monotonic()
        stale = [w for w in self.idle if now - w.idle_since >= IDLE_S or w.dead()]
        for worker in stale:
            self.idle.remove(worker)
            await self._discard(worker)

    async def _discard(self, worker: _Worker) -> None:
        if worker in self.everyone:
            self.everyone.discard(worker)
            self.stopped += 1
        await worker.discard()

    async def drop(self, key: int) -> None:
        """Idle renderers holding ``key``'s document close it.  Bounded: an idle
        renderer answers at once.  Best effort: with every renderer busy (no token
        free: the bound on renderers holds here too), one that is not told closes
        the document when it is given the next one, or is retired."""
        for worker in [w for w in self.idle if w.key == key]:
            if worker not in self.idle:
                continue  # taken meanwhile: its next document replaces this one
            try:
                self.limiter.acquire_nowait()
            except trio.WouldBlock:
                return
            try:
                self.idle.remove(worker)
                try:
                    with trio.CancelScope(shield=True):
                        await worker.drop(key)
                        worker.key = None
                except PolygateError:
                    pass  # it died: discarded below, and what it held went with it
                finally:
                    if worker.intact and not self.closed:
                        self.idle.append(worker)
                    else:
                        await self._discard(worker)
            finally:
                self.limiter.release()

    async def aclose(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        await _each([functools.partial(self._discard, worker) for worker in idle])


async def _each(closes: list[Callable[[], Awaitable[None]]]) -> None:
    """Await every one of ``closes``, whatever an earlier one raised (every renderer
    killed, every pool closed), then raise the first failure."""
    failed: Exception | None = None
    for close in closes:
        try:
            await close()
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


class Renderers:
    """The renderers of one session: processes (``render_in="process"``, at most one
    per CPU) and in-process threads (``"thread"``, bounded only by each call's
    ``max_concurrent_pages``).  :meth:`aclose` when the session ends."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}

    def _pool(self, render_in: str) -> _Pool:
        pool = self._pools.get(render_in)
        if pool is None:
            if render_in == "process":
                pool = _Pool(_cores(), _ProcessWorker.start)
            else:
                pool = _Pool(64, _start_thread_worker)
            self._pools[render_in] = pool
        return pool

    async def request(
        self, render_in: str, key: int | None, header: tuple[Any, ...], data: bytes
    ) -> tuple[tuple[Any, ...], bytes]:
        """Send ``header`` about ``key``'s document (whose bytes are ``data``) to a
        renderer; ``data`` goes along only to a renderer that does not hold it yet.
        ``key=None``: a request that leaves nothing held (an image), ``data`` always
        goes.  A ``("bad", message)`` reply raises ``ConfigError(message)``."""
        pool = self._pool(render_in)
        async with pool.checkout(key) as worker:
            blob = data if key is None or worker.key != key or header[0] == "open" else b""
            pool.documents_sent += bool(blob) and key is not None
            reply, out = await worker.request(header, blob)
            if key is None:
                pass
            elif reply[0] == "ok":
                worker.key = key
            elif header[0] == "open" or blob:
                worker.key = None  # a failed open leaves the renderer holding nothing
        if reply[0] == "bad":
            raise ConfigError(reply[1])
        if reply[0] != "ok":
            raise PolygateError(f"the OCR renderer failed: {reply[1]}")
        return reply, out

    async def drop(self, render_in: str, key: int) -> None:
        pool = self._pools.get(render_in)
        if pool is not None:
            await pool.drop(key)

    async def aclose(self) -> None:
        await _each([pool.aclose for pool in self._pools.values()])

    def statistics(self, render_in: str = "process") -> RendererStatistics:
        pool = self._pools.get(render_in)
        if pool is None:
            return RendererStatistics(0, 0, 0, 0, 0, 0)
        return RendererStatistics(
            started=pool.started,
            stopped=pool.stopped,
            alive=sum(w.alive() for w in pool.everyone),
            idle=len(pool.idle),
            holding=sum(w.key is not None for w in pool.idle),
            documents_sent=pool.documents_sent,
        )


async def _start_thread_worker() -> _Worker:
    return _ThreadWorker()
