"""Machinery of ``test_cancel_sweep.py``: one run of a scenario cancelled right after
its k-th step, and the invariants checked after it.

A *step* is one task step of trio's run loop (``Instrument.after_task_step``) or one
call of ``trio.lowlevel.checkpoint_if_cancelled`` (seen through ``sys.setprofile``):
the second kind is a point where a cancellation can land in the middle of a step
without the task yielding, which task steps alone would never reach.  A run counts
the steps from the moment its scenario's body enters the part it may lose; under
:class:`polygate.testing.Schedule` (``MockClock``, one seeded interleaving) the same
scenario takes the same steps every time, so "right after step k" names one point
of one execution, and ``k = 1 … N`` visits them all.

Two modes: ``"cancel"`` cancels the caller's scope around the call (the caller gives
up); ``"deadline"`` cancels the call's own deadline scope, the ``trio.fail_at`` that
polygate opens for ``call_deadline_s`` (the call times out), found through
:class:`DeadlineScopes`.  Both are ``scope.cancel()``: it lands at the next
checkpoint, as an expiring deadline does, but can also land between two tasks of one
batch, which an expiry (checked between batches) cannot — a superset of the real
points, none of which the code may mishandle anyway.

Two hooks, both here so that a redesign changes only this module: polygate's private
``Session._runtime.recorder`` (replaced by a :class:`Probe` that sees every attempt
record and every call row, as in ``_schedules.py``), and ``trio.fail_at`` (wrapped
by :class:`DeadlineScopes`, installed with the test's ``monkeypatch``).
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import traceback
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal

import attrs
import trio

import polygate
from polygate.testing import FakeUpstream, Router, Schedule

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

Mode = Literal["cancel", "deadline"]
NEVER = 0  # k: count the steps, cancel nothing (the baseline run)
# Outcomes that are not a value: the cancellable part was cancelled, or the caller
# left a stream before its end (the body reports it).
CANCELLED = "cancelled"
LEFT = "left"

# The session's close is bounded by its own steps (streams cut, cache and telemetry
# flushed), none of which should wait in virtual time with a memory backend and no
# sinks: a close that sleeps is waiting for something a cancelled call left behind.
CLOSE_BOUND_S = 1.0

_CHECK_CODE = trio.lowlevel.checkpoint_if_cancelled.__code__


# ---------------------------------------------------------------------- the hooks


class DeadlineScopes:
    """``trio.fail_at`` that remembers every scope it opened, and which task opened
    it, while it is open: how the deadline mode finds a call's deadline without
    knowing which polygate module opens it (``_call`` for a call, ``_cached`` for a
    cache lookup or a coalesced wait)."""

    def __init__(
        self, fail_at: Callable[..., contextlib.AbstractContextManager[trio.CancelScope]]
    ) -> None:
        self._fail_at = fail_at
        self.open: dict[trio.CancelScope, trio.lowlevel.Task] = {}

    @contextlib.contextmanager
    def fail_at(self, deadline: float, *, shield: bool = False) -> Iterator[trio.CancelScope]:
        with self._fail_at(deadline, shield=shield) as scope:
            self.open[scope] = trio.lowlevel.current_task()
            try:
                yield scope
            finally:
                del self.open[scope]


class Probe:
    """A Recorder that passes everything on and keeps every attempt record and every
    call row the calls report."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.attempts: list[tuple[str, Any]] = []  # (logical call id, record)
        self.calls: list[tuple[Any, Any, BaseException | None]] = []  # (ctx, stats, error)

    def attempt(self, ctx: Any, record: Any) -> None:
        self.attempts.append((ctx.logical_call_id, record))
        self.inner.attempt(ctx, record)

    def call(self, ctx: Any, stats: Any, usage: Any, error: Any, output: Any = None) -> None:
        self.calls.append((ctx, stats, error))
        self.inner.call(ctx, stats, usage, error, output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Stepper(trio.abc.Instrument):
    """Counts steps while ``counting`` and once ``started()``; calls ``fire`` right
    after step ``k``."""

    def __init__(self, k: int, started: Callable[[], bool], fire: Callable[[], str]) -> None:
        self.k = k
        self.started = started
        self.fire = fire
        self.counting = False
        self.steps = 0
        self.fired = ""

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self._tick()

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is _CHECK_CODE:
            self._tick()

    def _tick(self) -> None:
        if not (self.counting and self.started()):
            return
        self.steps += 1
        if self.steps == self.k:
            self.fired = self.fire()


# ---------------------------------------------------------------------- one run


@attrs.define(eq=False)
class Run:
    """What happened in one run.  The scenario's body marks the part it may lose with
    :meth:`cancellable` and reports what it got with :meth:`answer`."""

    k: int
    mode: Mode
    steps: int = 0
    fired: str = ""
    scope: trio.CancelScope | None = None
    task: trio.lowlevel.Task | None = None
    # how the cancellable part ended: answers, PolygateErrors, and "cancelled"
    outcomes: list[Any] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)
    upstreams: dict[str, FakeUpstream] = attrs.field(factory=dict)

    @contextlib.contextmanager
    def cancellable(self) -> Iterator[None]:
        """The scope the cancel mode cancels, in the task whose deadlines the deadline
        mode cancels.  What the caller could get is an outcome (a PolygateError,
        the cancellation); anything else that reaches it is a problem."""
        with trio.CancelScope() as scope:
            self.scope, self.task = scope, trio.lowlevel.current_task()
            try:
                yield
            except polygate.PolygateError as exc:
                self.outcomes.append(exc)
            except BaseExceptionGroup as group:
                if not _only_cancelled(group):
                    self.problems.append(f"an ExceptionGroup reached the caller: {group!r}")
                raise
            except Exception as exc:
                self.problems.append(
                    f"the caller got a bare {type(exc).__name__}: {exc!r}\n"
                    + "".join(traceback.format_exception(exc)[-4:])
                )
        if scope.cancelled_caught:
            self.outcomes.append(CANCELLED)

    def answer(self, value: Any) -> None:
        self.outcomes.append(value)

    def outcome_kinds(self) -> tuple[str, ...]:
        return tuple(o if isinstance(o, str) else type(o).__name__ for o in self.outcomes)


