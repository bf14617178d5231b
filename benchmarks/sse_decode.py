"""Why polygate decodes SSE itself: httpx-sse against polygate's byte-level decoder.

Both decode the same bodies — every recorded stream in tests/transcripts, and a
synthetic 200-chunk stream — fed in the same pieces.  The figure that matters is µs
per event: it is paid for every token of every streamed answer.  Two measurements:
the decoders alone (synchronous), and the way each is used on an httpx response
(httpx-sse's ``EventSource.aiter_sse()`` — text decoding and two async generators per
line — against polygate's decoder fed from ``response.aiter_raw()``).

    python benchmarks/sse_decode.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import trio
from httpx_sse import EventSource
from httpx_sse._decoders import SSEDecoder as HttpxSSEDecoder
from httpx_sse._decoders import SSELineDecoder

from polygate.transport._sse import SSEDecoder

from _common import machine, write_result

TRANSCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "transcripts"
CHUNK = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":'
         b'[{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":null}]}\n\n')
PIECE = 4096  # what a socket read typically hands over


def pieces(body: bytes) -> list[bytes]:
    return [body[i : i + PIECE] for i in range(0, len(body), PIECE)]


def httpx_sse(parts: list[bytes]) -> int:
    """What httpx-sse's EventSource does: text decode, split lines, build events."""
    lines = SSELineDecoder()
    decoder = HttpxSSEDecoder()
    events = 0
    for part in parts:
        for line in lines.decode(part.decode("utf-8")):
            if decoder.decode(line.rstrip("\n")) is not None:
                events += 1
    for line in lines.flush():
        if decoder.decode(line) is not None:
            events += 1
    return events


def polygate_sse(parts: list[bytes]) -> int:
    decoder = SSEDecoder(max_body=1 << 30, max_line=1 << 30, source="bench")
    events = 0
    for part in parts:
        events += sum(1 for _ in decoder.feed(part))
    events += sum(1 for _ in decoder.flush())
    return events


def measure(fn: Callable[[list[bytes]], int], bodies: list[list[bytes]], rounds: int) -> float:
    events = sum(fn(b) for b in bodies)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for body in bodies:
            fn(body)
        best = min(best, time.perf_counter() - start)
    return best / events * 1e6


class _Pieces(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self._parts = parts

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for part in self._parts:
            yield part


def _response(parts: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Pieces(parts))


async def _on_response(use_httpx_sse: bool, bodies: list[list[bytes]], rounds: int) -> float:
    events = 0
    best = float("inf")
    for _ in range(rounds):
        events = 0
        start = time.perf_counter()
        for parts in bodies:
            response = _response(parts)
            if use_httpx_sse:
                async for _ in EventSource(response).aiter_sse():
                    events += 1
            else:
                decoder = SSEDecoder(max_body=1 << 30, max_line=1 << 30, source="bench")
                async for part in response.aiter_raw():
                    events += sum(1 for _ in decoder.feed(part))
        best = min(best, time.perf_counter() - start)
    return best / events * 1e6


def main() -> None:
    corpus = [pieces(p.read_bytes()) for p in sorted(TRANSCRIPTS.glob("*.sse"))]
    synthetic = [pieces(CHUNK * 200 + b"data: [DONE]\n\n")]
    result = {"machine": machine()}
    print(f"{'corpus':<34}{'httpx-sse µs/event':>20}{'polygate µs/event':>20}{'ratio':>8}")
    for label, bodies in (("recorded transcripts", corpus), ("200-chunk synthetic stream", synthetic)):
        a = measure(httpx_sse, bodies, 50)
        b = measure(polygate_sse, bodies, 50)
        result[label] = {"httpx_sse_us": a, "polygate_us": b, "speedup": a / b}
        print(f"{label:<34}{a:>20.2f}{b:>20.2f}{a / b:>8.1f}x")
    print("\non an httpx response (what each costs in use):")
    for label, bodies in (("recorded transcripts", corpus), ("200-chunk synthetic stream", synthetic)):
        a = trio.run(_on_response, True, bodies, 30)
        b = trio.run(_on_response, False, bodies, 30)
        result[f"{label}, on a response"] = {"httpx_sse_us": a, "polygate_us": b, "speedup": a / b}
        print(f"{label:<34}{a:>20.2f}{b:>20.2f}{a / b:>8.1f}x")
    json.dumps(result)
    print(f"\nresults: {write_result('sse_decode', result)}")


if __name__ == "__main__":
    main()
