"""The scheduling-aware kit: EventTransport, Schedule and the hypothesis strategies.

EventTransport must send exactly FakeUpstream's bytes, at FakeUpstream's times; what
differs is *how* bodies wake: through events shared by every body due at one
instant (runnable in one batch with the timers due then), and with whatever has
already arrived handed over without a checkpoint.  Each difference is shown against
FakeUpstream's own transport, where it does not hold.
"""

from __future__ import annotations

import math
import random
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, find, given, settings

import polygate
from polygate.testing import (
    EventStatistics,
    EventTransport,
    FakeUpstream,
    Reply,
    Router,
    Schedule,
)
from polygate.testing import strategies as pst

URL = "http://fake/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _body(stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _exchange(
    transport: httpx.AsyncBaseTransport, stream: bool = True, path: str = URL
) -> tuple[int, list[tuple[str, str]], list[tuple[float, bytes]], str | None]:
    """Status, headers, (arrival time, piece) of the body, and the error that ended it."""
    request = httpx.Request("POST", path, json=_body(stream))
    response = await transport.handle_async_request(request)
    pieces: list[tuple[float, bytes]] = []
    error = None
    try:
        async for piece in response.aiter_raw():
            pieces.append((trio.current_time(), piece))
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    finally:
        await response.aclose()
    return response.status_code, list(response.headers.items()), pieces, error


def _joined(pieces: list[tuple[float, bytes]]) -> list[tuple[float, bytes]]:
    """Pieces arriving at one instant, joined (EventTransport hands them over as one)."""
    out: list[tuple[float, bytes]] = []
    for at, piece in pieces:
        if out and out[-1][0] == at:
            out[-1] = (at, out[-1][1] + piece)
        else:
            out.append((at, piece))
    return out


WIRE = [
    Reply(),
    Reply(first_token_s=1.5, inter_token_s=0.25, tokens=4, stall_at=2, stall_s=3.0),
    Reply(first_token_s=2.0, keepalive_s=0.5, tokens=2),
    Reply(status=429, retry_after_s=0),
    Reply(status=429, retry_after_ms=0, headers_delay_s=0.1),
    Reply(status=503, headers_delay_s=0.5),
    Reply(status=401),
    Reply(tokens=3, fault="error_event", fault_after=1),
    Reply(tokens=3, fault="truncated", fault_after=2),
    Reply(tokens=3, fault="reset", fault_after=1, first_token_s=0.5),
    Reply(tokens=3, fault="malformed_json", fault_after=1),
    Reply(fault="html"),
    Reply(fault="no_choices"),
    Reply(stream=False, first_token_s=1.0, tokens=5),
    Reply(stream=False, fault="truncated"),
    Reply(stream=False, fault="reset"),
]


@pytest.mark.parametrize("reply", WIRE, ids=lambda r: repr(r)[6:60])
@pytest.mark.parametrize("stream", [True, False])
async def test_same_wire_and_times_as_fake_upstream(
    autojump_clock: trio.testing.MockClock, reply: Reply, stream: bool
) -> None:
    fake, evented = FakeUpstream(reply, seed=3), FakeUpstream(reply, seed=3)
    t0 = trio.current_time()
    expected = await _exchange(fake.transport(), stream)
    t1 = trio.current_time()
    got = await _exchange(EventTransport(evented), stream)
    status, headers, pieces, error = expected
    assert got[:2] == (status, headers)
    assert got[3] == error
    shifted = [(at - t0 + t1, piece) for at, piece in _joined(pieces)]
    assert got[2] == shifted  # same bytes, at the same instants
    assert [(r.status, r.outcome) for r in evented.requests] == [
        (r.status, r.outcome) for r in fake.requests
    ]
    assert evented.in_flight == 0


