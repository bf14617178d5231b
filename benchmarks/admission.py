"""Admission + settle round trip on the memory backend, against one raw httpx call.

The round trip is what every attempt pays: picking (weights × health), the atomic
admit (cooldown, breaker, RPM/TPM windows, permit) and the settle (quota correction,
permit, breaker, health).  It is reported as a fraction of one raw httpx call to the
loopback FakeUpstream measured in the same run (target: ≤ 3 %).

    python benchmarks/admission.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import httpx
import trio

import polygate
from polygate._errors import Outcome
from polygate.governance import Governor, MemoryBackend

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
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
