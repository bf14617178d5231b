"""Hypothesis strategies of the scheduling-aware suite's scenarios (see
``_schedules.py`` for what a scenario is and ``test_schedules.py`` for the suite).

Built once, at import, and mostly drawn from tables: a hypothesis draw costs tens of
microseconds and a run a few milliseconds, so a scenario should take a few dozen
draws, not hundreds.  Tables are ordered simplest first (shrinking goes there).
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
from hypothesis import strategies as st

from polygate import Hedge
from polygate.testing import Reply

from ._schedules import CallSpec, Scenario, SourceSpec

__all__ = ["REPLIES", "scenarios"]


NAMES = ("a", "b", "c")
_SEED = st.integers(0, 2**16)
_TICK = st.sampled_from((0.0, 0.0, 0.1, 0.5))
_RACE_TICK = st.sampled_from((0.0, 0.25, 0.5, 0.5))  # coarse ticks: more arrivals meet
_LATENCY = st.sampled_from((0.0, 0.0, 0.01, 0.3))
# times on a grid, so that independent events meet: 2.0 == 1.0 + 1.0 (hedge + reply)
_FIRST = (0.0, 0.3, 1.0, 2.0, 4.0, 8.0)


def _reply_table() -> tuple[Reply, ...]:
    table = [Reply(tokens=3)]
    table += [Reply(first_token_s=t, inter_token_s=i, tokens=3) for t in _FIRST for i in (0.0, 0.5)]
    table += [Reply(first_token_s=t, tokens=1) for t in (30.0, 60.0)]  # 60: a whole window
    table += [Reply(first_token_s=t, stream=False) for t in (0.0, 1.0, 4.0)]  # cannot stream
    table += [Reply(status=429, retry_after_s=a, headers_delay_s=h)
              for a in (None, 0.0, 0.5, 3.0) for h in (0.0, 0.1)]
    table += [Reply(status=429, retry_after_ms=0.0)]
    table += [Reply(status=c, headers_delay_s=h) for c in (500, 503) for h in (0.0, 0.5)]
    table += [Reply(status=401), Reply(status=400)]
    table += [Reply(first_token_s=0.5, tokens=3, fault=f, fault_after=k)  # type: ignore[arg-type]
              for f in ("reset", "truncated", "malformed_json", "error_event") for k in (0, 2)]
    table += [Reply(fault="silent")]
    table += [Reply(first_token_s=0.5, tokens=3, stall_at=1, stall_s=s) for s in (3.0, 7.0)]
    return tuple(table)


REPLIES = _reply_table()
_REPLY = st.sampled_from(REPLIES)
_REPLY_LISTS = st.lists(_REPLY, min_size=1, max_size=4).map(tuple)


def _product(**choices: tuple[Any, ...]) -> st.SearchStrategy[dict[str, Any]]:
    """Every combination of the choices as one table: a single draw instead of one per
    field.  A value repeated in a choice weighs more; the table starts with every
    field's first choice, so shrinking heads for it."""
    names = list(choices)
    return st.sampled_from(
        tuple(dict(zip(names, combo, strict=True)) for combo in itertools.product(*choices.values()))
    )


_GENERAL_KNOBS = _product(
    weight=(1.0, 1.0, 1e-6),
    timeout_s=(20.0, 90.0),
    tpm=(None, None, 400, 2000),
    rpm=(None, None, None, 2, 50),
    max_in_flight=(None, None, 1),
    repeat_last=(False, False, True),
)
_STARTS = (0.0, 0.0, 0.3, 1.0, 2.5)
_DEADLINES = (None, None, 3.0, 10.0, 45.0)
_CANCELS = (None, None, None, 0.3, 1.0, 2.0, 4.0, 9.0)
_GENERAL_CALL = st.one_of(
    _product(kind=("chat",), start=_STARTS, deadline=_DEADLINES, cancel_after=_CANCELS),
    _product(kind=("stream",), start=_STARTS, deadline=_DEADLINES, cancel_after=_CANCELS,
             pace=(0.0, 0.0, 0.0, 1.0), stop_after=(None, None, None, 1, 2)),
).map(lambda fields: CallSpec(**fields))
_HEDGES = st.sampled_from((
    Hedge(),
    Hedge(after_s=1.0, budget_burst=5),
    Hedge(after_s=2.0, budget_burst=1),
    Hedge(after_s=0.5, max_extra=2, budget_burst=5),
    Hedge(after_s=1.0, stall_after_s=3.0, budget_burst=2),
    Hedge(after_s=4.0, max_extra=2, budget_burst=2, budget_ratio=1.0),
    Hedge(after_s=1.0, after_quantile=0.9, max_after_s=5.0, budget_burst=5),
    Hedge(after_s=1.0, after_quantile=0.9, min_after_s=0.5, max_after_s=5.0, budget_burst=2),
))


