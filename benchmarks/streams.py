"""Many slow streams at once: per-chunk cost, token jitter and memory per stream.

One paced upstream runs in its own process (asyncio, on uvloop when installed,
raw protocol: it must not be the bottleneck).  It behaves like a batched decoder
(vLLM and the like): every ``--gap`` seconds (20 ms: 50 tokens/s) it writes one
content chunk to every stream in flight, in one burst, and a request that arrives
joins at the next step.  Each chunk is its own HTTP chunk; its content is the
``time.monotonic()`` at which the upstream wrote it, so a client's *token delay*
is the moment its consumer gets the chunk minus the moment it left the upstream
(both processes read the same ``CLOCK_MONOTONIC``): the kernel's loopback, the
client's framing, decoding and hand-offs, and the wait behind the other streams of
the same burst.

Each client runs in its own process, one after another, rotated between repeats:

* ``polygate``: ``session.stream_chat`` (trio, LeanTransport), admission limits
  that never bind, hedging configured but not triggering, a call deadline;
* ``floor``: asyncio streams on raw sockets, a prebuilt request, chunked framing
  and SSE split by hand, ``json.loads`` per event: the least a Python client must
  do to hand a token to its caller;
* ``aiohttp``: ``ClientSession.post`` and ``async for line in response.content``
  with ``json.loads`` per ``data:`` line (asyncio);
* ``httpx``: ``AsyncClient.stream`` with httpx-sse and ``json.loads`` (trio);
* ``openai``: ``openai.AsyncOpenAI`` with ``stream=True`` (asyncio).

Workloads:

* ``c100`` … ``c1000``: that many concurrent workers, each running ``--rounds``
  streams of ``--chunks`` chunks back to back.  Figures are taken in a steady
  window, from the moment every worker has started its second stream to the moment
  the first worker finishes its last: CPU per chunk (the client process's user +
  system time in the window over the chunks it received), core share (that CPU
  over the window's wall time), token delay p50/p99/max (streams after the first),
  and RSS per stream (the highest RSS in the window minus the RSS before the first
  connection, over the concurrency).  ``upstream_lag_ms`` is how late the
  upstream's own steps were (p99): a figure for the upstream, not the client.
* ``sequential``: ``--seq-streams`` streams of 50 chunks one after another, every
  chunk written at once (no pacing): time per stream and time to the first chunk,
  medians.
* ``churn`` (``--churn N``, alone): N short unpaced streams (``--churn-chunks``, 10)
  through one process, ``--churn-concurrency`` (200) at a time, RSS and the live
  gc-tracked objects sampled every 5 % of the way: is memory flat over many streams
  (the end over the sample at 10 %, and the growth per 10,000 streams)?  ``--quick``
  runs 1,000 of them at 50 at a time.

Ratios are taken within one repeat (every client against the floor and against
aiohttp), and the medians of the repeats reported.

    python benchmarks/streams.py                        # 100/200/500/1000, 3 repeats
    python benchmarks/streams.py --quick                # CI smoke, seconds
    python benchmarks/streams.py --profile 200          # polygate at c200 under cProfile
    python benchmarks/streams.py --churn --clients polygate,floor --repeats 1   # 100,000 streams
    python benchmarks/streams.py --plot docs/img/stream_delay.png   # from the results
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from _common import RESULTS, machine, median, quantile, write_result

CLIENTS = ("polygate", "floor", "aiohttp", "httpx", "openai")
TRIO_CLIENTS = frozenset({"polygate", "httpx", "floor-trio", "floor-trio-hop"})
LEVELS = (100, 200, 500, 1000)
MESSAGES = [{"role": "user", "content": "Say hello."}]
API_KEY = "sk-bench"
HERE = Path(__file__).resolve()
PAGE = os.sysconf("SC_PAGE_SIZE")
SEQ_CHUNKS = 50

# ------------------------------------------------------------------------ the upstream

_HEAD = (b"HTTP/1.1 200 OK\r\nserver: paced\r\ncontent-type: text/event-stream\r\n"
         b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
_PREFIX = (b'data: {"id":"chatcmpl-paced","object":"chat.completion.chunk","created":1700000000,'
           b'"model":"m","system_fingerprint":"fp_paced","choices":[{"index":0,"delta":')
_SUFFIX = b',"logprobs":null,"finish_reason":null}]}\n\n'


def _framed(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


_ROLE = _framed(_PREFIX + b'{"role":"assistant","content":""}' + _SUFFIX)


def _finish_chunks(n: int) -> bytes:
    stop = (b'data: {"id":"chatcmpl-paced","object":"chat.completion.chunk","created":1700000000,'
            b'"model":"m","system_fingerprint":"fp_paced","choices":[{"index":0,"delta":{},'
            b'"logprobs":null,"finish_reason":"stop"}]}\n\n')
    usage = (b'data: {"id":"chatcmpl-paced","object":"chat.completion.chunk","created":1700000000,'
             b'"model":"m","system_fingerprint":"fp_paced","choices":[],"usage":{"prompt_tokens":3,'
             b'"completion_tokens":%d,"total_tokens":%d}}\n\n' % (n, n + 3))
    return _framed(stop) + _framed(usage) + _framed(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _token(now: float) -> bytes:
    return _framed(_PREFIX + b'{"content":"%.6f"}' % now + _SUFFIX)


class _Stream:
    __slots__ = ("left", "n", "transport")

    def __init__(self, transport: asyncio.Transport, n: int) -> None:
        self.transport = transport
        self.n = n
        self.left = n


class _Upstream(asyncio.Protocol):
    """One connection: requests in, SSE out (paced by the decoder loop, or at once)."""

    def __init__(self, decoder: _Decoder) -> None:
        self.decoder = decoder
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.stream: _Stream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.stream.left = 0  # the decoder drops it at its next step

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            body = json.loads(self.buf[end + 4:end + 4 + length])
            self.buf = self.buf[end + 4 + length:]
            self.answer(body)

    def answer(self, body: dict[str, Any]) -> None:
        assert self.transport is not None
        n = int(body.get("max_tokens") or 50)
        if not body.get("stream"):
            text = " ".join([f"{time.monotonic():.6f}"] * n)
            payload = json.dumps({
                "id": "chatcmpl-paced", "object": "chat.completion", "created": 1700000000,
                "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                           "finish_reason": "stop", "logprobs": None}],
                "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
            }).encode()
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            return
        if body.get("model") == "paced":
            self.transport.write(_HEAD + _ROLE)
            self.stream = _Stream(self.transport, n)
            self.decoder.join(self.stream)
            return
        out = [_HEAD, _ROLE]
        for _ in range(n):
            out.append(_token(time.monotonic()))
        out.append(_finish_chunks(n))
        self.transport.write(b"".join(out))


class _Decoder:
    """The batched decoder: one step every ``gap`` seconds on an absolute schedule,
    one chunk to every stream in flight per step."""

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.active: list[_Stream] = []
        self.joining: list[_Stream] = []
        self.lags: array[float] = array("d")

    def join(self, stream: _Stream) -> None:
        self.joining.append(stream)

    async def run(self) -> None:
        due = time.monotonic()
        while True:
            due += self.gap
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = time.monotonic() - due
            if len(self.lags) < 1_000_000:
                self.lags.append(lag)
            if lag > self.gap:
                due = time.monotonic()  # behind by a whole step: no catch-up burst
            if self.joining:
                self.active.extend(self.joining)
                self.joining.clear()
            if not self.active:
                continue
            still = []
            monotonic = time.monotonic
            for stream in self.active:
                if stream.left <= 0:
                    continue
                data = _token(monotonic())
                stream.left -= 1
                if stream.left == 0:
                    data += _finish_chunks(stream.n)
                else:
                    still.append(stream)
                stream.transport.write(data)
            self.active = still


async def _serve_upstream(gap: float) -> None:
    loop = asyncio.get_running_loop()
    decoder = _Decoder(gap)
    server = await loop.create_server(lambda: _Upstream(decoder), "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{port}/v1", flush=True)

    async def stats_on_stdin() -> None:
        # The parent asks for the step lags (and clears them) by writing a line.
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while await reader.readline():
            lags = sorted(decoder.lags)
            decoder.lags = array("d")
            print(json.dumps({"steps": len(lags), "lag_p50_ms": quantile(lags, 0.5) * 1e3,
                              "lag_p99_ms": quantile(lags, 0.99) * 1e3,
                              "lag_max_ms": (lags[-1] if lags else math.nan) * 1e3}), flush=True)

    await asyncio.gather(decoder.run(), stats_on_stdin())


def upstream_main(gap: float) -> None:
    try:
        import uvloop

        uvloop.run(_serve_upstream(gap))
    except ImportError:
        asyncio.run(_serve_upstream(gap))


class Upstream:
    """The paced upstream in its own process."""

    def __init__(self, gap: float) -> None:
        cmd = [sys.executable, str(HERE), "--upstream", "--gap", str(gap)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.close()
            raise RuntimeError(f"upstream did not start: {line!r}")
        self.url = line.removeprefix("listening on ")

    def lags(self) -> dict[str, float]:
        """The upstream's step lags since the last call."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------------ measuring


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Probe:
    """What every client does per token, the same for all: stamp its arrival."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.delays: array[float] = array("d")
        self.firsts: array[float] = array("d")
        self.chunks = 0
        self.second_started = 0
        self.window: dict[str, float] | None = None
        self.closed: dict[str, float] | None = None
        self.peak_rss = 0
        self.base_rss = 0

    def baseline(self) -> None:
        gc.collect()
        self.base_rss = rss_bytes()

    def started(self, index: int) -> None:
        if index == 1:
            self.second_started += 1
            if self.second_started == self.workers and self.window is None:
                self.window = self._mark()

    def finished(self, index: int, last: int) -> None:
        if index == last and self.window is not None and self.closed is None:
            self.closed = self._mark()

    def _mark(self) -> dict[str, float]:
        return {"cpu": time.process_time(), "wall": time.monotonic(), "chunks": self.chunks}

    def summary(self) -> dict[str, Any]:
        assert self.window is not None and self.closed is not None, "no steady window"
        chunks = self.closed["chunks"] - self.window["chunks"]
        cpu = self.closed["cpu"] - self.window["cpu"]
        wall = self.closed["wall"] - self.window["wall"]
        delays = sorted(self.delays)
        return {
            "chunks_in_window": chunks,
            "cpu_per_chunk_us": cpu / max(1, chunks) * 1e6,
            "core_share": cpu / wall if wall else math.nan,
            "chunks_per_s": chunks / wall if wall else math.nan,
            "delay_p50_ms": quantile(delays, 0.5) * 1e3,
            "delay_p99_ms": quantile(delays, 0.99) * 1e3,
            "delay_max_ms": (delays[-1] if delays else math.nan) * 1e3,
            "rss_per_stream_kb": (self.peak_rss - self.base_rss) / self.workers / 1024,
        }


Stream = Callable[[int], AsyncIterator[str]]


async def paced(open_stream: Stream, job: dict[str, Any], spawn: Callable[..., Awaitable[None]]) -> dict[str, Any]:
    """``job["concurrency"]`` workers, ``job["rounds"]`` streams each."""
    workers, rounds, chunks = job["concurrency"], job["rounds"], job["chunks"]
    probe = Probe(workers)
    for _ in range(2):  # warm-up: code paths, caches (one connection)
        async for _text in open_stream(chunks):
            pass
    probe.baseline()
    monotonic = time.monotonic
    delays = probe.delays

    async def worker() -> None:
        for index in range(rounds):
            probe.started(index)
            counted = index > 0
            async for text in open_stream(chunks):
                now = monotonic()
                if counted:
                    delays.append(now - float(text))
                probe.chunks += 1
                if probe.chunks % 512 == 0 and probe.window is not None and probe.closed is None:
                    probe.peak_rss = max(probe.peak_rss, rss_bytes())
            probe.finished(index, rounds - 1)

    await spawn(worker, workers)
    return probe.summary()


async def churn(open_stream: Stream, job: dict[str, Any], spawn: Callable[..., Awaitable[None]]) -> dict[str, Any]:
    """``job["streams"]`` short unpaced streams through one process, ``job["concurrency"]``
    at a time; RSS and the live gc-tracked objects sampled every 5 % of the way (no
    collection before a sample: what the process really holds)."""
    total, workers, chunks = job["streams"], job["concurrency"], job["chunks"]
    for _ in range(2):  # warm-up
        async for _text in open_stream(chunks):
            pass
    gc.collect()
    base_rss, base_objects = rss_bytes(), len(gc.get_objects())
    base_collected = sum(g["collected"] for g in gc.get_stats())
    step = max(1, total // 20)
    samples: list[dict[str, float]] = []
    started = done = 0
    monotonic = time.monotonic
    t0, cpu0 = monotonic(), time.process_time()

    async def worker() -> None:
        nonlocal started, done
        while started < total:
            started += 1
            async for _text in open_stream(chunks):
                pass
            done += 1
            if done % step == 0:
                samples.append({"streams": done, "rss_kb": (rss_bytes() - base_rss) / 1024,
                                "objects": len(gc.get_objects()) - base_objects,
                                "wall_s": monotonic() - t0, "cpu_s": time.process_time() - cpu0})

    await spawn(worker, workers)
    wall, cpu = monotonic() - t0, time.process_time() - cpu0
    gc.collect()
    collected = sum(g["collected"] for g in gc.get_stats()) - base_collected
    after = {"rss_kb": (rss_bytes() - base_rss) / 1024, "objects": len(gc.get_objects()) - base_objects}
    tenth = samples[min(len(samples) - 1, 1)]  # the sample at 10 % (the first at 5 % is still warming)
    last = samples[-1]
    return {
        "streams": total, "concurrency": workers, "chunks": chunks,
        "streams_per_s": total / wall, "cpu_per_stream_us": cpu / total * 1e6,
        "rss_per_stream_kb_at_10pct": tenth["rss_kb"] / workers,
        "rss_per_stream_kb_at_end": last["rss_kb"] / workers,
        "rss_end_over_10pct": (last["rss_kb"] / tenth["rss_kb"]) if tenth["rss_kb"] > 0 else math.nan,
        "rss_growth_kb_per_10k_streams": (last["rss_kb"] - tenth["rss_kb"])
        / max(1, last["streams"] - tenth["streams"]) * 10_000,
        "objects_end_over_10pct": (last["objects"] / tenth["objects"]) if tenth["objects"] > 0 else math.nan,
        # objects only the cyclic collector freed (garbage cycles), per stream
        "cycle_garbage_per_stream": collected / total,
        "after_idle_collected": after,
        "samples": samples,
    }


async def sequential(open_stream: Stream, job: dict[str, Any]) -> dict[str, Any]:
    """``job["streams"]`` unpaced streams one after another."""
    per_stream: list[float] = []
    first: list[float] = []
    monotonic = time.monotonic
    for _ in range(20):  # warm-up
        async for _text in open_stream(SEQ_CHUNKS):
            pass
    cpu0 = time.process_time()
    n = 0
    for _ in range(job["streams"]):
        t0 = monotonic()
        t1 = 0.0
        async for text in open_stream(SEQ_CHUNKS):
            if not t1:
                t1 = monotonic()
            float(text)
            n += 1
        per_stream.append(monotonic() - t0)
        first.append(t1 - t0)
    cpu = time.process_time() - cpu0
    return {"stream_median_us": median(per_stream) * 1e6, "stream_p99_us": quantile(per_stream, 0.99) * 1e6,
            "first_chunk_median_us": median(first) * 1e6, "first_chunk_p99_us": quantile(first, 0.99) * 1e6,
            "cpu_per_chunk_us": cpu / max(1, n) * 1e6}


# ------------------------------------------------------------------------ clients
# Each returns ``open_stream(chunks)``: an async iterator of the content of every
# content chunk, and a context in which the client lives.


def _payload(model: str, chunks: int) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_tokens": chunks, "stream": True}


async def client_polygate(url: str, model: str, run: Callable[[Stream], Awaitable[Any]]) -> Any:
    import polygate

    source = polygate.Source(
        name="a", base_url=url, api_key=API_KEY, model=model,
        rpm=10_000_000, tpm=10_000_000_000, max_in_flight=100_000, timeout_s=600,
    )
    other = polygate.Source(name="b", base_url=url, api_key=API_KEY, model=model,
                            weight=1e-9, timeout_s=600)
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[source, other], hedge=polygate.Hedge(after_s=300), call_deadline_s=600)})
    async with polygate.session(settings) as session:

        async def open_stream(chunks: int) -> AsyncIterator[str]:
            async with session.stream_chat(MESSAGES, max_tokens=chunks) as stream:
                async for chunk in stream:
                    if chunk.text:
                        yield chunk.text

        return await run(open_stream)


async def client_httpx(url: str, model: str, run: Callable[[Stream], Awaitable[Any]]) -> Any:
    import httpx
    from httpx_sse import EventSource

    headers = {"authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:

        async def open_stream(chunks: int) -> AsyncIterator[str]:
            async with client.stream("POST", url + "/chat/completions", json=_payload(model, chunks),
                                     headers=headers) as r:
                async for event in EventSource(r).aiter_sse():
                    if event.data == "[DONE]":
                        break
                    choices = json.loads(event.data)["choices"]
                    text = choices[0]["delta"].get("content") if choices else None
                    if text:
                        yield text

        return await run(open_stream)


async def client_aiohttp(url: str, model: str, run: Callable[[Stream], Awaitable[Any]]) -> Any:
    import aiohttp

    headers = {"authorization": f"Bearer {API_KEY}"}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:

        async def open_stream(chunks: int) -> AsyncIterator[str]:
            async with client.post(url + "/chat/completions", json=_payload(model, chunks),
                                   headers=headers) as r:
                r.raise_for_status()
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].rstrip()
                    if data == b"[DONE]":
                        break
                    choices = json.loads(data)["choices"]
                    text = choices[0]["delta"].get("content") if choices else None
                    if text:
                        yield text

        return await run(open_stream)


async def client_openai(url: str, model: str, run: Callable[[Stream], Awaitable[Any]]) -> Any:
    import httpx
    import openai

    http = openai.DefaultAsyncHttpxClient(
        limits=httpx.Limits(max_connections=2048, max_keepalive_connections=2048))
    client = openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=600,
                                http_client=http)
    try:

        async def open_stream(chunks: int) -> AsyncIterator[str]:
            response = await client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=chunks, stream=True)  # type: ignore[arg-type]
            async with response as chunks_in:
                async for chunk in chunks_in:
                    if chunk.choices and chunk.choices[0].delta.content:
                        yield chunk.choices[0].delta.content

        return await run(open_stream)
    finally:
        await client.close()


class _FloorParser:
    """The floor's parser: whole HTTP chunks off the bytes fed, the content of each
    ``data:`` event yielded as soon as it is decoded; ``done`` at the last chunk."""

    __slots__ = ("buf", "done")

    def __init__(self) -> None:
        self.buf = b""
        self.done = False

    def feed(self, data: bytes) -> Iterator[str]:
        buf = self.buf + data if self.buf else data
        loads = json.loads
        while True:
            line = buf.find(b"\r\n")
            if line < 0:
                break
            size = int(buf[:line], 16)
            if size == 0:
                self.done = True
                break
            end = line + 2 + size
            if len(buf) < end + 2:
                break
            event = buf[line + 2:end]
            buf = buf[end + 2:]
            if event.startswith(b"data: {"):
                choices = loads(event[6:])["choices"]
                text = choices[0]["delta"].get("content") if choices else None
                if text:
                    yield text
        self.buf = buf


def _floor_request(url: str, model: str) -> Callable[[int], bytes]:
    parts = urlsplit(url)
    requests: dict[int, bytes] = {}

    def request(chunks: int) -> bytes:
        if chunks not in requests:
            body = json.dumps(_payload(model, chunks)).encode()
            requests[chunks] = (
                f"POST {parts.path}/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
                f"authorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body
        return requests[chunks]

    return request


async def client_floor(url: str, model: str, run: Callable[[Stream], Awaitable[Any]]) -> Any:
    """Raw sockets (asyncio streams): a kept-alive connection per worker, a prebuilt
    request, chunked framing and SSE split by hand, json.loads per event."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    request = _floor_request(url, model)

    async def open_stream(chunks: int) -> AsyncIterator[str]:
        reader, writer = idle.pop() if idle else await asyncio.open_connection(host, port)
        writer.write(request(chunks))
        await reader.readuntil(b"\r\n\r\n")  # the head (chunked, by this upstream)
        parser = _FloorParser()
        while not parser.done:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("upstream closed")
            for text in parser.feed(data):
                yield text
        idle.append((reader, writer))

    try:
        return await run(open_stream)
    finally:
        for _, writer in idle:
            writer.close()


