"""Calls waiting for admission on one scope wait in a line, under MockClock: a change of
the governance state wakes the first of them, not all; each admission hands the turn to
the next; a waiter that would give up on what the first one learned still gives up at
once; a waiter that leaves passes its turn on."""

from __future__ import annotations

import functools
import math
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import SECRET, CountingBackend


def _settings(**source: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, **source),
    ])})


def _asking(tag: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"call {tag}"}]


def _tag(request: Any) -> int:
    return int(request.body["messages"][-1]["content"].split()[1])


async def test_a_permit_back_wakes_one_waiter_not_every_one(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every change used to wake every waiting call, and each asked the backend again:
    N waiters cost N admission passes a permit, O(N^2) in all (9 ms of CPU a call with
    2,000 calls on four permits)."""
    backend = CountingBackend()
    monkeypatch.setattr("polygate._session._backend_for", lambda settings: backend)
    a = FakeUpstream(Reply(first_token_s=1))
    calls = 300
    async with polygate.session(_settings(max_in_flight=3), transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            for i in range(calls):
                nursery.start_soon(s.chat, _asking(i))
        stats = await s.statistics()
    assert len(a.requests) == calls
    assert a.peak_in_flight == 3
    assert trio.current_time() == pytest.approx(calls / 3)
    assert next(x.state for x in stats.governance.sources).in_flight == 0
    # Each call: one pass on arrival, one when its turn comes, and at most one more
    # when a permit's return woke it first in the line while another took the permit.
    assert backend.admits <= 3 * calls


async def test_waiters_are_admitted_in_arrival_order(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=1))
    async with polygate.session(_settings(max_in_flight=1), transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(s.chat, _asking(i))
                await trio.sleep(0.01)
    assert [_tag(r) for r in a.requests] == list(range(30))


async def test_a_waiter_that_leaves_the_line_passes_its_turn_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=5))
    outcomes: dict[int, Any] = {}

    async def call(i: int) -> None:
        outcomes[i] = await s.chat(_asking(i))

    waiting = trio.CancelScope()

    async def first_in_line() -> None:
        with waiting:
            await call(1)

    async with polygate.session(_settings(max_in_flight=1), transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 0)
            await trio.sleep(0.1)
            nursery.start_soon(first_in_line)
            await trio.sleep(0.1)
            nursery.start_soon(call, 2)
            await trio.sleep(1)
            waiting.cancel()  # the first in the line leaves before any permit comes back
    assert sorted(outcomes) == [0, 2]
    assert [_tag(r) for r in a.requests] == [0, 2]
    assert a.requests[1].started_at == pytest.approx(5)  # at once when the permit came back


async def test_a_waiter_behind_the_first_still_gives_up_as_soon_as_it_knows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first waiter has time to wait out a long cooldown; the ones behind it do
    not, and learn it when the first does: they fail at once (rate limited, with the
    time to wait), not at their deadline."""
    a = FakeUpstream([Reply(status=429, retry_after_s=100, headers_delay_s=1), Reply()])
    errors: dict[int, BaseException] = {}
    ended: dict[int, float] = {}

    async def call(i: int, deadline: float) -> None:
        try:
            await s.chat(_asking(i), call_deadline_s=deadline)
        except polygate.PolygateError as exc:
            errors[i] = exc
        ended[i] = trio.current_time()

    async with polygate.session(_settings(max_in_flight=1), transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 0, 500)  # holds the permit, then is rate limited
            await trio.sleep(0.1)
            nursery.start_soon(call, 1, 500)  # first in the line: can wait 100 s
            await trio.sleep(0.1)
            for i in range(2, 6):
                nursery.start_soon(call, i, 30)  # cannot
    for i in range(2, 6):
        assert isinstance(errors[i], polygate.AllSourcesExhausted), errors[i]
        assert ended[i] == pytest.approx(1), i
        assert errors[i].retry_after_s == pytest.approx(100, abs=1)
    assert 0 not in errors and 1 not in errors


def _first_come_first_served(
    arrivals: list[float], duration: float, cancels: list[float | None], permits: int
) -> dict[int, float]:
    """When each call starts on ``permits`` permits, first come first served, with no
    permit idle while a call waits (calls cancelled at their time, waiting or not)."""
    starts: dict[int, float] = {}
    running: dict[int, float] = {}  # call -> when it frees its permit
    waiting: list[int] = []
    events = sorted({*arrivals, *(c for c in cancels if c is not None)})
    now = 0.0
    pending = list(range(len(arrivals)))
    while pending or waiting or running:
        frees = min(running.values(), default=float("inf"))
        upcoming = min((t for t in events if t > now), default=float("inf"))
        now = min(frees, upcoming) if (running or waiting or pending) else now
        for i, end in list(running.items()):
            if end <= now:
                del running[i]
        for i in list(pending):
            if arrivals[i] <= now:
                pending.remove(i)
                waiting.append(i)
        for i in list(waiting):
            if cancels[i] is not None and cancels[i] <= now:  # type: ignore[operator]
                waiting.remove(i)
        while waiting and len(running) < permits:
            i = waiting.pop(0)
            starts[i] = now
            end = now + duration
            cancel = cancels[i]
            running[i] = min(end, cancel) if cancel is not None else end
        if now == float("inf"):
            break
    return starts


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    gaps=st.lists(st.integers(1, 30), min_size=1, max_size=12),
    duration=st.integers(1, 5),
    cancel_after=st.lists(st.one_of(st.none(), st.integers(1, 60)), min_size=12, max_size=12),
    permits=st.integers(1, 3),
)
def test_admission_is_first_come_first_served_and_leaves_no_permit_idle(
    gaps: list[int], duration: int, cancel_after: list[int | None], permits: int
) -> None:
    """Arrivals, durations and cancellations on separate grids (no two at one instant):
    every call starts exactly when a first-come-first-served line with no idle permit
    says, whoever leaves the line and when; the permits all come back."""
    arrivals = [0.1 * sum(gaps[: i + 1]) + 0.013 for i in range(len(gaps))]
    length = duration + 0.0071
    cancels = [
        None if c is None else arrivals[i] + 0.29 * c + 0.0037 for i, c in enumerate(cancel_after[: len(gaps)])
    ]
    expected = _first_come_first_served(arrivals, length, cancels, permits)

    async def main() -> None:
        a = FakeUpstream(Reply(first_token_s=length, tokens=1))
        async with polygate.session(_settings(max_in_flight=permits), transport=Router({"a": a})) as s:
            async def call(i: int) -> None:
                await trio.sleep_until(arrivals[i])
                with trio.CancelScope(deadline=cancels[i] if cancels[i] is not None else math.inf):
                    await s.chat(_asking(i))

            async with trio.open_nursery() as nursery:
                for i in range(len(arrivals)):
                    nursery.start_soon(call, i)
            stats = await s.statistics()
        started = {_tag(r): r.started_at for r in a.requests}
        assert started.keys() == expected.keys()
        for i, at in expected.items():
            assert started[i] == pytest.approx(at, abs=1e-6), (i, started, expected)
        state = next(x.state for x in stats.governance.sources)
        assert state.in_flight == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# review: where the first waiter's refusals do not hold for the others --------------------


