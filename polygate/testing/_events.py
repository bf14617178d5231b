"""The scheduling-aware face: an httpx transport whose bodies wake the way sockets do.

``FakeUpstream.transport()`` waits with ``trio.sleep_until``: every pause ends through
a cancel-scope deadline of its own.  That is exact and convenient, and it hides a
whole class of races, because on a real event loop two things are true that such
waits never show:

1. **Wake-ups come in batches.**  When two sockets become readable in the same
   ``epoll`` wake-up, both tasks become runnable in the *same* scheduler batch,
   beside any timer that expired at that instant.  ``cancel()`` from the first one
   to run reaches the other only at its *next* checkpoint.  (A deadline-woken
   ``sleep`` is different: its wake-up *is* a cancellation, which an outer
   cancellation overrides, so the woken task never runs on.)
2. **Buffered data needs no checkpoint.**  A task that reads a socket gets
   everything that has arrived so far, and may parse it to the end without
   blocking once — so a contestant cancelled in the same batch can still finish
   its answer and return normally.

:class:`EventTransport` models both, in trio time (``MockClock`` or real):

* A request's bytes are FakeUpstream's plan for it (same renderer, same Reply, same
  recording), so the wire is identical: SSE chunks, JSON bodies, 429 with
  Retry-After, 5xx, error events, truncation, resets, hangs.
* Each instant at which some body's next bytes arrive has one ``trio.Event``, shared
  by every body waiting for that instant.  A run-loop instrument sets it in the
  loop iteration whose clock reaches the instant — before trio expires that
  iteration's deadlines — so all bodies due then, and every timer due then, are
  runnable in one batch, in the order trio's scheduler picks (see
  :class:`~polygate.testing.Schedule` to seed it).  The waiter's own deadline at
  the instant only makes the loop wake (or ``MockClock`` autojump) there.
* ``tick_s`` rounds arrival instants up to a multiple of itself: a loop that looks
  at its sockets every tick, or was busy that long — bodies whose data arrives in
  the same tick wake together, as in a loaded process.
* Once awake, a body hands over everything whose time has come as one piece (up to
  64 KiB), with no checkpoint: what the consumer reads late, it finds buffered.

A body's times count from the instant its head (status line) arrived; the head
arrives ``headers_delay_s`` after the request.  Sending a request is one checkpoint
(the write); a request cancelled there never reaches the upstream.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import AsyncGenerator, AsyncIterator, Mapping

import attrs
import httpx
import trio

from ._render import Due, FaultBytes, Pause, Plan
from ._transport import (
    body_ending,
    closed_unread,
    report_sent,
    route_key,
    routed,
    script_failed,
    trio_only,
)
from ._upstream import FakeUpstream, Outcome, RecordedRequest

__all__ = ["EventStatistics", "EventTransport"]

_PIECE = 64 * 1024  # a socket read returns at most this much at once


@attrs.frozen
class EventStatistics:
    """How the bodies woke.  ``instants``: distinct instants at which some body was
    woken; ``shared``: those that woke two bodies or more at once (the same-batch
    wake-ups a scenario needs to exercise commit races); ``max_woken``: the most
    bodies woken at one instant."""

    instants: int = 0
    shared: int = 0
    max_woken: int = 0


class _Readiness(trio.abc.Instrument):
    """Per run: one Event per pending arrival instant, set from the run loop."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self._heap: list[float] = []
        self._events: dict[float, trio.Event] = {}
        self.instants = 0
        self.shared = 0
        self.max_woken = 0

    def event_for(self, at: float) -> trio.Event:
        event = self._events.get(at)
        if event is None:
            event = self._events[at] = trio.Event()
            heapq.heappush(self._heap, at)
        return event

    def after_io_wait(self, timeout: float) -> None:
        # Runs in the loop, after I/O and before deadlines expire: tasks woken here
        # share a batch with the timers due at the same instant.
        heap = self._heap
        if not heap:
            return
        now = trio.current_time()
        while heap and heap[0] <= now:
            event = self._events.pop(heapq.heappop(heap))
            woken = event.statistics().tasks_waiting
            if woken:
                self.instants += 1
                self.shared += woken > 1
                self.max_woken = max(self.max_woken, woken)
            event.set()


