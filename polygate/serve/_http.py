"""HTTP/1.1 for the gateway: one keep-alive connection on h11 over a trio stream.

Everything a client can hold is bounded here: the wait for a request head
(``idle_timeout_s`` before its first byte on a kept-alive connection or
``header_timeout_s`` on a new one, then ``header_timeout_s`` for the rest of it),
its size (h11's ``max_incomplete_event_size``), the body's size
(``max_request_bytes``, refused from ``Content-Length`` before a byte of it is read)
and time (``body_timeout_s``), and every write to a client that does not read
(``send_timeout_s``).  A slow or silent client costs one connection slot for a
bounded time, never a task that lives forever.

While a request is being answered, :meth:`Connection.watch_close` reads the socket:
end of file (or a reset) means the client has left and the request's cancel scope is
cancelled at once -- that is how a disconnect reaches the logical call.  Bytes that
arrive meanwhile (a pipelined request) go to h11's buffer, up to a cap.

Each response leaves in one ``send_all`` where it can (head and body together; a
stream's head with its first chunk), so a zero-delay answer is one write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs
import h11
import trio

from .._config import Serve

__all__ = ["ClientGone", "Connection", "HTTPProblem", "Request"]

_RECEIVE: Final = 65536
_MAX_HEAD: Final = 64 * 1024  # request line and headers
_MAX_PIPELINED: Final = 1024 * 1024  # bytes buffered for the next request while answering
_SERVER: Final = (b"server", b"polygate")

Headers = Sequence[tuple[bytes, bytes]]


class ClientGone(Exception):
    """The client closed or reset the connection, or stopped reading."""


class HTTPProblem(Exception):
    """The request cannot be read: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@attrs.define(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes


class Connection:
    """One client connection: read a request, answer it, repeat."""

    __slots__ = ("client_gone", "h11", "limits", "requests", "stream")

    def __init__(self, stream: trio.SocketStream, limits: Serve) -> None:
        self.stream = stream
        self.limits = limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self.requests = 0
        self.client_gone = False

    # ------------------------------------------------------------------ reading

    async def read_request(self) -> Request | None:
        """The next request, or ``None`` when the client closed or stayed idle.

        Raises :class:`HTTPProblem` for a request that is malformed, too large or too
        slow; the caller answers it and closes.
        """
        limits = self.limits
        now = trio.current_time()
        started = bool(self.h11.trailing_data[0])
        wait = limits.idle_timeout_s if self.requests and not started else limits.header_timeout_s
        with trio.CancelScope(deadline=now + wait) as scope:
            event = await self._next_head_event(scope, started)
        if scope.cancelled_caught:
            if self.h11.their_state is h11.IDLE and not self.h11.trailing_data[0]:
                return None  # idle keep-alive connection: close quietly
            raise HTTPProblem(408, "the request head was not received in time", "request_timeout")
        if not isinstance(event, h11.Request):
            return None  # ConnectionClosed
        self.requests += 1
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
        length = headers.get("content-length")
        if length is not None and int(length) > limits.max_request_bytes:
            raise HTTPProblem(
                413, f"request body of {length} bytes exceeds the limit of "
                f"{limits.max_request_bytes} bytes", "request_too_large",
            )
        if self.h11.they_are_waiting_for_100_continue:
            await self._send(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        body = await self._read_body()
        target = event.target.decode("latin-1")
        return Request(event.method.decode("latin-1"), target.split("?", 1)[0], headers, body)

    async def _next_head_event(self, scope: trio.CancelScope, started: bool) -> h11.Event:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
                raise HTTPProblem(status, f"malformed request: {exc}", "bad_request") from None
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            data = await self._receive()
            if data and not started:
                # The first byte of a request: from now on the head has header_timeout_s.
                started = True
                scope.deadline = trio.current_time() + self.limits.header_timeout_s
            self.h11.receive_data(data)

    async def _read_body(self) -> bytes:
        limits = self.limits
        body = bytearray()
        with trio.move_on_after(limits.body_timeout_s):
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    raise HTTPProblem(400, f"malformed request body: {exc}", "bad_request") from None
                if event is h11.NEED_DATA:
                    self.h11.receive_data(await self._receive())
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > limits.max_request_bytes:  # chunked bodies
                        raise HTTPProblem(
                            413, f"request body exceeds the limit of {limits.max_request_bytes} bytes",
                            "request_too_large",
                        )
                elif isinstance(event, h11.EndOfMessage):
                    return bytes(body)
                else:  # ConnectionClosed mid-body
                    raise ClientGone
        raise HTTPProblem(408, "the request body was not received in time", "request_timeout")

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive_some(_RECEIVE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def watch_close(self, on_close: Callable[[], object]) -> None:
        """Run while a request is answered: when the client leaves, call ``on_close``
        (which cancels the request).  Pipelined bytes are kept for the next request."""
        while True:
            data = await self._receive()
            if not data:
                self.client_gone = True
                on_close()
                return
            self.h11.receive_data(data)
            if len(self.h11.trailing_data[0]) > _MAX_PIPELINED:
                await trio.sleep_forever()  # stop reading; the answer still goes out

    # ------------------------------------------------------------------ writing

    def response_head(self, status: int, headers: Headers, *, close: bool = False) -> bytes:
        all_headers = [_SERVER, *headers]
        if close:
            all_headers.append((b"connection", b"close"))
        return self.h11.send(h11.Response(status_code=status, headers=all_headers)) or b""

    async def send_response(
        self, status: int, headers: Headers, body: bytes, *, close: bool = False
    ) -> None:
        """A whole response (head and body) in one write."""
        head = self.response_head(
            status, [*headers, (b"content-length", b"%d" % len(body))], close=close
        )
        data = self.h11.send(h11.Data(data=body)) if body else b""
        await self._send(head + (data or b"") + (self.h11.send(h11.EndOfMessage()) or b""))

    def frame(self, payload: bytes) -> bytes:
        """A piece of a streamed (chunked) body, ready to send."""
        return self.h11.send(h11.Data(data=payload)) or b""

    def end(self) -> bytes:
        return self.h11.send(h11.EndOfMessage()) or b""

    async def send(self, data: bytes) -> None:
        await self._send(data)

    async def _send(self, data: bytes) -> None:
        with trio.move_on_after(self.limits.send_timeout_s):
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.client_gone = True
                raise ClientGone from None
            return
        self.client_gone = True  # a client that does not read is a client that left
        raise ClientGone

    def reusable(self) -> bool:
        """Whether another request may follow on this connection."""
        if self.client_gone:
            return False
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False

    async def aclose(self) -> None:
        with trio.move_on_after(1):
            await self.stream.aclose()
