"""Shared benchmark plumbing: a FakeUpstream server in its own process, timing helpers."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

Call = Callable[[], Awaitable[Any]]


@contextlib.contextmanager
def fake_server(reply: dict[str, Any] | None = None, *, seed: int = 0) -> Iterator[str]:
    """A loopback FakeUpstream in a separate process; yields its base URL."""
    cmd = [sys.executable, "-m", "polygate.testing.serve", "--port", "0", "--history", "10"]
    if reply:
        cmd += ["--reply", json.dumps(reply)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"fake server did not start: {line!r}")
        yield line.removeprefix("listening on ")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wake_cpu_us": wake_cpu_us(),
    }


def wake_cpu_us(n: int = 100) -> float:
    """The CPU one sleep and wake-up is charged here (``time.sleep(0.001)``, median
    of ``n``): what the machine makes every blocking wait cost.  On this project's
    shared 2-core machine it has read from ~10 to ~90 µs within one day, and every
    hop of a request (the gateway's included) pays it once or twice, so a latency
    figure is read beside it."""
    costs = []
    for _ in range(n):
        c0 = time.process_time()
        time.sleep(0.001)
        costs.append((time.process_time() - c0) * 1e6)
    return round(sorted(costs)[n // 2], 1)


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


async def timed_sequential(call: Call, n: int) -> list[float]:
    """Seconds each of ``n`` calls took, one after another."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t0)
    return times


async def timed_concurrent(call: Call, n: int, concurrency: int) -> float:
    """Wall seconds for ``n`` calls made by ``concurrency`` workers."""
    import trio

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
