"""The loopback face: a small HTTP/1.1 server (trio sockets + h11) for a FakeUpstream.

No framework sits in between because the faults need byte-level control: a reset
is a close with ``SO_LINGER`` 0 (the kernel sends RST), "truncated" declares a
Content-Length and closes early, "silent" accepts the request and sends nothing.

Cost per request is kept low for benchmarks: consecutive body steps are joined and
leave in one ``send_all`` (a zero-delay answer, head and all, is one write), and no
extra task is started per request.  A pause is a ``receive_some`` bounded by
``move_on_at``: it sleeps *and* notices a client that hangs up (EOF), which ends
the exchange as ``client_closed`` at once.  trio's socket receive is cancel-safe,
so no request bytes are lost; any that arrive early (pipelining) go to h11's buffer.
"""

from __future__ import annotations

import logging
import math
import socket
import struct
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, cast

import h11
import trio

from ._render import Due, FaultBytes, Pause, Plan
from ._transport import script_failure

if TYPE_CHECKING:
    from ._upstream import FakeUpstream, Outcome

__all__ = ["run_server"]

_RECEIVE = 65536
_FLUSH_AT = 256 * 1024
_SERVER = ("server", "polygate-fake")


class _ClientGone(Exception):
    """The client closed its end while we were waiting."""


@asynccontextmanager
async def run_server(upstream: FakeUpstream, host: str, port: int) -> AsyncIterator[str]:
    """Serve ``upstream`` on ``host:port`` while the block runs; yields the base URL.

    An exception from the block is re-raised as itself (not wrapped in the
    nursery's ExceptionGroup) after the server has stopped.
    """
    if not isinstance(host, str) or not host:
        # (None listens on every address, each on a port of its own with port 0: the
        # URL would name one of them.)
        raise TypeError(f"serve() takes one host to listen on (an address or a name), got {host!r}")
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len({listener.socket.getsockname()[1] for listener in listeners}) > 1:
        # A name with several addresses ("localhost": 127.0.0.1 and ::1) got a port for
        # each, and the URL names one: the first one's, for all of them.
        bound = listeners[0].socket.getsockname()[1]
        for listener in listeners:
            await listener.aclose()
        listeners = await trio.open_tcp_listeners(bound, host=host)
    bound = listeners[0].socket.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    failure: BaseException | None = None
    # What ended a connection's task that no handler takes (a behaviour's
    # BaseException, pytest.fail's): trio closes the connection in a ``finally``
    # (serve_listeners), and a stop of the server that lands there replaces that
    # error with its Cancelled, which the stop then absorbs.  Kept here, it is raised
    # as the server stops.
    escaped: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(trio.serve_listeners, partial(_serve_connection, upstream, escaped), listeners)
        )
        try:
            yield f"http://{shown}:{bound}/v1"
        except BaseException as exc:
            failure = exc
        finally:
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if escaped:
        raise escaped[0]


log = logging.getLogger("polygate.testing")


async def _serve_connection(
    upstream: FakeUpstream, escaped: list[BaseException], stream: trio.SocketStream,
) -> None:
    upstream.connections += 1
    async with stream:
        try:
            await _Connection(upstream, stream).run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, _ClientGone):
            pass  # the client went away between requests: nothing to report
        except Exception:
            # A script that fails (a behaviour callable that raises, a status h11
            # cannot frame) ends its connection, not the whole server and the block
            # that serves it.
            log.exception("%s: answering a request failed; its connection is closed",
                          upstream.name)
        except trio.Cancelled:
            raise
        except BaseException as exc:  # (see run_server)
            escaped.append(exc)
            raise


