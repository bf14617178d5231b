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
bytes for the next request, up to the cap. The set is level-triggered, so no socket
may sit in it readable and unread, or the task would spin. A socket whose client has
gone is removed at once. One past the pipelining cap stays, watched for a hang-up only
(``EPOLLRDHUP`` without ``EPOLLIN``): its unread bytes wake nothing, and its client's
leaving still cancels the request, which the watcher task, asleep past the cap, never
saw.

Only where ``select.epoll`` exists (Linux); elsewhere, and for streams that are not
sockets, the server keeps a watcher task per request.
"""

from __future__ import annotations

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
        #: Sockets past the pipelining cap: no longer read, watched for a hang-up only.
        self._capped: set[int] = set()

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
            self._capped.discard(fd)
            # (Already gone from the set if the socket was closed, or the set was.)
            try:  # (not contextlib.suppress: three calls on every request)
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass

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
        if fd in self._capped:  # a hang-up (or an error): the bytes are left unread
            conn.left(on_close)
            self.unwatch(fd, conn)
            return
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
            conn.left(on_close)
            more = False
        if more:
            return
        if not conn.client_gone:
            # Past the cap: reading stops, but a client that then leaves must still
            # cancel its request.  Without EPOLLIN the unread bytes wake nothing;
            # EPOLLRDHUP (and a reset's EPOLLHUP or EPOLLERR) still does.
            try:
                self._epoll.modify(fd, select.EPOLLRDHUP)
            except OSError:
                pass
            else:
                self._capped.add(fd)
                return
        self.unwatch(fd, conn)

    def close(self) -> None:
        """(Once no task waits on the set any more.)"""
        self._watched.clear()
        self._capped.clear()
        self._epoll.close()
