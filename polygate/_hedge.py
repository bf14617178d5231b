"""Rounds and hedged requests.

A logical call is a retry loop of *rounds*.  A round is one trio nursery.  It starts
with the primary attempt, already admitted; if hedging is configured it also runs a
*monitor* in the nursery's body that may start up to ``max_extra`` hedge attempts on
other sources.  The round ends when one attempt has won — the others are cancelled —
or when every attempt has ended without a winner.

This is the shape of trio's happy eyeballs (``trio/_highlevel_open_tcp_stream.py``):
a nursery per race, a cancel scope per contestant, the first success cancelling the
rest.  Three things make it an LLM hedge rather than a TCP one:

**Triggers.**  An attempt is *late* when

(a) it has no first content token ``after_s`` after it was sent (the classic hang:
    the upstream accepted the call and is queueing it),
(b) it has started streaming but has been silent for ``stall_after_s`` (a mid-stream
    stall; only for ``chat()``, where nothing has been shown to the caller yet), or
(c) its source cannot stream, and the whole attempt has run ``after_s`` (the only
    signal there is; a long healthy answer and a hang look the same).

A hedge starts when *every* live attempt is late: one healthy attempt is enough, and
a hedge that is itself streaming stops further hedges.  Because a new hedge is not
late until ``after_s`` after it was sent, staged extras follow one ``after_s`` apart.
Keep-alive comments and empty deltas are not content, so they delay nothing.  With
``after_quantile`` the threshold is learnt per source from a latency sketch of
first-token times (whole-call times for non-streaming sources), clamped to
``[min_after_s, max_after_s]``.

**Admission.**  A hedge goes to another source of the scope, picked normally with the
sources already in flight excluded; it only *tries* admission (quota, breaker,
permits) and then takes a token from the scope's hedge budget, a token bucket that
refills by ``budget_ratio`` per finished call — so over the long run no more than that
share of calls are hedged, even when every source hangs.  Refused, or no candidate:
no hedge, the round keeps waiting, and ``hedges`` does not count it; it tries again
one threshold later.

**Winners and losers.**  For ``chat()`` the first *complete, successful* answer
wins; an attempt that fails does not end the round while another is alive.  For
``stream_chat()`` the first attempt to hand a content chunk to the caller is
*committed*: the others are cancelled at once and never revived, because the
caller has seen that attempt's text.  Losers are cancelled through their own cancel
scope; their cleanup — the quota keeps the estimate (the upstream may have billed
it), the permit is returned, the telemetry row says ``hedge_cancelled`` — runs in their
own ``finally`` inside this nursery, so when the round returns every attempt is
settled and the call's statistics, frozen afterwards, count them all.  Losers feed
neither the breaker nor the health score.  If every attempt of a round fails, the
round counts as one attempt against ``max_attempts``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from ._attempt import AttemptCancelled, AttemptControl
from ._context import AttemptRecord, CallContext
from ._errors import GovernanceBackendError, Outcome, UpstreamError
from .governance import Admission
from .transport import OnContent

__all__ = ["Round", "RoundFailed"]

Runner = Callable[[Admission, AttemptControl], Awaitable[Any]]
Forward = Callable[[dict[str, Any]], Awaitable[None]]


class RoundFailed(Exception):
    """Every attempt of the round failed (or the committed one did)."""

    def __init__(
        self,
        errors: Sequence[UpstreamError],
        committed: UpstreamError | None,
        committed_record: AttemptRecord | None = None,
    ) -> None:
        super().__init__(f"{len(errors)} attempt(s) failed")
        self.errors = list(errors)
        self.committed = committed
        self.committed_record = committed_record


class _Path:
    __slots__ = ("admission", "control", "done", "error", "result")

    def __init__(self, admission: Admission, control: AttemptControl) -> None:
        self.admission = admission
        self.control = control
        self.done = False
        self.error: UpstreamError | None = None
        self.result: Any = None

    @property
    def record(self) -> AttemptRecord:
        return self.control.record


class Round:
    def __init__(
        self,
        ctx: CallContext,
        runner: Runner,
        *,
        forward: Forward | None = None,
        demote: Sequence[str] = (),
    ) -> None:
        self._ctx = ctx
        self._runner = runner
        self._forward = forward
        self._demote = demote
        self._paths: list[_Path] = []
        self._winner: _Path | None = None
        self._committed: _Path | None = None
        # The monitor parks here; paths unpark it when something it watches changes.
        self._changed = trio.lowlevel.ParkingLot()
        self._quiet_until = -math.inf
        self._extras = 0
        hedge = ctx.scope.hedge
        self._hedging = hedge.enabled and ctx.kind == "chat" and len(ctx.scope.sources) > 1
        self._nursery: trio.Nursery | None = None

    @property
    def winner_record(self) -> AttemptRecord | None:
        return self._winner.record if self._winner is not None else None

    async def run(self, primary: Admission) -> tuple[AttemptRecord, Any]:
        if self._hedging:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._launch(primary, "primary")
                await self._monitor()
        else:
            # Nothing to race: the primary runs in the caller's task, no nursery needed.
            await self._run_path(self._new_path(primary, "primary"))
        if self._winner is not None:
            return self._winner.record, self._winner.result
        errors = [p.error for p in self._paths if p.error is not None]
        if self._committed is not None:
            raise RoundFailed(errors, self._committed.error, self._committed.record)
        raise RoundFailed(errors, None)

    # ------------------------------------------------------------------ paths

    def _launch(self, admission: Admission, role: str) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._run_path, self._new_path(admission, role))

    def _new_path(self, admission: Admission, role: str) -> _Path:
        record = self._ctx.new_attempt(admission, role, trio.current_time())
        control = AttemptControl(record)
        path = _Path(admission, control)
        if self._forward is not None:
            control.on_content = self._committer(path)
        elif self._hedging and self._ctx.scope.hedge.stall_after_s is not None:
            # A first token can bring the stall trigger forward: wake the monitor once.
            control.on_content = self._first_token_waker()
        self._paths.append(path)
        return path

    async def _run_path(self, path: _Path) -> None:
        try:
            path.result = await self._runner(path.admission, path.control)
        except AttemptCancelled:
            pass
        except UpstreamError as exc:
            path.error = exc
        else:
            if self._winner is None:
                self._winner = path
                if self._committed is None:
                    self._committed = path
                self._cancel_others(path)
        finally:
            path.done = True
            self._observe(path)
            self._wake()

    def _committer(self, path: _Path) -> OnContent:
        forward = self._forward
        assert forward is not None

        async def on_content(now: float, chunk: dict[str, Any]) -> None:
            if self._committed is None:
                self._committed = path
                self._cancel_others(path)
                self._wake()
            if self._committed is path:
                await forward(chunk)

        return on_content

    def _first_token_waker(self) -> OnContent:
        woken = False

        async def on_content(now: float, chunk: dict[str, Any]) -> None:
            nonlocal woken
            if not woken:
                woken = True
                self._wake()

        return on_content

    def _cancel_others(self, keep: _Path) -> None:
        for path in self._paths:
            if path is not keep and not path.done:
                path.control.cancel(Outcome.HEDGE_CANCELLED)

    def _wake(self) -> None:
        self._changed.unpark_all()

    def _observe(self, path: _Path) -> None:
        """Feed the adaptive threshold: first-token time, or whole-call time when the
        source does not stream."""
        if self._ctx.scope.hedge.after_quantile is None:
            return
        timeline = path.record.timeline
        if timeline.sent_at is None:
            return
        sketch = self._ctx.runtime.sketch(self._ctx.scope_name, path.admission.source)
        if timeline.first_token_at is not None:
            sketch.add(timeline.first_token_at - timeline.sent_at)
        elif not timeline.streamed and path.record.outcome is Outcome.OK and timeline.ended_at:
            sketch.add(timeline.ended_at - timeline.sent_at)

    # ------------------------------------------------------------------ hedging

    async def _monitor(self) -> None:
        while self._winner is None and any(not p.done for p in self._paths):
            at = self._next_trigger()
            if at <= trio.current_time():
                await self._try_hedge()
                continue
            if at == math.inf:
                await self._changed.park()
            else:
                with trio.move_on_at(at):
                    await self._changed.park()

    def _threshold(self, source: str) -> float:
        hedge = self._ctx.scope.hedge
        if hedge.after_quantile is not None:
            sketch = self._ctx.runtime.sketch(self._ctx.scope_name, source)
            learnt = sketch.quantile(hedge.after_quantile)
            if learnt is not None:
                if hedge.min_after_s is not None:
                    learnt = max(learnt, hedge.min_after_s)
                if hedge.max_after_s is not None:
                    learnt = min(learnt, hedge.max_after_s)
                return learnt
        fallback = hedge.first_threshold_s
        return fallback if fallback is not None else math.inf

    def _late_at(self, path: _Path) -> float:
        timeline = path.record.timeline
        if timeline.first_token_at is None:
            sent = timeline.sent_at if timeline.sent_at is not None else path.record.started_at
            return sent + self._threshold(path.admission.source)
        stall_after = self._ctx.scope.hedge.stall_after_s
        last = timeline.last_token_at
        if stall_after is not None and self._forward is None and last is not None:
            return last + stall_after
        return math.inf

    def _next_trigger(self) -> float:
        if self._committed is not None or self._extras >= self._ctx.scope.hedge.max_extra:
            return math.inf
        latest = -math.inf
        for path in self._paths:
            if path.done:
                continue
            late = self._late_at(path)
            if late == math.inf:
                return math.inf
            latest = max(latest, late)
        if latest == -math.inf:
            return math.inf
        return max(latest, self._quiet_until)

    async def _try_hedge(self) -> None:
        ctx = self._ctx
        governor = ctx.runtime.governor
        in_flight = {p.admission.source for p in self._paths if not p.done}
        # A shared backend that cannot answer means no hedge: the primary carries on.
        try:
            result = await governor.try_admit(
                ctx.scope_name, ctx.estimate, exclude=in_flight, demote=self._demote
            )
        except GovernanceBackendError:
            result = []
        if isinstance(result, Admission):
            try:
                # The budget's refusals are counted per call, not per re-check.
                took = await governor.take_hedge_token(
                    ctx.scope_name, count_refusal=not ctx.hedge_refused
                )
                ctx.hedge_refused |= not took
            except GovernanceBackendError:
                took = False
            if took:
                ctx.hedges += 1
                self._extras += 1
                self._launch(result, "hedge")
                return
            await governor.release(result, Outcome.CANCELLED, sent=False)
        # Refused or no candidate: stay silent, look again one threshold later.
        gap = self._threshold(self._paths[0].admission.source)
        self._quiet_until = trio.current_time() + (gap if math.isfinite(gap) else 1.0)
