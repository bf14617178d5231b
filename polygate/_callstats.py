"""Freezing a logical call's statistics and building its response (call layer).

A call's answer usually comes from one attempt, the round's winner.  A committed
stream that was resumed has several *segments*: the attempts whose text the caller
was shown, in order, the last one the winner.  Their statistics combine the way the
caller lived them: ``ttft_ms`` from the first segment, ``generation_ms`` the sum of the
segments' transport times, stalls measured over the joined chunk timeline of those
transport times (a failed segment's silence before it failed and a continuation's wait
for its first token are stalls the caller saw; the time between segments -- finding a
source, backoff -- is waiting, as it is outside generation_ms), usage the sum of what
each segment reported (estimated for a segment that reported none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from ._context import AttemptRecord, CallContext
from ._stats import stall_stats
from ._types import CallStats, ChatResponse, Usage, finish_reason_of
from .governance import chars_tokens
from .transport import message_text

__all__ = ["call_stats", "chat_response"]


def _generation_s(record: AttemptRecord) -> float:
    tl = record.timeline
    ended = tl.ended_at if tl.ended_at is not None else record.ended_at
    if tl.sent_at is None or ended is None:
        return 0.0
    return max(ended - tl.sent_at - tl.paused_s, 0.0)


def _hedges_sent(attempts: Sequence[AttemptRecord]) -> int:
    """Hedge attempts whose request went out (SPEC §5: "actually sent").  A hedge
    launched in the instant its round was decided (the primary's answer and the
    trigger in one scheduler batch) is cancelled before its request leaves: it is
    an attempt, settled with ``hedge_cancelled``, but not a hedge sent."""
    sent = 0
    for r in attempts:  # (a loop, not sum() over a generator: once a call, one attempt)
        if r.role == "hedge" and r.timeline.sent_at is not None:
            sent += 1
    return sent


def call_stats(
    ctx: CallContext,
    winner: AttemptRecord | None,
    now: float,
    segments: Sequence[AttemptRecord] = (),
) -> CallStats:
    """Freeze the statistics; called only after every path of the call has ended.
    ``segments``: the earlier committed segments of a resumed stream, in order."""
    base = {
        "logical_call_id": ctx.logical_call_id,
        "attempts": len(ctx.attempts),
        "hedges": _hedges_sent(ctx.attempts),
        "total_latency_ms": (now - ctx.started_at) * 1000.0,
        "reasks": ctx.reasks,
        "scope": winner.scope if winner is not None and winner.scope else ctx.scope_name,
        # (a call ended without a winner -- a deadline mid-continuation -- still
        # counts the continuations it made)
        "resumes": max(len(segments), ctx.resumes),
    }
    if winner is None:
        return CallStats(**base)  # type: ignore[arg-type]
    parts = [*segments, winner]
    first = parts[0].timeline
    generation = sum(_generation_s(r) for r in parts) * 1000.0
    ttft = None
    streamed = False
    for r in parts:  # (not any() over a generator: one part, nearly always)
        if r.timeline.streamed:
            streamed = True
            break
    if not streamed:
        stalls = stall_stats((), 0)
    else:
        if first.first_token_at is not None and first.sent_at is not None:
            ttft = (first.first_token_at - first.sent_at) * 1000.0
        if segments:
            # Each segment's times leave out its own consumer holds; the joined
            # timeline leaves out the earlier segments' holds too, or a slow consumer
            # would show as a stall at each seam.  It leaves out the seams as well
            # (from a segment's end to the next one's request: finding a source,
            # backoff, continuations that failed before a token): that time is
            # outside every segment's transport time, so outside generation_ms, and
            # counted as decoding or a stall it would make them exceed it (SPEC §5:
            # ttft, stalls and active decoding are where the generation time went).
            joined: list[float] = []
            held = 0.0
            previous_end: float | None = None
            for r in parts:
                tl = r.timeline
                if previous_end is not None and tl.sent_at is not None:
                    held += max(0.0, tl.sent_at - previous_end)
                joined.extend(t - held for t in tl.chunk_times)
                held += tl.paused_s
                # (A failed segment's transport never recorded its end: its attempt did.)
                previous_end = tl.ended_at if tl.ended_at is not None else r.ended_at
            times: Sequence[float] = joined
        else:
            times = winner.timeline.chunk_times
        stalls = stall_stats(times, ctx.scope.stream.stall_threshold_ms)
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


def chat_response(
    ctx: CallContext,
    record: AttemptRecord,
    body: dict[str, Any],
    segments: Sequence[AttemptRecord] = (),
    shown: str | None = None,
    shown_chars: Sequence[int] = (),
    shown_reasoning: tuple[str, str] = ("", "reasoning_content"),
    shown_logprobs: Sequence[Any] = (),
) -> ChatResponse:
    """The call's answer.  For a resumed stream, the first choice's content is
    ``shown`` (everything the caller received, stitched), its reasoning every
    segment's as shown (``shown_reasoning``: the text and the field it came in), its
    ``logprobs.content`` the entries shown (``shown_logprobs``), and
    the usage sums the segments (``shown_chars``: the characters each segment showed,
    for an estimate where one reported no usage); the rest (finish reason, tool calls
    of the last segment…) is the last segment's."""
    stats = call_stats(ctx, record, trio.current_time(), segments)
    choices = body.get("choices") or []
    usage = record.usage
    if segments:
        choices = [dict(c) if isinstance(c, dict) else c for c in choices]
        if choices and isinstance(choices[0], dict):
            message = dict(choices[0].get("message") or {})
            message["content"] = shown or ""
            reasoning, field = shown_reasoning
            if reasoning:
                # The assembler fills reasoning_content for every form; "reasoning"
                # stays where the upstream sent it.
                message["reasoning_content"] = reasoning
                if field == "reasoning" or "reasoning" in message:
                    message["reasoning"] = reasoning
            choices[0]["message"] = message
            given = choices[0].get("logprobs")
            if shown_logprobs or (isinstance(given, dict) and isinstance(given.get("content"), list)):
                # Not the last segment's: those start with the restatement the caller
                # was not shown, and miss the earlier segments' tokens.
                choices[0]["logprobs"] = {**(given if isinstance(given, dict) else {}),
                                          "content": list(shown_logprobs)}
        body = {**body, "choices": choices}
        usage = _summed_usage([*segments, record], shown_chars)
    first = choices[0] if choices else {}
    message = first.get("message") or {}
    finish = first.get("finish_reason")
    model = body.get("model")
    return ChatResponse(
        text=message_text(message),
        message=message,
        choices=choices,
        usage=usage,
        source=record.source,
        model=model if isinstance(model, str) else None,
        finish_reason=finish_reason_of(finish),
        call_stats=stats,
        raw=body,
    )