async def client_floor_trio(
    url: str, model: str, run: Callable[[Stream], Awaitable[Any]], *, hop: bool = False
) -> Any:
    """The floor on trio sockets: what trio itself costs per chunk.  ``hop``: the
    reading runs in a producer task and tokens reach the consumer through a memory
    channel (the shape of a structured stream_chat), one send_nowait per token."""
    import trio

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    idle: list[trio.SocketStream] = []
    request = _floor_request(url, model)

    async def start(chunks: int) -> tuple[trio.SocketStream, bytes]:
        """A connection with the request sent and the head read; the body bytes
        that came with the head."""
        conn = idle.pop() if idle else await trio.open_tcp_stream(host, port)
        await conn.send_all(request(chunks))
        buf = b""
        while True:  # the head
            buf += await conn.receive_some(65536)
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                return conn, buf[end + 4:]

    async def read(chunks: int, emit: Callable[[str], Any]) -> None:
        conn, data = await start(chunks)
        parser = _FloorParser()
        while True:
            for text in parser.feed(data):
                await emit(text)
            if parser.done:
                break
            data = await conn.receive_some(65536)
            if not data:
                raise ConnectionError("upstream closed")
        idle.append(conn)

    if not hop:
        async def open_stream(chunks: int) -> AsyncIterator[str]:
            conn, data = await start(chunks)
            parser = _FloorParser()
            while True:
                for text in parser.feed(data):
                    yield text
                if parser.done:
                    break
                data = await conn.receive_some(65536)
                if not data:
                    raise ConnectionError("upstream closed")
            idle.append(conn)
    else:
        async def open_stream(chunks: int) -> AsyncIterator[str]:
            send, receive = trio.open_memory_channel[str](32)

            async def produce() -> None:
                async with send:
                    async def emit(text: str) -> None:
                        try:
                            send.send_nowait(text)  # no scheduler round trip while there is room
                        except trio.WouldBlock:
                            await send.send(text)
                    await read(chunks, emit)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                async for text in receive:
                    yield text

    return await run(open_stream)


