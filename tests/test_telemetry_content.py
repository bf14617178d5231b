"""With ``log_content=False`` no text the caller sent is stored, even quoted back by
an upstream's error (review: a resumed stream's shown answer, a signed image URL
and an assistant tool call's arguments were, in rows and in OpenTelemetry span
status)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

import polygate
from polygate._resume import CONTINUE_PROMPT
from polygate.testing import FakeUpstream, Reply, Router

KEY = "sk-CANARY-1234567890abcdef"
SHOWN_MARK = "ZEBRAQUARTZ-private-answer-words"
SIG = "X-Amz-Signature=CANARYSIG0123456789abcdef"
ARGS = '{"account_password": "CANARYTOOLARG-hunter2-xyz"}'


def _rows(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT * FROM calls").fetchall() + conn.execute(
            "SELECT * FROM attempts").fetchall()
    finally:
        conn.close()
    return [str(c) for row in rows for c in row]


async def test_resume_continuation_400_quoting_the_shown_answer_is_not_stored(
    autojump_clock: Any, tmp_path: Path,
) -> None:
    """log_content=False: the answer text shown before a cut is sent to the next source
    (an assistant message); an upstream 400 quoting it must not land in the rows."""
    answer = " ".join([SHOWN_MARK] + [f"w{i}" for i in range(40)])
    a = FakeUpstream(Reply(text=answer, fault="truncated", fault_after=20))

    def b_behaviour(request: Any, rng: Any) -> Reply:
        messages = request.body["messages"]
        if messages[-1]["role"] == "assistant" or messages[-1]["content"] == CONTINUE_PROMPT:
            quoted = next(m["content"] for m in messages if m["role"] == "assistant")
            return Reply(status=400, error_body={"error": {
                "message": f"Invalid 'messages[1].content': '{quoted[:60]}'", "type": "invalid_request_error"}})
        return Reply(text=answer)

    b = FakeUpstream(b_behaviour)
    db = tmp_path / "t.db"
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key=KEY, weight=1.0),
            polygate.Source(name="b", base_url="http://b/v1", api_key=KEY, weight=1e-9),
        ], stream=polygate.StreamWatch(resume=True))},
        telemetry=f"sqlite://{db}",
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.PolygateError):
            async with s.stream_chat([{"role": "user", "content": "tell me"}]) as stream:
                async for _ in stream:
                    pass
    assert b.requests, "continuation never sent"
    cells = _rows(db)
    leaked = [c for c in cells if SHOWN_MARK in c]
    assert not leaked, leaked


_IMAGE_URL = f"https://bucket.example/img.png?{SIG}"


@pytest.mark.parametrize(("messages", "quoted", "mark"), [
    ([{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                   {"type": "image_url", "image_url": {"url": _IMAGE_URL}}]}],
     f"Invalid image URL: '{_IMAGE_URL}'", "CANARYSIG"),
    ([{"role": "user", "content": "log me in"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "c1", "type": "function", "function": {"name": "login", "arguments": ARGS}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
     f"Invalid 'messages[1].tool_calls[0].function.arguments': '{ARGS}'", "CANARYTOOLARG"),
], ids=["signed-image-url", "tool-call-arguments"])
async def test_a_400_quoting_a_message_string_that_is_not_its_text_is_not_stored(
    autojump_clock: Any, tmp_path: Path, messages: Any, quoted: str, mark: str,
) -> None:
    up = FakeUpstream(Reply(status=400, error_body={"error": {
        "message": quoted, "type": "invalid_request_error"}}))
    db = tmp_path / "t.db"
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key=KEY)])},
        telemetry=f"sqlite://{db}",
    )
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(messages)
    leaked = [c for c in _rows(db) if mark in c]
    assert not leaked, leaked


async def test_otel_span_status_shows_a_signed_image_url_without_log_content(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import functools

    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import polygate._session
    from polygate.telemetry import open_telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(polygate._session, "open_telemetry",
                        functools.partial(open_telemetry, tracer_provider=provider))
    url = _IMAGE_URL
    up = FakeUpstream(Reply(status=400, error_body={"error": {
        "message": f"Invalid image URL: '{url}'", "type": "invalid_request_error"}}))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=KEY)])})
    msg = [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url}}]}]
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(msg)
    spans = exporter.get_finished_spans()
    assert spans
    shown = [f"{sp.name} {sp.status.description} {dict(sp.attributes or {})}" for sp in spans]
    leaked = [x for x in shown if "CANARYSIG" in x]
    assert not leaked, leaked
