"""FakeUpstream through its httpx transport face, in virtual time (MockClock).

Every timing assertion is exact: the transport sleeps only with ``trio.sleep`` and
the ``autojump_clock`` fixture jumps straight to the next deadline.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import random
import struct
from collections import Counter
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio
from httpx_sse import aconnect_sse

import polygate.testing
from polygate.testing import FakeUpstream, Profile, Reply, Router

CHAT = "/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]  # 30 chars


def chat_body(*, stream: bool = True, usage: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m1", "messages": MESSAGES, **extra}
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    return body


def client(upstream: FakeUpstream | Router, base_url: str = "http://fake/v1") -> httpx.AsyncClient:
    transport = upstream if isinstance(upstream, Router) else upstream.transport()
    return httpx.AsyncClient(transport=transport, base_url=base_url)


@attrs.frozen
class Event:
    at: float
    event: str | None
    data: str | None
    comment: str | None


def parse_sse(raw: bytes) -> list[tuple[str | None, str | None, str | None]]:
    """(event, data, comment) per SSE block; fails on anything that is not SSE."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-80:]
    blocks = []
    for block in text[:-2].split("\n\n"):
        event = data = comment = None
        for line in block.split("\n"):
            field, sep, value = line.partition(": ")
            assert sep, f"not an SSE line: {line!r}"
            if field == "":
                comment = value
            elif field == "event":
                event = value
            else:
                assert field == "data", line
                data = value
        blocks.append((event, data, comment))
    return blocks


async def timed_stream(
    c: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[float, httpx.Response, list[Event]]:
    """Send a stream request; (time of headers, response, timed events) from t=0."""
    start = trio.current_time()
    events = []
    async with c.stream("POST", CHAT, json=body) as response:
        head_at = trio.current_time() - start
        async for chunk in response.aiter_raw():
            at = trio.current_time() - start
            [(event, data, comment)] = parse_sse(chunk)  # one SSE event per chunk
            events.append(Event(at, event, data, comment))
    return head_at, response, events


def payloads(events: list[Event]) -> list[Any]:
    return [json.loads(e.data) for e in events if e.data is not None and e.data != "[DONE]"]


def content_times(events: list[Event]) -> list[float]:
    times = []
    for e in events:
        if e.data is None or e.data == "[DONE]":
            continue
        choices = json.loads(e.data)["choices"]
        delta = choices[0]["delta"] if choices else {}
        if delta.get("reasoning_content") or delta.get("content"):
            times.append(e.at)
    return times


# ------------------------------------------------------------------ stream shape and timing


async def test_stream_shape_matches_openai(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(tokens=3, reasoning_tokens=2))
    async with client(up) as c:
        _, response, events = await timed_stream(c, chat_body())
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = payloads(events)
    assert events[-1].data == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert {c["id"] for c in chunks} == {"chatcmpl-fake-0"}
    assert {c["model"] for c in chunks} == {"m1"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert [list(d) for d in deltas] == [["reasoning_content"]] * 2 + [["content"]] * 3
    assert "".join(d["content"] for d in deltas[2:]) == "The quick brown"
    finish = chunks[-2]["choices"][0]
    assert finish == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 30 // 4 + 1,
        "completion_tokens": 5,
        "total_tokens": 30 // 4 + 1 + 5,
        "completion_tokens_details": {"reasoning_tokens": 2},
    }


async def test_no_usage_chunk_unless_asked(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(tokens=2))
    async with client(up) as c:
        _, _, events = await timed_stream(c, chat_body(usage=False))
        _, _, without = await timed_stream(c, chat_body())
    assert all("usage" not in p for p in payloads(events))
    assert events[-1].data == "[DONE]"
    assert "usage" in payloads(without)[-1]
    up = FakeUpstream(Reply(tokens=2, usage=False))
    async with client(up) as c:
        _, _, events = await timed_stream(c, chat_body())
    assert all("usage" not in p for p in payloads(events))


async def test_stream_parses_with_httpx_sse(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(text="Hello brave new world", inter_token_s=0.1))
    async with client(up) as c, aconnect_sse(c, "POST", CHAT, json=chat_body()) as source:
        data = [sse.data async for sse in source.aiter_sse()]
    assert data[-1] == "[DONE]"
    parts = [json.loads(d)["choices"] for d in data[:-1]]
    text = "".join(p[0]["delta"].get("content", "") for p in parts if p)
    assert text == "Hello brave new world"
    assert [p[0]["delta"].get("content") for p in parts[1:5]] == [
        "Hello",
        " brave",
        " new",
        " world",
    ]


async def test_exact_first_token_and_inter_token_times(autojump_clock: Any) -> None:
    reply = Reply(headers_delay_s=1.0, first_token_s=2.0, inter_token_s=0.5, tokens=4)
    async with client(FakeUpstream(reply)) as c:
        head_at, _, events = await timed_stream(c, chat_body())
    assert head_at == 1.0
    assert events[0].at == 1.0  # the role chunk comes with the headers, before any token
    assert content_times(events) == [3.0, 3.5, 4.0, 4.5]
    assert [e.at for e in events[-3:]] == [4.5, 4.5, 4.5]  # finish, usage, [DONE]


async def test_exact_stall_time(autojump_clock: Any) -> None:
    reply = Reply(inter_token_s=0.25, tokens=4, stall_at=2, stall_s=30.0)
    async with client(FakeUpstream(reply)) as c:
        _, _, events = await timed_stream(c, chat_body())
    assert content_times(events) == [0.0, 0.25, 30.5, 30.75]


async def test_stall_before_finish_chunk(autojump_clock: Any) -> None:
    reply = Reply(tokens=2, stall_at=2, stall_s=7.0)
    async with client(FakeUpstream(reply)) as c:
        _, _, events = await timed_stream(c, chat_body())
    assert content_times(events) == [0.0, 0.0]
    assert [e.at for e in events[-3:]] == [7.0, 7.0, 7.0]


async def test_empty_answer_still_waits_for_the_first_token(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(tokens=0, first_token_s=3.0))) as c:
        _, _, events = await timed_stream(c, chat_body())
    assert content_times(events) == []
    assert [e.at for e in events] == [0.0, 3.0, 3.0, 3.0]  # role, finish, usage, [DONE]


