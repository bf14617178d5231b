"""Admission and governance through the Governor and the call path, under MockClock:
picking, quotas with reserve/settle, the breaker, permits, cooldowns, waiting."""

from __future__ import annotations

import contextlib
import json
import random
from collections import Counter
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.governance import (
    BreakerState,
    CharEstimator,
    Health,
    completion_budget,
    pick_order,
)
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, SECRET, CountingBackend


def _settings(*, names: tuple[str, ...] = ("a", "b"), weights: dict[str, float] | None = None,
              source: dict[str, dict[str, Any]] | None = None, **scope: Any) -> polygate.Settings:
    w = weights or {}
    src = source or {}
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, weight=w.get(n, 1.0),
                        **src.get(n, {}))
        for n in names], **scope)})


def _state(stats: polygate.SessionStatistics, name: str) -> Any:
    return next(s.state for s in stats.governance.sources if s.state.source == name)


# picking ---------------------------------------------------------------------------------


def test_pick_order_follows_weights() -> None:
    rng = random.Random(1)
    firsts = Counter(pick_order(["a", "b", "c"], [3.0, 1.0, 1.0], rng)[0] for _ in range(10_000))
    assert firsts["a"] / 10_000 == pytest.approx(0.6, abs=0.02)
    assert firsts["b"] / 10_000 == pytest.approx(0.2, abs=0.02)