def _summed_usage(parts: Sequence[AttemptRecord], shown_chars: Sequence[int]) -> Usage:
    """What every segment cost: its reported usage, else an estimate (its prompt, and
    what it showed at about four characters a token).  A cut segment's cost is never
    known whole: the last usage it reported before the cut (vLLM's continuous usage)
    gives its prompt, and its completion when that is above what it showed."""
    prompt = completion = 0
    estimated = False
    chars = [*shown_chars, *([0] * len(parts))]
    for record, shown in zip(parts, chars, strict=False):
        usage = record.usage
        shown_tokens = chars_tokens(shown)
        if usage is not None and usage.source == "upstream":
            # A usage without a prompt, or without a completion for text it showed
            # (one that reported only some fields, or only a total), counts that part
            # as estimated: never as 0.
            if usage.prompt_tokens and (usage.completion_tokens or not shown_tokens):
                prompt += usage.prompt_tokens
                completion += usage.completion_tokens
            else:
                estimated = True
                part_completion = usage.completion_tokens or shown_tokens
                prompt += _prompt_share(usage, record.prompt_estimate, part_completion)
                completion += part_completion
            continue
        estimated = True
        cut = record.timeline.cut_usage
        reported = Usage.from_wire(cut()) if cut is not None else None
        if reported is None:
            prompt += record.prompt_estimate  # what this segment sent, not the next one
            completion += shown_tokens
            continue
        # Reported before the cut, perhaps long before (a first chunk's usage, of no
        # text yet), perhaps in part (no prompt): a lower bound each.
        part_completion = max(reported.completion_tokens, shown_tokens)
        prompt += _prompt_share(reported, record.prompt_estimate, part_completion)
        completion += part_completion
    return Usage(prompt, completion, prompt + completion, "estimated" if estimated else "upstream")


def _prompt_share(usage: Usage, estimate: int, completion: int) -> int:
    """The prompt of a segment whose usage is known in part, beside its ``completion``:
    the prompt it reported, else ``estimate``; a reported total is a floor too (what
    it holds beyond the completion goes to the prompt)."""
    return max(usage.prompt_tokens or estimate, usage.total_tokens - completion)
