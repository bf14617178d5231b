"""The server: listeners, connections, and the lifecycle (drain on SIGTERM, reload).

::

    open_server ─ sessions nursery: one task per configuration generation, each holding
      │           an open polygate.session until it is retired and no request uses it
      └ connections nursery: an accept loop per listener, a task per connection
          ├ connection: read request → answer (its client watched) → next request
          └ hang-ups: one task watching the clients of every request being answered

A request holds the generation it started with (``Gateway.enter``/``leave``), so a
reload swaps the generation for new requests while calls in flight finish on the
old session, which then closes (its telemetry flushed).  :meth:`Server.shutdown`
stops accepting, closes idle keep-alive connections, lets requests in flight finish
for ``grace_s``, then cancels the rest -- each cancelled call is settled and recorded
as ``cancelled`` by the session, like any cancelled call.

When the governance backend does not answer at start, the first generation is a
stand-in (:mod:`._unavailable`: every call 503) and a task in the sessions nursery,
``_recover``, keeps opening the real one until it can.
"""

from __future__ import annotations

import errno
import importlib.util
import ipaddress
import logging
import os
import select
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from .._config import FieldError, Settings
from .._context import fresh_call_id
from .._errors import ConfigError, GovernanceBackendError, PolygateError
from .._session import Session, SharedBackends, session_on
from .._sockets import out_of, write_now
from ._app import NO_CALL, Context, Gateway, answer, answer_cut, endpoint_label
from ._errors import error_body
from ._fds import connection_room
from ._hangups import Hangups
from ._http import ClientGone, Connection, Cut, Cuts, HTTPProblem, server_lines
from ._metrics import Metrics
from ._unavailable import UnavailableSession

__all__ = ["Server", "ServerStatistics", "check_exposure", "open_server"]

log = logging.getLogger("polygate.serve")

_ACCEPT_PAUSE_S = 0.1  # out of file descriptors: the floor on the accept loop's period
_REFUSING = 64  # connections being answered 503 at once, beyond max_connections
#: Connections taken off a listener's queue in one step of its accept task.  trio's
#: ``accept`` takes one and then yields to the scheduler, so under load (a pass of the
#: scheduler as long as the work in flight) the kernel's queue grew while the gateway
#: took one a pass: a burst of 512 connects waited seconds there, health probes with
#: them, and the 503 that sheds load was never reached (asyncio takes up to 100 an
#: event, nginx's ``multi_accept`` all of them).
_ACCEPT_BATCH = 64
#: A refused connection's request line is waited for this long: it decides between
#: the liveness probe's 200 and the 503.
_HEAD_WAIT_S = 0.5
_REFUSE_S = 1.0  # a refusal's whole time: its request line, its answer, its linger
_LINE_WAITED = 8192  # (bytes: a request line longer than this is no probe)
_LIVENESS = (b"GET /healthz ", b"GET /healthz?", b"HEAD /healthz ", b"HEAD /healthz?")
_OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # the only paths without a key
_LAST_WORDS_S = 1.0  # after the grace period: time to tell cancelled clients why
#: A drain closes idle connections, but not one accepted less than this long ago that
#: has sent nothing yet: its client connected, and is about to write its request (Go's
#: http.Server gives a new connection 5 s).  Closed at once, the request it then sent
#: was lost: a reset or an EOF, nothing counted.
_FIRST_REQUEST_S = 1.0
#: Retries of a session whose governance backend did not answer at start: the first
#: after this long, then doubling up to the cap (a backend that restarts is back within
#: seconds; one that stays down is not hammered).
_RECOVER_FIRST_S = 0.5
_RECOVER_MAX_S = 10.0


class _Fresh:
    """A connection accepted that has not begun a request yet: when, and the scope of
    its wait for the first byte (once its task waits)."""

    __slots__ = ("opened", "scope")

    def __init__(self, opened: float) -> None:
        self.opened = opened
        self.scope: trio.CancelScope | None = None


@attrs.frozen
class ServerStatistics:
    """Where the server stands: ``in_flight`` requests being read or answered (one
    answered with its body unread, until its connection has closed), ``connections``
    open, ``draining`` after :meth:`Server.shutdown` began, ``generations`` sessions
    open (more than one while a reload lets old calls finish)."""

    in_flight: int
    connections: int
    draining: bool
    generations: int


def is_loopback(host: str) -> bool:
    # (A name in any case, as resolvers read it.  Not an IPv4 loopback written as
    # IPv6, "::ffff:127.0.0.1": trio listens on IPv6 addresses IPv6-only, where no
    # mapped address can be bound.)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings, host: str) -> None:
    """Refuse to serve without gateway keys anywhere but on a loopback address."""
    if not settings.serve.authenticated and not is_loopback(host):
        raise ConfigError(
            f"serve.api_keys: refusing to listen on {host!r} without gateway keys; set "
            "[serve] api_keys or [serve.keys.NAME] (or POLYGATE__SERVE__API_KEYS), or listen on "
            "127.0.0.1"
        )