@st.composite
def _general(draw: st.DrawFn) -> Scenario:
    n = draw(st.integers(2, 3))
    return Scenario(
        sources=tuple(
            SourceSpec(name=name, replies=draw(_REPLY_LISTS), **draw(_GENERAL_KNOBS))
            for name in NAMES[:n]
        ),
        calls=tuple(draw(st.lists(_GENERAL_CALL, min_size=1, max_size=3))),
        hedge=draw(_HEDGES),
        max_attempts=draw(st.integers(1, 3)),
        rate_limit_wait_s=draw(st.sampled_from((0.0, 1.0, 2.0))),
        stall_timeout_s=draw(st.sampled_from((None, None, 5.0))),
        latency=draw(_LATENCY), tick_s=draw(_TICK), seed=draw(_SEED),
    )


_RACE_FIRST = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
_RACE_HEALTHY = tuple(
    Reply(first_token_s=t, inter_token_s=i, tokens=k)
    for t in _RACE_FIRST for i in (0.0, 1.0) for k in (1, 3)
)
_RACE_FAULTY = tuple(r for r in REPLIES if r.status != 200 or r.fault is not None or r.stream is False)
_RACE_REPLY = st.one_of(
    st.sampled_from(_RACE_HEALTHY), st.sampled_from(_RACE_HEALTHY), st.sampled_from(_RACE_FAULTY)
)
_RACE_SOURCE = st.lists(_RACE_REPLY, min_size=1, max_size=3).map(tuple)
_RACE_HEDGE = _product(
    after_s=tuple(t for t in _RACE_FIRST if t > 0), stall_after_s=(None, 1.0), budget_burst=(1, 5)
).map(lambda fields: Hedge(**fields))
_RACE_CALL = _product(
    kind=("stream", "stream", "chat"), start=(0.0, 0.0, 0.5),
    cancel_after=(None, None, None, *_RACE_FIRST),
).map(lambda fields: CallSpec(**fields))


@st.composite
def _race(draw: st.DrawFn) -> Scenario:
    """Two sources racing one or two calls (mostly streams) whose answers often
    arrive whole with their first token — and, half the time, with the hedge's first
    token aligned on the primary's: same instant, two runnable paths."""
    a, b = draw(_RACE_SOURCE), draw(_RACE_SOURCE)
    hedge = draw(_RACE_HEDGE)
    latency = draw(_LATENCY)
    weight = draw(st.sampled_from((1.0, 1e-9)))
    if draw(st.booleans()) and a[0].status == 200 and hedge.after_s is not None:
        # a is the primary, sent after one admission round trip; the hedge is sent
        # after_s later, after two more (try_admit, then the budget token).
        aligned = a[0].first_token_s - hedge.after_s - 2 * latency
        if aligned >= 0:
            b = (attrs.evolve(b[0], first_token_s=aligned), *b[1:])
            weight = 1e-9
    return Scenario(
        sources=(SourceSpec(name="a", replies=a), SourceSpec(name="b", replies=b, weight=weight)),
        calls=tuple(draw(st.lists(_RACE_CALL, min_size=1, max_size=2))),
        hedge=hedge, max_attempts=2, latency=latency, tick_s=draw(_RACE_TICK), seed=draw(_SEED),
    )


# 3 tokens already cost more than an estimate of 1 (positive drift), 1 token less
# than one of 256 (negative drift)
_WINDOW_REPLIES = tuple(
    Reply(first_token_s=t, tokens=k) for t in (60.0, 0.0, 1.0, 30.0) for k in (1, 3, 20)
)
_WINDOW_REPLY_LISTS = st.lists(st.sampled_from(_WINDOW_REPLIES), min_size=1, max_size=3).map(tuple)
_WINDOW_KNOBS = _product(timeout_s=(90.0,), tpm=(None, 600, 2000), rpm=(None, 3))
_WINDOW_CALL = _product(
    kind=("chat", "stream"),
    start=tuple(k / 10 for k in range(81)),  # decimal instants: 0.3 + 60 - 60 < 0.3
    cancel_after=(None, None, None, 60.0),
).map(lambda fields: CallSpec(**fields))


