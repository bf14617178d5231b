"""Which mechanism should carry polygate to asyncio?  The measurement behind polygate.aio.

Three ways to call a trio library from an asyncio application, each a minimal bridge
written here the same way (a trio task per call in a nursery the bridge owns; the
result handed back through an asyncio future; cancellation of the asyncio task
cancels the trio task and waits until it has settled):

* ``guest``: trio's guest mode, ``trio.lowlevel.start_guest_run`` on the running
  asyncio (or uvloop) loop, in the same thread;
* ``thread``: ``trio.run`` in a thread of its own, a portal both ways
  (``TrioToken.run_sync_soon`` in, ``loop.call_soon_threadsafe`` out);
* ``native``: the same session called from trio directly, the baseline.

trio-asyncio is not a candidate for the front door: it runs asyncio *on top of*
trio, so an asyncio application would have to switch its event loop to trio-asyncio's
(uvicorn, uvloop and ``asyncio.run`` would all be replaced).  polygate.aio does use
the trio run underneath a trio-asyncio loop when it finds one (see docs/asyncio.md).

Workloads, against one FakeUpstream server in its own process (zero delays):
sequential non-streamed calls (per-call time), the same at concurrency 64
(throughput), 200-chunk streams (per-stream time) and cancellation latency (a call
to an upstream that never answers is cancelled from asyncio once the upstream has
it; time until ``CancelledError`` reaches the caller, the path settled and the
connection closed).  Every configuration runs in this one process, in rotated
blocks, several repeats; ratios are taken against ``native`` within a repeat.

    python benchmarks/aio_mechanisms.py            # full counts
    python benchmarks/aio_mechanisms.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import outcome
import trio

import polygate

from _common import fake_server, machine, median, quantile, write_result

MESSAGES = [{"role": "user", "content": "Say hello."}]


def settings_for(url: str, *, streaming: bool, deadline: float = 50) -> polygate.Settings:
    source = polygate.Source(
        name="a", base_url=url, api_key="sk-bench", model="m", streaming=streaming,
        rpm=10_000_000, tpm=10_000_000_000, max_in_flight=100_000, timeout_s=60,
    )
    other = polygate.Source(name="b", base_url=url, api_key="sk-bench", model="m",
                            streaming=streaming, weight=1e-9, timeout_s=60)
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[source, other], hedge=polygate.Hedge(after_s=30), call_deadline_s=deadline)})


# --------------------------------------------------------------------------- bridges


class _Bridge:
    """What both asyncio-side bridges share: a trio nursery that runs one task per
    call, an asyncio future per call, cancellation that waits for the trio side."""

    token: trio.lowlevel.TrioToken
    nursery: trio.Nursery
    loop: asyncio.AbstractEventLoop

    def _deliver(self, fut: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
        raise NotImplementedError

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        fut: asyncio.Future[Any] = self.loop.create_future()
        settled: asyncio.Future[None] = self.loop.create_future()
        box: list[trio.CancelScope] = []

        async def task() -> None:
            with trio.CancelScope() as scope:
                box.append(scope)
                result = await outcome.acapture(functools.partial(fn, *args, **kwargs))
            self._deliver(fut, result)
            self._deliver(settled, outcome.Value(None))

        self.token.run_sync_soon(self.nursery.start_soon, task)
        try:
            return await fut
        except asyncio.CancelledError:
            self.token.run_sync_soon(lambda: box and box[0].cancel())
            while not settled.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(settled)
            raise


class GuestBridge(_Bridge):
    def _deliver(self, fut: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
        if not fut.done():  # same thread: the trio tick is a callback of this loop
            _resolve(fut, result)

    @contextlib.asynccontextmanager
    async def open(self, settings: list[polygate.Settings]) -> AsyncIterator[list[Any]]:
        self.loop = loop = asyncio.get_running_loop()
        ready: asyncio.Future[list[Any]] = loop.create_future()
        done: asyncio.Future[Any] = loop.create_future()
        stop: list[trio.Event] = []

        async def main() -> None:
            async with contextlib.AsyncExitStack() as stack:
                sessions = [await stack.enter_async_context(polygate.session(s)) for s in settings]
                async with trio.open_nursery() as nursery:
                    self.nursery, self.token = nursery, trio.lowlevel.current_trio_token()
                    stop.append(trio.Event())
                    ready.set_result(sessions)
                    await stop[0].wait()
                    nursery.cancel_scope.cancel()

        trio.lowlevel.start_guest_run(
            main, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=done.set_result, host_uses_signal_set_wakeup_fd=True)
        try:
            yield await ready
        finally:
            self.token.run_sync_soon(stop[0].set)
            (await done).unwrap()


class ThreadBridge(_Bridge):
    def _deliver(self, fut: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
        def resolve() -> None:
            if not fut.done():
                _resolve(fut, result)

        self.loop.call_soon_threadsafe(resolve)

    @contextlib.asynccontextmanager
    async def open(self, settings: list[polygate.Settings]) -> AsyncIterator[list[Any]]:
        self.loop = loop = asyncio.get_running_loop()
        ready: asyncio.Future[list[Any]] = loop.create_future()
        stop: list[trio.Event] = []

        async def main() -> None:
            async with contextlib.AsyncExitStack() as stack:
                sessions = [await stack.enter_async_context(polygate.session(s)) for s in settings]
                async with trio.open_nursery() as nursery:
                    self.nursery, self.token = nursery, trio.lowlevel.current_trio_token()
                    stop.append(trio.Event())
                    loop.call_soon_threadsafe(ready.set_result, sessions)
                    await stop[0].wait()
                    nursery.cancel_scope.cancel()

        thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
        thread.start()
        try:
            yield await ready
        finally:
            self.token.run_sync_soon(stop[0].set)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)


def _resolve(fut: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
    if isinstance(result, outcome.Value):
        fut.set_result(result.value)
    else:
        fut.set_exception(result.error)


# --------------------------------------------------------------------------- workloads


async def _asyncio_block(bridge_cls: type[GuestBridge | ThreadBridge], url: str, hang_url: str,
                         counts: dict[str, int]) -> dict[str, float]:
    bridge = bridge_cls()
    settings = [settings_for(url, streaming=False), settings_for(url, streaming=True),
                settings_for(hang_url, streaming=False)]
    async with bridge.open(settings) as (plain, streamed, hanging):

        async def call() -> None:
            assert (await bridge.run(plain.chat, MESSAGES, max_tokens=8)).text

        async def stream_once() -> int:
            n = 0
            async with streamed.stream_chat(MESSAGES) as chunks:
                async for _ in chunks:
                    n += 1
            return n

        async def stream() -> None:
            assert await bridge.run(stream_once) >= 200

        async def cancel_once() -> float:
            task = asyncio.ensure_future(bridge.run(hanging.chat, MESSAGES))
            await asyncio.sleep(0.02)  # the request is at the upstream by then
            t0 = time.perf_counter()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return time.perf_counter() - t0

        async def concurrent(n: int, c: int) -> float:
            remaining = n

            async def worker() -> None:
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    await call()

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(c)))
            return n / (time.perf_counter() - t0)

        return await _measure(call, stream, cancel_once, concurrent, counts)


async def _native_block(url: str, hang_url: str, counts: dict[str, int]) -> dict[str, float]:
    async with polygate.session(settings_for(url, streaming=False)) as plain, \
            polygate.session(settings_for(url, streaming=True)) as streamed, \
            polygate.session(settings_for(hang_url, streaming=False)) as hanging:

        async def call() -> None:
            assert (await plain.chat(MESSAGES, max_tokens=8)).text

        async def stream() -> None:
            n = 0
            async with streamed.stream_chat(MESSAGES) as chunks:
                async for _ in chunks:
                    n += 1
            assert n >= 200

        async def cancel_once() -> float:
            elapsed = 0.0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hanging.chat, MESSAGES)
                await trio.sleep(0.02)
                t0 = time.perf_counter()
                nursery.cancel_scope.cancel()
            elapsed = time.perf_counter() - t0
            return elapsed

        async def concurrent(n: int, c: int) -> float:
            remaining = n

            async def worker() -> None:
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    await call()

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(c):
                    nursery.start_soon(worker)
            return n / (time.perf_counter() - t0)

        return await _measure(call, stream, cancel_once, concurrent, counts)


async def _measure(call: Callable[[], Awaitable[None]], stream: Callable[[], Awaitable[None]],
                   cancel_once: Callable[[], Awaitable[float]],
                   concurrent: Callable[[int, int], Awaitable[float]],
                   counts: dict[str, int]) -> dict[str, float]:
    for _ in range(counts["warmup"]):
        await call()
    seq = []
    for _ in range(counts["sequential"]):
        t0 = time.perf_counter()
        await call()
        seq.append(time.perf_counter() - t0)
    streams = []
    for _ in range(counts["streams"]):
        t0 = time.perf_counter()
        await stream()
        streams.append(time.perf_counter() - t0)
    cancels = [await cancel_once() for _ in range(counts["cancels"])]
    c64 = await concurrent(counts["concurrent"], 64)
    return {
        "sequential_median_us": median(seq) * 1e6,
        "sequential_p99_us": quantile(seq, 0.99) * 1e6,
        "c64_calls_per_s": c64,
        "stream_median_us": median(streams) * 1e6,
        "cancel_median_us": median(cancels) * 1e6,
        "cancel_max_us": max(cancels) * 1e6,
    }


def run_block(name: str, url: str, hang_url: str, counts: dict[str, int]) -> dict[str, float]:
    if name == "native":
        return trio.run(_native_block, url, hang_url, counts)
    bridge: type[GuestBridge | ThreadBridge] = GuestBridge if name.startswith("guest") else ThreadBridge
    coro = _asyncio_block(bridge, url, hang_url, counts)
    if name.endswith("uvloop"):
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def _upstream_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/_stats", timeout=5) as r:
        return dict(json.load(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    counts = {"warmup": 50, "sequential": 600, "concurrent": 3000, "streams": 40, "cancels": 20}
    if args.quick:
        counts = {"warmup": 10, "sequential": 100, "concurrent": 500, "streams": 10, "cancels": 5}
        args.repeats = 1
    names = ["native", "guest", "thread", "guest-uvloop", "thread-uvloop"]
    runs: list[dict[str, dict[str, float]]] = []
    with fake_server({"tokens": 200}) as url, fake_server({"headers_delay_s": 3600}) as hang_url:
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[: repeat % len(names)]
            run = {name: run_block(name, url, hang_url, counts) for name in order}
            runs.append({n: run[n] for n in names})
        hang_stats = _upstream_stats(hang_url)
    ratios = []
    for run in runs:
        base = run["native"]
        ratios.append({n: {
            "overhead_us": r["sequential_median_us"] - base["sequential_median_us"],
            "c64_throughput_ratio": r["c64_calls_per_s"] / base["c64_calls_per_s"],
            "stream_time_ratio": r["stream_median_us"] / base["stream_median_us"],
            "cancel_extra_us": r["cancel_median_us"] - base["cancel_median_us"],
        } for n, r in run.items()})
    med = {n: {k: median([r[n][k] for r in runs]) for k in runs[0][n]} for n in names}
    rat = {n: {k: median([r[n][k] for r in ratios]) for k in ratios[0][n]} for n in names}
    print(f"{'':<28}" + "".join(f"{n:>15}" for n in names))
    for key in runs[0]["native"]:
        print(f"{key:<28}" + "".join(f"{med[n][key]:>15.0f}" for n in names))
    print()
    for key in ratios[0]["native"]:
        print(f"{key:<28}" + "".join(f"{rat[n][key]:>15.2f}" for n in names))
    # Every cancelled call must have been seen by the upstream as a closed connection.
    print(f"\nhanging upstream: {hang_stats['requests']} requests, "
          f"{hang_stats['client_closed']} closed by the client, {hang_stats['in_flight']} in flight")
    path = write_result("aio-mechanisms-quick" if args.quick else "aio-mechanisms", {
        "machine": machine(), "counts": counts, "repeats": args.repeats,
        "median": med, "ratios": rat, "runs": runs, "hanging_upstream": hang_stats})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