def check_serving(settings: Settings, host: str) -> None:
    """What :func:`open_server` refuses before it listens, beyond the settings' own
    checks (``polygate check-config --serve`` runs it too): a public address without
    gateway keys, and the serve extra missing."""
    check_exposure(settings, host)
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("polygate serve needs prometheus-client (polygate's serve extra): "
                          "pip install 'prometheus-client>=0.17'")


async def _listen(port: int, host: str) -> list[trio.SocketListener]:
    """Listeners on every address ``host`` names, all on one port: with port 0, trio
    binds each address to a free port of its own (``localhost`` on a dual-stack
    machine: ::1 and 127.0.0.1 on two ports, where the URL names one).  The first's
    port is then taken on all of them; should another program take it on one in the
    meantime, a fresh pick, a few times."""
    skipped: list[str] = []
    try:
        for _ in range(4):
            listeners = await _open_listeners(port, host, skipped)
            ports = [listener.socket.getsockname()[1] for listener in listeners]
            if port or len(set(ports)) == 1:
                return listeners
            for listener in listeners:
                await trio.aclose_forcefully(listener)
            try:
                return await _open_listeners(ports[0], host, skipped)
            except OSError:
                continue
        # (Ports apart, as before: still listening.)
        return await _open_listeners(port, host, skipped)
    finally:
        if skipped:  # (once, however many tries it took)
            log.warning("%s names addresses this machine cannot listen on: %s; listening "
                        "on the others", host, ", ".join(dict.fromkeys(skipped)))


#: A bind that fails so says the address is not this machine's to listen on now (::1
#: where the kernel has IPv6 off), not that the port or the configuration is wrong.
_NOT_HERE = frozenset({errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT})