async def test_a_subnormal_weight_is_picked_last_not_a_division_by_zero(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: ``Source.weight=5e-324`` passes validation (> 0), and times a health
    score below 1 it is 0.0: picking divided by it (a bare ZeroDivisionError)."""
    b = FakeUpstream(Reply(text="from b"))
    settings = _settings(weights={"a": 5e-324, "b": 1.0})
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply()), "b": b})) as s:
        governor: Any = s._runtime.governor  # type: ignore[attr-defined]
        governor._health[("chat", "a")].failed(trio.current_time())  # a score below 1
        for _ in range(5):
            assert (await s.chat(MESSAGES)).source == "b"
    assert pick_order(["a", "b"], [0.0, 1.0], random.Random(1)) == ["b", "a"]


@pytest.mark.parametrize("weight", [1e-310, 5e-324, 1e-300, 1e300])
def test_equal_weights_come_first_by_chance_however_small(weight: float) -> None:
    """Outside review (how work is spread): the key log(u) / w overflowed to -inf for
    weights under ~1e-306, and two sources of equal weight 1e-310 split 1,955 to 45
    (5e-324: 2,000 to 0), by name."""
    rng = random.Random(3)
    firsts = Counter(pick_order(["a", "b"], [weight, weight], rng)[0] for _ in range(4_000))
    assert firsts["a"] / 4_000 == pytest.approx(0.5, abs=0.04)
    thirds = Counter(pick_order(["a", "b"], [weight, weight * 3 if weight < 1e300 else weight / 3],
                                rng)[0] for _ in range(4_000))
    share = thirds["b"] if weight < 1e300 else thirds["a"]
    assert share / 4_000 == pytest.approx(0.75, abs=0.04)


def test_pick_order_excludes_and_demotes() -> None:
    rng = random.Random(2)
    for _ in range(200):
        order = pick_order(["a", "b", "c", "d"], [1, 1, 1, 1], rng, exclude={"b"}, demote=["d", "a"])
        assert order[0] == "c" and order[1:] == ["d", "a"]


def test_health_score() -> None:
    fresh, failing, slow = Health(), Health(), Health()
    for _ in range(5):
        failing.failed()
        slow.success(4.0)
        fresh.success(1.0)
    ref = 1.0
    assert fresh.score(ref) == 1.0
    assert slow.score(ref) == pytest.approx(0.25)
    assert 0.05 <= failing.score(ref) < 0.5
    for _ in range(50):
        failing.failed()
    assert failing.score(ref) == pytest.approx(0.05)  # a floor: it stays pickable to recover


async def test_failing_source_is_picked_less(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=500))
    b = FakeUpstream(Reply())
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b}),
                                rng=random.Random(3)) as s:
        for _ in range(200):
            await s.chat(MESSAGES)
    assert len(a.requests) < 60  # equal weights, but a's health collapses


# estimates and usage ----------------------------------------------------------------------


def test_estimates() -> None:
    est = CharEstimator()
    short = est.prompt_tokens([{"role": "user", "content": "hi"}])
    long = est.prompt_tokens([{"role": "user", "content": "hi " * 400}])
    assert 0 < short < long and long >= 300
    assert completion_budget({}, 256) == 256
    assert completion_budget({"max_tokens": 50}, 256) == 50
    assert completion_budget({"max_completion_tokens": 70, "max_tokens": 50}, 256) == 70
    assert completion_budget({"max_tokens": 50, "n": 3}, 256) == 150
    assert completion_budget({"max_tokens": True}, 256) == 256
    # review: a max_completion_tokens that is no limit (null, 0) hid max_tokens: a call
    # that fitted a TPM quota was refused as too large
    assert completion_budget({"max_completion_tokens": None, "max_tokens": 50}, 256) == 50
    assert completion_budget({"max_completion_tokens": 0, "max_tokens": 50}, 256) == 50
    # review (2026-12-03): a whole float is the same JSON number to a pydantic-based
    # upstream (vLLM, SGLang take 5000.0 as 5000), so it reserves what the int does
    assert completion_budget({"max_tokens": 5000.0}, 256) == 5000
    assert completion_budget({"max_completion_tokens": 70.0, "max_tokens": 50}, 256) == 70
    assert completion_budget({"max_tokens": 100, "n": 50.0}, 256) == 5000
    assert completion_budget({"max_tokens": 1e300}, 256) == 10**12  # capped, exact
    # review (2026-12-06): so is a string of digits (pydantic's lax mode reads "5000"
    # as 5000): quoted, a limit slipped past a key's tpm reservation
    assert completion_budget({"max_tokens": "5000"}, 256) == 5000
    assert completion_budget({"max_tokens": " 100 ", "n": "50"}, 256) == 5000
    assert completion_budget({"max_tokens": "9" * 5000}, 256) == 10**12  # capped, no int()
    # as pydantic 2's lax mode reads them (review: "+5000" and "5_000" slipped past, and
    # leading zeros were read as the cap)
    for spelled in ("+5000", "5_000", "5000.0", "+5_000.00", "\t5000\n", "0000000000000005000",
                    "\u00a05000", "5000\u3000", "\u20035000\x85"):  # (Unicode blanks too)
        assert completion_budget({"max_tokens": spelled}, 256) == 5000, spelled
    for no_limit in (50.5, -50.0, float("inf"), float("nan"), "50.5", "-50", "0", "", "٥٠",
                     "5e3", "5000.", "5__000", "_5000", "5000_", "0x10", "000", False):
        assert completion_budget({"max_tokens": no_limit}, 256) == 256, no_limit


async def test_tools_and_a_response_format_are_part_of_the_prompts_estimate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An upstream bills tool definitions and a response format's schema as input: an
    agent's long tool list reserved nothing against tpm (an outside review, tenants of
    one gateway, 2026-12-05).  Counted as their JSON, about four characters a token."""
    from polygate.governance._estimate import params_tokens

    tool = {"type": "function", "function": {"name": "f", "description": "d" * 4000,
                                             "parameters": {"type": "object"}}}
    assert params_tokens({}) == 0 and params_tokens({"temperature": 0.5}) == 0
    assert 1000 < params_tokens({"tools": [tool]}) < 1100
    assert params_tokens({"tools": [tool], "response_format": {"type": "json_object"}}) > \
        params_tokens({"tools": [tool]})
    up = FakeUpstream(Reply(tokens=2, usage=False))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", tpm=1200)])})
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as refused:
            await s.chat(MESSAGES, tools=[tool], max_tokens=300)  # ~1,010 + 300 > 1,200
        assert refused.value.too_large
        await s.chat(MESSAGES, tools=[tool], max_tokens=100)
        snap = (await s.statistics()).governance.sources[0]
    assert snap.state.reserved_total > 1100  # (its reservation: the prompt with its tool)


async def test_a_schema_and_an_ocr_response_format_are_part_of_the_estimate_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``chat(schema=S)`` sends S (a response_format, or an instruction), the same bytes
    the caller's own response_format sends, and an OCR call's parameters go to every
    page: neither was reserved (a review of the estimate's fix, 2026-12-05)."""
    import base64

    schema = {"type": "object", "description": "d" * 4000, "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    up = FakeUpstream(Reply(text='{"city": "Paris"}'))
    settings = polygate.Settings(scopes={
        name: polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1", tpm=tpm)])
        for name, tpm in (("chat", 600), ("ocr", 1000))})
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as refused:
            await s.chat(MESSAGES, schema=schema, max_tokens=10)
        assert refused.value.too_large
        png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwAD"
                               "hgGAWjR9awAAAABJRU5ErkJggg==")
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
        with pytest.raises(polygate.AllSourcesExhausted) as refused:
            await s.ocr(png, response_format=rf, max_tokens=10)  # ~1,030 for the format alone
        assert refused.value.too_large
        # A small schema still fits.
        r = await s.chat(MESSAGES, schema={"type": "object", "properties": {"city": {"type": "string"}}},
                         max_tokens=10)
        assert r.parsed == {"city": "Paris"}
    assert len(up.requests) == 1


@pytest.mark.parametrize("kind", [[], {"a": 1}, ["image_url"], 3.5, None])
def test_a_content_part_of_any_type_is_estimated(kind: Any) -> None:
    """Outside review (fuzzing the gateway's bodies): a part whose ``type`` was a list
    or an object raised ``TypeError: unhashable type`` from the estimate (a 500 from
    ``polygate serve``, a bare TypeError from ``chat()``).  The part is counted by its
    JSON, and the upstream judges it."""
    part = {"type": kind, "payload": "x" * 400}
    tokens = CharEstimator().prompt_tokens([{"role": "user", "content": [part]}])
    assert tokens > 100


def test_a_part_typed_by_a_str_subclass_is_still_media() -> None:
    """Review of the fix above: ``type(kind) is str`` took a string enum's member equal
    to "image_url" for no media, and counted a 400 kB data URI as text (100,000 tokens)."""
    import enum

    class Part(str, enum.Enum):
        IMAGE = "image_url"

    image = {"type": Part.IMAGE, "image_url": {"url": "data:image/png;base64," + "A" * 400_000}}
    assert CharEstimator().prompt_tokens([{"role": "user", "content": [image]}]) < 1000


@pytest.mark.parametrize(
    "usage",
    [None, {"prompt_tokens": -5, "completion_tokens": 3}, {"prompt_tokens": 10**12, "completion_tokens": 1},
     {"prompt_tokens": "ten"}, "garbage"],
)
async def test_untrustworthy_usage_settles_the_estimate(usage: Any) -> None:
    body: dict[str, Any] = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                         "finish_reason": "stop"}]}
    if usage is not None:
        body["usage"] = usage

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    settings = _settings(names=("a",), source={"a": {"streaming": False, "tpm": 10**9}})
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        r = await s.chat(MESSAGES, max_tokens=40)
        stats = await s.statistics()
    assert r.usage is not None and r.usage.source == "estimated"
    assert r.usage.completion_tokens == 40
    state = _state(stats, "a")
    assert state.tokens_in_window == state.reserved_total == r.usage.total_tokens


