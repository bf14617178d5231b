"""HTTP/1.1 for the gateway: one keep-alive connection on h11 over a trio stream.

Everything a client can hold is bounded here: the wait for a request head
(``header_timeout_s`` for the whole head on a new connection; on a kept-alive one,
``idle_timeout_s`` before its first byte, then ``header_timeout_s`` from it), its size
(64 KiB: h11's ``max_incomplete_event_size`` while incomplete, and checked once
complete), the body's size (``max_request_bytes``, refused from ``Content-Length``
before a byte of it is read) and time (``body_timeout_s``), and every write to a
client that does not read (``send_timeout_s``).  A slow or silent client costs one
connection slot for a bounded time, never a task that lives forever.

While a request is being answered, its socket is watched (by :mod:`._hangups`, or
:meth:`Connection.watch_close` on another stream): end of file (or a reset) means the
client has left and the request's cancel scope is cancelled at once -- that is how a
disconnect reaches the logical call.  Bytes that arrive meanwhile (a pipelined
request) go to h11's buffer, up to a cap.

The usual request -- HTTP/1.1, CRLF lines, one Host, at most one Content-Length, no
Transfer-Encoding, Expect or Upgrade, all of it in one read -- is read here
(:func:`_plain_request`: a subset of what h11 accepts, read as h11 reads it; ~50 µs
of CPU a request); h11 parses every other request, so every refusal and every
request-smuggling shape is still h11's to judge.  Responses are written here, byte
for byte as h11 would write them (status line, headers, Content-Length or chunked
framing), because h11's writer validated every header of every answer -- a tenth of
the gateway's own CPU per request in ``benchmarks/serve.py``'s profile -- and every
header here is ours.  After a request h11 read, the parser is replaced by a fresh
one, fed whatever the client has already pipelined (after a plain one, h11 is still
fresh and holds it already); keep-alive follows the request (``Connection: close`` closes after the answer, and
so does any HTTP/1.0 request, ``Connection: keep-alive`` or not; an HTTP/1.0 stream is
delimited by the close, not chunked).  Each response leaves in
one ``send_all`` where it can (head and body together; a stream's head with its
first chunk), so a zero-delay answer is one write.
"""

from __future__ import annotations

import email.utils
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Final

import attrs
import h11
import trio

from .._chunked import ChunkedDecoder
from .._config import Serve
from .._http11 import FIELD_LINE, LENGTH_DIGITS, TOKEN
from .._sockets import receive_when_readable, send_all_progressing, write_first
from ._errors import CHALLENGE

__all__ = ["BAD_KEY", "ClientGone", "Connection", "HTTPProblem", "Request", "field_value", "reason"]

#: The 401's message.  OpenAI's own words first: clients that sort errors by their
#: text (LiteLLM, and its router's retry and fallback policies) read "Incorrect API key
#: provided" as an authentication error, and anything else of an invalid_request_error
#: as a bad request.
BAD_KEY: Final = (
    "Incorrect API key provided: the gateway key is wrong or missing; send "
    "'Authorization: Bearer <key>'."
)

_RECEIVE: Final = 65536
_MAX_HEAD: Final = 64 * 1024  # request line and headers
_MAX_PIPELINED: Final = 1024 * 1024  # bytes buffered for the next request while answering
#: h11 events of one request body between two checkpoints (a chunk each: ~6 µs).
_EVENTS_PER_CHECKPOINT: Final = 64
_SERVER_LINE: Final = b"server: polygate\r\n"
# The Date every answer carries (RFC 9110 6.6.1: a server with a clock must send it),
# written once a second, not once an answer.
_dated: tuple[int, bytes] = (-1, _SERVER_LINE)


def server_lines() -> bytes:
    """The ``server`` and ``date`` lines of an answer's head."""
    global _dated
    second = int(time.time())
    if second != _dated[0]:
        date = email.utils.formatdate(second, usegmt=True).encode("ascii")
        _dated = (second, b"%sdate: %s\r\n" % (_SERVER_LINE, date))
    return _dated[1]


_REASONS: Final = {
    100: b"Continue", 200: b"OK", 400: b"Bad Request", 401: b"Unauthorized",
    404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
    413: b"Content Too Large", 415: b"Unsupported Media Type", 429: b"Too Many Requests",
    431: b"Request Header Fields Too Large", 500: b"Internal Server Error", 502: b"Bad Gateway",
    503: b"Service Unavailable", 504: b"Gateway Timeout", 505: b"HTTP Version Not Supported",
}


def reason(status: int) -> bytes:
    return _REASONS.get(status, b"")

Headers = Sequence[tuple[bytes, bytes]]


#: The largest body written in one piece with its head: past it, the copy that joins
#: them costs more than the second write (~64 KiB copied against one ``send``).
_JOIN_MAX: Final = 64 * 1024


