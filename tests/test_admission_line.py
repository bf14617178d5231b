"""Calls waiting for admission on one scope wait in a line, under MockClock: a change of
the governance state wakes the first of them, not all; each admission hands the turn to
the next; a waiter that would give up on what the first one learned still gives up at
once; a waiter that leaves passes its turn on."""

from __future__ import annotations

import math
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import trio
import trio.testing

import polygate
from polygate.governance import MemoryBackend
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import SECRET


def _settings(**source: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, **source),
    ])})


def _asking(tag: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"call {tag}"}]


def _tag(request: Any) -> int:
    return int(request.body["messages"][-1]["content"].split()[1])


class CountingBackend(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.admits = 0

    async def admit(self, request: Any) -> Any:
        self.admits += 1
        return await super().admit(request)


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
