"""A write that the kernel takes at once, without a pass of trio's scheduler.

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

Only for a stream that one task writes at a time (trio's conflict detector is
bypassed for the synchronous write, which cannot interleave with anything, but a
``send_all`` of another task parked on a full buffer could be overtaken).
"""

from __future__ import annotations

import os

import trio

__all__ = ["write_first", "write_now"]


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
