"""One HTTP exchange with one source: send, read (SSE or JSON), time every content chunk.

The exchange knows nothing of retries, admission or hedging.  It records what happened
on a :class:`Timeline` that the caller owns, so that a caller which cancels it halfway
(a hedge loser, a watchdog) still knows when the request went out and which chunks
arrived.  Every failure leaves as exactly one :class:`~polygate.UpstreamError`.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import attrs
import httpx
import trio
from httpx_sse import EventSource, SSEError

from .._errors import (
    TransientUpstreamError,
    UpstreamError,
    classify_exception,
    classify_status,
    error_message,
    error_status,
    redact,
)
from ._assemble import ChatAssembler, has_content
from ._wire import Endpoint, Limits, chat_body, embeddings_body, raise_for_status, read_capped

__all__ = ["OnContent", "Timeline", "chat_exchange", "embeddings_exchange"]

OnContent = Callable[[float, dict[str, Any]], Awaitable[None]]

# After [DONE] the rest of the body is drained so the connection returns to the pool;
# a server that keeps the body open past [DONE] gets this long, then it is closed.
_DRAIN_AFTER_DONE_S = 1.0


@attrs.define
class Timeline:
    """When things happened during one exchange (``trio.current_time()`` seconds)."""

    sent_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    chunk_times: list[float] = attrs.Factory(list)
    status_code: int | None = None
    streamed: bool = False

    @property
    def last_token_at(self) -> float | None:
        return self.chunk_times[-1] if self.chunk_times else None


class _CappedStream(httpx.AsyncByteStream):
    """Guards memory: the whole body and each line (bytes since the last newline).

    A class-based iterator rather than an async generator, so stopping early leaves
    no half-run generator of ours for the garbage collector.
    """

    def __init__(self, inner: httpx.AsyncByteStream, limits: Limits, source: str) -> None:
        self._inner = inner
        self._iterator: Any = None
        self._max_body = limits.max_body_bytes
        self._max_line = limits.max_line_bytes
        self._source = source
        self._total = 0
        self._since_newline = 0

    def __aiter__(self) -> _CappedStream:
        self._iterator = self._inner.__aiter__()
        return self

    async def __anext__(self) -> bytes:
        chunk: bytes = await self._iterator.__anext__()
        self._total += len(chunk)
        if self._total > self._max_body:
            raise TransientUpstreamError(
                f"stream exceeds the {self._max_body}-byte body cap", source=self._source
            )
        cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if cut < 0:
            self._since_newline += len(chunk)
        else:
            self._since_newline = len(chunk) - cut - 1
        if self._since_newline > self._max_line:
            raise TransientUpstreamError(
                f"an SSE line exceeds the {self._max_line}-byte line cap", source=self._source
            )
        return chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


async def chat_exchange(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    messages: Sequence[Mapping[str, Any]],
    params: Mapping[str, Any],
    *,
    limits: Limits,
    timeline: Timeline,
    on_content: OnContent | None = None,
) -> dict[str, Any]:
    """Run one chat completion and return the (assembled) non-streamed response body."""
    stream = endpoint.streaming
    request = client.build_request(
        "POST",
        endpoint.url + "/chat/completions",
        content=chat_body(endpoint, messages, params, stream),
        headers=endpoint.headers(),
    )
    try:
        timeline.sent_at = trio.current_time()
        response = await client.send(request, stream=True)
        try:
            timeline.status_code = response.status_code
            await raise_for_status(response, endpoint)
            ctype = response.headers.get("content-type", "")
            if stream and "text/event-stream" in ctype:
                timeline.streamed = True
                body = await _read_sse(response, endpoint, limits, timeline, on_content)
            else:
                body = await _read_chat_json(response, endpoint, limits)
            timeline.ended_at = trio.current_time()
            return body
        finally:
            # Closing releases (or on cancellation, drops) the connection; it does
            # no network I/O that could hang, so the shield cannot delay anything.
            with trio.CancelScope(shield=True):
                await response.aclose()
    except UpstreamError:
        raise
    except (httpx.HTTPError, SSEError, ValueError, UnicodeDecodeError) as exc:
        raise _classified(exc, endpoint) from None


def _classified(exc: BaseException, endpoint: Endpoint) -> UpstreamError:
    error = classify_exception(exc, source=endpoint.name)
    error.message = redact(error.message, endpoint.secrets)
    error.args = (error.message,)
    return error


async def _read_sse(
    response: httpx.Response,
    endpoint: Endpoint,
    limits: Limits,
    timeline: Timeline,
    on_content: OnContent | None,
) -> dict[str, Any]:
    response.stream = _CappedStream(response.stream, limits, endpoint.name)  # type: ignore[arg-type]
    assembler = ChatAssembler()
    done = False
    chunk_times = timeline.chunk_times
    async with aclosing(EventSource(response).aiter_sse()) as events:
        async for event in events:
            data = event.data
            if event.event == "error":
                raise _error_event(data, endpoint)
            if not data:
                continue
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise TransientUpstreamError(
                    f"malformed stream chunk: expected an object, got {type(chunk).__name__}",
                    source=endpoint.name,
                )
            if chunk.get("error") is not None:
                raise _error_event(chunk, endpoint)
            assembler.add(chunk)
            if has_content(chunk):
                now = trio.current_time()
                if not chunk_times:
                    timeline.first_token_at = now
                chunk_times.append(now)
                if on_content is not None:
                    await on_content(now, chunk)
        if done:
            with trio.move_on_after(_DRAIN_AFTER_DONE_S):
                async for _ in events:
                    pass
    if not done and not assembler.finished:
        raise TransientUpstreamError(
            "stream ended before [DONE] and before any finish_reason (truncated)",
            source=endpoint.name,
        )
    return assembler.build()


def _error_event(payload: Any, endpoint: Endpoint) -> UpstreamError:
    """An error inside a 200 stream: classified by its code like an HTTP status."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            pass
    status = error_status(payload)
    detail = redact("error event in stream: " + error_message(payload), endpoint.secrets)
    if status is None or 200 <= status < 300:
        return TransientUpstreamError(detail, source=endpoint.name)
    return classify_status(status, detail, source=endpoint.name)