async def client_floor_trio_hop(url: str, model: str, run: Callable[[Stream], Awaitable[Any]]) -> Any:
    return await client_floor_trio(url, model, run, hop=True)


RUNNERS: dict[str, Callable[[str, str, Callable[[Stream], Awaitable[Any]]], Awaitable[Any]]] = {
    "polygate": client_polygate, "httpx": client_httpx, "aiohttp": client_aiohttp,
    "openai": client_openai, "floor": client_floor,
    "floor-trio": client_floor_trio, "floor-trio-hop": client_floor_trio_hop,
}


async def _trio_spawn(worker: Callable[[], Awaitable[None]], n: int) -> None:
    import trio

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(worker)


async def _asyncio_spawn(worker: Callable[[], Awaitable[None]], n: int) -> None:
    await asyncio.gather(*(worker() for _ in range(n)))


def worker_main(client: str, url: str, job: dict[str, Any]) -> None:
    """Child-process mode: one client, one job; one JSON line out."""
    is_trio = client in TRIO_CLIENTS
    spawn = _trio_spawn if is_trio else _asyncio_spawn
    model = "paced" if job["kind"] == "paced" else "burst"

    async def run(open_stream: Stream) -> Any:
        if job["kind"] == "paced":
            return await paced(open_stream, job, spawn)
        if job["kind"] == "churn":
            return await churn(open_stream, job, spawn)
        return await sequential(open_stream, job)

    if job.get("profile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    if is_trio:
        import trio

        result = trio.run(RUNNERS[client], url, model, run)
    else:
        result = asyncio.run(RUNNERS[client](url, model, run))
    if job.get("profile"):
        prof.disable()
        result["profile"] = _profile_groups(prof)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result), flush=True)


