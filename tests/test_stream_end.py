"""A stream whose every choice has finished, then silence where ``[DONE]`` should be.

An outside review (SPEC §3–§5 over real loopback servers, 2026-12-05) found such an
answer thrown away: a proxy that holds the end back, or a server that writes ``[DONE]``
late, turned a delivered answer into a stall (``stall_timeout_s``), a timeout
(``timeout_s``: 300 s by default), or a hedge (trigger (b)) -- each paid for twice.
SPEC §3: an answer with its finish_reason but no ``[DONE]`` is complete.  Once every
choice has finished, the rest (a usage chunk, ``[DONE]``) may take
``transport.END_GRACE_S``; then the answer completes and its connection is closed.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply
from polygate.transport import END_GRACE_S
from polygate.transport._exchange import END_MARGIN_S

from ._raw_server import raw_server
from .conftest import MESSAGES, one_source_settings


def _event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1,
                                   "model": "m", "choices": choices, **extra}).encode() + b"\n\n"


def _delta(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> bytes:
    return _event([{"index": index, "delta": delta, "finish_reason": finish}])


USAGE = _event([], usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
ANSWER = (_delta({"role": "assistant"}) + _delta({"content": "hello"})
          + _delta({"content": " world"}) + _delta({}, "stop"))


class _Silent(httpx.AsyncByteStream):
    """``parts``: (seconds to wait, bytes) in turn; then silence, for ever."""

    def __init__(self, parts: list[tuple[float, bytes]], log: list[str]) -> None:
        self._parts = parts
        self._log = log

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for wait, data in self._parts:
            await trio.sleep(wait)
            yield data
        await trio.sleep(math.inf)
        yield b""  # pragma: no cover

    async def aclose(self) -> None:
        self._log.append("closed")


def _transport(log: list[str], by_host: dict[str, list[tuple[float, bytes]]]) -> httpx.MockTransport:
    async def handle(request: httpx.Request) -> httpx.Response:
        log.append(request.url.host)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Silent(by_host[request.url.host], log))

    return httpx.MockTransport(handle)


def _settings(*names: str, **scope: Any) -> polygate.Settings:
    sources = [polygate.Source(name=n, base_url=f"http://{n}/v1", weight=1.0 if n == "a" else 1e-9,
                               **scope.pop("source", {})) for n in names]
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=sources, retry=polygate.Retry(max_attempts=1), **scope)})


@pytest.mark.parametrize("usage", [True, False])
@pytest.mark.parametrize("guard", [
    {"stream": polygate.StreamWatch(stall_timeout_s=0.5)},
    {"source": {"timeout_s": 0.5}},
    {"source": {"ttft_timeout_s": 0.5}},
])
async def test_a_finished_answer_is_complete_after_the_grace(
    autojump_clock: trio.testing.MockClock, usage: bool, guard: dict[str, Any]
) -> None:
    log: list[str] = []
    body = ANSWER + (USAGE if usage else b"")
    async with polygate.session(_settings("a", **guard),
                                transport=_transport(log, {"a": [(0.25, body)]})) as s:
        response = await s.chat(MESSAGES)
    assert (response.text, response.finish_reason) == ("hello world", "stop")
    assert response.usage.total_tokens == 5 if usage else response.usage.source == "estimated"
    assert trio.current_time() == pytest.approx(0.25 + END_GRACE_S)
    assert response.call_stats.attempts == 1
    assert log == ["a", "closed"]  # one request; the body not left open


async def test_a_committed_stream_ends_after_the_grace(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    settings = _settings("a", stream=polygate.StreamWatch(stall_timeout_s=0.5))
    async with polygate.session(settings, transport=_transport(log, {"a": [(1.0, ANSWER + USAGE)]})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            shown = "".join([chunk.text async for chunk in stream])
    assert shown == "hello world"
    assert stream.response is not None and stream.response.usage.total_tokens == 5


async def test_silence_after_the_end_triggers_no_hedge(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    settings = _settings("a", "b", hedge=polygate.Hedge(after_s=3, stall_after_s=0.4))
    transport = _transport(log, {"a": [(1.0, ANSWER + USAGE)], "b": [(0.1, ANSWER + USAGE)]})
    async with polygate.session(settings, transport=transport) as s:
        response = await s.chat(MESSAGES)
    assert (response.source, response.call_stats.hedges) == ("a", 0)
    assert "b" not in log


async def test_the_grace_waits_for_every_choice(autojump_clock: trio.testing.MockClock) -> None:
    """With ``n=2``, one finished choice is no end: the other's tokens, 3 s later,
    still count (a choice may be silent for longer than the grace)."""
    log: list[str] = []
    parts = [
        (0.5, _delta({"role": "assistant", "content": "one"}) + _delta({}, "stop")
         + _delta({"role": "assistant", "content": "two"}, index=1)),
        (3.0, _delta({"content": " more"}, index=1) + _delta({}, "stop", index=1) + USAGE),
    ]
    async with polygate.session(_settings("a"), transport=_transport(log, {"a": parts})) as s:
        response = await s.chat(MESSAGES, n=2)
    assert [c["message"]["content"] for c in response.choices] == ["one", "two more"]
    assert trio.current_time() == pytest.approx(3.5 + END_GRACE_S)


async def test_done_after_the_end_but_within_the_grace_keeps_the_connection() -> None:
    """Loopback, real time: an end that comes late but within the grace is read (the
    connection is reused); one held back past it is closed, and the next call opens a
    new one, its answer whole."""
    done_late = [0.2, END_GRACE_S + 1.0]

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        body = ANSWER + USAGE
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(body), body))
        await trio.sleep(done_late.pop(0) if done_late else 0)
        end = b"data: [DONE]\n\n"
        await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))

    async with raw_server(reply) as server:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=server.url, api_key="sk-x")])})
        async with polygate.session(settings) as s:
            for _ in range(3):
                with trio.fail_after(END_GRACE_S + 10):
                    response = await s.chat(MESSAGES)
                assert response.text == "hello world" and response.usage.total_tokens == 5
    # The first end came in time (one connection, reused); the second was held back
    # past the grace (its connection closed): the third call needed a new one.
    assert server.connections == 2


# A review of the change (2026-12-05) found these holes in its first version.

EMPTY = _delta({"role": "assistant", "content": ""}) + _delta({}, "content_filter")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_empty_finished_answer_triggers_no_hedge(
    autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    """Every choice finished with no content token (a filter emptied it), then the end
    held back: the first-token trigger (no token yet) still hedged, during the grace."""
    log: list[str] = []
    settings = _settings("a", "b", hedge=polygate.Hedge(after_s=0.5))
    transport = _transport(log, {"a": [(0.1, EMPTY + USAGE)], "b": [(0.1, ANSWER + USAGE)]})
    async with polygate.session(settings, transport=transport) as s:
        if stream:
            async with s.stream_chat(MESSAGES) as chat_stream:
                async for _ in chat_stream:
                    pass
            response = chat_stream.response
        else:
            response = await s.chat(MESSAGES)
    assert "b" not in log
    assert response is not None and (response.source, response.call_stats.hedges) == ("a", 0)


@pytest.mark.parametrize("n", [2, 2.0])
async def test_n_is_read_as_the_upstream_reads_it(autojump_clock: trio.testing.MockClock, n: Any) -> None:
    """``n=2.0`` is 2 to the pydantic-based servers (and to polygate's estimate): read
    as 1, the second choice, streamed after the first, was cut at the grace."""
    log: list[str] = []
    parts = [
        (0.5, _delta({"role": "assistant", "content": "one"}) + _delta({}, "stop")),
        (0.5, _delta({"role": "assistant", "content": "two"}, index=1)),
        (3.0, _delta({"content": " more"}, index=1) + _delta({}, "stop", index=1) + USAGE),
    ]
    async with polygate.session(_settings("a"), transport=_transport(log, {"a": parts})) as s:
        response = await s.chat(MESSAGES, n=n)
    assert [c["message"]["content"] for c in response.choices] == ["one", "two more"]


async def test_content_after_the_finish_restarts_no_watchdog(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    settings = _settings("a", stream=polygate.StreamWatch(stall_timeout_s=0.3))
    parts = [(0.25, ANSWER), (0.1, _delta({"content": "!"}))]
    async with polygate.session(settings, transport=_transport(log, {"a": parts})) as s:
        response = await s.chat(MESSAGES)
    assert response.text == "hello world!"
    # No stall at 0.65 (the watchdog stays stopped); the grace bounds the silence after
    # the last content (review: it bounded the rest of a stream from the first finish,
    # and cut what a proxy that sends "stop" on every chunk was still sending).
    assert trio.current_time() == pytest.approx(0.25 + 0.1 + END_GRACE_S)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_deadline_inside_the_grace_keeps_the_answer(
    autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    """A review of the change through every door (2026-12-05): a call deadline that
    fell inside the grace threw the answer away (chat: DeadlineExceeded with no
    winner; a stream: every token shown, then DeadlineExceeded).  The grace ends
    before the deadline instead, with the usage that came."""
    log: list[str] = []
    transport = _transport(log, {"a": [(0.2, ANSWER + USAGE)]})
    async with polygate.session(_settings("a"), transport=transport) as s:
        if stream:
            async with s.stream_chat(MESSAGES, call_deadline_s=0.7) as chat_stream:
                text = "".join([chunk.text async for chunk in chat_stream])
            response = chat_stream.response
        else:
            response = await s.chat(MESSAGES, call_deadline_s=0.7)
            text = response.text
    assert response is not None and text == "hello world"
    assert (response.finish_reason, response.usage.total_tokens) == ("stop", 5)
    assert trio.current_time() == pytest.approx(0.7 - END_MARGIN_S)
    assert log == ["a", "closed"]


async def test_a_fatal_error_that_ends_a_committed_stream_carries_its_statistics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/reference.md: an error that ends a committed ``stream_chat()`` carries the
    committed stream's statistics (its source, first token), a fatal one too (review:
    the table said "no winner" for it), and the text the caller received."""
    up = FakeUpstream(Reply(tokens=10, first_token_s=1, fault="error_event", fault_after=4,
                            error_event_code=400))
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        with pytest.raises(polygate.FatalUpstreamError) as failed:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
    stats = failed.value.call_stats
    assert stats is not None and stats.source == "a" and stats.ttft_ms == pytest.approx(1000)
    assert failed.value.text == stream.text != ""
