"""Hedging, property-tested over random upstream scripts (outside review, 2026-12-03):
whatever the sources do, a call has one outcome, leaves nothing in flight or reserved,
counts the attempts the upstreams received and the hedges actually sent, never more
than max_extra a round, and moves the hedge budget by the documented rule."""
from __future__ import annotations

import random
import sys
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .test_properties import _Attempts

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

NAMES = ("a", "b", "c", "d")

KINDS = {
    "hang": lambda: Reply(first_token_s=200, tokens=2),
    "slow": lambda: Reply(first_token_s=12, inter_token_s=0.5, tokens=3),
    "fail": lambda: Reply(status=500, headers_delay_s=3),
    "fail_late": lambda: Reply(status=503, headers_delay_s=11),
    "ok": lambda: Reply(first_token_s=1, inter_token_s=0.25, tokens=3),
    "stall": lambda: Reply(first_token_s=1, inter_token_s=0.5, tokens=6, stall_at=2, stall_s=30),
    "reset": lambda: Reply(first_token_s=2, tokens=4, fault="reset", fault_after=2),
    "r429": lambda: Reply(status=429, retry_after_s=1, headers_delay_s=1),
    "dead": lambda: Reply(status=401, headers_delay_s=2),
    "fatal": lambda: Reply(status=400, headers_delay_s=9),
    "trunc": lambda: Reply(first_token_s=1, tokens=4, fault="truncated", fault_after=2),
}

scenarios = st.fixed_dictionaries({
    "sources": st.integers(2, 4),
    "scripts": st.fixed_dictionaries(
        {n: st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=5) for n in NAMES}),
    "streaming": st.fixed_dictionaries({n: st.booleans() for n in NAMES}),
    "max_extra": st.integers(1, 3),
    "after_s": st.sampled_from([2.0, 5.0, 8.0]),
    "stall_after_s": st.sampled_from([None, 3.0]),
    "deadline": st.sampled_from([None, 20.0, 60.0]),
    "burst": st.sampled_from([1, 2, 10]),
    "ratio": st.sampled_from([0.1, 0.5]),
    "calls": st.lists(st.sampled_from(["chat", "stream"]), min_size=1, max_size=4),
    "max_attempts": st.integers(1, 3),
    "seed": st.integers(0, 2**16),
    "mif": st.sampled_from([None, 1]),
    "rpm": st.sampled_from([None, 3]),
})


def _settings(sc: dict[str, Any]) -> polygate.Settings:
    names = NAMES[: sc["sources"]]
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name=n, base_url=f"http://{n}/v1", timeout_s=100,
                                 streaming=sc["streaming"][n], max_in_flight=sc.get("mif"),
                                 rpm=sc.get("rpm")) for n in names],
        hedge=polygate.Hedge(after_s=sc["after_s"], max_extra=sc["max_extra"],
                             stall_after_s=sc["stall_after_s"],
                             budget_burst=sc["burst"], budget_ratio=sc["ratio"]),
        call_deadline_s=sc["deadline"],
        retry=polygate.Retry(max_attempts=sc["max_attempts"], backoff_base_s=0.1),
    )})


async def _run(sc: dict[str, Any]) -> dict[str, Any]:
    ups = {n: FakeUpstream([KINDS[k]() for k in sc["scripts"][n]], seed=sc["seed"] + i, then=Reply())
           for i, n in enumerate(NAMES[: sc["sources"]])}
    per_call = []
    async with polygate.session(_settings(sc), transport=Router(ups),
                                rng=random.Random(sc["seed"])) as s:
        rec = _Attempts(s._runtime.recorder)
        s._runtime.recorder = rec
        for kind in sc["calls"]:
            before_records = len(rec.records)
            before_requests = sum(len(u.requests) for u in ups.values())
            before = await s.statistics()
            result: Any
            try:
                with trio.fail_after(1000):
                    if kind == "chat":
                        result = (await s.chat([{"role": "user", "content": "hi"}])).call_stats
                    else:
                        async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
                            async for _ in stream:
                                pass
                        result = stream.response.call_stats
            except polygate.PolygateError as exc:
                result = exc
            after = await s.statistics()
            per_call.append({
                "kind": kind, "result": result,
                "records": rec.records[before_records:],
                "requests": sum(len(u.requests) for u in ups.values()) - before_requests,
                "budget_before": before.governance.hedge_budget.get("chat", sc["burst"]),
                "budget_after": after.governance.hedge_budget.get("chat", sc["burst"]),
                "supp_before": before.governance.hedges_suppressed_by_budget.get("chat", 0),
                "supp_after": after.governance.hedges_suppressed_by_budget.get("chat", 0),
                "gov": after.governance,
                "ups_in_flight": {n: u.in_flight for n, u in ups.items()},
            })
    return {"calls": per_call, "ups": ups}


