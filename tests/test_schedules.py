"""The scheduling-aware property suite: random scenarios under random, reproducible
interleavings of trio's scheduler, through bodies that wake the way sockets do.

Each example is a scenario (sources with scripted replies and faults, a hedging and
retry configuration, a governance backend whose operations take a shielded virtual
round trip like Redis, and calls with their start times, deadlines, points of
external cancellation and consumer pace) played under one or more schedules (seeds
of trio's batch order) through :class:`polygate.testing.EventTransport`.  After each
run every invariant of ``tests/_schedules.py`` must hold (the scenarios' strategies are
in ``tests/_schedule_scenarios.py``):

* one outcome per call, never a group: an answer or exactly one polygate error (or
  the caller's own cancellation, or a consumer that left early);
* ``stream.response`` starts with exactly the text the caller was shown, and comes
  from the answer those chunks came from;
* nothing is launched after a round has a winner or a stream committed;
* no task, permit or reservation outlives its call; ``reserved == settled +
  released``; a window later the quota windows are empty (no drift);
* admissions per virtual second are bounded (no spinning loop) and every call ends
  within the bounds its configuration implies;
* the hedge budget stays within ``[0, burst]``;
* losers are settled before the statistics freeze, and ``attempts`` counts them;
* a consumer's pace never shows up as upstream stalls, nor as a timeout or a stall
  charged to the source.

Five focuses share the work: ``general`` (everything), ``race`` (commit races of
hedged streams), ``window`` (exact 60-second answers on decimal instants), ``retry``
(sources that keep failing or rate limiting) and ``pace`` (slow consumers).

Cost and scale: about 10,000 schedules per run (``PLAN``), each test time-boxed;
``POLYGATE_SCHEDULES=10`` runs ten times as many examples (and ten times the box).
A failure prints a deterministic reproduction line (the scenario and the schedule
seed, to paste in a shell at the repository root) besides hypothesis's own
``@reproduce_failure`` blob; ``--hypothesis-seed=N`` repeats a whole run's choices.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from polygate.testing import Schedule
from polygate.testing import strategies as pst

from ._schedule_scenarios import scenarios
from ._schedules import Scenario, reproduction, run, violations

SCALE = float(os.environ.get("POLYGATE_SCHEDULES", "1"))

# focus: (examples, schedules per example, time box in seconds)
# 10,000 schedules; about 90 s of CPU on this project's 2-core machine (the time
# boxes add up to 108 s; a loaded machine runs fewer, and the summary line says how
# many).  Several schedules of one scenario share its generation (hypothesis spends
# ~3 ms an example).
PLAN = {
    "general": (1000, 3, 32.0),
    "race": (700, 6, 32.0),
    "window": (750, 2, 16.0),
    "retry": (400, 2, 14.0),
    "pace": (250, 2, 14.0),
}

_tally = {"schedules": 0, "seconds": 0.0, "boxed": 0, "shared": 0}
_started: dict[str, float] = {}
_failed: set[str] = set()


class _Summary:
    """A pytest plugin: one line in the terminal summary with what the suite ran."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if _tally["schedules"]:
            cut = f"; the time box cut {_tally['boxed']} examples" if _tally["boxed"] else ""
            terminalreporter.write_line(
                f"scheduling-aware suite: {_tally['schedules']} schedules in "
                f"{_tally['seconds']:.1f} s of runs ({_tally['shared']} with same-batch "
                f"wake-ups{cut})"
            )


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("polygate-schedules-summary"):
        manager.register(_Summary(), "polygate-schedules-summary")


def _check(focus: str, sc: Scenario, schedule: Schedule) -> None:
    _, per_example, box = PLAN[focus]
    now = time.perf_counter()
    start = _started.setdefault(focus, now)
    if now - start > box * SCALE and focus not in _failed:
        _tally["boxed"] += 1  # past the time box: the rest of the examples only draw
        return
    for k in range(per_example):
        this = Schedule((schedule.seed + k) % 2**32)
        t0 = time.perf_counter()
        obs = run(sc, this)
        _tally["seconds"] += time.perf_counter() - t0
        _tally["schedules"] += 1
        _tally["shared"] += obs.same_batch_wakeups > 0
        found = violations(sc, obs)
        if found:
            _failed.add(focus)  # never time-box the shrinking of a failure
            listing = "\n".join(f"  - {v}" for v in found)
            raise AssertionError(
                f"{len(found)} invariant(s) broken under {this!r} ({focus}):\n{listing}\n"
                f"reproduce: {reproduction(sc, this)}"
            )


def _settings(focus: str) -> settings:
    return settings(
        max_examples=max(1, int(PLAN[focus][0] * SCALE)),
        deadline=None,
        print_blob=True,
        # no "explain" phase: tracing every line of a run costs more than the run
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.mark.timeout(600)
@_settings("general")
@given(sc=scenarios("general"), schedule=pst.schedules())
def test_general(sc: Scenario, schedule: Schedule) -> None:
    _check("general", sc, schedule)


@pytest.mark.timeout(600)
@_settings("race")
@given(sc=scenarios("race"), schedule=pst.schedules())
def test_commit_races(sc: Scenario, schedule: Schedule) -> None:
    _check("race", sc, schedule)


@pytest.mark.timeout(600)
@_settings("window")
@given(sc=scenarios("window"), schedule=pst.schedules())
def test_quota_windows(sc: Scenario, schedule: Schedule) -> None:
    _check("window", sc, schedule)


@pytest.mark.timeout(600)
@_settings("retry")
@given(sc=scenarios("retry"), schedule=pst.schedules())
def test_retries_and_rate_limits(sc: Scenario, schedule: Schedule) -> None:
    _check("retry", sc, schedule)


@pytest.mark.timeout(600)
@_settings("pace")
@given(sc=scenarios("pace"), schedule=pst.schedules())
def test_consumer_pace(sc: Scenario, schedule: Schedule) -> None:
    _check("pace", sc, schedule)