Make = Callable[[], tuple[polygate.Settings, dict[str, FakeUpstream]]]
Body = Callable[[polygate.Session, Run], Awaitable[None]]


@attrs.frozen
class Scenario:
    name: str
    make: Make
    body: Body
    # The whole call is one logical call, so that its call row must agree with the
    # caller's outcome (a cache scenario makes several).
    single_call: bool = True


def run_once(sc: Scenario, k: int, mode: Mode, deadlines: DeadlineScopes) -> Run:
    """Play ``sc`` under ``Schedule(0)``, cancelling right after step ``k`` (``NEVER``:
    not at all), and list what it broke in ``Run.problems``."""
    settings, upstreams = sc.make()
    run = Run(k, mode, upstreams=upstreams)

    def fire() -> str:
        assert run.scope is not None
        if mode == "cancel":
            run.scope.cancel()
            return "caller"
        # Only deadlines opened in the cancellable part's task tree: a coalesced
        # waiter's own deadline is not the one under test.  (A stream's producer runs
        # in the session's nursery, which a single-call body opened in its own task.)
        mine = [scope for scope, task in deadlines.open.items() if _descends(task, run.task)]
        for scope in mine:
            scope.cancel()
        return f"{len(mine)} deadline(s)" if mine else "no deadline open"

    # Counted from the moment the body enters its cancellable part: the steps of a
    # body that first starts its tasks have nothing to cancel.
    stepper = Stepper(k, lambda: run.scope is not None, fire)

    async def main() -> None:
        transport = Router(upstreams)
        async with polygate.session(settings, transport=transport, rng=random.Random(0)) as s:
            # The suite's private hook (see the module docstring); this session is the
            # run's own, so there is nothing to put back.
            probe = Probe(s._runtime.recorder)
            s._runtime.recorder = probe
            tasks_before = _count_tasks()
            nurseries_before = len(trio.lowlevel.current_task().child_nurseries)
            trio.lowlevel.add_instrument(stepper)
            profiler = sys.getprofile()
            sys.setprofile(stepper.profile)
            stepper.counting = True
            try:
                await sc.body(s, run)
            finally:
                stepper.counting = False
                sys.setprofile(profiler)
                trio.lowlevel.remove_instrument(stepper)
            run.steps, run.fired = stepper.steps, stepper.fired
            if len(trio.lowlevel.current_task().child_nurseries) != nurseries_before:
                run.problems.append("a nursery was left open in the caller's task")
            if (tasks := _count_tasks()) != tasks_before:
                run.problems.append(f"{tasks - tasks_before} task(s) left running after the call")
            stats = await s.statistics()
            run.problems += violations(run, stats, probe, upstreams, settings,
                                       single_call=sc.single_call)
            closing = trio.current_time()
        if (took := trio.current_time() - closing) > CLOSE_BOUND_S:
            run.problems.append(f"the session took {took} virtual s to close")

    # Recorded, not raised: a warning (a coroutine never awaited, a resource left for
    # the collector) is one more problem of this run, reported with its k.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            Schedule(0).run(main)  # MockClock, and the same interleaving every run
        except BaseException as exc:
            run.problems.append(
                f"the run raised {exc!r}\n" + "".join(traceback.format_exception(exc)[-6:])
            )
        gc.collect()  # (what the run dropped warns now, inside the block)
    run.problems += [f"warning: {w.category.__name__}: {w.message}" for w in caught]
    return run


# ---------------------------------------------------------------------- invariants