async def test_keepalive_comments_during_waits(autojump_clock: Any) -> None:
    reply = Reply(first_token_s=10.0, tokens=3, stall_at=1, stall_s=4.0, keepalive_s=3.0)
    async with client(FakeUpstream(reply)) as c:
        _, _, events = await timed_stream(c, chat_body())
    comments = [e.at for e in events if e.comment is not None]
    assert {e.comment for e in events if e.comment is not None} == {"keep-alive"}
    assert comments == [3.0, 6.0, 9.0, 13.0]
    assert content_times(events) == [10.0, 14.0, 14.0]


async def test_non_stream_waits_for_the_whole_generation(autojump_clock: Any) -> None:
    reply = Reply(headers_delay_s=1.0, first_token_s=2.0, inter_token_s=0.5, tokens=5)
    async with client(FakeUpstream(reply)) as c:
        response = await c.post(CHAT, json=chat_body(stream=False))
    assert trio.current_time() == 1.0 + 2.0 + 4 * 0.5
    body = response.json()
    assert response.headers["content-length"] == str(len(response.content))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "The quick brown fox jumps"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5


async def test_non_stream_body_with_reasoning(autojump_clock: Any) -> None:
    reply = Reply(text="Paris.", reasoning_tokens=3, model="other-model")
    async with client(FakeUpstream(reply)) as c:
        body = (await c.post(CHAT, json=chat_body(stream=False))).json()
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Paris.",
        "refusal": None,
        "reasoning_content": "Let me think",
    }
    assert body["model"] == "other-model"
    assert body["usage"]["completion_tokens"] == 4


async def test_stream_false_answers_a_stream_request_with_json(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(stream=False))) as c:
        response = await c.post(CHAT, json=chat_body())
    assert response.headers["content-type"] == "application/json"
    assert response.json()["object"] == "chat.completion"


async def test_max_tokens_caps_and_reports_length(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(tokens=10))) as c:
        body = (await c.post(CHAT, json=chat_body(stream=False, max_tokens=3))).json()
        _, _, events = await timed_stream(c, chat_body(max_completion_tokens=2))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    chunks = payloads(events)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field", ["tokens", "reasoning_tokens"])
async def test_a_large_count_under_a_small_max_tokens_builds_only_what_is_sent(
    autojump_clock: Any, field: str,
) -> None:
    """Outside review (fuzzing): ``Reply(tokens=1_000_000)`` answering ``max_tokens=3``
    built (and cached) every one of the million words first: 1.8 s and 63 MB a call."""
    import time

    started = time.process_time()
    async with client(FakeUpstream(Reply(**{field: 10**7}))) as c:
        body = (await c.post(CHAT, json=chat_body(stream=False, max_tokens=3))).json()
    assert time.process_time() - started < 1.0
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


async def test_model_defaults(autojump_clock: Any) -> None:
    async with client(FakeUpstream()) as c:
        body = (await c.post(CHAT, json={"messages": []})).json()
    assert body["model"] == "fake-model"


# ------------------------------------------------------------------ error statuses


async def test_429_with_retry_after_headers(autojump_clock: Any) -> None:
    reply = Reply(status=429, retry_after_s=2, retry_after_ms=1500, headers={"x-extra": "1"})
    async with client(FakeUpstream(reply)) as c:
        response = await c.post(CHAT, json=chat_body())
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert response.headers["retry-after-ms"] == "1500"
    assert response.headers["x-extra"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [
        (500, "server_error", None),
        (401, "invalid_request_error", "invalid_api_key"),
        (400, "invalid_request_error", None),
        (503, "server_error", None),
    ],
)
async def test_error_bodies(autojump_clock: Any, status: int, kind: str, code: str | None) -> None:
    async with client(FakeUpstream(Reply(status=status, first_token_s=50))) as c:
        response = await c.post(CHAT, json=chat_body())
    assert trio.current_time() == 0  # an error answers at once (first_token_s is not used)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (kind, code)
    assert error["message"]


async def test_custom_error_body(autojump_clock: Any) -> None:
    body = {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    async with client(FakeUpstream(Reply(status=400, error_body=body))) as c:
        response = await c.post(CHAT, json=chat_body())
    assert response.json() == body


# ------------------------------------------------------------------ faults


async def test_fault_malformed_json_stream(autojump_clock: Any) -> None:
    reply = Reply(tokens=4, fault="malformed_json", fault_after=2)
    up = FakeUpstream(reply)
    async with client(up) as c:
        _, _, events = await timed_stream(c, chat_body())
    bad = []
    for i, e in enumerate(events):
        try:
            json.loads(e.data or "null") if e.data != "[DONE]" else None
        except ValueError:
            bad.append(i)
    assert bad == [3]  # role chunk, two tokens, then the broken line
    assert events[-1].data == "[DONE]"  # the stream itself carries on
    assert up.requests[0].outcome == "fault"


async def test_fault_malformed_json_body(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(fault="malformed_json"))) as c:
        response = await c.post(CHAT, json=chat_body(stream=False))
    assert response.status_code == 200
    with pytest.raises(ValueError, match="Expecting"):
        response.json()


async def test_fault_truncated_stream_ends_cleanly_without_finish(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(tokens=5, fault="truncated", fault_after=3))
    async with client(up) as c:
        _, _, events = await timed_stream(c, chat_body())
    chunks = payloads(events)
    assert len(chunks) == 4  # role + 3 tokens
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert all(e.data != "[DONE]" for e in events)
    assert up.requests[0].outcome == "fault"


async def test_fault_truncated_body_is_a_protocol_error(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(fault="truncated"))
    async with client(up) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(CHAT, json=chat_body(stream=False))
    assert up.requests[0].outcome == "fault"
    assert up.in_flight == 0


