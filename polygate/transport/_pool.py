"""LeanTransport: polygate's default HTTP transport, a lean HTTP/1.1 keep-alive pool
written on h11 (the parser httpcore itself uses) over trio streams.

Why it exists
-------------
polygate sends ``httpx.Request`` objects straight to an ``httpx.AsyncBaseTransport``.
httpx's own transport (httpcore's connection pool) is correct, but under trio it was
the bottleneck, not the network.  Against the zero-delay FakeUpstream server in its
own process on a 2-core machine (``benchmarks/peers.py``, medians of 3 repeats), a
raw-socket asyncio client did ~6,400 calls/s at concurrency 64 and ~5,600 at 256
(the server's limit); raw ``httpx.AsyncClient`` under trio ~880 and ~620, spending
1.1 and 1.6 ms of client CPU per call.  Profiled, 38 % of that client time is in
httpcore's ``_assign_requests_to_connections`` and what it calls: every request
entering or leaving the pool walks every connection for every queued request
(``is_idle``, ``has_expired``, a readability poll of each idle socket), and a
request assigned to a connection another request took first goes round again.  The
work per request grows with the number of connections, which is why bursts (and
hedges, which add bursts) hurt most (encode/httpcore#1110).

This pool does constant work per request: a dict lookup and a list pop for an idle
connection of the request's origin (LIFO: the warmest socket), one readability
poll of that one socket, one write for head and body, reads until h11 has the
response head.  polygate's whole call on it -- admission, hedging bookkeeping,
parsing included -- costs ~0.33 ms of CPU and runs ~3,100 calls/s at c=64 and
~3,000 at c=256 (3.6x and 4.8x raw httpx, about half the raw-socket floor);
sequential calls take 0.76x raw httpx's time.

What it does (and does not)
---------------------------
* HTTP/1.1 only, ``http`` and ``https`` (``trio.SSLStream``, ALPN ``http/1.1``,
  SNI; ``ssl.create_default_context()`` unless an ``ssl_context`` is given).
  No proxies, no HTTP/2.
* At most ``max_connections`` open connections (idle or busy, all origins
  together).  A request that finds none free waits in a FIFO queue (a
  ``trio.Event`` per waiter, no polling); a finished connection is handed straight
  to the first waiter (its own, if the origins match; otherwise it is closed and
  the waiter opens one in its slot).  At the cap, an idle connection of another
  origin is closed to make room.
* A connection goes back to the pool only after its response was read to the end,
  with nothing after it (bytes past the end -- a 204 with a body, more than the
  Content-Length -- would answer the next request), and neither side said
  ``Connection: close``.  Anything else -- an error, a cancellation, a response
  closed half-read -- closes it at once, so the server sees the client leave
  (polygate relies on that to stop hedge losers).  Closing a response never waits
  for the rest of its body: the connection is kept only if its end already arrived.
* Idle connections expire after ``keepalive_expiry`` seconds; one the server has
  closed (readable while idle) is dropped when it is next picked, and by
  :meth:`LeanTransport.close_idle`, which a session calls every few seconds.  If a reused
  connection fails while the request is being written (the server had closed it:
  a reset before the write was done) and no byte of an answer came, the request is
  sent once more on another connection.  Once the whole request was written, it is
  never sent again: a server that read it and hung up without a byte of answer may
  have acted on it (a generation, a bill), so the failure is the caller's to retry
  or not (polygate's retry policy counts it as an attempt), as httpx, Go's
  ``net/http`` and urllib3 do for a POST.  A fresh connection is never retried.
* The common exchange never touches h11: a plain request is written here, byte for
  byte as h11 would write it (see "the request" below), and an answer whose whole
  head is in the first read and has the plain shape (``HTTP/1.1``, a final status,
  CRLF lines, one Content-Length or ``chunked``: see ``_head``) is read here, its
  body counted or de-chunked to its end.  Everything else is h11's: an unusual
  request goes through h11's writer, and any other answer is handed to h11 from its
  first byte (a response head over ``_head.MAX_HEAD`` is refused here, counted as
  it is fed: h11's own limit counts only a head still incomplete; at most
  ``MAX_INTERIM_RESPONSES`` 1xx responses are read before the final one), as is a
  chunked end with trailers or bytes after it.  h11's refusal of a header value is
  re-worded so that it never quotes the value.
* The :data:`SENT_EXTENSION` callable of a request, if any, is called as the
  request starts going out: after any wait for a connection and the connect.
* Errors come out as httpx's exceptions, as httpx's transport raises them:
  ``ConnectError``, ``WriteError``, ``ReadError``, ``RemoteProtocolError``
  (a body shorter than its Content-Length, a server that hung up without
  answering), ``LocalProtocolError``.  Timeouts: polygate uses cancel scopes; the
  ``timeout`` extension that ``httpx.AsyncClient`` sets is honoured per operation
  (``PoolTimeout``, ``ConnectTimeout``, ``WriteTimeout``, ``ReadTimeout``).
* All I/O runs in the calling task: no background tasks, no threads (trio's own
  name resolution aside), so cancellation and deadlines apply to every byte.
"""

from __future__ import annotations

import collections
import encodings.idna  # noqa: F401 - now: see _open_shedding
import ipaddress
import logging
import math
import re
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, cast

import attrs
import h11
import httpx
import trio

from .._chunked import PLAIN_END, ChunkedDecoder
from .._http11 import unquoted
from .._sockets import out_of, out_of_now, read_now, reads_now, receive_when_readable, write_first
from .._threads import patient_clock
from ._eyeballs import Target, connect
from ._head import HEAD_EXTENSION, MAX_HEAD, Head, parse_head
from ._wire import CALL_ID_HEADER

__all__ = [
    "REPORTS_SENT", "SENT_EXTENSION", "LeanTransport", "PoolStatistics", "body_of", "close_now",
    "answered_on_close", "is_lean", "reports_sent",
]

log = logging.getLogger("polygate.transport")
#: Out of descriptors, a warning at most this often (each connect fails alike).
_WARN_EVERY_S: Final = 10.0

#: A request extension: a callable, called with no argument when the request starts
#: going out on a connection (after any wait for one and the connect; again if a
#: stale kept-alive connection makes it go out a second time).  polygate stamps
#: ``Timeline.sent_at`` with it, so a request cancelled while it waited was not sent.
SENT_EXTENSION: Final = "polygate.sent"
#: A transport with this attribute set to True calls the :data:`SENT_EXTENSION`
#: callable itself when it writes a request (LeanTransport does; so do the fakes of
#: ``polygate.testing``).  For any other transport polygate cannot tell when a request
#: is written, so it counts the request as sent when it hands it over.
REPORTS_SENT: Final = "polygate_reports_sent"
#: Interim (1xx) responses accepted before the final one.  Each is bounded by
#: ``_head.MAX_HEAD``, counted per response; without a count an upstream could send them
#: for ever, each one costing CPU and escaping every byte cap.
MAX_INTERIM_RESPONSES: Final = 8
# At most this much is taken from the kernel per read of an event stream.  A process
# that falls behind otherwise pulls each stream's whole backlog into memory at once
# (64 KiB reads: 139 KB RSS a stream at 1,000 concurrent streams, 4 KiB: 94 KB, with
# the same CPU a chunk and unchanged at 200 streams; benchmarks/streams.py): the rest
# waits in the socket buffer.  A whole body (a JSON answer, a batch of embeddings
# megabytes long) is read in large pieces: at 4 KiB it would take 16 times the reads.
_STREAM_READ: Final = 4096
_BODY_READ: Final = 65536
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
#: Network failures of a reused connection that may mean "the server had closed it".
_STALE_ERRORS: Final = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

_Key = tuple[str, str, int]  # (scheme, host, port)


@attrs.frozen
class PoolStatistics:
    """A snapshot of a :class:`LeanTransport`.  ``open``: connections open or being
    opened (idle and busy); ``idle``: kept alive, waiting for a request;
    ``waiting``: requests queued for a connection; ``opened``: connections ever
    opened; ``reused``: requests sent on a kept-alive connection; ``retried``:
    requests sent again after a reused connection turned out to be closed."""

    open: int
    idle: int
    waiting: int
    opened: int
    reused: int
    retried: int


