"""The gateway in a distributed trace: a request's W3C ``traceparent`` is the parent of
its logical call's span, when the process traces (a tracer provider is set), so the
gateway is one hop of the client's trace.  Skipped without opentelemetry-sdk."""

from __future__ import annotations

from typing import Any

import pytest
import trio

pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed")

from opentelemetry import trace
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
