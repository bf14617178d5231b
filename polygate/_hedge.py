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

**Admission.**  A hedge first takes a token from the scope's hedge budget, a token
bucket that refills by ``budget_ratio`` per finished call — so over the long run no
more than that share of calls are hedged, even when every source hangs.  Then it goes
to another source of the scope, picked normally with the sources in flight excluded
and the sources that failed in this call (this round included) at the back; it only
*tries* admission (quota, breaker, permits).  Refused, or no candidate: the token is
given back, no hedge, the round keeps waiting, and ``hedges`` does not count it; it
tries again one threshold later, and never sooner than a floor (a learnt threshold can
be microseconds).

**Winners and losers.**  For ``chat()`` the first *complete, successful* answer
wins; an attempt that fails does not end the round while another is alive, unless
it failed with a fatal error (the request is wrong: raised at once).  For
``stream_chat()`` the first attempt to hand a content chunk to the caller is
*committed*: the others are cancelled at once and never revived, because the
caller has seen that attempt's text.  Losers are cancelled through their own cancel
scope; their cleanup — the quota keeps the estimate (the upstream may have billed
it), the permit is returned, the telemetry row says ``hedge_cancelled`` — runs in their
own ``finally`` inside this nursery, so when the round returns every attempt is
settled and the call's statistics, frozen afterwards, count them all.  Losers feed
neither the breaker nor the health score.  If every attempt of a round fails, the
round counts as one attempt against ``max_attempts``.

**A race decides once.**  Unlike happy eyeballs, a committed stream keeps its
winner alive, so contestants are cancelled one by one and the decision needs explicit
guards, because ``cancel()`` is delivered only at the next checkpoint: a path that is
runnable in the winner's scheduler batch (its socket became readable in the same
wake-up) can read the rest of a buffered answer and return without ever reaching one.
So a path wins only if nothing else won or committed and it was not cancelled; a
cancelled path can neither commit nor forward a chunk; and the monitor re-checks the
round after every await of a hedge's admission, so nothing launches after a winner or
a commit (a granted admission found too late is released unsent, its token refunded).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import trio

from ._attempt import AttemptCancelled, AttemptControl
from ._context import AttemptRecord, CallContext, refused_context
from ._errors import FatalUpstreamError, GovernanceBackendError, Outcome, UpstreamError
from ._secrets import frameless
from .governance import Admission, Governor
from .transport import OnContent, OnExtra

__all__ = ["Round", "RoundFailed"]

# After a refused hedge the monitor looks again one threshold later, never sooner.
_RECHECK_FLOOR_S = 0.05

# The data-only chunks a path holds before its first content token (see
# Round._relayer); past this many, more are left out of the stream.
_EARLY_CAP = 64

Runner = Callable[[Admission, AttemptControl], Awaitable[Any]]


class Forward(Protocol):
    """The caller's end of a committed stream."""

    def offer(self, chunk: dict[str, Any]) -> bool:
        """Hand ``chunk`` to the caller without blocking.  False: the caller is
        behind; the chunk is held until :meth:`deliver_held`."""
        ...

    async def deliver_held(self) -> None:
        """Wait until the caller takes the held chunk."""
        ...


class RoundFailed(Exception):
    """Every attempt of the round failed (or the committed one did)."""

    def __init__(
        self,
        errors: Sequence[UpstreamError],
        committed: UpstreamError | None,
        committed_record: AttemptRecord | None = None,
        primary: UpstreamError | None = None,
    ) -> None:
        super().__init__(f"{len(errors)} attempt(s) failed")
        self.errors = list(errors)
        self.committed = committed
        self.committed_record = committed_record
        #: The primary path's error (the round's preferred source: hedges came after
        #: it), wherever it is in ``errors`` (the order the paths failed in).
        self.primary = primary


