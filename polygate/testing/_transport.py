"""The httpx face: an ``AsyncBaseTransport`` that answers from a FakeUpstream.

Waits are ``trio.sleep`` calls, so under ``trio.testing.MockClock`` a 90-second hang
takes microseconds and every chunk arrives at an exact virtual time.  Each body
step is yielded as its own chunk (one SSE event per chunk).  Wire faults become the
exceptions httpx itself raises for them: ``ReadError`` for a reset,
``RemoteProtocolError`` for a body shorter than its Content-Length.  httpx's own
timeouts live in httpcore and do not apply here: use cancel scopes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import httpx
import sniffio
import trio

from ..transport import SENT_EXTENSION
from ..transport._pool import reports_sent
from ._render import Due, FaultBytes, Pause, Plan

if TYPE_CHECKING:
    from ._upstream import FakeUpstream, Outcome, RecordedRequest

__all__ = ["FakeTransport", "Router", "report_sent", "route_key", "routed", "script_failed", "script_failure", "trio_only"]


class FakeTransport(httpx.AsyncBaseTransport):
    """Answers every request from one FakeUpstream (see ``FakeUpstream.transport``).

    The request is sent (recorded by the upstream) when it is handed over, and the
    transport says so through polygate's ``SENT_EXTENSION`` (``REPORTS_SENT``)."""

    #: (polygate.transport's ``REPORTS_SENT``) it calls ``SENT_EXTENSION`` itself
    polygate_reports_sent = True

    def __init__(self, upstream: FakeUpstream) -> None:
        self.upstream = upstream

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        trio_only()
        raw = await request.aread()
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            plan, rec = self.upstream._open(
                request.method, request.url.path, headers, raw, failure_status=500,
                query=request.url.query.decode("ascii", "replace"))
        except Exception as exc:
            # The script itself failed (a behaviour callable raised): the 500 the
            # loopback face answers, not an exception out of the transport, which a
            # client would take for a fault of the upstream's (polygate: "malformed",
            # retried) -- a test of how an app meets a failing upstream would pass on
            # its own broken fixture.
            report_sent(request)
            return script_failed(self.upstream.name, request.url.path, exc)
        report_sent(request)
        try:
            if plan.head_delay is None:
                await trio.sleep_forever()
            await trio.sleep(plan.head_delay)
        except BaseException:
            self.upstream._finish(rec, "client_closed")
            raise
        response_headers = list(plan.headers)
        if plan.content_length is not None:
            response_headers.append(("content-length", str(plan.content_length)))
        # The body's schedule runs from the head, however late the client reads it (a
        # socket would have buffered it meanwhile), as on the other faces.
        stream = _FakeStream(self.upstream, rec, plan, request, trio.current_time())
        return httpx.Response(plan.status, headers=response_headers, stream=stream)


log = logging.getLogger("polygate.testing")


def script_failure(name: str, path: str, exc: Exception) -> bytes:
    """What every face answers a request whose script failed (a behaviour callable
    raised) with, as a ``500``'s text/plain body: the error's name; it is logged with
    its traceback."""
    log.error("%s: the script failed for %s", name, path, exc_info=exc)
    return f"FakeUpstream script failed: {type(exc).__name__}: {exc}".encode()


def script_failed(name: str, path: str, exc: Exception) -> httpx.Response:
    """The httpx faces' answer to a request whose script failed (see script_failure)."""
    message = script_failure(name, path, exc)
    return httpx.Response(500, headers=[("content-type", "text/plain"), ("connection", "close"),
                                        ("content-length", str(len(message)))], content=message)


class _FakeStream(httpx.AsyncByteStream):
    """The body of one response; closing it early records ``client_closed``."""

    def __init__(
        self,
        upstream: FakeUpstream,
        rec: RecordedRequest | None,
        plan: Plan,
        request: httpx.Request,
        head_at: float,
    ) -> None:
        self._upstream = upstream
        self._rec = rec
        self._plan = plan
        self._request = request
        self._head_at = head_at
        self._iterator: AsyncGenerator[bytes, None] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        # Kept so that aclose() can close it: an abandoned async generator would be
        # finalised later by the garbage collector instead.
        self._iterator = self._iterate()
        return self._iterator

    async def _iterate(self) -> AsyncGenerator[bytes, None]:
        plan = self._plan
        outcome: Outcome = "client_closed"
        try:
            due = Due(self._head_at)  # an absolute schedule, as the server face keeps
            steps = iter(plan.steps)
            step = next(steps, None)
            while step is not None:
                if isinstance(step, Pause):
                    await trio.sleep_until(due.after(step))
                    step = next(steps, None)
                    continue
                # A run of bytes with no pause in it goes out at once, as the server
                # face writes it: delivered as a whole, however much of it the client
                # reads (the pieces still come one by one).
                run = [step]
                step = next(steps, None)
                while step is not None and not isinstance(step, Pause):
                    run.append(step)
                    step = next(steps, None)
                if step is None and plan.ending != "hang":
                    outcome = body_ending(plan, self._request)[0]  # the answer's end
                elif any(type(piece) is FaultBytes for piece in run):
                    outcome = "fault"  # delivered, whether or not the client reads on
                for piece in run:
                    yield piece
            if plan.ending == "hang":
                await trio.sleep_forever()
            outcome, error = body_ending(plan, self._request)
            if error is not None:
                raise error
        finally:
            self._upstream._finish(self._rec, outcome)

    async def aclose(self) -> None:
        if self._iterator is not None:
            await self._iterator.aclose()
        self._upstream._finish(self._rec, closed_unread(self._plan, self._request))