async def _race(transport_of: Any, seed_order: list[str]) -> tuple[bool, bytes]:
    """Bodies a and b both due at t=2; whichever runs first cancels the other's scope
    (a commit).  Returns whether b was cancelled and what b received."""
    a = FakeUpstream(Reply(first_token_s=2.0, inter_token_s=1.0, tokens=3), name="a")
    b = FakeUpstream(Reply(first_token_s=2.0, tokens=3), name="b")  # all of it at t=2
    transport = transport_of({"a": a, "b": b})
    b_scope = trio.CancelScope()
    got = bytearray()

    async def read(host: str) -> None:
        request = httpx.Request("POST", f"http://{host}/v1/chat/completions", json=_body())
        response = await transport.handle_async_request(request)
        try:
            # piece 0: the role chunk, at once; piece 1: what arrives at t=2
            async for index, piece in _enumerate(response.aiter_raw()):
                if index == 1:
                    seed_order.append(host)
                    if host == "a":
                        b_scope.cancel()  # "commit": cancel the other path
                if host == "b":
                    got.extend(piece)
        finally:
            await response.aclose()

    async def read_b() -> None:
        with b_scope:
            await read("b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, "a")
        nursery.start_soon(read_b)
    return b_scope.cancelled_caught, bytes(got)


async def _enumerate(pieces: Any) -> Any:
    index = 0
    async for piece in pieces:
        yield index, piece
        index += 1


def test_bodies_due_together_wake_in_one_batch_and_finish_their_buffered_tail() -> None:
    """a and b get their first tokens at the same instant.  Through EventTransport
    both are woken in one batch: when a runs first and cancels b, b is already
    runnable and finishes its buffered answer (b's cancel comes only at a
    checkpoint, and there is none left) — the race polygate must handle.  Through
    FakeUpstream's transport b's wake-up is a deadline, which a's cancel overrides."""
    outcomes = {"event": set(), "fake": set()}
    for seed in range(16):
        for kind, make in (("event", EventTransport), ("fake", Router)):
            order: list[str] = []
            cancelled, got = Schedule(seed).run(_race, make, order)
            first = order[0] if order else None
            outcomes[kind].add((first, cancelled, got.endswith(b"data: [DONE]\n\n")))
    # EventTransport: b completes its answer whichever ran first, and is never cancelled
    assert outcomes["event"] == {("a", False, True), ("b", False, True)}
    # FakeUpstream's transport: when a runs first, b's wake-up is lost to the cancel
    assert ("a", True, False) in outcomes["fake"]


async def test_a_late_reader_finds_the_tail_buffered(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(first_token_s=1.0, inter_token_s=0.5, tokens=6))
    request = httpx.Request("POST", URL, json=_body())
    response = await EventTransport(up).handle_async_request(request)
    pieces = response.aiter_raw()
    first = await pieces.__anext__()  # the role chunk, at once
    assert b"assistant" in first
    await trio.sleep(60)  # the consumer is busy; the whole answer arrives meanwhile
    with trio.CancelScope() as scope:
        scope.cancel()
        rest = [piece async for piece in pieces]  # no checkpoint: no Cancelled
    assert not scope.cancelled_caught
    assert len(rest) == 1 and rest[0].endswith(b"data: [DONE]\n\n")
    assert up.requests[0].outcome == "complete"


def test_arrivals_share_a_batch_with_the_timers_due_then() -> None:
    """An arrival and a timer due at the same instant are runnable in the same batch,
    so either may run first (as a readable socket and an expired timeout in one loop
    iteration)."""
    firsts = set()
    for seed in range(16):

        async def race() -> str:
            order: list[str] = []
            transport = EventTransport(FakeUpstream(Reply(headers_delay_s=1.0)))

            async def timer() -> None:
                await trio.sleep(1.0)
                order.append("timer")

            async def arrival() -> None:
                request = httpx.Request("POST", URL, json=_body())
                response = await transport.handle_async_request(request)
                order.append("arrival")
                await response.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(timer)
                nursery.start_soon(arrival)
            return order[0]

        firsts.add(Schedule(seed).run(race))
    assert firsts == {"timer", "arrival"}


async def test_tick_rounds_arrival_instants_up(autojump_clock: trio.testing.MockClock) -> None:
    transport = EventTransport(
        {"a": FakeUpstream(Reply(headers_delay_s=1.02)), "b": FakeUpstream(Reply(headers_delay_s=1.07))},
        tick_s=0.1,
    )
    arrived: list[float] = []

    async def one(host: str) -> None:
        request = httpx.Request("POST", f"http://{host}/v1/chat/completions", json=_body())
        response = await transport.handle_async_request(request)
        arrived.append(trio.current_time())
        await response.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "a")
        nursery.start_soon(one, "b")
    assert arrived == [pytest.approx(1.1)] * 2
    assert transport.statistics() == EventStatistics(instants=1, shared=1, max_woken=2)
    assert transport.arrival(0.3) == pytest.approx(0.3)  # a multiple stays put
    assert transport.arrival(1.1) == transport.arrival(1.05)


