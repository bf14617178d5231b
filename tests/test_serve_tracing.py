"""The gateway in a distributed trace: a request's W3C ``traceparent`` is the parent of
its logical call's span, when the process traces (a tracer provider is set), so the
gateway is one hop of the client's trace.  Skipped without opentelemetry-sdk."""

from __future__ import annotations

from typing import Any

import pytest
import trio

pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed")

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import (
    CarrierT,
    Getter,
    Setter,
    TextMapPropagator,
    default_getter,
    default_setter,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from polygate.testing import Reply

from ._serve_kit import AUTH, gateway, http, read_until_closed, request_bytes

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """The process traces (as under ``opentelemetry-instrument polygate serve``)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    return exporter


def _call_span(exporter: InMemorySpanExporter) -> tuple[ReadableSpan, list[ReadableSpan]]:
    spans = exporter.get_finished_spans()
    [call] = [s for s in spans if s.kind is SpanKind.INTERNAL]
    return call, [s for s in spans if s.kind is SpanKind.CLIENT]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_requests_traceparent_is_its_calls_parent(
    exporter: InMemorySpanExporter, stream: bool
) -> None:
    async with gateway(Reply()) as (server, _upstream):
        body = {**CHAT, "stream": True} if stream else CHAT
        answer = await http(server, "POST", "/v1/chat/completions", body,
                            {**AUTH, "traceparent": TRACEPARENT})
        assert answer.status == 200
    call, [attempt] = _call_span(exporter)
    assert call.context is not None and call.context.trace_id == TRACE_ID
    assert call.parent is not None and call.parent.span_id == PARENT_ID and call.parent.is_remote
    assert attempt.parent is not None and attempt.parent.span_id == call.context.span_id


async def test_a_request_without_one_starts_a_trace_and_leaves_nothing_behind(
    exporter: InMemorySpanExporter,
) -> None:
    """Each request's context is its own: one request's parent is not the next's on
    the same connection (a context attached and never detached would be)."""
    async with gateway(Reply()) as (server, _upstream):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            headers: dict[str, Any] = {**AUTH, "traceparent": TRACEPARENT}
            await stream.send_all(request_bytes("POST", "/v1/chat/completions", CHAT, headers))
            await stream.send_all(request_bytes("POST", "/v1/chat/completions", CHAT,
                                                {**AUTH, "connection": "close"}))
            await read_until_closed(stream)
    calls = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.INTERNAL]
    assert len(calls) == 2
    joined, alone = sorted(calls, key=lambda s: s.parent is None)
    assert joined.parent is not None and joined.parent.span_id == PARENT_ID
    assert alone.parent is None and alone.context is not None and alone.context.trace_id != TRACE_ID


async def test_a_malformed_traceparent_is_ignored(exporter: InMemorySpanExporter) -> None:
    async with gateway(Reply()) as (server, _upstream):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT,
                            {**AUTH, "traceparent": "00-zz-not-a-trace"})
        assert answer.status == 200
    call, _attempts = _call_span(exporter)
    assert call.parent is None


async def test_without_tracing_a_traceparent_changes_nothing() -> None:
    async with gateway(Reply()) as (server, _upstream):
        assert server._current is not None and server._current.join_trace is None  # (nothing is extracted at all)
        answer = await http(server, "POST", "/v1/chat/completions", CHAT,
                            {**AUTH, "traceparent": TRACEPARENT})
        assert answer.status == 200


class _XRayLike(TextMapPropagator):
    """Shaped as opentelemetry-propagator-aws-xray's (``OTEL_PROPAGATORS=xray``): its
    one field is ``X-Amzn-Trace-Id``, mixed case, read with the getter it is given."""

    KEY = "X-Amzn-Trace-Id"

    def extract(self, carrier: CarrierT, context: Any = None,
                getter: Getter[CarrierT] = default_getter) -> Any:
        context = context if context is not None else otel_context.Context()
        found = getter.get(carrier, self.KEY)
        if not found:
            return context
        parts = dict(p.split("=") for p in found[0].split(";"))
        _version, high, low = parts["Root"].split("-")
        span_context = trace.SpanContext(int(high + low, 16), int(parts["Parent"], 16),
                                         is_remote=True, trace_flags=trace.TraceFlags(1))
        return trace.set_span_in_context(trace.NonRecordingSpan(span_context), context)

    def inject(self, carrier: CarrierT, context: Any = None,
               setter: Setter[CarrierT] = default_setter) -> None:
        span_context = trace.get_current_span(context).get_span_context()
        if span_context.is_valid:
            t = f"{span_context.trace_id:032x}"
            setter.set(carrier, self.KEY,
                       f"Root=1-{t[:8]}-{t[8:]};Parent={span_context.span_id:016x};Sampled=1")

    @property
    def fields(self) -> set[str]:
        return {self.KEY}


async def test_a_propagator_whose_field_is_not_lower_case_joins_too(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: the joiner compared the propagator's field names with the lower-cased
    header names, and extracted from them with a case-sensitive getter: an X-Ray
    client's trace was never joined."""
    monkeypatch.setattr(propagate, "get_global_textmap", lambda: _XRayLike())
    t = f"{TRACE_ID:032x}"
    header = f"Root=1-{t[:8]}-{t[8:]};Parent={PARENT_ID:016x};Sampled=1"
    async with gateway(Reply()) as (server, _upstream):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT,
                            {**AUTH, "X-Amzn-Trace-Id": header})
        assert answer.status == 200
    call, _attempts = _call_span(exporter)
    assert call.parent is not None and call.parent.span_id == PARENT_ID


async def test_baggage_on_two_header_lines_goes_on_whole(exporter: InMemorySpanExporter) -> None:
    """Review: several ``baggage`` lines are one list (RFC 9110 5.3, W3C Baggage), as
    are several ``tracestate`` lines; the request's headers kept the last line only."""
    async with gateway(Reply()) as (server, upstream):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        raw = request_bytes("POST", "/v1/chat/completions", CHAT,
                            {**AUTH, "traceparent": TRACEPARENT, "baggage": "tenant=acme",
                             "connection": "close"})
        head, body = raw.split(b"\r\n\r\n", 1)
        async with stream:
            await stream.send_all(head + b"\r\nbaggage: region=eu\r\n\r\n" + body)
            answer = await read_until_closed(stream)
        assert answer.startswith(b"HTTP/1.1 200")
        sent = upstream.requests[0].headers.get("baggage", "")
    assert sorted(item.strip() for item in sent.split(",")) == ["region=eu", "tenant=acme"], sent


class _Raising(TextMapPropagator):
    """A propagator that raises on a header it cannot read (hand-written ones do)."""

    def extract(self, carrier: CarrierT, context: Any = None,
                getter: Getter[CarrierT] = default_getter) -> Any:
        raise ValueError("cannot read it")

    def inject(self, carrier: CarrierT, context: Any = None,
               setter: Setter[CarrierT] = default_setter) -> None:
        return None

    @property
    def fields(self) -> set[str]:
        return {"traceparent"}


async def test_a_propagator_that_raises_does_not_fail_the_request(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: its exception left the joiner and the request was answered 500; tracing
    never fails the call it describes."""
    monkeypatch.setattr(propagate, "get_global_textmap", lambda: _Raising())
    async with gateway(Reply()) as (server, _upstream):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT,
                            {**AUTH, "traceparent": TRACEPARENT})
        assert answer.status == 200
    call, _attempts = _call_span(exporter)
    assert call.parent is None
