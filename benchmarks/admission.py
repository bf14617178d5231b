"""Admission + settle round trip on the memory backend, against one raw httpx call.

The round trip is what every attempt pays: picking (weights × health), the atomic
admit (cooldown, breaker, RPM/TPM windows, permit) and the settle (quota correction,
permit, breaker, health).  It is reported as a fraction of one raw httpx call to the
loopback FakeUpstream measured in the same run (target: ≤ 3 %).

With ``--waiters``: what waiting costs.  Calls far beyond a source's ``max_in_flight``
wait in line; the CPU a call costs should not grow with how many wait with it (it did
when every settle woke every waiting call).  In virtual time (``MockClock``, the
in-process fake upstream), 2,000 calls a run on four permits, as 40 batches of 50
concurrent calls, ..., one batch of 2,000: the ratio of the CPU a call took in the
largest batch to the smallest is the figure.

    python benchmarks/admission.py [--quick] [--waiters]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import httpx
import trio
import trio.testing

import polygate
from polygate._errors import Outcome
from polygate.governance import Governor, MemoryBackend
from polygate.testing import FakeUpstream, Reply, Router

from _common import fake_server, machine, median, quantile, write_result


def settings() -> polygate.Settings:
    sources = [
        polygate.Source(name=n, base_url="http://127.0.0.1:1/v1", rpm=10_000_000, tpm=10**12,
                        max_in_flight=100_000)
        for n in ("a", "b", "c")
    ]
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=sources)})


async def round_trips(n: int) -> list[float]:
    governor = Governor(settings(), MemoryBackend(), rng=random.Random(1))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        admission = await governor.acquire("chat", 300)
        await governor.release(admission, Outcome.OK, usage_tokens=250, latency_s=0.5)
        times.append(time.perf_counter() - t0)
    return times


async def raw_calls(url: str, n: int) -> list[float]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    times = []
    async with httpx.AsyncClient() as client:
        for _ in range(n):
            t0 = time.perf_counter()
            r = await client.post(url + "/chat/completions", content=body,
                                  headers={"content-type": "application/json"})
            r.json()
            times.append(time.perf_counter() - t0)
    return times


async def waiting_calls(total: int, together: int) -> float:
    """CPU seconds a call, ``total`` calls in batches of ``together`` on 4 permits."""
    scope = polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1", max_in_flight=4)])
    upstream = FakeUpstream(Reply(first_token_s=0.01, tokens=3))
    messages = [{"role": "user", "content": "hi"}]
    async with polygate.session(polygate.Settings(scopes={"chat": scope}),
                                transport=Router({"a": upstream})) as s:
        t0 = time.process_time()
        for _ in range(total // together):
            async with trio.open_nursery() as nursery:
                for _ in range(together):
                    nursery.start_soon(s.chat, messages)
        return (time.process_time() - t0) / total


def waiters(quick: bool) -> None:
    total = 400 if quick else 2000
    sizes = [50, 200] if quick else [50, 200, 1000, 2000]
    per_call = {}
    for together in sizes:
        clock = trio.testing.MockClock(autojump_threshold=0)
        per_call[together] = trio.run(waiting_calls, total, together, clock=clock)
        print(f"{together:5d} calls waiting together: {per_call[together] * 1e6:7.1f} µs of CPU a call")
    ratio = per_call[sizes[-1]] / per_call[sizes[0]]
    print(f"ratio {sizes[-1]} to {sizes[0]}: {ratio:.2f} (flat: ~1)")
    result = {"machine": machine(), "cpu_us_per_call": {str(k): v * 1e6 for k, v in per_call.items()},
              "ratio": ratio}
    print(f"results: {write_result('admission-waiters-quick' if quick else 'admission-waiters', result)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--waiters", action="store_true", help="what waiting in line costs")
    args = parser.parse_args()
    if args.waiters:
        waiters(args.quick)
        return
    n = 2000 if args.quick else 20_000
    with fake_server({"tokens": 8}) as url:
        trio.run(raw_calls, url, 50)  # warm-up
        adm, raw = [], []
        for _ in range(5):  # interleaved blocks
            adm += trio.run(round_trips, n // 5)
            raw += trio.run(raw_calls, url, max(50, n // 50))
    a, r = median(adm), median(raw)
    result = {
        "machine": machine(),
        "admission_settle_p50_us": a * 1e6, "admission_settle_p99_us": quantile(adm, 0.99) * 1e6,
        "raw_httpx_call_p50_us": r * 1e6, "fraction_of_raw_call": a / r,
    }
    print(f"admission + settle round trip: p50 {a * 1e6:.1f} µs, p99 {quantile(adm, 0.99) * 1e6:.1f} µs")
    print(f"one raw httpx loopback call:   p50 {r * 1e6:.0f} µs")
    print(f"fraction: {100 * a / r:.1f} % (target <= 3 %)")
    print(f"results: {write_result('admission-quick' if args.quick else 'admission', result)}")


if __name__ == "__main__":
    main()