async def test_fault_reset_mid_stream(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(tokens=5, inter_token_s=1.0, fault="reset", fault_after=2))
    received = []

    async def read(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", CHAT, json=chat_body()) as response:
            async for chunk in response.aiter_raw():
                received.append(chunk)

    async with client(up) as c:
        with pytest.raises(httpx.ReadError):
            await read(c)
    assert len(received) == 3  # role + two tokens
    assert trio.current_time() == 1.0
    assert up.requests[0].outcome == "fault"
    assert up.in_flight == 0


async def test_fault_reset_non_stream(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(fault="reset"))) as c:
        with pytest.raises(httpx.ReadError):
            await c.post(CHAT, json=chat_body(stream=False))


async def test_fault_html(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(fault="html"))) as c:
        response = await c.post(CHAT, json=chat_body())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.text.startswith("<!DOCTYPE html>")


async def test_fault_no_choices(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(fault="no_choices"))) as c:
        response = await c.post(CHAT, json=chat_body())
    body = response.json()
    assert response.status_code == 200
    assert body["object"] == "chat.completion"
    assert "choices" not in body


async def test_fault_silent_sends_nothing_until_cancelled(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(fault="silent"))
    async with client(up) as c:
        with trio.move_on_after(3600) as scope:
            await c.post(CHAT, json=chat_body())
    assert scope.cancelled_caught
    assert trio.current_time() == 3600
    assert up.requests[0].outcome == "client_closed"
    assert up.requests[0].ended_at == 3600
    assert up.in_flight == 0


async def test_fault_error_event(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(tokens=4, fault="error_event", fault_after=1, error_event_code=503))
    async with client(up) as c:
        _, response, events = await timed_stream(c, chat_body())
    assert response.status_code == 200
    last = events[-1]
    assert last.event == "error"
    assert json.loads(last.data or "")["error"]["code"] == 503
    assert len(payloads(events)) == 3  # role, one token, the error
    assert all(e.data != "[DONE]" for e in events)
    assert up.requests[0].outcome == "fault"


async def test_fault_error_event_non_stream(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(fault="error_event"))) as c:
        response = await c.post(CHAT, json=chat_body(stream=False))
    assert response.status_code == 200
    assert response.json()["error"]["code"] == 500


async def test_fault_oversized_stream_line(autojump_clock: Any) -> None:
    size = 3 * 1024 * 1024 + 17
    up = FakeUpstream(Reply(fault="oversized", oversized_bytes=size))
    async with client(up) as c, c.stream("POST", CHAT, json=chat_body()) as response:
        raw = await response.aread()
    lines = raw.split(b"\n")
    longest = max(lines, key=len)
    assert len(longest) + 2 == size  # the line plus its blank-line terminator
    assert longest.startswith(b'data: {"id":')
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_fault_oversized_body(autojump_clock: Any) -> None:
    size = 2 * 1024 * 1024
    async with client(FakeUpstream(Reply(fault="oversized", oversized_bytes=size))) as c:
        response = await c.post(CHAT, json=chat_body(stream=False))
    assert len(response.content) == size
    assert response.headers["content-length"] == str(size)
    assert len(response.json()["padding"]) > size - 100


def test_oversized_default_is_64_mib() -> None:
    assert Reply().oversized_bytes == 64 * 1024 * 1024


# ------------------------------------------------------------------ embeddings and routing


async def test_embeddings_are_deterministic_unit_vectors(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(first_token_s=0.5), embedding_dim=16)
    async with client(up) as c:
        first = (await c.post("/embeddings", json={"model": "e", "input": ["a", "b"]})).json()
        again = (await c.post("/embeddings", json={"model": "e", "input": "a"})).json()
    assert trio.current_time() == 1.0
    assert first["object"] == "list"
    assert first["model"] == "e"
    assert [d["index"] for d in first["data"]] == [0, 1]
    a, b = (d["embedding"] for d in first["data"])
    assert len(a) == 16
    assert a == again["data"][0]["embedding"]
    assert a != b
    assert abs(sum(x * x for x in a) - 1.0) < 1e-5
    assert first["usage"] == {"prompt_tokens": 2, "total_tokens": 2}


async def test_embeddings_base64_and_dimensions(autojump_clock: Any) -> None:
    async with client(FakeUpstream(Reply(embedding_dim=4))) as c:
        floats = (await c.post("/embeddings", json={"input": "x"})).json()
        encoded = (
            await c.post("/embeddings", json={"input": "x", "encoding_format": "base64"})
        ).json()
        wide = (await c.post("/embeddings", json={"input": "x", "dimensions": 32})).json()
    vector = floats["data"][0]["embedding"]
    assert len(vector) == 4
    packed = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack("<4f", packed)) == vector
    assert len(wide["data"][0]["embedding"]) == 32


async def test_unknown_path_bad_json_and_stats(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(status=500))
    async with client(up) as c:
        missing = await c.post("/completions", json={})
        bad = await c.post(CHAT, content=b"{not json", headers={"content-type": "x"})
        stats = (await c.get("/_stats")).json()
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "unknown_url"
    assert bad.status_code == 400
    assert stats["requests"] == 2
    assert stats["completed"] == 2
    assert len(stats["request_times"]) == 2
    assert [r.status for r in up.requests] == [404, 400]


async def test_router_dispatches_by_host(autojump_clock: Any) -> None:
    a, b = FakeUpstream(name="a"), FakeUpstream(name="b")
    router = Router({"a": a, "b": b})
    async with httpx.AsyncClient(transport=router) as c:
        ra = await c.post(f"http://a/v1{CHAT}", json=chat_body(stream=False))
        rb = await c.post(f"http://b/v1{CHAT}", json=chat_body(stream=False))
        with pytest.raises(httpx.ConnectError):
            await c.post(f"http://c/v1{CHAT}", json=chat_body(stream=False))
    assert ra.json()["id"] == "chatcmpl-a-0"
    assert rb.json()["id"] == "chatcmpl-b-0"
    assert len(a.requests) == len(b.requests) == 1


# ------------------------------------------------------------------ in-flight and records


async def test_cancelled_stream_returns_in_flight_to_zero(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(first_token_s=100.0))
    async with client(up) as c:
        with trio.move_on_after(5):
            async with c.stream("POST", CHAT, json=chat_body()) as response:
                assert up.in_flight == 1
                async for _ in response.aiter_raw():
                    pass
    assert up.in_flight == 0
    rec = up.requests[0]
    assert (rec.outcome, rec.started_at, rec.ended_at) == ("client_closed", 0.0, 5.0)