def _profile_groups(prof: Any) -> dict[str, Any]:
    import pstats

    groups = {
        "h11": ("/h11/",),
        "polygate transport (pool, SSE, exchange, assembly)": ("polygate/transport/",),
        "polygate call, round, attempt, stream": ("/polygate/",),
        "trio": ("/trio/",),
        "httpx": ("/httpx/",),
        "json": ("json/", "<method 'decode' of", "raw_decode"),
        "socket syscalls": ("<method 'recv", "<method 'send", "epoll", "<method 'poll'"),
        "the benchmark": ("streams.py",),
    }
    stats = pstats.Stats(prof)
    total = 0.0
    grouped = dict.fromkeys([*groups, "other"], 0.0)
    top: list[tuple[float, str]] = []
    for (file, line, func), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        total += tt
        where = f"{file}:{line}({func})"
        top.append((tt, f"{where} x{nc}"))
        for name, needles in groups.items():
            if any(s in where for s in needles):
                grouped[name] += tt
                break
        else:
            grouped["other"] += tt
    top.sort(reverse=True)
    return {"total_s": total,
            "share_pct": {k: round(100 * v / total, 1) for k, v in
                          sorted(grouped.items(), key=lambda kv: -kv[1]) if v},
            "top": [f"{t:7.3f} s  {w.replace(str(Path(sys.prefix)), '<venv>')}" for t, w in top[:25]]}