async def _read_json(response: httpx.Response, endpoint: Endpoint, limits: Limits) -> Any:
    raw = await read_capped(response, limits.max_body_bytes, endpoint.name)
    try:
        payload = json.loads(raw)
    except ValueError:
        ctype = response.headers.get("content-type", "?")
        raise TransientUpstreamError(
            f"malformed upstream body: not JSON (content-type {ctype}, {len(raw)} bytes)",
            source=endpoint.name,
        ) from None
    if isinstance(payload, dict) and payload.get("error") is not None:
        raise _error_event(payload, endpoint)
    return payload


async def _read_chat_json(
    response: httpx.Response, endpoint: Endpoint, limits: Limits
) -> dict[str, Any]:
    payload = await _read_json(response, endpoint, limits)
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, dict) and isinstance(c.get("message"), dict) for c in choices)
    ):
        raise TransientUpstreamError(
            "malformed upstream body: no choices with a message", source=endpoint.name
        )
    assert isinstance(payload, dict)
    return payload


async def embeddings_exchange(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    inputs: Sequence[str],
    params: Mapping[str, Any],
    *,
    limits: Limits,
    timeline: Timeline,
) -> tuple[list[list[float]], dict[str, Any]]:
    """Run one embeddings request; vectors come back in input order."""
    request = client.build_request(
        "POST",
        endpoint.url + "/embeddings",
        content=embeddings_body(endpoint, inputs, params),
        headers=endpoint.headers(),
    )
    try:
        timeline.sent_at = trio.current_time()
        response = await client.send(request, stream=True)
        try:
            timeline.status_code = response.status_code
            await raise_for_status(response, endpoint)
            payload = await _read_json(response, endpoint, limits)
            timeline.ended_at = trio.current_time()
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()
        return _vectors(payload, len(inputs), endpoint), payload
    except UpstreamError:
        raise
    except (httpx.HTTPError, ValueError, UnicodeDecodeError) as exc:
        raise _classified(exc, endpoint) from None


def _vectors(payload: Any, expected: int, endpoint: Endpoint) -> list[list[float]]:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or len(data) != expected:
        got = len(data) if isinstance(data, list) else "no"
        raise TransientUpstreamError(
            f"malformed embeddings body: {got} vectors for {expected} inputs", source=endpoint.name
        )
    vectors: list[list[float] | None] = [None] * expected
    for position, item in enumerate(data):
        if not isinstance(item, dict):
            raise TransientUpstreamError("malformed embeddings item", source=endpoint.name)
        index = item.get("index", position)
        if not isinstance(index, int) or not 0 <= index < expected or vectors[index] is not None:
            raise TransientUpstreamError(
                f"malformed embeddings body: bad index {index!r}", source=endpoint.name
            )
        vectors[index] = _vector(item.get("embedding"), endpoint)
    return [v for v in vectors if v is not None]


def _vector(value: Any, endpoint: Endpoint) -> list[float]:
    if isinstance(value, str):  # encoding_format="base64": little-endian float32
        floats = array("f")
        floats.frombytes(base64.b64decode(value, validate=True))
        if sys.byteorder == "big":
            floats.byteswap()
        return floats.tolist()
    if isinstance(value, list) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value
    ):
        return [float(x) for x in value]
    raise TransientUpstreamError("malformed embedding vector", source=endpoint.name)
