"""What a cache hit costs: the whole ``s.chat()`` on a hit, beside an uncached call.

For each backend (memory, SQLite, Redis) one session on the in-process fake upstream
(zero delay) alternates blocks of calls: ``cache=False`` (no cache at all: the
logical call through admission, the attempt and the fake transport) and hits of one
stored answer; for Redis also misses (fresh prompts) beside uncached calls.  Medians
and ratios come from the same run.  Two floors are timed in the same run too, because
on a shared machine they move more than anything else: one trio checkpoint (every
hit takes one), one ``trio.to_thread.run_sync`` of nothing (every SQLite hit takes
one) and one raw Redis ``GET`` round trip.

Round trips to Redis are counted twice: by the backend (requests awaited) and by
Redis itself (``INFO commandstats``: GET and SET calls).  A hit must be one round
trip; a miss at most one more than no cache (its write goes behind, off the call path).

    python benchmarks/cache.py [--quick] [--no-redis]

Targets (issue 11): memory hit ≤ 20 µs p50, SQLite hit ≤ 200 µs p50.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from _common import machine, median, quantile, write_result

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def settings(cache: str) -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1", model="m")
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=3600)}, cache=cache
    )


async def timed(call: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t0)
    return times


async def floors(n: int, redis_url: str | None) -> dict[str, list[float]]:
    out = {
        "checkpoint": await timed(trio.lowlevel.checkpoint, n),
        "to_thread": await timed(lambda: trio.to_thread.run_sync(int), n // 4),
    }
    if redis_url:
        import coredis

        port = int(redis_url.split(":")[2].split("/")[0])
        async with coredis.Redis(host="127.0.0.1", port=port) as client:
            await client.get("warm-up")
            out["redis_get"] = await timed(lambda: client.get("polygate-bench-missing"), n // 4)
    return out


async def measure(cache: str, n: int, blocks: int, *, misses: bool) -> dict[str, Any]:
    up = FakeUpstream(Reply(text="Paris.", tokens=2), history=10)
    samples: dict[str, list[float]] = {"uncached": [], "hit": [], "miss": [], "uncached_fresh": []}
    counter = iter(range(10**9))
    async with polygate.session(settings(cache), transport=Router({"a": up})) as s:
        for _ in range(20):  # warm-up, and store the answer
            await s.chat(MESSAGES)
            await s.chat(MESSAGES, cache=False)
        backend: Any = s._cache.backend  # type: ignore[union-attr]
        trips_before = getattr(backend, "read_round_trips", 0)
        hits_before = (await s.statistics()).cache.hits
        for _ in range(blocks):
            samples["uncached"] += await timed(lambda: s.chat(MESSAGES, cache=False), n // blocks)
            samples["hit"] += await timed(lambda: s.chat(MESSAGES), n // blocks)
        hit_trips = (getattr(backend, "read_round_trips", 0) - trips_before) / max(1, len(samples["hit"]))
        assert (await s.statistics()).cache.hits - hits_before == len(samples["hit"])
        if misses:
            m = max(20, n // 10)
            for _ in range(blocks):
                samples["uncached_fresh"] += await timed(
                    lambda: s.chat([{"role": "user", "content": f"q{next(counter)}"}], cache=False),
                    m // blocks)
                before = backend.read_round_trips
                samples["miss"] += await timed(
                    lambda: s.chat([{"role": "user", "content": f"q{next(counter)}"}]), m // blocks)
                miss_trips = (backend.read_round_trips - before) / (m // blocks)
            samples["miss_trips"] = [miss_trips]
        stats = (await s.statistics()).cache
    samples["hit_trips"] = [hit_trips]
    return {"samples": samples, "stats": stats}


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests._redis_server import running_redis

    with running_redis(binary) as server:
        yield f"{server.url}?prefix=bench"


async def commandstats(url: str) -> dict[str, int]:
    import coredis

    port = int(url.split(":")[2].split("/")[0])
    async with coredis.Redis(host="127.0.0.1", port=port) as client:
        info = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_")}


def us(values: list[float]) -> float:
    return median(values) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-redis", action="store_true")
    args = parser.parse_args()
    n, blocks = (400, 4) if args.quick else (10_000, 10)
    result: dict[str, Any] = {"machine": machine(), "calls_per_kind": n}
    with tempfile.TemporaryDirectory() as tmp, (
        contextlib.nullcontext(None) if args.no_redis else redis_server()
    ) as redis_url:
        fl = trio.run(floors, n, redis_url)
        result["floors_p50_us"] = {k: us(v) for k, v in fl.items()}
        print("floors (p50): " + ", ".join(f"{k} {us(v):.1f} µs" for k, v in fl.items()))
        backends = [("memory", "memory"), ("sqlite", f"sqlite://{tmp}/cache.db")]
        if redis_url:
            backends.append(("redis", redis_url))
        for name, url in backends:
            before = trio.run(commandstats, redis_url) if name == "redis" and redis_url else None
            run = trio.run(lambda url=url, name=name: measure(url, n, blocks, misses=name == "redis"))
            s = run["samples"]
            row: dict[str, Any] = {
                "uncached_p50_us": us(s["uncached"]), "hit_p50_us": us(s["hit"]),
                "hit_p99_us": quantile(s["hit"], 0.99) * 1e6,
                "hit_over_uncached": median(s["hit"]) / median(s["uncached"]),
                "hit_round_trips": s["hit_trips"][0],
                "statistics": run["stats"],
            }
            line = (f"{name:>6}: hit p50 {row['hit_p50_us']:.1f} µs (p99 {row['hit_p99_us']:.0f}), "
                    f"uncached p50 {row['uncached_p50_us']:.1f} µs, "
                    f"hit/uncached {row['hit_over_uncached']:.3f}")
            if name == "memory":
                row["hit_in_checkpoints"] = median(s["hit"]) / median(fl["checkpoint"])
                line += f", hit = {row['hit_in_checkpoints']:.1f} checkpoints (target ≤ 20 µs)"
            if name == "sqlite":
                row["hit_minus_thread_hop_us"] = us(s["hit"]) - us(fl["to_thread"])
                line += (f", hit − thread hop {row['hit_minus_thread_hop_us']:.0f} µs "
                         "(target ≤ 200 µs)")
            if name == "redis":
                after = trio.run(commandstats, redis_url)
                assert before is not None
                row.update({
                    "miss_p50_us": us(s["miss"]), "uncached_fresh_p50_us": us(s["uncached_fresh"]),
                    "miss_minus_uncached_us": us(s["miss"]) - us(s["uncached_fresh"]),
                    "redis_get_p50_us": us(fl["redis_get"]),
                    "miss_round_trips_on_call_path": s["miss_trips"][0],
                    "redis_commands": {c: after.get(c, 0) - before.get(c, 0) for c in ("get", "set", "mget")},
                })
                line += (f"; miss p50 {row['miss_p50_us']:.1f} µs vs uncached {row['uncached_fresh_p50_us']:.1f}"
                         f" (+{row['miss_minus_uncached_us']:.0f} µs; one GET is {row['redis_get_p50_us']:.0f} µs)"
                         f"; round trips: hit {row['hit_round_trips']:.2f}, miss "
                         f"{row['miss_round_trips_on_call_path']:.2f} on the call path; "
                         f"Redis saw {row['redis_commands']}")
            print(line)
            result[name] = row
    name = "cache-quick" if args.quick else "cache"
    print(f"results: {write_result(name, result)}")


if __name__ == "__main__":
    main()
