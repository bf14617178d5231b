"""Behaviours of the wire that no other test pinned: SSE decoding, the assembly of
messages, the classification of upstream failures, the response types, and the
telemetry rows.

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through."""

from __future__ import annotations

import pytest

import polygate
from polygate.transport import ChatAssembler
from polygate.transport._assemble import has_content
from polygate.transport._sse import SSEDecoder


def decode(pieces: list[bytes], max_line: int = 1 << 20, max_body: int = 1 << 30) -> list[bytes]:
    decoder = SSEDecoder(max_body=max_body, max_line=max_line, source="s")
    out = [e.data for p in pieces for e in decoder.feed(p)]
    return out + [e.data for e in decoder.flush()]


# --------------------------------------------------------------------------- SSE


def test_a_body_of_exactly_the_cap_is_read() -> None:
    """Mutant: ``self._total > self._max_body`` -> ``>=``.  max_body_bytes is a cap:
    "going past it is a transient error" (configuration.md), reaching it is not."""
    data = b"data: 0123\n\n" * 3
    assert decode([data], max_body=len(data)) == [b"0123"] * 3
    with pytest.raises(polygate.TransientUpstreamError, match="body cap"):
        decode([data], max_body=len(data) - 1)


def test_only_one_space_after_the_colon_is_dropped() -> None:
    """Mutant: ``value.startswith(b" ")`` / ``value[1:]`` -> ``value.lstrip(b" ")``.
    WHATWG removes one leading space of a field's value; the rest is data (an indented
    line of a multi-line event, a token that starts with a space)."""
    assert decode([b"data:  a\ndata:   b\n\n"]) == [b" a\n  b"]
    assert decode([b"event: x\ndata:  two\n\n"]) == [b" two"]


def test_a_pending_event_is_measured_without_its_edge_line_ends() -> None:
    """Mutant: ``len(buf) > self._max_line + 2`` -> ``+ 1``.  An unfinished event that
    begins after a stray blank line is measured without it (one cap, however cut)."""
    event = b"data: 0123"  # 10 bytes: exactly the cap
    assert decode([b"data: a\n\n\n" + event + b"\n", b"\n"], max_line=len(event)) == [b"a", b"0123"]


def test_a_complete_event_is_measured_without_its_edge_line_ends() -> None:
    """Mutant: ``len(block.strip(b"\\n")) > max_line`` -> ``len(block) > max_line``."""
    event = b"data: 0123"
    assert decode([b"data: a\n\n\n" + event + b"\n\n"], max_line=len(event)) == [b"a", b"0123"]
    # The same event, cut otherwise, passes too (and one byte more fails either way).
    assert decode([b"data: a\n\n", b"\n" + event + b"\n\n"], max_line=len(event)) == [b"a", b"0123"]
    with pytest.raises(polygate.TransientUpstreamError, match="line cap"):
        decode([b"data: a\n\n\n" + event + b"4\n\n"], max_line=len(event))


# --------------------------------------------------------------------------- content tokens


def test_an_audio_transcript_piece_is_a_content_token() -> None:
    """Mutant: carries_audio reads ``data`` only.  concepts.md: an ``audio`` object
    with a piece of its ``data`` or ``transcript`` is a content token."""
    chunk = {"choices": [{"index": 0, "delta": {"audio": {"transcript": "hel"}}}]}
    assert has_content(chunk)
    assert ChatAssembler().add(chunk)
    assert not has_content({"choices": [{"index": 0, "delta": {"audio": {"id": "a1"}}}]})


# --------------------------------------------------------------------------- assembly


def _assembled(*chunks: dict) -> dict:
    assembler = ChatAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.build()


def test_an_empty_content_in_a_tool_call_stream_stays_empty_not_null() -> None:
    """Mutant: ``if self.saw_content or self.content`` -> ``if self.content``.  vLLM's
    tool-call streams send ``"content": ""`` in the role chunk: the JSON answer has
    ``""`` there (serve.md), not ``null``; a stream without it has ``null``."""
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    with_empty = _assembled(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    )
    assert with_empty["choices"][0]["message"]["content"] == ""
    without = _assembled(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    )
    assert without["choices"][0]["message"]["content"] is None


