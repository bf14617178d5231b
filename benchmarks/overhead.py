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

polygate runs twice: on httpx's own transport (``transport=httpx.AsyncHTTPTransport()``,
the like-for-like comparison the targets are about) and on its default transport
(``LeanTransport``, what users get).

polygate runs with admission configured (RPM/TPM/in-flight limits that never bind)
and hedging configured but not triggering, so their bookkeeping is in the figures.

    python benchmarks/overhead.py            # full counts
    python benchmarks/overhead.py --quick    # tiny counts, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import trio
from httpx_sse import EventSource

import polygate

from _common import (
    fake_server,
    machine,
    median,
    quantile,
    timed_concurrent,
    timed_sequential,
    write_result,
)

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
CLIENTS = ("raw", "polygate/httpx", "polygate")


async def run(args: argparse.Namespace, json_url: str, stream_url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    stream_body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True,
                              "stream_options": {"include_usage": True}}).encode()
    headers = {"authorization": "Bearer sk-bench", "content-type": "application/json"}

    async with AsyncExitStack() as stack:
        raw = await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=60))

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

        async def raw_default() -> None:
            await raw_stream(json_url)

        workloads: dict[str, tuple[Call, Call, Call]] = {"raw": (raw_json, raw_default, raw_stream)}
        for name in CLIENTS[1:]:
            def transport(name: str = name) -> httpx.AsyncBaseTransport | None:
                # polygate on httpx's own transport: the like-for-like comparison;
                # polygate on its default transport: what users get.
                return httpx.AsyncHTTPTransport(limits=limits) if name == "polygate/httpx" else None

            pg_json = await stack.enter_async_context(
                polygate.session(settings_for(json_url, streaming=False), transport=transport()))
            pg_stream = await stack.enter_async_context(
                polygate.session(settings_for(stream_url, streaming=True), transport=transport()))
            pg_default = await stack.enter_async_context(
                polygate.session(settings_for(json_url, streaming=True), transport=transport()))

            async def pg_call(s: polygate.Session = pg_json) -> None:
                assert (await s.chat(MESSAGES)).text

            async def pg_default_chat(s: polygate.Session = pg_default) -> None:
                assert (await s.chat(MESSAGES)).text

            async def pg_streamed(s: polygate.Session = pg_stream) -> int:
                n = 0
                async with s.stream_chat(MESSAGES) as stream:
                    async for _ in stream:
                        n += 1
                return n

            workloads[name] = (pg_call, pg_default_chat, pg_streamed)

        for one, dflt, strm in workloads.values():  # warm-up: connections, caches
            for _ in range(20):
                await one()
                await dflt()
            await strm()

        blocks = args.blocks
        seq: dict[str, list[float]] = {c: [] for c in CLIENTS}
        conc: dict[str, list[float]] = {c: [] for c in CLIENTS}
        streams: dict[str, list[float]] = {c: [] for c in CLIENTS}
        default: dict[str, list[float]] = {c: [] for c in CLIENTS}
        for block in range(blocks):
            order = list(CLIENTS)
            if block % 2:
                order.reverse()  # alternate, so drift hits every client alike
            for name in order:
                one, dflt, strm = workloads[name]
                seq[name] += await timed_sequential(one, args.sequential // blocks)
                conc[name].append(await timed_concurrent(one, args.concurrent // blocks, args.concurrency))
                streams[name] += await timed_sequential(strm, max(1, args.streams // blocks))
                default[name] += await timed_sequential(dflt, args.sequential // blocks // 2)
                print(".", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)

    per_block = args.concurrent // blocks
    result: dict[str, Any] = {"machine": machine(), "counts": vars(args)}
    for label, data in (("sequential", seq), ("streams_200_chunks", streams), ("default_chat", default)):
        r = median(data["raw"])
        result[label] = {
            name: {"median_us": median(data[name]) * 1e6,
                   "p99_us": quantile(data[name], 0.99) * 1e6,
                   "ratio_to_raw": median(data[name]) / r}
            for name in CLIENTS
        }
    raw_thr = median([per_block / t for t in conc["raw"]])
    result[f"concurrency_{args.concurrency}"] = {
        name: {"calls_per_s": median([per_block / t for t in conc[name]]),
               "ratio_to_raw": median([per_block / t for t in conc[name]]) / raw_thr}
        for name in CLIENTS
    }
    return result


def report(result: dict[str, Any], c: int) -> None:
    rows = [
        ("sequential JSON call, median µs", result["sequential"], "median_us", "<= 1.15"),
        (f"concurrency {c}, calls/s", result[f"concurrency_{c}"], "calls_per_s", ">= 0.85"),
        ("200-chunk stream, median µs", result["streams_200_chunks"], "median_us", "<= 1.20"),
        ("chat() streamed internally, µs", result["default_chat"], "median_us", "(info)"),
    ]
    print(f"{'workload':<34}" + "".join(f"{c:>16}" for c in CLIENTS)
          + f"{'ratio /httpx':>14}{'ratio':>8}{'target*':>9}")
    for title, data, key, target in rows:
        print(f"{title:<34}" + "".join(f"{data[c][key]:>16.0f}" for c in CLIENTS)
              + f"{data['polygate/httpx']['ratio_to_raw']:>14.2f}"
              + f"{data['polygate']['ratio_to_raw']:>8.2f}{target:>9}")
    print("* the targets apply to polygate on httpx's own transport (ratio /httpx)")


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
