"""Scale: many logical calls at once, and many one after another, in virtual time.

Two sources served by ``FakeUpstream.transport()`` through a ``testing.Router``,
under trio's ``MockClock`` (autojump): every call is a ``stream_chat`` of 200 tokens
(first token after 0.1-0.5 s, then one every 20 ms); 10 % of the attempts hang for
60 s before their first token; hedging is on (after 2 s, with a budget large enough
for every hang), so a hung primary is hedged on the other source and cancelled
when the hedge commits.

* ``concurrent``: 10,000 calls started together.  It checks that every call
  completes with its 200 tokens and that no task is left afterwards, and reports
  the resident memory per in-flight call: the peak of the process's RSS (sampled
  from ``/proc/self/statm`` every virtual second while calls run) above the RSS
  before the first call, divided by the calls in flight at that moment.  The fake
  upstreams are in the same process, so their per-call state (the rendered
  stream, the recorded request) is in the figure too; ``--tracemalloc`` splits the
  Python allocations at the peak by package.
* ``sequential``: 100,000 calls one after another, RSS sampled every 1 % of them:
  memory must not grow with the number of completed calls.

Wall time and CPU per call are reported for both.

    python benchmarks/scale.py                  # 10,000 concurrent, 100,000 sequential
    python benchmarks/scale.py --quick          # 2,000 and 5,000
    python benchmarks/scale.py --tracemalloc    # where the in-flight memory is
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from collections import defaultdict
from typing import Any

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Profile, Router

from _common import machine, write_result

MESSAGES = [{"role": "user", "content": "Say hello."}]
TOKENS = 200
PAGE = os.sysconf("SC_PAGE_SIZE")
TARGET_KB_PER_CALL = 30.0


def rss_bytes() -> int:
    """Resident set size now (not the high-water mark)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def upstreams(seed: int) -> dict[str, FakeUpstream]:
    profile = Profile(first_token_s=(0.1, 0.5), inter_token_s=0.02, tokens=TOKENS,
                      hang_p=0.1, hang_s=60.0)
    # history=100: the fakes keep their counters but not every request they saw.
    return {name: FakeUpstream(profile, seed=seed + i, name=name, history=100)
            for i, name in enumerate(("a", "b"))}


def settings(calls: int) -> polygate.Settings:
    sources = [polygate.Source(name=n, base_url=f"http://{n}/v1", api_key="sk-scale", model="m",
                               timeout_s=120) for n in ("a", "b")]
    hedge = polygate.Hedge(after_s=2.0, budget_ratio=1.0, budget_burst=max(10, calls))
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=sources, hedge=hedge, call_deadline_s=300)})


