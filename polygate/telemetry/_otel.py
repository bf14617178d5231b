"""OpenTelemetry: a span per logical call, a child span per attempt (extra ``otel``).

This module is imported only when ``opentelemetry`` is installed and the application
has installed a real tracer provider (see :func:`tracer_if_configured`).

The spans are started as an attempt's request is built -- the call's at its first
attempt, with the call's start time -- so that the request carries the attempt
span's context (W3C ``traceparent``, through the application's propagator) and an
upstream that traces joins the caller's trace.  Everything else is set when the call
ends, from its frozen statistics and its attempt records, with explicit end times:
the loser of a hedge -- cancelled, settled and recorded before the call's statistics
freeze -- still gets its span, and an attempt that never sent a request gets one
made then.  A span's times come from trio's clock through one anchor a call (trio's
time and the wall clock's, taken once), so under ``MockClock`` the durations are the
exact virtual ones.  The tasks of a call carry its caller's context, so the call
span's parent is whatever span the caller has current.

Attribute names follow the OpenTelemetry GenAI semantic conventions where one exists
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``server.address``, ``server.port``, ``error.type``,
``http.response.status_code``); polygate's own measurements are under
``polygate.*`` (hedge role and cancellation reason on attempt spans:
``polygate.attempt.role``, ``polygate.attempt.outcome``,
``polygate.attempt.cancel_reason``).  ``gen_ai.provider.name`` is left out: an
OpenAI-compatible upstream may be any server, and polygate does not know which.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .._context import AttemptRecord, CallContext
from .._errors import Outcome, redact
from .._types import CallStats, Usage
from ._recorder import error_text, unstored_prompt

__all__ = ["OtelRecorder", "tracer_if_configured"]

#: The GenAI operation of each kind of call: an OCR page is a vision chat completion
#: on the wire, so its attempts are ``chat`` spans; its call span keeps ``ocr`` in its
#: name (``ocr <scope>``), as the calls row keeps its kind.
_OPERATION = {"chat": "chat", "embed": "embeddings", "ocr": "chat"}
_NOT_FAILURES = (Outcome.OK, Outcome.HEDGE_CANCELLED, Outcome.CANCELLED)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_LOG_INTERVAL_S = 60.0  # real time, as the row pipeline's drop warnings

logger = logging.getLogger("polygate.telemetry")


@attrs.define(eq=False)
class _Live:
    """A call's span, started at its first attempt's request, and the anchor its
    spans' times are reckoned from."""

    span: trace.Span
    now: float  # trio's time ...
    now_ns: int  # ... and the wall clock's, at one instant

    def ns(self, t: float) -> int:
        return self.now_ns - int((self.now - t) * 1e9)


def tracer_if_configured(provider: Any = None) -> trace.Tracer | None:
    """polygate's tracer from ``provider``, else from the global provider when the
    application has set one (the API's default proxy means "no tracing wanted")."""
    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
            return None
    from .. import __version__

    tracer: trace.Tracer = provider.get_tracer("polygate", __version__)
    return tracer


