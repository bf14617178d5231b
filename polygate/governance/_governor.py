"""The governor: picking, admission with waiting, settlement, hedge budget.

It turns an attempt's end into the accounting rules (``docs/admission.md``), in one table
(:data:`SETTLE_RULES`), and leaves the shared state to the backend.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs
import trio

from .._config import Breaker, Settings
from .._errors import GovernanceBackendError, Outcome
from ._backend import GovernanceBackend
from ._estimate import TokenEstimator, chars_tokens, default_estimator, params_tokens
from ._line import Line, Waiter
from ._model import (
    Admission,
    AdmitRequest,
    BreakerPolicy,
    Feedback,
    Refusal,
    RefusalReason,
    SettleRequest,
    SourceLimits,
    SourceSnapshot,
    endpoint_of,
)
from ._picking import Health, HealthStats, pick_order, reference_latency

__all__ = [
    "SETTLE_RULES",
    "GovernanceStatistics",
    "Governor",
    "NoAdmission",
    "SourceStatistics",
    "only_breakers",
]

# outcome -> (tokens recorded: "usage" | "estimate" (the usage when an attempt that
# lost had reported it) | "zero", breaker feedback)
SETTLE_RULES: Mapping[Outcome, tuple[str, Feedback]] = {
    Outcome.OK: ("usage", Feedback.SUCCESS),
    Outcome.TRANSIENT: ("estimate", Feedback.FAILURE),
    Outcome.TIMEOUT: ("estimate", Feedback.FAILURE),
    Outcome.STALLED: ("estimate", Feedback.FAILURE),
    Outcome.DEAD: ("zero", Feedback.FAILURE),
    Outcome.RATE_LIMITED: ("zero", Feedback.NEUTRAL),
    Outcome.FATAL: ("zero", Feedback.NEUTRAL),
    Outcome.CANCELLED: ("estimate", Feedback.NEUTRAL),
    Outcome.HEDGE_CANCELLED: ("estimate", Feedback.NEUTRAL),
}

DEFAULT_RATE_LIMIT_COOLDOWN_S = 1.0
# The floor of a 429's cooldown, whatever Retry-After says: the period of the loop
# that retries rate-limited rounds (they are free of max_attempts).
MIN_RATE_LIMIT_COOLDOWN_S = 0.1
_MIN_WAIT_S = 0.001
#: The most scheduler passes a call arriving at a line gives woken waiters (see
#: _after_the_woken): a bound, never reached while each waiter asks in one step.
_ARRIVAL_PASSES = 64
_NEVER = frozenset({RefusalReason.TOO_LARGE})
#: Refusals that depend on the call's estimate: a smaller one may be admitted.
_ESTIMATED = frozenset({RefusalReason.TPM, RefusalReason.TOO_LARGE})


def _waitable(refusals: Sequence[Refusal]) -> list[Refusal]:
    """The refusals a wait may cure: not a dead source, not an estimate too large."""
    return [r for r in refusals if r.reason not in _NEVER and r.reason is not RefusalReason.DEAD]


def only_breakers(refusals: Sequence[Refusal]) -> bool:
    """Whether open breakers are all that kept a call out (dead sources and estimates
    too large aside): what a call with a fallback does not wait for."""
    waitable = _waitable(refusals)
    return bool(waitable) and all(r.reason is RefusalReason.BREAKER_OPEN for r in waitable)


@attrs.frozen
class _Refused:
    """What a pass of admission that every candidate refused means for a waiter."""

    refusals: Sequence[Refusal]
    never: bool  # nothing a wait cures (dead sources, estimates too large)
    breakers: bool  # open breakers are all a wait cures
    cooldowns: bool  # rate-limit cooldowns are all a wait cures
    unknown: bool  # some refusal has no time it ends by
    next_at: float  # the earliest known time one may end

    @classmethod
    def of(cls, refusals: Sequence[Refusal]) -> _Refused:
        waitable = _waitable(refusals)
        known = [r.retry_at for r in waitable if r.retry_at is not None]
        # A dead source is never waited for alone; but a call that waits anyway is
        # woken when its cooldown ends (and is not given up on before then).
        dead = [r.retry_at for r in refusals if r.reason is RefusalReason.DEAD and r.retry_at is not None]
        return cls(
            refusals, never=not waitable, breakers=only_breakers(refusals),
            cooldowns=all(r.reason is RefusalReason.COOLING_DOWN for r in waitable),
            # A time that is only the latest (``sooner``) wakes the wait but does not
            # let it give up early: the source may accept before it.
            unknown=len(known) < len(waitable) or any(r.sooner for r in waitable),
            next_at=min(known + dead, default=math.inf),
        )

    def bound(self, give_up_at: float, cooldown_give_up_at: float) -> float:
        """The waiter's limit: a wait for cooldowns alone has its own."""
        return min(give_up_at, cooldown_give_up_at) if self.cooldowns else give_up_at

    def gives_up(
        self, now: float, give_up_at: float, cooldown_give_up_at: float, wait_for_breakers: bool
    ) -> bool:
        return self.never or (not wait_for_breakers and self.breakers) or self.timed_out(
            now, give_up_at, cooldown_give_up_at
        )

    def timed_out(self, now: float, give_up_at: float, cooldown_give_up_at: float) -> bool:
        """Nothing will admit before the waiter's limit, or the limit is here.  A source
        free again only at ``give_up_at`` (the call's deadline) is no better: the call is
        cancelled at that instant (a 429 whose Retry-After ended with the deadline was
        waited out whole, then a DeadlineExceeded: a 504 where a 429 was due).  One free
        at a ``cooldown_give_up_at`` of its own (``rate_limit_wait_s``) is waited for."""
        bound = self.bound(give_up_at, cooldown_give_up_at)
        if self.unknown:
            return now >= bound
        return self.next_at > bound or self.next_at >= give_up_at or now >= bound

    @property
    def uniform(self) -> bool:
        """Whether the refusals hold for any call alike: none depends on the estimate
        (a tpm window, an estimate too large for a source)."""
        return not any(r.reason in _ESTIMATED for r in self.refusals)

    @property
    def telling(self) -> bool:
        """Whether it may make a waiter with other limits give up: the refusals have
        a known end, or are open breakers (which a call with a fallback leaves)."""
        return not self.unknown or self.breakers