async def test_cancel_during_headers_delay(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(headers_delay_s=60.0))
    async with client(up) as c:
        with trio.move_on_after(1):
            await c.post(CHAT, json=chat_body())
    assert up.in_flight == 0
    assert up.statistics().client_closed == 1


async def test_closing_early_records_client_closed(autojump_clock: Any) -> None:
    up = FakeUpstream(Reply(tokens=50, inter_token_s=1.0))
    async with client(up) as c:
        request = c.build_request("POST", CHAT, json=chat_body())
        response = await c.send(request, stream=True)
        assert up.in_flight == 1
        await response.aclose()  # headers read, body never read
    assert up.requests[0].outcome == "client_closed"
    assert up.in_flight == 0


async def test_peak_in_flight_and_statistics(autojump_clock: Any) -> None:
    up = FakeUpstream([Reply(first_token_s=10.0), Reply(first_token_s=20.0)])
    async with client(up) as c, trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(partial(c.post, CHAT, json=chat_body(stream=False)))
        await trio.sleep(1)
        assert up.in_flight == 3
    stats = up.statistics()
    assert (stats.requests, stats.completed, stats.in_flight, stats.peak_in_flight) == (3, 3, 0, 3)
    assert [r.ended_at for r in up.requests] == [10.0, 20.0, 20.0]  # the last Reply repeats


async def test_history_bounds_records_not_counters(autojump_clock: Any) -> None:
    up = FakeUpstream(history=5)
    async with client(up) as c:
        for _ in range(23):
            await c.post(CHAT, json=chat_body(stream=False))
        stats = (await c.get("/_stats")).json()
    assert 5 <= len(up.requests) < 10
    assert up.requests[-1].index == 22
    assert (stats["requests"], stats["completed"]) == (23, 23)
    # the listed times are the kept requests' (bounded like them), newest last
    assert stats["request_times"] == [r.wall_started_at for r in up.requests]


async def test_history_bounds_memory_of_a_long_run(autojump_clock: Any) -> None:
    """Nothing a FakeUpstream keeps per request grows past 2 x history."""
    up = FakeUpstream(Reply(tokens=0), history=3)
    transport = up.transport()
    for _ in range(500):
        response = await transport.handle_async_request(
            httpx.Request("POST", "http://a/v1/chat/completions", json=chat_body(stream=False))
        )
        await response.aread()
    assert up.statistics().requests == 500
    assert len(up.requests) < 6
    per_request = [v for v in vars(up).values() if isinstance(v, (list, dict, tuple))]
    assert all(len(v) < 6 for v in per_request), [len(v) for v in per_request]
    assert len(up._stats_payload()["request_times"]) < 6


async def test_sequence_then_and_callable(autojump_clock: Any) -> None:
    up = FakeUpstream([Reply(status=500)], then=Reply(status=429))
    seen = []

    def script(request: polygate.testing.RecordedRequest, rng: random.Random) -> Reply:
        seen.append(request.index)
        return Reply(status=200 if request.body["model"] == "ok" else 418)

    scripted = FakeUpstream(script)
    async with client(up) as c, client(scripted) as s:
        statuses = [(await c.post(CHAT, json=chat_body())).status_code for _ in range(3)]
        other = [(await s.post(CHAT, json={"model": m})).status_code for m in ("ok", "no")]
    assert statuses == [500, 429, 429]
    assert other == [200, 418]
    assert seen == [0, 1]


async def test_recorded_request_masks_authorization(autojump_clock: Any) -> None:
    up = FakeUpstream()
    async with client(up) as c:
        await c.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer sk-secret"})
    rec = up.requests[0]
    assert rec.headers["authorization"] == "Bearer sk-secret"
    assert "sk-secret" not in repr(rec)
    assert rec.body == chat_body()
    assert rec.path == "/v1/chat/completions"


# ------------------------------------------------------------------ determinism and Profile


PROFILE = Profile(
    first_token_s=(0.1, 2.0),
    inter_token_s=lambda rng: rng.expovariate(50.0),
    tokens=(1, 20),
    hang_p=0.2,
    hang_s=30.0,
    stall_p=0.2,
    stall_s=(5.0, 10.0),
    keepalive_s=2.0,
    p_429=0.1,
    p_500=0.1,
    p_malformed=0.1,
    p_truncated=0.1,
    p_reset=0.05,
)


async def transcript(up: FakeUpstream, n: int) -> list[tuple[int, Any, bytes, float]]:
    out: list[tuple[int, Any, bytes, float]] = []
    async with client(up) as c:
        for i in range(n):
            start = trio.current_time()
            try:
                async with c.stream("POST", CHAT, json=chat_body(stream=i % 3 != 0)) as r:
                    raw = b"".join([chunk async for chunk in r.aiter_raw()])
                    out.append((r.status_code, sorted(r.headers.items()), raw, 0.0))
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                out.append((0, None, type(exc).__name__.encode(), 0.0))
            out[-1] = (*out[-1][:3], round(trio.current_time() - start, 6))
    return out


async def test_same_seed_same_bytes(autojump_clock: Any) -> None:
    first = await transcript(FakeUpstream(PROFILE, seed=7), 40)
    second = await transcript(FakeUpstream(PROFILE, seed=7), 40)
    other = await transcript(FakeUpstream(PROFILE, seed=8), 40)
    assert first == second
    assert first != other
    assert len({status for status, *_ in first}) >= 3  # the profile really varies