class Run:
    """One scenario's counters and samples."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.done = 0
        self.failed = 0
        self.short = 0
        self.hedged = 0
        self.peak_rss = 0
        self.in_flight_at_peak = 0
        self.rss_at_fullest = 0
        self.samples: list[tuple[int, int]] = []  # (calls completed, rss bytes)
        self.snapshot: tracemalloc.Snapshot | None = None

    async def call(self, session: Any) -> None:
        self.in_flight += 1
        try:
            n = 0
            async with session.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    if chunk.text:
                        n += 1
            if n != TOKENS:
                self.short += 1
            if stream.response is not None and stream.response.call_stats.hedges:
                self.hedged += 1
            self.done += 1
        except polygate.PolygateError:
            self.failed += 1
        finally:
            self.in_flight -= 1

    def sample(self) -> None:
        """Keep the RSS of the fullest moment: most calls in flight, and of those
        moments the latest (calls hold more tokens the longer they stream)."""
        rss = rss_bytes()
        self.peak_rss = max(self.peak_rss, rss)
        if self.in_flight >= self.in_flight_at_peak:
            self.in_flight_at_peak, self.rss_at_fullest = self.in_flight, rss


async def concurrent(calls: int, trace: bool) -> dict[str, Any]:
    run = Run()
    ups = upstreams(seed=1)
    gc.collect()
    tasks_before = trio.lowlevel.current_statistics().tasks_living
    async with polygate.session(settings(calls), transport=Router(ups),
                                rng=random.Random(1)) as session:
        base = rss_bytes()
        wall0, cpu0, virtual0 = time.perf_counter(), time.process_time(), trio.current_time()

        async def sampler() -> None:
            while True:
                await trio.sleep(0.5)
                run.sample()
                if trace and run.snapshot is None and trio.current_time() - virtual0 >= 3.0:
                    run.snapshot = tracemalloc.take_snapshot()

        async with trio.open_nursery() as outer:
            outer.start_soon(sampler)
            async with trio.open_nursery() as nursery:
                for _ in range(calls):
                    nursery.start_soon(run.call, session)
            outer.cancel_scope.cancel()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        virtual = trio.current_time() - virtual0
    tasks_after = trio.lowlevel.current_statistics().tasks_living
    per_call_kb = (run.rss_at_fullest - base) / max(1, run.in_flight_at_peak) / 1024
    result = {
        "calls": calls, "completed": run.done, "failed": run.failed,
        "short_streams": run.short, "hedged": run.hedged,
        "tasks_left": tasks_after - tasks_before,
        "upstream_in_flight_after": sum(u.in_flight for u in ups.values()),
        "attempts": sum(u.statistics().requests for u in ups.values()),
        "rss_before_mb": base / 2**20, "peak_rss_mb": run.peak_rss / 2**20,
        "rss_at_fullest_mb": run.rss_at_fullest / 2**20,
        "in_flight_at_fullest": run.in_flight_at_peak,
        "rss_per_in_flight_call_kb": per_call_kb,
        "target_kb": TARGET_KB_PER_CALL, "target_met": per_call_kb <= TARGET_KB_PER_CALL,
        "wall_s": wall, "cpu_per_call_ms": cpu / calls * 1e3, "virtual_s": virtual,
    }
    if run.snapshot is not None:
        result["tracemalloc_at_peak_kb_per_call"] = by_package(run.snapshot, calls)
        result["tracemalloc_top_lines"] = top_lines(run.snapshot, calls)
    return result


def by_package(snapshot: tracemalloc.Snapshot, calls: int) -> dict[str, float]:
    """Python allocations alive at the snapshot, KB per call, by package."""
    sizes: dict[str, int] = defaultdict(int)
    for stat in snapshot.statistics("filename"):
        name = stat.traceback[0].filename
        for key in ("polygate/testing", "polygate", "httpx", "trio", "h11", "attrs", "ddsketch"):
            if f"/{key}/" in name:
                break
        else:
            key = "python stdlib/other"
        sizes[key] += stat.size
    return {k: v / calls / 1024 for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])}


def top_lines(snapshot: tracemalloc.Snapshot, calls: int, n: int = 12) -> list[str]:
    """The allocation sites holding the most memory at the snapshot, bytes per call."""
    out = []
    for stat in snapshot.statistics("lineno")[:n]:
        frame = stat.traceback[0]
        where = frame.filename.split("site-packages/")[-1].split("/work/main/")[-1]
        out.append(f"{stat.size / calls:8.0f} B/call  {where}:{frame.lineno}")
    return out


async def sequential(calls: int) -> dict[str, Any]:
    run = Run()
    ups = upstreams(seed=2)
    step = max(1, calls // 100)
    async with polygate.session(settings(calls), transport=Router(ups),
                                rng=random.Random(2)) as session:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(calls):
            await run.call(session)
            if (i + 1) % step == 0:
                # FakeUpstream keeps every request's arrival time for its /_stats
                # endpoint whatever ``history`` says (~35 B per request): the fake's
                # growth, not polygate's, so it is dropped before each sample.
                for up in ups.values():
                    up._request_times.clear()
                run.samples.append((i + 1, rss_bytes()))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    samples = run.samples
    # Allocator arenas and caches settle during the first calls: judge from 10 % on.
    settled = samples[len(samples) // 10:]
    first, last = settled[0], settled[-1]
    growth = (last[1] - first[1]) / 2**20
    per_1000 = (last[1] - first[1]) / max(1, last[0] - first[0]) * 1000 / 1024
    return {
        "calls": calls, "completed": run.done, "failed": run.failed,
        "short_streams": run.short, "hedged": run.hedged,
        "rss_mb_at": {str(n): rss / 2**20 for n, rss in samples[:: max(1, len(samples) // 10)]},
        "rss_mb_first_last": [samples[0][1] / 2**20, samples[-1][1] / 2**20],
        "growth_after_10pct_mb": growth,
        "growth_kb_per_1000_calls": per_1000,
        "flat": growth < 2.0,
        "wall_s": wall, "cpu_per_call_ms": cpu / calls * 1e3,
    }


def scenario_main(name: str, calls: int, trace: bool) -> None:
    """Child-process mode: run one scenario under a MockClock, print one JSON line."""
    if trace:
        tracemalloc.start()
    clock = trio.testing.MockClock(autojump_threshold=0)
    if name == "concurrent":
        result = trio.run(concurrent, calls, trace, clock=clock)
    else:
        result = trio.run(sequential, calls, clock=clock)
    print(json.dumps(result), flush=True)


def run_scenario(name: str, calls: int, trace: bool) -> dict[str, Any]:
    """One scenario in a fresh process, so that each starts from its own RSS."""
    cmd = [sys.executable, __file__, "--scenario", name, "--calls", str(calls)]
    if trace:
        cmd.append("--tracemalloc")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"scenario {name} failed with status {proc.returncode}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrent", type=int, default=10_000)
    parser.add_argument("--sequential", type=int, default=100_000)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--scenario", choices=("concurrent", "sequential"), help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        scenario_main(args.scenario, args.calls, args.tracemalloc)
        return
    if args.quick:
        args.concurrent, args.sequential = 1000, 3000
    result: dict[str, Any] = {"machine": machine(), "counts": vars(args)}
    result["concurrent"] = c = run_scenario("concurrent", args.concurrent, args.tracemalloc)
    print(f"concurrent: {c['completed']}/{c['calls']} completed ({c['failed']} failed, "
          f"{c['short_streams']} short, {c['hedged']} hedged), {c['tasks_left']} tasks left; "
          f"{c['rss_per_in_flight_call_kb']:.1f} KB RSS per in-flight call "
          f"({c['in_flight_at_fullest']} in flight; target <= {TARGET_KB_PER_CALL:.0f}); "
          f"{c['wall_s']:.1f} s wall, {c['cpu_per_call_ms']:.2f} ms CPU per call")
    if "tracemalloc_at_peak_kb_per_call" in c:
        print("  python allocations at the peak, KB per call: " + ", ".join(
            f"{k} {v:.1f}" for k, v in c["tracemalloc_at_peak_kb_per_call"].items()))
        print("\n".join("    " + line for line in c["tracemalloc_top_lines"]))
    ok = c["completed"] == c["calls"] and c["tasks_left"] == 0
    if not args.tracemalloc:  # tracing is for the in-flight figure only
        result["sequential"] = q = run_scenario("sequential", args.sequential, False)
        print(f"sequential: {q['completed']}/{q['calls']} completed ({q['failed']} failed, "
              f"{q['hedged']} hedged); RSS {q['rss_mb_first_last'][0]:.1f} -> "
              f"{q['rss_mb_first_last'][1]:.1f} MB, {q['growth_after_10pct_mb']:+.2f} MB after "
              f"the first 10 % ({q['growth_kb_per_1000_calls']:+.1f} KB per 1,000 calls); "
              f"{q['wall_s']:.1f} s wall, {q['cpu_per_call_ms']:.2f} ms CPU per call")
        ok = ok and q["completed"] == q["calls"]
    name = "scale-quick" if args.quick else "scale-tracemalloc" if args.tracemalloc else "scale"
    path = write_result(name, result)
    print(f"results: {path}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
