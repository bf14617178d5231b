"""The property suite's checks can fail: each invariant of ``tests/_schedules.py`` is
shown a run that breaks it (a faulty backend, or a hand-made observation), so that
the suite staying green means the invariants hold, not that the checks went blind."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate._errors import Outcome
from polygate.testing import FakeUpstream, Reply, Schedule

from ._schedules import (
    MAX_ADMITS_PER_S,
    CallResult,
    CallSpec,
    Observation,
    Probe,
    Reported,
    RoundTripBackend,
    Scenario,
    SourceSpec,
    Spinning,
    compact,
    reproduction,
    run,
    violations,
)

ONE = Scenario(
    sources=(SourceSpec(name="a", replies=(Reply(first_token_s=1.0, tokens=3),), tpm=2000),),
    calls=(CallSpec(kind="stream"), CallSpec(start=0.5)),
)


def test_a_healthy_run_breaks_nothing() -> None:
    obs = run(ONE, Schedule(0))
    assert violations(ONE, obs) == []
    assert [c.response is not None for c in obs.calls] == [True, True]
    assert obs.tasks_before == obs.tasks_after > 0


class _Leaky(RoundTripBackend):
    """Forgets to settle the first admission (a permit and a reservation leak)."""

    async def settle(self, request: Any) -> None:
        if request.admission.reservation_id == 1:
            return
        await super().settle(request)


class _Drifting(RoundTripBackend):
    """Settles every sent admission 7 tokens off in the window (a window drift)."""

    async def settle(self, request: Any) -> None:
        await super().settle(request)
        self._state(request.admission.scope, request.admission.source).window_tokens += 7


def test_leaks_and_drift_are_seen() -> None:
    leaked = violations(ONE, run(ONE, Schedule(0), backend=_Leaky(0.0)))
    assert leaked == [
        "a: in_flight=1 tokens_reserved=265 after every call ended",
        "a: reserved 530 != settled 265 + released 0",
    ]
    drift = violations(ONE, run(ONE, Schedule(0), backend=_Drifting(0.0)))
    assert drift == [
        "a: a window after the last call its window still holds 0 request(s) and 14 token(s) "
        "(window drift)"
    ]


async def test_spinning_and_budget_bounds_are_seen(autojump_clock: trio.testing.MockClock) -> None:
    backend = RoundTripBackend(0.0)
    with pytest.raises(Spinning, match="admission tries within 1 virtual second"):
        for _ in range(1000):
            backend._count_admit()  # a loop with no floor on its period
    assert backend.admits == MAX_ADMITS_PER_S + 1
    backend._budgets["chat"] = 7.5
    backend._check_budget("chat", 5.0, "budget_refill")
    assert backend.problems[-1] == "hedge budget 7.5 outside [0, 5.0] after budget_refill"


def _record(source: str, role: str, started: float, ended: float | None, outcome: Outcome | None,
            first: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        attempt_id=f"x.{source}", source=source, role=role, started_at=started, ended_at=ended,
        outcome=outcome, timeline=SimpleNamespace(first_token_at=first, sent_at=started),
    )


def _observation(records: list[SimpleNamespace], result: CallResult) -> Observation:
    probe = Probe()
    ctx = SimpleNamespace(logical_call_id="x", attempts=records, started_at=0.0,
                          messages=[{"content": "call 0"}])
    probe.calls["x"] = ctx
    # every settled attempt was reported at its end
    probe.attempts += [Reported("x", r, r.ended_at) for r in records if r.outcome is not None]
    return Observation(calls=[result], upstreams={}, backend=RoundTripBackend(0.0), probe=probe)


def _stats(attempts: int, latency_s: float) -> polygate.CallStats:
    return polygate.CallStats(logical_call_id="x", attempts=attempts, total_latency_ms=latency_s * 1000)


def test_races_are_seen() -> None:
    sc = Scenario(sources=(SourceSpec(name="a", replies=()), SourceSpec(name="b", replies=())),
                  calls=(CallSpec(kind="stream"),))
    # The caller was shown a's chunks; the response is b's; a hedge started after the
    # commit and b settled after the statistics froze.
    response = SimpleNamespace(text="one two", source="b", raw={"id": "chatcmpl-b-0"},
                               call_stats=_stats(2, 3.0))
    result = CallResult(0, CallSpec(kind="stream"), started=0.0, ended=3.0,
                        response=response, shown="alpha", chunk_ids=["chatcmpl-a-0"])  # type: ignore[arg-type]
    records = [
        _record("a", "primary", 0.0, 3.0, Outcome.HEDGE_CANCELLED, first=2.0),
        _record("b", "hedge", 2.5, 3.5, Outcome.OK, first=3.0),
    ]
    found = violations(sc, _observation(records, result))
    assert any("does not start with the shown text 'alpha'" in v for v in found), found
    assert any("hedge attempt on b launched at 2.500, after the stream committed at 2.000" in v
               for v in found), found
    assert any("settled at 3.500, after the statistics froze" in v for v in found), found


def test_groups_and_stray_outcomes_are_seen() -> None:
    sc = Scenario(sources=(SourceSpec(name="a", replies=()),), calls=(CallSpec(),))
    both = CallResult(0, CallSpec(), started=0.0, ended=1.0,
                      response=SimpleNamespace(call_stats=None),  # type: ignore[arg-type]
                      error=polygate.AllSourcesExhausted("x", errors=[]))
    found = violations(sc, _observation([], both))
    assert any(v.startswith("call 0: outcome:") for v in found), found


def test_legitimate_churn_at_the_rate_limit_floor_is_no_spin() -> None:
    """Found by hypothesis on Python 3.10: three calls retrying a "Retry-After: 0" 429
    at its 0.1 s floor (retries free of max_attempts, every settle waking every waiting
    acquirer) try ~240 admissions a virtual second; the old limit (200) called that a
    spin.  A loop on the 1 ms wait floor would still pass the limit (3 sources)."""
    sc = Scenario(
        sources=(SourceSpec(name="a", replies=(Reply(status=429), Reply(status=429))),
                 SourceSpec(name="b", replies=(Reply(status=429),)),
                 SourceSpec(name="c", replies=(Reply(status=429, retry_after_s=0.0),), repeat_last=True)),
        calls=(CallSpec(), CallSpec(), CallSpec()), max_attempts=1, rate_limit_wait_s=1.0,
    )
    assert violations(sc, run(sc, Schedule(0))) == []
    assert MAX_ADMITS_PER_S < 3 * 1000


def test_reproduction_lines_replay_exactly() -> None:
    line = reproduction(ONE, Schedule(3))
    assert line.startswith('python -c "from tests._schedules import *; replay(Scenario(')
    assert line.endswith(', 3)"')
    from . import _schedules

    again = eval(compact(ONE), vars(_schedules))
    assert again == ONE
    assert compact(Reply(first_token_s=60.0)) == "Reply(first_token_s=60.0)"
    assert math.isfinite(ONE.time_limit())


def test_the_upstream_is_charged_only_for_its_own_time() -> None:
    sc = Scenario(sources=(SourceSpec(name="a", replies=(), timeout_s=5.0),),
                  calls=(CallSpec(kind="stream", pace=1.0),))
    up = FakeUpstream(Reply(tokens=40), name="a")
    up.requests.append(SimpleNamespace(  # type: ignore[arg-type]
        body={"messages": [{"content": "call 0"}]}, reply=Reply(tokens=40), index=0))
    records = [_record("a", "primary", 0.0, 5.0, Outcome.TIMEOUT, first=0.0)]
    error = polygate.TransientUpstreamError("attempt exceeded timeout_s=5.0", source="a")
    result = CallResult(0, sc.calls[0], started=0.0, ended=5.0, error=error)
    obs = _observation(records, result)
    obs.upstreams["a"] = up
    found = violations(sc, obs)
    assert any("charged TIMEOUT, but its upstream answered in 0.00 s" in v for v in found), found