def _two(a: dict[str, Any], b: dict[str, Any]) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, weight=1.0, **a),
        polygate.Source(name="b", base_url="http://b/v1", api_key=SECRET, weight=1e-9, **b),
    ])})


async def _one_by_one(nursery: trio.Nursery, *calls: Any) -> None:
    """Start each call 0.1 s after the one before: each finds the others waiting."""
    for call in calls:
        nursery.start_soon(call)
        await trio.sleep(0.1)


def _sent(tag: int, *upstreams: FakeUpstream) -> float:
    return next(r.started_at for u in upstreams for r in u.requests if _tag(r) == tag)


async def test_a_smaller_call_is_not_kept_behind_a_first_too_large_for_the_free_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Source a's tpm is too small for the first waiter's estimate, ever; both sources
    busy.  When a's permit comes back, the smaller call behind it takes it at once (it
    waited for b, 90 s longer, behind the first)."""
    a = FakeUpstream(Reply(first_token_s=10, tokens=5))
    b = FakeUpstream(Reply(first_token_s=100, tokens=5))
    async with polygate.session(_two({"tpm": 1000, "max_in_flight": 1},
                                     {"tpm": 100_000, "max_in_flight": 1}),
                                transport=Router({"a": a, "b": b})) as s:
        async with trio.open_nursery() as nursery:
            await _one_by_one(
                nursery,
                functools.partial(s.chat, _asking(0)),  # a
                functools.partial(s.chat, _asking(1)),  # b (a is full)
                functools.partial(s.chat, _asking(2), max_tokens=5000),  # never a
                functools.partial(s.chat, _asking(3), max_tokens=10),
            )
    assert _sent(3, a, b) == pytest.approx(10)


async def test_a_cooldown_the_first_cannot_see_the_end_of_is_watched_by_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Source a cools down (a 429) until t=10 and is too small for the first waiter
    anyway; b is busy until t=100.  The smaller call behind it is sent on a at 10."""
    a = FakeUpstream([Reply(status=429, retry_after_s=10), Reply(tokens=2)])
    b = FakeUpstream(Reply(first_token_s=100, tokens=5))
    async with polygate.session(_two({"tpm": 1000}, {"tpm": 100_000, "max_in_flight": 1}),
                                transport=Router({"a": a, "b": b})) as s:
        async with trio.open_nursery() as nursery:
            await _one_by_one(
                nursery,
                functools.partial(s.chat, _asking(0)),  # a: 429, then b for 100 s
                functools.partial(s.chat, _asking(1), max_tokens=5000),
                functools.partial(s.chat, _asking(2), max_tokens=10),
            )
    assert _sent(2, a, b) == pytest.approx(10)