def test_header_fields_come_from_the_first_chunk_that_fills_them() -> None:
    """Mutant: the header's ``value not in (None, "", 0)`` -> ``value is not None``.  An
    upstream whose first chunk carries ``"id": ""``, ``"created": 0``, ``"model": ""``
    (a role chunk built before the answer's header is known) still gets the real
    ones from a later chunk; and ``system_fingerprint`` is kept (mutant: dropped)."""
    body = _assembled(
        {"id": "", "created": 0, "model": "", "system_fingerprint": "",
         "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"id": "chatcmpl-1", "created": 1700000000, "model": "m-1", "system_fingerprint": "fp_1",
         "choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {"id": "chatcmpl-2", "created": 1, "model": "other", "system_fingerprint": "fp_2",
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )
    assert (body["id"], body["created"], body["model"]) == ("chatcmpl-1", 1700000000, "m-1")
    assert body["system_fingerprint"] == "fp_1"


def test_a_null_in_a_later_annotation_keeps_what_came() -> None:
    """Mutant: ``if value is None and key in held: continue`` -> ``... not in held``
    (a null erases).  Azure's ``content_filter_results``: a later chunk's null for a
    category keeps the category's earlier result (as the SDK's accumulator)."""
    body = _assembled(
        {"choices": [{"index": 0, "delta": {"content": "a"},
                      "content_filter_results": {"hate": {"filtered": False, "severity": "safe"}}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                      "content_filter_results": {"hate": None, "violence": {"filtered": False}}}]},
    )
    results = body["choices"][0]["content_filter_results"]
    assert results == {"hate": {"filtered": False, "severity": "safe"}, "violence": {"filtered": False}}


def test_an_empty_signature_after_one_keeps_it() -> None:
    """Mutant: the ``key in _TAGS and value == "" and old`` skip removed.  OpenRouter's
    ``reasoning_details``: a fragment with ``"signature": ""`` (one to come) does not
    erase the signature an earlier fragment of that index carried; texts join."""
    def detail(text: str, signature: str) -> dict:
        return {"choices": [{"index": 0, "delta": {"reasoning_details": [
            {"index": 0, "type": "reasoning.text", "text": text, "signature": signature}]}}]}
    body = _assembled(detail("think ", "sig-1"), detail("more", ""),
                      {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]})
    [entry] = body["choices"][0]["message"]["reasoning_details"]
    assert entry["text"] == "think more"
    assert entry["signature"] == "sig-1"


# --------------------------------------------------------------------------- response types


def test_a_stream_chunks_reasoning_reads_either_name() -> None:
    """Mutant: ``StreamChunk.reasoning`` reads ``reasoning_content`` only.  reference.md:
    ``.reasoning`` is the ``reasoning_content`` or ``reasoning`` delta (Ollama and
    OpenRouter send ``reasoning``)."""
    assert polygate.StreamChunk(text="", delta={"reasoning": "hmm"}, raw={}).reasoning == "hmm"
    assert polygate.StreamChunk(text="", delta={"reasoning_content": "a"}, raw={}).reasoning == "a"
    assert polygate.StreamChunk(text="x", delta={"content": "x"}, raw={}).reasoning == ""


def test_usage_at_the_plausibility_bound_is_believed() -> None:
    """Mutant: ``0 <= value <= _MAX_PLAUSIBLE_TOKENS`` -> ``<``.  The bound itself is a
    believable count; one past it is not."""
    usage = polygate.Usage.from_wire({"prompt_tokens": 100_000_000, "completion_tokens": 1})
    assert usage is not None and usage.total_tokens == 100_000_001
    assert polygate.Usage.from_wire({"prompt_tokens": 100_000_001, "completion_tokens": 1}) is None


# --------------------------------------------------------------------------- classification


async def test_an_error_event_with_a_2xx_status_is_classified_by_its_code(
    autojump_clock: object,
) -> None:
    """Mutant: ``if status is None or 200 <= status < 300`` -> ``if status is None``.
    An error event that carries the 200 of the response it came in (``"status": 200``)
    still says by its code what failed: a rate limit (429: the source cools down), not
    a transient fault with status 200."""
    from tests.test_bad_upstream import _sse_handler

    body = (b'data: {"error":{"message":"slow down","type":"rate_limit_error"},"status":200}\n\n')
    transport, _ = _sse_handler(body)
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key="k" * 20)],
        retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=0))})
    async with polygate.session(settings, transport=transport) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat([{"role": "user", "content": "hi"}])
    [error] = info.value.errors
    assert type(error) is polygate.RateLimitedError
    assert error.status_code == 429


# --------------------------------------------------------------------------- telemetry rows


def test_an_error_text_keeps_500_characters_and_replaces_nul() -> None:
    """Mutants: ``len(text) <= _MESSAGE_LIMIT`` -> ``<`` (a message of exactly 500
    characters cut), and the NUL replacement dropped (PostgreSQL refuses a NUL in text:
    the whole batch, other calls' rows with it)."""
    from polygate.telemetry._recorder import error_text

    assert error_text(Exception("x" * 500), ()) == "x" * 500
    assert error_text(Exception("x" * 501), ()) == "x" * 499 + "…"  # at most 500 in all
    text = error_text(polygate.FatalUpstreamError("bad\x00body", source="a"), ())
    assert text is not None and "\x00" not in text and "bad\ufffdbody" in text


