"""Every loop has a floor on its period, every call one deadline (review R3, R6, R8).

Also the mutation gaps in the same area: the deadline is the call's, not a round's;
the TPM window has one membership predicate; non-streaming sources teach the learnt
hedge threshold; non-string content is estimated.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.governance import (
    AdmitRequest,
    CharEstimator,
    Feedback,
    MemoryBackend,
    SettleRequest,
    SourceLimits,
)
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, one_source_settings


async def test_429_with_retry_after_zero_gives_up_after_rate_limit_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R3: rounds of 429s are free of max_attempts, but not free of time.  With
    ``Retry-After: 0`` and no latency the cooldown floor (0.1 s) paces them, and
    ``rate_limit_wait_s`` ends the call."""
    up = FakeUpstream(Reply(status=429, retry_after_s=0))
    settings = one_source_settings(retry=polygate.Retry(rate_limit_wait_s=1.0))
    async with polygate.session(settings, transport=up.transport()) as s:
        t0 = trio.current_time()
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
        elapsed = trio.current_time() - t0
    assert elapsed == pytest.approx(1.0, abs=0.11)
    assert 10 <= len(up.requests) <= 12
    assert all(isinstance(e, polygate.RateLimitedError) for e in info.value.errors)


async def test_429s_under_a_deadline_are_paced_until_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R3 with a deadline: the call ends by its deadline (as soon as no source can be
    admitted before it), having sent at most one request per cooldown floor — not
    thousands in zero virtual seconds."""
    up = FakeUpstream(Reply(status=429, retry_after_s=0))
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        t0 = trio.current_time()
        with pytest.raises((polygate.AllSourcesExhausted, polygate.DeadlineExceeded)):
            await s.chat(MESSAGES, call_deadline_s=5)
        assert 4.8 <= trio.current_time() - t0 <= 5
    assert 45 <= len(up.requests) <= 51


async def test_the_deadline_is_the_calls_not_a_rounds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 10 s deadline ends the call at 10 s although each round alone would fit in it
    (a deadline armed per round would end it at 16 s)."""
    a = FakeUpstream(Reply(status=500, headers_delay_s=8))
    b = FakeUpstream(Reply(first_token_s=8))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name=n, base_url=f"http://{n}/v1", weight=FIRST_A[n])
                 for n in ("a", "b")],
        call_deadline_s=10)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await s.chat(MESSAGES)
    assert info.value.call_stats is not None
    assert info.value.call_stats.total_latency_ms == pytest.approx(10_000)
    assert info.value.call_stats.attempts == 2


class _SlowEstimate(CharEstimator):
    """An estimate that takes 50 ms of (virtual) time, like tiktoken on a long prompt."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self._clock = clock

    def prompt_tokens(self, messages: Any) -> int:
        self._clock.jump(0.05)
        return super().prompt_tokens(messages)


async def test_a_deadline_reached_waiting_for_a_permit_is_deadline_exceeded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R8: one deadline base.  The estimate runs after the call started; the wait for
    the only permit and the call's deadline end at the same instant, and the call
    raises DeadlineExceeded — not AllSourcesExhausted with no errors."""
    up = FakeUpstream(Reply(first_token_s=30))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)])})
    async with polygate.session(settings, transport=up.transport()) as s:
        s._runtime.governor._estimator = _SlowEstimate(autojump_clock)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.chat, MESSAGES)
            await trio.sleep(1)
            t0 = trio.current_time()
            with pytest.raises(polygate.DeadlineExceeded) as info:
                await s.chat(MESSAGES, call_deadline_s=0.5)
            assert trio.current_time() - t0 == pytest.approx(0.5)
            nursery.cancel_scope.cancel()
    assert isinstance(info.value, TimeoutError)
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 0


@pytest.mark.parametrize("cost", [1, 600])
async def test_an_entry_that_left_the_window_never_changes_it(
    autojump_clock: trio.testing.MockClock, cost: int
) -> None:
    """R6: admitted at 0.3, settled at 60.3 — exactly when it leaves the window, where
    ``0.3 + 60 <= 60.3`` and ``0.3 > 60.3 - 60`` are both true in floating point.  The
    settle must not add ``cost - estimate`` to a window it no longer belongs to, in
    either direction (negative drift over-admits; positive drift locks the source)."""
    backend = MemoryBackend()
    limits = SourceLimits(tpm=600)
    await trio.sleep(0.3)
    admission = await backend.admit(AdmitRequest("chat", "a", limits, 262))
    await trio.sleep_until(60.3)
    await backend.settle(SettleRequest(admission, cost, Feedback.SUCCESS))  # type: ignore[arg-type]
    snap = await backend.snapshot("chat", "a")
    assert (snap.requests_in_window, snap.tokens_in_window) == (0, 0)
    granted = [await backend.admit(AdmitRequest("chat", "a", limits, 200)) for _ in range(4)]
    assert sum(isinstance(g, polygate.governance.Admission) for g in granted) == 3
    assert (await backend.snapshot("chat", "a")).tokens_in_window == 600


async def test_non_streaming_sources_teach_the_learnt_threshold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A source that cannot stream has no first token: its whole-call times feed the
    quantile sketch, so ``after_quantile`` hedges it too."""
    a = FakeUpstream(Reply(first_token_s=2.0))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        hedge=polygate.Hedge(after_quantile=0.5))})
    async with polygate.session(settings, transport=Router({"a": a, "b": a})) as s:
        for _ in range(20):  # the sketch answers from its 20th sample
            r = await s.chat(MESSAGES)
            assert r.source == "a"
        learnt = s._runtime.sketch("chat", "a").quantile(0.5)
    assert learnt == pytest.approx(2.0, rel=0.02)


def test_non_string_content_is_estimated() -> None:
    """Content-part lists, tool calls and images all reserve tokens; an image part by
    a flat cost, not by the length of its data URI."""
    est = CharEstimator()
    plain = est.prompt_tokens([{"role": "user", "content": "x" * 400}])
    parts = est.prompt_tokens([{"role": "user", "content": [{"type": "text", "text": "x" * 400}]}])
    assert parts == plain
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1_000_000}}
    with_image = est.prompt_tokens([{"role": "user", "content": [
        {"type": "text", "text": "x" * 400}, image]}])
    assert with_image == plain + 765
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"city": "' + "y" * 400 + '"}'}}]}
    assert est.prompt_tokens([call]) > est.prompt_tokens([{"role": "assistant", "content": ""}]) + 100