def test_profile_probabilities_roughly_honoured() -> None:
    profile = Profile(
        tokens=(2, 30), hang_p=0.1, hang_s=90.0, stall_p=0.05, stall_s=50.0,
        p_429=0.1, p_500=0.05, p_401=0.02, p_400=0.02, p_malformed=0.03,
        p_truncated=0.03, p_reset=0.03,
    )  # fmt: skip
    rng = random.Random(42)
    replies = [profile.draw(rng) for _ in range(2000)]
    kinds = Counter(r.fault or str(r.status) for r in replies)
    expected = {"429": 0.1, "500": 0.05, "401": 0.02, "400": 0.02, "malformed_json": 0.03,
                "truncated": 0.03, "reset": 0.03}  # fmt: skip
    for kind, p in expected.items():
        assert abs(kinds[kind] - 2000 * p) < 4 * (2000 * p * (1 - p)) ** 0.5 + 1, (kind, kinds)
    hangs = sum(r.first_token_s >= 90.0 for r in replies)
    stalls = [r for r in replies if r.stall_at is not None]
    assert abs(hangs - 200) < 60
    assert abs(len(stalls) - 100) < 40
    assert all(1 <= r.stall_at < r.tokens for r in stalls if r.stall_at is not None)
    assert all(2 <= r.tokens <= 30 for r in replies)
    assert all(r.retry_after_s == 1.0 for r in replies if r.status == 429)
    # seeded: the exact counts are reproducible
    again = [profile.draw(random.Random(42)) for _ in range(1)]
    assert again[0] == replies[0]
    rng = random.Random(42)
    assert (
        Counter((r.fault or str(r.status)) for r in (profile.draw(rng) for _ in range(2000)))
        == kinds
    )


def test_profile_draws_do_not_depend_on_fault_probabilities() -> None:
    quiet = Profile(first_token_s=(0.0, 5.0), tokens=(1, 50))
    noisy = attrs.evolve(quiet, p_500=0.5, hang_p=0.3)
    rng_a, rng_b = random.Random(3), random.Random(3)
    a = [quiet.draw(rng_a) for _ in range(50)]
    b = [noisy.draw(rng_b) for _ in range(50)]
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert {x.status for x in b} == {200, 500}


def test_each_request_draws_from_its_own_generator() -> None:
    """A callable that consumes a varying amount of randomness does not shift the
    draws of the following requests."""

    def greedy(rng: random.Random) -> float:
        return sum(rng.random() for _ in range(rng.randrange(1, 20)))

    lean = Profile(first_token_s=(0.0, 5.0), inter_token_s=0.1)
    hungry = attrs.evolve(lean, inter_token_s=greedy)
    rng_a, rng_b = random.Random(5), random.Random(5)
    a = [lean.draw(rng_a).first_token_s for _ in range(20)]
    b = [hungry.draw(rng_b).first_token_s for _ in range(20)]
    assert a == b


def test_profile_hang_phase_headers() -> None:
    reply = Profile(hang_p=1.0, hang_s=12.0, hang_phase="headers").draw(random.Random(0))
    assert (reply.headers_delay_s, reply.first_token_s) == (12.0, 0.0)
    assert Profile(streaming=False).draw(random.Random(0)).stream is False


def test_profile_keeps_its_bases_keepalive() -> None:
    """A probe found a Profile's keepalive_s (None by default) overwrote its base's:
    'slow first token with keep-alives' scripted through a base sent none."""
    base = Reply(keepalive_s=0.5, tokens=2)
    assert Profile(first_token_s=2.0, base=base).draw(random.Random(0)).keepalive_s == 0.5
    assert Profile(keepalive_s=1.0, base=base).draw(random.Random(0)).keepalive_s == 1.0


