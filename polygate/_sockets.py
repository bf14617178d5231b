"""A write that the kernel takes at once, without a pass of trio's scheduler; a read
that waits before it tries.

trio's ``SocketStream.send_all`` ends every send with a scheduler pass (a
``cancel_shielded_checkpoint`` after the write, so that the call always looks as if
it blocked).  On the gateway's path that is two passes per request -- the upstream
request and the client's answer -- each a run-loop iteration with its own
``epoll_wait``: measured at ~40 µs of CPU per request together, in-process
(``benchmarks/serve.py``'s request, alternating blocks).  Both writes are followed
by a real wait (for the answer, for the next request), where the scheduler runs
anyway, so nothing is starved by skipping them.

:func:`write_now` writes what the socket's buffer takes right now; the caller sends
whatever is left (if anything) with ``send_all`` as before, and on any error it
writes nothing, so ``send_all`` meets the same error and raises it as trio does.
:func:`write_first` checks cancellation first (``checkpoint_if_cancelled``, which
does not yield unless cancelled): a cancelled request must never be written.

:func:`receive_when_readable` is for a read whose bytes cannot be here yet: the
answer to a request just written, the next request on a kept-alive connection just
answered.  trio's ``receive_some`` tries the read first (to return at once when the
bytes are there), and there that try always fails: a ``recv`` that returns EAGAIN,
raised as ``BlockingIOError`` and caught, inside two context managers, before the
wait it was always going to come to.  Waiting first goes straight to the wait and
reads once.  When the bytes were there after all, the wait returns at trio's next
I/O poll: a scheduler pass later, never wrong.

:func:`send_all_progressing` is ``send_all`` for a peer that may stop reading: it gives
up once the peer has taken nothing for a while, however long the whole takes while it
keeps taking.  Progress is what the peer's kernel acknowledged (Linux's ``SIOCOUTQ``,
the bytes sent and not yet acknowledged), not only the writes the socket took: the
socket turns writable again only once a good share of its buffer is free (~128 KiB on
loopback), which a slow reader may take longer than the timeout to make room for.

(:func:`out_of` says whether a failure was this process running out of descriptors,
socket buffers or memory: no fault of the peer's.)

Only for a stream that one task writes at a time (trio's conflict detector is
bypassed for the synchronous write, which cannot interleave with anything, but a
``send_all`` of another task parked on a full buffer could be overtaken).
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
import struct
import sys
from collections.abc import Iterator
from typing import cast

import trio

from ._threads import no_thread

__all__ = [
    "os_reasons", "out_of", "out_of_now", "read_now", "reads_now", "receive_when_readable",
    "send_all_progressing", "write_first", "write_now",
]

#: What this process (or the machine) ran out of, by the errno that says so.
_EXHAUSTED: dict[int, str] = {
    errno.EMFILE: "file descriptors",
    errno.ENFILE: "file descriptors (the system's)",
    errno.ENOBUFS: "socket buffers",
    errno.ENOMEM: "memory",
}


def out_of_now() -> OSError | None:
    """The error a new descriptor meets now, when this process (or the machine) is out
    of them; ``None`` when one opens.  For failures that hide it: glibc's resolver,
    unable to open ``/etc/hosts`` or a DNS socket, says "Name or service not known";
    an SSL context that could not read its CA file is built empty, without a word."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError as exc:
        return exc if exc.errno in _EXHAUSTED else None
    os.close(fd)
    return None


def out_of(exc: BaseException) -> tuple[str, str] | None:
    """What ``exc`` says this process ran out of, and the errno's name -- looked for in
    it, its causes, and the groups among them (trio's ``open_tcp_stream`` raises
    ``OSError("all attempts to connect ... failed")`` from a group of each attempt's
    error; httpx and the pool map that ``from`` it in turn) -- or ``None``.  Not in
    contexts: an error raised while another was handled may have nothing to do with
    it, and a real upstream failure must never pass for this process's."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in _EXHAUSTED:
            return _EXHAUSTED[e.errno], errno.errorcode[e.errno]
        if isinstance(e, MemoryError):  # (the interpreter's: a body too large to hold)
            return "memory", "MemoryError"
        if no_thread(e):  # (a name's lookup, in one of trio's threads)
            return "threads", "can't start new thread"
    return None


def os_reasons(exc: BaseException) -> list[str]:
    """The operating system's words for why ``exc`` happened, each once, found where
    :func:`out_of` looks (a connect's "all attempts to connect to h:p failed" says
    nothing of them: refused, no route, unreachable, an address this machine cannot
    use).  OS text only, never a message of a library's (which may quote more)."""
    reasons: list[str] = []
    for e in _causes(exc):
        # Not a resolver's or TLS's error: OSErrors whose numbers are their own (-2 is
        # "Name or service not known"; an SSL error's 1 would read "Operation not
        # permitted"), and which say what they mean in their own text already.
        if isinstance(e, OSError) and not isinstance(e, (socket.gaierror, ssl.SSLError)) \
                and isinstance(e.errno, int) and e.errno > 0 and e.errno in errno.errorcode:
            reason = os.strerror(e.errno)  # (not its strerror: trio's names the address)
            if reason not in reasons:
                reasons.append(reason)
    return reasons[:3]


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and the groups among them, depth first, each once (64 at most)."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo and len(seen) < 64:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += (e.__cause__, *getattr(e, "exceptions", ()))

_POSIX = os.name == "posix"
#: How often a blocked send looks at what the peer acknowledged, at most.
_PROGRESS_CHECK_S = 1.0