def _chat_context(messages_json: str, kind: str = "chat") -> object:
    from polygate._context import CallContext

    return CallContext(runtime=None, scope_name="chat", scope=None,  # type: ignore[arg-type]
                       kind=kind, started_at=0.0, messages_json=messages_json)


async def test_content_that_exactly_fills_the_bound_is_queued_whole() -> None:
    """Mutant: ``queued_content + size > max_queued_content`` -> ``>=``.  A row whose
    content reaches the bound (but does not go over it) keeps its content
    (telemetry.md: a row "whose content would go over" goes without it)."""
    import trio

    from polygate.telemetry._recorder import TelemetryRecorder, call_event
    from polygate.telemetry._sink import Counters

    ctx = _chat_context('[{"role":"user","content":"' + "x" * 100 + '"}]')
    stats = polygate.CallStats(logical_call_id="c1")
    size = len(call_event(ctx, stats, None, None, 0.0, session_id="s",  # type: ignore[arg-type]
                          log_content=True).content or "")
    send, receive = trio.open_memory_channel[object](10)
    counters = Counters(max_queued_content=size)
    recorder = TelemetryRecorder(send, counters, session_id="s", log_content=True)  # type: ignore[arg-type]
    recorder.call(ctx, stats, None, None)  # type: ignore[arg-type]
    row = receive.receive_nowait()
    assert row.content is not None and len(row.content) == size and "x" * 100 in row.content
    assert counters.queued_content == size and counters.content_omitted == 0


def test_log_content_stores_no_content_for_an_embed_row() -> None:
    """Mutant: ``if log_content and ctx.kind == "chat"`` -> ``if log_content``.
    ocr.md: ``log_content`` applies to chat only; an embed's or OCR call's row has no
    content (a chat-shaped ``{"messages":[],"output":null}`` is no record of it)."""
    from polygate.telemetry._recorder import call_event

    stats = polygate.CallStats(logical_call_id="c1")
    for kind in ("embed", "ocr"):
        row = call_event(_chat_context("[]", kind), stats, None, None, 0.0,  # type: ignore[arg-type]
                         session_id="s", log_content=True)
        assert row.content is None, kind
    chat = call_event(_chat_context("[]"), stats, None, None, 0.0,  # type: ignore[arg-type]
                      session_id="s", log_content=True)
    assert chat.content == '{"messages":[],"output":null}'


async def test_an_attempt_rows_ttft_runs_from_the_request_being_sent(
    autojump_clock: object, tmp_path: object
) -> None:
    """Mutant: the attempt's ``ttft_ms`` from ``record.started_at`` (admission) instead
    of ``timeline.sent_at``.  telemetry.md: ``ttft_ms`` is request sent -> first
    content token; a 2 s connect before the request is written is not the model's
    time to first token (and the call row's ttft_ms, from CallStats, agrees)."""
    import sqlite3

    import attrs
    import trio

    from polygate.testing import FakeUpstream, Reply, Router
    from polygate.testing._transport import FakeTransport
    from tests.conftest import MESSAGES, two_source_settings

    class SlowConnect(FakeTransport):
        async def handle_async_request(self, request):  # type: ignore[no-untyped-def]
            await trio.sleep(2.0)  # connecting: nothing is written yet
            return await super().handle_async_request(request)

    db = tmp_path / "t.db"  # type: ignore[operator]
    settings = attrs.evolve(two_source_settings(names=("a",)), telemetry=f"sqlite://{db}")
    up = FakeUpstream(Reply(first_token_s=1.5, inter_token_s=0.1, tokens=5))
    async with polygate.session(settings, transport=Router({"a": SlowConnect(up)})) as s:
        response = await s.chat(MESSAGES)
    assert response.call_stats.ttft_ms == pytest.approx(1500)
    conn = sqlite3.connect(db)
    try:
        [(attempt_ttft, latency)] = conn.execute("SELECT ttft_ms, latency_ms FROM attempts").fetchall()
        [(call_ttft,)] = conn.execute("SELECT ttft_ms FROM calls").fetchall()
    finally:
        conn.close()
    assert attempt_ttft == pytest.approx(1500) and call_ttft == pytest.approx(1500)
    assert latency == pytest.approx(response.call_stats.generation_ms)


# --------------------------------------------------------------------------- embeddings


def test_an_embeddings_body_that_repeats_an_index_is_malformed() -> None:
    """Mutant: the ``vectors[index] is not None`` check dropped.  Two items with index 0
    for two inputs: one vector overwritten, the other missing -- without the check the
    answer held one vector for two inputs (or the wrong one for the first)."""
    from polygate.transport._exchange import _vectors

    class _Endpoint:
        name = "a"

    body = {"data": [{"index": 0, "embedding": [1.0, 0.0]}, {"index": 0, "embedding": [0.0, 1.0]}]}
    with pytest.raises(polygate.TransientUpstreamError, match="bad index 0"):
        _vectors(body, 2, _Endpoint())  # type: ignore[arg-type]
    swapped = {"data": [{"index": 1, "embedding": [1.0, 0.0]}, {"index": 0, "embedding": [0.0, 1.0]}]}
    assert _vectors(swapped, 2, _Endpoint()) == [[0.0, 1.0], [1.0, 0.0]]  # type: ignore[arg-type]


