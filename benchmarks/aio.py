"""polygate.aio against polygate called from trio: what the asyncio front door costs.

One FakeUpstream server in its own process (zero delays, 200-token answers; the
non-streamed calls ask ``max_tokens=8`` of a plain-JSON source, like peers.py).  Three
configurations run the same workloads in this one process, in short alternating
blocks (rotated order, many rounds) so that machine noise hits all alike:

* ``trio``: ``polygate.session()`` under ``trio.run`` (the baseline);
* ``asyncio``: ``polygate.aio.session()`` under ``asyncio.run`` (selector loop);
* ``uvloop``: the same under ``uvloop.run``;
* with ``--thread-io``, also ``asyncio-thread-io``: ``asyncio`` with trio's I/O wait
  in trio's own helper thread (stock guest mode: polygate's fallback where trio's I/O
  manager cannot be polled by the loop), to show what the loop driver saves.

Workloads: sequential non-streamed calls (per-call time and CPU), the same at
concurrency 64 (throughput), 200-chunk streams one after another (per-stream time),
and cancellation latency (a call to an upstream that never answers is cancelled once
the upstream has it: time until the cancellation has reached the caller, every path
settled and the connection closed).

Targets (issue 13): the bridge adds <= 30 µs per call over the trio-native call, and
throughput at c=64 from asyncio is >= 0.9x trio-native.

    python benchmarks/aio.py                # full counts
    python benchmarks/aio.py --quick        # seconds (CI smoke)
    python benchmarks/aio.py --profile      # where an asyncio call's time goes
    python benchmarks/aio.py --thread-io    # also stock guest mode, side by side
    python benchmarks/aio.py --in-process   # the bridge alone: no network, no server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

import polygate
import polygate.aio

from _common import fake_server, machine, median, quantile, write_result

MESSAGES = [{"role": "user", "content": "Say hello."}]
CONFIGS = ("trio", "asyncio", "uvloop")


def settings_for(url: str, *, streaming: bool) -> polygate.Settings:
    source = polygate.Source(
        name="a", base_url=url, api_key="sk-bench", model="m", streaming=streaming,
        rpm=10_000_000, tpm=10_000_000_000, max_in_flight=100_000, timeout_s=60,
    )
    other = polygate.Source(name="b", base_url=url, api_key="sk-bench", model="m",
                            streaming=streaming, weight=1e-9, timeout_s=60)
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[source, other], hedge=polygate.Hedge(after_s=30), call_deadline_s=50)})


class Workloads:
    """The same workloads for both front doors; the loop-specific parts are injected."""

    def __init__(self, plain: Any, streamed: Any, hanging: Any, *, gather: Any,
                 sleep: Any, cancel_once: Any) -> None:
        self.plain, self.streamed, self.hanging = plain, streamed, hanging
        self.gather, self.sleep, self.cancel_once = gather, sleep, cancel_once

    async def call(self) -> None:
        assert (await self.plain.chat(MESSAGES, max_tokens=8)).text

    async def stream(self) -> None:
        n = 0
        async with self.streamed.stream_chat(MESSAGES) as chunks:
            async for _ in chunks:
                n += 1
        assert n >= 200

    async def run(self, block: str, n: int) -> dict[str, float]:
        if block == "sequential":
            times, cpu0 = [], time.process_time()
            for _ in range(n):
                t0 = time.perf_counter()
                await self.call()
                times.append(time.perf_counter() - t0)
            return {"median_us": median(times) * 1e6, "p99_us": quantile(times, 0.99) * 1e6,
                    "cpu_us": (time.process_time() - cpu0) / n * 1e6}
        if block == "c64":
            remaining = n

            async def worker() -> None:
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    await self.call()

            t0, cpu0 = time.perf_counter(), time.process_time()
            await self.gather([worker] * 64)
            return {"calls_per_s": n / (time.perf_counter() - t0),
                    "cpu_us": (time.process_time() - cpu0) / n * 1e6}
        if block == "streams":
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                await self.stream()
                times.append(time.perf_counter() - t0)
            return {"median_us": median(times) * 1e6}
        assert block == "cancel"
        times = [await self.cancel_once() for _ in range(n)]
        return {"median_us": median(times) * 1e6, "max_us": max(times) * 1e6}


async def _trio_gather(fns: list[Callable[[], Awaitable[None]]]) -> None:
    async with trio.open_nursery() as nursery:
        for fn in fns:
            nursery.start_soon(fn)


async def _asyncio_gather(fns: list[Callable[[], Awaitable[None]]]) -> None:
    await asyncio.gather(*(fn() for fn in fns))


async def trio_block(urls: tuple[str, str], plan: list[tuple[str, int]]) -> dict[str, Any]:
    url, hang_url = urls
    async with polygate.session(settings_for(url, streaming=False)) as plain, \
            polygate.session(settings_for(url, streaming=True)) as streamed, \
            polygate.session(settings_for(hang_url, streaming=False)) as hanging:

        async def cancel_once() -> float:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hanging.chat, MESSAGES)
                await trio.sleep(0.01)  # the request is at the upstream by then
                t0 = time.perf_counter()
                nursery.cancel_scope.cancel()
            return time.perf_counter() - t0

        w = Workloads(plain, streamed, hanging, gather=_trio_gather, sleep=trio.sleep,
                      cancel_once=cancel_once)
        for _ in range(30):
            await w.call()
        return {block: await w.run(block, n) for block, n in plan}


async def asyncio_block(urls: tuple[str, str], plan: list[tuple[str, int]]) -> dict[str, Any]:
    url, hang_url = urls
    async with polygate.aio.session(settings_for(url, streaming=False)) as plain, \
            polygate.aio.session(settings_for(url, streaming=True)) as streamed, \
            polygate.aio.session(settings_for(hang_url, streaming=False)) as hanging:

        async def cancel_once() -> float:
            task = asyncio.ensure_future(hanging.chat(MESSAGES))
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return time.perf_counter() - t0

        w = Workloads(plain, streamed, hanging, gather=_asyncio_gather, sleep=asyncio.sleep,
                      cancel_once=cancel_once)
        for _ in range(30):
            await w.call()
        return {block: await w.run(block, n) for block, n in plan}


def run_config(config: str, urls: tuple[str, str], plan: list[tuple[str, int]]) -> dict[str, Any]:
    if config == "asyncio-thread-io":
        from polygate.aio import _guest_io

        tick = _guest_io._guest_tick
        _guest_io._guest_tick = lambda: None  # the fallback: trio's helper thread
        try:
            return asyncio.run(asyncio_block(urls, plan))
        finally:
            _guest_io._guest_tick = tick
    if config == "trio":
        return trio.run(trio_block, urls, plan)
    if config == "uvloop":
        import uvloop

        return uvloop.run(asyncio_block(urls, plan))
    return asyncio.run(asyncio_block(urls, plan))


def in_process(n: int, rounds: int) -> dict[str, Any]:
    """Sequential calls on polygate's in-process fake upstream (no sockets, no server):
    what the bridge itself adds, with nothing else in the way.  Alternating rounds."""
    from polygate.testing import FakeUpstream, Reply, Router

    def fresh() -> tuple[polygate.Settings, Any]:
        source = polygate.Source(name="a", base_url="http://a/v1", model="m")
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[source])})
        return settings, Router({"a": FakeUpstream(Reply(text="Paris.", tokens=2))})

    async def timed(s: Any) -> dict[str, float]:
        for _ in range(100):
            await s.chat(MESSAGES)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            await s.chat(MESSAGES)
        return {"us": (time.perf_counter() - t0) / n * 1e6,
                "cpu_us": (time.process_time() - c0) / n * 1e6}

    async def on_trio() -> dict[str, float]:
        settings, transport = fresh()
        async with polygate.session(settings, transport=transport) as s:
            return await timed(s)

    async def on_asyncio() -> dict[str, float]:
        settings, transport = fresh()
        async with polygate.aio.session(settings, transport=transport) as s:
            return await timed(s)

    import uvloop

    runs: list[dict[str, dict[str, float]]] = []
    for _ in range(rounds):
        runs.append({"trio": trio.run(on_trio), "asyncio": asyncio.run(on_asyncio()),
                     "uvloop": uvloop.run(on_asyncio())})
    out: dict[str, Any] = {}
    for config in ("trio", "asyncio", "uvloop"):
        out[config] = {k: median([r[config][k] for r in runs]) for k in ("us", "cpu_us")}
    for config in ("asyncio", "uvloop"):
        out[f"{config}_added_us"] = median([r[config]["us"] - r["trio"]["us"] for r in runs])
    print(f"in-process, {n} sequential calls, median of {rounds} rounds")
    for config in ("trio", "asyncio", "uvloop"):
        print(f"  {config:<8} {out[config]['us']:8.0f} µs/call ({out[config]['cpu_us']:.0f} CPU)")
    for config in ("asyncio", "uvloop"):
        print(f"  {config} adds {out[f'{config}_added_us']:.0f} µs a call")
    return out


def thread_round_trip_us(n: int = 2000) -> float:
    """Median time of one round trip main thread -> another thread -> main thread
    through a socketpair (two context switches, two GIL hand-offs): the unit a guest
    run pays when trio waits for I/O in its helper thread, measured on this machine
    in this run."""
    import socket
    import threading

    a, b = socket.socketpair()

    def echo() -> None:
        while (data := b.recv(1)) not in (b"", b"q"):
            b.send(data)

    thread = threading.Thread(target=echo)
    thread.start()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        a.send(b"x")
        a.recv(1)
        times.append(time.perf_counter() - t0)
    a.send(b"q")
    thread.join()
    a.close()
    b.close()
    return median(times) * 1e6


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds of each figure, and of each ratio taken within a round."""
    configs = list(rounds[0])
    med: dict[str, Any] = {}
    for config in configs:
        med[config] = {}
        for block in rounds[0][config]:
            med[config][block] = {k: median([r[config][block][k] for r in rounds])
                                  for k in rounds[0][config][block]}
    ratios: dict[str, Any] = {}
    for config in (c for c in configs if c != "trio"):
        per_round = []
        for r in rounds:
            a, t = r[config], r["trio"]
            per_round.append({
                "added_us_per_call": a["sequential"]["median_us"] - t["sequential"]["median_us"],
                "added_cpu_us_per_call": a["sequential"]["cpu_us"] - t["sequential"]["cpu_us"],
                "c64_throughput_vs_trio": a["c64"]["calls_per_s"] / t["c64"]["calls_per_s"],
                "c64_cpu_vs_trio": a["c64"]["cpu_us"] / t["c64"]["cpu_us"],
                "stream_time_vs_trio": a["streams"]["median_us"] / t["streams"]["median_us"],
                "cancel_added_us": a["cancel"]["median_us"] - t["cancel"]["median_us"],
            })
        ratios[config] = {k: median([p[k] for p in per_round]) for k in per_round[0]}
        ratios[config]["spread"] = {k: (min(p[k] for p in per_round), max(p[k] for p in per_round))
                                    for k in per_round[0]}
    return {"median": med, "ratios": ratios}