def closed_unread(plan: Plan, request: httpx.Request) -> Outcome:
    """What a body closed before it was read records: an answer with no pause in it
    went out with its head (the server face writes it at once, and records it
    delivered), anything else was cut short by the client."""
    if plan.ending == "hang" or any(isinstance(step, Pause) for step in plan.steps):
        return "client_closed"
    return body_ending(plan, request)[0]


def body_ending(plan: Plan, request: httpx.Request) -> tuple[Outcome, httpx.TransportError | None]:
    """How a body that did not hang ends, for every transport face of FakeUpstream:
    the outcome it records, and the error a reset or a cut-short body raises, worded
    as httpx words them."""
    outcome: Outcome = "fault" if plan.fault or plan.ending != "complete" else "complete"
    if plan.ending == "reset":
        return outcome, httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
    if plan.ending == "truncate":
        return outcome, httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body", request=request
        )
    return outcome, None


def report_sent(request: httpx.Request) -> None:
    """Tell polygate that ``request`` was written: the call of its
    ``SENT_EXTENSION`` callable, if it has one."""
    sent = request.extensions.get(SENT_EXTENSION)
    if callable(sent):
        sent()


_DEFAULT_PORTS = {"http": 80, "https": 443}


def route_key(host: object) -> str:
    """A Router's (or EventTransport's) key as httpx gives a URL's host: lower case, an
    IPv6 address without its brackets; a URL is refused (it could never match)."""
    key = str(host).lower()
    if "/" in key or not key:
        raise ValueError(f"route keys are hosts or host:port, got {host!r}")
    if key.startswith("[") and "]" in key:  # "[::1]:8000": httpx's host has no brackets
        key = key[1:].replace("]", "", 1)
    return key


def routed(routes: Mapping[str, Any], url: httpx.URL) -> Any:
    """The route for ``url``: its ``host:port`` (a scheme's default port too: httpx
    drops it from the URL, so "a:80" is http://a/), else its host; None."""
    port = url.port or _DEFAULT_PORTS.get(url.scheme)
    route = routes.get(f"{url.host}:{port}") if port else None
    return route or routes.get(url.host)


def trio_only() -> None:
    """The fakes wait in trio's time: from asyncio, trio's own error ("must be called
    from async context") says the opposite of what is wrong."""
    if sniffio.current_async_library() != "trio":
        raise RuntimeError(
            "FakeUpstream's transports run in trio's time: from asyncio, hand one to "
            "polygate.aio.session(transport=...), or run the fake as a server (serve())")


class Router(httpx.AsyncBaseTransport):
    """Dispatches by the request URL's host, so sources configured as ``http://a/v1``
    and ``http://b/v1`` reach different fakes.  Keys are hosts or ``host:port``;
    values are FakeUpstreams or any httpx transport.  An unknown host raises
    ``httpx.ConnectError``, as an unreachable server would."""

    def __init__(self, routes: Mapping[str, FakeUpstream | httpx.AsyncBaseTransport]) -> None:
        from ._upstream import FakeUpstream  # (it imports this module)

        if not isinstance(routes, Mapping):
            raise TypeError(
                f"Router takes a mapping of hosts to FakeUpstreams or httpx transports, "
                f"got {type(routes).__name__}")
        self._routes: dict[str, httpx.AsyncBaseTransport] = {}
        for host, route in routes.items():
            if isinstance(route, FakeUpstream):
                route = route.transport()
            elif not isinstance(route, httpx.AsyncBaseTransport):
                raise TypeError(
                    f"Router routes map hosts to FakeUpstreams or httpx transports; "
                    f"{host!r} maps to {type(route).__name__}")
            self._routes[route_key(host)] = route

    @property
    def polygate_reports_sent(self) -> bool:
        """(``REPORTS_SENT``) when every route says itself when it writes."""
        return all(reports_sent(route) for route in self._routes.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        route: httpx.AsyncBaseTransport | None = routed(self._routes, url)
        if route is None:
            raise httpx.ConnectError(f"no fake upstream for host {url.host!r}", request=request)
        return await route.handle_async_request(request)

    async def aclose(self) -> None:
        for route in self._routes.values():
            await route.aclose()
