"""A token exactly at a watchdog's limit is in time (review finding).

SPEC §4: a stream is stalled when silent *longer* than ``stall_timeout_s``, and
``ttft_timeout_s`` wants a first token *within* it; the statistics already count a
gap equal to the threshold as no stall.  The watchdog's deadline fell in the instant
the token came, and trio cancelled the read that brought it: a StreamStalled, an
attempt failed as stalled, or "no first token within ttft_timeout_s", on every
scheduling order."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router, Schedule

from .conftest import MESSAGES

ANSWER = " ".join(f"w{i}" for i in range(20))


def _settings(stream: polygate.StreamWatch, **source: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", **source)],
        stream=stream, retry=polygate.Retry(max_attempts=1))})


@pytest.mark.parametrize("seed", range(4))
def test_a_committed_stream_silent_exactly_stall_timeout_is_not_stalled(seed: int) -> None:
    async def main() -> str:
        a = FakeUpstream(Reply(text=ANSWER, stall_at=10, stall_s=5.0))  # one gap of 5.0 s
        async with polygate.session(_settings(polygate.StreamWatch(stall_timeout_s=5.0)),
                                    transport=Router({"a": a})) as s:
            async with s.stream_chat(MESSAGES) as stream:
                return "".join([c.text async for c in stream])

    assert Schedule(seed).run(main) == ANSWER


async def test_a_chat_silent_exactly_stall_timeout_is_not_stalled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text=ANSWER, stall_at=10, stall_s=5.0))
    async with polygate.session(_settings(polygate.StreamWatch(stall_timeout_s=5.0)),
                                transport=Router({"a": a})) as s:
        r = await s.chat(MESSAGES)
    assert r.text == ANSWER and r.call_stats.stall_count == 1  # 5.0 s > the 2 s threshold


@pytest.mark.parametrize(("first_token_s", "in_time"), [(5.0, True), (5.001, False)])
async def test_a_first_token_exactly_at_ttft_timeout_is_in_time(
    autojump_clock: trio.testing.MockClock, first_token_s: float, in_time: bool
) -> None:
    """(The grace is a microsecond, not a loophole: 1 ms late is late.)"""
    a = FakeUpstream(Reply(text=ANSWER, first_token_s=first_token_s))
    async with polygate.session(_settings(polygate.StreamWatch(), ttft_timeout_s=5.0),
                                transport=Router({"a": a})) as s:
        if in_time:
            r = await s.chat(MESSAGES)
            assert r.text == ANSWER and r.call_stats.ttft_ms == pytest.approx(5000)
            return
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    assert "no first token within ttft_timeout_s=5.0" in str(info.value.errors[0])


@pytest.mark.parametrize("offset", [1e9, 1e11, 1e12])
@pytest.mark.parametrize("limit", ["stall_timeout_s", "ttft_timeout_s", "timeout_s"])
def test_a_token_exactly_at_its_limit_is_in_time_late_in_a_long_clock(offset: float, limit: str) -> None:
    """Review finding (a session living for weeks): the microsecond of grace, added to
    a trio time past ~2**34 s (a MockClock jumped that far), rounded away (the floats
    there are 15 µs apart at 1e11): the watchdog fired in the very instant of a token
    exactly at its limit."""
    reply = {
        "stall_timeout_s": Reply(text=ANSWER, stall_at=10, stall_s=5.0),
        "ttft_timeout_s": Reply(text=ANSWER, first_token_s=5.0),
        "timeout_s": Reply(text=ANSWER, first_token_s=5.0, inter_token_s=0.0),
    }[limit]
    stream = polygate.StreamWatch(stall_timeout_s=5.0) if limit == "stall_timeout_s" else polygate.StreamWatch()
    source: dict[str, Any] = {"ttft_timeout_s": {"ttft_timeout_s": 5.0}, "timeout_s": {"timeout_s": 5.0}}.get(limit, {})

    async def main() -> str:
        async with polygate.session(_settings(stream, **source),
                                    transport=Router({"a": FakeUpstream(reply)})) as s:
            async with s.stream_chat(MESSAGES) as st:
                return "".join([c.text async for c in st])

    clock = trio.testing.MockClock(autojump_threshold=0)
    clock.jump(offset)
    assert trio.run(main, clock=clock) == ANSWER
