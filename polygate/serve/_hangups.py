"""Clients that leave while their request is answered: one task watches them all.

A request being answered must learn at once that its client has gone, so that the
logical call is cancelled (the upstream sees its connection closed within 100 ms).
A watcher task per request that reads the socket (:meth:`Connection.watch_close`) cost
~80 µs of the gateway's ~680 µs of CPU a request, measured in-process with and
without it. Most of that was the task and its nursery, a ``recv`` that finds nothing,
trio registering and unregistering the descriptor, and the watcher's cancellation
after the answer.

Here the sockets of the requests being answered sit in an epoll set of their own, and
one task waits on that set's descriptor through trio. Watching a request costs one
``epoll_ctl`` to add its socket and one to remove it. The task runs only when a
client sends something or leaves, and it does what the watcher did: at end of file,
or on a reset, it marks the client gone and cancels the request; it keeps pipelined
bytes for the next request, up to the cap. The set is level-triggered. A socket that
would stay readable (gone, or over the pipelining cap) is removed at once, so the set
never wakes the task for nothing.

Only where ``select.epoll`` exists (Linux); elsewhere, and for streams that are not
sockets, the server keeps a watcher task per request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
from collections.abc import Callable

import trio

from ._http import _RECEIVE, Connection

__all__ = ["Hangups"]

log = logging.getLogger("polygate.serve")


class Hangups:
    """The epoll set of the sockets whose requests are being answered."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._events = select.EPOLLIN | select.EPOLLRDHUP
        self._watched: dict[int, tuple[Connection, Callable[[], object]]] = {}

    @staticmethod
    def supported() -> bool:
        return hasattr(select, "epoll")

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, conn: Connection, fd: int, on_close: Callable[[], object]) -> bool:
        """Until :meth:`unwatch`: when ``conn``'s client leaves, call ``on_close``.
        False if the set cannot take the socket (the kernel refused it, or the set is
        closed): the caller watches it some other way."""
        try:
            self._epoll.register(fd, self._events)
        except (OSError, ValueError):
            return False
        self._watched[fd] = (conn, on_close)
        return True

    def unwatch(self, fd: int, conn: Connection) -> None:
        """Stop watching ``conn`` -- only ``conn``: were its socket closed first, its
        descriptor's number could already be another connection's."""
        entry = self._watched.get(fd)
        if entry is not None and entry[0] is conn:
            del self._watched[fd]
            # (Already gone from the set if the socket was closed, or the set was.)
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)

    async def run(self) -> None:
        """Wait for the set's events and handle them, until cancelled."""
        own = self._epoll.fileno()
        while True:
            await trio.lowlevel.wait_readable(own)
            for fd, _ in self._epoll.poll(0):
                self._check(fd)

    def _check(self, fd: int) -> None:
        entry = self._watched.get(fd)
        if entry is None:
            return
        conn, on_close = entry
        try:
            data = os.read(fd, _RECEIVE)  # (non-blocking: trio's sockets are)
        except BlockingIOError:
            return
        except OSError:  # a reset: the client has gone as surely as at end of file
            data = b""
        try:
            more = conn.took(data, on_close)
        except Exception:  # a bug here must not stop the watching of every client
            log.exception("watching a client failed: its request is cancelled")
            conn.client_gone = True
            on_close()
            more = False
        if not more:
            self.unwatch(fd, conn)

    def close(self) -> None:
        """(Once no task waits on the set any more.)"""
        self._watched.clear()
        self._epoll.close()