class _Path:
    __slots__ = ("admission", "control", "done", "early", "error", "result")

    def __init__(self, admission: Admission, control: AttemptControl) -> None:
        self.admission = admission
        self.control = control
        self.done = False
        self.error: UpstreamError | None = None
        self.result: Any = None
        #: A stream's data-only chunks that came before the race was decided: the
        #: caller's when this path commits or wins (see Round._relayer); at most
        #: _EARLY_CAP.
        self.early: list[dict[str, Any]] | None = None

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
        # The paths that failed, in the order they failed (not launched): the order of
        # AllSourcesExhausted.errors, and of the sources that go to the back.
        self._failed: list[_Path] = []
        self._winner: _Path | None = None
        self._committed: _Path | None = None
        # The monitor parks here; paths unpark it when something it watches changes.
        # (Made with the monitor: a round without hedging has none to wake.)
        self._changed: trio.lowlevel.ParkingLot | None = None
        self._quiet_until = -math.inf
        self._extras = 0
        hedge = ctx.scope.hedge
        self._hedging = hedge.enabled and ctx.kind == "chat" and len(ctx.scope.sources) > 1
        self._nursery: trio.Nursery | None = None
        # A hedging round's monitor, made when it starts (a scope is ~0.4 µs to make,
        # and a round without hedging, nearly every one, has no monitor).
        self._monitor_scope: trio.CancelScope | None = None

    @property
    def winner_record(self) -> AttemptRecord | None:
        return self._winner.record if self._winner is not None else None

    async def run(self, primary: Admission) -> tuple[AttemptRecord, Any]:
        if self._hedging:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                monitor = self._monitor_scope = trio.CancelScope()
                self._changed = trio.lowlevel.ParkingLot()
                self._launch(primary, "primary")
                # A win or a commit cancels the monitor with the losers (as happy
                # eyeballs cancels its starter): a hedge whose budget or admission
                # round trip is in flight then never launches.
                with monitor:
                    await self._monitor()
        else:
            # Nothing to race: the primary runs in the caller's task, no nursery needed
            # (and its error's context may be the exception its caller is handling).
            await self._run_path(self._new_path(primary, "primary"), sys.exc_info()[1])
        winner = self._winner
        if winner is not None:
            if winner.early is not None:
                # It won without a content token (data and no output): what it sent
                # is the caller's now, before the stream ends.
                early, winner.early = winner.early, None
                await self._deliver(early)
            return winner.record, winner.result
        errors = [p.error for p in self._failed if p.error is not None]
        primary_error = self._paths[0].error if self._paths else None
        if self._committed is not None:
            raise RoundFailed(errors, self._committed.error, self._committed.record, primary_error)
        raise RoundFailed(errors, None, primary=primary_error)

    # ------------------------------------------------------------------ paths

    def _launch(self, admission: Admission, role: str) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._run_path, self._new_path(admission, role))

    def _new_path(self, admission: Admission, role: str) -> _Path:
        record = self._ctx.new_attempt(admission, role, trio.current_time())
        control = AttemptControl(record)
        path = _Path(admission, control)
        control.claim = self._claimer(path)
        if self._forward is not None:
            control.on_content = self._committer(path)
            control.on_extra = self._relayer(path)
        elif self._hedging and self._ctx.scope.hedge.stall_after_s is not None:
            # A first token can bring the stall trigger forward: wake the monitor once.
            control.on_content = self._first_token_waker()
        self._paths.append(path)
        return path

    @trio.lowlevel.enable_ki_protection  # (a task of its own: see _call._retry_loop)
    async def _run_path(self, path: _Path, handled: BaseException | None = None) -> None:
        """Run one path; ``handled``: the exception its task was handling as it
        started (``frameless``), none for a task of the round's own."""
        try:
            path.result = await self._runner(path.admission, path.control)
        except AttemptCancelled:
            pass
        except UpstreamError as exc:
            # Kept without its frames: their locals (this frame's path and control, the
            # attempt's record) lead back to it, a cycle only the cyclic collector
            # frees, with the request it holds: for every failed attempt, also of calls
            # that then succeed (a gateway behind 429s makes thousands a minute, and the
            # collector's full passes stop the loop).  Raised again above, it gets the
            # frames from there; what went wrong is in its message.
            path.error = frameless(exc, handled=handled)
            self._failed.append(path)
            if isinstance(exc, FatalUpstreamError) and not self._decided():
                # The request is wrong (SPEC §3: raised at once): the other paths would
                # be told so too, later.  They end now, as losers, and the round with
                # this error.
                self._cancel_others(path)
        else:
            # The attempt claimed the win before it settled (see _claimer); a runner
            # that returned without asking is asked now.
            if self._winner is not path:
                self._claim(path)
        finally:
            path.done = True
            # The path's callbacks close over this round, which holds the path: drop
            # them, so that a finished round is freed by reference counting, not left
            # as a cycle (with its nursery, tasks and records) for the cyclic collector.
            control = path.control
            control.on_content = control.on_extra = control.claim = None
            self._observe(path)
            self._wake()
            if path.record.role == "hedge" and path.record.timeline.sent_at is None:
                # Never sent (launched in the instant the round was decided, cut by
                # the call's deadline or its caller while it waited for a connection,
                # or failed before its request left): not a hedge (CallStats.hedges),
                # so its budget token goes back -- the budget caps the hedges that
                # reach an upstream.  (Also on the way out of a cancelled call: the
                # memory backend's refill has no checkpoint, Redis's is shielded.)
                await self._refund(self._ctx.runtime.governor)

    def _claimer(self, path: _Path) -> Callable[[], bool]:
        def claim() -> bool:
            if self._claim(path):
                return True
            # (A path that cannot win was cancelled when the race was decided; this
            # only makes sure it settles as what it is.)
            path.control.cancel(Outcome.HEDGE_CANCELLED)
            return False

        return claim

    def _claim(self, path: _Path) -> bool:
        """A race decides once: the first complete answer wins, unless a winner or
        another path's commit came first (the attempt layer refuses a result that
        finished after its cancel was called, in the winner's scheduler batch)."""
        if not self._may_win(path):
            return False
        self._winner = path
        if self._committed is None:
            self._committed = path
        self._cancel_others(path)
        return True

    def _may_win(self, path: _Path) -> bool:
        return (
            self._winner is None
            and self._committed in (None, path)
            and not path.control.cancelled
        )

    def _decided(self) -> bool:
        """A winner or a commit: from then on nothing launches."""
        return self._winner is not None or self._committed is not None

    def _committer(self, path: _Path) -> OnContent:
        forward = self._forward
        assert forward is not None

        def on_content(now: float, chunk: dict[str, Any]) -> Awaitable[None] | None:
            # A path cancelled by another's commit can still be running in the same
            # scheduler batch: it must neither commit nor reach the caller.
            if self._committed is None and self._winner is None and not path.control.cancelled:
                self._committed = path
                self._ctx.committed = path.record
                self._cancel_others(path)
                self._wake()
            if self._committed is path:
                if path.early is not None:
                    # What it sent before its first token goes first.
                    early, path.early = path.early, None
                    early.append(chunk)
                    return path.control.hold_while(functools.partial(self._deliver, early))
                if not forward.offer(chunk):
                    # The caller is behind: that wait is the caller's, not the upstream's.
                    return path.control.hold_while(forward.deliver_held)
            return None

        return on_content

    def _relayer(self, path: _Path) -> OnExtra:
        forward = self._forward
        assert forward is not None

        def on_extra(chunk: dict[str, Any]) -> Awaitable[None] | None:
            # Data without a content token (a reasoning block's signature, citations,
            # a finish chunk's annotations, an audio id): the caller's only from the path
            # that commits or wins.  Before the race is decided it is held with its
            # path (it commits nothing: SPEC §4 counts no such token).
            if path.control.cancelled:
                return None
            if self._committed is path:
                if not forward.offer(chunk):
                    return path.control.hold_while(forward.deliver_held)
            elif self._committed is None and self._winner is None:
                early = path.early
                if early is None:
                    early = path.early = []
                if len(early) < _EARLY_CAP:
                    early.append(chunk)
                # else: so many and still no token (an upstream that sends nothing
                # else): held on, parsed chunks would cost many times their bytes.
                # They are left out of the stream; the answer has them assembled.
            return None

        return on_extra

    async def _deliver(self, chunks: list[dict[str, Any]]) -> None:
        """Hand ``chunks`` to the caller in order, waiting for it when it is behind."""
        forward = self._forward
        assert forward is not None
        for chunk in chunks:
            if not forward.offer(chunk):
                await forward.deliver_held()

    def _first_token_waker(self) -> OnContent:
        woken = False

        def on_content(now: float, chunk: dict[str, Any]) -> None:
            nonlocal woken
            if not woken:
                woken = True
                self._wake()

        return on_content

    def _cancel_others(self, keep: _Path) -> None:
        if self._monitor_scope is not None:
            # (Without hedging there is no monitor, and trio's cancel() formats the
            # calling task's repr for its reason: ~2 µs a call for nothing.)
            self._monitor_scope.cancel()
        for path in self._paths:
            if path is not keep and not path.done:
                path.control.cancel(Outcome.HEDGE_CANCELLED)

    def _wake(self) -> None:
        changed = self._changed
        if changed is not None and changed:  # (only a hedging round's monitor parks)
            changed.unpark_all()

    def _observe(self, path: _Path) -> None:
        """Feed the adaptive threshold: first-token time, or whole-call time when the
        source does not stream."""
        if self._ctx.scope.hedge.after_quantile is None or self._ctx.kind != "chat":
            # Only chat calls hedge, so only theirs teach the trigger: an OCR page's
            # first token (an image to read first) would lift a chat scope's threshold.
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
        changed = self._changed
        assert changed is not None  # (made with the monitor, in run)
        while not self._decided() and any(not p.done for p in self._paths):
            at = self._next_trigger()
            if at <= trio.current_time():
                # Paths woken in this same instant run first (a first token, an answer
                # or a failure exactly at the threshold): a path exactly at it is not
                # late, and whether a hedge goes out must not hang on the order of one
                # scheduler batch.
                await trio.lowlevel.checkpoint()
                if self._decided() or self._next_trigger() > trio.current_time():
                    continue
                await self._try_hedge()
                continue
            if at == math.inf:
                await changed.park()
            else:
                with trio.move_on_at(at):
                    await changed.park()

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
        """When ``path`` is late; when that fell inside a stall of the loop, once the
        look the stall gives has ended (what its upstream sent during the stall is
        read first, over as many reads as it takes: see polygate._lag)."""
        late = self._late_from_timeline(path)
        lag = self._ctx.runtime.loop_lag
        return late if lag is None else lag.look_after(late)

    def _late_from_timeline(self, path: _Path) -> float:
        timeline = path.record.timeline
        if timeline.finished_at is not None:
            # Every choice finished (an empty answer too, with no first token): silence
            # after the end is neither a hang nor a stall.
            return math.inf
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
        if self._ctx.runtime.closed:
            # A call that outlived its session (started from a task outside the block)
            # sends nothing new through the closed transport: no hedge, as no new round.
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
        """Take a budget token, then try admission on another source; launch only if
        the round is still undecided after both awaits (each can be a network round
        trip to a shared backend, during which a path may win or commit)."""
        ctx = self._ctx
        governor = ctx.runtime.governor
        # The budget first: with an empty bucket a trigger costs one backend call, not
        # an admission and its release (and no transient permit or probe occupancy).
        # A shared backend that cannot answer means no hedge (fail closed): the
        # primary carries on.
        try:
            # The budget's refusals are counted per call, not per re-check.
            took = await governor.take_hedge_token(
                ctx.scope_name, count_refusal=ctx.scope_name not in ctx.hedge_refused
            )
            if not took:
                ctx.hedge_refused.add(ctx.scope_name)
        except GovernanceBackendError:
            took = False
        if took and not self._decided():
            in_flight = {p.admission.source for p in self._paths if not p.done}
            # Sources that failed in this round go to the back too, not only those
            # that failed in earlier rounds: least recently failed first, so one that
            # failed before and again in this round moves to the end.
            now_failed = list(dict.fromkeys(p.admission.source for p in self._failed))
            demote = [*(s for s in self._demote if s not in now_failed), *now_failed]
            try:
                result = await governor.try_admit(
                    ctx.scope_name, ctx.estimate, exclude=in_flight | refused_context(ctx),
                    demote=demote
                )
            except GovernanceBackendError:
                result = []
            except BaseException:
                # Cancelled during the admission round trip (the call ended): no hedge
                # was sent, so the token goes back (the refund has no checkpoint on
                # the memory backend and is shielded on Redis, as settles are).
                await self._refund(governor)
                raise
            if isinstance(result, Admission):
                if not self._decided() and not ctx.runtime.closed:
                    self._extras += 1
                    self._launch(result, "hedge")
                    return
                await governor.release(result, Outcome.CANCELLED, sent=False)
        if took:
            await self._refund(governor)
        # Refused, no candidate, or decided meanwhile: stay silent and look again one
        # threshold later — never sooner than the floor, or a tiny learnt threshold
        # turns a refused hedge into a busy loop of admission round trips.
        gap = self._threshold(self._paths[0].admission.source)
        gap = gap if math.isfinite(gap) else 1.0
        self._quiet_until = trio.current_time() + max(gap, _RECHECK_FLOOR_S)

    async def _refund(self, governor: Governor) -> None:
        try:
            await governor.refund_hedge_token(self._ctx.scope_name)
        except GovernanceBackendError:
            pass  # the token is lost: the budget errs on the side of fewer hedges