if sys.platform.startswith("linux"):
    import fcntl
    import termios

    def _unacknowledged(fd: int) -> int | None:
        """Bytes of the socket's stream not yet acknowledged by the peer (SIOCOUTQ,
        which is TIOCOUTQ on Linux); None for a closed socket (-1)."""
        try:
            return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0])
        except OSError:
            return None
else:  # pragma: no cover - polygate's CI runs on Linux

    def _unacknowledged(fd: int) -> int | None:
        return None


async def write_first(stream: trio.abc.SendStream, data: bytes) -> memoryview:
    """What is left of ``data`` for ``send_all`` after :func:`write_now` (empty when
    the kernel took it all).  A cancelled caller writes nothing: cancellation is
    checked first, without a yield unless cancelled."""
    await trio.lowlevel.checkpoint_if_cancelled()
    return memoryview(data)[write_now(stream, data):]


def write_now(stream: trio.abc.SendStream, data: bytes | memoryview) -> int:
    """Write as much of ``data`` as ``stream``'s socket takes without blocking; the
    number of bytes written.  0 for a stream that is not a plain socket stream (TLS,
    a test's memory stream), a full buffer, or any error (left for ``send_all``)."""
    if type(stream) is not trio.SocketStream or not data:
        return 0
    try:
        # A socket's write(2) is its send(2) without flags; trio set it non-blocking.
        return os.write(stream.socket.fileno(), data)
    except OSError:  # EAGAIN, EPIPE, ECONNRESET, EBADF (closed): send_all's to raise
        return 0


async def send_all_progressing(stream: trio.SocketStream, data: bytes | memoryview, timeout_s: float) -> bool:
    """Send all of ``data`` on a plain socket stream; ``False`` (the rest unsent) once
    the peer has taken nothing for ``timeout_s``: neither a write the socket took nor a
    byte it acknowledged.  trio's errors as ``send_all`` raises them; cancellable
    between writes only (nothing is half-written by a cancellation)."""
    sock = stream.socket
    view = memoryview(data)
    await trio.lowlevel.checkpoint_if_cancelled()
    deadline = trio.current_time() + timeout_s
    unacknowledged = _unacknowledged(sock.fileno())
    while view:
        try:
            written = os.write(sock.fileno(), view)
        except BlockingIOError:
            written = 0
        except OSError as exc:  # as trio's _translate_socket_errors_to_stream_errors
            if exc.errno == errno.EBADF:
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        if written:
            view = view[written:]
            deadline = trio.current_time() + timeout_s
            unacknowledged = _unacknowledged(sock.fileno())
            continue
        with trio.move_on_at(min(deadline, trio.current_time() + _PROGRESS_CHECK_S)):
            await trio.lowlevel.wait_writable(sock)
        now = trio.current_time()
        left = _unacknowledged(sock.fileno())
        if left is not None and unacknowledged is not None and left < unacknowledged:
            deadline = now + timeout_s  # the peer took some: it is reading
        unacknowledged = left
        if now >= deadline:
            return False
    return True


def reads_now(stream: trio.abc.ReceiveStream) -> bool:
    """Whether :func:`read_now` can read ``stream`` (a plain socket stream, on POSIX)."""
    return type(stream) is trio.SocketStream and _POSIX


def read_now(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | None:
    """What a plain socket stream has to read right now, without waiting (up to
    ``max_bytes``; ``b""``: the peer closed); ``None`` when nothing is there, on any
    error, and for a stream whose bytes cannot be read so (TLS, whose records only its
    own layer can open; any stream on Windows)."""
    if type(stream) is not trio.SocketStream or not _POSIX:
        return None
    try:
        return os.read(stream.socket.fileno(), max_bytes)  # (non-blocking: trio's sockets are)
    except OSError:  # EAGAIN (nothing yet), a reset, EBADF (closed)
        return None


async def receive_when_readable(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes:
    """``stream.receive_some(max_bytes)``, for a read that will wait: it waits for the
    socket to be readable, then reads.  The same results and errors as trio's: the
    bytes, ``b""`` at the end, ``trio.BrokenResourceError`` for a broken connection,
    ``trio.ClosedResourceError`` for a closed socket; a checkpoint (cancellable)
    whatever happens.  Any stream that is not a plain socket stream goes to its own
    ``receive_some``, and so does every stream on Windows, whose sockets are not
    file descriptors.

    One reader at a time, as everywhere polygate reads a socket: a second task
    waiting on the same socket raises ``trio.BusyResourceError`` (trio's
    ``receive_some`` would too, unless the bytes were already there)."""
    if max_bytes < 1:
        raise ValueError("max_bytes must be >= 1")  # (as receive_some: 0 is not the end)
    if type(stream) is not trio.SocketStream or not _POSIX or stream.socket.fileno() < 0:
        # (a closed socket: trio's error).  SSLStream's bytearray reads as bytes here,
        # as everywhere polygate reads a stream (typeshed says bytes-like).
        return cast("bytes", await stream.receive_some(max_bytes))
    sock = stream.socket
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            # A socket's read(2) is its recv(2) without flags (the socket is
            # non-blocking); a closed trio socket's descriptor is -1: EBADF.
            return os.read(sock.fileno(), max_bytes)
        except BlockingIOError:
            continue  # readable, then not (another reader, a spurious wake-up)
        except OSError as exc:
            # As trio's _translate_socket_errors_to_stream_errors: its messages.
            if exc.errno == errno.EBADF:
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
