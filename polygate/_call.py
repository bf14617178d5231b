"""A logical call: one deadline scope around a retry loop of rounds.

::

    logical call ─ deadline scope (trio.fail_after: the whole tree, cleanup included)
      └ retry loop (max_attempts, full-jitter backoff, Retry-After via cooldowns)
          └ round (see _hedge): primary attempt + hedges
              └ attempt (see _attempt): admission → exchange → settle → report

Retry rules (SPEC §3): a fatal error is raised as itself at once; a round in which
every attempt was rate limited is free of ``max_attempts`` (the sources cool down for
their Retry-After and admission waits it out, bounded by the deadline or, without one,
by ``rate_limit_wait_s``); any other failed round consumes one attempt.  The next round
prefers sources that have not failed in this call; backoff sleeps only when every
source of the scope has already failed once — switching to a fresh source is
immediate.  Out of attempts or sources: :class:`AllSourcesExhausted` with every
attempt's error.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from ._attempt import AttemptControl, run_chat_attempt, run_embed_attempt
from ._backoff import full_jitter
from ._callstats import call_stats, chat_response
from ._config import Source
from ._context import (
    AttemptRecord,
    CallContext,
    ChatRequest,
    Continuation,
    Runtime,
    refused_context,
)
from ._errors import (
    AllSourcesExhausted,
    ConfigError,
    DeadlineExceeded,
    FatalUpstreamError,
    GovernanceBackendError,
    Outcome,
    PolygateError,
    RateLimitedError,
    StreamStalled,
    StructuredOutputError,
    TransientUpstreamError,
    UpstreamError,
)
from ._fallback import continuation_scope, failure_reasons, fallback_scope, first_not_refused
from ._hedge import Forward, Round, RoundFailed, Runner
from ._resume import (
    PREFILL_PARAMS,
    ResumedForward,
    Stitcher,
    StreamSink,
    continuation_messages,
)
from ._types import CallStats, ChatResponse, EmbeddingResponse, Usage, encode_compact, message_delta
from .governance import (
    Admission,
    BreakerState,
    NoAdmission,
    Refusal,
    RefusalReason,
    chars_tokens,
    completion_budget,
    only_breakers,
    positive_count,
)
from .transport import Endpoint, Timeline, message_text

__all__ = ["Rounds", "call_stats", "every_error", "one_apart", "one_error", "run_chat", "run_embed"]

T = TypeVar("T")


class Rounds(Protocol):
    """More rounds inside one logical call (structured output's re-asks, SPEC §8.1).

    Every round is a full retry loop — admission, hedging, retries — under the call's
    one deadline; its attempts are the call's attempts.  ``request`` says what an
    attempt on ``source`` sends in the current round (``None``: the call's own
    messages and parameters); ``after_round`` judges the round's answer: the call's
    final response, or the messages of the next round.  It raises a polygate error to
    end the call (carrying the response's frozen statistics).
    """

    #: How many times a round may be asked again (0: one round only).
    max_reasks: int
    #: The characters of prompt each request of these rounds adds beyond the call's
    #: messages and parameters (a schema sent as ``response_format``, or written into
    #: an instruction): reserved with them, as the governor counts text.
    prompt_chars: int

    def request(
        self, source: Source, messages: Sequence[Mapping[str, Any]], messages_json: str,
        *, strict: bool = False,
    ) -> ChatRequest | None: ...

    async def after_round(
        self, response: ChatResponse, messages: Sequence[Mapping[str, Any]]
    ) -> ChatResponse | list[Mapping[str, Any]]: ...

    def cache_key(self) -> Any:
        """What these rounds add to a response-cache key (a schema changes the answer)."""
        ...

    async def ready(self) -> None:
        """Finish preparing before the first round (ConfigError: nothing was sent)."""
        ...

    async def accept(self, response: ChatResponse) -> ChatResponse | None:
        """A stored answer as these rounds' answer (``parsed`` set), or ``None``."""
        ...


async def _with_deadline(
    ctx: CallContext, deadline_s: float | None, body: Callable[[], Awaitable[T]]
) -> T:
    """Run ``body`` under the call deadline; attach frozen statistics to every error.

    The deadline is one absolute time, ``ctx.started_at + deadline_s`` (the same
    ``_deadline_at`` that bounds admission waits): one clock base for the whole tree."""
    recorder = ctx.runtime.recorder
    deadline_at = ctx.deadline_at = _deadline_at(ctx, deadline_s)
    try:
        try:
            if deadline_at is None:  # (no nullcontext: three calls a call, for nothing)
                return await body()
            with trio.fail_at(deadline_at):
                result = await body()
                if trio.current_time() > deadline_at:
                    # An answer read without a checkpoint after the deadline (its bytes
                    # were waiting when a stall of the caller's loop ended): the
                    # deadline passed, and fires now whatever the answer's length --
                    # one that must wait for its next read would have.
                    raise trio.TooSlowError
                return result
        except BaseExceptionGroup as group:
            error, rest = one_apart(group)
        except trio.TooSlowError:
            # A stream the deadline cut: its statistics are the committed attempt's, as
            # far as it got (the source the caller's text came from, its first token).
            committed = ctx.committed
            earlier = [r for r in ctx.segments if r is not committed]
            frozen = call_stats(ctx, committed, trio.current_time(), earlier)
            raise DeadlineExceeded(
                f"call exceeded its deadline of {deadline_s} s "
                f"({frozen.attempts} attempt(s), scope {ctx.scope_name!r})",
                call_stats=frozen,
            ) from None
        # (Raised outside the handler: inside it, the group would become its context.)
        try:
            raise error from rest
        finally:
            del error, rest  # (its traceback holds this frame: a cycle, for a Cancelled too)
    except ConfigError as exc:
        if not ctx.attempts:
            raise  # the caller's arguments (an OCR page out of range): not a call's outcome
        # Found bad after attempts ran (a PDF page PDFium cannot load, met once the
        # pages before it were sent): the call has an outcome, and its attempts'
        # rows a call row to belong to.
        if ctx.record_call:
            recorder.call(ctx, call_stats(ctx, None, trio.current_time()), None, exc)
        raise
    except PolygateError as exc:
        stats: CallStats | None = getattr(exc, "call_stats", None)
        if stats is None:
            stats = call_stats(ctx, None, trio.current_time())
            if hasattr(exc, "call_stats"):
                exc.call_stats = stats
        if ctx.record_call:
            recorder.call(ctx, stats, None, exc)
        raise
    except BaseException as exc:  # cancelled by the caller (or a bug): still one row
        if ctx.record_call:
            recorder.call(ctx, call_stats(ctx, None, trio.current_time()), None, exc)
        raise
    finally:
        if ctx.kind == "chat":
            # In finally: cancelled calls refill the hedge budget too — of every scope
            # the call asked (the one it started in, and each fallback it moved to).
            settings = ctx.runtime.settings
            for name in dict.fromkeys((ctx.first_scope or ctx.scope_name, *ctx.fallbacks)):
                if settings.scopes[name].hedge.enabled:
                    await ctx.runtime.governor.refill_hedge_budget(name)


class CommittedFailure(Exception):
    """The committed path of a stream failed after the caller saw its text: no retry
    of this request (its ``record`` is the segment as far as it got)."""

    def __init__(self, error: UpstreamError, record: AttemptRecord | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.record = record


# Protected from KeyboardInterrupt (see _session._ki_protected): landing between a
# source's admission and the attempt's try/finally that settles it, or in the settle,
# it left the permit and the reservation taken for the session's life.  (Every way
# in is marked already, the session's methods and the tasks a call starts; this mark
# keeps it so for a way in added later.)
@trio.lowlevel.enable_ki_protection
async def _retry_loop(
    ctx: CallContext,
    runner: Runner,
    forward: Forward | None,
    deadline_at: float | None,
    tokens: int,
    *,
    demoted: Sequence[str] = (),
) -> tuple[AttemptRecord, Any]:
    retry = ctx.scope.retry
    governor = ctx.runtime.governor
    errors: list[UpstreamError] = []
    failed: list[str] = list(demoted)
    consumed = 0
    same_source: dict[str, int] = {}
    again: str | None = None  # the source to retry first (Retry.same_source_retries)
    again_waits = True  # ... waiting out its cooldown (not when it is asked again)
    admitted: Admission | None = None  # an admission the loop already holds
    # Admission waits until the deadline; without one, waiting out 429 cooldowns is
    # bounded by rate_limit_wait_s (permits, RPM windows and breakers free up alone).
    give_up_at = deadline_at if deadline_at is not None else math.inf
    cooldown_give_up_at = (
        deadline_at if deadline_at is not None else ctx.started_at + retry.rate_limit_wait_s
    )
    # A scope whose sources' breakers are all open is exhausted for a call that has a
    # fallback to go to: waiting out an open period (seconds, growing with each failed
    # probe) only delays the answer the fallback can give now.  The probe that closes
    # a breaker is the first call that finds it due.
    wait_for_breakers = ctx.scope.fallback is None or "exhausted" not in ctx.scope.fallback_on
    # A continuation's waits are silence on the caller's stream, as its wait for a
    # first token is: each wait for admission at most stall_timeout_s, and its 429s,
    # free of max_attempts, retried within one stall_timeout_s in all, not until the
    # deadline or rate_limit_wait_s (each short, they would add up to either).
    stall = ctx.scope.stream.stall_timeout_s if ctx.continuation is not None else None
    silent_until = trio.current_time() + stall if stall is not None else math.inf
    while True:
        admission, admitted = admitted, None
        if ctx.runtime.closed:
            # A call from a task outside the session block outlived the session:
            # nothing more is sent through its closed transport.
            if admission is not None:
                await governor.release(admission, Outcome.CANCELLED, sent=False)
            raise PolygateError("this session is closed")
        if admission is None:
            # A cancel point before admission: the memory backend admits without one,
            # so a call made in a cancelled scope (or cancelled while it backed off)
            # took a permit and a reservation, and wrote an attempt row, for a request
            # it never sent.
            await trio.lowlevel.checkpoint_if_cancelled()
        if admission is None and again is not None:
            admission = await _same_source(ctx, again, tokens, min(
                cooldown_give_up_at, silent_until,
                trio.current_time() + stall if stall is not None else math.inf,
                # (A source asked again without what it refused is asked first only
                # if it can be now: its cooldown is waited out only by a retry that
                # same_source_retries asked for.)
                math.inf if again_waits else trio.current_time(),
            ))
        if admission is None:
            limit, cooldown_limit = give_up_at, cooldown_give_up_at
            if stall is not None:
                bound = trio.current_time() + stall
                limit, cooldown_limit = min(limit, bound), min(cooldown_limit, bound, silent_until)
            try:
                admission = await governor.acquire(
                    ctx.scope_name, tokens, exclude=refused_context(ctx), demote=failed,
                    give_up_at=limit, cooldown_give_up_at=cooldown_limit,
                    wait_for_breakers=wait_for_breakers,
                )
            except NoAdmission as exc:
                # Gave up at the deadline: the deadline's own cancellation is due at this
                # very instant (one clock base), so let it speak (DeadlineExceeded).
                await trio.lowlevel.checkpoint_if_cancelled()
                if not wait_for_breakers and only_breakers(exc.refusals) and not (
                    await _fallback_admits(ctx)
                ):
                    # The fallback cannot take the call now either: this scope's
                    # breakers are what to wait for after all (their probe may be due
                    # long before the fallback's).
                    wait_for_breakers = True
                    continue
                too_large = _never_admitted(ctx, errors, exc.refusals)
                raise AllSourcesExhausted(
                    f"{exc}{_too_large_detail(ctx, tokens) if too_large else ''} after "
                    f"{len(errors)} failed attempt(s) in scope {ctx.scope_name!r}"
                    + _last_errors(errors),
                    errors=errors, retry_after_s=_rate_limited_for(exc.refusals), timed=exc.timed,
                    too_large=too_large,
                ) from None
        try:
            return await Round(ctx, runner, forward=forward, demote=failed).run(admission)
        except RoundFailed as failure:
            round_errors = failure.errors
            primary_error = failure.primary
            committed = failure.committed
            committed_record = failure.committed_record
            if committed is not None:
                # Content reached the caller: no retry.  Its statistics are those of
                # the committed attempt, as far as it got.
                committed.call_stats = call_stats(
                    ctx, failure.committed_record, trio.current_time()
                )
        errors.extend(round_errors)
        for error in round_errors:
            if error.source in failed:
                failed.remove(error.source)
            if error.source is not None:
                failed.append(error.source)
        if committed is not None:
            raise CommittedFailure(committed, committed_record)
        for error in round_errors:
            if isinstance(error, FatalUpstreamError):
                raise error
        refusing = [e.source for e in round_errors if e.asked_again and e.source is not None]
        if refusing:
            # polygate's way of asking was refused, not the request: the same source is
            # asked again without it (the prefill, stream_options, streaming), first,
            # free of max_attempts and of same_source_retries (once per source and
            # field: it is never asked so again), whatever the round's other path did.
            for source in refusing:
                if source in failed:
                    failed.remove(source)
            again, again_waits = refusing[0], False
            continue
        again, again_waits = _retry_same(retry.same_source_retries, primary_error, same_source), True
        if again is not None:
            # Retried on the same source first, free of max_attempts (bounded by
            # same_source_retries per source): a short outage of the preferred
            # source costs a wait, not a move to the others (or the fallback).  It
            # stays among the failed: when that retry cannot be had (a cooldown past
            # the wait's bound, its breaker open) the call fails over, and once every
            # source has failed the next round waits its backoff.
            if not isinstance(primary_error, RateLimitedError):
                until = trio.current_time() + full_jitter(
                    same_source[again], retry.backoff_base_s, retry.backoff_max_s, ctx.runtime.rng
                )
                # (Its breaker open, or a cooldown past the wait: _same_source fails
                # over at once, and the wait before it would serve nothing.)
                if not await _refused_past(ctx, errors, [again], until):
                    await trio.sleep_until(until)
            continue
        if round_errors and all(isinstance(e, RateLimitedError) for e in round_errors):
            # Free of max_attempts: the sources cool down (never for less than the
            # governor's floor, so Retry-After: 0 cannot make this loop spin) and
            # admission waits them out — but only until the deadline or, without
            # one, rate_limit_wait_s after the call started.  Past that, only a
            # source that has not rate limited this call may still take it (one that
            # failed otherwise, long ago): the call is not given up while one admits.
            now = trio.current_time()
            if now >= min(cooldown_give_up_at, silent_until):
                limited = {e.source for e in errors if isinstance(e, RateLimitedError) and e.source}
                # (At a deadline nothing more starts: its cancellation is due now.)
                at_deadline = deadline_at is not None and now >= deadline_at
                result = [] if at_deadline else await governor.try_admit(
                    ctx.scope_name, tokens, exclude=limited | refused_context(ctx), demote=failed
                )
                if not isinstance(result, Admission):
                    waited = "at the deadline" if at_deadline else (
                        f"after stall_timeout_s={stall} of silence on the resumed stream"
                        if now >= silent_until
                        else f"after rate_limit_wait_s={retry.rate_limit_wait_s}"
                    )
                    after = _rate_limited_for(result)
                    if not at_deadline:
                        # The sources left out above cool down too: when the first of
                        # them may take the call again (the errors' own Retry-After is
                        # as old as each 429; the client would come back too early).
                        cooling = await _cooling_for(ctx, limited)
                        if cooling is not None:
                            after = cooling if after is None else min(after, cooling)
                    raise AllSourcesExhausted(
                        f"every source still rate limited {waited} in scope {ctx.scope_name!r}"
                        + _last_errors(errors),
                        errors=errors, retry_after_s=after, timed=True,
                    )
                admitted = result
            continue
        consumed += 1
        if consumed >= retry.max_attempts:
            raise AllSourcesExhausted(
                f"all {len(errors)} attempt(s) failed in scope {ctx.scope_name!r}"
                + _last_errors(errors),
                errors=errors,
            )
        if set(failed) >= {s.name for s in ctx.scope.sources} - refused_context(ctx):
            # Every source it may ask failed (those of a model that refused the call's
            # context are never asked): the next try waits.
            until = trio.current_time() + full_jitter(
                consumed, retry.backoff_base_s, retry.backoff_max_s, ctx.runtime.rng
            )
            if not await _refused_past(ctx, errors, failed, until):
                await trio.sleep_until(until)  # (the look above counts against it)


#: A refusal of streaming itself, not of the request (OpenAI, o3 and gpt-5, to an
#: organization that has not verified itself: "Your organization must be verified to
#: stream this model").
_NO_STREAMING = re.compile(r"must be verified to stream", re.IGNORECASE)
#: A refusal of the ``stream_options`` field itself: Mistral's pydantic error at its
#: location (``extra_forbidden``), Azure's "Unrecognized request argument supplied:
#: stream_options", Groq's "property 'stream_options' is unsupported", xAI's "Argument
#: not supported: stream_options" -- not any error whose text echoes the request.
_NO_STREAM_OPTIONS = re.compile(
    r"stream_options.{0,80}(extra_forbidden|not permitted|unsupported|not supported|unknown)"
    r"|(unrecognized|not supported|unsupported|unknown)[^.]{0,60}stream_options",
    re.IGNORECASE | re.DOTALL,
)


async def run_asking_again(
    ctx: CallContext, admission: Admission, control: AttemptControl, request: ChatRequest | None
) -> Any:
    """``run_chat_attempt``, a refusal of polygate's own way of asking turned into the
    error that asks the source again without it (``ask_again``)."""
    try:
        return await run_chat_attempt(ctx, admission, control, request)
    except FatalUpstreamError as exc:
        again = ask_again(ctx, admission.source, exc, control.record.timeline)
        if again is not None:
            control.record.listed_error = again  # (as the call lists it: see every_error)
            raise again from exc
        raise


def ask_again(
    ctx: CallContext, source: str, error: FatalUpstreamError, sent: Timeline
) -> UpstreamError | None:
    """The error to retry with when ``error`` refused polygate's own way of asking, not
    the caller's request: the same source is asked again without it, free of
    ``max_attempts`` (see _retry_loop), and never asked so again in this session;
    ``None`` when the request itself was refused.  ``sent``: the refused attempt's
    timeline, which says what its request carried (another call may have taught the
    source meanwhile: a refusal of a request sent before is still one)."""
    endpoint = ctx.runtime.endpoints[(ctx.scope_name, source)]
    learnt = _learn_refusal(endpoint, error, ctx.params, sent)
    if learnt is None:
        return None
    again = TransientUpstreamError(
        f"refused {learnt} ({error.message}); asking without it",
        source=error.source, status_code=error.status_code,
    )
    again.asked_again = True
    return again


def _learn_refusal(
    endpoint: Endpoint, error: FatalUpstreamError, params: Mapping[str, Any], sent: Timeline
) -> str | None:
    """What of polygate's own way of asking ``error`` refuses -- streaming, or the
    ``stream_options`` it adds -- now marked on ``endpoint`` not to be asked again;
    ``None`` when it refuses the request itself."""
    asking = endpoint.asking
    if sent.sent_stream and _NO_STREAMING.search(error.message):
        asking.stream = False
        return "streaming"
    given = params.get("stream_options")
    if (sent.sent_stream_options and error.status_code in (400, 422)
            and (given is None or (isinstance(given, Mapping) and set(given) <= _OURS))
            and _NO_STREAM_OPTIONS.search(error.message)):
        # (Not when the caller sent stream_options of its own beyond include_usage,
        # which polygate asks for anyway: then the request, as the caller wrote it,
        # is what was refused.  A gateway client's include_usage is the gateway's.)
        asking.stream_options = False
        return "stream_options"
    return None


#: OpenAI's (and Azure OpenAI's) refusal of a schema strict mode cannot take.
_NOT_STRICT = re.compile(r"invalid schema for response_format", re.IGNORECASE)

#: The ``stream_options`` polygate sends of its own.
_OURS = frozenset({"include_usage"})


def _never_admitted(ctx: CallContext, errors: Sequence[Any], refusals: Sequence[Any]) -> bool:
    """Whether the caller's request as sent can never be admitted: every candidate
    refused its estimate alone as over ``tpm``, before any attempt of the call, and
    the estimate is the request's own (not a re-ask's or a continuation's, which carry
    an answer too)."""
    return (
        bool(refusals) and not errors and not ctx.reasks and ctx.continuation is None
        and all(r.reason is RefusalReason.TOO_LARGE for r in refusals)
    )


def _not_too_large(exc: AllSourcesExhausted, ctx: CallContext) -> None:
    """Drop the over-tpm detail of a chat call that an earlier scope took: the text
    :func:`_too_large_detail` added in the last scope's retry loop, which asked with
    ``ctx.estimate`` (no scope was entered since)."""
    if exc.args and isinstance(exc.args[0], str):
        detail = _too_large_detail(ctx, ctx.estimate)
        exc.args = (exc.args[0].replace(detail, "", 1), *exc.args[1:])


def _too_large_detail(ctx: CallContext, tokens: int) -> str:
    """What a request no source can admit needs, and what the sources allow, in every
    scope it went through: how much an agent's history (or a batch, or a page) must
    lose -- the gateway key's own refusal says as much."""
    if ctx.kind == "embed":
        needs = (f"one batch of its inputs needs about {tokens:,} tokens (the scope's "
                 f"embed_batch_size is {ctx.scope.embed_batch_size})")
    elif ctx.kind == "ocr":
        needs = f"a page needs about {tokens:,} tokens"
    else:
        needs = (f"the request needs about {tokens:,} tokens (its prompt -- messages, tools "
                 f"and parameters -- about {ctx.prompt_estimate:,}, the completion's budget "
                 f"{ctx.completion_estimate:,})")
    scopes = list(dict.fromkeys([ctx.first_scope or ctx.scope_name, *ctx.fallbacks]))
    limits = ", ".join(
        f"{source.name} {source.tpm:,}" + (f" in {name!r}" if len(scopes) > 1 else "")
        for name in scopes for source in ctx.runtime.settings.scopes[name].sources
        if source.tpm is not None)
    return f": {needs}, more than a source may use in a minute (tpm: {limits})"


#: Admission refusals a wait cures: every source was rate limited.
_RATE_REASONS = frozenset({RefusalReason.COOLING_DOWN, RefusalReason.RPM, RefusalReason.TPM})


async def _fallback_admits(ctx: CallContext) -> bool:
    """Whether the call's fallback scope has a source that is up: its breaker not open
    (or its open period over), neither dead nor cooling down.  Read from the backend's
    state, not by admitting (an admission given back would still count as one, and
    take a half-open breaker's probe); quotas and permits are left out: they free up
    by themselves, there too."""
    target = ctx.scope.fallback
    if target is None:
        return False
    backend = ctx.runtime.governor.backend
    now = backend.now()
    for source in ctx.runtime.settings.scopes[target].sources:
        try:
            state = await backend.snapshot(target, source.name)
        except GovernanceBackendError:
            return False
        # An open breaker whose period is over admits its probe now: up (a snapshot
        # says OPEN until an admission check moves it on, however long ago that was).
        open_now = state.breaker is BreakerState.OPEN and (
            state.breaker_open_until is None or state.breaker_open_until > now
        )
        if not open_now and not state.dead and (
            state.cooldown_until is None or state.cooldown_until <= now
        ):
            return True
    return False


async def _cooling_for(ctx: CallContext, sources: set[str]) -> float | None:
    """Seconds until the first of ``sources`` ends its cooldown (0: one has); None when
    there are none, or the backend cannot say."""
    backend = ctx.runtime.governor.backend
    waits: list[float] = []
    for name in sorted(sources):
        try:
            state = await backend.snapshot(ctx.scope_name, name)
        except GovernanceBackendError:
            return None
        until = state.cooldown_until
        waits.append(0.0 if until is None else max(0.0, until - backend.now()))
    return min(waits) if waits else None


def _rate_limited_for(refusals: Sequence[Refusal]) -> float | None:
    """Seconds until a source may admit the call, when every refusal is one a wait
    cures (``AllSourcesExhausted.retry_after_s``); None otherwise."""
    if not refusals or not all(r.reason in _RATE_REASONS for r in refusals):
        return None
    now = trio.current_time()
    known = [r.retry_at - now for r in refusals if r.retry_at is not None]
    return max(0.0, min(known)) if known else 1.0  # (each reason has its time: a guess)


async def _refused_past(
    ctx: CallContext, errors: Sequence[UpstreamError], failed: Sequence[str], until: float
) -> bool:
    """Whether no failed source can be admitted before ``until`` (when the backoff
    would end): each last failed dead (401, 403, …) with ``dead_cooldown_s`` at least
    ``backoff_max_s``, so that the mark outlasts any backoff, is cooling down past it (a
    5xx's Retry-After), or has its breaker open past it -- the failure that opened it
    was this round's.  Then the backoff waits for
    nothing: the next round finds them refused and the call moves on to its fallback,
    gives up at once (a cooldown past its give-up time), or waits in admission for the
    same period the backoff lies inside.  Where one may be back first, the backoff is
    what keeps it from being asked (probed) again at once."""
    backend = ctx.runtime.governor.backend
    last = {e.source: e for e in errors if e.source is not None}
    dead_past = ctx.runtime.settings.dead_cooldown_s >= ctx.scope.retry.backoff_max_s
    # The look is bounded by the backoff it may skip: a Redis that hangs costs the
    # backoff, as before, not its read timeout on top (the caller sleeps until
    # ``until``, which the look has used up).
    with trio.move_on_at(until):
        for name in failed:
            error = last.get(name)
            if dead_past and error is not None and error.outcome is Outcome.DEAD:
                continue
            try:
                state = await backend.snapshot(ctx.scope_name, name)
            except GovernanceBackendError:
                return False  # (the backoff, as before; the next round meets the error)
            if state.cooldown_until is not None and state.cooldown_until >= until:
                continue  # (a Retry-After: admission waits it out, or gives up at once)
            if state.breaker is not BreakerState.OPEN or state.breaker_open_until is None:
                return False
            if state.breaker_open_until < until:
                return False
        return True
    return False


def _retry_same(
    limit: int, first: UpstreamError | None, counts: dict[str, int]
) -> str | None:
    """The source to retry first after a failed round, under ``same_source_retries``:
    the round's primary source (the preferred one; a hedge came after it, and may have
    failed first), when its failure (``first``) was transient or a 429, while it has
    retries left."""
    if not limit or first is None:
        return None
    source = first.source
    if source is None or not isinstance(first, (TransientUpstreamError, RateLimitedError)):
        return None
    if counts.get(source, 0) >= limit:
        return None
    counts[source] = counts.get(source, 0) + 1
    return source


async def _same_source(
    ctx: CallContext, source: str, tokens: int, give_up_at: float
) -> Admission | None:
    """Admission on ``source`` alone, waiting out its cooldown (a 429's Retry-After)
    until ``give_up_at``; ``None`` when it cannot be had that way (its breaker opened,
    it is dead, its cooldown ends later): then the loop fails over as usual."""
    governor = ctx.runtime.governor
    others = [s.name for s in ctx.scope.sources if s.name != source]
    if source in refused_context(ctx):
        return None
    while True:
        result = await governor.try_admit(ctx.scope_name, tokens, exclude=others)
        if isinstance(result, Admission):
            return result
        refusal = next((r for r in result if r.source == source), None)
        if (
            refusal is None
            or refusal.reason is not RefusalReason.COOLING_DOWN
            or refusal.retry_at is None
            or refusal.retry_at > give_up_at
        ):
            return None
        await trio.sleep_until(refusal.retry_at)


def _deadline_at(ctx: CallContext, deadline_s: float | None) -> float | None:
    return ctx.started_at + deadline_s if deadline_s is not None else None


async def run_chat(
    runtime: Runtime,
    scope_name: str,
    messages: Sequence[Mapping[str, Any]],
    messages_json: str,
    params: Mapping[str, Any],
    deadline_s: float | None,
    *,
    forward: StreamSink | None = None,
    delivered: list[str] | None = None,
    rounds: Rounds | None = None,
    started_at: float | None = None,
) -> ChatResponse:
    """One logical chat call: the retry loop in the asked scope, then — inside the same
    deadline — its fallback scopes (see _fallback), and for a committed stream whose
    path failed, continuations on other sources (see _resume).

    ``started_at``: when the logical call began, if before now (the cache layer's
    lookup and a wait on a flight it took over): the deadline, the statistics and the
    row all count from there."""
    scope = runtime.settings.scopes[scope_name]
    ctx = CallContext(
        runtime, scope_name, scope, "chat",
        trio.current_time() if started_at is None else started_at, messages=messages,
        messages_json=messages_json, params=params, streaming_to_caller=forward is not None,
    )
    added = chars_tokens(rounds.prompt_chars) if rounds is not None else 0
    ctx.prompt_estimate = runtime.governor.prompt_estimate(messages, params) + added
    ctx.completion_estimate = completion_budget(params, scope.completion_estimate_tokens)
    shown = delivered if delivered is not None else []

    async def runner(admission: Admission, control: AttemptControl) -> Any:
        source = ctx.source(admission.source)
        request = None
        cont = ctx.continuation
        if cont is not None and cont.shown:
            request = cont.request(source, ctx.params)
        elif rounds is not None:
            endpoint = runtime.endpoints[(ctx.scope_name, source.name)]
            request = rounds.request(source, ctx.messages, ctx.messages_json,
                                     strict=endpoint.asking.strict_schemas)
        if cont is not None and not cont.shown and cont.limits:
            # Cut in its reasoning: asked again as it was, within what is left of its
            # token limit (the reasoning shown counts, as a continuation's does).
            request = (
                ChatRequest(ctx.messages_json, {**ctx.params, **cont.limits}) if request is None
                else attrs.evolve(request, params={**request.params, **cont.limits})
            )
        try:
            return await run_asking_again(ctx, admission, control, request)
        except FatalUpstreamError as exc:
            if request is not None and request.loose_schema and exc.status_code == 400 \
                    and _NOT_STRICT.search(exc.message):
                # A model's schema refused for not being in strict form (OpenAI): asked
                # again at once with its strict form, and so from now on.  polygate's
                # way of asking, never the caller's request (a dict schema is theirs).
                runtime.endpoints[(ctx.scope_name, source.name)].asking.strict_schemas = True
                refused = TransientUpstreamError(
                    f"refused the schema as not in strict form ({exc.message}); asking "
                    "with its strict form", source=exc.source, status_code=exc.status_code,
                )
                refused.asked_again = True  # (see _retry_loop)
                control.record.listed_error = refused
                raise refused from exc
            if cont is None or not cont.prefilled(source) or failure_reasons(exc) & _NOT_PREFILL:
                # (A context-length or content-policy 400 is about the conversation,
                # not the prefill: asked again without it, the request is longer still.)
                raise
            # The target rejected the assistant prefill: ask it again without one.  That
            # 400 concerns polygate's way of asking, never the caller's request.
            cont.refused_prefill.add(admission.source)
            refused = TransientUpstreamError(
                f"rejected the assistant prefill ({exc.message}); asking without one",
                source=exc.source, status_code=exc.status_code,
            )
            refused.asked_again = True  # (see _retry_loop)
            control.record.listed_error = refused  # (as the call lists it: see every_error)
            raise refused from exc

    async def one_round() -> ChatResponse:
        """One answer: the retry loop in the asked scope, then its fallbacks; a
        committed stream whose path fails is continued elsewhere."""
        # A re-ask starts from the asked scope -- or past it, when its models refused
        # this call's context: a context-length error is never resent to the same model.
        start = first_not_refused(runtime.settings, scope_name, ctx.context_refused)
        if ctx.scope_name != start:
            _move_to(ctx, start, params)
        deadline_at = _deadline_at(ctx, deadline_s)
        active: Forward | None = forward
        # (On the context too: a deadline's statistics are the whole stream's.)
        segments: list[AttemptRecord] = []
        ctx.segments = segments
        segment_chars: list[int] = []
        committed_error: UpstreamError | None = None
        # A re-ask starts behind the sources that already failed in this call (a source
        # that failed in this call goes to the back, round or no round).
        demoted = _failed_sources(ctx, start)
        # The errors of the scopes this round left for a fallback: the last scope's
        # AllSourcesExhausted lists them first, in the order they happened.
        earlier: list[UpstreamError] = []
        stopped: UpstreamError | None = None
        while True:
            try:
                record, result = await _retry_loop(
                    ctx, runner, active, deadline_at, ctx.estimate, demoted=demoted
                )
                break
            except CommittedFailure as failure:
                committed_error = failure.error
                if forward is None or not _can_resume(ctx, forward, failure.error, len(segments)):
                    if segments and failure.record is not None:
                        # A continuation failed: the statistics are the whole stream's.
                        failure.error.call_stats = call_stats(
                            ctx, failure.record, trio.current_time(), segments
                        )
                    # (Raised outside this handler: inside, the failure that holds it
                    # would become its context, a cycle only the cyclic collector frees.)
                    stopped = _committed_error(failure.error, shown)
                else:
                    # Continue the answer elsewhere: the failed source goes to the back.
                    if failure.record is not None:
                        segments.append(failure.record)
                        segment_chars.append(_shown_chars(shown, forward) - sum(segment_chars))
                    failed = failure.error.source
                    onward = continuation_scope(
                        runtime.settings, ctx.scope_name, ctx.context_refused
                    ) if all(s.name == failed or s.name in refused_context(ctx)
                             for s in ctx.scope.sources) else None
                    if onward is not None:
                        # The scope's only source just failed: continue in its fallback
                        # (never in one whose models refused this call's context).
                        _move_to(ctx, onward, params)
                        demoted = []
                    elif failed:
                        # Behind every source that has not failed in this call, the
                        # least recently failed first (as within a round).
                        demoted = [*(d for d in demoted if d != failed), failed]
                    ctx.resumes = len(segments)
                    _prepare_continuation(ctx, ctx.messages, "".join(shown), _shown_chars(shown, forward),
                                          added)
                    active = ResumedForward(forward, Stitcher("".join(shown)))
            except (AllSourcesExhausted, FatalUpstreamError) as exc:
                refused = _refused_model(ctx, exc)
                if refused is not None and "context_length" in failure_reasons(exc):
                    ctx.context_refused.add(refused)  # never asked of that model again
                target = fallback_scope(runtime.settings, ctx.scope_name, exc, ctx.context_refused)
                if target is None:
                    if earlier and isinstance(exc, AllSourcesExhausted):
                        exc.errors = [*earlier, *exc.errors]
                        if exc.too_large:  # an earlier scope took it (and failed)
                            exc.too_large = False
                            _not_too_large(exc, ctx)
                    if committed_error is not None:
                        # No source could continue the stream: the caller's error is
                        # the stream's own failure, with the whole stream's statistics.
                        if segments:
                            committed_error.call_stats = call_stats(
                                ctx, segments[-1], trio.current_time(), segments[:-1]
                            )
                        raise _committed_error(committed_error, shown) from exc
                    raise
                earlier.extend(exc.errors if isinstance(exc, AllSourcesExhausted) else [exc])
                _move_to(ctx, target, params)
                demoted = []
            if stopped is not None:
                raise stopped from None
        if segments:
            ctx.continuation = None
            await _finish_continuation(active, record, result)
            assert forward is not None  # (only a stream is resumed)
            return chat_response(
                ctx, record, result, segments, "".join(shown),
                [*segment_chars, _shown_chars(shown, forward) - sum(segment_chars)],
                ("".join(forward.shown_reasoning), forward.reasoning_field),
                forward.shown_logprobs,
            )
        return chat_response(ctx, record, result)

    async def body() -> ChatResponse:
        if rounds is not None:
            await rounds.ready()  # a big schema compiles here: off the loop, in the deadline
        while True:
            try:
                response = await one_round()
            except AllSourcesExhausted as exc:
                if ctx.reasks:  # the earlier rounds' failed attempts too
                    exc.errors = every_error(ctx)
                raise
            if rounds is None:
                return response
            try:
                judged = await rounds.after_round(response, ctx.messages)
            except StructuredOutputError as exc:
                await trio.lowlevel.checkpoint()
                if exc.call_stats is not None:
                    exc.call_stats = _judged(ctx, exc.call_stats)
                raise
            if isinstance(judged, ChatResponse):
                await trio.lowlevel.checkpoint()
                return attrs.evolve(judged, call_stats=_judged(ctx, judged.call_stats))
            # A deadline that passed while the answer was judged (a caller's validator,
            # on the loop, can take any time) ends the call here: a re-ask admitted
            # after it would take a quota slot for a request no one waits for.
            await trio.lowlevel.checkpoint()
            _next_round(ctx, judged, added)

    response = await _with_deadline(ctx, deadline_s, body)
    runtime.recorder.call(ctx, response.call_stats, response.usage, None, response.message)
    return response


def _judged(ctx: CallContext, stats: CallStats) -> CallStats:
    """The statistics of a call whose last answer was just judged: judging (a
    validation, perhaps seconds of it in a worker thread) is part of the logical call,
    so ``total_latency_ms`` runs to now.

    The caller checkpoints first: a deadline that passed while an answer was validated
    on the loop (which nothing could interrupt) is then the call's outcome
    (DeadlineExceeded), not the answer."""
    return attrs.evolve(stats, total_latency_ms=(trio.current_time() - ctx.started_at) * 1000.0)


def _next_round(ctx: CallContext, messages: list[Mapping[str, Any]], added: int) -> None:
    """The next round asks with ``messages``; the statistics count one more re-ask.
    ``added``: the rounds' own prompt tokens (:attr:`Rounds.prompt_chars`)."""
    if ctx.asked_json is None:
        ctx.asked_json = ctx.messages_json
    ctx.messages = messages
    ctx.messages_json = encode_compact(messages)
    ctx.prompt_estimate = ctx.runtime.governor.prompt_estimate(messages, ctx.params) + added
    ctx.reasks += 1


def _committed_error(error: UpstreamError, shown: list[str]) -> UpstreamError:
    """A committed stream's failure as the caller gets it, carrying the text delivered
    (``text``); a stall is StreamStalled."""
    text = "".join(shown)
    if error.outcome is Outcome.STALLED and not isinstance(error, StreamStalled):
        stalled = StreamStalled(
            error.message, source=error.source, text=text, call_stats=error.call_stats
        )
        stalled.__cause__ = error
        return stalled
    error.text = text
    return error


def _can_resume(ctx: CallContext, sink: StreamSink, error: UpstreamError, resumes: int) -> bool:
    # The call's policy, set by the scope it asked: a fallback it moved to (with other
    # settings) neither stops nor extends it.
    watch = ctx.runtime.settings.scopes[ctx.first_scope or ctx.scope_name].stream
    n = ctx.params.get("n", 1)
    return (
        watch.resume
        and resumes < watch.max_resumes
        and not isinstance(error, FatalUpstreamError)
        and not sink.shown_tool_calls
        and (n is None or n == 1)
    )


#: The parameters that bound the answer's length (OpenAI's old and new names).
_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")

#: The 400s to a prefilled continuation that are not its prefill's refusal.
_NOT_PREFILL = frozenset({"context_length", "content_policy"})


def _shown_chars(shown: Sequence[str], forward: StreamSink) -> int:
    """The characters a stream has shown so far, its reasoning too: a model's limit
    (``max_completion_tokens``) and its bill count reasoning tokens, although a
    continuation does not carry the reasoning over."""
    return sum(map(len, shown)) + sum(map(len, forward.shown_reasoning))


def _prepare_continuation(
    ctx: CallContext, messages: Sequence[Mapping[str, Any]], shown: str, shown_chars: int,
    added: int,
) -> None:
    """The next rounds ask for the rest of the answer (``shown``); their prompt
    estimate grows by it, and the caller's token limit shrinks by what was shown,
    reasoning included (``shown_chars``, estimated as a cut segment's usage is: about
    four characters a token), at least 1.  ``added``: the rounds' own prompt tokens
    (:attr:`Rounds.prompt_chars`), sent again when nothing was shown."""
    refused = ctx.continuation.refused_prefill if ctx.continuation is not None else set()
    spent = chars_tokens(shown_chars)
    limits = {
        name: max(1, limit - spent)
        for name in _TOKEN_LIMITS
        if (limit := positive_count(ctx.params.get(name))) is not None
    }
    if not shown:
        # Cut before any content (in its reasoning): nothing to continue, so the call
        # is asked again as it was -- its messages, its structured output's format --
        # within what is left of its limit (the runner adds ``limits``).  Still a
        # continuation: its wait for admission is silence on the caller's stream.
        ctx.continuation = Continuation("", "", {}, refused, limits)
    else:
        prefill = encode_compact(continuation_messages(messages, shown, prefill=True))
        prompt = encode_compact(continuation_messages(messages, shown, prefill=False))
        ctx.continuation = Continuation(prefill, prompt, PREFILL_PARAMS, refused, limits, shown)
    ctx.prompt_estimate = ctx.runtime.governor.prompt_estimate(
        continuation_messages(messages, shown, prefill=False), ctx.params
    ) + (0 if shown else added)
    if limits:
        ctx.completion_estimate = completion_budget(
            {**ctx.params, **limits}, ctx.scope.completion_estimate_tokens
        )


async def _finish_continuation(
    active: Forward | None, record: AttemptRecord, result: dict[str, Any]
) -> None:
    """Show what a continuation's stitcher still holds; a continuation that came back
    as one JSON body (a source that cannot stream) is shown as one chunk."""
    if not isinstance(active, ResumedForward):
        return
    if not record.timeline.streamed:
        choices = result.get("choices") or [{}]
        message = choices[0].get("message") or {}
        # All the message holds, as a JSON answer not resumed is shown (its reasoning,
        # its tool calls: only the content was, and a client of the gateway saw a
        # finish_reason "tool_calls" with no calls); the role was shown already.
        delta = {k: v for k, v in message_delta(message).items() if k != "role" and v}
        if "content" in delta and not isinstance(delta["content"], str):
            # Content parts (Mistral's typed chunks): their text, as a JSON answer's
            # one chunk shows it, so that the stitcher sees it.
            delta["content"] = message_text(message)
            if not delta["content"]:
                del delta["content"]
        chunk: dict[str, Any] = {"index": 0, "delta": delta}
        if isinstance(choices[0].get("logprobs"), dict):
            chunk["logprobs"] = choices[0]["logprobs"]  # (the answer's logprobs: shown too)
        if delta and not active.offer({"choices": [chunk]}):
            await active.deliver_held()
    await active.finish()


def _refused_model(ctx: CallContext, error: PolygateError) -> str | None:
    if isinstance(error, FatalUpstreamError) and error.source is not None:
        try:
            return ctx.source(error.source).model
        except KeyError:
            return None
    return None


def _last_errors(errors: Sequence[UpstreamError]) -> str:
    """The last three attempts' errors, for an AllSourcesExhausted message: what the
    upstreams said (a 401's "Incorrect API key provided") is what a reader needs."""
    return ": " + "; ".join(str(e) for e in errors[-3:]) if errors else ""


def _move_to(ctx: CallContext, scope_name: str, params: Mapping[str, Any]) -> None:
    """The call continues in its fallback scope: same logical call, same deadline."""
    scope = ctx.runtime.settings.scopes[scope_name]
    if ctx.first_scope is None:
        ctx.first_scope = ctx.scope_name
    ctx.fallbacks.append(scope_name)
    ctx.scope_name = scope_name
    ctx.scope = scope
    if ctx.continuation is not None and ctx.continuation.limits:
        params = {**params, **ctx.continuation.limits}  # what is left of the limit
    ctx.completion_estimate = completion_budget(params, scope.completion_estimate_tokens)


async def run_embed(
    runtime: Runtime,
    scope_name: str,
    inputs: Sequence[str],
    params: Mapping[str, Any],
    deadline_s: float | None,
    *,
    part_of: str | None = None,
    started_at: float | None = None,
    live: list[CallContext] | None = None,
    numbers: Iterator[int] | None = None,
    whole: CallContext | None = None,
) -> EmbeddingResponse:
    """Batches of ``embed_batch_size`` run concurrently in the call's nursery, each with
    its own retry loop; vectors are reassembled in input order and ``generation_ms`` is
    the sum of the batches' transport times.

    ``part_of``: the logical call this is part of (the cache layer's, which sent only
    its misses): its attempts carry that id, and that layer writes the one call row;
    ``started_at``: when that call began (see :func:`run_chat`); ``live``: gets this
    run's context, so that layer counts its attempts while it runs (its call may end
    first, on an error it shares with another flight); ``numbers``: that call's one
    numbering of attempts, shared by all of its runs; ``whole``: that call's context,
    whose attempts list gets this run's too (its spans are made from it)."""
    scope = runtime.settings.scopes[scope_name]
    began = trio.current_time() if started_at is None else started_at
    ctx = CallContext(runtime, scope_name, scope, "embed", began, params=params,
                      input_texts=inputs)
    if live is not None:
        live.append(ctx)
    if part_of is not None:
        ctx.logical_call_id = part_of
        ctx.record_call = False
    ctx.attempt_numbers = numbers
    ctx.whole = whole
    size = scope.embed_batch_size
    batches = [list(inputs[i : i + size]) for i in range(0, len(inputs), size)]
    results: list[tuple[AttemptRecord, Any] | None] = [None] * len(batches)
    limiter = trio.CapacityLimiter(8)
    deadline_at = _deadline_at(ctx, deadline_s)

    @trio.lowlevel.enable_ki_protection  # (a task: see _session._ki_protected)
    async def one_batch(index: int, batch: list[str]) -> None:
        async with limiter:
            tokens = runtime.governor.estimate_inputs(batch)

            async def runner(admission: Admission, control: AttemptControl) -> Any:
                return await run_embed_attempt(ctx, admission, control, batch)

            results[index] = await _retry_loop(ctx, runner, None, deadline_at, tokens)

    async def body() -> EmbeddingResponse:
        # A failed batch leaves the nursery as a group: _with_deadline unwraps it.
        async with trio.open_nursery() as nursery:
            for index, batch in enumerate(batches):
                nursery.start_soon(one_batch, index, batch)
        return _embedding_response(ctx, results)

    try:
        response = await _with_deadline(ctx, deadline_s, body)
    except AllSourcesExhausted as exc:
        exc.errors = every_error(ctx)
        raise
    if ctx.record_call:
        runtime.recorder.call(ctx, response.call_stats, response.usage, None)
    return response


def _failed(ctx: CallContext) -> list[tuple[AttemptRecord, UpstreamError]]:
    """The call's failed attempts and their errors, in the order they failed."""
    failed = [(r, r.listed_error or r.error) for r in ctx.attempts if r.error is not None]
    failed.sort(key=lambda f: f[0].ended_at if f[0].ended_at is not None else math.inf)
    return failed


def _failed_sources(ctx: CallContext, scope_name: str) -> list[str]:
    """The sources of ``scope_name`` that failed in this call so far, least recently
    failed first (each once): where a new round of the call puts them."""
    latest = [r.source for r, error in reversed(_failed(ctx))
              if r.scope == scope_name and not error.asked_again]
    return list(reversed(dict.fromkeys(latest)))


def every_error(ctx: CallContext) -> list[UpstreamError]:
    """Every failed attempt's error of a call made of several retry loops (embedding
    batches, OCR pages), in the order they failed, as one retry loop lists them: the
    failing loop knew only its own, and another's failed attempt (retried, then
    answered) counts in ``call_stats.attempts`` too."""
    return [error for _, error in _failed(ctx)]


def one_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """A public call raises one exception, never a nursery's group.

    In order: a ``KeyboardInterrupt`` or other non-cancellation ``BaseException``
    (Ctrl-C reaches the caller as itself, as from ``trio.run``); else the call's
    polygate error; else its first plain exception (a bug, surfaced as itself); else
    (nothing but cancellations) one of its ``Cancelled``: they are interchangeable --
    a cancel scope asks its own state, not which instance reached it -- and a caller's
    ``except trio.Cancelled:`` must see one."""
    leaves = _leaves(group)
    for exc in leaves:
        if not isinstance(exc, (Exception, trio.Cancelled)):
            return exc
    errors = [exc for exc in leaves if isinstance(exc, Exception)]
    if not errors:
        return leaves[0]
    return next((exc for exc in errors if isinstance(exc, PolygateError)), errors[0])


def one_apart(group: BaseExceptionGroup[Any]) -> tuple[BaseException, BaseException | None]:
    """``one_error(group)``, and what else the group held to raise it from: the group
    without it, or ``None`` when the rest is only cancellations (the other branches cut
    because this one failed, which says nothing more).

    Raised from the whole group, the error was in a cycle with it (its cause's members
    hold it), freed by the cyclic collector alone: raise it outside the handler, as
    ``raise error from rest``, or the group becomes its context."""
    error = one_error(group)
    rest = group.split(lambda exc: exc is error)[1]
    if rest is None or all(isinstance(exc, trio.Cancelled) for exc in _leaves(rest)):
        return error, None
    return error, rest


def one_cancelled(group: BaseExceptionGroup[Any]) -> trio.Cancelled | None:
    """The first ``Cancelled`` of a group made of nothing else (see ``one_error``)."""
    leaves = _leaves(group)
    if leaves and all(isinstance(exc, trio.Cancelled) for exc in leaves):
        first = leaves[0]
        assert isinstance(first, trio.Cancelled)
        return first
    return None


def one_interrupt(group: BaseExceptionGroup[Any]) -> KeyboardInterrupt | None:
    """The first ``KeyboardInterrupt`` of a group made of nothing else but
    cancellations (a nursery's exit that Ctrl-C reached as it waited for its cancelled
    tasks)."""
    leaves = _leaves(group)
    if not all(isinstance(exc, (KeyboardInterrupt, trio.Cancelled)) for exc in leaves):
        return None
    return next((exc for exc in leaves if isinstance(exc, KeyboardInterrupt)), None)


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


def _embedding_response(
    ctx: CallContext, results: list[tuple[AttemptRecord, Any] | None]
) -> EmbeddingResponse:
    now = trio.current_time()
    vectors: list[list[float]] = []
    prompt = total = 0
    generation = 0.0
    sources: dict[str, int] = {}
    model = None
    dimensions: dict[int, str] = {}  # each vector length seen, and the source that first sent it
    for item in results:
        assert item is not None
        record, (batch_vectors, payload) = item
        vectors.extend(batch_vectors)
        if batch_vectors:  # one length within a batch: the exchange checked it
            dimensions.setdefault(len(batch_vectors[0]), record.source)
        if record.usage is not None:
            prompt += record.usage.prompt_tokens
            total += record.usage.total_tokens
        tl = record.timeline
        if tl.sent_at is not None and tl.ended_at is not None:
            generation += (tl.ended_at - tl.sent_at) * 1000.0
        sources[record.source] = sources.get(record.source, 0) + 1
        if model is None and isinstance(payload, dict) and isinstance(payload.get("model"), str):
            model = payload["model"]
    if len(dimensions) > 1:
        # Batches answered by sources serving different models (one failed over):
        # vectors of mixed lengths cannot be compared, so none is returned.
        seen = ", ".join(f"{n} (source {name!r})" for n, name in dimensions.items())
        raise FatalUpstreamError(
            f"the batches of this call came back with vectors of different dimensions: {seen}; "
            f"the sources of scope {ctx.scope_name!r} must serve the same embedding model",
            source=list(dimensions.values())[-1],
        )
    source = max(sources, key=lambda s: sources[s]) if sources else None
    estimated = any(r is not None and r[0].usage is not None and r[0].usage.source == "estimated" for r in results)
    stats = CallStats(
        logical_call_id=ctx.logical_call_id,
        attempts=len(ctx.attempts),
        source=source,
        total_latency_ms=(now - ctx.started_at) * 1000.0,
        generation_ms=generation,
        scope=ctx.scope_name,
    )
    usage = Usage(prompt, total - prompt, total, "estimated" if estimated else "upstream")
    return EmbeddingResponse(vectors=vectors, usage=usage, call_stats=stats, model=model,
                             source=source, upstream_usage=usage)