def violations(
    run: Run,
    stats: polygate.SessionStatistics,
    probe: Probe,
    upstreams: dict[str, FakeUpstream],
    settings: polygate.Settings,
    *,
    single_call: bool = True,
) -> list[str]:
    """Every invariant the finished run broke, from what the session and the fake
    upstreams report once the cancellable part is over."""
    found: list[str] = []
    if len(run.outcomes) != 1:
        found.append(f"the call ended {len(run.outcomes)} times: {run.outcome_kinds()}")

    # Admission: everything reserved went back or was settled, nothing is held.
    for name, up in upstreams.items():
        if up.in_flight:
            found.append(f"upstream {name} still has {up.in_flight} request(s) open")
    seen_by_source: dict[str, int] = {}
    for src in stats.governance.sources:
        st = src.state
        if st.in_flight or st.tokens_reserved:
            found.append(f"{st.scope}/{st.source}: in_flight={st.in_flight} "
                         f"tokens_reserved={st.tokens_reserved} after the call")
        if abs(st.reserved_total - (st.settled_total + st.released_total)) > 1e-6:
            found.append(f"{st.scope}/{st.source}: reserved {st.reserved_total} != settled "
                         f"{st.settled_total} + released {st.released_total}")
        if st.tokens_in_window < 0:
            found.append(f"{st.scope}/{st.source}: tokens_in_window={st.tokens_in_window}")
        seen_by_source[st.source] = seen_by_source.get(st.source, 0) + st.requests_in_window
    for name, up in upstreams.items():
        if name in seen_by_source and seen_by_source[name] != len(up.requests):
            found.append(f"{name}: requests_in_window={seen_by_source[name]}, "
                         f"but the upstream saw {len(up.requests)}")
    for scope_name, level in stats.governance.hedge_budget.items():
        burst = settings.scopes[scope_name].hedge.budget_burst
        if not -1e-9 <= level <= burst + 1e-9:
            found.append(f"hedge budget of {scope_name} at {level}, outside [0, {burst}]")
    if stats.cache.in_flight:
        found.append(f"cache in_flight={stats.cache.in_flight} after the call")

    # Telemetry: one call row per logical call; each attempt settled, reported once,
    # and counted by its call's statistics.
    records = [id(record) for _, record in probe.attempts]
    if len(records) != len(set(records)):
        found.append("an attempt was reported twice")
    rows: dict[str, list[tuple[Any, Any, BaseException | None]]] = {}
    for ctx, cst, error in probe.calls:
        rows.setdefault(ctx.logical_call_id, []).append((ctx, cst, error))
    for call_id, its_rows in rows.items():
        if len(its_rows) != 1:
            found.append(f"call {call_id}: {len(its_rows)} call rows")
        ctx, cst, _ = its_rows[0]
        unsettled = [a.attempt_id for a in ctx.attempts if a.outcome is None]
        if unsettled:
            found.append(f"call {call_id}: attempts {unsettled} unsettled at its end")
        reported = [r for cid, r in probe.attempts if cid == call_id]
        expected = cst.attempts if cst is not None else len(ctx.attempts)
        if len(reported) != expected:
            found.append(f"call {call_id}: {len(reported)} attempt rows for {expected} attempts")
    if single_call:
        nothing_sent = not probe.attempts and all(not up.requests for up in upstreams.values())
        if not rows and run.outcomes == [CANCELLED] and nothing_sent:
            pass  # cancelled before the call began: no call, no row
        elif len(rows) != 1:
            found.append(f"{len(rows)} logical calls recorded for one call")
        elif len(run.outcomes) == 1:
            _, _, error = probe.calls[0]
            got = run.outcomes[0]
            if isinstance(got, polygate.PolygateError):
                if type(error) is not type(got):
                    found.append(f"the caller got {type(got).__name__}, "
                                 f"its row says {type(error).__name__}")
            elif got in (CANCELLED, LEFT):
                # The row may say the call ended first (answered, or failed: a stream
                # whose deadline fired after the last chunk its caller read, who left
                # without hearing of it), or that it was cut; never a bare error.
                ended = (trio.Cancelled, polygate.PolygateError)
                if error is not None and not isinstance(error, ended):
                    found.append(f"the caller ended {got}, its row says {error!r}")
            elif error is not None:
                found.append(f"the caller got an answer, its row says {error!r}")

    for got in run.outcomes:
        cs = getattr(got, "call_stats", None)
        if cs is None:
            continue
        durations = (cs.total_latency_ms, cs.generation_ms, cs.ttft_ms, cs.stall_ms,
                     cs.active_generation_ms)
        if any(d is not None and d < -1e-9 for d in durations):
            found.append(f"a negative duration in {cs}")
    return found


# ---------------------------------------------------------------------- helpers


def _descends(task: trio.lowlevel.Task | None, ancestor: trio.lowlevel.Task | None) -> bool:
    while task is not None:
        if task is ancestor:
            return True
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    return False


def _count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return walk(root)


def _only_cancelled(group: BaseExceptionGroup[Any]) -> bool:
    return all(
        _only_cancelled(e) if isinstance(e, BaseExceptionGroup) else isinstance(e, trio.Cancelled)
        for e in group.exceptions
    )