def test_validation() -> None:
    with pytest.raises(ValueError, match="fault"):
        Reply(fault="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="add up"):
        Profile(p_429=0.6, p_500=0.6)
    with pytest.raises(ValueError, match="lo"):
        Profile(first_token_s=(2.0, 1.0))
    with pytest.raises(ValueError):
        Reply(first_token_s=-1)
    with pytest.raises(ValueError):
        FakeUpstream([])
    # Outside review (fuzzing): numbers no float holds raised OverflowError (the docs
    # promise a ValueError or a TypeError for a mistake).
    for build in (lambda: Reply(first_token_s=10**400), lambda: Reply(retry_after_s=10**5000),
                  lambda: Profile(inter_token_s=10**400), lambda: Profile(tokens=(0, 10**400))):
        with pytest.raises(ValueError, match="too large"):
            build()


@pytest.mark.parametrize("kwargs", [
    {"embedding_dim": 2.5}, {"embedding_dim": True}, {"history": 1.5}, {"history": 0},
])
def test_a_fakes_own_settings_are_checked_when_written(kwargs: dict[str, Any]) -> None:
    """review: a fractional embedding_dim was taken, and every request then failed inside
    the fake (polygate saw a malformed upstream body): a script's mistake is refused
    where it is written, as docs/testing.md says."""
    with pytest.raises(ValueError, match="whole number"):
        FakeUpstream(Reply(), **kwargs)


def test_an_error_body_json_cannot_write_is_refused_when_written() -> None:
    with pytest.raises(TypeError, match="error_body"):
        Reply(status=500, error_body=object())
    assert Reply(status=500, error_body=b"<html>").error_body == b"<html>"
    assert Reply(status=400, error_body={"detail": ["x"]}).status == 400


def test_public_names() -> None:
    assert set(polygate.testing.__all__) == {
        "Behaviour",
        "Distribution",
        "EventStatistics",
        "EventTransport",
        "FakeUpstream",
        "Fault",
        "Outcome",
        "Profile",
        "RecordedRequest",
        "Reply",
        "Router",
        "Schedule",
        "ToolCall",
        "UpstreamStatistics",
    }
    assert FakeUpstream.__module__ == "polygate.testing"


async def test_an_absurd_embedding_size_is_a_400_not_a_frozen_server(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A probe asked the fake for dimensions=10**9: it built the vector and froze (and,
    served, ignored SIGTERM).  It answers 400 as a provider would."""
    import polygate

    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=FakeUpstream(Reply()).transport()) as s:
        with pytest.raises(polygate.FatalUpstreamError, match="dimensions"):
            await s.embed(["x"], dimensions=10**9)
        assert len((await s.embed(["x"], dimensions=8)).vectors[0]) == 8


# --------------------------------------------------------------------------- review findings


async def _timed_chunks(transport: Any, read_after: float = 0.0) -> list[tuple[float, bytes]]:
    """(time since the request, raw body piece) for a streamed chat."""
    async with httpx.AsyncClient(transport=transport, base_url="http://x/v1") as c:
        t0 = trio.current_time()
        async with c.stream("POST", CHAT, json=chat_body()) as r:
            await trio.sleep(read_after)
            return [(trio.current_time() - t0, piece) async for piece in r.aiter_raw()]


@pytest.mark.parametrize("keepalive", [None, 0.1, 0.3, 0.7])
async def test_keep_alive_comments_do_not_move_the_tokens(
    autojump_clock: trio.testing.MockClock, keepalive: float | None
) -> None:
    """A wait split by keep-alives summed its pieces in floating point: the first
    token came at 0.9999999999999999 instead of 1.0 (each test: a clock from 0)."""
    up = FakeUpstream(Reply(first_token_s=1.0, inter_token_s=0.1, tokens=3, keepalive_s=keepalive))
    times = [t for t, piece in await _timed_chunks(up.transport()) if b'"content":"' in piece]
    assert times[1:4] == [1.0, 1.0 + 1 * 0.1, 1.0 + 2 * 0.1]  # (after the role chunk)


@pytest.mark.parametrize("face", ["transport", "event"])
async def test_token_k_comes_at_first_plus_k_gaps_exactly(
    autojump_clock: trio.testing.MockClock, face: str
) -> None:
    """review: the gaps were added up one by one, and token times drifted off the
    documented exact times (0.7999999999999999 for 0.3 + 5 x 0.1), unlike the
    non-streamed answer's delay, computed at once."""
    up = FakeUpstream(Reply(tokens=10, first_token_s=0.3, inter_token_s=0.1, stall_at=4, stall_s=2.5))
    times = []
    async with _face(up, face) as c, c.stream("POST", CHAT, json=chat_body()) as r:
        async for line in r.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                times.append(trio.current_time())
    assert times == [0.3 + k * 0.1 + (2.5 if k >= 4 else 0.0) for k in range(10)]


async def test_a_late_reader_finds_the_body_already_sent(autojump_clock: trio.testing.MockClock) -> None:
    """The body's schedule runs from the head (a socket buffers what came meanwhile),
    not from the first read: it was 5, 6, 7 s for a body sent by 2 s."""
    reply = Reply(first_token_s=1, inter_token_s=1, tokens=2)
    for transport in (FakeUpstream(reply).transport(), polygate.testing.EventTransport(FakeUpstream(reply))):
        assert {t for t, _ in await _timed_chunks(transport, read_after=5)} == {5.0}


@pytest.mark.parametrize("status", [201, 202, 206])
async def test_a_2xx_status_is_sent_as_scripted(autojump_clock: trio.testing.MockClock, status: int) -> None:
    """Every 2xx path sent 200 (the record said the scripted status)."""
    for stream in (True, False):
        up = FakeUpstream(Reply(status=status, fault="html" if status == 206 else None))
        async with client(up) as c:
            r = await c.post(CHAT, json=chat_body(stream=stream))
        assert r.status_code == up.requests[0].status == status


@pytest.mark.parametrize(("make", "words"), [
    (lambda: Reply(status=100), "status"),
    (lambda: Reply(status=204), "status"),
    (lambda: Reply(status=304), "status"),
    (lambda: Reply(first_token_s=float("nan")), "first_token_s"),
    (lambda: Reply(headers_delay_s=float("nan")), "headers_delay_s"),
    (lambda: Reply(tokens=2.5), "tokens"),
    (lambda: Reply(stall_at=1.5), "stall_at"),
    (lambda: Reply(fault="truncated", fault_after=1.5), "fault_after"),
    (lambda: Reply(text=123), "text"),
    (lambda: Profile(first_token_s=float("nan")), "first_token_s"),
    (lambda: Profile(first_token_s=(0, float("nan"))), "first_token_s"),
    (lambda: Profile(tokens=float("inf")), "tokens"),
    (lambda: Profile(base={"tokens": 3}), "base"),
    (lambda: FakeUpstream([Reply()], then="x"), "then"),
])
def test_a_bad_script_is_refused_when_it_is_written(make: Any, words: str) -> None:
    """Each of these was accepted, then ignored or failed on every request with an
    unrelated error (a NaN wait of 0 s, a fault that never came, an AssertionError)."""
    with pytest.raises((ValueError, TypeError), match=words):
        make()


async def test_a_failing_script_is_a_500_on_loopback_not_the_end_of_the_server() -> None:
    """A behaviour that raises tore the whole loopback server down (and the block
    serving it); now that request gets a 500 that says why, and the next one is served."""
    calls = []

    def behaviour(request: Any, rng: random.Random) -> Reply:
        calls.append(request)
        if len(calls) == 1:
            raise KeyError("the script's own bug")
        return Reply(text="fine")

    up = FakeUpstream(behaviour)
    with trio.fail_after(20):
        async with up.serve() as url, httpx.AsyncClient(base_url=url) as c:
            first = await c.post(CHAT, json=chat_body(stream=False))
            second = await c.post(CHAT, json=chat_body(stream=False))
    assert first.status_code == 500 and b"KeyError" in first.content
    assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize("fault", ["malformed_json", "error_event"])
async def test_a_fault_the_client_stops_at_is_recorded_as_delivered(
    autojump_clock: Any, fault: Any
) -> None:
    """A client reads up to a mid-stream fault and closes (polygate does: the stream
    failed).  The fault's bytes were delivered, so the exchange is a ``fault``, as
    the server face records it, not ``client_closed``."""
    up = FakeUpstream(Reply(tokens=6, inter_token_s=0.1, fault=fault, fault_after=2))
    async with client(up) as c, c.stream("POST", CHAT, json=chat_body()) as response:
        async for line in response.aiter_lines():
            if "unterminated" in line or line.startswith("event: error"):
                break
    assert up.requests[0].outcome == "fault"
    assert up.statistics().faults == 1


def _face(up: FakeUpstream, face: str) -> httpx.AsyncClient:
    transport = up.transport() if face == "transport" else polygate.testing.EventTransport(up)
    return httpx.AsyncClient(transport=transport, base_url="http://x/v1")


@pytest.mark.parametrize("face", ["transport", "event", "server"])
async def test_an_answer_read_to_done_then_closed_is_complete_in_every_face(face: str) -> None:
    """review: a client that read a stream through [DONE] and closed (as httpx-sse
    loops do), or closed a 503 after reading its status, was recorded client_closed
    by the two in-process faces and complete by the loopback server: the last bytes
    handed over are delivered."""
    for reply, stream in ((Reply(tokens=3, inter_token_s=0.01), True), (Reply(status=503), False)):
        up = FakeUpstream(reply)
        async with contextlib.AsyncExitStack() as stack:
            if face == "server":
                c = await stack.enter_async_context(httpx.AsyncClient(base_url=await stack.enter_async_context(up.serve())))
            else:
                c = await stack.enter_async_context(_face(up, face))
            async with c.stream("POST", CHAT, json=chat_body(stream=stream)) as r:
                if stream:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            break
                else:
                    assert r.status_code == 503
        # (the server face's exchanges have all ended when its serve() block has)
        assert up.requests[0].outcome == "complete", (face, reply)
        assert up.statistics().completed == 1


@pytest.mark.parametrize("face", ["transport", "event"])
async def test_a_stream_closed_before_its_last_bytes_is_client_closed(
    autojump_clock: trio.testing.MockClock, face: str
) -> None:
    up = FakeUpstream(Reply(tokens=5, inter_token_s=1))
    async with _face(up, face) as c, c.stream("POST", CHAT, json=chat_body()) as r:
        async for line in r.aiter_lines():
            if '"content":"' in line and '""' not in line:
                break  # the first token: four more to come
    assert up.requests[0].outcome == "client_closed"


@pytest.mark.parametrize("name", ["fäke", 'my "fake"', "back\\slash", "", "a\nb"])
def test_a_name_that_cannot_go_into_ids_and_headers_is_refused(name: str) -> None:
    """review: a name was pasted raw into the x-request-id header (non-ASCII: every
    request failed) and into hand-built JSON ids ('"', '\\': every chunk invalid)."""
    with pytest.raises(ValueError, match="name must be printable ASCII"):
        FakeUpstream(name=name)


async def test_a_name_with_blanks_and_punctuation_answers(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(tokens=2), name="up a:8001/x")
    async with client(up) as c, c.stream("POST", CHAT, json=chat_body()) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        assert r.headers["x-request-id"] == "req-up a:8001/x-0"
    assert all(json.loads(line[6:])["id"] == "chatcmpl-up a:8001/x-0" for line in lines)


@pytest.mark.parametrize("router", [Router, polygate.testing.EventTransport])
async def test_routes_match_hosts_in_any_case(autojump_clock: trio.testing.MockClock, router: Any) -> None:
    """review: Router({"API.local": up}) missed http://API.local/v1: httpx lower-cases
    the host."""
    up = FakeUpstream(Reply())
    async with httpx.AsyncClient(transport=router({"API.local": up}), base_url="http://API.local/v1") as c:
        assert (await c.post(CHAT, json=chat_body(stream=False))).status_code == 200


def test_a_route_that_is_no_upstream_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="'a' maps to str"):
        Router({"a": "http://a/v1"})  # type: ignore[dict-item]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"embedding_dim": True}, "embedding_dim"),
    ({"headers": {"x-note": "a\nb"}}, "x-note"),
    ({"headers": {"bad name": "x"}}, "bad name"),
    ({"error_event_code": 1.5}, "error_event_code"),
    ({"finish_reason": 3}, "finish_reason"),
    ({"model": b"m"}, "model"),
    ({"keepalive_s": 1e-300}, "keepalive_s"),
])
def test_script_mistakes_are_refused_when_written(kwargs: dict[str, Any], words: str) -> None:
    """review: these were taken, then failed every request they answered (a
    struct.error; a server that dropped every connection)."""
    with pytest.raises(ValueError, match=words):
        Reply(**kwargs)


