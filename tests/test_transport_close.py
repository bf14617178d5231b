"""A caller's own httpx transport whose response fails to close (a test harness's
body stream, a recording wrapper's bug): the failed close never takes the place of
what was under way (an outside review, "the caller's own httpx transport").

It replaced the cancellation of a call cut by its deadline or its caller, which then
counted as the source's failure: five deadlines opened the breaker of a source that
never failed (SPEC §3: never fed by external cancellation). It replaced a complete
answer, and the error that explained a failure."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate

from .conftest import SECRET

HI = [{"role": "user", "content": "hi"}]
SSE = {"content-type": "text/event-stream"}


def _sse(*texts: str) -> list[bytes]:
    events: list[dict[str, Any]] = [
        {"id": "x", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]} for text in texts]
    events.append({"id": "x", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


class _FailingClose(httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes], *, hang: bool = False) -> None:
        self.pieces = pieces
        self.hang = hang

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece
        if self.hang:
            await trio.sleep_forever()

    async def aclose(self) -> None:
        raise RuntimeError("close failed")


def _settings(**scope: Any) -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[source], **scope)})


def _hanging(_request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, stream=_FailingClose([b": hi\n\n"], hang=True), headers=SSE)


async def _failures(s: polygate.Session) -> int:
    (source,) = (await s.statistics()).governance.sources
    assert source.state.in_flight == 0 and source.state.tokens_reserved == 0
    return source.state.consecutive_failures


async def test_deadlines_never_feed_the_breaker(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL)  # (the failed closes are logged as bugs)
    async with polygate.session(_settings(call_deadline_s=4), transport=httpx.MockTransport(_hanging)) as s:
        for _ in range(5):
            with pytest.raises(polygate.DeadlineExceeded):
                await s.chat(HI)
        assert await _failures(s) == 0
        (source,) = (await s.statistics()).governance.sources
        assert source.state.breaker.value == "closed"


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_callers_cancellation_never_feeds_the_breaker(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, streamed: bool,
) -> None:
    caplog.set_level(logging.CRITICAL)
    async with polygate.session(_settings(), transport=httpx.MockTransport(_hanging)) as s:
        with trio.move_on_after(3) as cut:
            if streamed:
                async with s.stream_chat(HI) as stream:
                    async for _ in stream:
                        pass  # pragma: no cover
            else:
                await s.chat(HI)
        assert cut.cancelled_caught
        assert await _failures(s) == 0


async def test_a_complete_answer_is_not_lost_to_its_close(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL)  # (logged as the transport's bug, not raised)

    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_FailingClose(_sse("he", "llo")), headers=SSE)

    async with polygate.session(_settings(retry=polygate.Retry(max_attempts=1)),
                                transport=httpx.MockTransport(handler)) as s:
        assert (await s.chat(HI)).text == "hello"
        assert await _failures(s) == 0


_JSON = json.dumps({"id": "x", "object": "chat.completion", "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
_VECTORS = json.dumps({"object": "list", "model": "m",
                       "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                       "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_complete_json_answer_is_not_lost_to_its_close(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, streaming: bool,
) -> None:
    """httpx closes a body itself as it ends (its aiter_raw): the failed close came out
    of the read of a JSON answer, which was retried (billed again) and fed the breaker."""
    caplog.set_level(logging.CRITICAL)
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, stream=_FailingClose([_JSON]), headers={"content-type": "application/json"})

    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, streaming=streaming)
    async with polygate.session(polygate.Settings(scopes={"chat": polygate.Scope(sources=[source])}),
                                transport=httpx.MockTransport(handler)) as s:
        assert (await s.chat(HI)).text == "hello"
        assert await _failures(s) == 0
    assert len(sent) == 1


async def test_embeddings_are_not_lost_to_their_close(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL)

    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_FailingClose([_VECTORS]), headers={"content-type": "application/json"})

    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)
    async with polygate.session(polygate.Settings(scopes={"embed": polygate.Scope(sources=[source])}),
                                transport=httpx.MockTransport(handler)) as s:
        assert len((await s.embed(["hi"])).vectors) == 1


async def test_the_error_names_its_cause_not_the_close(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """``httpx.Response(content=<a sync iterator>)`` in an async transport: the error
    named the close that followed ("an async close on a sync stream")."""
    caplog.set_level(logging.CRITICAL)

    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter(_sse("x")), headers=SSE)

    async with polygate.session(_settings(retry=polygate.Retry(max_attempts=1)),
                                transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.chat(HI)
    # (httpx 0.27 says "an sync stream")
    assert re.search(r"async iterator on an? sync stream", str(caught.value.errors[0]))