def _gives_up(refused: _Refused, now: float, waiter: Waiter) -> bool:
    """Whether ``waiter`` gives up on refusals that hold for every call alike."""
    return refused.gives_up(now, waiter.give_up_at, waiter.cooldown_give_up_at, waiter.wait_for_breakers)


class NoAdmission(Exception):
    """No source admitted the attempt (and waiting was not allowed or gave up)."""

    def __init__(self, refusals: Sequence[Refusal], *, timed: bool = False) -> None:
        self.refusals = list(refusals)
        #: Given up at the caller's time limit (a source would admit later), not
        #: because none ever will: another caller with more time may still be admitted.
        self.timed = timed
        detail = ", ".join(f"{r.source}: {r.reason.value}" for r in refusals) or "no candidate"
        super().__init__(f"no source admitted the call ({detail})")


@attrs.frozen
class SourceStatistics:
    state: SourceSnapshot
    health: HealthStats


@attrs.frozen
class GovernanceStatistics:
    sources: tuple[SourceStatistics, ...]
    hedge_budget: Mapping[str, float]
    hedges_suppressed_by_budget: Mapping[str, int]


def _policy(breaker: Breaker) -> BreakerPolicy:
    return BreakerPolicy(
        failures=breaker.failures, open_s=breaker.open_s,
        # No rate rule: a share of failures can never be over 1.
        failure_rate=1.0 if breaker.failure_rate is None else breaker.failure_rate,
        rate_window=breaker.rate_window, rate_min_calls=breaker.rate_min_calls,
        max_open_s=breaker.open_s if breaker.max_open_s is None else breaker.max_open_s,
        probes=breaker.probes,
    )


