"""Time in Python's cyclic garbage collector while polygate makes calls.

Objects in a reference cycle are freed only by the cyclic collector, whose full passes
stop the event loop; a call that leaves a cycle behind makes them longer and more
frequent.  This runs one kind of call many times at a concurrency, in virtual time
(``MockClock``) on the in-process fake upstream so that only polygate's own work is
timed, and reports the collector's share of the wall time, its longest pass, and the
objects it found to free (zero when every call is freed by reference counting).

Kinds: ``ok`` (plain calls), ``failover`` (every call's first attempt gets a 500 and
the second source answers: a gateway behind a failing source), ``fatal`` (every call
fails with a 400).  Their figures print side by side, with ``ok`` as the baseline.

Usage::

    python benchmarks/gc_pauses.py                     # 10,000 calls of each, 200 at a time
    python benchmarks/gc_pauses.py --calls 2000 --quick
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from _common import write_result

MESSAGES = [{"role": "user", "content": "Say hello."}]
NOBREAK = polygate.Breaker(failures=10**9)


def _kind(name: str) -> tuple[polygate.Settings, Router, Callable[[polygate.Session], Awaitable[Any]]]:
    sources = [polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
               polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)]
    scope = polygate.Scope(sources=sources, breaker=NOBREAK, retry=polygate.Retry(max_attempts=2))
    settings = polygate.Settings(scopes={"chat": scope}, telemetry="off")
    good = FakeUpstream(Reply(tokens=5))
    if name == "ok":
        return settings, Router({"a": good, "b": good}), lambda s: s.chat(MESSAGES)
    if name == "failover":
        return settings, Router({"a": FakeUpstream(Reply(status=500)), "b": good}), \
            lambda s: s.chat(MESSAGES)
    bad = FakeUpstream(Reply(status=400, error_body={"error": {"message": "bad", "code": "x"}}))

    async def failing(s: polygate.Session) -> None:
        try:
            await s.chat(MESSAGES)
        except polygate.FatalUpstreamError:
            return
        raise AssertionError("the call did not fail")
    return settings, Router({"a": bad, "b": bad}), failing


class _Collector:
    """gc.callbacks: the time of each pass, and what it found to free."""

    def __init__(self) -> None:
        self.started = 0.0
        self.total = 0.0
        self.longest = 0.0
        self.passes = 0
        self.full = 0
        self.freed = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        self.total += took
        self.longest = max(self.longest, took)
        self.passes += 1
        self.full += info["generation"] == 2
        self.freed += info["collected"]


async def _measure(name: str, calls: int, concurrency: int) -> dict[str, Any]:
    settings, router, call = _kind(name)
    async with polygate.session(settings, transport=router, rng=random.Random(0)) as s:
        for _ in range(3):
            await call(s)
        gc.collect()
        collector = _Collector()
        gc.callbacks.append(collector)
        left = calls
        started = time.perf_counter()

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await call(s)

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
            wall = time.perf_counter() - started
        finally:
            gc.callbacks.remove(collector)
    return {"wall_s": wall, "gc_s": collector.total, "gc_share": collector.total / wall,
            "longest_ms": collector.longest * 1000, "passes": collector.passes,
            "full_passes": collector.full, "freed": collector.freed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1,000 calls")
    args = parser.parse_args()
    calls = 1_000 if args.quick else args.calls
    results = {}
    for name in ("ok", "failover", "fatal"):
        results[name] = trio.run(_measure, name, calls, args.concurrency,
                                 clock=trio.testing.MockClock(autojump_threshold=0))
    base = results["ok"]
    print(f"{calls:,} calls of each kind, {args.concurrency} at a time (virtual time)")
    print(f"{'kind':<10} {'wall s':>8} {'× ok':>6} {'in gc':>7} {'passes':>7} {'full':>5} "
          f"{'longest ms':>11} {'freed objects':>14}")
    for name, r in results.items():
        print(f"{name:<10} {r['wall_s']:8.2f} {r['wall_s'] / base['wall_s']:6.2f} "
              f"{r['gc_share'] * 100:6.1f}% {r['passes']:7d} {r['full_passes']:5d} "
              f"{r['longest_ms']:11.1f} {r['freed']:14,d}")
    write_result("gc_pauses-quick" if args.quick else "gc_pauses",
                 {"calls": calls, "concurrency": args.concurrency, "results": results})


if __name__ == "__main__":
    main()
