"""A source's latency, as its health counts it: the wait for its first token, not the
answer's length; and a latency that fades with time, as failures do, so that one slow
answer does not keep a source off the scope's traffic for as long as the scope lives.

Outside review (how work is spread, 2026-12-06): with latency counted send to settle
and never forgotten, a session whose first call was a long answer (2,000 tokens at a
fast pace: 60 s) sent 2 of its next 300 calls to that source, and a source whose first
answer came after 60 s (a cold start) got 9 of the 300 calls of the next 5 minutes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.governance._picking import Health
from polygate.testing import FakeUpstream, Reply, Router

MSG = [{"role": "user", "content": "hi"}]


def two_sources(**scope: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name=name, base_url=f"http://{name}/v1") for name in ("a", "b")], **scope)})


async def test_a_long_answer_does_not_make_a_source_look_slow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def reply(request: Any, rng: Any) -> Reply:
        long = request.body.get("max_tokens") == 2000
        return Reply(first_token_s=0.3, inter_token_s=0.03, tokens=2000 if long else 10)

    upstreams = {name: FakeUpstream(reply, name=name) for name in ("a", "b")}
    async with polygate.session(two_sources(), transport=Router(upstreams),
                                rng=random.Random(2)) as s:
        long_source = (await s.chat(MSG, max_tokens=2000)).source
        picked = [(await s.chat(MSG, max_tokens=50)).source for _ in range(300)]
        health = {x.state.source: x.health for x in (await s.statistics()).governance.sources}
    assert picked.count(long_source) >= 100, (long_source, picked.count(long_source), health)
    assert health[long_source].latency_ewma_s == pytest.approx(0.3, abs=0.05)


@pytest.mark.parametrize("slow_s", [60.0, 120.0])
async def test_a_source_slow_once_takes_its_share_again(
    slow_s: float, autojump_clock: trio.testing.MockClock,
) -> None:
    slow = [True]

    def b_reply(request: Any, rng: Any) -> Reply:
        first_token_s, slow[0] = (slow_s if slow[0] else 0.5), False  # a cold start, once
        return Reply(first_token_s=first_token_s, tokens=1)

    upstreams = {"a": FakeUpstream(Reply(first_token_s=0.5, tokens=1), name="a"),
                 "b": FakeUpstream(b_reply, name="b")}
    async with polygate.session(two_sources(), transport=Router(upstreams),
                                rng=random.Random(5)) as s:
        while slow[0]:
            await s.chat(MSG)
        picked = []
        for _ in range(300):  # a call a second: 5 minutes
            await trio.sleep(1.0)
            picked.append((await s.chat(MSG)).source)
    assert picked[-100:].count("b") >= 30, (picked[-100:].count("b"), picked.count("b"))


async def test_a_source_that_stays_slow_still_gets_less(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What the latency is for still holds: a source whose first token always comes
    ten times later than its twin's takes a small share, probed now and then."""
    upstreams = {"a": FakeUpstream(Reply(first_token_s=0.2, tokens=20), name="a"),
                 "b": FakeUpstream(Reply(first_token_s=2.0, tokens=20), name="b")}
    async with polygate.session(two_sources(), transport=Router(upstreams),
                                rng=random.Random(7)) as s:
        for _ in range(20):  # both are known
            await s.chat(MSG)
        picked = []
        for _ in range(300):
            await trio.sleep(0.5)
            picked.append((await s.chat(MSG)).source)
    assert 1 <= picked.count("b") <= 45, picked.count("b")


def test_a_latency_weighs_less_as_it_ages() -> None:
    health = Health()
    health.success(10.0, now=0.0)
    fresh = health.score(1.0, now=0.0)
    assert fresh == pytest.approx(0.1)
    assert fresh < health.score(1.0, now=30.0) < health.score(1.0, now=120.0) < 1.0
    assert health.score(1.0, now=30.0) == pytest.approx(0.1 ** 0.5)
    # the next sample counts for more against an old latency than against a fresh one
    aged, fresh_twin = Health(), Health()
    aged.success(10.0, now=0.0)
    fresh_twin.success(10.0, now=100.0)
    aged.success(1.0, now=100.0)
    fresh_twin.success(1.0, now=100.0)
    assert fresh_twin.latency == pytest.approx(10.0 - 0.2 * 9.0)
    assert aged.latency is not None and aged.latency < 2.0
    # a source no slower than the reference is not touched by age
    fast = Health()
    fast.success(1.0, now=0.0)
    assert fast.score(1.0, now=0.0) == fast.score(1.0, now=1000.0) == 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_hung_source_stays_off_a_quiet_scope(
    seed: int, autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fading: a latency learnt from waits cut by the call's deadline
    (a hung source: no breaker, no failure) faded like any, and in a scope of a call a
    minute the hung source was back to half the calls (44-48 of 100 cut, against 5-7).
    Each such wait cost a caller its call: it does not fade."""
    upstreams = {"a": FakeUpstream(Reply(first_token_s=0.1), name="a"),
                 "b": FakeUpstream(Reply(first_token_s=10_000), name="b")}
    settings = two_sources(call_deadline_s=2.0)
    cut = 0
    async with polygate.session(settings, transport=Router(upstreams),
                                rng=random.Random(seed)) as s:
        for _ in range(100):
            await trio.sleep(60.0)  # a call a minute
            try:
                await s.chat(MSG)
            except polygate.DeadlineExceeded:
                cut += 1
    assert cut <= 20, cut


def test_a_latency_from_waits_does_not_fade() -> None:
    health = Health()
    health.success(1.0, now=0.0)
    health.waited(20.0, reference_latency=1.0, now=10.0)
    assert health.score(0.5, now=10.0) == health.score(0.5, now=1000.0) < 0.1
    health.success(0.5, now=1000.0)  # it answered: what it says fades again
    assert health.score(0.5, now=1000.0) < health.score(0.5, now=1100.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_source_slow_once_then_hung_stays_off(
    seed: int, autojump_clock: trio.testing.MockClock,
) -> None:
    """Second review: waits were compared with the latency as learnt (a stale 60 s),
    while the score saw it faded: 30 s deadline cuts taught nothing, and a source slow
    once, then hung, was back at a score of 1 and half the calls (43-47 of 100 cut)."""
    hung = [False]

    def b_reply(request: Any, rng: Any) -> Reply:
        return Reply(first_token_s=10_000 if hung[0] else 60.0, tokens=1)

    upstreams = {"a": FakeUpstream(Reply(first_token_s=0.1), name="a"),
                 "b": FakeUpstream(b_reply, name="b")}
    settings = two_sources(call_deadline_s=30.0)
    cut = 0
    async with polygate.session(settings, transport=Router(upstreams),
                                rng=random.Random(seed)) as s:
        while not hung[0]:  # b's cold start: its first answer after 60 s
            hung[0] = (await s.chat(MSG, call_deadline_s=None)).source == "b"
        for _ in range(100):
            await trio.sleep(10.0)
            try:
                await s.chat(MSG)
            except polygate.DeadlineExceeded:
                cut += 1
    assert cut <= 20, cut
