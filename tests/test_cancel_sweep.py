"""Cancellation at every step: each core scenario is run once to count its steps,
then again once per step k, cancelled right after step k — by the caller, or by the
call's own deadline — and the invariants are checked after each run.

Why exhaustive: a cancellation that leaks lands at one particular checkpoint (between
an admission and the ``try`` that releases it, between a win and its settle), and
random cancellation times hit a given checkpoint only by luck; under ``MockClock``
and one seeded schedule a scenario is a fixed sequence of a few dozen steps, so all
of them can be tried.  The invariants (``_cancel_sweep.violations``): exactly one
outcome and no ExceptionGroup for the caller, no task or nursery left, admission
back to nothing held with ``requests_in_window`` equal to what the upstream saw, the
hedge budget in range, the cache with nothing in flight, one telemetry call row per
call agreeing with the caller's outcome, no negative durations, a prompt close.

The machinery is in ``_cancel_sweep.py``; the self-tests at the end show that its
checks fail on a broken run, so that a green sweep means something.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply

from ._cancel_sweep import LEFT, NEVER, DeadlineScopes, Mode, Run, Scenario, run_once
from .conftest import MESSAGES, SECRET

DEADLINE_S = 100.0  # far past every scenario's end: only the sweep cuts a call short


def _settings(
    *sources: str, scope: str = "chat", cache: str = "off", **kw: Any
) -> polygate.Settings:
    """Sources named after their hosts, the first practically always picked first."""
    built = [
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET,
                        weight=1.0 if i == 0 else 1e-9)
        for i, n in enumerate(sources)
    ]
    return polygate.Settings(cache=cache, scopes={scope: polygate.Scope(
        sources=built, call_deadline_s=DEADLINE_S, **kw)})


# ---------------------------------------------------------------------- scenarios
# Each ``make`` builds fresh upstreams (their scripts are consumed); each body checks
# what its answer must be when it gets one, whatever was cancelled before.


def _plain() -> Any:
    a = FakeUpstream(Reply(first_token_s=0.5, inter_token_s=0.1, tokens=5))
    return _settings("a"), {"a": a}


def _retry() -> Any:
    a = FakeUpstream([Reply(status=429, retry_after_s=1), Reply(status=503)], then=Reply(tokens=3))
    return _settings("a", retry=polygate.Retry(backoff_base_s=0.1)), {"a": a}


def _hedged() -> Any:
    # a hangs (its first token would come at 90 s): b, hedged at 2 s, answers
    a = FakeUpstream(Reply(first_token_s=90, tokens=3))
    b = FakeUpstream(Reply(first_token_s=0.5, inter_token_s=0.1, tokens=3))
    return _settings("a", "b", hedge=polygate.Hedge(after_s=2.0)), {"a": a, "b": b}


ANSWER = "one two three four five six seven eight nine ten"


def _resume() -> Any:
    # a's stream breaks after 4 tokens; b continues the answer from there
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=4, inter_token_s=0.1))
    b = FakeUpstream(Reply(text=" two three four five six seven eight nine ten", inter_token_s=0.1))
    return _settings("a", "b", stream=polygate.StreamWatch(resume=True)), {"a": a, "b": b}


def _stream() -> Any:
    a = FakeUpstream(Reply(tokens=8, first_token_s=0.3, inter_token_s=0.1))
    return _settings("a"), {"a": a}


def _structured() -> Any:
    a = FakeUpstream([Reply(text="not json at all", inter_token_s=0.1)],
                     then=Reply(text='{"ok": true}', inter_token_s=0.1))
    return _settings("a"), {"a": a}


def _cached() -> Any:
    a = FakeUpstream(Reply(first_token_s=0.5, inter_token_s=0.1, tokens=4))
    return _settings("a", cache="memory", cache_ttl_s=3600), {"a": a}


def _embed() -> Any:
    # five inputs in batches of two: three batches at once; a fails the first one
    # with a 503, which is retried (on b) while the others are answered
    a = FakeUpstream([Reply(status=503)], then=Reply(first_token_s=0.2))
    b = FakeUpstream(Reply(first_token_s=0.1))
    return _settings("a", "b", scope="embed", embed_batch_size=2), {"a": a, "b": b}


async def _chat(s: polygate.Session, run: Run) -> None:
    with run.cancellable():
        run.answer(await s.chat(MESSAGES))


async def _stream_to_the_end(s: polygate.Session, run: Run) -> None:
    with run.cancellable():
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
        response = stream.response
        assert response is not None
        if response.text != ANSWER or stream.text != ANSWER:
            run.problems.append(f"shown {stream.text!r}, response {response.text!r}")
        run.answer(response)


async def _stream_left_after_two(s: polygate.Session, run: Run) -> None:
    with run.cancellable():
        async with s.stream_chat(MESSAGES) as stream:
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
        run.answer(LEFT)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


async def _structured_chat(s: polygate.Session, run: Run) -> None:
    with run.cancellable():
        response = await s.chat(MESSAGES, schema=SCHEMA)
        if response.parsed != {"ok": True}:
            run.problems.append(f"parsed {response.parsed!r}")
        run.answer(response)


async def _fill_with_a_waiter_then_hit(s: polygate.Session, run: Run) -> None:
    """The cancellable part fills the cache then hits it; a waiter that asks the same
    meanwhile is coalesced onto the fill and must get an answer however it ends."""
    waited: list[Any] = []

    async def filler() -> None:
        # its own task: the deadline mode cancels deadlines of this task tree only
        with run.cancellable():
            await s.chat(MESSAGES)
            hit = await s.chat(MESSAGES)
            if not hit.call_stats.cached:
                run.problems.append("the second call was not a cache hit")
            run.answer(hit)

    async def waiter() -> None:
        await trio.sleep(0.1)  # while the fill is in flight
        try:
            waited.append(await s.chat(MESSAGES))
        except polygate.PolygateError as exc:
            waited.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(filler)
        nursery.start_soon(waiter)
    if not (len(waited) == 1 and isinstance(waited[0], polygate.ChatResponse)):
        run.problems.append(f"the coalesced waiter got {waited!r}")


async def _embed_five(s: polygate.Session, run: Run) -> None:
    with run.cancellable():
        response = await s.embed(["x1", "x2", "x3", "x4", "x5"])
        if len(response.vectors) != 5:
            run.problems.append(f"{len(response.vectors)} vectors for 5 inputs")
        run.answer(response)


Shape = Callable[[Run], str | None]


def _shape(*, requests: dict[str, int] | None = None, **want: Any) -> Shape:
    """What the uncancelled run must show — its answer's statistics, the requests
    each upstream saw — so that the scenario still exercises what it is named after
    (a hedge that stopped happening would leave a sweep with nothing to find)."""

    def check(run: Run) -> str | None:
        if run.outcome_kinds() not in {("ChatResponse",), ("EmbeddingResponse",)}:
            return f"baseline ended {run.outcome_kinds()}"
        stats = run.outcomes[0].call_stats
        got = {name: getattr(stats, name) for name in want}
        expected = dict(want)
        if requests is not None:
            got["requests"] = {name: len(up.requests) for name, up in run.upstreams.items()}
            expected["requests"] = requests
        return None if got == expected else f"baseline {got}, want {expected}"

    return check


def _left_stream(run: Run) -> str | None:
    return None if run.outcomes == [LEFT] else f"baseline ended {run.outcome_kinds()}"


# (scenario, what its uncancelled run must look like, fewest steps it may take)
SCENARIOS: dict[str, tuple[Scenario, Shape, int]] = {
    sc.name: (sc, shape, least)
    for sc, shape, least in [
        (Scenario("plain_chat", _plain, _chat), _shape(attempts=1, hedges=0), 6),
        (Scenario("retry_429_503", _retry, _chat), _shape(attempts=3), 7),
        (Scenario("hedged_chat", _hedged, _chat),
         _shape(attempts=2, hedges=1, hedge_won=True, requests={"a": 1, "b": 1}), 12),
        (Scenario("failover_resume", _resume, _stream_to_the_end),
         _shape(resumes=1, source="b"), 45),
        (Scenario("stream_left_after_2", _stream, _stream_left_after_two), _left_stream, 12),
        (Scenario("structured_reask", _structured, _structured_chat), _shape(reasks=1), 9),
        # one request: the waiter was coalesced onto the fill, the hit served from it
        (Scenario("cache_coalesced", _cached, _fill_with_a_waiter_then_hit, single_call=False),
         _shape(cached=True, requests={"a": 1}), 10),
        (Scenario("embed_batches", _embed, _embed_five), _shape(attempts=4), 15),
    ]
}


@pytest.fixture
def deadlines(monkeypatch: pytest.MonkeyPatch) -> DeadlineScopes:
    """Every ``trio.fail_at`` scope open, for the deadline mode to cancel.  Patched on
    trio, not on a polygate module: the deadlines are found wherever polygate opens
    them; and through ``monkeypatch``, so that the next test gets trio back."""
    scopes = DeadlineScopes(trio.fail_at)
    monkeypatch.setattr(trio, "fail_at", scopes.fail_at)
    return scopes


@pytest.mark.parametrize("mode", ["cancel", "deadline"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cancelled_after_every_step(name: str, mode: Mode, deadlines: DeadlineScopes) -> None:
    sc, shape, least = SCENARIOS[name]
    baseline = run_once(sc, NEVER, mode, deadlines)
    assert not baseline.problems, "\n".join(baseline.problems)
    assert (wrong := shape(baseline)) is None, wrong
    n = baseline.steps
    assert n >= least, f"{name} took {n} steps: the sweep would try too little"

    problems: list[str] = []
    ends: Counter[tuple[str, ...]] = Counter()
    for k in range(1, n + 1):  # every step: the slowest scenario takes ~3 s
        run = run_once(sc, k, mode, deadlines)
        ends[run.outcome_kinds()] += 1
        problems += [f"k={k}/{n} ({run.fired}): {p}" for p in run.problems]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:20])
    # The cancellations landed: many runs end cut short, as cancelled or as the call's
    # DeadlineExceeded (a deadline mode that found no scope would end every run
    # answered).  A third, not all: a cancellation after the answer changes nothing,
    # and in the deadline mode there is none to cancel before the call opens its
    # deadline scope (a stream's producer starts a few steps in) or after it closed.
    cut = "cancelled" if mode == "cancel" else "DeadlineExceeded"
    assert sum(c for kinds, c in ends.items() if cut in kinds) >= n // 3, dict(ends)


# ---------------------------------------------------------------------- self-tests
# The checks must fail on a broken run, or a green sweep proves nothing: two bugs
# of the kind the sweep looks for, made with the public API only.


async def _stream_never_closed(s: polygate.Session, run: Run) -> None:
    """A caller that enters a stream and never leaves it: its admission (an
    in-flight permit and reserved tokens) and its request stay open, as a
    cancellation-path leak inside polygate would leave them."""
    with run.cancellable():
        stream = s.stream_chat(MESSAGES)
        opened = await stream.__aenter__()
        await opened.__anext__()
        run.answer(LEFT)


def test_the_checks_see_a_leaked_permit(deadlines: DeadlineScopes) -> None:
    run = run_once(Scenario("leak", _stream, _stream_never_closed), NEVER, "cancel", deadlines)
    found = "\n".join(run.problems)
    assert "chat/a: in_flight=1" in found, found
    assert "upstream a still has 1 request(s) open" in found, found


async def _cancellation_swallowed(s: polygate.Session, run: Run) -> None:
    """A retry loop's classic bug: ``Cancelled`` caught as if it were a failure."""
    with run.cancellable():
        try:
            run.answer(await s.chat(MESSAGES))
        except trio.Cancelled:
            pass


def test_the_sweep_sees_a_swallowed_cancellation(deadlines: DeadlineScopes) -> None:
    sc = Scenario("swallow", _plain, _cancellation_swallowed)
    n = run_once(sc, NEVER, "cancel", deadlines).steps
    broken = [k for k in range(1, n + 1) if run_once(sc, k, "cancel", deadlines).problems]
    # every cancellation that landed before the answer is swallowed and reported
    assert len(broken) >= n // 2, (broken, n)