def profile(urls: tuple[str, str], n: int) -> dict[str, Any]:
    """cProfile one asyncio block (sequential and c64): time grouped by where it goes."""
    import cProfile
    import pstats

    groups = {
        "polygate.aio (the bridge)": ("polygate/aio/",),
        "polygate (call, hedge, admission, transport)": ("/polygate/",),
        "trio scheduler and guest ticks": ("/trio/",),
        "asyncio event loop": ("/asyncio/",),
        "h11": ("/h11/",),
        "socket and epoll syscalls": ("<method 'send'", "<method 'recv'", "<method 'poll'",
                                      "<method 'select'", "epoll"),
        "thread hand-offs (locks)": ("_thread.lock", "<method 'acquire'", "<method 'release'"),
    }
    out: dict[str, Any] = {}
    for block in ("sequential", "c64"):
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(asyncio_block(urls, [(block, n)]))
        prof.disable()
        stats = pstats.Stats(prof)
        total = 0.0
        grouped = dict.fromkeys([*groups, "other"], 0.0)
        for (file, line, func), (_cc, _nc, tt, _ct, _c) in stats.stats.items():  # type: ignore[attr-defined]
            total += tt
            where = f"{file}:{line}({func})"
            for name, needles in groups.items():
                if any(s in where for s in needles):
                    grouped[name] += tt
                    break
            else:
                grouped["other"] += tt
        out[block] = {"total_s": total, "per_call_us": total / n * 1e6,
                      "share_pct": {k: 100 * v / total for k, v in grouped.items() if v}}
        print(f"\n{block}: {total / n * 1e6:.0f} µs of profiled main-thread time per call")
        for k, v in sorted(out[block]["share_pct"].items(), key=lambda kv: -kv[1]):
            print(f"  {v:5.1f} %  {k}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--in-process", action="store_true",
                        help="sequential calls on the in-process fake upstream only")
    parser.add_argument("--thread-io", action="store_true",
                        help="also run asyncio with trio's I/O wait in its helper thread")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the counts (short blocks, many rounds: --scale 0.25 --rounds 30)")
    args = parser.parse_args()
    plan = [("sequential", 400), ("c64", 3000), ("streams", 30), ("cancel", 10)]
    if args.quick:
        plan = [("sequential", 50), ("c64", 300), ("streams", 5), ("cancel", 3)]
        args.rounds = 1
    plan = [(block, max(3, round(n * args.scale))) for block, n in plan]
    if args.in_process:
        result = in_process(300 if args.quick else 3000, 1 if args.quick else 5)
        name = 'aio-in-process-quick' if args.quick else 'aio-in-process'
        print(f"\nresults: {write_result(name, {'machine': machine(), **result})}")
        return
    with fake_server({"tokens": 200}) as url, fake_server({"headers_delay_s": 3600}) as hang:
        urls = (url, hang)
        if args.profile:
            result = profile(urls, 500 if args.quick else 3000)
            print(f"\nresults: {write_result('aio-profile', {'machine': machine(), **result})}")
            return
        configs = CONFIGS + (("asyncio-thread-io",) if args.thread_io else ())
        rounds = []
        for i in range(args.rounds):
            k = i % len(configs)
            order = configs[k:] + configs[:k]
            rounds.append({c: run_config(c, urls, plan) for c in order})
    summary = summarise(rounds)
    summary["thread_round_trip_us"] = thread_round_trip_us()
    med, rat = summary["median"], summary["ratios"]
    configs = tuple(summary["median"])
    others = configs[1:] if configs[0] == "trio" else tuple(c for c in configs if c != "trio")
    configs = ("trio", *others)
    print(f"{'median of rounds':<34}" + "".join(f"{c:>18}" for c in configs))
    rows = [("sequential", "median_us", "sequential µs/call"), ("sequential", "p99_us", "sequential p99 µs"),
            ("sequential", "cpu_us", "sequential CPU µs/call"), ("c64", "calls_per_s", "c64 calls/s"),
            ("c64", "cpu_us", "c64 CPU µs/call"), ("streams", "median_us", "200-chunk stream µs"),
            ("cancel", "median_us", "cancellation µs"), ("cancel", "max_us", "cancellation max µs")]
    for block, key, label in rows:
        print(f"{label:<34}" + "".join(f"{med[c][block][key]:>18.0f}" for c in configs))
    print(f"\n{'against trio, within each round':<34}" + "".join(f"{c:>18}" for c in others))
    for key in rat["asyncio"]:
        if key != "spread":
            print(f"{key:<34}" + "".join(f"{rat[c][key]:>18.2f}" for c in others))
    print(f"{'one thread round trip µs (here)':<34}{summary['thread_round_trip_us']:>12.0f}")
    checks = {}
    for config in ("asyncio", "uvloop"):
        checks[f"{config}: added time per call <= 30 µs"] = (rat[config]["added_us_per_call"], 30.0, "<=")
        checks[f"{config}: c64 throughput >= 0.9x trio"] = (rat[config]["c64_throughput_vs_trio"], 0.9, ">=")
    print("\ntargets")
    targets = {}
    for name, (value, bound, op) in checks.items():
        met = value <= bound if op == "<=" else value >= bound
        targets[name] = {"value": value, "bound": f"{op} {bound}", "met": met}
        print(f"  {'met ' if met else 'MISS'} {name:<42} {value:.2f} ({op} {bound})")
    path = write_result("aio-quick" if args.quick else "aio", {
        "machine": machine(), "plan": plan, "rounds": args.rounds, **summary,
        "targets": targets, "raw": rounds})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