class ClientGone(Exception):
    """The client closed or reset the connection, or stopped reading."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        #: The request's path, when its head was read (for the metrics' label).
        self.path = path


class Cut(Exception):
    """A drain's grace period ended while the request was still arriving (its head or
    its body not all here): it is told 503 ``shutting_down``, and the connection closes."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        #: The request's path, when its head was read (for the metrics' label).
        self.path = path


@attrs.define(eq=False)
class Cuts:
    """What the end of a drain's grace period cancels (the server's, shared by its
    connections): the scope of each call being answered, of each request head being
    read once its first byte is here, and of each wait for the rest of a request's
    body.  ``on`` once it has ended: a scope added then is cancelled at once."""

    scopes: set[trio.CancelScope] = attrs.Factory(set)
    on: bool = False

    def add(self, scope: trio.CancelScope) -> None:
        self.scopes.add(scope)
        if self.on:
            scope.cancel()

    def cut(self) -> None:
        self.on = True
        for scope in list(self.scopes):
            scope.cancel()


class HTTPProblem(Exception):
    """The request cannot be read: answer ``status`` and close the connection."""

    def __init__(
        self, status: int, message: str, code: str, path: str | None = None,
        headers: Headers = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        #: The request's path, when its head was read (for the metrics' label).
        self.path = path
        #: Fields the answer carries besides the usual ones.
        self.headers = headers


@attrs.define(slots=True)
class Request:
    method: str
    path: str
    # Lower-case names; a repeated header keeps its last value.  Its repr (a local of
    # every handler, which a crash reporter records) names the headers without their
    # values: the gateway key travels in one, and any header may carry a credential.
    headers: dict[str, str] = attrs.field(repr=lambda h: f"<{', '.join(h)}>")
    body: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")  # the prompt: not shown


#: Headers whose repeated lines are one list (RFC 9110 5.3: joined with commas): the
#: trace context a traced gateway reads (W3C Baggage, Trace Context), and ``Via``
#: (a proxy between two gateways may add its own line: the gateway's loop check
#: reads them all).  Any other repeated header keeps its last line.
_LISTS: Final = frozenset({b"baggage", b"tracestate", b"via"})


def _join_lists(headers: dict[str, str], lines: Sequence[tuple[bytes, bytes]]) -> None:
    for name in _LISTS:
        values = [v for k, v in lines if k == name]
        if len(values) > 1:
            headers[name.decode()] = b", ".join(values).decode("latin-1")


#: A request line of HTTP/1.1 (h11's ``request_line``, narrowed to that version).
_REQUEST_LINE: Final = re.compile(rb"(" + TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.1")
#: Request headers whose meaning h11 must judge: framing, expectations, upgrades.
_H11_ONLY: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
#: How long a connection closed with its request's body unread reads what still
#: comes (see Connection.aclose), and in what pieces.
LINGER_S: Final = 2.0
_LINGER_READ: Final = 65536
_POSIX: Final = os.name == "posix"  # (a socket is a file descriptor: see polygate._sockets)
#: Off a plain socket (a test's stream): what one send may take before the send
#: timeout starts again.
_SEND_PIECE: Final = 16 * 1024


class _PlainRequest:
    """A request read without h11 (see :func:`_plain_request`): what
    ``read_request`` takes from h11's ``Request`` event, and the body."""

    __slots__ = ("body", "headers", "method", "target")
    http_version = b"1.1"

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                 body: bytes) -> None:
        self.method = method
        self.target = target
        self.headers = headers  # lower-case names, as h11's events hand them on
        self.body = body


def _plain_request(data: bytes) -> tuple[_PlainRequest, bytes] | None:
    """The request at the start of ``data``, and what follows it, if the request is
    plain and whole: an HTTP/1.1 request line (not a CONNECT), CRLF field lines (a
    subset of what h11 accepts: ``polygate._http11``) with exactly one Host, at most
    one Content-Length and no Transfer-Encoding, Expect or Upgrade, and all of its body.
    ``None`` otherwise: h11 reads it, and judges it."""
    end = data.find(b"\r\n\r\n")
    if end < 0 or end + 4 > _MAX_HEAD:
        return None
    lines = data[:end].split(b"\r\n")
    line = _REQUEST_LINE.fullmatch(lines[0])
    if line is None or line[1] == b"CONNECT":
        return None  # (a CONNECT: h11 judges it, and the answer says close)
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    length = -1
    field = FIELD_LINE.fullmatch
    for raw in lines[1:]:
        match = field(raw)
        if match is None:
            return None
        name, value = match[1].lower(), match[2]
        if name in _H11_ONLY:
            return None
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > LENGTH_DIGITS:
                return None  # repeated, or not a plain number: h11's to judge
            length = int(value)
        headers.append((name, value))
    start = end + 4
    stop = start + max(length, 0)
    if hosts != 1 or stop > len(data):
        return None  # (h11 refuses a missing or repeated Host; reads a body in parts)
    return _PlainRequest(line[1], line[2], headers, data[start:stop]), data[stop:]


def _late_or_cut(scope: trio.CancelScope, cuts: Cuts) -> None:
    """A head's scope cancelled with its first bytes here: its deadline passed (408),
    or the end of a drain's grace cut it (:class:`Cut`: a 408 would say the client
    was slow) -- or else, returning, a drain's start (see read_request)."""
    if trio.current_time() >= scope.deadline:
        raise HTTPProblem(408, "the request head was not received in time", "request_timeout")
    if cuts.on:
        raise Cut


def _head_problem(status: int) -> str:
    if status == 431:
        return "malformed request: the request head is too large"
    return ("malformed request: the request line or a header line is not valid HTTP/1.1 "
            "(or a header is repeated that may not be)")


def _malformed_body(path: str | None) -> HTTPProblem:
    return HTTPProblem(
        400, "malformed request body: its framing (Content-Length or chunked encoding) "
        "is not valid HTTP/1.1", "bad_request", path)


def _framed(framing: ChunkedDecoder, data: bytes, path: str | None) -> ChunkedDecoder | None:
    """``data`` of a chunked request body through ``framing`` before h11 reads it: the
    decoder, or ``None`` once its last chunk began (the trailers and what follows are
    h11's); a framing h11 would refuse is refused here, in time linear in it."""
    try:
        _, last = framing.decode(data)
    except h11.RemoteProtocolError:
        raise _malformed_body(path) from None
    return framing if last is None else None


def _first_byte_wait(limits: Serve, idle: bool) -> float:
    """How long a connection waits for a request: ``idle_timeout_s`` for the next one on
    a kept-alive connection, else ``header_timeout_s`` for the whole head."""
    return limits.idle_timeout_s if idle else limits.header_timeout_s


class Connection:
    """One client connection: read a request, answer it, repeat."""

    __slots__ = ("body_left", "carried", "chunked", "client_gone", "cuts", "finishing",
                 "first_byte_cap", "h11", "head_only", "keep_alive", "limits", "pipelined",
                 "requests", "responding", "stream", "writing")

    def __init__(
        self, stream: trio.SocketStream, limits: Serve,
        finishing: set[trio.CancelScope] | None = None, cuts: Cuts | None = None,
    ) -> None:
        self.stream = stream
        self.limits = limits
        #: The server's frame writes in progress (see finish_frame): a hard stop cancels
        #: them, a drain does not.
        self.finishing = finishing if finishing is not None else set()
        #: The server's: a wait for a request body's rest joins them (see _read_body).
        self.cuts = cuts if cuts is not None else Cuts()
        #: The body bytes the request being read frames, once its head is read (0 for
        #: a request read whole with its head); -1 before, or when not known (chunked):
        #: see still_sending.
        self.body_left = -1
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self.requests = 0
        self.client_gone = False
        self.keep_alive = True  # what the current request allows
        self.chunked = True  # HTTP/1.1: streams are chunked; HTTP/1.0: close-delimited
        self.responding = False  # a response head has been sent for the current request
        self.head_only = False  # the current request is a HEAD: its answer has no body
        self.pipelined = 0  # bytes read while the current request is answered
        #: The server counted the next request in flight as the last answer ended (its
        #: bytes were already here, pipelined): a drain reads and answers it too.
        self.carried = False
        #: The most the wait for the next request's first byte may take (a drain's
        #: moment, see read_request), or None.
        self.first_byte_cap: float | None = None
        #: The scope of a write that waits for the client to read (see :meth:`left`).
        self.writing: trio.CancelScope | None = None

    # ------------------------------------------------------------------ reading

    def retime(self, scope: trio.CancelScope, limits: Serve) -> None:
        """A reload's ``limits`` for this connection, waiting for a request's first byte
        in ``scope`` (as read_request set it): the new period, from when the wait
        began, so that a lowered timeout reaches it now."""
        old, self.limits = self.limits, limits
        if old is limits or scope.deadline == math.inf:
            return
        # (Called only for a wait with nothing pending: a pending request starts at once.)
        idle = bool(self.requests)
        before, after = _first_byte_wait(old, idle), _first_byte_wait(limits, idle)
        cap = self.first_byte_cap
        if cap is not None:  # a drain's moment (see read_request): no reload stretches it
            before, after = min(before, cap), min(after, cap)
        scope.deadline = scope.deadline - before + after

    async def read_request(
        self, admit: Callable[[str, dict[str, str]], bool] | None = None,
        started: Callable[[], object] | None = None,
        scope: trio.CancelScope | None = None,
        first_byte_s: float | None = None,
    ) -> Request | None:
        """The next request, or ``None`` when the client closed or stayed idle
        (``first_byte_s``: at most that long before its first byte comes).

        Raises :class:`HTTPProblem` for a request that is malformed, too large or too
        slow, or that ``admit(path, headers)`` refuses (a missing gateway key: refused
        from the head, so a client without a key never makes the server hold its
        body); the caller answers it and closes.  ``admit`` may set ``limits`` (a
        reload's, for the rest of the request).  ``started()`` is called once the
        request's first byte is here.  A client that leaves mid-request raises
        :class:`ClientGone`; one still arriving when a drain's grace ends, :class:`Cut`.

        The head is read in ``scope`` (a new one if none is given), with its deadline
        set here: the server's scope for a connection that a drain may close while it
        is idle, so one scope does both (cancelled there before the first byte, it
        ends the read like a timeout does: ``None``).
        """
        limits = self.limits
        # A problem met before this request's head is parsed (a malformed or too large
        # head, a head timeout) is answered whole: the last request's HEAD-ness (no
        # body) is not this one's.
        self.head_only = self.responding = False
        self.body_left = -1
        buffered = self.h11.trailing_data[0]
        if buffered[:1] in (b"\r", b"\n") and self.h11.their_state is h11.IDLE:
            # Empty lines before a request line (RFC 9112 section 2.2: a server SHOULD
            # ignore at least one; some clients send a CRLF after a POST body), which
            # h11 takes for a head without a request line: dropped, with a fresh parser
            # (h11 has no other way to drop bytes it holds).
            buffered = buffered.lstrip(b"\r\n")
            self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
            if buffered:
                self.h11.receive_data(buffered)
        pending = len(buffered)  # pipelined: already here
        # A kept-alive connection waits idle_timeout_s for a request, and its head has
        # header_timeout_s from its first byte; a new one has header_timeout_s for the
        # whole head, from its start (a first byte does not buy a second period).
        idle = bool(self.requests) and not pending
        wait = _first_byte_wait(limits, idle)
        self.first_byte_cap = first_byte_s  # (for retime)
        if first_byte_s is not None and first_byte_s < wait:
            wait = first_byte_s
        if pending and started is not None:
            started()
            started = None
        # The usual request, whole in one read, is read without h11 (see
        # _plain_request); only when nothing is pending, so that h11 is fresh.
        plain = not pending and self.h11.their_state is h11.IDLE
        if scope is None:
            scope = trio.CancelScope()
        # Relative: the deadline is fixed as the scope is entered, just below, at this
        # same instant (no checkpoint between).  Setting an absolute deadline on an
        # unentered scope runs trio's re-registration for nothing (~2 µs a request).
        # (trio refuses a relative deadline on a scope that has an absolute one: a
        # scope given with a deadline gets this one over it, as always.)
        if scope.deadline == math.inf:
            scope.relative_deadline = wait
        else:
            scope.deadline = trio.current_time() + wait
        with scope:
            if pending:
                # Pipelined: already here, it would be taken, answered and written (a
                # write the kernel takes at once yields nothing) without a pass of the
                # scheduler; one client's pipeline of small requests held every other
                # client and stream for a read's worth of them (~2,000) at a time.
                await trio.lowlevel.checkpoint()
            event, fed = await self._next_head_event(scope, idle, started, plain, fresh=not pending)
        if scope.cancelled_caught:
            if self.h11.their_state is h11.IDLE and not self.h11.trailing_data[0]:
                return None  # idle keep-alive connection: close quietly
            _late_or_cut(scope, self.cuts)
            # Neither: a drain's start, which closes idle connections, in the instant
            # those bytes came.  In flight from them, the request is read on, in a
            # scope of its own that only the grace's end cuts.  (Its bytes so far
            # are all in h11's buffer: an incomplete head is not consumed.)
            again = trio.CancelScope(deadline=scope.deadline)
            self.cuts.add(again)
            try:
                with again:
                    event, fed = await self._next_head_event(
                        again, False, None, fed=len(self.h11.trailing_data[0]) - pending)
            finally:
                self.cuts.scopes.discard(again)
            if again.cancelled_caught:
                _late_or_cut(again, self.cuts)
                raise Cut  # (only the cuts cancel it)
        if not isinstance(event, _PlainRequest):
            if not isinstance(event, h11.Request):
                return None  # ConnectionClosed
            # h11 checks its size limit only while a head is incomplete: one completed
            # by a later read (or pipelined) may be larger.  What it has not consumed is
            # body.  (A plain request's head is within the limit by construction.)
            if pending + fed > _MAX_HEAD and pending + fed - len(self.h11.trailing_data[0]) > _MAX_HEAD:
                raise HTTPProblem(431, "the request head is over 64 KiB", "bad_request")
            if not event.http_version.startswith((b"1.", b"0.")):
                # h11 reads a request line of any version: HTTP/2's connection preface
                # ("PRI * HTTP/2.0") too, which was then answered as HTTP/1.1 (a 401).
                # (One below 1.0 is answered as HTTP/1.0 is, below.)
                raise HTTPProblem(  # (RFC 9112 §2.3: a major version it does not speak)
                    505, "this gateway speaks HTTP/1.1 (HTTP/2 is not served: use HTTP/1.1)",
                    "http_version_not_supported")
        self.requests += 1
        self.responding = False
        self.pipelined = 0
        self.head_only = event.method == b"HEAD"
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
        if len(headers) < len(event.headers):  # (a repeated line: rare)
            _join_lists(headers, event.headers)
        if isinstance(event, _PlainRequest):
            self.body_left = 0  # (its body came with it)
        elif "transfer-encoding" not in headers:
            framed = headers.get("content-length", "0")
            self.body_left = int(framed) if framed.isdigit() else -1
        target = event.target.decode("latin-1")
        if target[:8].lower().startswith(("http://", "https://")):
            # The absolute form (RFC 9112 §3.2.2: a server MUST accept it), which a
            # client configured with the gateway as its proxy sends: its path.
            # The authority ends at the first "/", "?" or "#" (RFC 3986 §3.2): a query's
            # "/" is not the path's.  (Read by hand: urlsplit raises on an authority
            # such as "[", and this runs before the key is checked.)
            rest = target.split("://", 1)[1]
            ends = [at for at in (rest.find("/"), rest.find("?"), rest.find("#")) if at >= 0]
            target = rest[min(ends):] if ends else "/"
            if not target.startswith("/"):
                target = "/" + target
        path = target.split("?", 1)[0]
        if len(headers) < len(event.headers) and sum(
                k == b"authorization" for k, _ in event.headers) > 1:
            # It cannot repeat (RFC 9110): a proxy reading the first and this server
            # the last would disagree on who calls.
            raise HTTPProblem(400, "more than one Authorization header", "invalid_request", path)
        # Every Connection header's tokens (a repeated one is one list, RFC 9110 §5.3).
        # Whole tokens: "x-closed" is not "close".
        tokens = {t.strip() for t in b",".join(
            v for k, v in event.headers if k == b"connection").decode("latin-1").lower().split(",")}
        if event.http_version < b"1.1":
            # HTTP/1.0 closes after the answer, and the answer says so: h11 keeps no
            # HTTP/1.0 connection alive (keep-alive is an extension it does not take),
            # and an answer without "connection: close" would read as persistent.
            # (Nor one that says 0.9, which gets no chunked answer either.)
            self.chunked = False
            self.keep_alive = False
        else:
            self.chunked = True
            self.keep_alive = "close" not in tokens
        if ("upgrade" in headers or event.method == b"CONNECT"
                or ("content-length" in headers and "transfer-encoding" in headers)):
            # An Upgrade (h2c, websocket) or a CONNECT is not taken: h11 will not read
            # past it, so the answer says close.  Content-Length beside
            # Transfer-Encoding is a request smuggling shape: RFC 9112 §6.1 has the
            # server close after it.
            self.keep_alive = False
        if admit is not None and not admit(path, headers):
            raise HTTPProblem(401, BAD_KEY, "invalid_api_key", path, CHALLENGE)
        limits = self.limits  # (admit may have brought a reload's)
        length = headers.get("content-length")
        if length is not None and int(length) > limits.max_request_bytes:
            raise HTTPProblem(
                413, f"request body of {length} bytes exceeds the limit of "
                f"{limits.max_request_bytes} bytes", "request_too_large", path,
            )
        if "content-encoding" in headers and (length not in (None, "0") or "transfer-encoding" in headers):
            codings = b",".join(v for k, v in event.headers if k == b"content-encoding")
            if any(c.strip() not in (b"", b"identity") for c in codings.lower().split(b",")):
                # A compressed body (RFC 9110 §15.5.16) is refused unread, as polygate's
                # own client refuses an answer in a coding: it was read as JSON, and a
                # plain body labelled gzip went upstream as it was.
                raise HTTPProblem(
                    415, "a request body in a content coding (Content-Encoding) is not "
                    "accepted: send it uncompressed", "unsupported_content_encoding", path,
                    headers=((b"accept-encoding", b"identity"),))
        if isinstance(event, _PlainRequest):
            body = event.body
        else:
            if self.h11.they_are_waiting_for_100_continue:
                if self.cuts.on:  # past a drain's grace: no body is asked for to be refused
                    raise Cut(path)
                await self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await self._read_body(path, chunked="transfer-encoding" in headers)
        return Request(event.method.decode("latin-1"), path, headers, body)

    async def _next_head_event(
        self, scope: trio.CancelScope, idle: bool, started: Callable[[], object] | None,
        plain: bool = False, fed: int = 0, fresh: bool = False,
    ) -> tuple[h11.Event | _PlainRequest, int]:
        """The next event, and how many bytes were received for it (``fed`` of them
        before this call).  With ``plain`` (h11 fresh, nothing pending), a plain
        request whole in the first read comes back as a :class:`_PlainRequest`, and
        what followed it goes to h11.  With ``fresh`` (nothing of the request here
        yet), empty lines before its first byte are dropped, as in read_request."""
        while True:
            if not plain:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    # (h11's 501 hint, for any Transfer-Encoding but a lone "chunked",
                    # stays a 400: RFC 9112 §6.3 asks one for chunked not last, or twice,
                    # and h11 does not say which it saw.)
                    hint = exc.error_status_hint
                    status = hint if 400 <= hint < 500 else 400
                    # Not h11's words: they quote the offending line, a key in it included.
                    raise HTTPProblem(status, _head_problem(status), "bad_request") from None
                if event is not h11.NEED_DATA:
                    return event, fed  # type: ignore[return-value]
            # A kept-alive connection just answered waits for its next request: the
            # first read waits before it tries.
            data = await self._receive(wait_first=idle and not fed)
            if not data and (fed or self.h11.trailing_data[0]):
                # The client left in the middle of a head: gone (499), not a
                # malformed request (h11 would call the cut head a 400).
                raise ClientGone
            if fresh and not fed and data[:1] in (b"\r", b"\n"):
                data = data.lstrip(b"\r\n")
                if not data:
                    continue  # (not the request's first byte: still waiting for it)
            if data and started is not None:
                started()
                started = None
            fed += len(data)
            if plain:
                plain = False
                found = _plain_request(data)
                if found is not None:
                    request, after = found
                    if after:
                        self.h11.receive_data(after)  # pipelined: the next request's
                    return request, fed
            if data and idle:
                # The first byte of a request: from now on the head has header_timeout_s.
                # (Not for a request already whole: nothing more is waited for.)
                idle = False
                scope.deadline = trio.current_time() + self.limits.header_timeout_s
            self.h11.receive_data(data)

    async def _read_body(self, path: str | None = None, *, chunked: bool = False) -> bytes:
        limits = self.limits
        body = bytearray()
        # A chunked body's framing is checked by polygate's decoder before h11 reads
        # it: h11's pattern for a size line is quadratic in a line of blanks that ends
        # in a bare LF (one 64 KiB read of one held every client's loop for 2 s).  h11
        # still reads the body; the decoder only refuses, in linear time, what h11
        # would refuse slowly.
        framing: ChunkedDecoder | None = ChunkedDecoder() if chunked else None
        if framing is not None:
            framing = _framed(framing, self.h11.trailing_data[0], path)
        # body_timeout_s runs from here.  A body that came with its head (most do) is
        # read without a cancel scope; one is opened only for a read that may wait.
        deadline: float | None = None
        events = 0
        while True:
            events += 1
            if events % _EVENTS_PER_CHECKPOINT == 0:
                # A chunked body of tiny chunks is one h11 event per chunk, ~6 µs each:
                # one 64 KiB read of 1-byte chunks held the loop (every other request
                # and stream) for ~100 ms.  Let the others run, and count the time it
                # takes against the body's own time limit.
                await trio.lowlevel.checkpoint()
                if deadline is None:
                    deadline = trio.current_time() + limits.body_timeout_s
                elif trio.current_time() >= deadline:
                    raise HTTPProblem(408, "the request body was not received in time",
                                      "request_timeout", path)
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                raise _malformed_body(path) from None
            if event is h11.NEED_DATA:
                if deadline is None:
                    deadline = trio.current_time() + limits.body_timeout_s
                # (A scope only for a wait: the end of a drain's grace cuts it.)
                with trio.move_on_at(deadline) as waiting:
                    self.cuts.add(waiting)
                    try:
                        data = await self._receive()
                    finally:
                        self.cuts.scopes.discard(waiting)
                    if not data:  # left mid-body: gone, not a malformed body
                        raise ClientGone(path)
                    if framing is not None:
                        framing = _framed(framing, data, path)
                    self.h11.receive_data(data)
                    continue
                if self.cuts.on:
                    raise Cut(path)
                raise HTTPProblem(408, "the request body was not received in time",
                                  "request_timeout", path)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > limits.max_request_bytes:  # chunked bodies
                    raise HTTPProblem(
                        413, f"request body exceeds the limit of {limits.max_request_bytes} bytes",
                        "request_too_large", path,
                    )
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:  # ConnectionClosed mid-body
                raise ClientGone(path)

    async def _receive(self, wait_first: bool = False) -> bytes:
        """``wait_first``: the bytes cannot be here yet (see polygate._sockets)."""
        try:
            if wait_first:
                return await receive_when_readable(self.stream, _RECEIVE)
            return await self.stream.receive_some(_RECEIVE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def watch_close(self, on_close: Callable[[], object]) -> None:
        """Run while a request is answered: when the client leaves, call ``on_close``
        (which cancels the request).  Pipelined bytes are kept for the next request.

        The server does this for all its socket connections in one task instead
        (:mod:`._hangups`); this is for any other stream."""
        while True:
            data = await self._receive()
            if not self.took(data, on_close):
                if self.client_gone:
                    return
                await trio.sleep_forever()  # stop reading; the answer still goes out

    def took(self, data: bytes, on_close: Callable[[], object]) -> bool:
        """What a read while a request is answered brought: ``b""`` (the client left:
        ``on_close()``) or pipelined bytes, kept for the next request.  Whether to go
        on reading: not once the client has left, or has pipelined more than the cap."""
        if not data:
            self.left(on_close)
            return False
        self.h11.receive_data(data)
        # Counted here: h11's trailing_data copies its whole buffer, and a client that
        # trickles bytes would make that quadratic (a 1 MiB copy per read, near the cap).
        self.pipelined += len(data)
        return self.pipelined <= _MAX_PIPELINED

    def left(self, on_close: Callable[[], object]) -> None:
        """The client has gone (end of file, a reset, a hang-up): its request is
        cancelled by ``on_close()``, and the connection is not reused."""
        self.client_gone = True
        on_close()
        # A write waiting for this client to read would wait out the send timeout,
        # the request (its permits, its key's in-flight count) with it: nobody reads.
        if self.writing is not None:
            self.writing.cancel()

    def fileno(self) -> int | None:
        """The socket's descriptor, or None on another kind of stream."""
        if isinstance(self.stream, trio.SocketStream):
            return self.stream.socket.fileno()
        return None

    # ------------------------------------------------------------------ writing

    def response_head(
        self, status: int, headers: Headers, *, length: int | None = None, close: bool = False
    ) -> bytes:
        """A response head: ``length`` gives a Content-Length, ``None`` a stream
        (chunked on HTTP/1.1, close-delimited on HTTP/1.0).  Every header is ours:
        names are constants, values numbers, ids and names the settings validated."""
        fields = _fields(headers)
        if length is not None:
            return self.prepared_head(status, fields, length, close=close)
        self.responding = True
        if close or not self.chunked:
            self.keep_alive = False
        return b"HTTP/1.1 %d %s\r\n%s%s%s%s\r\n" % (
            status, _REASONS.get(status, b""), server_lines(), fields,
            b"transfer-encoding: chunked\r\n" if self.chunked else b"",
            b"" if self.keep_alive else b"connection: close\r\n")

    async def send_response(
        self, status: int, headers: Headers, body: bytes, *, close: bool = False
    ) -> None:
        """A whole response (head and body) in one write; a HEAD's without the body."""
        await self.send_prepared(status, _fields(headers), body, close=close)

    async def send_prepared(self, status: int, fields: bytes, body: bytes, *, close: bool = False) -> None:
        """:meth:`send_response` with the header lines already written (``fields``,
        each line ending in CRLF, every value as :func:`field_value` leaves it)."""
        head = self.prepared_head(status, fields, len(body), close=close)
        if self.head_only:
            await self._send(head)
        elif len(body) < _JOIN_MAX:
            await self._send(head + body)
        else:
            # After its head, not copied behind it: joined, a large answer was a second
            # full-size copy at the peak of its memory, and out of memory there, with
            # the answer begun, not even the 503 could go out (the client was cut).
            await self._send(head)
            await self._send(body)

    def prepared_head(self, status: int, fields: bytes, length: int, *, close: bool = False) -> bytes:
        """:meth:`response_head` with a Content-Length, of header lines already written."""
        self.responding = True
        if close:
            self.keep_alive = False
        return b"HTTP/1.1 %d %s\r\n%s%scontent-length: %d\r\n%s\r\n" % (
            status, _REASONS.get(status, b""), server_lines(), fields, length,
            b"" if self.keep_alive else b"connection: close\r\n")

    def frame(self, payload: bytes) -> bytes:
        """A piece of a streamed body, ready to send."""
        if not self.chunked:
            return payload
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    def end(self) -> bytes:
        return b"0\r\n\r\n" if self.chunked else b""

    async def send(self, data: bytes) -> None:
        await self._send(data)

    async def write_first(self, data: bytes) -> memoryview:
        """What is left of ``data`` after a write the kernel takes at once (empty,
        nearly always), without a scheduler pass (see polygate._sockets); a
        cancelled request writes nothing.  The caller sends the rest, if any."""
        if self.client_gone:  # (it left before the write: nobody reads it)
            raise ClientGone
        return await write_first(self.stream, data)

    async def finish_frame(self, data: bytes | memoryview) -> None:
        """The rest of a stream frame whose write has begun, bounded by the send
        timeout and by nothing else: a drain that cancelled it half-way would leave a
        cut frame for its error event to land in (trio cannot say how much of a
        cancelled ``send_all`` went out).  The drain takes effect right after."""
        if self.client_gone:
            raise ClientGone
        with trio.CancelScope(shield=True) as scope:  # bounded: the deadline below
            scope.deadline = trio.current_time() + self.limits.send_timeout_s
            # A hard stop (the grace's last words over, a second signal, the server's
            # block left) cancels it: only a drain waits for the frame.
            self.finishing.add(scope)
            self.writing = scope
            try:
                took = await self._send_all(scope, data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.client_gone = True
                raise ClientGone from None
            finally:
                self.finishing.discard(scope)
                self.writing = None
        if scope.cancelled_caught or not took:
            self.client_gone = True  # a client that does not read is a client that left
            raise ClientGone

    async def _send(self, data: bytes) -> None:
        # Most answers leave in one write the kernel takes at once: then no scope and
        # no scheduler pass.  A cancelled request writes nothing (see polygate._sockets).
        if self.client_gone:  # (it left before the write: nobody reads it)
            raise ClientGone
        rest = await write_first(self.stream, data)
        if not rest:
            return
        took = False
        with trio.CancelScope(deadline=trio.current_time() + self.limits.send_timeout_s) as scope:
            self.writing = scope
            try:
                took = await self._send_all(scope, rest)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.client_gone = True
                raise ClientGone from None
            finally:
                self.writing = None
        if not took:
            self.client_gone = True  # a client that does not read is a client that left
            raise ClientGone

    async def _send_all(self, scope: trio.CancelScope, data: bytes | memoryview) -> bool:
        """Send ``data`` under ``scope`` (the write's, whose deadline is the send
        timeout); ``False`` when the client took nothing of it for ``send_timeout_s``.
        The timeout is for a client that stops reading, not for the whole of a large
        answer to one that reads slowly and steadily: on a socket, any byte the
        client's side acknowledged starts it again (see polygate._sockets); on another
        stream, each 16 KiB it takes."""
        timeout = self.limits.send_timeout_s
        if type(self.stream) is trio.SocketStream and _POSIX:
            scope.deadline = math.inf  # what is progress, send_all_progressing judges
            return await send_all_progressing(self.stream, data, timeout)
        view = memoryview(data)
        while view:
            piece = view[:_SEND_PIECE]
            await self.stream.send_all(piece)
            view = view[len(piece):]
            if view:
                scope.deadline = trio.current_time() + timeout
        return True

    def still_sending(self) -> bool:
        """Whether the client may still be sending, for a request refused before its
        body was read: its head or body not all here (or framed by chunks, whose end
        is not known), or bytes already here past it (pipelined).  Its connection
        then lingers (see aclose)."""
        return self.body_left < 0 or len(self.h11.trailing_data[0]) != self.body_left

    def pending(self) -> bool:
        """Whether bytes of a next request are already here (pipelined); empty lines
        are not one (read_request drops them)."""
        data = self.h11.trailing_data[0]
        return bool(data) and bool(data.lstrip(b"\r\n"))

    def reusable(self) -> bool:
        """Whether another request may follow; if so, a fresh parser takes over with
        whatever the client already sent (pipelining)."""
        if self.client_gone or not self.keep_alive:
            return False
        if self.h11.their_state is h11.IDLE:
            # A plain request (h11 reads any other to its end: DONE): h11 saw nothing
            # of it and is still fresh, holding whatever the client pipelined meanwhile.
            return not self.h11.trailing_data[1]
        if self.h11.their_state is not h11.DONE:
            return False
        pending, closed = self.h11.trailing_data
        if closed:
            return False
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        if pending:
            self.h11.receive_data(pending)
        return True

    async def aclose(self, linger: bool = False) -> None:
        """Close.  ``linger``: the last request was refused before its body was read,
        so the client may still be sending it; a close with unread bytes sends a reset
        (RST), which can destroy the answer before the client reads it (RFC 9112 §9.6).
        Then the server half-closes, and reads and drops what still comes -- until the
        client closes, for :data:`LINGER_S` at most -- before it closes (nginx's
        ``lingering_close``)."""
        try:
            if linger:
                with trio.move_on_after(LINGER_S):
                    try:
                        await self.stream.send_eof()
                        while await self.stream.receive_some(_LINGER_READ):
                            pass
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
        finally:  # a hard stop cancels a linger: the socket is closed all the same
            with trio.move_on_after(1):
                await self.stream.aclose()


_UNSAFE_IN_VALUES = bytes.maketrans(b"\r\n\x00", b"   ")


def _fields(headers: Headers) -> bytes:
    """``headers`` as a head's field lines, each value as :func:`field_value` leaves it."""
    return b"".join([name + b": " + field_value(value) + b"\r\n" for name, value in headers])


def field_value(value: bytes) -> bytes:
    """``value`` as a header value can hold it: a line break or NUL (never in a value
    of ours: names are validated, but one would end the head early and split the
    answer) becomes a space."""
    if value.find(b"\n") >= 0 or value.find(b"\r") >= 0 or value.find(b"\x00") >= 0:
        return value.translate(_UNSAFE_IN_VALUES)
    return value
