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

import json
import math
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Protocol, TypeVar

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from ._attempt import AttemptControl, run_chat_attempt, run_embed_attempt
from ._backoff import full_jitter
from ._config import Source
from ._context import AttemptRecord, CallContext, ChatRequest, Runtime
from ._errors import (
    AllSourcesExhausted,
    DeadlineExceeded,
    FatalUpstreamError,
    Outcome,
    PolygateError,
    RateLimitedError,
    StreamStalled,
    UpstreamError,
)
from ._hedge import Forward, Round, RoundFailed, Runner
from ._stats import stall_stats
from ._types import CallStats, ChatResponse, EmbeddingResponse, Usage
from .governance import Admission, NoAdmission, completion_budget
from .transport import message_text

__all__ = ["Rounds", "run_chat", "run_embed", "call_stats"]

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

    def request(
        self, source: Source, messages: Sequence[Mapping[str, Any]], messages_json: str
    ) -> ChatRequest | None: ...

    async def after_round(
        self, response: ChatResponse, messages: Sequence[Mapping[str, Any]]
    ) -> ChatResponse | list[Mapping[str, Any]]: ...


def call_stats(ctx: CallContext, winner: AttemptRecord | None, now: float) -> CallStats:
    """Freeze the statistics; called only after every path of the call has ended."""
    base = {
        "logical_call_id": ctx.logical_call_id,
        "attempts": len(ctx.attempts),
        "hedges": ctx.hedges,
        "total_latency_ms": (now - ctx.started_at) * 1000.0,
        "reasks": ctx.reasks,
    }
    if winner is None:
        return CallStats(**base)  # type: ignore[arg-type]
    tl = winner.timeline
    generation = 0.0
    ended = tl.ended_at if tl.ended_at is not None else winner.ended_at
    if tl.sent_at is not None and ended is not None:
        generation = (ended - tl.sent_at) * 1000.0
    ttft = None
    stalls = stall_stats((), 0)
    if tl.streamed:
        if tl.first_token_at is not None and tl.sent_at is not None:
            ttft = (tl.first_token_at - tl.sent_at) * 1000.0
        stalls = stall_stats(tl.chunk_times, ctx.scope.stream.stall_threshold_ms)
    return CallStats(
        **base,  # type: ignore[arg-type]
        hedge_won=winner.role == "hedge",
        source=winner.source,
        generation_ms=generation,
        ttft_ms=ttft,
        stall_ms=stalls.stall_ms,
        stall_count=stalls.stall_count,
        active_generation_ms=stalls.active_generation_ms,
    )


async def _with_deadline(
    ctx: CallContext, deadline_s: float | None, body: Callable[[], Awaitable[T]]
) -> T:
    """Run ``body`` under the call deadline; attach frozen statistics to every error."""
    recorder = ctx.runtime.recorder
    scope = trio.fail_after(deadline_s) if deadline_s is not None else nullcontext()
    try:
        try:
            with scope:
                return await body()
        except BaseExceptionGroup as group:
            raise _one_error(group) from group
        except trio.TooSlowError:
            frozen = call_stats(ctx, None, trio.current_time())
            raise DeadlineExceeded(
                f"call exceeded its deadline of {deadline_s} s "
                f"({frozen.attempts} attempt(s), scope {ctx.scope_name!r})",
                call_stats=frozen,
            ) from None
    except PolygateError as exc:
        stats: CallStats | None = getattr(exc, "call_stats", None)
        if stats is None:
            stats = call_stats(ctx, None, trio.current_time())
            if hasattr(exc, "call_stats"):
                exc.call_stats = stats
        recorder.call(ctx, stats, None, exc)
        raise
    except BaseException as exc:  # cancelled by the caller (or a bug): still one row
        recorder.call(ctx, call_stats(ctx, None, trio.current_time()), None, exc)
        raise
    finally:
        if ctx.scope.hedge.enabled and ctx.kind == "chat":
            # In finally: cancelled calls refill the hedge budget too.
            await ctx.runtime.governor.refill_hedge_budget(ctx.scope_name)