class _Disconnected(Exception):
    """The server closed the connection before sending a single byte of response."""


#: A request this large is written over TLS a piece at a time, a failed write ending
#: the writing without breaking the stream (see _SoftSend); a smaller one in one write.
_SOFT_TLS_SEND: Final = 64 * 1024
_TLS_SEND_PIECE: Final = 64 * 1024


class _SoftSend(trio.abc.Stream):
    """The socket under a TLS stream.  A server may answer before it has read the
    whole request, then close (a proxy's 413 for a large body, a 401); on a plain
    socket that answer is read after the failed write (see _round_trip), but trio's
    TLS stream is broken for good by a failed write -- its reads refused -- and the
    answer was lost (the body uploaded again, the breaker fed, for a request no source
    takes).  While ``soft`` (a large request going out), a failed write is kept in
    ``failed`` and ends the writing instead, the TLS stream none the wiser: the answer
    is read from it as from a plain socket.  (The connection is never reused.)"""

    __slots__ = ("failed", "soft", "tcp")

    def __init__(self, tcp: trio.SocketStream) -> None:
        self.tcp = tcp
        self.soft = False
        self.failed: BaseException | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.failed is not None:
            await trio.lowlevel.checkpoint()  # (the writing has ended: nowhere to go)
            return
        try:
            await self.tcp.send_all(data)
        except (trio.BrokenResourceError, OSError) as exc:
            if not self.soft:
                raise
            self.failed = exc

    async def wait_send_all_might_not_block(self) -> None:
        await self.tcp.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.tcp.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.tcp.aclose()


#: A host name looked up this recently is not looked up again: a new connection goes
#: to the addresses that lookup found.
_LOOKUP_FRESH_S: Final = 5.0
#: Real seconds a ``MockClock`` stands still while a name is looked up (see _lookup).
_LOOKUP_HOLD_S: Final = 1.0
#: Names a transport keeps its lookups' state for before it forgets idle ones.
_LOOKUPS_KEPT: Final = 256


class _Lookup:
    """A host name's lookups (LeanTransport._lookup): its callers in turn, its one
    lookup thread, and how and when the last lookup ended."""

    __slots__ = ("addresses", "ended_at", "failed", "lookups", "thread", "turn")

    def __init__(self) -> None:
        self.turn = trio.Lock()
        self.thread = trio.CapacityLimiter(1)
        self.ended_at = -math.inf
        self.failed: OSError | None = None
        self.addresses: Sequence[Target] = ()  # what the last lookup that answered found
        self.lookups = 0  # lookups ended (with an outcome to share)


def _is_address(host: str) -> bool:
    """An IP address (IPv6 with or without its zone): nothing to look up."""
    try:
        ipaddress.ip_address(host.replace("%25", "%"))
    except ValueError:
        return False
    return True


def _custom_resolver() -> bool:
    """Whether the application set trio's hostname resolver for this run (read by
    the only public means, setting it: both calls are synchronous, so nothing runs
    in between)."""
    found = trio.socket.set_custom_hostname_resolver(None)
    trio.socket.set_custom_hostname_resolver(found)
    return found is not None


def _connectable(host: str) -> str:
    """The host as the resolver reads it: an IPv6 zone as itself (``fe80::1%eth0``),
    not percent-encoded as the URL writes it (RFC 6874: ``%25eth0``)."""
    return host.replace("%25", "%") if "%25" in host and _is_address(host) else host


def _tls_name(host: str) -> str:
    """The name a certificate is checked against, and SNI's.  A name's trailing dot is
    the DNS root, not part of the name a certificate holds, nor of SNI's (RFC 6066:
    "api.example.com." failed every handshake).  An address goes without its IPv6 zone,
    this host's interface and part of no certificate: ``ssl`` then checks the address
    against the certificate's IP entries and sends no SNI, as RFC 6066 asks of an
    address (``fe80::1%25eth0`` was checked as a name, and never matched)."""
    if _is_address(host):
        return host.replace("%25", "%").split("%", 1)[0]
    return host.rstrip(".")


class _Connection:
    """One socket, its (optional) TLS layer and its h11 state machine."""

    __slots__ = ("broken", "drained", "end_due", "h11", "idle_since", "key", "read_size", "socket",
                 "stream")

    def __init__(self, key: _Key, stream: trio.abc.Stream, socket: trio.socket.SocketType) -> None:
        self.key = key
        self.stream = stream
        self.socket = socket
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.read_size = _BODY_READ  # per response: see _STREAM_READ
        self.drained = False  # the last read emptied the socket (see receive)
        #: Why the request could not all be written (the server may have answered early
        #: and closed): its answer is read all the same, the connection never reused.
        self.broken: BaseException | None = None
        #: Idle with its last answer's end still to come: the bytes it must read first
        #: (see LeanTransport._park_unended).
        self.end_due: bytes | None = None

    def close(self) -> None:
        """Close the socket now, without I/O (no TLS close_notify): the server sees
        EOF at once, and nothing here can block or be cancelled."""
        self.socket.close()

    async def send(self, data: bytes, limit_s: float | None) -> None:
        # Most requests leave in one write, without trio's scheduler pass; a request
        # cancelled before this point is never written (see polygate._sockets).
        rest = await write_first(self.stream, data)
        if not rest:
            return
        send = (self._send_soft if len(rest) > _SOFT_TLS_SEND
                and type(self.stream) is not trio.SocketStream else self.stream.send_all)
        if limit_s is None:
            await send(rest)
            return
        with trio.move_on_after(limit_s):
            await send(rest)
            return
        raise httpx.WriteTimeout("timed out sending the request")

    async def _send_soft(self, data: bytes | memoryview) -> None:
        """Write a large request over TLS a piece at a time; a write the server cut
        short ends the writing, its stream still readable (see _SoftSend)."""
        stream = cast("trio.SSLStream[_SoftSend]", self.stream)
        wire = stream.transport_stream
        view = memoryview(data)
        wire.soft = True
        try:
            for start in range(0, len(view), _TLS_SEND_PIECE):
                await stream.send_all(view[start:start + _TLS_SEND_PIECE])
                if wire.failed is not None:
                    break
        finally:
            wire.soft = False
        if wire.failed is not None:
            raise trio.BrokenResourceError("the server closed before the request was all written") \
                from wire.failed

    def readable_after_failed_write(self) -> bool:
        """Whether the answer to a request whose write failed can still be read: a
        plain socket, or a TLS stream whose large request's write ended softly."""
        stream = self.stream
        if type(stream) is trio.SocketStream:
            return True
        wire = getattr(stream, "transport_stream", None)
        return type(wire) is _SoftSend and wire.failed is not None

    async def receive(self, limit_s: float | None) -> bytes:
        """The next bytes (``b""`` at the end).  After a read that emptied the socket
        (it brought less than it asked for), the next one waits before it tries (see
        polygate._sockets): a stream's next token, the rest of a body, is rarely
        there yet, and trio's try-first read would fail first, every time."""
        size = self.read_size
        if limit_s is None:
            data = await self._read(size)
        else:
            with trio.move_on_after(limit_s) as clock:  # (a bad limit raises before a read)
                data = await self._read(size)
            if clock.cancelled_caught:
                raise httpx.ReadTimeout("timed out reading the response")
        self.drained = len(data) < size
        return data

    def _read(self, size: int) -> Awaitable[bytes]:
        if self.drained:
            return receive_when_readable(self.stream, size)
        # h11 takes bytes-like; SSLStream's bytearray is fine (typeshed says bytes).
        return cast("Awaitable[bytes]", self.stream.receive_some(size))

    async def receive_answer(self, limit_s: float | None) -> bytes:
        """The first read after the request went out: its answer cannot be here
        yet, so this waits before it reads."""
        self.drained = True
        return await self.receive(limit_s)


