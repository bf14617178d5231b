"""One attempt: an admitted source, one exchange under its watchdogs, then settlement.

The attempt owns three clocks, all trio cancel scopes:

* the whole attempt: ``timeout_s`` from the start;
* a watchdog whose deadline moves only when a content token arrives: before the first
  token it is ``ttft_timeout_s``, after it ``stall_timeout_s`` (keep-alive comments and
  empty deltas never move it — httpx's per-read timeouts would);
* whatever encloses the attempt: the hedge round (a loser is cancelled), the call
  deadline, the caller.

Whatever ends the attempt, its ``finally`` settles the admission by the governor's rules
and reports the attempt — synchronously for the in-memory backend, so a cancelled
loser is fully accounted before its round's nursery exits.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Final, TypeVar

import trio

from ._context import AttemptRecord, CallContext, ChatRequest
from ._errors import Outcome, TransientUpstreamError, UpstreamError
from ._json import plain_keys
from ._lag import look_end
from ._types import Usage
from .governance import Admission, positive_count
from .transport import OnContent, OnExtra, Timeline, chat_exchange, embeddings_exchange

__all__ = ["AttemptCancelled", "AttemptControl", "run_chat_attempt", "run_embed_attempt"]

T = TypeVar("T")

#: How far past its limit a watchdog fires (the statistics' stall threshold has the
#: same tolerance, polygate._stats): a token exactly at the limit is in time.
_WATCH_GRACE_S: Final = 1e-6


#: A cut (a reset, a close mid-body) of a stream its caller once held this long at
#: one stretch is not held against the source: a server stops waiting on a reader
#: that stops reading (nginx's ``send_timeout``, 60 s by default; a balancer's idle
#: timeout) once what it wrote meanwhile no longer fits the sockets' buffers.  At one
#: stretch, not in all: a reader a little slower than its upstream is held a moment
#: at each chunk, which adds up over a long stream, and the source that crashes
#: under it must still feed its breaker.
HELD_CUT_S: Final = 5.0


def _held_cut(error: UpstreamError, held_s: float) -> bool:
    """Whether ``error`` is a cut of a stream its caller held ``held_s`` at one stretch
    (then said so in its message: the operator sees why it is no breaker's business).
    Asked once an attempt, as it settles: before its error reaches anyone."""
    if not error.cut or held_s < HELD_CUT_S:
        return False
    error.message = (f"{error.message} (after the caller held the stream {held_s:.1f} s "
                     "at one stretch: a server may cut a reader that stops reading)")
    error.args = (error.message,)
    return True


def _past(limit: float) -> float:
    """``limit`` plus the grace, or plus the next float's distance where that is more:
    past ~2**34 s of clock (a MockClock jumped that far) 1 µs no longer moves it, and
    the watchdog fired in the instant of a token exactly at its limit."""
    if limit < _GRACE_MOVES_BELOW:  # (nearly always: a token's cost, no call to ulp)
        return limit + _WATCH_GRACE_S
    return limit + max(_WATCH_GRACE_S, math.ulp(limit))


#: Below it, the floats are closer than the grace (ulp(2**30) is 2.4e-7 s).
_GRACE_MOVES_BELOW: Final = 2.0**30


def _added(ctx: CallContext, record: AttemptRecord) -> Sequence[tuple[str, str]]:
    """The headers the attempt's request carries besides the source's own: its trace
    context (none unless the session traces), and what the call's front end adds."""
    headers = ctx.runtime.trace_headers
    if headers is None:
        return ctx.added_headers
    return (*headers(ctx, record), *ctx.added_headers) if ctx.added_headers else headers(ctx, record)


class AttemptControl:
    """The round's handle on one running attempt.

    One cancel scope carries all three of the attempt's own clocks: its deadline is
    the earlier of the whole-attempt deadline and the watchdog's, and the round
    cancels it outright.  When it fires, ``cancelled`` and the clock tell which.
    """

    __slots__ = (
        "_held", "_look_until", "_looked", "_looks", "_movable", "_watch", "_whole",
        "cancel_reason", "cancelled", "claim", "on_content", "on_extra", "record", "scope",
    )

    #: The most looks stalls of the loop give one due time (see stalled()).
    LOOKS: ClassVar[int] = 3

    def __init__(self, record: AttemptRecord, on_content: OnContent | None = None) -> None:
        self.record = record
        #: Made by ``start_clocks`` with its deadline: an unentered scope's deadline
        #: set afterwards costs trio's whole re-registration dance (~2 µs), for nothing.
        self.scope: trio.CancelScope | None = None
        self.cancel_reason = Outcome.CANCELLED
        self.cancelled = False
        self.on_content = on_content
        #: A stream's relay of chunks that carry data but no content token.
        self.on_extra: OnExtra | None = None
        #: The round's verdict on a complete answer, asked *before* it settles: True,
        #: it won (the others are cancelled); False, it lost (and is cancelled).  A
        #: settle may yield (Redis): decided after it, a path that completed meanwhile
        #: would settle as ``ok`` too, feeding the breaker though it lost.
        self.claim: Callable[[], bool] | None = None
        self._whole = math.inf
        self._watch = math.inf
        self._held = False  # in hold_while: its clocks are off
        #: The due time stalls of the loop last gave looks before firing, how many,
        #: and when the last look ends (stalled()).
        self._looked = math.nan
        self._looks = 0
        self._look_until = -math.inf
        #: What stalls before the request went may still move the clocks (stalled()).
        self._movable = math.inf

    def cancel(self, reason: Outcome) -> None:
        self.cancel_reason = reason
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()
        # (else the attempt has not started: start_clocks makes its scope cancelled)

    def start_clocks(self, whole: float, watch: float) -> trio.CancelScope:
        """The attempt's scope, to be entered now, with its clocks set (``watch`` as
        :meth:`watch` takes it)."""
        # Both a hair past their limits: an answer exactly at ``timeout_s`` is in time,
        # as a token exactly at a watchdog's limit is (see watch()).
        self._whole = _past(whole)
        self._watch = _past(watch)
        self._movable = min(whole, watch) - self.record.started_at
        scope = self.scope = trio.CancelScope(deadline=self._deadline())
        if self.cancelled:  # by the round, before this attempt's task first ran
            scope.cancel()
        return scope

    def watch(self, deadline: float) -> None:
        """Move the watchdog (only real content tokens do).  A token exactly at the
        limit is in time (SPEC §4: silent *longer* than ``stall_timeout_s``; a first
        token *within* ``ttft_timeout_s``): the scope fires a hair after it, or in the
        instant they share trio would cancel the read that brings the token."""
        # (_past's common branch written out: this runs for every content token)
        self._watch = deadline + _WATCH_GRACE_S if deadline < _GRACE_MOVES_BELOW else _past(deadline)
        earliest = self._deadline()
        # trio re-registers an entered scope's deadline on every assignment, even of
        # the same value (a heap update): the first token of an attempt without a
        # ttft watchdog changes nothing, so it assigns nothing.
        scope = self.scope
        assert scope is not None  # (the clocks run once the attempt has started)
        if earliest != scope.deadline:
            scope.deadline = earliest

    def answered(self, until: float) -> float:
        """Every choice has its finish_reason: no clock of the attempt's fires after
        it.  Silence is no stall, and the answer is in hand, so ``timeout_s`` has
        nothing left to bound: the exchange bounds the rest (a usage chunk, ``[DONE]``)
        itself, ``until`` then (``transport.END_GRACE_S``).  Returns the whole
        attempt's deadline as it was: content that still comes after the finish (a
        proxy that says "stop" on every chunk) is read until then at most."""
        whole = self._whole
        self._whole = self._watch = math.inf
        scope = self.scope
        assert scope is not None  # (a choice finished: the attempt has started)
        # (Whatever it was: a watchdog's deadline left in place would read, to the
        # exchange, as a bound on content that goes on after the finish.)
        if scope.deadline != math.inf:
            scope.deadline = math.inf
        return whole

    async def hold_while(self, wait: Callable[[], Awaitable[None]]) -> None:
        """Run ``wait`` (the caller taking a chunk it is behind on) with the attempt's
        own clocks stopped.  The consumer's pace is neither the upstream's silence nor
        its slowness: no timeout or stall fires meanwhile (nothing is fed to the
        breaker), the whole-attempt deadline moves by the time held, and the timeline
        subtracts it from later chunk times (no false stall in the statistics, no
        consumer time in ``generation_ms``)."""
        scope = self.scope
        assert scope is not None  # (a chunk came: the attempt has started)
        start = trio.current_time()
        scope.deadline = math.inf
        self._held = True
        try:
            await wait()
        finally:
            self._held = False
            held = trio.current_time() - start
            timeline = self.record.timeline
            timeline.paused_s += held
            if held > timeline.longest_hold_s:
                timeline.longest_hold_s = held
            # Both clocks stop: the stall clock too, whatever the chunk held (a content
            # chunk's caller restarts it at once; a data-only chunk's does not).
            self._whole += held
            self._watch += held
            scope.deadline = self._deadline()

    def stalled(self, now: float, stall: float) -> None:
        """The event loop did not look at the sockets for ``stall`` seconds, up to
        ``now`` (polygate._lag, before trio expires deadlines).

        A request not yet written (a connect, a TLS handshake, a pool's wait): the
        upstream has not begun, and the stall is the caller's alone: both clocks move
        by it -- by one of the first limit in all, at most, and then it has its looks
        as below: under stalls that recur (a container's CPU quota, spent every
        period), a connect to a host that drops its SYNs, whose retries the kernel goes
        on with meanwhile, took 8 s to time out of a ``timeout_s`` of 1.  Once it went,
        or past what may move, a clock due by ``now`` gives the attempt a look first,
        as long as the stall was, two seconds at most (``look_end``): what the
        upstream sent during the stall is read -- over as many reads as it takes --
        and a token moves the watchdog as ever; what silence remains fires after it.  ``LOOKS`` times for
        a due time at most: a look may end inside the next of such recurring stalls,
        but a loop busy turn after turn must not keep a hung upstream's clocks from
        firing."""
        scope = self.scope
        if self._held or scope is None:
            return  # (held: the clocks are off, and the hold moves them by its time)
        if self.record.timeline.sent_at is None and self._movable > 0.0:
            moved = stall if stall < self._movable else self._movable
            self._movable -= moved
            self._whole += moved
            self._watch += moved
            scope.deadline = self._deadline()
            if moved == stall:
                return
            # (Past what may move: a clock due by now gets its looks, as below.)
        due = self._watch if self._watch < self._whole else self._whole  # (the look aside)
        if due > now:
            return
        if due != self._looked:
            self._looked, self._looks = due, 0
        if self._looks < self.LOOKS:
            self._looks += 1
            self._look_until = look_end(now, stall)
            scope.deadline = self._look_until

    def _deadline(self) -> float:
        """The scope's deadline: the watchdog's or the whole attempt's, the earlier, and
        not before the end of a look a stall of the loop gave (a token read in it, or
        the end of a hold, would set a clock already past: the look's rest was lost)."""
        due = self._watch if self._watch < self._whole else self._whole
        return due if due >= self._look_until else self._look_until

    def timed_out(self, now: float) -> bool:
        return now >= self._whole


async def run_chat_attempt(
    ctx: CallContext,
    admission: Admission,
    control: AttemptControl,
    request: ChatRequest | None = None,
) -> dict[str, Any]:
    """One chat exchange; ``request`` (default: the call's messages and parameters)
    is what this attempt sends."""
    source = ctx.source(admission.source)
    endpoint = ctx.runtime.endpoints[(ctx.scope_name, source.name)]
    stall_timeout = ctx.scope.stream.stall_timeout_s
    forward = control.on_content
    messages_json: str | bytes = ctx.messages_json
    params = ctx.params
    prompt_estimate, completion_estimate = ctx.prompt_estimate, ctx.completion_estimate
    if request is not None:
        messages_json, params = request.messages_json, request.params
        if request.prompt_estimate is not None:
            prompt_estimate = request.prompt_estimate
        if request.completion_estimate is not None:
            completion_estimate = request.completion_estimate
    control.record.prompt_estimate = prompt_estimate

    async def work(timeline: Timeline) -> dict[str, Any]:
        watch = control.watch
        first = True

        def seen(now: float) -> None:
            # Moving a deadline costs a heap update: done only when a watchdog needs it.
            nonlocal first
            if stall_timeout is not None:
                if timeline.finished_at is not None:
                    return  # content after every choice finished: its clocks stay off
                watch(now + stall_timeout)
            elif first:
                first = False
                watch(math.inf)  # the first token ends the ttft watchdog

        def on_content(now: float, chunk: dict[str, Any]) -> Awaitable[None] | None:
            # Runs for every content chunk, synchronously unless the caller is behind.
            if forward is not None:
                # The round hands the chunk to the caller; when the caller is behind,
                # it stops this attempt's clocks meanwhile (AttemptControl.hold_while).
                wait = forward(now, chunk)
                if wait is not None:
                    return held(wait)
            seen(now)
            return None

        async def held(wait: Awaitable[None]) -> None:
            await wait
            seen(trio.current_time())  # the stall clock restarts when the caller is back


        return await chat_exchange(
            ctx.runtime.transport,
            endpoint,
            messages_json,
            params,
            limits=ctx.runtime.limits,
            timeline=timeline,
            on_content=on_content,
            call_id=ctx.logical_call_id,
            trace=_added(ctx, control.record),
            # Only the round's consumer (a stream's caller, a hedge's monitor) waits
            # for a first token; the watchdogs above need no scheduler pass for it.
            hand_on_first_token=forward is not None,
            on_extra=control.on_extra,
            on_finished=control.answered,
            choices=positive_count(params.get("n")) or 1,
            plain=_plain(ctx, params),
        )

    def usage_of(body: dict[str, Any]) -> Usage:
        reported = Usage.from_wire(body.get("usage"))
        if reported is not None:
            return reported
        # The estimate, never below what streamed (a content chunk: a token at least),
        # as the quota settles it.
        completion = max(completion_estimate, len(control.record.timeline.chunk_times))
        return Usage(prompt_estimate, completion, prompt_estimate + completion, source="estimated")

    ttft_timeout = source.ttft_timeout_s
    stall_first = False
    if ctx.continuation is not None and stall_timeout is not None and endpoint.streams and (
            ttft_timeout is None or stall_timeout <= ttft_timeout):
        # A continuation of a committed stream: the caller's stream is silent until
        # its first token, so the stall watch bounds that wait too (else only
        # timeout_s would, and resume would stretch the silence a stream may keep).
        # Not from a source that cannot stream: its first token is its whole answer,
        # which the stall watch (silence between tokens) never bounds.
        ttft_timeout, stall_first = stall_timeout, True
    return await _guarded(
        ctx, admission, control, source.timeout_s, ttft_timeout, work, usage_of,
        first_token_stall=stall_first,
    )


async def run_embed_attempt(
    ctx: CallContext, admission: Admission, control: AttemptControl, inputs: list[str]
) -> tuple[list[list[float]], Any]:
    source = ctx.source(admission.source)
    endpoint = ctx.runtime.endpoints[(ctx.scope_name, source.name)]

    async def work(timeline: Timeline) -> tuple[list[list[float]], Any]:
        return await embeddings_exchange(
            ctx.runtime.transport, endpoint, inputs, ctx.params,
            limits=ctx.runtime.limits, timeline=timeline, call_id=ctx.logical_call_id,
            trace=_added(ctx, control.record),
        )

    def usage_of(result: tuple[list[list[float]], Any]) -> Usage:
        payload = result[1]
        wire = payload.get("usage") if isinstance(payload, dict) else None
        usage = Usage.from_wire(wire)
        if usage is None or usage.total_tokens == 0:
            # (0 tokens for inputs that are never empty is no count: LM Studio reports
            # it for every request; believed, the source's TPM would never bind.)
            return Usage(admission.tokens, 0, admission.tokens, source="estimated")
        # An embedding's tokens are all input: an upstream that reports only
        # total_tokens (Voyage AI) reported its prompt tokens.
        return Usage(usage.total_tokens, 0, usage.total_tokens, source=usage.source)

    # An embeddings answer is never streamed: ttft_timeout_s bounds the whole of it,
    # as it does a chat answer from a source that cannot stream.
    return await _guarded(
        ctx, admission, control, source.timeout_s, source.ttft_timeout_s, work, usage_of
    )


class AttemptCancelled(Exception):
    """The round cancelled this attempt (it lost the race, or the round ended)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.value)
        self.outcome = outcome


async def _guarded(
    ctx: CallContext,
    admission: Admission,
    control: AttemptControl,
    timeout_s: float,
    ttft_timeout_s: float | None,
    work: Callable[[Timeline], Awaitable[T]],
    usage_of: Callable[[T], Usage],
    *,
    first_token_stall: bool = False,
) -> T:
    """``first_token_stall``: ``ttft_timeout_s`` is the stall watch of a continuation
    (its miss is a stall, not a timeout)."""
    record = control.record
    timeline = record.timeline
    outcome = Outcome.CANCELLED  # unless something below says otherwise
    error: UpstreamError | None = None
    start = trio.current_time()
    scope = control.start_clocks(
        start + timeout_s, start + ttft_timeout_s if ttft_timeout_s is not None else math.inf
    )
    # A stall of the loop gives the attempt a look before its clocks fire (polygate._lag).
    lagging = ctx.runtime.loop_lag
    if lagging is not None:
        lagging.attempts.add(control)
    try:
        with scope:
            result = await work(timeline)
            record.usage = usage_of(result)
            claim = control.claim
            if not control.cancelled and (claim is None or claim()):
                outcome = Outcome.OK
                return result
        # ``cancel()`` is delivered at the next checkpoint: an attempt runnable in the
        # winner's scheduler batch can finish its buffered answer without one and
        # return normally after it was cancelled.  It lost all the same (its usage is
        # known, so it settles that, not the estimate).
        # The scope caught a cancellation of its own: the round's, or one of the clocks.
        if control.cancelled:
            outcome = control.cancel_reason
            raise AttemptCancelled(outcome)
        if control.timed_out(trio.current_time()):
            raise TransientUpstreamError(
                f"attempt exceeded timeout_s={timeout_s}",
                source=admission.source, outcome=Outcome.TIMEOUT,
            )
        raise _watchdog_error(ctx, admission.source, timeline, ttft_timeout_s, first_token_stall)
    except UpstreamError as exc:
        if control.cancelled:
            # The same race as above, ending in a fault instead: a buffered cut or
            # malformed body surfacing after this path lost.  A loser never feeds the
            # breaker or the source's health, whatever its body held.
            outcome = control.cancel_reason
            raise AttemptCancelled(outcome) from None
        error = exc
        # The session closed under it (a call from a task outside the session block,
        # its connection cut by the pool's close): the caller's doing, not the
        # upstream's -- settled as a cancellation, no breaker, no health.
        outcome = Outcome.CANCELLED if ctx.runtime.closed else exc.outcome
        raise
    finally:
        if lagging is not None:
            lagging.attempts.discard(control)
        if outcome is Outcome.CANCELLED:
            outcome = control.cancel_reason
        record.error = error
        await _settle(ctx, admission, record, outcome, error)


def _plain(ctx: CallContext, params: Mapping[str, Any]) -> bool:
    """Whether ``params``' keys are all plain (``plain_keys``), found once for the call's
    parameters (or a round's own), however many attempts send them."""
    known = ctx.plain_params
    if known is None or known[0] is not params:
        known = ctx.plain_params = (params, plain_keys(params))
    return known[1]


def _watchdog_error(
    ctx: CallContext, source: str, timeline: Timeline, ttft_timeout_s: float | None,
    first_token_stall: bool = False,
) -> UpstreamError:
    if timeline.first_token_at is None and first_token_stall:
        return TransientUpstreamError(
            "the continuation of the stream sent no first token within "
            f"stall_timeout_s={ttft_timeout_s}", source=source, outcome=Outcome.STALLED,
        )
    if timeline.first_token_at is None:
        waited = "no answer" if ctx.kind == "embed" else "no first token"
        return TransientUpstreamError(
            f"{waited} within ttft_timeout_s={ttft_timeout_s}",
            source=source, outcome=Outcome.TIMEOUT,
        )
    return TransientUpstreamError(
        f"stream silent for more than stall_timeout_s={ctx.scope.stream.stall_timeout_s}",
        source=source, outcome=Outcome.STALLED,
    )


async def _settle(
    ctx: CallContext,
    admission: Admission,
    record: AttemptRecord,
    outcome: Outcome,
    error: UpstreamError | None,
) -> None:
    """Settle by the governor's rules and report the attempt.  Runs in ``finally``,
    possibly inside a cancelled scope: the memory backend's settle has no checkpoint."""
    timeline = record.timeline
    now = trio.current_time()
    record.ended_at = now
    record.outcome = outcome
    usage = record.usage
    usage_tokens = usage.total_tokens if usage is not None and usage.source == "upstream" else None
    latency = (now - timeline.sent_at - timeline.paused_s) if timeline.sent_at is not None else None
    # Cut with no answer at all, by the call's deadline or by a hedge that won: the
    # source made the call wait this long and would have taken longer (a lower bound
    # of its latency, for its health).  Not when the caller left (its own doing), nor
    # once anything came (a long answer is not a hung source).
    waited = latency if timeline.first_token_at is None and (
        outcome is Outcome.HEDGE_CANCELLED or (
            outcome is Outcome.CANCELLED and ctx.deadline_at is not None and now >= ctx.deadline_at)
    ) else None
    streamed = len(timeline.chunk_times)  # content chunks: a token each, at least
    # The source's latency, for its health: how long it made the call wait for its
    # first token where the answer streamed one.  Not the whole answer's time, which
    # grows with the answer: one long answer (a 2,000-token essay at a fast pace) made
    # a healthy source look forty times slower than its twin, which then took ~99 % of
    # the scope's calls.  (A source that streams slowly is the stall watchdog's.)
    if timeline.first_token_at is not None and timeline.sent_at is not None:
        latency = timeline.first_token_at - timeline.sent_at
    try:
        record.tokens_settled = await ctx.runtime.governor.release(
            admission,
            outcome,
            usage_tokens=usage_tokens,
            sent=timeline.sent_at is not None,
            retry_after_s=error.retry_after_s if error is not None else None,
            latency_s=latency,
            waited_s=waited,
            at_least=(record.prompt_estimate + streamed if streamed
                      else admission.tokens if timeline.billed else 0),
            neutral=error is not None and (
                error.exhausted is not None or _held_cut(error, timeline.longest_hold_s)),
        )
    finally:
        # Reported whatever cut the release (Ctrl-C, which no shield holds back, in a
        # Redis settle): the row is queued without blocking, and never raises.
        ctx.runtime.recorder.attempt(ctx, record)