async def _retry_loop(
    ctx: CallContext,
    runner: Runner,
    forward: Forward | None,
    deadline_at: float | None,
    tokens: int,
) -> tuple[AttemptRecord, Any]:
    retry = ctx.scope.retry
    governor = ctx.runtime.governor
    errors: list[UpstreamError] = []
    failed: list[str] = []
    consumed = 0
    # Admission waits until the deadline; without one, waiting out 429 cooldowns is
    # bounded by rate_limit_wait_s (permits, RPM windows and breakers free up alone).
    give_up_at = deadline_at if deadline_at is not None else math.inf
    cooldown_give_up_at = (
        deadline_at if deadline_at is not None else ctx.started_at + retry.rate_limit_wait_s
    )
    while True:
        try:
            admission = await governor.acquire(
                ctx.scope_name, tokens, demote=failed, give_up_at=give_up_at,
                cooldown_give_up_at=cooldown_give_up_at,
            )
        except NoAdmission as exc:
            raise AllSourcesExhausted(
                f"{exc} after {len(errors)} failed attempt(s) in scope {ctx.scope_name!r}",
                errors=errors,
            ) from None
        try:
            return await Round(ctx, runner, forward=forward, demote=failed).run(admission)
        except RoundFailed as failure:
            round_errors = failure.errors
            committed = failure.committed
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
            raise committed
        for error in round_errors:
            if isinstance(error, FatalUpstreamError):
                raise error
        if round_errors and all(isinstance(e, RateLimitedError) for e in round_errors):
            continue  # free of max_attempts; cooldowns make admission wait
        consumed += 1
        if consumed >= retry.max_attempts:
            raise AllSourcesExhausted(
                f"all {consumed} attempt(s) failed in scope {ctx.scope_name!r}: "
                + "; ".join(str(e) for e in errors[-3:]),
                errors=errors,
            )
        if len(set(failed)) >= len(ctx.scope.sources):
            await trio.sleep(
                full_jitter(consumed, retry.backoff_base_s, retry.backoff_max_s, ctx.runtime.rng)
            )


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
    forward: Forward | None = None,
    delivered: list[str] | None = None,
    rounds: Rounds | None = None,
) -> ChatResponse:
    scope = runtime.settings.scopes[scope_name]
    ctx = CallContext(
        runtime, scope_name, scope, "chat", trio.current_time(), messages=messages,
        messages_json=messages_json, params=params, streaming_to_caller=forward is not None,
    )
    ctx.prompt_estimate = runtime.governor.prompt_estimate(messages)
    ctx.completion_estimate = completion_budget(params, scope.completion_estimate_tokens)

    async def runner(admission: Admission, control: AttemptControl) -> Any:
        request = None
        if rounds is not None:
            request = rounds.request(ctx.source(admission.source), ctx.messages, ctx.messages_json)
        return await run_chat_attempt(ctx, admission, control, request)

    async def one_round() -> ChatResponse:
        try:
            record, result = await _retry_loop(
                ctx, runner, forward, _deadline_at(ctx, deadline_s), ctx.estimate
            )
        except UpstreamError as exc:
            if forward is not None and exc.outcome is Outcome.STALLED:
                raise StreamStalled(
                    exc.message, source=exc.source, text="".join(delivered or ()),
                    call_stats=exc.call_stats,
                ) from exc
            raise
        return _chat_response(ctx, record, result)

    async def body() -> ChatResponse:
        while True:
            response = await one_round()
            if rounds is None:
                return response
            judged = await rounds.after_round(response, ctx.messages)
            if isinstance(judged, ChatResponse):
                return judged
            _next_round(ctx, judged)

    response = await _with_deadline(ctx, deadline_s, body)
    runtime.recorder.call(ctx, response.call_stats, response.usage, None, response.message)
    return response


def _next_round(ctx: CallContext, messages: list[Mapping[str, Any]]) -> None:
    """The next round asks with ``messages``; the statistics count one more re-ask."""
    ctx.messages = messages
    ctx.messages_json = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    ctx.prompt_estimate = ctx.runtime.governor.prompt_estimate(messages)
    ctx.reasks += 1


def _chat_response(ctx: CallContext, record: AttemptRecord, body: dict[str, Any]) -> ChatResponse:
    stats = call_stats(ctx, record, trio.current_time())
    choices = body.get("choices") or []
    first = choices[0] if choices else {}
    message = first.get("message") or {}
    finish = first.get("finish_reason")
    model = body.get("model")
    return ChatResponse(
        text=message_text(message),
        message=message,
        choices=choices,
        usage=record.usage,
        source=record.source,
        model=model if isinstance(model, str) else None,
        finish_reason=finish if isinstance(finish, str) else None,
        call_stats=stats,
        raw=body,
    )


async def run_embed(
    runtime: Runtime,
    scope_name: str,
    inputs: Sequence[str],
    params: Mapping[str, Any],
    deadline_s: float | None,
) -> EmbeddingResponse:
    """Batches of ``embed_batch_size`` run concurrently in the call's nursery, each with
    its own retry loop; vectors are reassembled in input order and ``generation_ms`` is
    the sum of the batches' transport times (seed 000 H8)."""
    scope = runtime.settings.scopes[scope_name]
    ctx = CallContext(runtime, scope_name, scope, "embed", trio.current_time(), params=params)
    size = scope.embed_batch_size
    batches = [list(inputs[i : i + size]) for i in range(0, len(inputs), size)]
    results: list[tuple[AttemptRecord, Any] | None] = [None] * len(batches)
    limiter = trio.CapacityLimiter(8)
    deadline_at = _deadline_at(ctx, deadline_s)

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

    response = await _with_deadline(ctx, deadline_s, body)
    runtime.recorder.call(ctx, response.call_stats, response.usage, None)
    return response


def _one_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """A public call raises one exception, never a nursery's group: its polygate
    error, else its first plain exception (a bug, surfaced as itself).  A group
    holding a cancellation or KeyboardInterrupt is re-raised whole for trio."""
    leaves = _leaves(group)
    if any(not isinstance(exc, Exception) for exc in leaves):
        raise group
    return next((exc for exc in leaves if isinstance(exc, PolygateError)), leaves[0])


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
    for item in results:
        assert item is not None
        record, (batch_vectors, payload) = item
        vectors.extend(batch_vectors)
        if record.usage is not None:
            prompt += record.usage.prompt_tokens
            total += record.usage.total_tokens
        tl = record.timeline
        if tl.sent_at is not None and tl.ended_at is not None:
            generation += (tl.ended_at - tl.sent_at) * 1000.0
        sources[record.source] = sources.get(record.source, 0) + 1
        if model is None and isinstance(payload, dict) and isinstance(payload.get("model"), str):
            model = payload["model"]
    source = max(sources, key=lambda s: sources[s]) if sources else None
    estimated = any(r is not None and r[0].usage is not None and r[0].usage.source == "estimated" for r in results)
    stats = CallStats(
        logical_call_id=ctx.logical_call_id,
        attempts=len(ctx.attempts),
        source=source,
        total_latency_ms=(now - ctx.started_at) * 1000.0,
        generation_ms=generation,
    )
    usage = Usage(prompt, total - prompt, total, "estimated" if estimated else "upstream")
    return EmbeddingResponse(vectors=vectors, usage=usage, call_stats=stats, model=model, source=source)