class _Waiter:
    """A request queued for a connection: it is granted either a kept-alive
    connection of its origin (``conn``) or a slot to open one (``conn is None``)."""

    __slots__ = ("conn", "event", "granted", "key", "refused")

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.event = trio.Event()
        self.granted = False
        self.refused = False  # woken by aclose(): granted nothing
        self.conn: _Connection | None = None

    def grant(self, conn: _Connection | None) -> None:
        self.conn = conn
        self.granted = True
        self.event.set()

    def refuse(self) -> None:
        self.granted = self.refused = True
        self.event.set()


class LeanTransport(httpx.AsyncBaseTransport):
    """An HTTP/1.1 keep-alive connection pool for trio (see the module docstring).

    ``max_connections``: open connections at most, all origins together;
    ``max_idle_connections`` (default: ``max_connections``): kept-alive ones at
    most; ``keepalive_expiry``: seconds an idle connection is kept;
    ``ssl_context``: for ``https`` (default: ``ssl.create_default_context()``
    with ALPN ``http/1.1``, made on first use).
    """

    #: (:data:`REPORTS_SENT`) it calls a request's :data:`SENT_EXTENSION` itself
    polygate_reports_sent = True

    def __init__(
        self,
        *,
        max_connections: int = 1024,
        max_idle_connections: int | None = None,
        keepalive_expiry: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        if max_idle_connections is None:
            max_idle_connections = max_connections
        if max_idle_connections < 0:
            raise ValueError(f"max_idle_connections must be >= 0, got {max_idle_connections!r}")
        if not keepalive_expiry >= 0:
            raise ValueError(f"keepalive_expiry must be >= 0, got {keepalive_expiry!r}")
        self._max = max_connections
        self._max_idle = max_idle_connections
        self._expiry = keepalive_expiry
        self._ssl_context = ssl_context
        self._idle: dict[_Key, list[_Connection]] = {}
        self._idle_count = 0
        self._open = 0  # slots taken: connections open or being opened
        self._conns: set[_Connection] = set()
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._closed = False
        self._opened = 0
        self._reused = 0
        self._retried = 0
        self._lines = _Lines()
        self._warned_at = -math.inf  # (running out of descriptors: see _open_shedding)
        #: Per host name, in the trio run that looked them up (see _lookup).
        self._lookups: dict[str, _Lookup] = {}
        self._lookups_run: trio.lowlevel.TrioToken | None = None

    @classmethod
    def from_limits(cls, limits: httpx.Limits, **kwargs: Any) -> LeanTransport:
        """The pool that ``httpx.AsyncHTTPTransport(limits=limits)`` would be
        (``None`` in httpx's limits means no limit, no expiry)."""
        return cls(
            max_connections=limits.max_connections or sys.maxsize,
            max_idle_connections=limits.max_keepalive_connections,
            keepalive_expiry=math.inf if limits.keepalive_expiry is None else limits.keepalive_expiry,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"<LeanTransport open={self._open} idle={self._idle_count} max={self._max}>"

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            open=self._open,
            idle=self._idle_count,
            waiting=len(self._waiters),
            opened=self._opened,
            reused=self._reused,
            retried=self._retried,
        )

    # ------------------------------------------------------------------ requests

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("this LeanTransport is closed")
        url = request.url
        scheme = url.scheme
        port = url.port or _DEFAULT_PORTS.get(scheme)
        if port is None:
            raise httpx.UnsupportedProtocol(
                f"LeanTransport speaks http and https, not {scheme!r}", request=request
            )
        key = (scheme, url.raw_host.decode("ascii"), port)
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = await request.aread()  # a streamed body: read once, replayable after
        timeouts = _timeouts(request.extensions)
        on_sent = request.extensions.get(SENT_EXTENSION)
        wire = _encode(request.method, url.raw_path, request.headers.raw, body)
        if wire is None:  # h11 validates and frames it (or says why it cannot)
            refusal = None
            try:
                head = h11.Request(
                    method=request.method, target=url.raw_path, headers=request.headers.raw
                )
            except h11.LocalProtocolError as exc:  # a header with CR/LF, no Host, ...
                refusal = _refusal(exc, request.headers.raw)
            if refusal is not None:
                # Raised outside the handler: h11's error quotes the value (a key,
                # perhaps), so it must not ride along as __context__.
                raise httpx.LocalProtocolError(refusal, request=request)
        return await self._round_trip(
            key, request.method, wire, head if wire is None else None, body, timeouts, on_sent,
            request,
        )

    async def post(
        self, url: httpx.URL, headers: list[tuple[str, str]], body: bytes,
        on_sent: Callable[[], object] | None = None,
    ) -> httpx.Response | None:
        """What ``handle_async_request(httpx.Request("POST", url, headers=headers,
        content=body))`` does, without building the ``httpx.Request`` (~25 µs a call:
        its headers normalised, its URL and framing prepared, all to be undone here).
        The request's bytes are exactly those (tests/test_pool.py holds them
        together).  ``None``, with nothing sent, for a request that is not plain (a
        header that is not ASCII, or one h11 must write or refuse): the caller builds
        the ``httpx.Request`` and calls ``handle_async_request``.  The response's
        errors carry no request."""
        if self._closed:
            raise RuntimeError("this LeanTransport is closed")
        lines = self._lines
        # A source posts to the same URL object every call: what is read from it is
        # kept (httpx works out each of these properties anew, ~0.6 µs together).
        known = lines.urls.get(id(url))
        if known is None or known[0] is not url:
            scheme = url.scheme
            port = url.port or _DEFAULT_PORTS.get(scheme)
            known = (url, None if port is None else (scheme, url.raw_host.decode("ascii"), port),
                     (url.raw_path, url.netloc))
            if len(lines.urls) < lines.limit:
                lines.urls[id(url)] = known  # (holding the URL: its id is not reused)
        _, key, place = known
        wire = _post_wire(url, headers, body, lines, place)
        if key is None or wire is None:
            return None
        return await self._round_trip(key, "POST", wire, None, body, _NO_TIMEOUTS, on_sent, None)

    async def _round_trip(
        self, key: _Key, method: str, wire: bytes | None, head: h11.Request | None,
        body: bytes, timeouts: tuple[float | None, ...], on_sent: Callable[[], object] | None,
        request: httpx.Request | None,
    ) -> httpx.Response:
        """Send the request (``wire``, or h11's ``head`` and ``body``) and read the
        response's head; its body is the response's stream."""
        for attempt in (1, 2):
            # The one resend after a kept-alive connection that turned out closed goes on
            # a new connection: the other idle ones may well be closed too.
            conn, reused = await self._acquire(key, request, timeouts, fresh=attempt == 2)
            h = conn.h11
            got_bytes = False
            written = False  # the whole request went out: the server may have acted on it
            error_class: type[httpx.TransportError] = httpx.WriteError
            try:
                if wire is not None:
                    data = wire
                else:
                    assert head is not None
                    data = h.send(head) or b""
                    if body:
                        data += h.send(h11.Data(data=body)) or b""
                    data += h.send(_END) or b""
                if on_sent is not None:
                    on_sent()
                try:
                    await conn.send(data, timeouts[3])
                    written = True
                except (trio.BrokenResourceError, OSError) as exc:
                    if not conn.readable_after_failed_write():
                        raise  # (TLS: a stream broken by a failed send reads nothing more)
                    # A server may answer before it has read the whole request, then
                    # close (a 413 for a large body, a 401): its answer is what it said,
                    # read as httpx's transport reads it.  Nothing there: the error is
                    # the write's (see _answer_after; on a reused connection, the
                    # stale retry below).
                    conn.broken = exc
                error_class = httpx.ReadError if conn.broken is None else httpx.WriteError
                rest = b""  # received past the head h11 was given
                if wire is not None:
                    # The common answer, whole head in the first read, is read without
                    # h11 (see _head); h11 then sees nothing of this exchange.
                    data = await (conn.receive_answer(timeouts[2]) if conn.broken is None
                                  else _answer_after(conn, timeouts[2]))
                    if not data:
                        raise _Disconnected("server disconnected without sending a response")
                    got_bytes = True
                    end = data.find(b"\r\n\r\n") + 4
                    fast = parse_head(data[:end], method) if end > 3 else None
                    if fast is not None:
                        conn.read_size = _STREAM_READ if fast.event_stream else _BODY_READ
                        return httpx.Response(
                            fast.status,
                            headers=fast.headers,
                            stream=_Body(
                                self, conn, method, request, timeouts[2],
                                ChunkedDecoder() if fast.chunked else None, data[end:],
                                fast=fast,
                            ),
                            extensions=_extensions(fast, request),
                        )
                    # Anything else is h11's, from the first byte: it learns of the
                    # request (written here, byte for byte as it would) first.
                    h.send(_stand_in(method))
                    h.send(_END)
                    rest = data
                interim = 0
                # h11 is given the bytes up to the end of a head, no further: a
                # chunked body that follows is decoded here (see _chunked).
                tail = b""  # the end of what h11 was given, for a blank line cut by a read
                # The head's bytes given to h11: its own limit counts only a head still
                # incomplete, so one whole in a read (up to 64 KiB) passed it.
                fed = 0
                while True:
                    event = h.next_event()
                    if event is h11.NEED_DATA:
                        if rest:
                            data, rest = rest, b""
                        else:
                            data = await (conn.receive(timeouts[2]) if conn.broken is None
                                          else _answer_after(conn, timeouts[2], first=not got_bytes))
                            if not data:
                                if not got_bytes:
                                    raise _Disconnected(
                                        "server disconnected without sending a response"
                                    )
                                h.receive_data(b"")
                                continue
                            got_bytes = True
                        window = tail + data
                        blank = _BLANK_LINE.search(window)
                        cut = len(data) if blank is None else blank.end() - len(tail)
                        fed += cut
                        if fed > MAX_HEAD:
                            raise h11.RemoteProtocolError(
                                f"response head over {MAX_HEAD // 1024} KiB (the cap on one)")
                        if blank is None:
                            h.receive_data(data)
                            tail = window[-2:]
                        else:
                            h.receive_data(data[:cut])
                            rest = data[cut:]
                            tail = b""
                    elif isinstance(event, h11.Response):
                        response = event
                        break
                    else:  # an InformationalResponse (1xx): the real one follows
                        fed = 0
                        interim += 1
                        if interim > MAX_INTERIM_RESPONSES:
                            raise h11.RemoteProtocolError(
                                f"more than {MAX_INTERIM_RESPONSES} interim (1xx) responses "
                                "(the cap on them)"
                            )
                conn.read_size = _read_size(response)
                chunked = None
                if _is_chunked(method, response):
                    chunked = ChunkedDecoder()
                elif rest:
                    h.receive_data(rest)
                    rest = b""
            except BaseException as exc:
                self._discard(conn)
                if (
                    attempt == 1
                    and reused
                    and not written
                    and not got_bytes
                    and isinstance(exc, (_Disconnected, *_STALE_ERRORS))
                ):
                    self._retried += 1
                    continue
                mapped = _mapped(exc, request, error_class)
                if mapped is exc:
                    raise
                raise mapped from exc
            return httpx.Response(
                response.status_code,
                headers=response.headers.raw_items(),
                stream=_Body(self, conn, method, request, timeouts[2], chunked, rest),
                extensions={
                    "http_version": b"HTTP/" + response.http_version,
                    "reason_phrase": response.reason,
                },
            )
        raise AssertionError("unreachable: the second attempt returns or raises")

    # ------------------------------------------------------------------ the pool

    async def _acquire(
        self, key: _Key, request: httpx.Request | None, timeouts: tuple[float | None, ...],
        *, fresh: bool = False,
    ) -> tuple[_Connection, bool]:
        """A connection for ``key`` and whether it was kept alive (reused); ``fresh``:
        not an idle one (when no other caller waits for one)."""
        if not self._waiters:  # nobody queued ahead of us: no need to wait our turn
            conn = None if fresh else self._pop_idle(key)
            if conn is not None:
                self._reused += 1
                return conn, True
            if self._open >= self._max and self._idle_count:
                self._evict_idle()
            if self._open < self._max:
                self._open += 1
                return await self._connect(key, request, timeouts[1]), False
        waiter = _Waiter(key)
        self._waiters.append(waiter)
        try:
            if timeouts[0] is None:
                await waiter.event.wait()
            else:
                with trio.move_on_after(timeouts[0]):
                    await waiter.event.wait()
                if not waiter.granted:
                    raise httpx.PoolTimeout("timed out waiting for a connection", request=request)
        except BaseException:
            if not waiter.granted:
                self._waiters.remove(waiter)
            elif waiter.refused:
                pass  # woken by aclose(): it holds no slot
            elif waiter.conn is not None:
                self._put_back(waiter.conn)  # granted just as we were cancelled: pass it on
            else:
                self._free_slot()
            raise
        if self._closed:
            if waiter.refused:
                pass  # aclose() woke it without a slot
            elif waiter.conn is not None:
                self._discard(waiter.conn)
            else:
                self._free_slot()
            raise RuntimeError("this LeanTransport was closed while a request waited")
        if waiter.conn is not None:
            self._reused += 1
            return waiter.conn, True
        return await self._connect(key, request, timeouts[1]), False

    def _pop_idle(self, key: _Key) -> _Connection | None:
        """The most recently used idle connection of ``key`` that is still usable;
        expired ones and ones the server closed are dropped on the way.  One whose
        last answer's end is still on its way (see :meth:`_park_unended`) is passed
        over and left idle: it may serve the next call (two connections take turns
        in a run of back-to-back calls, where each call found its predecessor's end
        not yet come)."""
        stack = self._idle.get(key)
        if not stack:
            return None
        now = trio.current_time()
        found = None
        passed: list[_Connection] = []
        while stack:
            conn = stack.pop()
            self._idle_count -= 1
            state = self._state(conn, now)
            if state is _USABLE:
                found = conn
                break
            if state is _NOT_YET:
                passed.append(conn)
            else:
                self._drop(conn)
        if passed:
            stack += reversed(passed)
            self._idle_count += len(passed)
        return found

    def _state(self, conn: _Connection, now: float) -> object:
        """Whether an idle connection can take a request: ``_USABLE``; ``_NOT_YET``
        (parked, its last answer's end not all here yet); or ``_GONE``: expired,
        readable while idle (EOF, a reset or junk: the server is done with it), or
        parked and its end not what it should be, or not come within
        :data:`_END_WAIT_S`.  An end read whole makes it an idle connection like
        any other."""
        if now - conn.idle_since >= self._expiry:
            return _GONE
        due = conn.end_due
        if due is not None:
            got = read_now(conn.stream, len(due))
            if got is None:  # nothing yet (or an error, which leaves it readable)
                if conn.socket.is_readable() or now - conn.idle_since >= _END_WAIT_S:
                    return _GONE
                return _NOT_YET
            if not got or not due.startswith(got):
                return _GONE
            if got != due:
                conn.end_due = due[len(got):]
                return _NOT_YET
            conn.end_due = None
        return _GONE if conn.socket.is_readable() else _USABLE

    def _park_unended(self, conn: _Connection, due: bytes, keep_alive: bool) -> None:
        """A streamed answer read to its ``[DONE]`` whose chunked end (``due``) has not
        come yet: idle all the same, when nobody waits for a connection, and that end
        is read before the connection is used again (:meth:`_state`).  Servers write
        it on its own (uvicorn, and so vLLM, SGLang and LiteLLM; hypercorn, aiohttp,
        Go), a moment after the last event: dropped, the connection cost the next
        call a connect (and a TLS handshake).  A TLS connection's end cannot be read
        without its layer: closed, as before.  A waiter would send its request before
        the end is read: it gets the slot instead."""
        if (not keep_alive or conn.broken is not None or self._closed or self._waiters
                or not reads_now(conn.stream)
                or sum(c.end_due is not None for c in self._idle.get(conn.key, ())) >= _PARKED_MAX):
            self._discard(conn)
            return
        conn.end_due = due
        self._put_back(conn)

    def close_idle(self) -> int:
        """Close every idle connection that expired or that its server closed (readable
        while idle: EOF, a reset, junk); how many.  A request looks only at the
        connection it picks, the warmest: the others, after a burst, would otherwise
        stay open until traffic or the close came (in ``CLOSE_WAIT`` when the server
        had hung up).  ``polygate.session()`` calls it on a timer for its own pool."""
        now = trio.current_time()
        closed = 0
        for key in list(self._idle):
            stack = self._idle[key]
            kept = []
            for conn in stack:
                if self._state(conn, now) is not _GONE:
                    kept.append(conn)
                else:
                    self._idle_count -= 1
                    self._drop(conn)
                    closed += 1
            if kept:
                stack[:] = kept
            else:
                del self._idle[key]
        return closed

    def _evict_idle(self) -> None:
        """Close the oldest idle connection of some origin (we are at the cap)."""
        for key, stack in self._idle.items():
            if stack:
                self._idle_count -= 1
                self._drop(stack.pop(0))
                if not stack:
                    del self._idle[key]
                return

    def _put_back(self, conn: _Connection) -> None:
        """A connection whose exchange ended cleanly: to the first waiter, or idle."""
        if self._closed:
            self._discard(conn)
            return
        if self._waiters:
            waiter = self._waiters.popleft()
            if waiter.key == conn.key:
                waiter.grant(conn)
                return
            conn.close()  # the waiter wants another origin: it gets the slot
            self._conns.discard(conn)
            waiter.grant(None)
            return
        key = conn.key
        stack = self._idle.get(key)
        if stack is None:
            stack = self._idle[key] = []
        now = trio.current_time()
        conn.idle_since = now
        stack.append(conn)
        self._idle_count += 1
        # The bottom of a LIFO stack may sit unused: close what expired there.
        while stack and (now - stack[0].idle_since >= self._expiry or self._idle_count > self._max_idle):
            self._idle_count -= 1
            self._drop(stack.pop(0))

    def _drop(self, conn: _Connection) -> None:
        """Close a connection that no request holds (idle): its slot is freed."""
        conn.close()
        self._conns.discard(conn)
        self._open -= 1

    def _discard(self, conn: _Connection) -> None:
        """Close a connection a request held; its slot goes to the first waiter."""
        conn.close()
        self._conns.discard(conn)
        self._free_slot()

    def _free_slot(self) -> None:
        if self._waiters:
            self._waiters.popleft().grant(None)
        else:
            self._open -= 1

    def _release_fast(self, conn: _Connection, stray: bool, keep_alive: bool) -> None:
        """A response read to its end, and h11's state already the fresh one the next
        exchange needs (a fast body never touched it; :meth:`_release` resets it):
        kept alive if both sides allow it.  Bytes past the end of the response (a 204
        with a body, more than its Content-Length, a stray response) would answer the
        next request: they were dropped, and if more are still arriving the connection
        is closed (one that receives any later, while idle, is dropped when next
        picked: _pop_idle's probe)."""
        if not keep_alive or conn.broken or (stray and conn.socket.is_readable()):
            # (Stray bytes that come later still are the next request's failure, an
            # illegal status line, and no error quotes them: see _mapped.)
            self._discard(conn)
            return
        self._put_back(conn)  # (which closes it instead if the pool has closed)

    def _release(self, conn: _Connection) -> None:
        """The response was read to its end by h11: keep the connection alive if both
        sides allow it (no ``Connection: close``, no HTTP/1.0 close-delimited body)."""
        h = conn.h11
        if self._closed or conn.broken or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
            self._discard(conn)
            return
        stray, eof = h.trailing_data
        if eof:
            self._discard(conn)
            return
        if stray:
            conn.h11 = h11.Connection(h11.CLIENT)  # the stray bytes go with the old one
        else:
            h.start_next_cycle()
        self._release_fast(conn, bool(stray), keep_alive=True)

    async def _connect(
        self, key: _Key, request: httpx.Request | None, limit_s: float | None
    ) -> _Connection:
        """Open a connection in a slot already counted; the slot is freed on failure."""
        conn: _Connection | None = None
        try:
            if limit_s is None:
                conn = await self._open_shedding(key)
            else:
                with trio.move_on_after(limit_s):
                    conn = await self._open_shedding(key)
                if conn is None:
                    raise httpx.ConnectTimeout("timed out connecting", request=request)
        except BaseException as exc:
            self._free_slot()
            mapped = _mapped(exc, request, httpx.ConnectError)
            if mapped is exc:
                raise
            raise mapped from exc
        self._opened += 1
        if self._closed:  # closed while we were connecting
            self._discard(conn)
            raise RuntimeError("this LeanTransport was closed while a request connected")
        self._conns.add(conn)
        return conn

    async def _open_shedding(self, key: _Key) -> _Connection:
        """:meth:`_open_connection`; when the process is out of descriptors (or socket
        buffers) and this pool holds idle connections, they are what it can give
        back: it closes them and tries once more.  (Kept 30 s after a burst to other
        origins, they would otherwise make every new connection fail while they
        last.)  (``encodings.idna`` is imported with this module: a connect's host
        encoding imports it on first use, and out of descriptors that import failed,
        naming a file of the standard library.)"""
        try:
            return await self._open_connection(key)
        except OSError as exc:
            found = out_of(exc)
            if found is None:
                raise
            now = trio.current_time()
            if now - self._warned_at >= _WARN_EVERY_S:  # (not once a connect, at a flood)
                self._warned_at = now
                log.warning("out of %s (%s) opening a connection to %s:%s%s", *found, *key[1:],
                            f"; closing {self._idle_count} idle connection(s) and trying again"
                            if self._idle_count else "")
            if not self._idle_count:
                raise
        for stack in self._idle.values():
            for conn in stack:
                self._drop(conn)
        self._idle.clear()
        self._idle_count = 0
        return await self._open_connection(key)

    async def _open_connection(self, key: _Key) -> _Connection:
        """A connection to ``key``.  Two failures that a process out of descriptors
        meets without saying so are checked against the process itself
        (:func:`out_of_now`), and raised from what that finds: the resolver's
        (glibc's, unable to open ``/etc/hosts`` or a DNS socket, answers "Name or
        service not known") and a TLS certificate verification.  No other is, so a
        refused or reset connect is never taken for this process's."""
        scheme, host, port = key
        try:
            targets = await self._lookup(host, port)
            if targets is None:
                tcp = await trio.open_tcp_stream(_connectable(host), port)  # sets TCP_NODELAY
            else:
                tcp = await connect(host, port, targets)  # (trio's race, without its lookup)
        except socket.gaierror as exc:
            hidden = out_of_now()
            if hidden is not None:
                raise hidden from exc
            # The resolver's words name no name ("Name or service not known"), where a
            # refused connect names its address: which of a scope's hosts it was.
            raise socket.gaierror(exc.errno, f"{exc.strerror or exc} (looking up {host!r})") from exc
        if scheme != "https":
            return _Connection(key, tcp, tcp.socket)
        try:
            tls = trio.SSLStream(_SoftSend(tcp), self._tls(), server_hostname=_tls_name(host),
                                 https_compatible=True)
            await tls.do_handshake()
        except BaseException as exc:
            # A verification that failed may be a process out of descriptors: CAs in a
            # hashed directory are read at each handshake, and a failed read says
            # nothing.  Asked before the socket is closed, which frees one.
            cause = exc.__cause__
            verify = isinstance(cause, ssl.SSLError) and (  # (3.10: a plain SSLError says it)
                isinstance(cause, ssl.SSLCertVerificationError)
                or cause.reason == "CERTIFICATE_VERIFY_FAILED")
            hidden = out_of_now() if verify else None
            tcp.socket.close()
            if hidden is not None:
                raise hidden from exc
            raise
        return _Connection(key, tls, tcp.socket)

    async def _lookup(self, host: str, port: int) -> Sequence[Target] | None:
        """``host``'s addresses, looked up one lookup at a time per name, unless one
        answered in the last few seconds; None where trio's connect needs no thread to
        find them (an address, or the application's own resolver: its rules).

        trio's own connect looks names up in worker threads under its process-wide
        limit (40), abandoning a cancelled lookup whose thread keeps its slot until
        the resolver answers: a source whose DNS hangs, asked again and again
        (retries, hedges, calls), took every slot, and every other name -- and every
        thread polygate runs -- waited behind it.  Now such a name holds one thread
        of its own, its calls waiting on it (within their own bounds).  And the
        application's threads share that limit: 40 of them waiting on polygate's calls
        (``trio.from_thread.run``) held every slot, and the lookup their calls needed
        never ran.  So the connect goes to the addresses found here (``_eyeballs``)."""
        if _is_address(host) or _custom_resolver():
            return None
        token = trio.lowlevel.current_trio_token()
        if self._lookups_run is not token:
            # A transport used by another trio run: a lookup that run abandoned would
            # hold its name's limiter for good (its release goes to the finished run),
            # and its clock is not this one's.
            self._lookups, self._lookups_run = {}, token
        entry = self._lookups.get(host)
        if entry is None:
            if len(self._lookups) >= _LOOKUPS_KEPT:
                self._forget_lookups()
            entry = self._lookups[host] = _Lookup()
        seen = entry.lookups
        async with entry.turn:
            if entry.lookups != seen:
                # A lookup ended while this caller waited its turn: its outcome is this
                # caller's too (a name that fails fails for all at once, rather than
                # once a lookup each, in turn, past their timeouts).  Counted, not
                # timed: under a clock that stands still, "while it waited" is not
                # "at the same instant".
                if entry.failed is not None:
                    raise type(entry.failed)(*entry.failed.args)
                return entry.addresses
            if entry.failed is None and trio.current_time() - entry.ended_at < _LOOKUP_FRESH_S:
                return entry.addresses  # (a burst of connections: one lookup)
            # The thread's token is the name's own, held until the resolver answers,
            # however the caller that started it was cut: the next caller waits for it
            # (cancellably) rather than start another thread.
            try:
                # (A MockClock held still while it runs, for a while: virtual time
                # would jump to the call's deadline while the resolver answers in real
                # time.  Not for ever: a resolver that never answers must not hold the
                # deadline back.)
                with patient_clock(_LOOKUP_HOLD_S):
                    found = await trio.to_thread.run_sync(
                        socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM,
                        limiter=entry.thread, abandon_on_cancel=True,
                    )
            except OSError as exc:  # (getaddrinfo's EAI_SYSTEM is a plain OSError)
                if out_of_now() is None:
                    # (A failure that hid this process out of descriptors is not the
                    # name's: those waiting look it up again, once the caller here has
                    # closed idle connections, rather than be told it is unknown.)
                    entry.failed, entry.ended_at = exc, trio.current_time()
                    entry.lookups += 1
                raise
            except UnicodeError as exc:
                # (A label IDNA refuses, over 63 characters: what trio's own connect
                # raises too, bare.  The settings refuse such a source's URL.)
                raise socket.gaierror(socket.EAI_NONAME, f"not a name that can be looked up ({exc})") from None
            entry.failed, entry.ended_at, entry.addresses = None, trio.current_time(), found
            entry.lookups += 1
            return found

    def _forget_lookups(self) -> None:
        """Forget the names no caller is at and no lookup thread holds (a transport
        used for many names): one looked up again soon costs a lookup, no more."""
        for name, entry in list(self._lookups.items()):
            if not entry.turn.locked() and not entry.thread.borrowed_tokens:
                del self._lookups[name]

    def tls_context(self) -> ssl.SSLContext:
        """The TLS settings this pool connects with (another transport may share them:
        an egress proxy's, see _proxies)."""
        return self._tls()

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            context = ssl.create_default_context()
            context.set_alpn_protocols(["http/1.1"])
            if ssl.get_default_verify_paths().cafile and not context.cert_store_stats()["x509_ca"]:
                # A CA file, and nothing read from it: out of descriptors as the context
                # was built, which says nothing.  Kept, it would fail every verification
                # for the transport's life: not kept, and the exhaustion said when it
                # still holds.  (A system with CAs in a hashed directory only reads them
                # at each handshake: nothing is loaded, and there is no file.)
                exhausted = out_of_now()
                if exhausted is not None:
                    raise exhausted
                return context
            self._ssl_context = context
        return self._ssl_context

    async def aclose(self) -> None:
        """Close every connection, idle or busy (a busy one's reader gets a
        ``ReadError``); requests still queued are refused."""
        self._closed = True
        self._lines.clear()
        for conn in self._conns:
            conn.close()
        self._conns.clear()
        self._idle.clear()
        self._open -= self._idle_count  # busy ones free their slots as they fail
        self._idle_count = 0
        # Queued requests are refused, not granted a slot: they never held one, so
        # they must not free one (``open`` would go negative).
        while self._waiters:
            self._waiters.popleft().refuse()
        await trio.lowlevel.checkpoint()


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection as the caller iterates.

    ``__aiter__`` returns the stream itself and ``__anext__`` is a plain coroutine,
    not an async generator, so a caller that stops early leaves nothing for the
    garbage collector to finalise.  The connection goes back to the pool the moment
    the end of the body is parsed; ``aclose()`` before that closes it.

    A chunked body is decoded here (``_chunked``) until its last chunk.  After a head
    h11 read, the last chunk's bytes and whatever follows go to h11, and every other
    body is h11's.  After a head read without h11 (``fast``, see :mod:`._head`), a
    Content-Length body is counted here, and a chunked one ends here when its last
    chunk is the plain ``0\r\n\r\n``; anything else (trailers, bytes after it) is
    replayed to h11 behind a stand-in head of the same framing, and h11 decides.
    Each read's data comes out as one piece.
    """

    __slots__ = ("_answered", "_chunked", "_conn", "_fast", "_keep_alive", "_left", "_method",
                 "_pending", "_pool", "_request", "_size", "_timeout")

    def __init__(
        self,
        pool: LeanTransport,
        conn: _Connection,
        method: str,
        request: httpx.Request | None,
        timeout: float | None,
        chunked: ChunkedDecoder | None = None,
        pending: bytes = b"",
        *,
        fast: Head | None = None,
    ) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        #: The answer it carries is complete (see answered_on_close).
        self._answered = False
        self._method = method
        self._request = request
        self._timeout = timeout
        self._chunked = chunked
        # Body bytes that came with the head (h11's own, unless chunked or fast); in a
        # fast body, also what came past its end once the end is here.
        self._pending = pending
        # h11 has seen nothing of this exchange: the end is found here.
        self._fast = fast is not None
        self._keep_alive = fast is None or fast.keep_alive
        # A fast body's bytes still to come: its Content-Length, counted down; -1
        # while a chunked one has not ended (0 once it has).
        self._size = self._left = -1 if fast is None or fast.chunked else fast.length

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        h = conn.h11
        try:
            chunked = self._chunked
            while chunked is not None:
                data = await self._more(conn, " (incomplete chunked read)")
                piece, last = chunked.decode(data)
                if last is not None:
                    self._chunked = chunked = None
                    self._last_chunk(conn, last)
                if piece:
                    return piece
            if self._fast:
                piece = await self._sized(conn)
                if piece:
                    return piece
            else:
                while True:
                    event = h.next_event()
                    if event is h11.NEED_DATA:
                        h.receive_data(await conn.receive(self._timeout))  # b"" at EOF
                    elif type(event) is h11.Data:
                        return bytes(event.data)
                    elif type(event) is h11.EndOfMessage:
                        break
                    else:
                        raise h11.RemoteProtocolError(
                            f"unexpected {type(event).__name__} in a body")
        except BaseException as exc:
            self._conn = None
            self._pool._discard(conn)
            mapped = _mapped(exc, self._request, httpx.ReadError)
            if mapped is exc:
                raise
            raise mapped from exc
        self._conn = None
        self._ended(conn)
        raise StopAsyncIteration

    async def _sized(self, conn: _Connection) -> bytes:
        """A fast body's next piece; ``b""`` at its end (what came past it stays in
        ``_pending``)."""
        left = self._left
        if not left:
            return b""
        data = await self._more(conn, f": received {self._size - left} bytes, expected {self._size}")
        if len(data) > left:
            self._pending = data[left:]
            data = data[:left]
        self._left = left - len(data)
        return data

    async def _more(self, conn: _Connection, missing: str) -> bytes:
        """The body bytes already here, else the next read; the end of the stream
        before the body's end is an error (h11's words, then what is ``missing``)."""
        data = self._pending
        if data:
            self._pending = b""
            return data
        data = await conn.receive(self._timeout)
        if not data:
            raise h11.RemoteProtocolError(
                f"peer closed connection without sending complete message body{missing}")
        return data

    def _last_chunk(self, conn: _Connection, last: bytes) -> None:
        """The bytes from a chunked body's last-chunk line on: its end, here, when
        fast and plain; else h11's (a fast body's replayed behind a stand-in head)."""
        if self._fast:
            if last == PLAIN_END:
                self._left = 0
                return
            self._fast = False
            h = conn.h11
            h.send(_stand_in(self._method))
            h.send(_END)
            h.receive_data(_CHUNKED_HEAD if self._keep_alive else _CHUNKED_HEAD_CLOSE)
            event = h.next_event()
            assert type(event) is h11.Response, event
        conn.h11.receive_data(last)

    def _ended(self, conn: _Connection) -> None:
        if self._fast:
            self._pool._release_fast(conn, bool(self._pending), self._keep_alive)
        else:
            self._pool._release(conn)

    async def aclose(self) -> None:
        self.close_now()

    def close_now(self) -> None:
        """Release the connection if what is left of the body is already buffered
        (parsed without I/O), else close it: unread bytes would corrupt the next
        response.  No I/O and no await, so a cancellation cannot interrupt it."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        h = conn.h11
        try:
            if self._chunked is not None:
                _, last = self._chunked.decode(self._pending)
                self._pending = b""
                if last is None:
                    due = self._chunked.end_due() if self._fast and self._answered else None
                    if due is None:
                        self._pool._discard(conn)
                    else:  # (a fast body left h11's state fresh for the next exchange)
                        self._pool._park_unended(conn, due, self._keep_alive)
                    return
                self._chunked = None
                self._last_chunk(conn, last)
            if self._fast:
                if len(self._pending) >= self._left:  # the end is here
                    self._pool._release_fast(
                        conn, len(self._pending) > self._left, self._keep_alive)
                    return
            else:
                while True:
                    event = h.next_event()
                    if type(event) is h11.EndOfMessage:
                        self._pool._release(conn)
                        return
                    if type(event) is not h11.Data:
                        break
        except h11.RemoteProtocolError:
            pass
        self._pool._discard(conn)