@pytest.mark.parametrize("seed", [None, True, 1.5])
def test_a_seed_is_an_int(seed: Any) -> None:
    """None seeded from the OS: a fake that is not the same twice."""
    with pytest.raises(TypeError, match="seed"):
        FakeUpstream(seed=seed)


@pytest.mark.parametrize("face", ["transport", "event", "server"])
@pytest.mark.parametrize("read", [0, 1, 3])
async def test_a_zero_delay_stream_read_in_part_is_delivered_in_every_face(face: str, read: int) -> None:
    """review: a stream with no pause, of which the client read one chunk and closed,
    was client_closed in the transport face, complete in the others (the server
    writes a run of bytes with no pause at once): reading less gave complete, more
    client_closed."""
    up = FakeUpstream(Reply(text="a b c d e f"))
    async with contextlib.AsyncExitStack() as stack:
        if face == "server":
            c = await stack.enter_async_context(httpx.AsyncClient(base_url=await stack.enter_async_context(up.serve())))
        else:
            c = await stack.enter_async_context(_face(up, face))
        async with c.stream("POST", CHAT, json=chat_body()) as r:
            pieces = 0
            async for _ in r.aiter_raw():
                pieces += 1
                if pieces >= read:
                    break
    assert up.requests[0].outcome == "complete"


@pytest.mark.parametrize("routes", [[], None, "a"])
def test_event_transport_routes_of_the_wrong_kind_are_a_type_error(routes: Any) -> None:
    """review: an AttributeError ('list' object has no attribute 'items')."""
    with pytest.raises(TypeError, match="FakeUpstream or a mapping"):
        polygate.testing.EventTransport(routes)


@pytest.mark.parametrize("routes", [[], "a", 3, FakeUpstream()])
def test_router_routes_of_the_wrong_kind_are_a_type_error(routes: Any) -> None:
    with pytest.raises(TypeError, match="mapping of hosts"):
        Router(routes)


@pytest.mark.parametrize("limits", [{"max_completion_tokens": None, "max_tokens": 2},
                                    {"max_completion_tokens": 0, "max_tokens": 2}])
async def test_a_null_max_completion_tokens_leaves_max_tokens_the_cap(
    autojump_clock: trio.testing.MockClock, limits: dict[str, Any],
) -> None:
    """review: the fake ignored max_tokens beside a null max_completion_tokens (and
    polygate's estimate, reading them as an upstream does, did not agree with it)."""
    async with client(FakeUpstream(Reply(tokens=8))) as c:
        r = await c.post(CHAT, json=chat_body(stream=False, **limits))
    answer = r.json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("most", "per_second"), [(0.29, 100), (0.57, 100), (2.01, 100), (1.001, 1000)])