def _run_seeded(sc: dict[str, Any]) -> dict[str, Any]:
    trio._core._run._r.seed(sc["seed"])
    return trio.run(_run, sc, clock=trio.testing.MockClock(autojump_threshold=0))


def _rounds(records: list[Any]) -> list[list[Any]]:
    ordered = sorted(records, key=lambda r: (r.started_at, r.role != "primary"))
    rounds: list[list[Any]] = []
    for r in ordered:
        if r.role == "primary" or not rounds:
            rounds.append([r])
        else:
            rounds[-1].append(r)
    return rounds


def check(sc: dict[str, Any]) -> None:
    res = _run_seeded(sc)
    for c in res["calls"]:
        result = c["result"]
        assert not isinstance(result, BaseExceptionGroup)
        assert isinstance(result, (polygate.CallStats, polygate.PolygateError)), result
        stats = result if isinstance(result, polygate.CallStats) else result.call_stats
        assert stats is not None, result
        recs = c["records"]
        # in-flight 0, reservations conserved after every call
        assert all(v == 0 for v in c["ups_in_flight"].values()), c
        for src in c["gov"].sources:
            stt = src.state
            assert stt.in_flight == 0, stt
            assert stt.tokens_reserved == 0, stt
            assert stt.reserved_total == stt.settled_total + stt.released_total, stt
        # attempts == records == requests the fakes received
        sent = [r for r in recs if r.timeline.sent_at is not None]
        assert stats.attempts == len(recs), (stats, [(r.source, r.role, r.outcome) for r in recs])
        assert len(sent) == c["requests"], (len(sent), c["requests"])
        # hedges counts only hedges that were sent
        hedges_sent = [r for r in sent if r.role == "hedge"]
        assert stats.hedges == len(hedges_sent), (stats, [(r.source, r.role, r.outcome, r.timeline.sent_at) for r in recs])
        # per round: hedges <= max_extra; never a source in flight in the round
        for rnd in _rounds(recs):
            assert len([r for r in rnd if r.role == "hedge"]) <= sc["max_extra"]
            for i, h in enumerate(rnd):
                if h.role != "hedge":
                    continue
                for o in rnd[:i]:
                    if o.source == h.source:
                        assert o.ended_at is not None and o.ended_at <= h.started_at, (
                            [(r.source, r.role, r.started_at, r.ended_at, r.outcome) for r in rnd])
        # every attempt ended with an outcome; losers are hedge_cancelled
        for r in recs:
            assert r.outcome is not None
        if isinstance(result, polygate.CallStats):
            oks = [r for r in recs if r.outcome is polygate._errors.Outcome.OK]
            assert len(oks) == 1, [(r.source, r.role, r.outcome) for r in recs]
            assert stats.hedge_won == (oks[0].role == "hedge")
        # budget bucket: level' = min(burst, level - hedges + ratio)
        expect = min(sc["burst"], c["budget_before"] - stats.hedges + sc["ratio"])
        assert c["budget_after"] == pytest.approx(expect, abs=1e-6), (c["budget_before"], stats, c["budget_after"])
        # suppressed counted at most once per call
        assert c["supp_after"] - c["supp_before"] in (0, 1)


@settings(max_examples=int(__import__("os").environ.get("HEDGE_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_hedge_invariants(sc: dict[str, Any]) -> None:
    check(sc)
