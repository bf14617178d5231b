"""A child process whose start takes no token of trio's default thread limiter.

``trio.lowlevel.open_process`` runs ``subprocess.Popen`` (a fork and an exec) in a
thread of trio's default limiter, which the application's threads share: 40 of them
waiting on polygate's calls (a FastAPI ``def`` endpoint on anyio's trio backend, any
``trio.from_thread.run``) hold every token, and an OCR renderer's start waited for one
of them to finish, for ever (review: trio web applications; ``tests/test_thread_limits.py``).
``open_process`` takes no limiter, so :func:`start` does what it does on polygate's own
limiter (``polygate._threads.own_limiter``): the pipes made here, ``Popen`` in a
thread, the parent's ends as ``trio.lowlevel.FdStream``.

The start is cancellable while it waits for a thread and not once the thread runs
(``abandon_on_cancel=False``: the ``Popen`` always comes back, so no process is lost);
trio delivers the cancellation at the caller's next checkpoint, with the child in
hand.  :meth:`Child.wait` waits on a pidfd, as trio does.  Where the kernel gives
none (macOS and Windows, whose waits trio does its own way, Linux before 5.3 or under a
seccomp profile that refuses ``pidfd_open``), :func:`start` is trio's own start, as
before, and takes a token of trio's default limiter.  A pidfd that cannot be opened for
one child (out of descriptors) leaves its wait to a thread of a limiter that never
makes it wait (as trio's own fallback does): the wait after a SIGKILL is shielded, and
must not queue for a token.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import subprocess
from collections.abc import Sequence

import trio

from polygate._threads import run_sync

__all__ = ["Child", "start"]

#: Each thread waits for one child of ours to exit: bounded by the children, no token.
_WAITS = trio.CapacityLimiter(math.inf)


_pidfds: bool | None = None  # whether this kernel gives pidfds: asked once


def pidfds() -> bool:
    """Whether this process can open pidfds (Linux 5.3 and later, not refused)."""
    global _pidfds
    if _pidfds is None:
        try:
            os.close(os.pidfd_open(os.getpid()))
        except (AttributeError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                return False  # (out of descriptors now: asked again next time)
            _pidfds = False
        else:
            _pidfds = True
    return _pidfds


class Child:
    """A started process and the parent's ends of its stdin and stdout (the subset
    of ``trio.Process`` that polygate uses)."""

    def __init__(self, popen: subprocess.Popen[bytes], stdin: trio.lowlevel.FdStream,
                 stdout: trio.lowlevel.FdStream) -> None:
        self._popen = popen
        self.stdin = stdin
        self.stdout = stdout
        self._waiting = trio.Lock()  # (one wait at a time on a pidfd, as trio's)
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):  # (out of descriptors: a thread waits)
            self._pidfd = os.pidfd_open(popen.pid)

    def __repr__(self) -> str:
        return f"<polygate child process {self.pid}, exit status {self.returncode}>"

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (reaped then), else None; does not block."""
        return self._popen.poll()

    def send_signal(self, sig: int) -> None:
        if self._popen.returncode is None:  # (a reaped pid may be another process's)
            self._popen.send_signal(sig)

    def kill(self) -> None:
        if self._popen.returncode is None:
            self._popen.kill()

    async def wait(self) -> int:
        """Until it exits (then reaped); its exit status."""
        async with self._waiting:
            if self._popen.returncode is None:
                if self._pidfd is not None:
                    await trio.lowlevel.wait_readable(self._pidfd)
                else:
                    await run_sync(self._popen.wait, abandon_on_cancel=True, limiter=_WAITS)
            code = self._popen.wait()  # (it has exited: at once)
            fd, self._pidfd = self._pidfd, None
            if fd is not None:
                trio.lowlevel.notify_closing(fd)
                os.close(fd)
        return code


async def start(command: Sequence[str]) -> Child | trio.Process:
    """Start ``command`` with its stdin and stdout piped to the returned child (its
    stderr is this process's); ``OSError`` where it cannot start."""
    if not pidfds():  # (see above: trio's own start and wait)
        return await trio.lowlevel.open_process(
            list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    child_in, parent_in = os.pipe()  # (not inherited: Popen dups the child's ends)
    try:
        parent_out, child_out = os.pipe()
    except BaseException:
        os.close(child_in)
        os.close(parent_in)
        raise

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(command), stdin=child_in, stdout=child_out)

    try:
        started = await run_sync(popen)  # (on polygate's own limiter)
    except BaseException:
        os.close(parent_in)
        os.close(parent_out)
        raise
    finally:
        # The child has its own copies now: when it exits, ours read end of file.
        os.close(child_in)
        os.close(child_out)
    streams: list[trio.lowlevel.FdStream] = []
    try:
        for fd in (parent_in, parent_out):
            streams.append(trio.lowlevel.FdStream(fd))
        return Child(started, *streams)
    except BaseException:  # (a KeyboardInterrupt just then, say): nothing left behind
        started.kill()
        started.wait()  # (bounded: SIGKILL)
        for stream in streams:
            stream.close()
        for fd in (parent_in, parent_out)[len(streams):]:
            os.close(fd)
        raise
