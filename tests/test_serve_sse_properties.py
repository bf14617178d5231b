"""The gateway's relay of a stream, for streams shaped as servers send them: it never
raises, every event is JSON a client can read (each entry an object with an integer
index and an object delta), and the OpenAI SDK's stream helper builds the library's
answer from it -- text, refusal, tool calls and the finish reason.  (The SDK's helper
itself fails on shapes no server sends -- a tool call with no function, a choice 1
with no choice 0 -- so those are left out: the library's own tests cover them.)"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from polygate._types import ChatResponse, StreamChunk
from polygate.serve._sse import StreamShape
from polygate.transport import ChatAssembler
from polygate.transport._assemble import carries_extras, has_content

BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}

_text = st.sampled_from(["", "a", " b", "ü", "\n", "x y"])


@st.composite
def _calls(draw: Any, started: list[int], gemini: bool, base: int, step: int) -> list[dict[str, Any]]:
    """A delta's tool calls as servers send them: a call begins with its id, type and
    name (OpenAI, vLLM; indexes from ``base``, ``step`` apart: a bridge passing on
    Anthropic's content-block index counts from 1), the same again on later deltas
    (some servers; with another id, a new call once the call's arguments are
    complete, as Ollama's are), or whole without an index (Gemini);
    it goes on with argument fragments by index."""
    out: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 2))):
        # (A server indexes its calls, or never does: Gemini.)
        kind = "indexless" if gemini else draw(st.sampled_from(["begin", "more", "repeat"]))
        if kind == "more" and started:
            out.append({"index": draw(st.sampled_from(started)), "function": {"arguments": draw(_text)}})
        elif kind == "repeat" and started:
            index = draw(st.sampled_from(started))
            out.append({"index": index, "id": draw(st.sampled_from([f"c{index}", f"r{index}"])),
                        "type": "function",
                        "function": {"name": f"f{index}", "arguments": draw(_text)}})
        elif kind == "indexless":
            out.append({"id": draw(st.sampled_from(["g1", "g2"])), "type": "function",
                        "function": {"name": "g", "arguments": "{}"}})
        else:
            index = base + step * len(started)
            started.append(index)
            out.append({"index": index, "id": f"c{index}", "type": "function",
                        "function": {"name": f"f{index}", "arguments": draw(_text)}})
    return out


@st.composite
def _stream(draw: Any) -> list[dict[str, Any]]:
    """One choice's stream (n = 1): deltas of text, reasoning, a refusal or tool
    calls, the role on the first or on every one (OpenRouter), a finish on the last,
    sometimes with a null delta; now and then an empty chunk or a second entry of the
    choice in one chunk."""
    started: list[int] = []
    gemini = draw(st.booleans())
    base, step = draw(st.sampled_from([0, 1])), draw(st.sampled_from([1, 2]))
    every_role = draw(st.booleans())
    chunks = []
    for n in range(draw(st.integers(1, 5))):
        delta: dict[str, Any] = {}
        if n == 0 or every_role:
            delta["role"] = "assistant"
        kind = draw(st.sampled_from(["content", "reasoning", "refusal", "tools", "empty"]))
        if kind == "content":
            delta["content"] = draw(_text)
        elif kind == "reasoning":
            delta["reasoning_content"] = draw(_text)
        elif kind == "refusal":
            delta["refusal"] = draw(_text)
        elif kind == "tools":
            delta["tool_calls"] = draw(_calls(started, gemini, base, step))
        entries: list[dict[str, Any]] = [{"index": 0, "delta": delta, "finish_reason": None}]
        if draw(st.integers(0, 5)) == 0:
            entries.append({"index": 0, "delta": None})
        chunks.append({**BASE, "choices": entries})
    reason = draw(st.sampled_from(["stop", "length", "tool_calls"]))
    last = draw(st.sampled_from([{}, None]))
    chunks.append({**BASE, "choices": [{"index": 0, "delta": last, "finish_reason": reason}]})
    return chunks


def _forwarded(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any] | None:
    """What the session forwards (chunks with content, or with data a caller must
    see), and the answer the library assembles; None for a stream it refuses."""
    assembler = ChatAssembler()
    forwarded = []
    for chunk in chunks:
        if assembler.add(chunk) or has_content(chunk) or carries_extras(chunk):
            forwarded.append(chunk)
        if assembler.malformed is not None:
            return None
    if not assembler.saw_choice:
        return None
    return forwarded, assembler.build()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_stream())
def test_any_accepted_stream_relays_to_events_an_sdk_client_assembles(chunks: Any) -> None:
    found = _forwarded(chunks)
    if found is None:
        return
    forwarded, answer = found
    shape = StreamShape()
    out = b"".join(shape.chunk(StreamChunk(text="", delta={}, raw=c)) for c in forwarded)
    response = ChatResponse(text="", message={}, choices=answer["choices"], usage=None,
                            source="a", model="m", finish_reason=None, call_stats=None,  # type: ignore[arg-type]
                            raw=answer)
    out += shape.ending(response, include_usage=False)
    state = ChatCompletionStreamState()
    for block in out.split(b"\n\n"):
        if not block.startswith(b"data: {"):
            continue
        event = json.loads(block[6:])
        for entry in event["choices"]:
            assert type(entry["index"]) is int and type(entry.get("delta")) is dict, event
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    built = {c.index: c for c in state.current_completion_snapshot.choices}
    for choice in answer["choices"]:
        got = built[choice["index"]]
        message = choice["message"]
        assert (got.message.content or "") == (message.get("content") or "")
        assert (got.message.refusal or "") == (message.get("refusal") or "")
        assert got.finish_reason == (choice["finish_reason"] or "stop")
        calls = [(c.id, c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
        assert calls == [(c["id"], c["function"]["name"], c["function"]["arguments"])
                         for c in message.get("tool_calls") or []]