class Governor:
    def __init__(
        self,
        settings: Settings,
        backend: GovernanceBackend,
        *,
        rng: random.Random | None = None,
        breaker: BreakerPolicy | None = None,
        estimator: TokenEstimator | None = None,
    ) -> None:
        self._settings = settings
        self.backend = backend
        self._rng = rng or random.Random()
        # One breaker policy per scope (Scope.breaker); ``breaker`` overrides them all.
        self._breakers = {
            name: breaker or _policy(scope.breaker) for name, scope in settings.scopes.items()
        }
        self._estimator = estimator or default_estimator()
        self._health: dict[tuple[str, str], Health] = {}
        self._limits: dict[tuple[str, str], SourceLimits] = {}
        self._suppressed: dict[str, int] = {}
        # (scope, source) -> when its open breaker half-opens, as a refusal reported it
        self._probe_due: dict[tuple[str, str], float] = {}
        # (scope, excluded sources) -> the primary attempts waiting there, in order
        self._lines: dict[tuple[str, frozenset[str]], Line] = {}
        for scope_name, scope in settings.scopes.items():
            for source in scope.sources:
                key = (scope_name, source.name)
                self._health[key] = Health()
                self._limits[key] = SourceLimits(
                    source.rpm, source.tpm, source.max_in_flight,
                    endpoint_of(source.base_url, source.model, source.api_key),
                )

    # ------------------------------------------------------------------ estimates

    def prompt_estimate(
        self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any] | None = None
    ) -> int:
        """The prompt's tokens: its messages, and the parameters an upstream reads (and
        bills) as input beside them (:func:`params_tokens`)."""
        tokens = self._estimator.prompt_tokens(messages)
        return tokens + params_tokens(params) if params else tokens

    def _healths(self, scope_name: str) -> list[Health]:
        """The health of each of the scope's sources, in its order."""
        return [self._health[(scope_name, s.name)] for s in self._settings.scopes[scope_name].sources]

    def estimate_inputs(self, inputs: Sequence[str]) -> int:
        return sum(chars_tokens(len(text)) + 1 for text in inputs)

    # ------------------------------------------------------------------ admission

    def order(
        self, scope_name: str, *, exclude: Collection[str] = (), demote: Sequence[str] = ()
    ) -> list[str]:
        scope = self._settings.scopes[scope_name]
        if len(scope.sources) == 1:
            # One candidate: nothing to weigh or probe first (a third of admission's
            # CPU in a one-source scope went to the weighing).
            name = scope.sources[0].name
            return [] if name in exclude else [name]
        healths = self._healths(scope_name)
        ref = reference_latency(healths)
        names = [s.name for s in scope.sources]
        now = self.backend.now()
        weights = [s.weight * h.score(ref, now) for s, h in zip(scope.sources, healths, strict=True)]
        # A breaker whose open period is over is probed first: one real request tells
        # whether the source recovered, and without it a source that failed (and so has
        # a low score) would wait long for traffic.
        due = [n for n in names if self._probe_due.get((scope_name, n), math.inf) <= now]
        return pick_order(names, weights, self._rng, exclude=exclude, demote=demote, first=due)

    async def try_admit(
        self, scope_name: str, tokens: int, *, exclude: Collection[str] = (), demote: Sequence[str] = ()
    ) -> Admission | list[Refusal]:
        """One pass over the candidates in picking order; the first grant wins."""
        refusals: list[Refusal] = []
        for name in self.order(scope_name, exclude=exclude, demote=demote):
            result = await self.backend.admit(AdmitRequest(
                scope_name, name, self._limits[(scope_name, name)], tokens,
                self._breakers[scope_name],
            ))
            key = (scope_name, name)
            if isinstance(result, Admission):
                self._probe_due.pop(key, None)
                return result
            if result.reason is RefusalReason.BREAKER_OPEN and result.retry_at is not None:
                self._probe_due[key] = result.retry_at
            refusals.append(result)
        return refusals

    async def acquire(
        self,
        scope_name: str,
        tokens: int,
        *,
        exclude: Collection[str] = (),
        demote: Sequence[str] = (),
        give_up_at: float = math.inf,
        cooldown_give_up_at: float | None = None,
        wait_for_breakers: bool = True,
    ) -> Admission:
        """Admission for a primary attempt: waits (without polling) until a source
        accepts.  Raises :class:`NoAdmission` when none ever will (every source dead or
        too small for the estimate), none can before ``give_up_at``, the only thing
        to wait for is a rate-limit cooldown ending after ``cooldown_give_up_at``, or
        -- ``wait_for_breakers=False``: a call with somewhere else to go -- open
        breakers."""
        if cooldown_give_up_at is None:
            cooldown_give_up_at = give_up_at
        waiting = self._lines.get((scope_name, frozenset(exclude)))
        if waiting:
            await _after_the_woken(waiting)
        key: tuple[str, frozenset[str]] = (scope_name, frozenset())  # (set once it waits)
        line: Line | None = None
        waiter: Waiter | None = None
        try:
            while True:
                # Taken before the check: a permit returned (or a wake-up from the line)
                # while the check's round trip is in flight still ends the wait below.
                mark = self.backend.change_mark()
                alarm = waiter.arm() if waiter is not None else None
                result = await self.try_admit(scope_name, tokens, exclude=exclude, demote=demote)
                if isinstance(result, Admission):
                    return result
                refused = _Refused.of(result)
                now = self.backend.now()
                if refused.never or (not wait_for_breakers and refused.breakers):
                    raise NoAdmission(result)
                if refused.timed_out(now, give_up_at, cooldown_give_up_at):
                    raise NoAdmission(result, timed=True)
                bound = refused.bound(give_up_at, cooldown_give_up_at)
                # A retry time that is already due (clock arithmetic, or a shared
                # backend's time converted to ours) must not turn the wait into a spin.
                wake_at = min(max(refused.next_at, now + _MIN_WAIT_S), bound)
                if not refused.uniform:
                    # Refused because of its own estimate: out of the line (another's
                    # may fit where its does not), woken by every change.
                    if line is not None and waiter is not None:
                        self._leave(key, line, waiter)
                        line = waiter = None
                    await self.backend.wait_changed(wake_at, mark)
                    continue
                if line is None or waiter is None:
                    key = (scope_name, frozenset(exclude))
                    line = self._lines.get(key)
                    if line is None:
                        line = self._lines[key] = Line()
                    waiter = Waiter(give_up_at, cooldown_give_up_at, wait_for_breakers)
                    line.join(waiter)
                    alarm = waiter.arm()
                if line.first() is waiter:
                    if refused.telling:
                        line.wake_if(result, functools.partial(_gives_up, refused, now))
                    # First, it watches the backend's changes since it asked (``mark``),
                    # not its alarm: a turn that woke it during its ask (a round trip on
                    # Redis) is spent, and left set it would read as a wake-up still to
                    # come (see _after_the_woken: newcomers would wait on it in vain).
                    waiter.arm()
                    waiter.mark = mark  # (a change sets it: its turn, see _after_the_woken)
                    try:
                        await self.backend.wait_changed(wake_at, mark)
                    finally:
                        waiter.mark = None
                else:
                    assert alarm is not None
                    with trio.move_on_at(bound):  # the first's wake-ups are ours
                        await alarm.wait()
        except GovernanceBackendError:
            if line is not None:
                line.wake_all()  # each finds out at once, not one turn after another
            raise
        finally:
            if line is not None and waiter is not None:
                self._leave(key, line, waiter)

    def _leave(self, key: tuple[str, frozenset[str]], line: Line, waiter: Waiter) -> None:
        line.leave(waiter)
        if not line and self._lines.get(key) is line:
            del self._lines[key]

    async def release(
        self,
        admission: Admission,
        outcome: Outcome,
        *,
        usage_tokens: int | None = None,
        sent: bool = True,
        retry_after_s: float | None = None,
        latency_s: float | None = None,
        waited_s: float | None = None,
        at_least: int = 0,
        neutral: bool = False,
    ) -> int:
        """Settle an admission by the rules of :data:`SETTLE_RULES`; returns the tokens
        recorded against the quota (0 when the request never left).  ``at_least``: what
        the attempt is known to have cost whatever it reported (its prompt and the
        tokens it streamed), which an estimate that stands never undercuts.
        ``neutral``: the failure was this process's, not the source's (out of
        descriptors, say): no breaker feedback, no health.  ``waited_s``: a neutral
        attempt cut before any answer came (by its call's deadline, or by a hedge that
        won) after that long: a lower bound of the source's latency (``Health.waited``)."""
        kind, feedback = SETTLE_RULES[outcome]
        if neutral:
            feedback = Feedback.NEUTRAL
        tokens: int | None
        if kind == "zero":
            # The request was refused (a 429, a 4xx): nothing was generated -- unless it
            # streamed content first (an error event inside a 200 stream), which was
            # generated and may be billed, and counts against tpm like any.
            tokens = at_least
        else:
            # "usage": what the upstream reported; "estimate": the estimate stands in
            # for a cost that is unknown, and an attempt that lost after reporting its
            # usage (it finished in the winner's batch) settles that.  Either way, with
            # no usage the estimate is a floor, never a discount: a stream that
            # streamed more than it (a client that left just before the end of a long
            # answer, an answer without a usage chunk) costs at least what it streamed.
            tokens = usage_tokens
            if tokens is None and at_least > admission.tokens:
                tokens = at_least
        cooldown = None
        dead = False
        if outcome is Outcome.RATE_LIMITED:
            cooldown = retry_after_s if retry_after_s is not None else DEFAULT_RATE_LIMIT_COOLDOWN_S
            # "Retry-After: 0" means "now"; honoured literally, a call whose every
            # source answers 429 at once would retry in a loop with no period.
            cooldown = max(cooldown, MIN_RATE_LIMIT_COOLDOWN_S)
        elif retry_after_s is not None and outcome is Outcome.TRANSIENT:
            cooldown = retry_after_s  # a 503 with Retry-After: the server said when
        elif outcome is Outcome.DEAD:
            cooldown = self._settings.dead_cooldown_s
            dead = True
        await self.backend.settle(SettleRequest(
            admission, tokens, feedback, self._breakers[admission.scope], sent, cooldown, dead,
            # Equal jitter for a re-opening this settle may start (the backend applies it
            # only there: see BreakerPolicy.open_for).
            jitter=0.5 + 0.5 * self._rng.random() if feedback is Feedback.FAILURE else 1.0,
        ))
        health = self._health.get((admission.scope, admission.source))
        if health is not None:
            now = self.backend.now()
            if feedback is Feedback.SUCCESS and admission.probe:
                health.recovered(now)
            if feedback is Feedback.SUCCESS and latency_s is not None:
                health.success(latency_s, now)
            elif feedback is Feedback.FAILURE:
                health.failed(now)
            elif waited_s is not None and feedback is Feedback.NEUTRAL:
                health.waited(waited_s, reference_latency(self._healths(admission.scope)), now)
        if not sent:
            return 0
        return admission.tokens if tokens is None else tokens

    # ------------------------------------------------------------------ hedge budget

    async def take_hedge_token(self, scope_name: str, *, count_refusal: bool = True) -> bool:
        """Take one token from the scope's hedge budget.  A refusal is counted in
        ``hedges_suppressed_by_budget`` only with ``count_refusal``: the round passes
        False once its call has been counted, so the counter counts calls denied a
        hedge, not the trigger's re-checks."""
        burst = self._settings.scopes[scope_name].hedge.budget_burst
        if await self.backend.budget_take(scope_name, burst):
            return True
        if count_refusal:
            self._suppressed[scope_name] = self._suppressed.get(scope_name, 0) + 1
        return False

    async def refund_hedge_token(self, scope_name: str) -> None:
        """Give back a token taken for a hedge that was not launched after all."""
        burst = self._settings.scopes[scope_name].hedge.budget_burst
        await self.backend.budget_refill(scope_name, 1.0, burst)

    async def refill_hedge_budget(self, scope_name: str) -> None:
        hedge = self._settings.scopes[scope_name].hedge
        await self.backend.budget_refill(scope_name, hedge.budget_ratio, hedge.budget_burst)

    # ------------------------------------------------------------------ statistics

    def suppressed(self) -> dict[str, int]:
        """``hedges_suppressed_by_budget`` alone: this process's count, no backend."""
        return dict(self._suppressed)

    async def statistics(self) -> GovernanceStatistics:
        records: list[SourceStatistics] = []
        budgets: dict[str, float] = {}
        for scope_name, scope in self._settings.scopes.items():
            healths = self._healths(scope_name)
            ref = reference_latency(healths)
            for source, health in zip(scope.sources, healths, strict=True):
                state = await self.backend.snapshot(scope_name, source.name)
                records.append(SourceStatistics(state, health.stats(ref, self.backend.now())))
            budgets[scope_name] = await self.backend.budget_level(scope_name, scope.hedge.budget_burst)
        return GovernanceStatistics(tuple(records), budgets, dict(self._suppressed))


async def _after_the_woken(line: Line) -> None:
    """Let the line's woken waiters ask before a call that has just arrived does.

    A permit that comes back wakes the line's first waiter, and its admission wakes the
    next.  A caller that calls again the moment its call ends (a loop of calls, a
    worker pool) arrives in the same step as the settle that returned the permit: it
    asked before the woken one ran and took the permit, every time, so the line never
    moved (four workers of eight had nothing until the other four had done all their
    items; a call without a deadline waited for ever).  So while the first in the line
    has been woken and has not asked yet, the newcomer lets the scheduler run.  On the
    memory backend a waiter asks in the step it wakes in, so the line is served in
    order; where asking takes a round trip (Redis), a newcomer may still win the
    race, as it may between processes."""
    for _ in range(_ARRIVAL_PASSES):
        first = line.first()
        if first is None or not first.pending():
            return
        await trio.lowlevel.checkpoint()
