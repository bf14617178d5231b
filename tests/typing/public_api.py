"""A user's program, type-checked (never run) by ``mypy --strict`` in CI.

polygate ships ``py.typed``: what a user's type checker sees is part of the API.  This
file uses the public surface as the docs show it and pins, with ``assert_type``, the
types a user gets back.  The misuses at the end each carry a ``type: ignore[code]``:
mypy's ``warn_unused_ignores`` (on under ``strict``) fails the check if a misuse
stops being an error, so a loose annotation (an ``Any``) cannot creep back in.
"""

from __future__ import annotations

import asyncio
import pathlib

import pydantic
import trio
from typing_extensions import assert_type

import polygate
import polygate.aio
from polygate import CallStats, ChatResponse, EmbeddingResponse, OcrResponse, StreamChunk

SETTINGS = polygate.Settings(
    scopes={
        "chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", model="m")],
            hedge=polygate.Hedge(after_s=8.0),
        )
    }
)
MESSAGES = [{"role": "user", "content": "hi"}]


class Answer(pydantic.BaseModel):
    city: str


class Said(pydantic.BaseModel):
    role: str
    content: str


async def trio_usage() -> None:
    async with polygate.session(SETTINGS) as s:
        r = await s.chat(MESSAGES, temperature=0.2)
        assert_type(r, ChatResponse)
        assert_type(r.text, str)
        assert_type(r.call_stats, CallStats)
        assert_type(r.call_stats.ttft_ms, float | None)
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                assert_type(chunk, StreamChunk)
        # None when the stream did not finish (docs/structured.md), so a user narrows.
        assert_type(stream.response, ChatResponse | None)
        assert_type(await s.embed(["a", "b"]), EmbeddingResponse)
        assert_type(await s.ocr(pathlib.Path("scan.pdf"), pages=[0]), OcrResponse)
        await s.ocr(b"%PDF-1.7")
        await s.ocr("https://example.com/scan.png")
        await s.chat(MESSAGES, cache="refresh", call_deadline_s=None, schema=Answer)
        await s.chat(MESSAGES, cache=False, schema={"type": "object"})
        # A pydantic message in the history (the openai SDK's ChatCompletionMessage, as
        # concepts.md says): refused by both checkers before (a review of the typing).
        await s.chat([*MESSAGES, Said(role="assistant", content="Paris.")])
        async with s.stream_chat([Said(role="user", content="hi")]):
            pass


def errors(exc: Exception) -> None:
    # The call-level errors always carry the call's statistics: no narrowing needed.
    if isinstance(exc, polygate.AllSourcesExhausted):
        assert_type(exc.call_stats, CallStats)
        assert_type(exc.errors, list[polygate.UpstreamError])
    if isinstance(exc, polygate.DeadlineExceeded):
        assert_type(exc.call_stats, CallStats)
    if isinstance(exc, polygate.StreamStalled):
        assert_type(exc.call_stats, CallStats)
        assert_type(exc.text, str)
    if isinstance(exc, polygate.StructuredOutputError):
        assert_type(exc.call_stats, CallStats)
    if isinstance(exc, polygate.UpstreamError):  # set only when it ended a call
        assert_type(exc.call_stats, CallStats | None)


def settings_from_files() -> None:
    polygate.Settings.from_toml("polygate.toml")
    polygate.Settings.from_toml(pathlib.Path("polygate.toml"))
    polygate.Settings.from_env({})


async def asyncio_usage() -> None:
    async with polygate.aio.session(SETTINGS) as s:
        assert_type(s, polygate.aio.Session)
        assert_type(await s.chat(MESSAGES, call_deadline_s=3), ChatResponse)
        assert_type(asyncio.ensure_future(s.chat(MESSAGES)), asyncio.Task[ChatResponse])
        # (Coroutine[Any, Any, T] made gather's result Any under mypy: a review.)
        both = await asyncio.gather(s.chat(MESSAGES), s.embed(["a"]))
        assert_type(both, tuple[ChatResponse, EmbeddingResponse])
        await s.chat([Said(role="user", content="hi")])
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                assert_type(chunk, StreamChunk)
        assert_type(stream.response, ChatResponse | None)
        assert_type(stream.text, str)
        assert_type(await s.embed(["a"]), EmbeddingResponse)


async def misuse(s: polygate.Session, a: polygate.aio.Session, r: ChatResponse) -> None:
    await s.chat("hi")  # type: ignore[arg-type]
    await s.chat(MESSAGES, "chat")  # type: ignore[call-arg]
    await s.chat(MESSAGES, cache="refersh")  # type: ignore[arg-type]
    await s.embed(["a"], cache="yes")  # type: ignore[arg-type]
    s.stream_chat(MESSAGES, cache="refreshed")  # type: ignore[arg-type]
    await s.ocr(12345)  # type: ignore[arg-type]
    await s.stream_chat(MESSAGES)  # type: ignore[misc]
    with s.stream_chat(MESSAGES):  # type: ignore[attr-defined]
        pass
    print(r.call_stats.latency_ms)  # type: ignore[attr-defined]
    polygate.Source(name="a", base_url="http://a/v1", timeout=3)  # type: ignore[call-arg]
    # (A review of the typing: these took Any, so only a run found them.)
    source = polygate.Source(name="a", base_url="http://a/v1")
    polygate.Scope(sources=source)  # type: ignore[arg-type]
    polygate.Scope(sources=["http://a/v1"])  # type: ignore[list-item]
    polygate.Settings(scopes=[polygate.Scope(sources=[source])])  # type: ignore[arg-type]
    polygate.Scope(sources=[source], fallback_on=[1])  # type: ignore[list-item]
    polygate.Serve(models=["chat"])  # type: ignore[arg-type]
    await a.chatt(MESSAGES)  # type: ignore[attr-defined]
    async with a.stream_chat(MESSAGES) as stream:
        print(stream.respnse)  # type: ignore[attr-defined]
    await a.ocr(12345)  # type: ignore[arg-type]


trio.run(trio_usage)