async def test_a_stream_left_after_more_than_its_estimate_settles_what_it_streamed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a cancelled attempt settled its estimate whatever it had streamed: a
    caller that leaves just before the end of a long answer (the usage chunk never
    comes) paid a 256-token budget for 400 -- a quota anyone could step around.
    SPEC §3 keeps the estimate for a cost that is *unknown*; 400 tokens are known."""
    from polygate.testing import FakeUpstream, Reply, Router

    settings = _settings(names=("a",), source={"a": {"tpm": 10**9}})
    upstream = FakeUpstream(Reply(tokens=400, stall_at=400, stall_s=30))
    async with polygate.session(settings, transport=Router({"a": upstream})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            seen = 0
            async for chunk in stream:
                seen += chunk.text != ""
                if seen == 400:
                    break  # the answer's end (and its usage) never read
        state = _state(await s.statistics(), "a")
    estimate = state.reserved_total
    prompt = estimate - 256
    assert state.tokens_in_window == prompt + 400 > estimate


async def test_an_answered_stream_without_usage_settles_at_least_what_it_streamed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the floor held for a stream left before its end but not for one read to
    its end without a usage chunk: the whole answer paid less than a part of it.  The
    estimated usage the caller is shown says the same."""
    from polygate.testing import FakeUpstream, Reply, Router

    settings = _settings(names=("a",), source={"a": {"tpm": 10**9}})
    upstream = FakeUpstream(Reply(tokens=400, usage=False))
    async with polygate.session(settings, transport=Router({"a": upstream})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
        state = _state(await s.statistics(), "a")
    prompt = state.reserved_total - 256
    assert state.tokens_in_window == prompt + 400
    usage = stream.response.usage if stream.response is not None else None
    assert usage is not None and usage.source == "estimated"
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, 400)


# quotas ----------------------------------------------------------------------------------


def _max_in_window(times: list[float], window: float = 60.0) -> int:
    times = sorted(times)
    best = 0
    j = 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


async def test_rpm_is_never_exceeded_and_calls_wait(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply())
    settings = _settings(names=("a",), source={"a": {"rpm": 3}})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(s.chat, MESSAGES)
    starts = [r.started_at for r in a.requests]
    assert len(starts) == 10
    assert _max_in_window(starts) == 3
    assert sorted(starts)[-1] == pytest.approx(180)  # 3 at 0, 60, 120; the tenth at 180


@pytest.mark.parametrize(("tokens", "third_at"), [(10, 1.0), (100, 60.0)])
async def test_tpm_counts_reservations_then_real_usage(
    tokens: int, third_at: float, autojump_clock: trio.testing.MockClock
) -> None:
    a = FakeUpstream(Reply(tokens=tokens, first_token_s=1))
    settings = _settings(names=("a",), source={"a": {"tpm": 250}})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        # each call reserves prompt (~10) + max_tokens 100: two fit, the third waits for
        # their settlement; if they really used ~110 tokens each it waits for the window
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(lambda: s.chat(MESSAGES, max_tokens=100))
    starts = sorted(r.started_at for r in a.requests)
    assert starts[:2] == [0, 0]
    assert starts[2] == pytest.approx(third_at)


async def test_a_tpm_wait_within_the_deadline_is_not_given_up_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: with a call deadline, the third call of the case above gave up at t=0
    (AllSourcesExhausted "tpm"), taking the window's expiry (t=60, past the deadline)
    for the earliest admission, though the two open reservations settled at t=1 far
    below their estimates and let it in.  SPEC §3: a primary waits for admission,
    bounded by the deadline."""
    a = FakeUpstream(Reply(tokens=10, first_token_s=1))
    settings = _settings(names=("a",), source={"a": {"tpm": 250}}, call_deadline_s=30)
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(lambda: s.chat(MESSAGES, max_tokens=100))
        stats = await s.statistics()
    assert sorted(r.started_at for r in a.requests) == [0, 0, pytest.approx(1.0)]
    assert _state(stats, "a").in_flight == 0 and _state(stats, "a").tokens_reserved == 0


async def test_a_tpm_waiter_wakes_when_the_window_frees_while_a_reservation_is_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix above: with the time unknown while a reservation was open, a
    waiter woke only on a settle: a long stream (open for 190 s) kept a call that fits
    once the window frees (t=60) waiting to t=190, or past its deadline.  The window's
    time stays the wake time; it is only not a reason to give up."""
    a = FakeUpstream([Reply(first_token_s=1, inter_token_s=1, tokens=190), Reply(tokens=2)])
    settings = _settings(names=("a",), source={"a": {"tpm": 100}}, call_deadline_s=100)
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        async with s.stream_chat(MESSAGES, max_tokens=70) as stream:
            await stream.__anext__()  # open for 190 s, its ~80 tokens in the window
            assert (await s.chat(MESSAGES, max_tokens=30)).text  # ~40 more: fits at t=60
    assert [r.started_at for r in a.requests] == [0, pytest.approx(60.0)]