class OtelRecorder:
    """A :class:`~polygate._context.Recorder` that emits spans when a call ends."""

    __slots__ = ("_log_content", "_next_log", "_secrets", "_tracer", "errors")

    def __init__(
        self, tracer: trace.Tracer, *, log_content: bool = False, secrets: tuple[str, ...] = ()
    ) -> None:
        self._tracer = tracer
        self._log_content = log_content
        self._secrets = secrets
        self.errors = 0
        self._next_log = -math.inf

    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None:
        return None  # attempt spans end with the call's, from ctx.attempts

    def trace_headers(self, ctx: CallContext, record: AttemptRecord) -> list[tuple[str, str]]:
        """The attempt's span context as request headers, its span (and the call's, at
        its first attempt) started now."""
        try:
            span = record.trace
            if span is None:
                call = ctx.whole or ctx  # (an embed call's runs of its cache misses)
                live = call.trace
                if live is None:
                    live = call.trace = self._start_call(call)
                span = record.trace = self._tracer.start_span(
                    _attempt_name(ctx, record, _OPERATION.get(ctx.kind, ctx.kind)),
                    context=trace.set_span_in_context(live.span), kind=SpanKind.CLIENT,
                    start_time=live.ns(record.started_at),
                )
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            return list(carrier.items())
        except Exception as exc:  # tracing must never break the call it describes
            self._failed(exc)
            return []

    def _start_call(self, ctx: CallContext) -> _Live:
        live = _Live(trace.INVALID_SPAN, trio.current_time(), time.time_ns())
        live.span = self._tracer.start_span(
            _call_name(ctx), kind=SpanKind.INTERNAL, start_time=live.ns(ctx.started_at)
        )
        return live

    def call(
        self,
        ctx: CallContext,
        stats: CallStats,
        usage: Usage | None,
        error: BaseException | None,
        output: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            self._spans(ctx, stats, usage, error)
        except Exception as exc:  # tracing must never break the call it describes
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + _LOG_INTERVAL_S
            # By class only: the text of an exporter's or processor's error may quote
            # anything (a collector's answer, the span's attributes).
            logger.warning(
                "OpenTelemetry: a call's spans could not be emitted (%s); %d failure(s) "
                "so far (logged at most once a minute)", type(exc).__name__, self.errors,
            )

    def _prompt(self, ctx: CallContext) -> list[str]:
        """The prompt texts an error's text must not show (as in the rows)."""
        return unstored_prompt(ctx, self._log_content)

    def _spans(
        self, ctx: CallContext, stats: CallStats, usage: Usage | None, error: BaseException | None
    ) -> None:
        live = ctx.trace
        if live is None:  # (no attempt sent a request: a cache hit, a call refused)
            live = self._start_call(ctx)
        ctx.trace = None  # (ended below, once)
        now = trio.current_time()
        operation = _OPERATION.get(ctx.kind, ctx.kind)
        start = live.ns(ctx.started_at)
        scope = ctx.first_scope or ctx.scope_name  # the scope called, as the calls row
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "polygate.scope": scope,
            "polygate.logical_call_id": ctx.logical_call_id,
            "polygate.stream": ctx.streaming_to_caller,
            "polygate.attempts": stats.attempts,
            "polygate.hedges": stats.hedges,
            "polygate.hedge_won": stats.hedge_won,
            "polygate.cached": stats.cached,
            "polygate.total_latency_ms": stats.total_latency_ms,
            "polygate.generation_ms": stats.generation_ms,
            "polygate.waiting_ms": stats.total_latency_ms - stats.generation_ms,
        }
        _put(attributes, "polygate.source", stats.source)
        if stats.source:  # (a source's name is its scope's: the one that answered)
            _put(attributes, "polygate.answered_scope", stats.scope)
        _put(attributes, "polygate.ttft_ms", stats.ttft_ms)
        _put(attributes, "polygate.stall_ms", stats.stall_ms)
        _put(attributes, "polygate.stall_count", stats.stall_count)
        _put(attributes, "polygate.active_generation_ms", stats.active_generation_ms)
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
            attributes["polygate.usage_source"] = usage.source
        if self._log_content and ctx.kind == "chat":
            asked = ctx.asked_json if ctx.asked_json is not None else ctx.messages_json
            attributes["gen_ai.input.messages"] = redact(asked, self._secrets)
        span = live.span
        try:
            span.set_attributes(attributes)
            if error is not None:
                if isinstance(error, Exception):
                    span.set_attribute("error.type", type(error).__name__)
                    text = error_text(error, self._secrets, self._prompt(ctx)) or ""
                    span.set_status(Status(StatusCode.ERROR, text[:300]))
                else:  # (no error.type: the conventions set it on failures only, and
                    # backends count errors by it; a cancel is not one)
                    span.set_attribute("polygate.cancelled", True)
            parent = trace.set_span_in_context(span)
            for record in ctx.attempts:
                self._attempt_span(ctx, record, operation, parent, live, now)
        finally:  # a started span always ends (exported), whatever an attempt's did
            try:
                for record in ctx.attempts:  # (one whose attributes failed: ended all the same)
                    if record.trace is not None:
                        record.trace, attempt = None, record.trace
                        try:
                            attempt.end(end_time=live.ns(now))
                        except Exception as exc:
                            self._failed(exc)
            finally:
                span.end(end_time=start + int(stats.total_latency_ms * 1e6))

    def _attempt_span(
        self, ctx: CallContext, record: AttemptRecord, operation: str, parent: Any, live: _Live,
        now: float,
    ) -> None:
        # The attempt's own scope: a call that moved to a fallback scope has attempts
        # in the scope it was asked in too.
        scope = ctx.runtime.settings.scopes.get(record.scope or "", ctx.scope)
        source = scope.source(record.source)
        tl = record.timeline
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "polygate.scope": record.scope or ctx.scope_name,
            "polygate.source": record.source,
            "polygate.attempt.id": record.attempt_id,
            "polygate.attempt.role": record.role,
            "polygate.tokens.reserved": record.tokens_reserved,
            "polygate.streamed": tl.streamed,
        }
        _put(attributes, "gen_ai.request.model", source.model)
        parts = urlsplit(source.base_url)
        _put(attributes, "server.address", parts.hostname)
        # The port the URL implies when it names none, as the conventions want it
        # beside every server.address (https://api.openai.com/v1: 443).
        _put(attributes, "server.port", parts.port or _DEFAULT_PORTS.get(parts.scheme))
        _put(attributes, "http.response.status_code", tl.status_code)
        _put(attributes, "polygate.tokens.settled", record.tokens_settled)
        if tl.first_token_at is not None and tl.sent_at is not None:
            attributes["polygate.ttft_ms"] = (tl.first_token_at - tl.sent_at) * 1000.0
        if record.usage is not None:
            attributes["gen_ai.usage.input_tokens"] = record.usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = record.usage.completion_tokens
        outcome = record.outcome or Outcome.CANCELLED
        attributes["polygate.attempt.outcome"] = outcome.value
        if outcome in (Outcome.HEDGE_CANCELLED, Outcome.CANCELLED):
            attributes["polygate.attempt.cancel_reason"] = outcome.value
        span = record.trace
        if span is None:  # (it sent no request: cancelled or refused before it)
            span = self._tracer.start_span(
                _attempt_name(ctx, record, operation), context=parent, kind=SpanKind.CLIENT,
                start_time=live.ns(record.started_at),
            )
        record.trace = None  # (ended here, once)
        try:
            span.set_attributes(attributes)
            if outcome not in _NOT_FAILURES:
                error = record.error
                span.set_attribute("error.type", type(error).__name__ if error else outcome.value)
                text = (error_text(error, self._secrets, self._prompt(ctx)) or "")[:300] \
                    if error is not None else outcome.value
                span.set_status(Status(StatusCode.ERROR, text))
        finally:
            span.end(end_time=live.ns(record.ended_at if record.ended_at is not None else now))


def _call_name(ctx: CallContext) -> str:
    operation = _OPERATION.get(ctx.kind, ctx.kind)
    scope = ctx.first_scope or ctx.scope_name
    return f"{'ocr' if ctx.kind == 'ocr' else operation} {scope}"


def _attempt_name(ctx: CallContext, record: AttemptRecord, operation: str) -> str:
    scope = ctx.runtime.settings.scopes.get(record.scope or "", ctx.scope)
    model = scope.source(record.source).model
    return f"{operation} {model}" if model else operation


def _put(attributes: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:  # OpenTelemetry attributes cannot be None
        attributes[key] = value