#: What an idle connection is (LeanTransport._state).
_USABLE: Final = object()
_NOT_YET: Final = object()
_GONE: Final = object()
#: How long a connection parked before its answer's end came waits for that end.
_END_WAIT_S: Final = 1.0
#: The most connections of one origin parked so at once: two take turns in a run of
#: back-to-back calls, and each request looks at every one (a server that sends its
#: ends late had every acquire read hundreds of them).
_PARKED_MAX: Final = 2
#: What h11 is told a fast chunked answer's head was, to read its end (see _Body).
_CHUNKED_HEAD: Final = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
_CHUNKED_HEAD_CLOSE: Final = (
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")


def reports_sent(transport: object) -> bool:
    """Whether ``transport`` says itself when a request is written (:data:`REPORTS_SENT`)."""
    return getattr(transport, REPORTS_SENT, False) is True


def _extensions(fast: Head, request: httpx.Request | None) -> dict[str, Any]:
    """A lean response's extensions.  The head read is kept (see ``header_of``) only
    for :meth:`LeanTransport.post`'s (``request`` None): polygate's exchange reads
    those as they come.  One that leaves through ``handle_async_request`` may pass
    through a wrapper transport, or a subclass, that edits its headers on the way."""
    extensions: dict[str, Any] = {"http_version": b"HTTP/1.1", "reason_phrase": fast.reason}
    if request is None:
        extensions[HEAD_EXTENSION] = fast
    return extensions


def body_of(response: httpx.Response) -> _Body | None:
    """The body of a LeanTransport response not read yet, to iterate directly:
    httpx's ``aiter_raw`` adds an async generator and a chunker per piece.  The
    response counts as consumed from then on (``aclose`` still closes the body)."""
    stream = response.stream
    if type(stream) is not _Body or response.is_stream_consumed or response.is_closed:
        return None
    response.is_stream_consumed = True
    return stream


def is_lean(response: httpx.Response) -> bool:
    """Whether ``response`` is a LeanTransport response (its body one of ours)."""
    return type(response.stream) is _Body


def close_now(response: httpx.Response) -> bool:
    """Close a LeanTransport response here and now, without an await (see
    :meth:`_Body.close_now`); False, and nothing done, for another transport's."""
    stream = response.stream
    if type(stream) is not _Body:
        return False
    response.is_closed = True
    stream.close_now()
    return True


def answered_on_close(pieces: object) -> bool:
    """For a body whose answer is complete (its ``[DONE]`` read): whether closing
    ``pieces`` reads what is left of it as far as it is already here, as
    :func:`polygate.transport._exchange._drain_buffered` would.  A LeanTransport body
    does, without a cancel scope or a read, and is told here that its answer is
    complete: its close then keeps the connection when only the body's plain end is
    still to come (:meth:`LeanTransport._park_unended`), where a body closed
    mid-answer closes its connection (the upstream stops generating)."""
    if type(pieces) is not _Body:
        return False
    pieces._answered = True
    return True


def _read_size(response: h11.Response) -> int:
    for name, value in response.headers:
        if name == b"content-type":
            return _STREAM_READ if value.lower().startswith(b"text/event-stream") else _BODY_READ
    return _BODY_READ


def _is_chunked(method: str, response: h11.Response) -> bool:
    """Whether h11 frames this response's body as chunked (its ``_body_framing``):
    a response to HEAD, a 204 or 304 has no body, and h11 accepts no
    ``transfer-encoding`` but ``chunked``."""
    if method == "HEAD" or response.status_code in (204, 304):
        return False
    if method == "CONNECT" and 200 <= response.status_code < 300:
        return False
    return any(name == b"transfer-encoding" for name, _ in response.headers)


# ----------------------------------------------------------------------- the request
#
# h11 drives every connection's state machine and parses every response.  The
# request itself, in the common case, is written here: httpx has just built its
# headers, and h11's re-validation and re-encoding of them cost more than the rest
# of this module's work per request.  h11 is told that a request of that method went
# out through a stand-in event (cached, validated once) with no body, so its state --
# what the response to a HEAD looks like, when the exchange is over -- is exactly
# what the real request gives it.  Anything unusual goes through h11's own writer.

_TOKEN: Final = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
# No CR, LF, NUL or other CTL, and (as h11 requires) no blank at either end.
_FIELD_VALUE: Final = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")
_TARGET: Final = re.compile(rb"[\x21-\x7e\x80-\xff]+")
_CALL_ID_LINE: Final = CALL_ID_HEADER.encode() + b": "
#: Request headers that change framing or the connection's fate: h11 handles them.
_H11_ONLY: Final = frozenset({b"connection", b"transfer-encoding", b"upgrade", b"expect", b"te"})
_END: Final = h11.EndOfMessage()
#: The end of a response head, as h11 finds it (``h11._receivebuffer``).
_BLANK_LINE: Final = re.compile(rb"\n\r?\n", re.MULTILINE)
_STAND_INS: dict[str, h11.Request] = {}


def _encode(
    method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes | None:
    """The request's bytes, or ``None`` when h11 should write it: framing other than
    a Content-Length that matches the body, a header h11 must see, or anything that
    fails validation (h11 then raises the precise error)."""
    raw_method = method.encode("ascii", "replace")
    if not _TOKEN.fullmatch(raw_method) or not _TARGET.fullmatch(target):
        return None
    parts = [raw_method, b" ", target, b" HTTP/1.1\r\n"]
    hosts = 0
    length: bytes | None = None
    for name, value in headers:
        lower = name.lower()
        if lower in _H11_ONLY or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            return None
        if lower == b"host":
            hosts += 1
        elif lower == b"content-length":
            if length is not None:
                return None
            length = value
        parts += (name, b": ", value, b"\r\n")
    if hosts != 1 or (length if length is not None else b"0") != b"%d" % len(body):
        return None
    parts += (b"\r\n", body)
    return b"".join(parts)


class _Lines:
    """Checked pieces of plain POSTs (see :func:`_post_wire`), one set per transport
    (emptied when it closes: a line may hold a source's key): a (target, netloc) ->
    its request line and Host line; a header pair -> its line, or b"" where only
    :func:`_encode` may decide.  Bounded: a full set stops taking entries."""

    __slots__ = ("first", "headers", "urls")
    limit = 1024

    def __init__(self) -> None:
        self.first: dict[tuple[bytes, bytes], bytes] = {}
        self.headers: dict[tuple[str, str], bytes] = {}
        #: id(url) -> (url, its pool key or None, its (target, netloc)): see post.
        self.urls: dict[int, tuple[httpx.URL, _Key | None, tuple[bytes, bytes]]] = {}

    def clear(self) -> None:
        self.first.clear()
        self.headers.clear()
        self.urls.clear()


def _post_wire(
    url: httpx.URL, headers: list[tuple[str, str]], body: bytes, lines: _Lines,
    place: tuple[bytes, bytes] | None = None,
) -> bytes | None:
    """The bytes ``httpx.Request("POST", url, headers=headers, content=body)`` goes out
    as (see :meth:`LeanTransport.post`), or ``None`` where h11 or httpx must see it.

    A source sends the same headers with every call: each line is checked once and
    kept in ``lines`` (~10 µs a call to check them all again); anything unusual goes
    the whole way through :func:`_encode`, which decides exactly as before.  A call's
    own id (:data:`CALL_ID_HEADER`) changes with every call: checked, never kept.
    ``place``: the URL's ``(raw_path, netloc)``, when the caller has them."""
    if place is None:
        place = (url.raw_path, url.netloc)
    first = lines.first.get(place)
    if first is None:
        target, netloc = place
        if not _TARGET.fullmatch(target) or not _FIELD_VALUE.fullmatch(netloc):
            return _post_wire_checked(url, headers, body)
        first = b"POST %s HTTP/1.1\r\nHost: %s\r\n" % place
        if len(lines.first) < lines.limit:
            lines.first[place] = first
    parts = [first]
    kept = lines.headers
    for pair in headers:
        line = kept.get(pair)
        if line is None:
            name, value = pair
            if name == CALL_ID_HEADER:
                # New with every call, and nearly always letters, digits and "-" (ids
                # of polygate's format): a plain line, as _plain_line would write it,
                # without its two pattern matches (~6,000 instructions).
                if value.isascii() and value.replace("-", "").isalnum():
                    line = _CALL_ID_LINE + value.encode() + b"\r\n"
                else:
                    line = _plain_line(name, value)
            else:
                line = _plain_line(name, value)
                if len(kept) < lines.limit:
                    kept[pair] = line
        if not line:
            return _post_wire_checked(url, headers, body)
        parts.append(line)
    parts += (b"Content-Length: %d\r\n\r\n" % len(body), body)
    return b"".join(parts)


def _plain_line(name: str, value: str) -> bytes:
    """``name: value`` as a header line, or b"" for a header that is not plain: not
    ASCII, one h11 must write, a second Host or Content-Length, or invalid."""
    try:
        raw_name, raw_value = name.encode("ascii"), value.encode("ascii")
    except UnicodeEncodeError:
        return b""
    lower = raw_name.lower()
    if lower in _H11_ONLY or lower == b"host" or lower == b"content-length":
        return b""
    if not _TOKEN.fullmatch(raw_name) or not _FIELD_VALUE.fullmatch(raw_value):
        return b""
    return b"%s: %s\r\n" % (raw_name, raw_value)


def _post_wire_checked(
    url: httpx.URL, headers: list[tuple[str, str]], body: bytes,
) -> bytes | None:
    """:func:`_post_wire`, every piece checked by :func:`_encode`."""
    try:
        raw = [(name.encode("ascii"), value.encode("ascii")) for name, value in headers]
    except UnicodeEncodeError:
        return None  # httpx refuses it, with its own error
    # httpx's order: Host first, then the caller's, then the Content-Length.
    return _encode("POST", url.raw_path, [
        (b"Host", url.netloc), *raw, (b"Content-Length", b"%d" % len(body))], body)


def _stand_in(method: str) -> h11.Request:
    """A bodiless request of ``method`` for h11's state machine (see above)."""
    event = _STAND_INS.get(method)
    if event is None:
        event = h11.Request(method=method, target="/", headers=[("host", "-")])
        if len(_STAND_INS) < 16:  # methods are few; never let odd ones grow this
            _STAND_INS[method] = event
    return event


def _refusal(exc: h11.LocalProtocolError, headers: list[tuple[bytes, bytes]]) -> str:
    """h11's reason for refusing a request, without the value it quotes: a header
    value can be an API key (``Illegal header value b'Bearer …'``)."""
    for name, value in headers:
        if not _TOKEN.fullmatch(name):
            return "illegal header name (not a token)"
        if not _FIELD_VALUE.fullmatch(value):
            shown = name.decode("ascii", "replace").lower()
            return f"illegal value in header {shown!r} (a control character or an edge blank)"
    reason = str(exc).split("'", 1)[0].split('"', 1)[0].strip()
    return f"invalid request: {reason or type(exc).__name__}"


def _timeouts(extensions: Mapping[str, Any]) -> tuple[float | None, ...]:
    """(pool, connect, read, write) seconds from httpx's ``timeout`` extension; all
    ``None`` for polygate's own requests, whose deadlines are cancel scopes."""
    timeout = extensions.get("timeout")
    if not timeout:
        return _NO_TIMEOUTS
    return tuple(timeout.get(name) for name in ("pool", "connect", "read", "write"))


_NO_TIMEOUTS: Final[tuple[float | None, ...]] = (None, None, None, None)


async def _answer_after(conn: _Connection, limit_s: float | None, *, first: bool = True) -> bytes:
    """The next bytes of the answer to a request whose write failed (``conn.broken``):
    whatever the server said before it closed; if it said nothing (``first``: before
    any byte of it), the write's own error."""
    assert conn.broken is not None
    try:
        data = await conn.receive(limit_s)
    except (trio.BrokenResourceError, OSError):
        data = b""
    if not data and first:
        raise conn.broken
    return data


def _mapped(
    exc: BaseException, request: httpx.Request | None, network_error: type[httpx.TransportError]
) -> BaseException:
    """httpx's exception for what the socket, TLS or h11 raised (``network_error``
    for an I/O failure in the current phase); anything else -- cancellation,
    httpx's own errors, bugs -- is returned unchanged."""
    if isinstance(exc, httpx.HTTPError) or not isinstance(exc, Exception):
        return exc
    cls: type[httpx.TransportError]
    if isinstance(exc, (h11.RemoteProtocolError, _Disconnected)):
        cls = httpx.RemoteProtocolError
    elif isinstance(exc, h11.LocalProtocolError):
        raw = request.headers.raw if request is not None else []
        return httpx.LocalProtocolError(_refusal(exc, raw), request=request)
    elif isinstance(exc, _STALE_ERRORS):
        cls = network_error
    else:
        return exc
    message = str(exc) or str(exc.__cause__ or exc.__context__ or "") or type(exc).__name__
    if cls is httpx.RemoteProtocolError:
        message = unquoted(message)
    return cls(message, request=request)