async def test_a_tpm_refusal_past_the_deadline_still_fails_as_soon_as_it_is_known(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The other side: once nothing is open, the window's expiry is exact, and a call
    whose deadline comes first fails then, not at its deadline."""
    a = FakeUpstream(Reply(tokens=100, first_token_s=1))
    settings = _settings(names=("a",), source={"a": {"tpm": 250}}, call_deadline_s=30)
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        await s.chat(MESSAGES, max_tokens=100)
        await s.chat(MESSAGES, max_tokens=100)  # ~220 tokens used, nothing open
        started = trio.current_time()
        with pytest.raises(polygate.AllSourcesExhausted, match="tpm"):
            await s.chat(MESSAGES, max_tokens=100)
        assert trio.current_time() == started


@pytest.mark.parametrize(("b_limits", "deadline"), [({"max_in_flight": 1}, None), ({"rpm": 1}, 30.0)])
async def test_a_waiting_call_takes_a_dead_source_back_when_its_cooldown_ends(
    autojump_clock: trio.testing.MockClock, b_limits: dict[str, int], deadline: float | None,
) -> None:
    """Review: a call waiting for b's permit (busy for 100 s) ignored that a, dead after
    a 401, was back at t=5: it waited until t=100.  And with b over its RPM until t=60
    and a 30 s deadline, the call gave up at t=0 though a was back at t=5.  A dead
    source is never waited for alone, but a call that waits anyway takes it back."""
    base = {"api_key": SECRET}
    a = FakeUpstream([Reply(status=401), Reply()])
    b = FakeUpstream(Reply(first_token_s=100) if "max_in_flight" in b_limits else Reply())
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", **base),
        polygate.Source(name="b", base_url="http://b/v1", weight=1e-9, **base, **b_limits),
    ], call_deadline_s=deadline)}, dead_cooldown_s=5)
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        async with trio.open_nursery() as nursery:
            first_done = trio.Event()

            async def first() -> None:
                await s.chat(MESSAGES)  # a: 401 (dead for 5 s), then b
                first_done.set()

            nursery.start_soon(first)
            if "rpm" in b_limits:
                await first_done.wait()  # b's one request this minute is spent
            else:
                await trio.sleep(1.0)  # b's one permit is held until t=100
            r = await s.chat(MESSAGES)
            assert r.source == "a"
            assert trio.current_time() == pytest.approx(5.0)
            nursery.cancel_scope.cancel()
        stats = await s.statistics()
    assert all(_state(stats, n).in_flight == 0 for n in "ab")


async def test_a_429_that_outlasts_a_dead_mark_is_waited_for_once_the_mark_is_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review finding (docs, claim by claim): "a dead mark never outlives its
    cooldown".  a answered 401 (dead for 5 s), then, to a call sent before it, 429 with
    Retry-After: 100: a stayed dead until t=101, and a call at t=11 failed at once
    where it could wait for a (rate_limit_wait_s=600) and get its answer at t=101."""
    a = FakeUpstream([Reply(status=429, retry_after_s=100, headers_delay_s=1), Reply(status=401)],
                     then=Reply(text="ok"))
    settings = polygate.Settings(dead_cooldown_s=5, scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=600),
    )})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        async def refused() -> None:
            with pytest.raises(polygate.PolygateError):
                await s.chat(MESSAGES)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(refused)  # a: 429 at t=1
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(refused)  # a: 401 at t=0, dead until t=5
        await trio.sleep_until(11)
        state = _state(await s.statistics(), "a")
        assert not state.dead and state.cooldown_until == pytest.approx(101, abs=0.01)
        r = await s.chat(MESSAGES)
        assert r.text == "ok" and trio.current_time() == pytest.approx(101, abs=0.01)


async def test_estimate_larger_than_tpm_fails_at_once(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply())
    settings = _settings(names=("a",), source={"a": {"tpm": 100}})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted, match="too_large") as info:
            await s.chat(MESSAGES, max_tokens=1000)
        assert trio.current_time() == 0
        assert info.value.too_large  # no retry of it is ever admitted
    assert a.requests == []


async def test_too_large_only_for_the_request_as_sent(autojump_clock: trio.testing.MockClock) -> None:
    """Review of ``too_large``: it said "never admitted" when only a fallback scope was
    too small (the asked scope's source had admitted the call and failed with a 500),
    and when only a structured re-ask was (its estimate carries the bad answer): in
    both, the same request asked again is answered."""
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                               retry=polygate.Retry(max_attempts=1), fallback="small"),
        "small": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1", tpm=100)]),
    })
    a = FakeUpstream([Reply(status=500), Reply(text="ok")])
    async with polygate.session(settings, transport=Router({"a": a, "b": FakeUpstream(Reply())})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES, max_tokens=500)
        assert not info.value.too_large
        assert (await s.chat(MESSAGES, max_tokens=500)).text == "ok"

    answers = iter([Reply(text="x" * 4000), Reply(text='{"n": 1}')])
    up = FakeUpstream(lambda request, rng: next(answers))
    settings = _settings(names=("a",), source={"a": {"tpm": 600}})
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted, match="too_large") as info:
            await s.chat(MESSAGES, schema=schema, max_tokens=100)  # the re-ask is too large
        assert not info.value.too_large
        assert (await s.chat(MESSAGES, schema=schema, max_tokens=100)).parsed == {"n": 1}


async def test_max_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(first_token_s=5))
    settings = _settings(names=("a",), source={"a": {"max_in_flight": 2}})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(7):
                nursery.start_soon(s.chat, MESSAGES)
        stats = await s.statistics()
    assert a.peak_in_flight == 2
    assert trio.current_time() == pytest.approx(20)
    assert _state(stats, "a").in_flight == 0