async def test_an_unlabelled_stream_that_opens_with_a_comment_is_read_as_sse() -> None:
    """Mutant: ``_SSE_START`` without the leading ``:`` (a comment).  An upstream that
    labels its stream application/json (or nothing) and opens it with a keep-alive
    comment, as proxies do, is SSE (openai-python reads it so), not a malformed JSON
    body retried elsewhere."""
    from tests.test_hostile_core import OK_EVENTS, _labelled, _one_source, raw_server

    for ctype in (None, b"application/json"):
        body = b": keep-alive\n\n" + OK_EVENTS
        async with raw_server(_labelled(ctype, body)) as server:
            async with polygate.session(_one_source(server)) as s:
                response = await s.chat([{"role": "user", "content": "hi"}])
        assert response.text == "hi" and len(server.requests) == 1


def test_typed_thinking_parts_join_a_reasoning_content_already_in_the_delta() -> None:
    """Mutant: ``_flatten_parts`` sets ``reasoning_content`` to the parts' thinking
    only, dropping a ``reasoning_content`` string the same delta carried."""
    from polygate.transport._exchange import _flatten_parts

    delta = {"reasoning_content": "first ", "content": [
        {"type": "thinking", "thinking": [{"type": "text", "text": "then"}]},
        {"type": "text", "text": "answer"}]}
    _flatten_parts(delta)
    assert delta == {"reasoning_content": "first then", "content": "answer"}


def test_an_error_that_quotes_an_eight_character_prompt_stores_no_prompt() -> None:
    """Mutants: ``len(piece) >= 8`` -> ``> 8`` (a message text of exactly 8 characters
    is never looked for) and ``len(core) < 8`` -> ``<= 8`` (a quoted run of exactly 8
    characters from a longer message is kept).  telemetry.md: a quoted run of 8 or
    more characters found in a message text is replaced by ``[prompt text]``."""
    from polygate.telemetry._recorder import error_text

    short = error_text(polygate.FatalUpstreamError("Invalid content: 'passw0rd'", source="a"),
                       (), ["passw0rd"])
    assert short is not None and "passw0rd" not in short and "[prompt text]" in short
    run = error_text(polygate.FatalUpstreamError("bad token 'there wo' here", source="a"),
                     (), ["hello there world, how are you"])
    assert run is not None and "there wo" not in run and "[prompt text]" in run


def test_a_choice_with_only_non_object_logprobs_gets_no_state() -> None:
    """Mutant: ``carries_something`` counts any non-null ``logprobs`` (not only an
    object).  A choice that carries nothing else (``{"index": 3, "logprobs": []}``)
    needs no state: the answer must not grow an empty choice 3 (nor three with it)."""
    from polygate._types import carries_something

    assert not carries_something({"index": 3, "logprobs": []})
    assert carries_something({"index": 3, "logprobs": {"content": []}})
    body = _assembled(
        {"choices": [{"index": 0, "delta": {"content": "hi"}}, {"index": 3, "logprobs": []}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )
    assert [c["index"] for c in body["choices"]] == [0]


async def test_a_whole_answer_shown_as_one_chunk_has_no_null_fields(autojump_clock: object) -> None:
    """Mutant: ``message_delta`` keeps the message's null fields.  A source that cannot
    stream shows its answer as one chunk whose delta is the message's non-null fields,
    as a streamed delta has them (no ``"refusal": None`` a client would read as a
    refusal delta)."""
    from polygate.testing import FakeUpstream, Reply, Router

    up = FakeUpstream(Reply(text="hello"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key="k" * 20, streaming=False)])})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
            chunks = [chunk async for chunk in stream]
    assert stream.response is not None and stream.response.message["refusal"] is None
    assert [chunk.delta for chunk in chunks] == [{"role": "assistant", "content": "hello"}]


def test_an_empty_piece_between_a_cr_and_its_lf_changes_nothing() -> None:
    """An empty piece reset the "the last piece ended in CR" flag, so a CRLF split
    around it read as two line ends: one event became two.  (httpx and polygate's own
    transport never hand over an empty piece; a transport of the caller's may.)"""
    decoder = SSEDecoder(max_body=1 << 20, max_line=1 << 16, source="s")
    events = [*decoder.feed(b"data: a\r"), *decoder.feed(b""), *decoder.feed(b"\ndata: b\r\n\r\n")]
    assert [e.data for e in events] == [b"a\nb"]