async def test_a_waiter_whose_own_estimate_cannot_fit_in_time_gives_up_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first waiter (a small estimate) would fit the tpm window at 60 when the
    permit comes back at 25; the one behind it (a larger estimate, a deadline at 70)
    only at 80: it fails at 25, as a waiter that learns it cannot make its deadline
    does, not when its turn or its deadline comes."""
    a = FakeUpstream([
        Reply(first_token_s=1, tokens=400),  # 401 tokens at 0..1
        Reply(first_token_s=5, tokens=550),  # 551 tokens at 20..25
        Reply(first_token_s=1, tokens=5),
    ])
    ended: dict[int, float] = {}
    errors: dict[int, BaseException] = {}

    async def call(i: int, deadline: float, max_tokens: int) -> None:
        try:
            await s.chat(_asking(i), call_deadline_s=deadline, max_tokens=max_tokens)
        except polygate.PolygateError as exc:
            errors[i] = exc
        ended[i] = trio.current_time()

    async with polygate.session(_settings(tpm=1000, max_in_flight=1), transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            await call(0, 100, 400)
            await trio.sleep_until(20)
            nursery.start_soon(call, 1, 100, 560)
            await trio.sleep(0.1)
            nursery.start_soon(call, 2, 1000, 90)
            await trio.sleep(0.1)
            nursery.start_soon(call, 3, 70 - trio.current_time(), 490)
    assert isinstance(errors[3], polygate.AllSourcesExhausted), errors
    assert ended[3] == pytest.approx(25)
    assert 2 not in errors


@pytest.mark.integration
async def test_a_hung_redis_fails_every_waiter_at_once() -> None:
    """Redis stops answering while a dozen calls wait in line: each fails typed within
    about the backend's timeout, not one after another as turns pass (review: the last
    after 2.4 s)."""
    import os
    import secrets
    import signal

    from ._redis_server import need_redis, running_redis
    from ._serve_kit import wait_for

    waiters = 12
    with running_redis(need_redis()) as server:
        assert server.proc is not None
        url = f"{server.url}?prefix=line{secrets.token_hex(4)}&timeout_s=0.3"
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)])}, backend=url)
        upstream = FakeUpstream(Reply(first_token_s=30, tokens=2))
        ended: dict[int, float] = {}
        errors: dict[int, BaseException] = {}
        try:
            async with polygate.session(settings, transport=upstream.transport()) as s:
                async def call(i: int) -> None:
                    try:
                        await s.chat(_asking(i), call_deadline_s=25)
                    except polygate.PolygateError as exc:
                        errors[i] = exc
                    ended[i] = trio.current_time()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(call, 0)  # holds the only permit for 30 s
                    await wait_for(lambda: upstream.in_flight == 1)
                    for i in range(1, waiters + 1):
                        nursery.start_soon(call, i)
                    await wait_for(lambda: len(s._runtime.governor._lines.get(("chat", frozenset()), ())) == waiters)
                    os.kill(server.proc.pid, signal.SIGSTOP)
                    stopped = trio.current_time()
                    await wait_for(lambda: len(ended) == waiters, limit_s=15)
                    nursery.cancel_scope.cancel()
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    assert {type(errors[i]) for i in range(1, waiters + 1)} == {polygate.GovernanceBackendError}
    assert max(ended[i] for i in range(1, waiters + 1)) - stopped < 1.2


async def test_equal_waiters_behind_a_first_too_large_for_a_source_all_fail_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review (second): sources a (too small for the first waiter's estimate) and b
    each hold a call that ends in a 429 with Retry-After 60 at 9.5 and 10 s: every
    source the small waiters could use cools down past their deadline (40).  Each fails
    at once (AllSourcesExhausted at 10), not with DeadlineExceeded at 40."""
    a = FakeUpstream([Reply(headers_delay_s=10, status=429, retry_after_s=60), Reply(tokens=2)])
    b = FakeUpstream([Reply(headers_delay_s=9.5, status=429, retry_after_s=60), Reply(tokens=2)])
    ended: dict[int, tuple[str, float]] = {}

    async def call(i: int, deadline: float, max_tokens: int) -> None:
        try:
            await s.chat(_asking(i), call_deadline_s=deadline, max_tokens=max_tokens)
            ended[i] = ("ok", trio.current_time())
        except polygate.PolygateError as exc:
            ended[i] = (type(exc).__name__, trio.current_time())

    async with polygate.session(_two({"tpm": 1000, "max_in_flight": 1},
                                     {"tpm": 100_000, "max_in_flight": 1}),
                                transport=Router({"a": a, "b": b})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 0, 15, 10)  # a
            await trio.sleep(0.1)
            nursery.start_soon(call, 1, 15, 10)  # b
            await trio.sleep(0.1)
            nursery.start_soon(call, 2, 1000, 5000)  # never a: waits for b
            await trio.sleep(0.1)
            for i in (3, 4, 5):
                nursery.start_soon(call, i, 40 - trio.current_time(), 10)
                await trio.sleep(0.1)
            await trio.sleep(50)
            nursery.cancel_scope.cancel()
    for i in (3, 4, 5):
        assert ended[i] == ("AllSourcesExhausted", pytest.approx(10)), ended