async def test_silent_upstreams_and_cancelled_requests_close_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream([Reply(fault="silent"), Reply(first_token_s=50)])
    transport = EventTransport(up)
    with trio.move_on_after(5):
        await transport.handle_async_request(httpx.Request("POST", URL, json=_body()))
    with trio.move_on_after(5):
        await _exchange(transport)
    with trio.CancelScope() as scope:
        scope.cancel()  # cancelled at the write: never reaches the upstream
        await transport.handle_async_request(httpx.Request("POST", URL, json=_body()))
    assert [r.outcome for r in up.requests] == ["client_closed", "client_closed"]
    assert up.in_flight == 0


def test_works_again_in_a_later_run_and_on_the_real_clock() -> None:
    up = FakeUpstream(Reply(first_token_s=0.05, inter_token_s=0.01, tokens=3))
    transport = EventTransport(up)
    for _ in range(2):  # a new trio run gets its own instrument
        status, _, pieces, error = trio.run(_exchange, transport)  # real clock
        assert (status, error) == (200, None)
        assert pieces[-1][1].endswith(b"data: [DONE]\n\n")
        assert pieces[-1][0] - pieces[0][0] >= 0.05
    assert [r.outcome for r in up.requests] == ["complete", "complete"]


async def test_routes_and_arguments() -> None:
    a = FakeUpstream(name="a")
    transport = EventTransport({"a": a, "b:8080": FakeUpstream(name="b")})
    assert "hosts=['a', 'b:8080']" in repr(transport)
    assert transport.statistics() == EventStatistics()
    with pytest.raises(httpx.ConnectError, match="no fake upstream for host 'c'"):
        await transport.handle_async_request(httpx.Request("POST", "http://c/v1/x"))
    status, _, _, _ = await _exchange(transport, path="http://b:8080/v1/chat/completions")
    assert status == 200
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="tick_s"):
            EventTransport(a, tick_s=bad)
    with pytest.raises(TypeError, match="FakeUpstreams"):
        EventTransport({"a": Router({"a": a})})  # type: ignore[dict-item]


async def test_polygate_stream_through_event_transport(autojump_clock: trio.testing.MockClock) -> None:
    """The kit drives a real session: both paths of a hedged stream wake at t=10."""
    a = FakeUpstream(Reply(first_token_s=10, inter_token_s=1, text="alpha beta"), name="a")
    b = FakeUpstream(Reply(first_token_s=2, text="one two"), name="b")
    transport = EventTransport({"a": a, "b": b})
    settings_ = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        hedge=polygate.Hedge(after_s=8))})
    async with polygate.session(settings_, transport=transport, rng=random.Random(0)) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    assert stream.response is not None
    assert transport.statistics().shared == 1  # a's and b's first tokens: one batch
    assert a.in_flight == b.in_flight == 0


# ---------------------------------------------------------------------- Schedule


async def _woken_order() -> list[int]:
    order: list[int] = []
    event = trio.Event()

    async def waiter(i: int) -> None:
        await event.wait()
        order.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(waiter, i)
        await trio.sleep(1)
        event.set()
    return order


def test_a_schedule_is_one_reproducible_interleaving() -> None:
    from trio._core import _run

    state = _run._r.getstate()
    flag = _run._ALLOW_DETERMINISTIC_SCHEDULING
    orders = [tuple(Schedule(seed).run(_woken_order)) for seed in (1, 1, 2, 3, 4)]
    assert orders[0] == orders[1]  # same seed, same order
    assert len(set(orders)) >= 3  # other seeds, other orders (8! of them)
    assert _run._r.getstate() == state and flag == _run._ALLOW_DETERMINISTIC_SCHEDULING

    async def now() -> float:
        return trio.current_time()

    assert Schedule(5).run(now) == 0.0  # MockClock by default
    with pytest.raises(TypeError):
        Schedule("7")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- strategies