class EventTransport(httpx.AsyncBaseTransport):
    """An httpx transport answering from FakeUpstreams, whose bodies wake through
    events shared across paths (see the module docstring).

    ``routes`` is one FakeUpstream (every request goes to it) or a mapping of hosts
    (or ``host:port``) to FakeUpstreams, as for :class:`~polygate.testing.Router`;
    an unknown host raises ``httpx.ConnectError``.  Each upstream's behaviour
    scripts its own requests, in arrival order.  ``tick_s`` (0: exact instants)
    rounds arrival instants up to a multiple of itself.

    It needs nothing opened: the run-loop instrument is added to the current trio
    run by the first request (and again in a later run).
    """

    #: (polygate.transport's ``REPORTS_SENT``) it calls ``SENT_EXTENSION`` itself,
    #: once the request is past its write (see :func:`report_sent`)
    polygate_reports_sent = True

    def __init__(
        self, routes: FakeUpstream | Mapping[str, FakeUpstream], *, tick_s: float = 0.0
    ) -> None:
        if isinstance(routes, FakeUpstream):
            self._default: FakeUpstream | None = routes
            self._routes: dict[str, FakeUpstream] = {}
        else:
            if not isinstance(routes, Mapping):
                raise TypeError(
                    "EventTransport takes a FakeUpstream or a mapping of hosts to FakeUpstreams, "
                    f"got {type(routes).__name__}")
            self._default = None
            # Hosts are matched as httpx gives them: lower case.
            self._routes = {route_key(host): u for host, u in routes.items()}
            if not all(isinstance(u, FakeUpstream) for u in self._routes.values()):
                raise TypeError("EventTransport routes must map hosts to FakeUpstreams")
        if isinstance(tick_s, bool) or not (math.isfinite(tick_s) and tick_s >= 0):
            raise ValueError(f"tick_s must be a finite number >= 0, got {tick_s!r}")
        self.tick_s = float(tick_s)
        self._readiness: _Readiness | None = None

    def __repr__(self) -> str:
        hosts = sorted(self._routes) if self._default is None else ["*"]
        return f"<EventTransport hosts={hosts} tick_s={self.tick_s}>"

    def statistics(self) -> EventStatistics:
        """Wake-ups in the current (or last) trio run."""
        r = self._readiness
        if r is None:
            return EventStatistics()
        return EventStatistics(r.instants, r.shared, r.max_woken)

    # ------------------------------------------------------------------ time

    def arrival(self, at: float) -> float:
        """The instant data due at ``at`` is seen: ``at`` rounded up to the tick."""
        tick = self.tick_s
        if tick == 0.0:
            return at
        # The small slack keeps a multiple of the tick from rounding up a whole tick.
        return math.ceil(at / tick - 1e-9) * tick

    async def _wait_for(self, at: float) -> None:
        """Return once data due at ``at`` has arrived; no checkpoint if it has."""
        at = self.arrival(at)
        if at <= trio.current_time():
            return
        event = self._current().event_for(at)
        # The deadline only makes the loop wake (or MockClock jump) at ``at``; the
        # instrument sets the event first, so the wake-up is a value, not a cancel.
        with trio.CancelScope(deadline=at):
            await event.wait()

    def _current(self) -> _Readiness:
        token = trio.lowlevel.current_trio_token()
        r = self._readiness
        if r is None or r.token is not token:
            r = self._readiness = _Readiness(token)
            trio.lowlevel.add_instrument(r)
        return r

    # ------------------------------------------------------------------ httpx

    def _route(self, request: httpx.Request) -> FakeUpstream:
        if self._default is not None:
            return self._default
        url = request.url
        route: FakeUpstream | None = routed(self._routes, url)
        if route is None:
            raise httpx.ConnectError(f"no fake upstream for host {url.host!r}", request=request)
        return route

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        trio_only()
        upstream = self._route(request)
        raw = await request.aread()
        await trio.lowlevel.checkpoint()  # the write: a cancelled request is never sent
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            plan, rec = upstream._open(
                request.method, request.url.path, headers, raw, failure_status=500,
                query=request.url.query.decode("ascii", "replace"))
        except Exception as exc:  # the script failed: the other faces' 500 (see FakeTransport)
            report_sent(request)
            return script_failed(upstream.name, request.url.path, exc)
        report_sent(request)  # (polygate stamps the attempt as sent here, not before)
        try:
            if plan.head_delay is None:
                await trio.sleep_forever()  # "silent": the head never comes
            head_at = self.arrival(trio.current_time() + plan.head_delay)
            await self._wait_for(head_at)
        except BaseException:
            upstream._finish(rec, "client_closed")
            raise
        response_headers = list(plan.headers)
        if plan.content_length is not None:
            response_headers.append(("content-length", str(plan.content_length)))
        body = _Body(self, upstream, rec, plan, request, head_at)
        return httpx.Response(plan.status, headers=response_headers, stream=body)


class _Body(httpx.AsyncByteStream):
    """One response body; closing it early records ``client_closed``."""

    def __init__(
        self,
        transport: EventTransport,
        upstream: FakeUpstream,
        rec: RecordedRequest | None,
        plan: Plan,
        request: httpx.Request,
        start: float,
    ) -> None:
        self._transport = transport
        self._upstream = upstream
        self._rec = rec
        self._plan = plan
        self._request = request
        self._start = start
        self._iterator: AsyncGenerator[bytes, None] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._iterator = self._iterate()
        return self._iterator

    async def _iterate(self) -> AsyncGenerator[bytes, None]:
        plan = self._plan
        transport = self._transport
        outcome: Outcome = "client_closed"
        buffered: list[bytes] = []
        size = 0
        try:
            schedule = Due(self._start)
            steps = iter(plan.steps)  # (lazy: a long stream is never all in memory)
            following = next(steps, None)
            while following is not None:
                step, following = following, next(steps, None)
                if following is None and plan.ending != "hang":
                    # The last bytes go with the next piece: delivered, as the server
                    # face records them, even to a client that stops asking there.
                    outcome = body_ending(plan, self._request)[0]
                if isinstance(step, Pause):
                    due = schedule.after(step)
                    if transport.arrival(due) <= trio.current_time():
                        continue  # arrived already: it joins the buffered piece
                    if buffered:
                        piece = b"".join(buffered)
                        buffered.clear()
                        size = 0
                        yield piece
                    await transport._wait_for(due)
                else:
                    if type(step) is FaultBytes:
                        # Delivered with this piece: it goes out before any wait
                        # (nothing can close the body between here and that yield).
                        outcome = "fault"
                    buffered.append(step)
                    size += len(step)
                    if size >= _PIECE:
                        piece = b"".join(buffered)
                        buffered.clear()
                        size = 0
                        yield piece
            if buffered:
                piece = b"".join(buffered)
                buffered.clear()
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