async def test_a_woken_waiter_cancelled_before_it_asks_leaves_nobody_stuck(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review (second): the waiter that a permit's return woke is cancelled before it
    asks; the one behind it still gets the permit at once."""
    a = FakeUpstream(Reply(first_token_s=10, tokens=5))
    b = FakeUpstream(Reply(first_token_s=100, tokens=5))
    first_small = trio.CancelScope()

    async def cancellable() -> None:
        with first_small:
            await s.chat(_asking(3), max_tokens=10)

    async with polygate.session(_two({"tpm": 1000, "max_in_flight": 1},
                                     {"tpm": 100_000, "max_in_flight": 1}),
                                transport=Router({"a": a, "b": b})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.chat, _asking(0))  # a until 10
            await trio.sleep(0.1)
            nursery.start_soon(s.chat, _asking(1))  # b until 100
            await trio.sleep(0.1)
            nursery.start_soon(functools.partial(s.chat, _asking(2), max_tokens=5000))  # never a
            await trio.sleep(0.1)
            nursery.start_soon(cancellable)
            await trio.sleep(0.1)
            nursery.start_soon(functools.partial(s.chat, _asking(4), max_tokens=10))
            await trio.sleep_until(10)
            first_small.cancel()  # in the instant the permit comes back
    assert _sent(4, a, b) == pytest.approx(10)


def test_the_same_news_in_another_order_is_told_once() -> None:
    """Review (third): the first's refusals come in picking order, which is random; the
    same state read in another order is not news (each telling scans the whole line)."""
    from polygate.governance import Refusal, RefusalReason
    from polygate.governance._line import Line, Waiter

    line = Line()
    for _ in range(3):
        line.join(Waiter(math.inf, math.inf, True))
    a = Refusal("a", RefusalReason.COOLING_DOWN, 10.0)
    b = Refusal("b", RefusalReason.RPM, 20.0)
    asked: list[Waiter] = []

    def gives_up(waiter: Waiter) -> bool:
        asked.append(waiter)
        return False

    line.wake_if([a, b], gives_up)
    line.wake_if([b, a], gives_up)
    assert len(asked) == 2  # the two behind the first, once
    line.wake_if([a], gives_up)
    assert len(asked) == 4


# review (fairness): a caller that calls again the moment its call ends ----------------


@pytest.mark.parametrize("seed", range(4))
def test_a_worker_pool_larger_than_the_permits_shares_them_in_turn(seed: int) -> None:
    """A fairness review: a call that ends returns its permit and wakes the first in
    the line, but a worker that calls again at once (``for item in items: await
    s.chat(item)``) arrived in the same step, asked before the woken one ran, and took
    the permit, every time: of eight workers on four permits, four had nothing until
    the other four had done all their items (first answers at 1 s and 51 s), and a call
    without a deadline behind such a loop waited for ever.  Whatever order trio's
    scheduler runs them in, the line is now served in turn."""
    from polygate.testing import Schedule

    first_answer: dict[int, float] = {}

    async def main() -> None:
        a = FakeUpstream(Reply(first_token_s=1))
        async with polygate.session(_settings(max_in_flight=4), transport=Router({"a": a})) as s:
            async def worker(w: int) -> None:
                for i in range(6):
                    await s.chat(_asking(100 * w + i))
                    first_answer.setdefault(w, trio.current_time())

            async with trio.open_nursery() as nursery:
                for w in range(8):
                    nursery.start_soon(worker, w)

    Schedule(seed).run(main)
    assert sorted(first_answer.values()) == [1.0] * 4 + [2.0] * 4, first_answer


@pytest.mark.parametrize("seed", range(4))
def test_a_loop_of_calls_does_not_keep_waiters_without_a_deadline_out(seed: int) -> None:
    """The same review, one loop on one permit and three callers arriving meanwhile
    (no deadline: they would have waited for ever): each is served in turn, the loop's
    next call behind them."""
    from polygate.testing import Schedule

    waited: list[float] = []

    async def main() -> None:
        a = FakeUpstream(Reply(first_token_s=1))
        async with polygate.session(_settings(max_in_flight=1), transport=Router({"a": a})) as s:
            async def loop() -> None:
                for i in range(100):
                    await s.chat(_asking(i))

            async def caller(i: int) -> None:
                await trio.sleep(0.5 + 0.01 * i)  # (in this order, while the loop's call runs)
                start = trio.current_time()
                await s.chat(_asking(1000 + i))
                waited.append(trio.current_time() - start)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop)
                async with trio.open_nursery() as callers:
                    for i in range(3):
                        callers.start_soon(caller, i)
                nursery.cancel_scope.cancel()

    Schedule(seed).run(main)
    assert waited == pytest.approx([1.5 - 0.0, 2.5 - 0.01, 3.5 - 0.02]), waited


async def test_a_first_woken_during_its_own_round_trip_holds_no_newcomer_back(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review of the change above: a waiter whose turn came while its own ask was
    on the wire (a Redis round trip) went on to watch the backend as the first, its
    alarm still set: it read as woken and not yet asked, and every newcomer meanwhile
    gave it 64 passes of the scheduler in vain."""
    from polygate.governance._memory import MemoryBackend

    asked_by: list[trio.lowlevel.Task] = []

    class RoundTrip(MemoryBackend):
        turn_during_ask = False

        async def admit(self, request: Any) -> Any:
            asked_by.append(trio.lowlevel.current_task())
            await trio.lowlevel.checkpoint()  # the round trip
            if self.turn_during_ask:
                self.turn_during_ask = False
                [line] = governor._lines.values()
                first = line.first()
                assert first is not None
                first.wake()  # its turn, come while it asks
            return await super().admit(request)

    backend = RoundTrip()
    monkeypatch.setattr("polygate._session._backend_for", lambda settings: backend)

    a = FakeUpstream(Reply(first_token_s=10))
    async with polygate.session(_settings(max_in_flight=1), transport=Router({"a": a})) as s:
        governor = s._runtime.governor
        async with trio.open_nursery() as nursery:
            await _held_and_first(s, nursery)
            backend.turn_during_ask = True
            backend._notify()  # a change: the first asks again, its turn comes meanwhile
            await trio.sleep(1)
            before_asking = await _steps_before_asking(s, nursery, 2, asked_by)
    assert before_asking < 10, before_asking  # (64 and more before)


async def test_a_backend_error_behind_the_first_holds_no_newcomer_back(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review of the change above: a backend error on another waiter's ask woke every
    waiter (wake_all), the first too, which watches the backend, not its alarm: it read
    as woken until its next wake-up, and newcomers gave it 64 passes in vain."""
    from polygate import GovernanceBackendError
    from polygate.governance._memory import MemoryBackend

    asked_by: list[trio.lowlevel.Task] = []

    class Failing(MemoryBackend):
        fail_next = False

        async def admit(self, request: Any) -> Any:
            asked_by.append(trio.lowlevel.current_task())
            if self.fail_next:
                self.fail_next = False
                raise GovernanceBackendError("redis blip")
            return await super().admit(request)

    backend = Failing()
    monkeypatch.setattr("polygate._session._backend_for", lambda settings: backend)

    async def quietly(i: int) -> None:
        try:
            await s.chat(_asking(i))
        except polygate.PolygateError:
            pass  # (the blip's)

    a = FakeUpstream(Reply(first_token_s=10))
    async with polygate.session(_settings(max_in_flight=1), transport=Router({"a": a})) as s:
        governor = s._runtime.governor
        async with trio.open_nursery() as nursery:
            await _held_and_first(s, nursery)
            nursery.start_soon(quietly, 2)  # second in the line
            await trio.sleep(1)
            [line] = governor._lines.values()
            second = list(line._waiters)[1]
            backend.fail_next = True
            second.wake()  # it asks again; the backend fails it: wake_all
            await trio.sleep(1)
            first = line.first()
            assert first is not None and first.mark is not None  # still watching the backend
            before_asking = await _steps_before_asking(s, nursery, 3, asked_by)
    assert before_asking < 10, before_asking


async def _steps_before_asking(
    s: polygate.Session, nursery: trio.Nursery, tag: int, asked_by: list[trio.lowlevel.Task]
) -> int:
    """The scheduler steps a call arriving now takes (within half a second) before it
    asks the backend."""
    steps: dict[trio.lowlevel.Task, int] = {}
    newcomer: list[trio.lowlevel.Task] = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            steps[task] = steps.get(task, 0) + 1

    async def arrive() -> None:
        newcomer.append(trio.lowlevel.current_task())
        await s.chat(_asking(tag))

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        nursery.start_soon(arrive)
        await trio.sleep(0.5)
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert newcomer[0] in asked_by
    return steps[newcomer[0]]


async def _held_and_first(s: polygate.Session, nursery: trio.Nursery) -> None:
    """A call holding the only permit (its answer comes at 10 s), and one first in the
    line behind it."""
    nursery.start_soon(s.chat, _asking(0))
    await trio.sleep(1)
    nursery.start_soon(s.chat, _asking(1))
    await trio.sleep(1)