# ------------------------------------------------------------------------ the parent


def run_worker(client: str, url: str, job: dict[str, Any], limit_s: float = 900) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE), "--worker", client, "--url", url, "--job", json.dumps(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=HERE.parent)
    try:
        out, _ = proc.communicate(timeout=limit_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{client} worker failed with status {proc.returncode}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def _median_tree(trees: list[Any]) -> Any:
    first = trees[0]
    if isinstance(first, dict):
        return {k: _median_tree([t[k] for t in trees if k in t]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return median([float(t) for t in trees])
    return first


def ratios(run: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Within one repeat: every client's figures over the floor's and aiohttp's."""
    out: dict[str, Any] = {}
    for workload, by_client in run.items():
        out[workload] = {}
        for client, figures in by_client.items():
            per: dict[str, float] = {}
            for base in ("floor", "aiohttp"):
                if base not in by_client or client == base:
                    continue
                for key, value in figures.items():
                    b = by_client[base].get(key)
                    if isinstance(value, (int, float)) and isinstance(b, (int, float)) and b:
                        per[f"{key}/{base}"] = value / b
            out[workload][client] = per
    return out


def targets(rat: dict[str, Any], levels: list[int]) -> dict[str, dict[str, Any]]:
    checks: dict[str, tuple[float, str, float]] = {}

    def get(workload: str, key: str) -> float | None:
        value = rat.get(workload, {}).get("polygate", {}).get(key)
        return None if value is None else float(value)

    for level in levels:
        if level in (200, 1000):
            value = get(f"c{level}", "delay_p99_ms/floor")
            if value is not None:
                checks[f"c{level}: token delay p99 <= 2x the floor"] = (value, "<=", 2.0)
    for level in levels:
        value = get(f"c{level}", "cpu_per_chunk_us/aiohttp")
        if value is not None:
            checks[f"c{level}: CPU per chunk <= aiohttp's"] = (value, "<=", 1.0)
        value = get(f"c{level}", "cpu_per_chunk_us/floor")
        if value is not None:
            checks[f"c{level}: CPU per chunk <= 1.2x the floor"] = (value, "<=", 1.2)
    value = get("sequential", "first_chunk_median_us/floor")
    if value is not None:
        checks["sequential: first chunk <= 2x the floor"] = (value, "<=", 2.0)
    out = {}
    for name, (value, op, bound) in checks.items():
        met = value <= bound if op == "<=" else value >= bound
        out[name] = {"value": value, "bound": f"{op} {bound}", "met": bool(met)}
    return out


def report(med: dict[str, Any], rat: dict[str, Any], checks: dict[str, Any], lags: dict[str, Any]) -> None:
    clients = list(next(iter(med.values())))
    rows = [("cpu_per_chunk_us", "CPU µs/chunk", 1), ("core_share", "core share", 2),
            ("delay_p50_ms", "delay p50 ms", 2), ("delay_p99_ms", "delay p99 ms", 2),
            ("delay_max_ms", "delay max ms", 1), ("rss_per_stream_kb", "RSS KB/stream", 1)]
    print(f"\n{'':<28}" + "".join(f"{c:>12}" for c in clients))
    for workload, by_client in med.items():
        if workload == "sequential":
            continue
        lag = lags.get(workload, {})
        print(f"{workload} (upstream step lag p99 {lag.get('lag_p99_ms', math.nan):.1f} ms)")
        for key, label, digits in rows:
            print(f"  {label:<26}" + "".join(f"{by_client[c][key]:>12.{digits}f}" for c in clients))
    if "sequential" in med:
        print(f"sequential ({SEQ_CHUNKS} chunks, no pacing)")
        for key, label in (("stream_median_us", "per stream µs"), ("first_chunk_median_us", "first chunk µs"),
                           ("cpu_per_chunk_us", "CPU µs/chunk")):
            print(f"  {label:<26}" + "".join(f"{med['sequential'][c][key]:>12.0f}" for c in clients))
    print("\npolygate / floor, polygate / aiohttp (medians of the per-repeat ratios)")
    for workload, by_client in rat.items():
        pg = by_client.get("polygate", {})
        keys = (("cpu_per_chunk_us", "delay_p99_ms", "rss_per_stream_kb") if workload != "sequential"
                else ("stream_median_us", "first_chunk_median_us", "cpu_per_chunk_us"))
        print(f"  {workload:<11}" + "  ".join(
            f"{k} {pg.get(k + '/floor', math.nan):.2f} / {pg.get(k + '/aiohttp', math.nan):.2f}" for k in keys))
    print("\ntargets")
    for name, check in checks.items():
        print(f"  {'met ' if check['met'] else 'MISS'} {name:<44} {check['value']:.2f} ({check['bound']})")


def run_churn(clients: list[str], url: str, job: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Every client through the same churn, rotated between repeats; a table of the
    medians, and each client's RSS curve."""
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        order = clients[repeat % len(clients):] + clients[:repeat % len(clients)]
        run = {}
        for client in order:
            run[client] = run_worker(client, url, job, limit_s=3600)
            print(f"repeat {repeat + 1}: churn {client} done", file=sys.stderr, flush=True)
        runs.append({c: run[c] for c in clients})
    med = {c: _median_tree([{k: v for k, v in r[c].items() if k != "samples"} for r in runs]) for c in clients}
    print(f"\nchurn: {job['streams']:,} streams of {job['chunks']} chunks, {job['concurrency']} at a time, "
          f"one process each (medians of {repeats})")
    rows = [("streams_per_s", "streams/s", 0), ("cpu_per_stream_us", "CPU µs/stream", 0),
            ("rss_per_stream_kb_at_10pct", "RSS KB/stream at 10 %", 1),
            ("rss_per_stream_kb_at_end", "RSS KB/stream at end", 1),
            ("rss_end_over_10pct", "RSS end / at 10 %", 3),
            ("rss_growth_kb_per_10k_streams", "RSS growth KB/10k str", 1),
            ("objects_end_over_10pct", "objects end / at 10 %", 3),
            ("cycle_garbage_per_stream", "cycle garbage obj/stream", 1)]
    print(f"  {'':<26}" + "".join(f"{c:>12}" for c in clients))
    for key, label, digits in rows:
        print(f"  {label:<26}" + "".join(f"{med[c][key]:>12.{digits}f}" for c in clients))
    for client in clients:
        samples = runs[-1][client]["samples"]
        print(f"  {client} (last repeat), streams: RSS KB over the baseline / live objects over it")
        print("    " + "  ".join(f"{int(x['streams']):,}: {x['rss_kb']:.0f}/{int(x['objects'])}"
                                  for x in samples))
        after = runs[-1][client]["after_idle_collected"]
        print(f"    idle and collected at the end: {after['rss_kb']:.0f} KB / {after['objects']} objects")
    return {"median": med, "runs": runs}


def plot(results: Path, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    med = data["median"]
    levels = [int(w[1:]) for w in med if w.startswith("c")]
    clients = list(med[f"c{levels[0]}"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for client in clients:
        for ax, key in zip(axes, ("delay_p99_ms", "cpu_per_chunk_us"), strict=True):
            ax.plot(levels, [med[f"c{lv}"][client][key] for lv in levels], marker="o", label=client)
    axes[0].set_ylabel("token delay p99, ms")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("client CPU per chunk, µs")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_xlabel("concurrent streams of 50 tokens/s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"one paced upstream, each client in its own process (medians of {data['repeats']} repeats)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--seq-streams", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", help="results file name (default: streams, streams-quick)")
    parser.add_argument("--profile", type=int, metavar="N", help="polygate at cN under cProfile")
    parser.add_argument("--plot", metavar="PNG", help="draw the figure from the results and exit")
    parser.add_argument("--churn", type=int, nargs="?", const=100_000, metavar="N",
                        help="only the churn: N short streams (default 100,000) through one process "
                             "per client, RSS sampled every 5 %% of the way")
    parser.add_argument("--churn-concurrency", type=int, default=200)
    parser.add_argument("--churn-chunks", type=int, default=10)
    parser.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        upstream_main(args.gap)
        return
    if args.worker:
        worker_main(args.worker, args.url, json.loads(args.job))
        return
    if args.plot:
        plot(RESULTS / f"{args.name or 'streams'}.json", args.plot)
        return
    if args.quick:
        args.levels, args.chunks, args.rounds, args.seq_streams, args.repeats = "20,50", 20, 3, 20, 1
        args.churn, args.churn_concurrency = min(args.churn or 1_000, 1_000), 50
    levels = [int(x) for x in args.levels.split(",") if x]
    clients = [c for c in args.clients.split(",") if c]
    upstream = Upstream(args.gap)
    try:
        if args.profile:
            job = {"kind": "paced", "concurrency": args.profile, "rounds": args.rounds,
                   "chunks": args.chunks, "profile": True}
            result = run_worker("polygate", upstream.url, job)
            prof = result.pop("profile")
            print(json.dumps(result, indent=1))
            print(f"\n{prof['total_s']:.2f} s profiled")
            for k, v in prof["share_pct"].items():
                print(f"  {v:5.1f} %  {k}")
            print("\n".join(prof["top"]))
            write_result("streams-profile", {"machine": machine(), "job": job, **result, "profile": prof})
            return
        churned: dict[str, Any] = {}
        if args.churn:
            job = {"kind": "churn", "streams": args.churn, "concurrency": args.churn_concurrency,
                   "chunks": args.churn_chunks}
            churned = run_churn(clients, upstream.url, job, args.repeats)
            if not args.quick:
                path = write_result(args.name or "streams-churn",
                                    {"machine": machine(), "args": vars(args), "job": job, **churned})
                print(f"\nresults: {path}")
                return
        runs: list[dict[str, dict[str, Any]]] = []
        lags: dict[str, Any] = {}
        for repeat in range(args.repeats):
            order = clients[repeat % len(clients):] + clients[:repeat % len(clients)]
            run: dict[str, dict[str, Any]] = {}
            for level in levels:
                workload = f"c{level}"
                run[workload] = {}
                upstream.lags()
                for client in order:
                    job = {"kind": "paced", "concurrency": level, "rounds": args.rounds,
                           "chunks": args.chunks}
                    run[workload][client] = run_worker(client, upstream.url, job)
                    print(f"repeat {repeat + 1}: {workload} {client} done", file=sys.stderr, flush=True)
                lags.setdefault(workload, []).append(upstream.lags())
            run["sequential"] = {}
            for client in order:
                job = {"kind": "sequential", "streams": args.seq_streams}
                run["sequential"][client] = run_worker(client, upstream.url, job)
            print(f"repeat {repeat + 1}: sequential done", file=sys.stderr, flush=True)
            runs.append({w: {c: r[c] for c in clients} for w, r in run.items()})
    finally:
        upstream.close()
    med = _median_tree(runs)
    rat = _median_tree([ratios(r) for r in runs])
    lag_med = {w: _median_tree(v) for w, v in lags.items()}
    checks = targets(rat, levels)
    report(med, rat, checks, lag_med)
    payload = {"machine": machine(), "args": vars(args), "repeats": args.repeats, "median": med,
               "ratios": rat, "upstream_lag": lag_med, "targets": checks, "runs": runs, "churn": churned}
    path = write_result(args.name or ("streams-quick" if args.quick else "streams"), payload)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
