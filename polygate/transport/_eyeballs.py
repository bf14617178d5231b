"""A TCP connect to a name's addresses already looked up: trio's happy eyeballs.

``trio.open_tcp_stream(name, port)`` looks the name up itself, in a worker thread
under trio's process-wide thread limiter.  The application's own threads share that
limiter: a FastAPI ``def`` endpoint on anyio's trio backend, or any thread that
calls polygate through ``trio.from_thread.run``, holds a token while it waits for
its call, and 40 of them waiting took every token -- the lookup their calls needed
never started, and they waited for ever.  The pool looks names up under a limiter of
its own (``LeanTransport._lookup``) and connects here, to the addresses it found.

The race is trio's own (``trio/_highlevel_open_tcp_stream.py``), kept as it is: one
attempt per address, in the order the resolver gave with the first address of the
other family moved second (RFC 6555, section 5.4); the next attempt starts when the
one before it fails or ``DELAY_S`` after it started; the first to connect wins and
the others are cancelled, their sockets closed.  When every attempt fails, the error
is trio's too: ``OSError("all attempts to connect to HOST:PORT failed")`` raised from
a group of each attempt's error.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from typing import Any

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

__all__ = ["DELAY_S", "connect"]

#: trio's ``open_tcp_stream`` default (RFC 8305 recommends 250 ms).
DELAY_S = 0.25

#: What ``socket.getaddrinfo`` gives: (family, type, proto, canonname, sockaddr).
Target = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]


def ordered(targets: Sequence[Target]) -> list[Target]:
    """``targets`` with the first of the other address family second (RFC 6555 5.4):
    a name whose IPv6 addresses all black-hole still connects over IPv4 in
    ``DELAY_S``."""
    ordered = list(targets)
    for i in range(1, len(ordered)):
        if ordered[i][0] != ordered[0][0]:
            if i != 1:
                ordered.insert(1, ordered.pop(i))
            break
    return ordered


async def connect(host: str, port: int, targets: Sequence[Target]) -> trio.SocketStream:
    """A stream connected to one of ``targets`` (``host``'s addresses), raced as the
    module says; ``host`` names it in the error when all fail."""
    errors: list[OSError] = []
    winner: trio.socket.SocketType | None = None

    async def attempt(target: Target, failed: trio.Event, done: trio.CancelScope) -> None:
        nonlocal winner
        family, kind, proto, _, sockaddr = target
        # The port asked for, whatever the lookup was asked with: a name's addresses
        # serve every port (two sources on one host, another port each).
        sockaddr = (sockaddr[0], port, *sockaddr[2:])
        try:
            # (Made inside: a socket that cannot be made -- out of descriptors, a kernel
            # without IPv6 -- is this address's failure, as in trio's race.)
            sock = trio.socket.socket(family, kind, proto)
        except OSError as exc:
            errors.append(exc)
            failed.set()
            return
        try:
            await sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            failed.set()
            return
        except BaseException:
            sock.close()
            raise
        if winner is not None:
            # Another attempt connected in the same scheduler pass, and its cancel came
            # after this connect had returned: the first keeps the win.
            sock.close()
            return
        winner = sock
        done.cancel()

    try:
        async with trio.open_nursery() as nursery:
            for target in ordered(targets):
                failed = trio.Event()
                nursery.start_soon(attempt, target, failed, nursery.cancel_scope)
                with trio.move_on_after(DELAY_S):
                    await failed.wait()
    except BaseException:
        if winner is not None:  # (cancelled from outside in the instant it won)
            winner.close()
        raise
    if winner is None:
        name = f"[{host}]" if ":" in host else host
        message = f"all attempts to connect to {name}:{port} failed"
        raise OSError(message) from ExceptionGroup(message, errors)
    return trio.SocketStream(winner)
