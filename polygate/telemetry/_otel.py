"""OpenTelemetry: a span per logical call, a child span per attempt (extra ``otel``).

This module is imported only when ``opentelemetry`` is installed and the application
has installed a real tracer provider (see :func:`tracer_if_configured`).

The spans are built when the call ends, from the call's frozen statistics and its
attempt records, with explicit start and end times: nothing is added to the call
path while the call runs, and the loser of a hedge — cancelled, settled and recorded
before the call's statistics freeze — still gets its span.  They are created in the
caller's task, so the call span's parent is whatever span the caller has current.

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

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import trio
from opentelemetry import trace
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

    __slots__ = ("_log_content", "_secrets", "_tracer", "errors")

    def __init__(
        self, tracer: trace.Tracer, *, log_content: bool = False, secrets: tuple[str, ...] = ()
    ) -> None:
        self._tracer = tracer
        self._log_content = log_content
        self._secrets = secrets
        self.errors = 0

    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None:
        return None  # attempt spans are made with the call's, from ctx.attempts

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
        except Exception:  # tracing must never break the call it describes
            self.errors += 1

    def _prompt(self, ctx: CallContext) -> list[str]:
        """The prompt texts an error's text must not show (as in the rows)."""
        return unstored_prompt(ctx, self._log_content)

    def _spans(
        self, ctx: CallContext, stats: CallStats, usage: Usage | None, error: BaseException | None
    ) -> None:
        now = trio.current_time()
        now_ns = time.time_ns()

        def ns(t: float) -> int:
            return now_ns - int((now - t) * 1e9)

        operation = _OPERATION.get(ctx.kind, ctx.kind)
        start = ns(ctx.started_at)
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
        span = self._tracer.start_span(
            f"{'ocr' if ctx.kind == 'ocr' else operation} {scope}", kind=SpanKind.INTERNAL,
            start_time=start,
            attributes=attributes,
        )
        if error is not None:
            kind = type(error).__name__
            span.set_attribute("error.type", kind)
            if isinstance(error, Exception):
                text = error_text(error, self._secrets, self._prompt(ctx)) or ""
                span.set_status(Status(StatusCode.ERROR, text[:300]))
            else:
                span.set_attribute("polygate.cancelled", True)
        parent = trace.set_span_in_context(span)
        try:
            for record in ctx.attempts:
                self._attempt_span(ctx, record, operation, parent, ns, now)
        finally:  # a started span always ends (exported), whatever an attempt's did
            span.end(end_time=start + int(stats.total_latency_ms * 1e6))

    def _attempt_span(
        self, ctx: CallContext, record: AttemptRecord, operation: str, parent: Any, ns: Any, now: float
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
        span = self._tracer.start_span(
            f"{operation} {source.model}" if source.model else operation,
            context=parent, kind=SpanKind.CLIENT, start_time=ns(record.started_at),
            attributes=attributes,
        )
        if outcome not in _NOT_FAILURES:
            error = record.error
            span.set_attribute("error.type", type(error).__name__ if error else outcome.value)
            text = (error_text(error, self._secrets, self._prompt(ctx)) or "")[:300] \
                if error is not None else outcome.value
            span.set_status(Status(StatusCode.ERROR, text))
        span.end(end_time=ns(record.ended_at if record.ended_at is not None else now))


def _put(attributes: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:  # OpenTelemetry attributes cannot be None
        attributes[key] = value
