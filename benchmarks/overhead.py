"""polygate's own cost against raw httpx on the same loopback server.

The FakeUpstream server runs in its own process with zero delays.  Both clients run
under trio in this process, in alternating blocks so machine noise hits both alike:

* sequential non-streamed calls (polygate: a ``streaming=False`` source, so both send
  the same plain JSON request) — per-call time;
* the same at concurrency 64 — throughput;
* streams of 200 chunks (polygate: ``stream_chat``; raw: httpx + httpx-sse + json) —
  per-stream time;
* polygate's default ``chat()`` (which streams internally to time the first token)
  against a raw streamed request, for information.

polygate runs with admission configured (RPM/TPM/in-flight limits that never bind)
and hedging configured but not triggering, so their bookkeeping is in the figures.

    python benchmarks/overhead.py            # full counts
    python benchmarks/overhead.py --quick    # tiny counts, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio
from httpx_sse import EventSource

import polygate

from _common import fake_server, machine, median, quantile, write_result

MESSAGES = [{"role": "user", "content": "Say hello."}]


def settings_for(url: str, *, streaming: bool) -> polygate.Settings:
    source = polygate.Source(
        name="a", base_url=url, api_key="sk-bench", model="m", streaming=streaming,
        rpm=10_000_000, tpm=10_000_000_000, max_in_flight=100_000, timeout_s=60,
    )
    other = polygate.Source(name="b", base_url=url, api_key="sk-bench", model="m",
                            streaming=streaming, weight=1e-9, timeout_s=60)
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[source, other], hedge=polygate.Hedge(after_s=30), call_deadline_s=50)})


Call = Callable[[], Awaitable[Any]]


async def timed_sequential(call: Call, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t0)
    return times


async def timed_concurrent(call: Call, n: int, concurrency: int) -> float:
    """Wall seconds for n calls with ``concurrency`` workers."""
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - t0


async def run(args: argparse.Namespace, json_url: str, stream_url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    stream_body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True,
                              "stream_options": {"include_usage": True}}).encode()
    headers = {"authorization": "Bearer sk-bench", "content-type": "application/json"}

    async with httpx.AsyncClient(limits=limits, timeout=60) as raw, \
            polygate.session(settings_for(json_url, streaming=False)) as pg_json, \
            polygate.session(settings_for(stream_url, streaming=True)) as pg_stream, \
            polygate.session(settings_for(json_url, streaming=True)) as pg_default:

        async def raw_json() -> None:
            r = await raw.post(json_url + "/chat/completions", content=body, headers=headers)
            r.raise_for_status()
            assert r.json()["choices"][0]["message"]["content"]

        async def raw_stream(url: str = stream_url) -> int:
            n = 0
            async with raw.stream("POST", url + "/chat/completions", content=stream_body,
                                  headers=headers) as r:
                async for event in EventSource(r).aiter_sse():
                    if event.data == "[DONE]":
                        break
                    json.loads(event.data)
                    n += 1
            return n

        async def pg_call() -> None:
            r = await pg_json.chat(MESSAGES)
            assert r.text

        async def pg_streamed() -> int:
            n = 0
            async with pg_stream.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    n += 1
            return n

        async def pg_default_chat() -> None:
            assert (await pg_default.chat(MESSAGES)).text

        async def raw_default() -> None:
            await raw_stream(json_url)

        # warm-up: connections, caches
        for call in (raw_json, pg_call, raw_default, pg_default_chat):
            for _ in range(20):
                await call()
        await raw_stream()
        await pg_streamed()

        blocks = args.blocks
        seq: dict[str, list[float]] = {"raw": [], "polygate": []}
        conc: dict[str, list[float]] = {"raw": [], "polygate": []}
        streams: dict[str, list[float]] = {"raw": [], "polygate": []}
        default: dict[str, list[float]] = {"raw": [], "polygate": []}
        for block in range(blocks):
            order = [("raw", raw_json, raw_default, raw_stream),
                     ("polygate", pg_call, pg_default_chat, pg_streamed)]
            if block % 2:
                order.reverse()
            for name, one, dflt, strm in order:
                seq[name] += await timed_sequential(one, args.sequential // blocks)
                conc[name].append(await timed_concurrent(one, args.concurrent // blocks, args.concurrency))
                streams[name] += await timed_sequential(strm, max(1, args.streams // blocks))
                default[name] += await timed_sequential(dflt, args.sequential // blocks // 2)
                print(".", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)

    per_block = args.concurrent // blocks
    result: dict[str, Any] = {"machine": machine(), "counts": vars(args)}
    for label, data in (("sequential", seq), ("streams_200_chunks", streams), ("default_chat", default)):
        r, p = median(data["raw"]), median(data["polygate"])
        result[label] = {
            "raw_median_us": r * 1e6, "polygate_median_us": p * 1e6,
            "raw_p99_us": quantile(data["raw"], 0.99) * 1e6,
            "polygate_p99_us": quantile(data["polygate"], 0.99) * 1e6,
            "ratio": p / r,
        }
    thr_raw = [per_block / t for t in conc["raw"]]
    thr_pg = [per_block / t for t in conc["polygate"]]
    result[f"concurrency_{args.concurrency}"] = {
        "raw_calls_per_s": median(thr_raw), "polygate_calls_per_s": median(thr_pg),
        "ratio": median(thr_pg) / median(thr_raw),
    }
    return result


def report(result: dict[str, Any], c: int) -> None:
    s, st, d = result["sequential"], result["streams_200_chunks"], result["default_chat"]
    cc = result[f"concurrency_{c}"]
    print(f"{'workload':<38}{'raw httpx':>14}{'polygate':>14}{'ratio':>9}{'target':>10}")
    print(f"{'sequential JSON call, median µs':<38}{s['raw_median_us']:>14.0f}"
          f"{s['polygate_median_us']:>14.0f}{s['ratio']:>9.2f}{'<= 1.15':>10}")
    print(f"{f'concurrency {c}, calls/s':<38}{cc['raw_calls_per_s']:>14.0f}"
          f"{cc['polygate_calls_per_s']:>14.0f}{cc['ratio']:>9.2f}{'>= 0.85':>10}")
    print(f"{'200-chunk stream, median µs':<38}{st['raw_median_us']:>14.0f}"
          f"{st['polygate_median_us']:>14.0f}{st['ratio']:>9.2f}{'<= 1.20':>10}")
    print(f"{'chat() streamed internally, median µs':<38}{d['raw_median_us']:>14.0f}"
          f"{d['polygate_median_us']:>14.0f}{d['ratio']:>9.2f}{'(info)':>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sequential", type=int, default=2000)
    parser.add_argument("--concurrent", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=10)
    args = parser.parse_args()
    if args.quick:
        args.sequential, args.concurrent, args.streams, args.blocks = 100, 320, 10, 2
    with fake_server({"tokens": 8}) as json_url, fake_server({"tokens": 200}) as stream_url:
        result = trio.run(run, args, json_url, stream_url)
    report(result, args.concurrency)
    path = write_result("overhead-quick" if args.quick else "overhead", result)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
