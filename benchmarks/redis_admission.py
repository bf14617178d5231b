"""The Redis governance backend's cost: admission round trips, and calls/s at concurrency.

A ``redis-server`` (started here, loopback, no persistence) and a FakeUpstream server
(zero delays, :func:`_common.fake_server`) run in their own processes.

* **Admission + settle round trip**: ``admit`` then ``settle`` on one source, one after
  the other, through the Redis backend — µs per pair, p50 and p99 (the memory backend
  alongside for scale).
* **Throughput at concurrency 64**: non-streamed chat calls through polygate with the
  Redis backend, polygate with the memory backend, and raw httpx, in alternating blocks
  so machine noise hits all three alike.  polygate runs with admission configured
  (RPM/TPM/in-flight limits that never bind) and hedging configured but not triggering,
  so every call pays admit, settle and the hedge-budget refill.

    python benchmarks/redis_admission.py            # full counts
    python benchmarks/redis_admission.py --quick    # tiny counts, seconds

Target: Redis-backed polygate >= 0.7x raw httpx calls/s at concurrency 64.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import trio

import polygate
from polygate.governance import AdmitRequest, Feedback, SettleRequest, SourceLimits
from polygate.governance._redis import RedisBackend, parse_redis_url

from _common import fake_server, machine, median, quantile, timed_concurrent, write_result

MESSAGES = [{"role": "user", "content": "Say hello."}]


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A loopback redis-server without persistence; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="polygate-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def settings_for(url: str, backend: str) -> polygate.Settings:
    source = polygate.Source(
        name="a", base_url=url, api_key="sk-bench", model="m", streaming=False,
        rpm=10_000_000, tpm=10_000_000_000, max_in_flight=100_000, timeout_s=60,
    )
    other = polygate.Source(name="b", base_url=url, api_key="sk-bench", model="m",
                            streaming=False, weight=1e-9, timeout_s=60)
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source, other], hedge=polygate.Hedge(after_s=30),
                                       call_deadline_s=50)},
        backend=backend,
    )


async def round_trips(backend: Any, n: int) -> list[float]:
    request = AdmitRequest("chat", "a", SourceLimits(10_000_000, 10_000_000_000, 100_000), 20)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        admission = await backend.admit(request)
        await backend.settle(SettleRequest(admission, 25, Feedback.SUCCESS))
        times.append(time.perf_counter() - t0)
    return times


async def run(args: argparse.Namespace, url: str, redis_url: str) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": machine(), "counts": vars(args)}

    backend = RedisBackend(parse_redis_url(f"{redis_url}?prefix=bench-rt"))
    await backend.start()
    try:
        await round_trips(backend, 50)  # warm-up: connection, scripts
        redis_rt = await round_trips(backend, args.round_trips)
    finally:
        await backend.aclose()
    memory_rt = await round_trips(polygate.governance.MemoryBackend(), args.round_trips)
    result["admit_settle_round_trip"] = {
        "redis_p50_us": quantile(redis_rt, 0.5) * 1e6, "redis_p99_us": quantile(redis_rt, 0.99) * 1e6,
        "memory_p50_us": quantile(memory_rt, 0.5) * 1e6, "memory_p99_us": quantile(memory_rt, 0.99) * 1e6,
    }

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    headers = {"authorization": "Bearer sk-bench", "content-type": "application/json"}
    async with httpx.AsyncClient(limits=limits, timeout=60) as raw, \
            polygate.session(settings_for(url, "memory")) as pg_memory, \
            polygate.session(settings_for(url, f"{redis_url}?prefix=bench-{os.getpid()}")) as pg_redis:

        async def raw_call() -> None:
            r = await raw.post(url + "/chat/completions", content=body, headers=headers)
            r.raise_for_status()
            assert r.json()["choices"][0]["message"]["content"]

        async def memory_call() -> None:
            assert (await pg_memory.chat(MESSAGES)).text

        async def redis_call() -> None:
            assert (await pg_redis.chat(MESSAGES)).text

        calls = {"raw": raw_call, "memory": memory_call, "redis": redis_call}
        for call in calls.values():  # warm-up: connections, scripts, caches
            await timed_concurrent(call, 200, args.concurrency)
        per_block = args.concurrent // args.blocks
        throughput: dict[str, list[float]] = {name: [] for name in calls}
        for block in range(args.blocks):
            order = list(calls.items())
            order = order[block % 3:] + order[: block % 3]  # rotate who goes first
            for name, call in order:
                seconds = await timed_concurrent(call, per_block, args.concurrency)
                throughput[name].append(per_block / seconds)
            print(".", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        stats = await pg_redis.statistics()
        assert all(s.state.in_flight == 0 for s in stats.governance.sources)

    raw_s, mem_s, redis_s = (median(throughput[k]) for k in ("raw", "memory", "redis"))
    result[f"concurrency_{args.concurrency}"] = {
        "raw_calls_per_s": raw_s, "memory_calls_per_s": mem_s, "redis_calls_per_s": redis_s,
        "redis_vs_raw": redis_s / raw_s, "memory_vs_raw": mem_s / raw_s, "redis_vs_memory": redis_s / mem_s,
    }
    return result


def report(result: dict[str, Any], c: int) -> None:
    rt, cc = result["admit_settle_round_trip"], result[f"concurrency_{c}"]
    print(f"{'admit + settle round trip':<34}{'p50 µs':>10}{'p99 µs':>10}")
    print(f"{'  redis (loopback)':<34}{rt['redis_p50_us']:>10.0f}{rt['redis_p99_us']:>10.0f}")
    print(f"{'  memory':<34}{rt['memory_p50_us']:>10.1f}{rt['memory_p99_us']:>10.1f}")
    print(f"\n{f'concurrency {c}':<34}{'calls/s':>10}{'vs raw':>10}{'target':>10}")
    print(f"{'  raw httpx':<34}{cc['raw_calls_per_s']:>10.0f}{1.0:>10.2f}")
    print(f"{'  polygate, memory backend':<34}{cc['memory_calls_per_s']:>10.0f}{cc['memory_vs_raw']:>10.2f}")
    print(f"{'  polygate, redis backend':<34}{cc['redis_calls_per_s']:>10.0f}"
          f"{cc['redis_vs_raw']:>10.2f}{'>= 0.70':>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--concurrent", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=10)
    args = parser.parse_args()
    if args.quick:
        args.round_trips, args.concurrent, args.blocks = 200, 600, 2
    with fake_server({"tokens": 8}) as url, redis_server() as redis_url:
        result = trio.run(run, args, url, redis_url)
    report(result, args.concurrency)
    path = write_result("redis_admission-quick" if args.quick else "redis_admission", result)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