def test_instants_reach_their_upper_bound(most: float, per_second: int) -> None:
    """review: 0.57 * 100 is 56.99999999999999: the bound, on the grid, was never drawn."""
    from hypothesis import find

    from polygate.testing import strategies as pst

    assert find(pst.instants(most=most, per_second=per_second), lambda t: t == most) == most


def test_instants_never_pass_their_bound() -> None:
    from hypothesis import find
    from hypothesis.errors import NoSuchExample

    from polygate.testing import strategies as pst

    most = 0.569999999999  # rounded to 57 steps of 0.01: one past it
    with pytest.raises(NoSuchExample):
        find(pst.instants(most=most, per_second=100), lambda t: t > most)


async def test_a_content_part_whose_text_is_no_string_is_answered(autojump_clock: Any) -> None:
    """Review: a part ``{"type": "text", "text": 5}`` made the fake raise a TypeError
    (a 500 with a traceback in the log) while counting the prompt's tokens."""
    up = FakeUpstream(Reply(text="ok"))
    body = chat_body(stream=False, messages=[
        {"role": "user", "content": [{"type": "text", "text": 5}, {"type": "text", "text": "hi"}]}])
    async with client(up) as c:
        r = await c.post("/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "ok"


async def test_an_endless_inter_token_wait_hangs_after_the_first_token(autojump_clock: Any) -> None:
    """Review: inter_token_s=inf ("infinity waits for ever") made a NaN deadline
    (inf x 0 at the first token) and every request failed with trio's ValueError."""
    upstream = FakeUpstream(Reply(first_token_s=1.0, inter_token_s=math.inf, tokens=3))
    async with client(upstream) as http:
        seen: list[tuple[float, str]] = []
        with trio.move_on_after(100):
            async with http.stream("POST", "/chat/completions", json=chat_body()) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        seen.append((trio.current_time(), line))
        # A one-token JSON answer comes at its first token's time.
        one = FakeUpstream(Reply(first_token_s=1.0, inter_token_s=math.inf, tokens=1))
        async with client(one) as once:
            started = trio.current_time()
            answer = await once.post("/chat/completions", json=chat_body(stream=False))
            assert answer.status_code == 200 and trio.current_time() - started == 1.0
    assert [at for at, _ in seen[1:2]] == [1.0]  # the role chunk at 0, the first token at 1 s
    assert len(seen) == 2  # and then nothing: the hang
    assert upstream.requests[0].outcome == "client_closed"


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Profile(keepalive_s=1e-5), "keepalive_s"),
    (lambda: Reply(text="caf\ud800"), "text is not UTF-8"),
    (lambda: Reply(model="m\ud800"), "model is not UTF-8"),
    (lambda: Reply(finish_reason="\ud800"), "finish_reason is not UTF-8"),
    (lambda: Reply(status=400, error_body={"e": "\ud800"}), "error_body"),
    (lambda: Reply(status=400, error_body={"e": math.nan}), "error_body"),
    (lambda: Reply(headers={"content-length": "3"}), "frames the message"),
    (lambda: Reply(headers={"Transfer-Encoding": "chunked"}), "frames the message"),
    (lambda: Reply(status=429, retry_after_s=math.inf), "finite"),
])
def test_a_script_the_fake_cannot_send_fails_at_construction(make: Any, match: str) -> None:
    """Review: each of these was accepted, then failed every request the script
    answered (a 500 "script failed" over loopback, an error from the transport), or
    made the two faces send different bytes."""
    with pytest.raises((ValueError, TypeError), match=match):
        make()


async def test_a_small_retry_after_is_written_without_an_exponent(autojump_clock: Any) -> None:
    upstream = FakeUpstream(Reply(status=429, retry_after_s=0.00001))
    async with client(upstream) as http:
        answer = await http.post("/chat/completions", json=chat_body())
    assert answer.headers["retry-after"] == "0.00001"


async def test_a_request_records_its_query_string_on_every_face() -> None:
    """A gap an application team met: Azure's clients send ``?api-version=...`` on every
    request, and ``RecordedRequest`` kept only the path."""
    from polygate.testing import EventTransport

    fake = FakeUpstream(Reply())
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for transport in (fake.transport(), EventTransport({"a": fake})):
        async with httpx.AsyncClient(transport=transport, base_url="http://a/v1") as client:
            await client.post("/chat/completions", params={"api-version": "2024-06-01"}, json=body)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as client:
        await client.post("/chat/completions", params={"api-version": "2024-06-01"}, json=body)
        await client.post("/chat/completions", json=body)
    assert [(r.path, r.query) for r in fake.requests] == [
        ("/v1/chat/completions", "api-version=2024-06-01")] * 3 + [("/v1/chat/completions", "")]


async def test_the_fake_lists_its_model_as_openai_does() -> None:
    """A gap an application team met: an OpenAI client's first request is often
    ``GET /v1/models`` (a health check, ``client.models.list()``), and the fake
    answered it 404."""
    from openai.types import Model

    from polygate.testing import EventTransport

    plain, named = FakeUpstream(Reply()), FakeUpstream(Reply(model="gpt-4o-mini"))
    listed = []
    for transport in (plain.transport(), EventTransport({"a": named})):
        async with httpx.AsyncClient(transport=transport, base_url="http://a/v1") as client:
            listed.append((await client.get("/models")).json())
    async with plain.serve() as url, httpx.AsyncClient(base_url=url) as client:
        answer = await client.get("/models")
        assert answer.status_code == 200 and answer.json() == listed[0]
        assert (await client.head("/models")).status_code == 200
    assert [[Model.model_validate(m).id for m in page["data"]] for page in listed] == [
        ["fake-model"], ["gpt-4o-mini"]]
    assert listed[0]["object"] == "list"
    assert [(r.method, r.path, r.status, r.outcome) for r in plain.requests][:2] == [
        ("GET", "/v1/models", 200, "complete")] * 2