async def _open_listeners(port: int, host: str, skipped: list[str]) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners``, except that a host *name* listens on the addresses
    it names that can be listened on here.  ``localhost`` names ::1 as well as
    127.0.0.1 in Debian's and Docker's /etc/hosts, and with IPv6 disabled by sysctl
    (a common hardening) binding ::1 fails with EADDRNOTAVAIL: trio skips a family
    only where its socket cannot be made at all, so the server did not start.  Such an
    address is skipped, with a warning, as long as another one listens; an address
    given as such (``--host ::1``) is never skipped.  The skipped ones are added to
    ``skipped``, for one warning (see _listen)."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        if exc.errno not in _NOT_HERE or _is_address(host):
            raise
        first = exc
    found = await trio.socket.getaddrinfo(
        host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE
    )
    addresses = list(dict.fromkeys(str(sockaddr[0]) for *_, sockaddr in found))
    listeners: list[trio.SocketListener] = []
    passed: list[str] = []
    try:
        for address in addresses:
            try:
                listeners += await trio.open_tcp_listeners(port, host=address)
            except OSError as exc:
                if exc.errno not in _NOT_HERE:
                    raise
                passed.append(f"{address} ({exc.strerror})")
    except BaseException:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
        raise
    if not listeners:
        raise first
    skipped += passed
    return listeners


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Server:
    """A running gateway; obtain one with ``async with open_server(...)``."""

    def __init__(self, listeners: list[trio.SocketListener], host: str, transport: Any) -> None:
        self._listeners = listeners
        self._host = host
        self._transport = transport
        self.metrics = Metrics()
        self.port: int = listeners[0].socket.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        #: ``http://host:port``; an OpenAI client's ``base_url`` is :attr:`base_url`.
        self.url = f"http://{shown}:{self.port}"
        self.base_url = self.url + "/v1"
        self.draining = False
        #: Its name in the ``Via`` of the requests its calls send (a request that
        #: comes back with it is a loop: serve/_app.py).  Drawn per server, not per
        #: process: two servers of one process may front one another.
        self.via = f"polygate-{os.urandom(6).hex()}"
        self.via_line = f"1.1 {self.via}"
        #: The server's block is being left: a reload's session that opens from now is
        #: retired at once (see _generation), and no reload starts.
        self._closing = False
        self._current: Gateway | None = None
        self._backends = SharedBackends()
        self._generations: set[Gateway] = set()
        self._sessions: trio.Nursery | None = None
        self._connections: trio.Nursery | None = None
        #: Stream frames being finished past a drain (Connection.finish_frame).
        self._finishing: set[trio.CancelScope] = set()
        #: The connections waiting for a request's first byte, by the scope of that wait
        #: (a drain closes them; a reload re-times their wait).
        self._idle: dict[trio.CancelScope, Connection] = {}
        #: Those of them that have answered a request: a client's pool keeping them
        #: open between requests, closed to make room at the limit (_reclaim_idle).  A
        #: connection that has sent nothing yet is not: its head's timeout ends it.
        self._kept_alive: dict[trio.CancelScope, Connection] = {}
        #: The connections accepted that have not begun a request yet (a drain waits a
        #: moment for those just accepted: _FIRST_REQUEST_S).
        self._fresh: set[_Fresh] = set()
        #: Those closed to make room that still count in ``metrics.connections`` (each
        #: until its task has closed it): room already made for a newcomer.
        self._reclaimed: set[Connection] = set()
        # An accept step's scan for idle connections (see _accept).
        self._busy_seen: set[Connection] = set()
        self._none_idle = False
        #: What the end of a drain's grace cancels: calls being answered, requests still
        #: arriving (once on, a call that starts is cut at once).
        self._cuts = Cuts()
        self._in_flight = 0
        self._quiet = trio.Event()
        self._refusing = 0
        #: The retries of a session the governance backend refused at start.
        self._recovering = trio.CancelScope()
        #: One reload at a time, in the order they were asked (trio's lock is fair):
        #: two at once would install whichever opened its session last.
        self._reloading = trio.Lock()
        #: Made with the connections' nursery (see _serve_connections).
        self._hangups: Hangups | None = None
        #: Every connection task has ended (see shutdown).
        self._closed = trio.Event()
        #: The client connections served at once: the settings' max_connections, or
        #: fewer where the open-file limit has no room for them (see _fds); and the
        #: max_connections that was computed for (every generation installed is fitted).
        self._room = 0
        self._room_for = 0

    def __repr__(self) -> str:
        return f"<polygate.serve.Server {self.url}{' draining' if self.draining else ''}>"

    @property
    def session(self) -> Session:
        """The session new requests use.  Raises :class:`GovernanceBackendError` while
        the governance backend has not answered since start (the server then answers
        every call 503 and keeps trying to open its session)."""
        assert self._current is not None
        session = self._current.session
        if isinstance(session, UnavailableSession):
            raise session._error()
        return session

    @property
    def settings(self) -> Settings:
        assert self._current is not None
        return self._current.settings

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(
            self._in_flight, self.metrics.connections, self.draining, len(self._generations)
        )

    # ------------------------------------------------------------------ lifecycle

    async def _generation(
        self, settings: Settings, *, task_status: trio.TaskStatus[Gateway] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # One in-process backend for every generation: a reload keeps the in-flight
        # permits of the calls still running on the old one (a source's and a key's
        # max_in_flight would otherwise hold twice over), its quota windows and breakers.
        backend = self._backends.for_settings(settings)
        gateway: Gateway | None = None
        session: Session | None = None
        try:
            async with session_on(settings, backend, transport=self._transport, relay=True) as opened:
                session = opened
                # Opened: nothing from here on fails, and it serves new requests next.
                self._backends.in_force(settings)
                self.metrics.sessions.add(opened)
                gateway = Gateway(settings, opened)
                self._generations.add(gateway)
                task_status.started(gateway)
                if self._closing:
                    # A reload's, opened as the block was left: the block's end retired
                    # the generations there were then, not this one, and the sessions'
                    # nursery waited for it for ever.
                    gateway.retire()
                await gateway.idle.wait()
        finally:
            if gateway is not None:
                self._generations.discard(gateway)
            if session is not None:
                # Closed (its last rows flushed): what it counted joins the totals
                # /metrics carries across reloads, and it is no generation any more.
                self.metrics.session_closed(session)

    async def reload(self, settings: Settings) -> None:
        """Serve new requests with ``settings``; calls in flight finish on the old
        session.  Raises (and changes nothing) when the new session cannot open --
        except while the server is still waiting for its governance backend: then the
        new settings are the ones it keeps trying.  ``host`` and ``port`` are not
        rebound: they need a restart.  Reloads asked at once take effect one after the
        other, in the order asked: the last one asked is the one in force.  Raises
        :class:`PolygateError` once the server's block has been left."""
        if self._closing:
            raise PolygateError("the server is closed: a reload needs a running server")
        async with self._reloading:
            if self._closing:  # (left while an earlier reload held the turn)
                raise PolygateError("the server is closed: a reload needs a running server")
            await self._reload(settings)

    async def _reload(self, settings: Settings) -> None:
        assert self._sessions is not None and self._current is not None
        old = self._current
        if (settings.serve.host, settings.serve.port) != (old.settings.serve.host, old.settings.serve.port):
            log.warning("reload: serve.host and serve.port take effect only at restart")
        check_exposure(settings, self._host)
        try:
            new: Gateway = await self._sessions.start(self._generation, settings)
        except GovernanceBackendError as exc:
            # Re-read: a recovery may have opened the real session meanwhile, which
            # this failure must not replace with a stand-in.
            old = self._current
            if isinstance(old.session, UnavailableSession):
                # In force all the same: the settings the server keeps trying.
                self._current = Gateway(settings, UnavailableSession(settings, str(exc)))
                self._fit_connections(settings)
                self._retime_waits(settings)
                old.retire()
                self.metrics.reloads += 1
            raise
        self._fit_connections(settings)
        self._retime_waits(settings)
        # Re-read: a recovery (below) may have replaced the stand-in meanwhile.
        old, self._current = self._current, new
        old.retire()
        self._recovering.cancel()  # a reload that opened its session ends the waiting
        self.metrics.reloads += 1
        # In force: the names no open generation uses any more let their state go.
        self._backends.forget_unused(gateway.settings for gateway in self._generations)

    def _fit_connections(self, settings: Settings, *, starting: bool = False) -> None:
        """Fit the connections the open-file limit leaves room for to the settings
        coming into force (see _fds): once for each ``max_connections`` asked."""
        wanted = settings.serve.max_connections
        if wanted != self._room_for:
            self._room = connection_room(wanted, self.metrics.connections, starting=starting)
            self._room_for = wanted

    def _retime_waits(self, settings: Settings) -> None:
        """Give the connections waiting for a request the new settings' wait, from when
        their wait began: a reload that lowers ``idle_timeout_s`` (or
        ``header_timeout_s``) reaches them now, not when the old period ends."""
        for scope, conn in self._idle.items():
            conn.retime(scope, settings.serve)

    async def _recover(self) -> None:
        """Open the session the backend refused at start, retrying with a growing
        period; the generation it opens replaces the stand-in."""
        assert self._sessions is not None
        with self._recovering:
            delay = wait = _RECOVER_FIRST_S
            while True:
                await trio.sleep(wait)
                assert self._current is not None
                settings = self._current.settings  # a reload may have changed them
                try:
                    new: Gateway = await self._sessions.start(self._generation, settings)
                except GovernanceBackendError as exc:
                    delay = wait = min(delay * 2, _RECOVER_MAX_S)
                    log.warning("governance backend still unreachable (%s); retrying in %.1f s",
                                exc, delay)
                    continue
                except PolygateError as exc:
                    # The backend answers, but the configuration in force cannot open
                    # otherwise (a reload the backend refused first, whose telemetry
                    # database cannot open, say).  The server goes on answering 503s
                    # and trying: a reload of a fixed file takes over, as any does.
                    delay = wait = min(delay * 2, _RECOVER_MAX_S)
                    log.error("the configuration in force cannot open its session (%s); "
                              "retrying in %.1f s", exc, delay)
                    continue
                if self._recovering.cancel_called:  # a reload got there first
                    new.retire()
                    return
                if self._current.settings is not settings:
                    # A reload while this opened, refused by the backend and so in force
                    # as the stand-in's: these settings are no longer the ones to serve
                    # (installed, they would undo it: a key it revoked accepted again).
                    # The backend answers now: open the reload's at once.
                    new.retire()
                    wait = 0
                    continue
                old, self._current = self._current, new
                old.retire()
                log.info("governance backend reachable: serving calls")
                return

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting; let requests in flight finish within ``grace_s`` (default
        ``serve.grace_s``), then cancel what is left (each is told why, within a second).
        Returns once every connection is closed: :meth:`statistics` then shows nothing
        in flight."""
        if grace_s is None:
            grace_s = self.settings.serve.grace_s
        self.draining = True
        self._recovering.cancel()
        for listener in self._listeners:
            await listener.aclose()
        for scope in list(self._kept_alive):
            scope.cancel()  # idle keep-alive connections: nothing in flight, close now
        # A connection woken with its request's first bytes before the drain began has
        # not yet run to count itself in flight: let it (it runs in this batch of trio's
        # scheduler; this task, in the next), or the drain would find nothing in flight
        # and hard-stop it unanswered.  (Its idle scope is cancelled all the same: the
        # request reads on without it, see Connection.read_request.)
        await trio.lowlevel.checkpoint()
        with trio.move_on_after(grace_s):
            # Those accepted less than _FIRST_REQUEST_S ago may still begin their
            # request (in flight from its first byte, then answered); each closes as
            # its own moment ends with nothing sent, the older ones at once (idle).
            closed = False
            while self._fresh:
                now = trio.current_time()
                for fresh in list(self._fresh):
                    if fresh.opened + _FIRST_REQUEST_S <= now:
                        self._unfresh(fresh, close=True)
                        closed = True
                if self._fresh:
                    with trio.move_on_at(min(f.opened for f in self._fresh) + _FIRST_REQUEST_S):
                        await self._until(lambda: not self._fresh)
            if closed:
                await trio.lowlevel.checkpoint()  # (as above: a first byte in that instant)
            await self._until(lambda: not self._in_flight)
        if self._in_flight:
            log.warning("grace period over: cancelling %d call(s) in flight", self._in_flight)
            # Each call stops, settles, and its client is told why; so is each request
            # still arriving, and any that reaches its answer from now (see _answer).
            self._cuts.cut()
            with trio.move_on_after(_LAST_WORDS_S):
                await self._until(lambda: not self._in_flight)
        self.hard_stop()
        # Returns once every connection has closed and counted itself out: cancelled,
        # each ends at its next checkpoint (its close is bounded on its own).
        await self._closed.wait()

    async def _until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()``, rechecked whenever the drain's state moves (a request
        landed, a fresh connection began one or closed)."""
        while not done():
            if self._quiet.is_set():  # (one event for every waiter: a second drain too)
                self._quiet = trio.Event()
            await self._quiet.wait()

    def _unfresh(self, fresh: _Fresh, *, close: bool = False) -> None:
        """``fresh`` has begun its request, or closed (``close``: closes it if it waits)."""
        if fresh in self._fresh:
            self._fresh.discard(fresh)
            if close and fresh.scope is not None:
                fresh.scope.cancel()
            fresh.scope = None
            if self.draining:
                self._quiet.set()

    def hard_stop(self) -> None:
        """Cancel every connection now, a frame being finished too."""
        for scope in list(self._finishing):
            scope.cancel()
        if self._connections is not None:
            self._connections.cancel_scope.cancel()

    # ------------------------------------------------------------------ connections

    async def _serve_connections(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        hangups = None
        if Hangups.supported():
            try:
                hangups = Hangups()
            except OSError as exc:  # out of descriptors, say: a task per request will do
                log.warning("cannot watch clients in one epoll set (%s): a task per request", exc)
        self._hangups = hangups
        try:
            async with trio.open_nursery() as connections:
                self._connections = connections
                if hangups is not None:
                    connections.start_soon(hangups.run)
                for listener in self._listeners:
                    connections.start_soon(self._accept, listener)
                task_status.started()
        finally:
            if hangups is not None:
                hangups.close()  # every connection task has ended, and its run
            self._closed.set()

    async def _accept(self, listener: trio.SocketListener) -> None:
        assert self._connections is not None
        # The listening socket itself, to take what else is queued without a pass of
        # the scheduler each (see _ACCEPT_BATCH); trio's private attribute, so where
        # it is not there, one connection a pass as before.
        found = getattr(listener.socket, "_sock", None)
        raw: socket.socket | None = found if isinstance(found, socket.socket) else None
        starved = False  # logged once a spell, not ten times a second
        while True:
            try:
                stream = await listener.accept()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            except OSError as exc:
                if out_of(exc) is None:  # (not out of descriptors, buffers or memory)
                    raise
                if not starved:
                    starved = True
                    log.error("accept failed (%s): retrying every %.1f s",
                              errno.errorcode.get(exc.errno or 0), _ACCEPT_PAUSE_S)
                await trio.sleep(_ACCEPT_PAUSE_S)
                continue
            if starved:
                starved = False
                log.warning("accepting connections again")
            # What a scan for idle connections found stays true for this whole step (no
            # connection's task runs meanwhile): each newcomer of a batch need not scan
            # again the busy ones another has seen, nor any once none was idle.
            self._busy_seen, self._none_idle = set(), False
            self._take(stream)
            if raw is not None:
                self._take_queued(raw)

    def _take_queued(self, raw: socket.socket) -> None:
        """Take what else waits in the listening socket's queue, up to a batch."""
        for _ in range(_ACCEPT_BATCH - 1):
            try:
                sock, _address = raw.accept()  # (non-blocking: trio made it so)
            except OSError:
                # Nothing more queued; or an error, which the awaited accept meets again
                # and handles (out of descriptors: its pause).
                return
            self._take(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))

    def _take(self, stream: trio.SocketStream) -> None:
        """A connection just accepted: served, or refused at the limit."""
        assert self._connections is not None
        # (Connections closed for an earlier newcomer still count until they have
        # gone: room made already, not to be made twice.)
        open_now = self.metrics.connections - len(self._reclaimed)
        if open_now >= self._room and not self._reclaim_idle(open_now - self._room + 1):
            if self._refusing < _REFUSING:
                self._refusing += 1  # (now: a burst taken in one step counts each)
                self._connections.start_soon(self._refuse, stream)
            else:
                # Refusals already take all the time they may: this one is answered
                # from what its socket already holds (a liveness probe's 200 too), as
                # far as the socket takes the answer now, and closed: nothing waits.
                write_now(stream, self._refusal(_queued(stream)))
                stream.socket.close()
            return
        # Counted here, not when its task first runs: a burst of connects accepted
        # before any of them ran overshot max_connections.
        self.metrics.connections += 1
        self.metrics.connections_total += 1
        fresh = _Fresh(trio.current_time())
        self._fresh.add(fresh)
        self._connections.start_soon(self._connection, stream, fresh)

    def _reclaim_idle(self, wanted: int) -> bool:
        """At the connection limit, close the connections that have waited longest for
        their next request, to make room for this one (nginx reuses keep-alive
        connections so when it runs out): a client's pool holding its connections open
        between requests otherwise kept every other client out, 503
        ``too_many_connections`` from an idle gateway, until ``idle_timeout_s`` (a
        request every 74 s kept it so).  ``wanted``: how many to close for one more to
        fit, more than one over a limit a reload lowered (the count comes down to it, as
        it did with refusals).  Their descriptors go within a pass of the scheduler, the
        new one's comes now: the reserve for everything else covers the moment between.
        False when fewer are idle: then the new one is refused."""
        if self._none_idle:
            return False
        for scope, conn in self._kept_alive.items():  # (the oldest first: each wait is added as it begins)
            if wanted <= 0:
                break
            if scope.cancel_called or conn in self._busy_seen:
                continue
            # One whose client has sent its next request, not yet read (its task has
            # not run since), is not idle: closed, it read the request on, was answered
            # and counted again, past the cap, with the newcomer let in too.  Up to a
            # whole accept batch of them at once (a review saw 64 over the cap, 502s
            # for lack of descriptors).
            if _next_request_came(conn):
                self._busy_seen.add(conn)
                continue
            scope.cancel()
            self._reclaimed.add(conn)
            self.metrics.idle_reclaimed += 1
            wanted -= 1
        if wanted > 0:
            self._none_idle = True
        return wanted <= 0

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """A connection past ``max_connections`` (counted in ``_refusing`` by the accept
        loop): answered ``503 too_many_connections`` -- except a liveness probe,
        ``GET /healthz``, answered 200 as ever: the process serves, and a probe told
        otherwise at the gateway's busiest would have it restarted.  The request line
        is read first, as it decides; after the answer the connection lingers (see
        ``Connection.aclose``), since a close with the request unread sends a reset
        that can destroy the answer before the client reads it.  All of it within
        ``_REFUSE_S``: the refusals in progress are bounded (``_REFUSING``)."""
        decided = False
        try:
            with trio.move_on_after(_REFUSE_S):
                start = b""
                with trio.move_on_after(_HEAD_WAIT_S):
                    while b"\n" not in start and len(start) < _LINE_WAITED:
                        data = await stream.receive_some(_LINE_WAITED)
                        if not data:
                            break
                        start += data
                decided = True
                await stream.send_all(self._refusal(start))
                await stream.send_eof()
                while await stream.receive_some(_LINE_WAITED):
                    pass  # (dropped: read until the client closes, _REFUSE_S at most)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # (the client went)
        finally:
            if not decided:  # (gone, or the server stopping, before its request line)
                self.metrics.connections_refused += 1
            self._refusing -= 1
            await _close(stream)

    def _refusal(self, start: bytes) -> bytes:
        """The answer to a connection past the limit whose request began with
        ``start``: 200 to a liveness probe, else a 503 (counted)."""
        if start.startswith(_LIVENESS):
            status, retry, body = b"200 OK", b"", b'{"status":"ok"}'
        else:
            self.metrics.connections_refused += 1
            status, retry = b"503 Service Unavailable", b"retry-after: 1\r\n"
            body = error_body(
                "The gateway is at its connection limit; try again shortly.", "api_error",
                "too_many_connections",
            )
        cid = fresh_call_id().encode()
        head = (
            b"HTTP/1.1 %s\r\n%scontent-type: application/json\r\n%sconnection: close\r\n"
            b"x-polygate-call-id: %s\r\nx-request-id: %s\r\n%scontent-length: %d\r\n\r\n"
            % (status, server_lines(), retry, cid, cid,
               b"".join(b"%s: %s\r\n" % pair for pair in NO_CALL), len(body))
        )
        return head if start.startswith(b"HEAD ") else head + body

    async def _connection(self, stream: trio.SocketStream, fresh: _Fresh) -> None:
        """One connection, counted in ``metrics.connections`` by the accept loop, and in
        ``_fresh`` (``fresh``) until it begins its first request."""
        metrics = self.metrics
        assert self._current is not None
        conn = Connection(stream, self._current.settings.serve, self._finishing, self._cuts)
        # The generation whose keys admitted the request being read (admit, below): its
        # answer needs no second check, unless a reload came in between.
        checked: Gateway | None = None

        def admit(path: str, headers: dict[str, str]) -> bool:
            nonlocal checked
            gateway = self._current
            assert gateway is not None
            # The request's body is read under the limits in force when its head
            # came: a reload changes them for the connections already open too.
            conn.limits = gateway.settings.serve
            if path in _OPEN_PATHS:
                return True
            if gateway.authorised(headers):
                checked = gateway
                return True
            return False

        answered = False  # a request has been answered on it (see _kept_alive)
        linger = False  # the last request was refused with its body unread
        #: Its request was answered with its body's rest unread (refused, or cut by the
        #: drain): in flight until the connection has closed after its linger, so that
        #: a drain does not cut the linger short (a close with unread bytes resets, and
        #: a reset can destroy the answer before the client reads it).
        landing_late = False
        try:
            # A drain ends the loop, except for a request whose bytes came before the
            # last answer ended (carried): in flight from its first byte, answered too;
            # and for a connection just accepted that the drain lets begin its first.
            while not self.draining or conn.carried or fresh in self._fresh:
                checked = None
                # The wait for the next request, and its head, are under the limits in
                # force now (a reload's too, on a connection kept alive across it).
                conn.limits = self._current.settings.serve
                idle = trio.CancelScope()
                self._idle[idle] = conn
                if answered:
                    self._kept_alive[idle] = conn
                elif fresh in self._fresh:
                    fresh.scope = idle
                begun = False
                begun_at = 0.0  # (monotonic) its first byte: a problem's time counts from it

                def started(idle: trio.CancelScope = idle) -> None:
                    # Idle until its first byte: a drain closes an idle connection, but a
                    # request it has begun to receive is in flight: read and answered.
                    nonlocal begun, begun_at
                    begun = True
                    begun_at = time.monotonic()
                    self._idle.pop(idle, None)
                    self._kept_alive.pop(idle, None)
                    self._unfresh(fresh)
                    if conn.carried:
                        conn.carried = False  # (counted as the last answer ended)
                    else:
                        self._in_flight += 1
                    # From here the end of a drain's grace cuts the head's read.
                    self._cuts.add(idle)
                    # (The head's deadline, set right after: a reload during the wait.)
                    assert self._current is not None
                    conn.limits = self._current.settings.serve

                request = None
                try:
                    # (read_request enters idle, with the head's deadline: one scope.)
                    request = await conn.read_request(
                        admit, started=started, scope=idle,
                        # (Kept open by a drain after its answer: see _answer.)
                        first_byte_s=_FIRST_REQUEST_S if conn.carried and not conn.pending() else None)
                except HTTPProblem as problem:
                    landing_late, linger = begun and conn.still_sending(), True
                    await self._problem(conn, problem, begun_at if begun else None)
                    return
                except ClientGone as gone:
                    if begun:  # left in the middle of its request: as after it, a 499
                        metrics.disconnects += 1
                        metrics.request(
                            "other" if gone.path is None else endpoint_label(gone.path), 499,
                            time.monotonic() - begun_at)
                    return
                except Cut as stopped:
                    # (Its linger within the drain's last words.)
                    landing_late = linger = True
                    await self._told_cut(conn, stopped.path, begun_at)
                    return
                finally:
                    self._idle.pop(idle, None)
                    self._kept_alive.pop(idle, None)
                    self._cuts.scopes.discard(idle)
                    if begun and request is None and not landing_late:
                        self._landed()  # nothing to answer: (the answer lands its own)
                # (None: the client closed, or a drain closed the idle connection. A
                # request read despite idle's cancellation read on without it.)
                if request is None:
                    return
                # (Closed to make room as its request's bytes came: answered, and open
                # still, it counts again.)
                self._reclaimed.discard(conn)
                await self._answer(conn, request, checked)
                answered = True
                if not conn.reusable():
                    return
        finally:
            self._unfresh(fresh)
            if conn.carried:  # counted, never read (the client left first, say)
                conn.carried = False
                self._landed()
            if not linger:
                # Its descriptor goes in aclose's first step, before any wait: its
                # place is free for a newcomer now (until the count below comes down).
                self._reclaimed.add(conn)
            try:
                await conn.aclose(linger)
            finally:
                metrics.connections -= 1  # (after a linger: its descriptor was held)
                self._reclaimed.discard(conn)
                if landing_late:
                    self._landed()

    async def _answer(self, conn: Connection, request: Any, checked: Gateway | None = None) -> None:
        """``checked``: the generation whose keys admitted the request at its head."""
        gateway = self._current
        assert gateway is not None
        gateway.enter()
        # (in self._in_flight since its first byte: see _connection)
        self.metrics.in_flight += 1
        context = Context(conn, gateway, self.metrics, self, key_checked=checked is gateway)
        # Past the grace (the cuts on), a request that was pipelined behind another, or
        # whose last bytes came after, starts no call: it is told 503 shutting_down.
        self._cuts.add(context.stop)
        hangups = self._hangups
        fd = None if hangups is None else conn.fileno()
        try:
            # A client that leaves cancels the request's call: the server's one
            # watching task sees it (see _hangups), or, for a stream it cannot take, a
            # task of its own.  The call's scope is the one a drain cancels too
            # (Context.stop): one scope a request, not two (each costs ~3 % of a
            # request's instructions); the answer tells the two apart by whether the
            # client is gone.  Everything else a request awaits is bounded on its own.
            stop = context.stop.cancel
            if hangups is not None and fd is not None and hangups.watch(conn, fd, stop):
                try:
                    await answer(context, request)
                finally:
                    hangups.unwatch(fd, conn)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(conn.watch_close, stop)
                    await answer(context, request)
                    nursery.cancel_scope.cancel()
        finally:
            self._cuts.scopes.discard(context.stop)
            gateway.leave()
            self.metrics.in_flight -= 1
            if self.draining and conn.reusable() and (conn.pending() or not self._cuts.on):
                # The next request is already here: in flight from now, before this one
                # lands, so that a drain waiting for quiet waits for it as well.  (Not
                # draining, the loop counts it at its first byte: no await comes
                # between here and there, so a drain cannot begin in between.)  Or it
                # may be about to come: an answer still reusable in a drain is one whose
                # head went out before it (a stream's), which could not say close, and
                # its client may send the next request at once.  Closed now, that request
                # was lost unanswered (a reset, or "disconnected without a response"):
                # the connection waits _FIRST_REQUEST_S for its first byte, as a
                # connection just accepted does, in flight meanwhile.  (Not once the
                # grace is over: the server is stopping, a stream cut then closes.)
                self._in_flight += 1
                conn.carried = True
            self._landed()

    async def _told_cut(self, conn: Connection, path: str | None, begun_at: float) -> None:
        """Tell a request still arriving when the grace ended why it is not answered."""
        status = 503  # (the hard stop cutting the write, too: as a call it cuts)
        try:
            await answer_cut(conn)
        except ClientGone:
            status = 499
            self.metrics.disconnects += 1
        finally:
            self.metrics.request(
                "other" if path is None else endpoint_label(path), status,
                time.monotonic() - begun_at)

    def _landed(self) -> None:
        """A request in flight (being read, or answered) is done."""
        self._in_flight -= 1
        if self._in_flight == 0 and self.draining:
            self._quiet.set()

    async def _problem(
        self, conn: Connection, problem: HTTPProblem, begun_at: float | None = None
    ) -> None:
        """Answer a request that could not be read; ``begun_at``: its first byte (the
        metrics' duration counts from there, as a slow client's 408 took that long)."""
        try:
            cid = fresh_call_id().encode()
            await conn.send_response(
                problem.status,
                [(b"content-type", b"application/json"), (b"x-polygate-call-id", cid),
                 (b"x-request-id", cid), *NO_CALL, *problem.headers],
                error_body(problem.message, "invalid_request_error", problem.code), close=True,
            )
        except ClientGone:
            pass
        except Exception:  # h11 could not even frame an answer: just close
            pass
        self.metrics.request(
            "other" if problem.path is None else endpoint_label(problem.path), problem.status,
            0.0 if begun_at is None else time.monotonic() - begun_at)


#: Linux's "the peer closed or half-closed" poll event (0 elsewhere: an end of file
#: there reads as a request come, and the connection is not taken as idle).
_RDHUP = getattr(select, "POLLRDHUP", 0)


def _next_request_came(conn: Connection) -> bool:
    """Whether a kept-alive connection's client has sent its next request (bytes its
    task has not read yet): then it is about to be busy, not idle.  A client that
    closed, half-closed or reset has not: its connection is leaving (and taken as
    idle, its place given now, as a pool that closed all at once made every newcomer
    wait for the next pass)."""
    if conn.pending():
        return True
    stream, poll = conn.stream, getattr(select, "poll", None)
    if type(stream) is not trio.SocketStream or poll is None:
        return False  # (not a plain socket, or no poll(2): taken as idle, as before)
    poller = poll()
    try:
        poller.register(stream.socket.fileno(), select.POLLIN | _RDHUP)
    except (OSError, ValueError):  # (closed meanwhile)
        return False
    events = poller.poll(0)
    if not events:
        return False
    mask = events[0][1]
    return bool(mask & select.POLLIN) and not mask & (_RDHUP | select.POLLHUP | select.POLLERR)


def _queued(stream: trio.SocketStream) -> bytes:
    """The start of what the client has sent already, read without waiting."""
    try:
        return os.read(stream.socket.fileno(), _LINE_WAITED)
    except OSError:  # (nothing yet: EAGAIN; or the client went)
        return b""


async def _close(stream: trio.SocketStream) -> None:
    with trio.move_on_after(1):
        await stream.aclose()


@asynccontextmanager
async def open_server(
    settings: Settings | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Server]:
    """Serve ``settings`` (default: the configuration ``polygate.session()`` would
    load) over HTTP while the block runs.  ``host``/``port`` override
    ``settings.serve``; port 0 picks a free port (``server.port``).  Leaving the block
    cancels whatever is still running; call :meth:`Server.shutdown` first to drain."""
    from .._config_load import given_settings

    try:
        settings = given_settings(settings, env)
    finally:
        del env  # (a configuration error's frames would show it: see frameless_on)
    host = settings.serve.host if host is None else host
    port = settings.serve.port if port is None else port
    try:  # the overrides are checked like [serve] host and port (70000 is not 4464)
        attrs.evolve(settings.serve, host=host, port=port)
    except FieldError as exc:
        raise ConfigError(f"{exc.field}: {exc.problem}") from None
    check_serving(settings, host)
    try:
        listeners = await _listen(port, host)
    except OSError as exc:
        where = f"[{host}]" if ":" in host else host  # (an IPv6 address: ::1:8080 is one too)
        raise ConfigError(f"serve: cannot listen on {where}:{port} ({exc.strerror})") from None
    server = Server(listeners, host, transport)
    try:
        server._fit_connections(settings, starting=True)
    except ConfigError:  # (no room for one client: nothing listens)
        for listener in listeners:
            await trio.aclose_forcefully(listener)
        raise
    failure: BaseException | None = None
    async with trio.open_nursery() as sessions:
        server._sessions = sessions
        try:
            try:
                server._current = await sessions.start(server._generation, settings)
            except GovernanceBackendError as exc:
                # Fail closed per call (503), not by exiting: see _unavailable.
                log.warning("governance backend unreachable (%s): answering 503 and retrying", exc)
                server._current = Gateway(settings, UnavailableSession(settings, str(exc)))
                sessions.start_soon(server._recover)
            # The connections live in a task of their own, so that shutdown() can cancel
            # them without cancelling the caller's block.
            await sessions.start(server._serve_connections)
            try:
                yield server
            except BaseException as exc:  # re-raised below as itself
                failure = exc
        except BaseException as exc:
            failure = failure or exc
        finally:
            server._closing = True
            server._recovering.cancel()
            server.hard_stop()
            for listener in listeners:
                await listener.aclose()
            for gateway in list(server._generations):
                gateway.retire()  # each session closes once its last request has left
    if failure is not None:
        raise failure