def test_strategies_reach_the_interesting_values() -> None:
    zero = find(pst.replies(), lambda r: r.status == 429 and r.retry_after_s == 0)
    assert zero.retry_after_s == 0
    assert find(pst.replies(), lambda r: r.first_token_s == 60.0).first_token_s == 60.0
    assert find(pst.replies(), lambda r: r.fault == "silent").fault == "silent"
    tail = find(pst.replies(), lambda r: r.status == 200 and r.tokens > 2 and r.inter_token_s == 0)
    assert tail.fault is None  # a whole answer arriving with its first token
    assert find(pst.instants(), lambda t: t == 0.3) == 0.3  # the decimal, not 0.1 * 3
    assert find(pst.cancellations(), lambda t: t is None) is None
    assert find(pst.hedges(), lambda h: h.after_quantile is not None).after_quantile == 0.9
    assert find(pst.schedules(), lambda s: s.seed > 1000).seed > 1000
    with pytest.raises(ValueError, match="per_second"):
        pst.instants(per_second=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=pst.replies(), hedge=pst.hedges(), at=pst.instants(most=2.0, per_second=4))
def test_strategies_build_valid_values(reply: Reply, hedge: polygate.Hedge, at: float) -> None:
    assert isinstance(reply, Reply) and isinstance(hedge, polygate.Hedge)
    assert 0 <= at <= 2.0 and (at * 4).is_integer()
    if reply.stall_at is not None:
        assert 1 <= reply.stall_at <= max(1, reply.tokens)
    assert reply.fault_after <= reply.tokens


@settings(max_examples=20, deadline=None)
@given(schedule=pst.schedules(), reply=pst.replies(statuses=(200,), faults=(None,)))
def test_strategies_drive_a_scheduled_exchange(schedule: Schedule, reply: Reply) -> None:
    status, _, pieces, error = schedule.run(_exchange, EventTransport(FakeUpstream(reply)))
    assert (status, error) == (200, None)
    body = b"".join(p for _, p in pieces)
    assert body.endswith(b"data: [DONE]\n\n" if reply.stream is None else b"}")



def test_the_fakes_say_when_a_request_is_written() -> None:
    """polygate stamps an attempt as sent when a transport that says itself when it
    writes calls the request's SENT_EXTENSION (REPORTS_SENT); for any other
    transport, on hand-over.  The fakes say it: a request a fake never recorded was
    never sent, in the statistics too (see test_hedge's instant test)."""
    from polygate.transport import REPORTS_SENT
    from polygate.transport._pool import reports_sent

    up = FakeUpstream(Reply())
    assert reports_sent(up.transport()) and reports_sent(EventTransport(up))
    assert reports_sent(Router({"a": up})) and getattr(Router({"a": up}), REPORTS_SENT) is True
    # A route that cannot say (any other httpx transport): the Router cannot either.
    assert not reports_sent(Router({"a": up, "b": httpx.MockTransport(lambda r: httpx.Response(200))}))
    assert not reports_sent(httpx.MockTransport(lambda r: httpx.Response(200)))
    # polygate's own transport says it too, as a route as well.
    lean = polygate.transport.LeanTransport()
    assert reports_sent(lean) and reports_sent(Router({"a": up, "b": lean}))


async def test_a_fault_the_client_stops_at_is_recorded_as_delivered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As in FakeUpstream's other faces: a client that reads up to a malformed line and
    closes was sent the fault."""
    up = FakeUpstream(Reply(tokens=6, inter_token_s=0.1, fault="malformed_json", fault_after=2))
    response = await EventTransport(up).handle_async_request(
        httpx.Request("POST", URL, json=_body()))
    try:
        async for piece in response.aiter_raw():
            if b"unterminated" in piece:
                break
    finally:
        await response.aclose()
    assert up.requests[0].outcome == "fault"
