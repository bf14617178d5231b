"""polygate.aio edge cases an outside review found (2026-12-02): a stream whose
session is left mid-stream, and a loop closed under an open session."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

import polygate
import polygate.aio
from polygate.aio import _guest_io
from polygate.testing import FakeUpstream, Reply

from ._aio_support import BACKENDS, messages, settings_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60, method="thread")]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(autouse=True, params=["loop-io", "thread-io"])
def guest_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "thread-io":
        monkeypatch.setattr(_guest_io, "_guest_tick", lambda: None)
    return str(request.param)


async def test_buffered_chunks_after_the_session_was_left_are_not_skipped() -> None:
    """A slow consumer (the bridge's 32-chunk buffer is full, its trio side waits for
    space) whose session is left by another part of the program (a lifespan ending)
    while the stream's block is still open.  Docs: the caller gets
    PolygateError("the session was closed while this call was in flight").

    It was: after 16 chunks, __anext__ raised PolygateError("polygate's trio run has
    ended (its loop is shutting down)") -- the 17th chunk popped and dropped -- and
    iterating again went on with chunk 18 and later raised the right error."""
    up = FakeUpstream(Reply(tokens=100, inter_token_s=0.0005))
    block = polygate.aio.session(settings_for("http://a/v1"), transport=up.transport())
    s = await block.__aenter__()
    texts: list[str] = []
    errors: list[str] = []
    async with s.stream_chat(messages("slow")) as stream:
        for _ in range(200):  # let the trio side fill the buffer and wait for space
            await asyncio.sleep(0.002)
            if len(stream._chunks) >= 32:
                break
        await block.__aexit__(None, None, None)
        for _ in range(3):
            try:
                async for chunk in stream:
                    texts.append(chunk.text)
                break
            except polygate.PolygateError as exc:
                errors.append(str(exc))
    assert errors[:1] == ["the session was closed while this call was in flight"], errors
    assert len(texts) == 32  # every chunk that had come, none skipped