@st.composite
def _window(draw: st.DrawFn) -> Scenario:
    """Admissions on decimal instants, answers that take exactly one window (60 s),
    estimates above and below the real cost."""
    n = draw(st.integers(1, 2))
    return Scenario(
        sources=tuple(
            SourceSpec(name=name, replies=draw(_WINDOW_REPLY_LISTS), **draw(_WINDOW_KNOBS))
            for name in NAMES[:n]
        ),
        calls=tuple(draw(st.lists(_WINDOW_CALL, min_size=1, max_size=3))),
        max_attempts=1, completion_estimate=draw(st.sampled_from((256, 1))),
        seed=draw(_SEED),
    )


_RETRY_REPLIES = (
    Reply(tokens=1),
    *(Reply(status=429, retry_after_s=a, headers_delay_s=h)
      for a in (0.0, None, 0.5, 3.0) for h in (0.0, 0.1, 1.0)),
    Reply(status=429, retry_after_ms=0.0),
    Reply(status=429, retry_after_s=0.5, headers_delay_s=1.0),
    Reply(status=500), Reply(status=503, retry_after_s=0.0), Reply(status=503, retry_after_s=2.0),
    Reply(status=401), Reply(status=400), Reply(first_token_s=2.0, tokens=1),
)
_RETRY_REPLY_LISTS = st.lists(st.sampled_from(_RETRY_REPLIES), min_size=1, max_size=3).map(tuple)
_RETRY_KNOBS = _product(
    repeat_last=(True, True, False), timeout_s=(20.0,), rpm=(None, None, 5), max_in_flight=(None, 1)
)
_RETRY_CALL = _product(
    kind=("chat", "stream"), start=(0.0, 0.5), deadline=(None, None, 5.0, 30.0)
).map(lambda fields: CallSpec(**fields))


@st.composite
def _retry(draw: st.DrawFn) -> Scenario:
    """Sources that keep failing or rate limiting (429 with Retry-After 0 included):
    retries, cooldowns and give-up bounds."""
    n = draw(st.integers(1, 2))
    return Scenario(
        sources=tuple(
            SourceSpec(name=name, replies=draw(_RETRY_REPLY_LISTS), **draw(_RETRY_KNOBS))
            for name in NAMES[:n]
        ),
        calls=tuple(draw(st.lists(_RETRY_CALL, min_size=1, max_size=2))),
        max_attempts=draw(st.integers(1, 3)),
        rate_limit_wait_s=draw(st.sampled_from((0.0, 1.0, 2.0))),
        latency=draw(_LATENCY), seed=draw(_SEED),
    )


_PACE_REPLY = _product(
    first_token_s=(0.0, 0.2, 1.0), inter_token_s=(0.0, 0.01, 0.1), tokens=(2, 40)
).map(lambda fields: Reply(**fields))
_PACE_CALL = _product(
    kind=("stream",), start=(0.0, 0.5), pace=(0.5, 1.0, 3.0)
).map(lambda fields: CallSpec(**fields))


@st.composite
def _pace(draw: st.DrawFn) -> Scenario:
    """Healthy upstreams read by a slow consumer (the 32-chunk buffer fills up)."""
    n = draw(st.integers(1, 2))
    sources = tuple(
        SourceSpec(name=name, replies=(draw(_PACE_REPLY),),
                   timeout_s=draw(st.sampled_from((5.0, 20.0, 200.0))))
        for name in NAMES[:n]
    )
    return Scenario(
        sources=sources, calls=tuple(draw(st.lists(_PACE_CALL, min_size=1, max_size=2))),
        stall_timeout_s=draw(st.sampled_from((None, 2.5))),
        latency=draw(_LATENCY), tick_s=min(draw(_TICK), 0.1), seed=draw(_SEED),
    )


_FOCUSES: dict[str, st.SearchStrategy[Scenario]] = {
    "general": _general(), "race": _race(), "window": _window(), "retry": _retry(),
    "pace": _pace(),
}


def scenarios(focus: str = "general") -> st.SearchStrategy[Scenario]:
    """Scenarios for one of the suite's focuses:

    ``general``: 2-3 sources, any hedging, 1-3 calls of both kinds with deadlines,
    cancellations, early exits, quotas and faults;
    ``race``: two sources racing one or two calls, tails that arrive at once;
    ``window``: admissions on decimal instants and answers that take exactly a
    window (60 s), on TPM-limited sources;
    ``retry``: sources that keep failing or rate limiting (Retry-After 0 included);
    ``pace``: streams read by a slow consumer from healthy upstreams.
    """
    return _FOCUSES[focus]