class _Connection:
    """One keep-alive connection: read a request, answer it, repeat."""

    def __init__(self, upstream: FakeUpstream, stream: trio.SocketStream) -> None:
        self.upstream = upstream
        self.stream = stream
        self.conn = h11.Connection(h11.SERVER)
        #: Whether the current answer's fault bytes (FaultBytes) have been written:
        #: then it is a ``fault`` even if the client leaves before its end.
        self.fault_sent = False

    async def run(self) -> None:
        while True:
            try:
                request = await self._read_request()
            except h11.RemoteProtocolError:
                await self._bad_request()
                return
            if request is None:
                return
            if not await self._answer(*request):
                return
            if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                return
            self.conn.start_next_cycle()

    async def _next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(_RECEIVE))
                continue
            return event  # type: ignore[return-value]

    async def _read_request(self) -> tuple[h11.Request, bytes] | None:
        event = await self._next_event()
        if not isinstance(event, h11.Request):
            return None  # ConnectionClosed (client hung up between requests)
        body = bytearray()
        while True:
            part = await self._next_event()
            if isinstance(part, h11.Data):
                body += part.data
            elif isinstance(part, h11.EndOfMessage):
                return event, bytes(body)
            else:
                return None

    async def _bad_request(self) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            head = h11.Response(
                status_code=400, headers=[_SERVER, ("content-length", "0"), ("connection", "close")]
            )
            await self.stream.send_all(self._send(head) + self._send(h11.EndOfMessage()))

    async def _answer(self, request: h11.Request, body: bytes) -> bool:
        """Answer one request; False when the connection must not be reused."""
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
        try:
            plan, rec = self.upstream._open(
                request.method.decode("latin-1"), path, headers, body, failure_status=500,
                query=query)
        except Exception as exc:
            # The script itself failed (a behaviour callable raised): a 500 that says
            # so, and the connection closes.
            message = script_failure(self.upstream.name, path, exc)
            head = h11.Response(status_code=500, headers=[
                _SERVER, ("content-type", "text/plain"), ("content-length", str(len(message))),
                ("connection", "close")])
            await self.stream.send_all(
                self._send(head) + self._send(h11.Data(data=message)) + self._send(h11.EndOfMessage()))
            return False
        outcome: Outcome = "client_closed"
        self.fault_sent = False
        try:
            outcome = await self._send_plan(plan, head_only=request.method == b"HEAD")
            return plan.ending == "complete"
        except (_ClientGone, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        finally:
            self.upstream._finish(rec, "fault" if self.fault_sent else outcome)

    async def _send_plan(self, plan: Plan, *, head_only: bool = False) -> Outcome:
        await self._pause(plan.head_delay)
        headers = [_SERVER, *plan.headers]
        if plan.chunked:
            headers.append(("transfer-encoding", "chunked"))
        else:
            headers.append(("content-length", str(plan.content_length)))
        out = [self._send(h11.Response(status_code=plan.status, headers=headers))]
        if head_only:  # a HEAD: the head a GET would have, and no body (h11 refuses one)
            out.append(self._send(h11.EndOfMessage()))
            await self._flush(out, [])
            return "complete"
        pending: list[bytes] = []
        if plan.joinable:
            pending.append(b"".join(cast("Iterable[bytes]", plan.steps)))
        else:
            await self._send_steps(plan.steps, out, pending)
        if plan.ending == "complete":
            self._frame(out, pending)
            out.append(self._send(h11.EndOfMessage()))
            await self._flush(out, pending)
            return "fault" if plan.fault else "complete"
        await self._flush(out, pending)
        if plan.ending == "hang":
            await self._pause(None)
        if plan.ending == "reset":
            # SO_LINGER with a zero timeout: close() discards the send buffer and sends RST.
            self.stream.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        return "fault"

    async def _send_steps(
        self, steps: Iterable[bytes | Pause], out: list[bytes], pending: list[bytes]
    ) -> None:
        """Send the steps, one write per run of bytes between pauses (or per
        ``_FLUSH_AT`` bytes, so a huge body is not held in memory).

        Pauses are kept on an absolute schedule: a wake-up that comes late (a busy
        machine) shortens the next pause instead of delaying every later token."""
        size = 0
        due = Due(trio.current_time())
        fault = False  # a fault's bytes are pending: written with the next flush
        for step in steps:
            if isinstance(step, Pause):
                await self._flush(out, pending)
                self.fault_sent |= fault
                size = 0
                await self._pause_until(due.after(step))
                continue
            fault |= type(step) is FaultBytes
            pending.append(step)
            size += len(step)
            if size >= _FLUSH_AT:
                await self._flush(out, pending)
                self.fault_sent |= fault
                size = 0

    def _send(self, event: h11.Event) -> bytes:
        return self.conn.send(event) or b""

    def _frame(self, out: list[bytes], pending: list[bytes]) -> None:
        if pending:
            out.append(self._send(h11.Data(data=b"".join(pending))))
            pending.clear()

    async def _flush(self, out: list[bytes], pending: list[bytes]) -> None:
        self._frame(out, pending)
        if out:
            data = b"".join(out)
            out.clear()
            await self.stream.send_all(data)

    async def _pause(self, seconds: float | None) -> None:
        """Send nothing for ``seconds`` (``None``: until the client leaves); raise
        _ClientGone as soon as the client closes its end."""
        if seconds is not None and seconds <= 0:
            return
        await self._pause_until(math.inf if seconds is None else trio.current_time() + seconds)

    async def _pause_until(self, deadline: float) -> None:
        if deadline <= trio.current_time():
            return
        while True:
            with trio.move_on_at(deadline):
                data = await self.stream.receive_some(_RECEIVE)
                if not data:
                    raise _ClientGone
                self.conn.receive_data(data)
                continue
            return