async def test_waiting_does_not_poll(autojump_clock: trio.testing.MockClock,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    backend = CountingBackend()
    monkeypatch.setattr("polygate._session._backend_for", lambda settings: backend)
    a = FakeUpstream(Reply(first_token_s=100))
    settings = _settings(names=("a",), source={"a": {"max_in_flight": 1}})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.chat, MESSAGES)
            nursery.start_soon(s.chat, MESSAGES)
    assert trio.current_time() == pytest.approx(200)
    assert backend.admits <= 4  # 2 grants + one refusal + one retry after the wake-up


# breaker and cooldowns --------------------------------------------------------------------


class _NoJitter(random.Random):
    """random() == 1 - 2**-53: the breaker's equal jitter is then (almost exactly) 1."""

    def random(self) -> float:
        return 1.0 - 2.0**-53


async def test_breaker_opens_probes_and_closes(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream([Reply(status=500)] * 5 + [Reply()])
    settings = _settings(names=("a",), retry=polygate.Retry(max_attempts=1),
                         breaker=polygate.Breaker(open_s=30, max_open_s=60))
    async with polygate.session(settings, transport=Router({"a": a}), rng=_NoJitter()) as s:
        for _ in range(5):
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
        assert _state(await s.statistics(), "a").breaker is BreakerState.OPEN
        # open: the next call waits for the half-open probe (30 s), then succeeds
        r = await s.chat(MESSAGES)
        assert trio.current_time() == pytest.approx(30)
        assert _state(await s.statistics(), "a").breaker is BreakerState.CLOSED
    assert r.call_stats.attempts == 1 and len(a.requests) == 6


async def test_failed_probe_reopens_for_twice_as_long(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream([Reply(status=500)] * 6 + [Reply()])
    settings = _settings(names=("a",), retry=polygate.Retry(max_attempts=1),
                         breaker=polygate.Breaker(open_s=30, max_open_s=60))
    async with polygate.session(settings, transport=Router({"a": a}), rng=_NoJitter()) as s:
        for _ in range(6):  # five to open, the sixth is the failed probe at 30 s
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
        assert trio.current_time() == pytest.approx(30)
        assert _state(await s.statistics(), "a").breaker is BreakerState.OPEN
        await s.chat(MESSAGES)  # the next probe after 2 × 30 s
        assert trio.current_time() == pytest.approx(90)


async def test_the_default_breaker_opens_after_5_failures_for_30_s_then_probes_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The documented defaults: five consecutive failures open the breaker, it stays
    open exactly 30 s whatever the jitter draws (review: the defaults were 5 s, drawn
    in [2.5, 5] s), and then one probe at a time is let through."""
    for seed in range(6):
        a = FakeUpstream([Reply(status=500)] * 5, then=Reply(headers_delay_s=10))
        settings = _settings(names=("a",), retry=polygate.Retry(max_attempts=1))
        async with polygate.session(settings, transport=Router({"a": a}),
                                    rng=random.Random(seed)) as s:
            for _ in range(4):
                with pytest.raises(polygate.AllSourcesExhausted):
                    await s.chat(MESSAGES)
            assert _state(await s.statistics(), "a").breaker is BreakerState.CLOSED
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
            opened_at = trio.current_time()
            assert _state(await s.statistics(), "a").breaker is BreakerState.OPEN
            await trio.sleep_until(opened_at + 29.9)
            with pytest.raises(polygate.AllSourcesExhausted, match="breaker_open"):
                await s.chat(MESSAGES, call_deadline_s=0.05)  # still open: not worth a wait
            assert len(a.requests) == 5
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.chat, MESSAGES)  # the probe: answers after 10 s
                await trio.sleep_until(opened_at + 30 + 1e-3)
                assert len(a.requests) == 6
                with pytest.raises(polygate.DeadlineExceeded):  # one probe at a time
                    await s.chat(MESSAGES, call_deadline_s=5)  # (its end is unknown: waits)
                assert len(a.requests) == 6
            assert _state(await s.statistics(), "a").breaker is BreakerState.CLOSED


async def test_the_default_breaker_opens_on_consecutive_failures_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review: the default breaker also opened on a failure rate (over half of
    the last 20 outcomes, at least 10), so a source failing two calls in three opened
    with never more than two failures in a row.  The documented default opens after 5
    consecutive failures only; the rate rule is there when ``failure_rate`` is set."""
    pattern = [Reply(status=500), Reply(status=500), Reply()] * 10
    for breaker, opens in ((polygate.Breaker(), False), (polygate.Breaker(failure_rate=0.5), True)):
        a = FakeUpstream(pattern)
        settings = _settings(names=("a",), retry=polygate.Retry(max_attempts=1), breaker=breaker)
        states = []
        async with polygate.session(settings, transport=Router({"a": a})) as s:
            for _ in range(30):
                with contextlib.suppress(polygate.AllSourcesExhausted):
                    await s.chat(MESSAGES, call_deadline_s=1)
                states.append(_state(await s.statistics(), "a").breaker)
        assert (BreakerState.OPEN in states) is opens, states


async def test_without_a_backoff_every_opening_lasts_open_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The default (``max_open_s`` unset): a failed probe opens the breaker for exactly
    ``open_s`` again, whatever the jitter draws: the documented 30 s, then one probe."""
    for seed in range(6):
        a = FakeUpstream([Reply(status=500)] * 6, then=Reply())
        settings = _settings(names=("a",), retry=polygate.Retry(max_attempts=1))
        async with polygate.session(settings, transport=Router({"a": a}),
                                    rng=random.Random(seed)) as s:
            t0 = trio.current_time()
            for _ in range(6):  # five open it, the sixth is the probe at 30 s: it fails
                with pytest.raises(polygate.AllSourcesExhausted):
                    await s.chat(MESSAGES)
            assert trio.current_time() - t0 == pytest.approx(30)
            await s.chat(MESSAGES)  # the next probe, 30 s after the failed one
            assert trio.current_time() - t0 == pytest.approx(60)


async def test_re_openings_are_jittered(autojump_clock: trio.testing.MockClock) -> None:
    """Equal jitter from the first failed probe on: a re-opening lasts between half and
    all of its nominal period, drawn per settle, so breakers whose probes failed
    together do not probe together again; the first opening is exactly ``open_s``."""
    firsts, periods = [], []
    for seed in range(8):
        a = FakeUpstream([Reply(status=500)] * 2, then=Reply())
        settings = _settings(names=("a",), retry=polygate.Retry(max_attempts=1),
                             breaker=polygate.Breaker(failures=1, open_s=10, max_open_s=20))
        async with polygate.session(settings, transport=Router({"a": a}),
                                    rng=random.Random(seed)) as s:
            t0 = trio.current_time()
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)  # the probe, after the first opening: fails
            t1 = trio.current_time()
            firsts.append(t1 - t0)
            await s.chat(MESSAGES)
            periods.append(trio.current_time() - t1)
    assert firsts == [pytest.approx(10)] * 8
    assert all(10 <= p <= 20 for p in periods) and len(set(periods)) == 8


async def test_a_flapping_source_gets_traffic_again_within_34_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The breaker timeline under sparse traffic: one source answers 503 for 60 s, then
    recovers; one request every 4 s; the other source is healthy.  With the default
    breaker (30 s each opening, no backoff), a probe due first in the picking
    order and failures that fade with time, it is back in use within 34 s of
    recovering, whatever the jitter and the picking draws."""
    down_until = 60.0

    def primary(request: Any, rng: random.Random) -> Reply:
        return Reply(status=503) if request.started_at < down_until else Reply()

    for seed in range(6):
        a = FakeUpstream(primary)
        b = FakeUpstream(Reply())
        settings = _settings()  # equal weights: health and the breaker decide
        served_by_a_at = []
        async with polygate.session(settings, transport=Router({"a": a, "b": b}),
                                    rng=random.Random(seed)) as s:
            start = trio.current_time()
            while trio.current_time() - start < 150:
                r = await s.chat(MESSAGES)
                if r.source == "a":
                    served_by_a_at.append(trio.current_time() - start)
                await trio.sleep_until(start + 4 * (1 + int((trio.current_time() - start) // 4)))
        back = [t for t in served_by_a_at if t >= down_until]
        assert back and back[0] - down_until <= 34, (seed, back[:3])
        # and once back it carries its share again (equal weights: about half)
        assert len(back) >= 0.25 * (150 - back[0]) / 4, (seed, back)


@pytest.mark.parametrize("interval", [4.0, 0.25])
async def test_a_source_recovering_after_a_failed_probe_waits_at_most_the_cap(
    autojump_clock: trio.testing.MockClock, interval: float
) -> None:
    """The worst moment to recover is just after a failed probe.  The primary (preferred
    by weight) fails its first 7 requests — 5 open the breaker, 2 probes fail — and is
    healthy from then on; requests every 4 s (sparse) or 0.25 s (steady load).  The
    next probe comes at most one open period (``max_open_s``: by default ``open_s``,
    30 s) + one request interval later."""
    for seed in range(6):
        seen: list[float] = []

        def primary(request: Any, rng: random.Random, seen: list[float] = seen) -> Reply:
            seen.append(request.started_at)
            return Reply(status=503) if len(seen) <= 7 else Reply()

        a = FakeUpstream(primary)
        settings = _settings(weights={"a": 1.0, "b": 1e-9})
        async with polygate.session(settings, transport=Router({"a": a, "b": FakeUpstream(Reply())}),
                                    rng=random.Random(seed)) as s:
            start = trio.current_time()
            while len(seen) < 9 and trio.current_time() - start < 300:
                await s.chat(MESSAGES)
                tick = 1 + int((trio.current_time() - start) // interval)
                await trio.sleep_until(start + interval * tick)
        recovered_at, next_probe = seen[6], seen[7]
        assert next_probe - recovered_at <= 30 + interval + 1e-6, (seed, seen)


@pytest.mark.parametrize("reply", [Reply(status=429, retry_after_s=0.1), Reply(status=400)])
async def test_breaker_ignores_rate_limits_and_caller_errors(
    reply: Reply, autojump_clock: trio.testing.MockClock
) -> None:
    a = FakeUpstream(reply)
    settings = _settings(names=("a",), retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=0.5))
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        for _ in range(8):
            with pytest.raises(polygate.PolygateError):
                await s.chat(MESSAGES)
        state = _state(await s.statistics(), "a")
    assert state.breaker is BreakerState.CLOSED and state.consecutive_failures == 0


async def test_breaker_ignores_deadlines_and_cancellation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=100))
    async with polygate.session(_settings(names=("a",), call_deadline_s=1),
                                transport=Router({"a": a})) as s:
        for _ in range(8):
            with pytest.raises(polygate.DeadlineExceeded):
                await s.chat(MESSAGES)
        for _ in range(3):
            with trio.move_on_after(0.5):
                await s.chat(MESSAGES, call_deadline_s=None)
        state = _state(await s.statistics(), "a")
    assert state.breaker is BreakerState.CLOSED and state.consecutive_failures == 0
    assert state.tokens_reserved == 0 and state.in_flight == 0


async def test_rate_limit_cooldown_sends_calls_elsewhere(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream([Reply(status=429, retry_after_s=30), Reply()])
    b = FakeUpstream(Reply())
    async with polygate.session(_settings(weights=FIRST_A), transport=Router({"a": a, "b": b})) as s:
        first = await s.chat(MESSAGES)
        during = [await s.chat(MESSAGES) for _ in range(5)]
        stats = await s.statistics()
        await trio.sleep(31)
        after = await s.chat(MESSAGES)
    assert first.source == "b" and first.call_stats.attempts == 2
    assert all(r.source == "b" for r in during)
    assert _state(stats, "a").cooldown_until == pytest.approx(30)
    assert after.source == "a"


async def test_statistics_are_frozen_records(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply())
    settings = _settings(names=("a",), source={"a": {"rpm": 10, "tpm": 10_000, "max_in_flight": 4}})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        await s.chat(MESSAGES)
        stats = await s.statistics()
    record = stats.governance.sources[0]
    with pytest.raises(AttributeError):
        record.state.in_flight = 3  # type: ignore[misc]
    assert record.state.requests_in_window == 1
    assert record.health.latency_ewma_s is not None
    json.dumps([str(record)])  # printable


async def test_hedge_token_budget_refills_on_cancelled_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(first_token_s=100))
    b = FakeUpstream(Reply(first_token_s=100))
    hedge = polygate.Hedge(after_s=1, budget_burst=1, budget_ratio=0.5)
    async with polygate.session(_settings(hedge=hedge), transport=Router({"a": a, "b": b})) as s:
        for _ in range(3):
            with trio.move_on_after(2):
                await s.chat(MESSAGES)
        stats = await s.statistics()
    # 1 token at start; call 1 hedges (0) +0.5; call 2 cannot (0.5) +0.5; call 3 hedges (0) +0.5
    assert stats.governance.hedge_budget["chat"] == pytest.approx(0.5)
    assert len(a.requests) + len(b.requests) == 5


class SpinGuardBackend(CountingBackend):
    async def admit(self, request: Any) -> Any:
        if self.admits > 100:
            raise AssertionError("admission is spinning at one instant")
        return await super().admit(request)


async def test_rpm_wait_is_not_a_spin_at_float_edges(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window entry at 1e-232: at + 60 == 60.0 exactly while 1e-232 <= 60.0 - 60 is false.
    backend = SpinGuardBackend()
    monkeypatch.setattr("polygate._session._backend_for", lambda settings: backend)
    a = FakeUpstream(Reply())
    settings = _settings(names=("a",), source={"a": {"rpm": 1}})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        await trio.sleep(1e-232)
        await s.chat(MESSAGES)
        await s.chat(MESSAGES)
    assert [r.started_at for r in a.requests] == [pytest.approx(0), pytest.approx(60)]


def test_tiktoken_only_when_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from polygate.governance import _estimate

    fake = types.ModuleType("tiktoken")

    class Encoding:
        def encode(self, text: str, disallowed_special: object = ()) -> list[int]:
            return [0] * len(text.split())

    fake.get_encoding = lambda name: Encoding()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    monkeypatch.setattr(_estimate, "_tiktoken_cached", lambda: False)
    assert isinstance(_estimate.default_estimator(), CharEstimator)  # never a download
    monkeypatch.setattr(_estimate, "_tiktoken_cached", lambda: True)
    estimator = _estimate.default_estimator()
    assert not isinstance(estimator, CharEstimator)
    assert estimator.prompt_tokens([{"role": "user", "content": "one two three"}]) == 3 + 4 + 3


async def test_a_call_that_can_never_be_admitted_fails_at_once_behind_a_busy_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: with its only permit out, a call whose estimate is above tpm waited for
    the permit (here: to its deadline, then DeadlineExceeded, a 504 at the gateway)
    before it learnt that it can never be admitted."""
    up = FakeUpstream(Reply(tokens=4, first_token_s=100))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[polygate.Source(
        name="a", base_url="http://a/v1", api_key=SECRET, max_in_flight=1, tpm=1000)])})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.chat, MESSAGES)
            await trio.sleep(1)  # the permit is out
            t0 = trio.current_time()
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES, max_tokens=5000, call_deadline_s=30)
            assert trio.current_time() == t0
            assert "too_large" in str(info.value)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("code", "outcome"), [(429, "rate_limited"), (400, "fatal"), (401, "dead")])
async def test_an_error_event_after_content_keeps_what_streamed_in_the_tpm_window(
    autojump_clock: trio.testing.MockClock, code: int, outcome: str,
) -> None:
    """review: a 200 stream that streamed 50 content tokens and then an error event with
    a 429 (or a 4xx) settled 0 tokens, as a refused request does: the tokens had been
    generated, and never counted against tpm.  A refusal before any content is 0."""
    streamed = FakeUpstream(Reply(tokens=50, fault="error_event", fault_after=50, error_event_code=code))
    refused = FakeUpstream(Reply(fault="error_event", fault_after=0, error_event_code=code))
    windows = []
    for up in (streamed, refused):
        settings = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, tpm=100_000)],
            retry=polygate.Retry(max_attempts=1))})
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            with pytest.raises(polygate.PolygateError):
                await s.chat(MESSAGES)
            snapshot = await s._runtime.governor.backend.snapshot("chat", "a")  # type: ignore[attr-defined]
            windows.append(snapshot.tokens_in_window)
    assert windows[0] >= 50 and windows[1] == 0


async def test_a_reload_drops_the_state_of_names_it_removed_once_it_holds_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reloads review: ``polygate serve``'s generations share one in-process backend,
    and a reload that renamed a source (a model version in its name) or a named gateway
    key kept the old name's state, its last minute of admissions with it (~120 bytes
    each), for the life of the process.  At each reload a name the new settings do not
    use is dropped once its minute has passed and it holds nothing; one still busy, or
    with its breaker open, stays."""
    from polygate._key_quota import KEY_SCOPE
    from polygate._session import SharedBackends
    from polygate.governance._memory import MemoryBackend
    from polygate.governance._model import AdmitRequest, Feedback, SettleRequest, SourceLimits

    def settings(*names: str, key: str = "team") -> polygate.Settings:
        return polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[
                polygate.Source(name=n, base_url=f"http://{n}/v1") for n in names])},
            serve=polygate.Serve(keys={key: polygate.ServeKey(key="sk-gw-" + key * 4, rpm=10)}))

    shared = SharedBackends()
    backend = shared.for_settings(settings("a-v1", "b"))
    assert isinstance(backend, MemoryBackend)
    limits = SourceLimits(rpm=1000)
    for scope, name in (("chat", "a-v1"), ("chat", "b"), (KEY_SCOPE, "team")):
        admission = await backend.admit(AdmitRequest(scope, name, limits, 10))
        await backend.settle(SettleRequest(admission, 10, Feedback.SUCCESS))
    busy = await backend.admit(AdmitRequest("chat", "b", limits, 10))  # still in flight

    assert shared.for_settings(settings("a-v2", key="other")) is backend
    shared.forget_unused([settings("a-v2", key="other")])
    assert ("chat", "a-v1") in backend._sources  # its minute is not over
    await trio.sleep(61)
    # An old generation still open keeps its names: b's, here.
    shared.forget_unused([settings("a-v3", key="other"), settings("b", key="x")])
    assert set(backend._sources) == {("chat", "b")}
    shared.forget_unused([settings("a-v3", key="other")])
    assert set(backend._sources) == {("chat", "b")}  # b holds a call still
    await backend.settle(SettleRequest(busy, 10, Feedback.SUCCESS))
    await trio.sleep(61)
    shared.forget_unused([settings("a-v3", key="other")])
    assert backend._sources == {}


async def test_a_reload_drops_the_hedge_budget_of_a_scope_it_removed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (a session that lives for weeks): a reload that renamed a scope
    (a model version in its name) kept the old scope's hedge budget for the life of
    the process: 1,000 renaming reloads, 1,000 budgets.  A scope that an open
    generation still uses keeps its level."""
    from polygate._session import SharedBackends
    from polygate.governance._memory import MemoryBackend

    def settings(scope: str) -> polygate.Settings:
        return polygate.Settings(scopes={scope: polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1"),
            polygate.Source(name="b", base_url="http://b/v1")])})

    shared = SharedBackends()
    backend = shared.for_settings(settings("chat-v0"))
    assert isinstance(backend, MemoryBackend)
    for i in range(1, 50):
        assert await backend.budget_take(f"chat-v{i - 1}", 10.0)
        if i <= 4:
            assert await backend.budget_take("kept", 10.0)
        await trio.sleep(61)
        shared.forget_unused([settings(f"chat-v{i}"), settings("kept")])
    assert set(backend._budgets) == {"kept"}
    assert await backend.budget_level("kept", 10.0) == 6.0  # (4 taken, none refilled)


LONG_SCHEMA = {"type": "object", "description": "d" * 4000,
               "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}


async def test_a_schema_stream_resumed_before_content_reserves_its_schema(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cut in its reasoning, a structured stream is asked again as it was, its schema's
    response_format included: the re-ask reserved the prompt alone (a review of the
    schema's estimate, 2026-12-05)."""
    bodies: dict[str, Any] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        bodies[request.url.host] = json.loads(request.content)
        if request.url.host == "a":  # reasoning, then cut: nothing of the answer shown
            body = (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", '
                    b'"reasoning_content": "Let me think. "}}]}\n\n')
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)
        chunks = [{"choices": [{"index": 0, "delta": {"content": '{"city": "Paris"}'}}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=body.encode())

    transport = httpx.MockTransport(answer)
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        stream=polygate.StreamWatch(resume=True))})
    async with polygate.session(settings, transport=Router({"a": transport, "b": transport})) as s:
        async with s.stream_chat([{"role": "user", "content": "hello there"}], schema=LONG_SCHEMA, max_tokens=50) as stream:
            async for _ in stream:
                pass
        reserved = {src.state.source: src.state.reserved_total
                    for src in (await s.statistics()).governance.sources}
    assert stream.response is not None and stream.response.parsed == {"city": "Paris"}
    # Both attempts sent the schema's response_format ...
    assert bodies["a"]["response_format"] == bodies["b"]["response_format"]
    # ... so both reserve it (~1,000 tokens): the re-ask reserved the prompt alone.
    assert reserved["a"] > 1000 and reserved["b"] > 1000, reserved


def test_no_writable_temporary_directory_is_not_tiktoken_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding (containers: `docker run --read-only` without a tmpfs): asking
    where tiktoken would cache its file raised FileNotFoundError ("No usable temporary
    directory") from every session's open when tiktoken was installed, a bare
    traceback from `polygate serve`. No temporary directory: nothing cached there."""
    import tempfile

    def no_tmp() -> str:
        raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp', '/var/tmp', '/usr/tmp']")

    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "gettempdir", no_tmp)
    from polygate.governance import _estimate

    assert _estimate._tiktoken_cached() is False
