"""How much telemetry the sinks absorb, where drops begin, and what it costs a call.

Sections (each prints a table; all results go to ``benchmarks/results/``):

* ``absorb`` — sustained rows/s into SQLite: the bare sink (``SQLiteSink.write`` of
  5,000-row batches) and the whole pipeline (events sent into the channel with
  back-pressure, so none is dropped, until the flusher has written them all).
  Target: ≥ 20,000 rows/s.
* ``knee`` — open-loop synthetic load: ``R`` logical calls per second (two rows each:
  the call and its attempt) sent with ``send_nowait`` for a few seconds, as the call
  path does; the first rate at which rows are dropped.
* ``sessions`` — real sessions on the in-process fake upstream (zero delays, real
  clock), telemetry off and SQLite side by side, alternating blocks: calls/s at
  concurrency 64, and whether any row was dropped at the fastest rate polygate itself
  can go.
* ``loopback`` — sequential non-streamed calls to a FakeUpstream server in its own
  process, telemetry off and SQLite in alternating blocks: per-call cost, side by
  side.
* ``overhead`` (``--overhead``) — ``benchmarks/overhead.py`` run as it is, except
  that every session it opens has SQLite telemetry on: its targets with telemetry.
* ``postgres`` (``--postgres URL`` or ``--postgres auto``: a throwaway server started
  like the tests do) — rows/s of psycopg ``COPY`` (the sink) and ``executemany`` in a
  worker thread against asyncpg's ``copy_records_to_table`` and ``executemany``
  through trio-asyncio (when installed), and the longest stall each inflicts on the
  trio loop (a 1 ms ticker's worst gap).

    python benchmarks/telemetry_sink.py                  # absorb, knee, sessions
    python benchmarks/telemetry_sink.py --quick          # smaller counts
    python benchmarks/telemetry_sink.py --overhead --postgres auto
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

import polygate
from polygate.telemetry import AttemptEvent, Batch, CallEvent, Pipeline
from polygate.telemetry._recorder import TelemetryRecorder
from polygate.telemetry._sqlite import SQLiteSink
from polygate.testing import FakeUpstream, Reply, Router

from _common import fake_server, machine, median, write_result

MESSAGES = [{"role": "user", "content": "Say hello."}]


def call_row(i: int) -> CallEvent:
    return CallEvent(
        "bench", f"call-{i:09d}", "chat", "chat", 0, time.time(), "ok", None, None,
        1234.5, 1200.0, 310.0, 0.0, 0, 880.0, 1, 0, 0, "a", 0, 42, 186, "upstream", None,
    )


def attempt_row(i: int) -> AttemptEvent:
    return AttemptEvent(
        f"call-{i:09d}.1", f"call-{i:09d}", "chat", "a", "primary", time.time(), 1200.0,
        310.0, 200, 1, "ok", None, None, 450, 228, 42, 186, "upstream",
    )


def rows(n_calls: int, start: int = 0) -> Iterator[CallEvent | AttemptEvent]:
    for i in range(start, start + n_calls):
        yield attempt_row(i)
        yield call_row(i)


@functools.cache
def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="polygate-bench-"))


def fresh_db(name: str) -> Path:
    path = scratch() / f"{name}.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return path


# --------------------------------------------------------------------------- absorb


def bare_sink(n_rows: int, batch: int = 5000) -> float:
    sink = SQLiteSink.open(fresh_db("bare"))
    calls = [call_row(i) for i in range(batch // 2)]
    attempts = [attempt_row(i) for i in range(batch // 2)]
    t0 = time.perf_counter()
    for _ in range(n_rows // batch):
        sink.write(Batch(calls, attempts))
    elapsed = time.perf_counter() - t0
    sink.close()
    return (n_rows // batch) * batch / elapsed


async def pipeline_absorb(n_calls: int) -> tuple[float, Any]:
    pipeline = Pipeline(SQLiteSink.open(fresh_db("pipeline")), session_id="bench")
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        send = pipeline.send
        for event in rows(n_calls):
            try:
                send.send_nowait(event)
            except trio.WouldBlock:
                await send.send(event)  # back-pressure: measure capacity, not drops
        await pipeline.aclose()
    elapsed = time.perf_counter() - t0
    stats = pipeline.statistics()
    assert stats.dropped == 0, stats
    return stats.written / elapsed, stats


# --------------------------------------------------------------------------- knee


async def offered_load(calls_per_s: float, seconds: float, capacity: int) -> dict[str, Any]:
    """Send 2 rows per call at ``calls_per_s`` with send_nowait, in 5 ms ticks."""
    pipeline = Pipeline(
        SQLiteSink.open(fresh_db(f"knee-{calls_per_s:.0f}")), session_id="bench", capacity=capacity
    )
    recorder = TelemetryRecorder(pipeline.send, pipeline.counters, session_id="bench")
    tick = 0.005
    sent = 0
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        while (now := trio.current_time()) - t0 < seconds:
            due = int((now - t0) * calls_per_s)
            for i in range(sent, due):
                recorder._put(attempt_row(i))
                recorder._put(call_row(i))
            sent = max(sent, due)
            await trio.sleep(tick)
        offered_s = trio.current_time() - t0
        dropped_while_running = pipeline.counters.dropped
        await pipeline.aclose()
    stats = pipeline.statistics()
    return {
        "calls_per_s": calls_per_s,
        "achieved_calls_per_s": sent / offered_s,
        "rows": 2 * sent,
        "dropped": dropped_while_running,
        "dropped_pct": 100.0 * dropped_while_running / max(1, 2 * sent),
        "written": stats.written,
    }


# --------------------------------------------------------------------------- sessions


async def session_throughput(args: argparse.Namespace) -> dict[str, Any]:
    up = FakeUpstream(Reply(tokens=8))
    base = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key="sk-bench", model="m")])})
    configs = {
        "off": base,
        "sqlite": attrs.evolve(base, telemetry=f"sqlite://{fresh_db('sessions')}"),
    }
    rates: dict[str, list[float]] = {k: [] for k in configs}
    dropped: dict[str, int] = dict.fromkeys(configs, 0)
    written: dict[str, int] = dict.fromkeys(configs, 0)
    per_block = args.session_calls // args.blocks
    for block in range(args.blocks):
        order = list(configs) if block % 2 == 0 else list(configs)[::-1]
        for name in order:
            async with polygate.session(configs[name], transport=Router({"a": up})) as s:
                for _ in range(20):
                    await s.chat(MESSAGES)  # warm-up
                remaining = per_block

                async def worker(s: polygate.Session = s) -> None:
                    nonlocal remaining
                    while remaining > 0:
                        remaining -= 1
                        await s.chat(MESSAGES)

                t0 = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(64):
                        nursery.start_soon(worker)
                rates[name].append(per_block / (time.perf_counter() - t0))
                stats = (await s.statistics()).telemetry
            final = (await s.statistics()).telemetry
            dropped[name] += stats.dropped + final.dropped_at_close
            written[name] += final.written
        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    off, on = median(rates["off"]), median(rates["sqlite"])
    return {
        "calls_per_s_off": off, "calls_per_s_sqlite": on, "ratio": on / off,
        "dropped_sqlite": dropped["sqlite"], "written_sqlite": written["sqlite"],
    }


async def loopback_sequential(url: str, calls: int, blocks: int) -> dict[str, Any]:
    """Sequential non-streamed calls to a loopback server, telemetry off and SQLite
    in alternating blocks: the per-call cost of telemetry, side by side."""
    source = polygate.Source(name="a", base_url=url, api_key="sk-bench", model="m",
                             streaming=False, timeout_s=60)
    base = polygate.Settings(scopes={"chat": polygate.Scope(sources=[source])})
    configs = {"off": base, "sqlite": attrs.evolve(base, telemetry=f"sqlite://{fresh_db('loopback')}")}
    times: dict[str, list[float]] = {k: [] for k in configs}
    async with polygate.session(configs["off"]) as off, polygate.session(configs["sqlite"]) as on:
        sessions = {"off": off, "sqlite": on}
        for s in sessions.values():
            for _ in range(50):
                await s.chat(MESSAGES)
        for block in range(blocks):
            for name in (list(configs) if block % 2 == 0 else list(configs)[::-1]):
                s = sessions[name]
                for _ in range(calls // blocks):
                    t0 = time.perf_counter()
                    await s.chat(MESSAGES)
                    times[name].append(time.perf_counter() - t0)
        dropped = (await on.statistics()).telemetry.dropped
    off_us, on_us = median(times["off"]) * 1e6, median(times["sqlite"]) * 1e6
    return {"median_us_off": off_us, "median_us_sqlite": on_us, "ratio": on_us / off_us,
            "dropped": dropped}


# --------------------------------------------------------------------------- overhead.py


def overhead_with_telemetry(quick: bool) -> dict[str, Any]:
    """benchmarks/overhead.py as it is, every session with SQLite telemetry on; its
    result goes to ``overhead-telemetry[-quick].json`` (overhead.py's own file is left
    alone)."""
    import overhead  # benchmarks/ is on sys.path when this script runs

    counter = iter(range(1_000_000))
    saved = overhead.settings_for, overhead.write_result, sys.argv
    captured: dict[str, Any] = {}

    def with_telemetry(*a: Any, **kw: Any) -> polygate.Settings:
        settings: polygate.Settings = saved[0](*a, **kw)
        return attrs.evolve(settings, telemetry=f"sqlite://{fresh_db(f'overhead-{next(counter)}')}")

    def write_elsewhere(name: str, payload: dict[str, Any]) -> Path:
        captured.update(payload)
        return write_result(name.replace("overhead", "overhead-telemetry"), payload)

    overhead.settings_for, overhead.write_result = with_telemetry, write_elsewhere
    sys.argv = [sys.argv[0], *(["--quick"] if quick else [])]
    try:
        overhead.main()
    finally:
        overhead.settings_for, overhead.write_result, sys.argv = saved
    return captured


# --------------------------------------------------------------------------- postgres


async def loop_stall(work: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """Run ``work`` beside a 1 ms ticker; (seconds, worst gap between ticks in ms)."""
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await trio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        t0 = time.perf_counter()
        await work()
        elapsed = time.perf_counter() - t0
        done = True
    return elapsed, worst * 1000


async def postgres_compare(url: str, n_rows: int, batch: int) -> list[dict[str, Any]]:
    import psycopg

    from polygate.telemetry._postgres import PostgresSink

    n_batches = max(1, n_rows // batch)
    calls = [call_row(i) for i in range(batch // 2)]
    attempts = [attempt_row(i) for i in range(batch // 2)]
    results = []

    def reset() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("TRUNCATE calls, attempts")

    PostgresSink.open(url).close()  # the schema
    sink = PostgresSink.open(url)

    async def copy_in_thread() -> None:
        for _ in range(n_batches):
            await trio.to_thread.run_sync(sink.write, Batch(calls, attempts))

    insert_calls = f"INSERT INTO calls ({', '.join(CallEvent._fields)}) VALUES ({', '.join(['%s'] * len(CallEvent._fields))})"
    insert_attempts = f"INSERT INTO attempts ({', '.join(AttemptEvent._fields)}) VALUES ({', '.join(['%s'] * len(AttemptEvent._fields))})"
    conn = psycopg.connect(url, autocommit=True)

    def executemany() -> None:
        with conn.transaction(), conn.cursor() as cur:
            cur.executemany(insert_calls, calls)
            cur.executemany(insert_attempts, attempts)

    async def executemany_in_thread() -> None:
        for _ in range(n_batches):
            await trio.to_thread.run_sync(executemany)

    methods: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("psycopg COPY, worker thread (the sink)", copy_in_thread),
        ("psycopg executemany, worker thread", executemany_in_thread),
    ]
    try:
        import asyncpg
        import trio_asyncio
    except ImportError:
        asyncpg = trio_asyncio = None
        print("asyncpg/trio-asyncio not installed: psycopg only", file=sys.stderr)
    for name, method in methods:
        reset()
        elapsed, stall = await loop_stall(method)
        results.append({"method": name, "rows_per_s": n_batches * batch / elapsed, "worst_loop_stall_ms": stall})
    sink.close()
    conn.close()
    if asyncpg is not None and trio_asyncio is not None:
        async with trio_asyncio.open_loop():
            aconn = await trio_asyncio.aio_as_trio(asyncpg.connect)(url)
            call_records = [tuple(c) for c in calls]
            attempt_records = [tuple(a) for a in attempts]
            a_calls = insert_calls.replace("%s", "${}")
            a_calls = a_calls.format(*range(1, len(CallEvent._fields) + 1))
            a_attempts = insert_attempts.replace("%s", "${}").format(*range(1, len(AttemptEvent._fields) + 1))

            async def a_copy() -> None:
                async with aconn.transaction():
                    await aconn.copy_records_to_table("calls", records=call_records, columns=list(CallEvent._fields))
                    await aconn.copy_records_to_table("attempts", records=attempt_records, columns=list(AttemptEvent._fields))

            async def a_many() -> None:
                async with aconn.transaction():
                    await aconn.executemany(a_calls, call_records)
                    await aconn.executemany(a_attempts, attempt_records)

            for name, one in (("asyncpg copy_records_to_table, trio-asyncio", a_copy),
                              ("asyncpg executemany, trio-asyncio", a_many)):
                reset()

                async def run_all(one: Any = one) -> None:
                    for _ in range(n_batches):
                        await trio_asyncio.aio_as_trio(one)()

                elapsed, stall = await loop_stall(run_all)
                results.append({"method": name, "rows_per_s": n_batches * batch / elapsed, "worst_loop_stall_ms": stall})
            await trio_asyncio.aio_as_trio(aconn.close)()
    return results


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=400_000, help="rows for the absorb section")
    parser.add_argument("--seconds", type=float, default=3.0, help="per offered rate in the knee")
    parser.add_argument("--session-calls", type=int, default=6000)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--overhead", action="store_true", help="run overhead.py with telemetry on")
    parser.add_argument("--postgres", metavar="URL", help="a PostgreSQL URL, or 'auto'")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.seconds, args.session_calls, args.blocks = 50_000, 1.0, 1200, 2
    result: dict[str, Any] = {"machine": machine(), "counts": vars(args)}

    bare = bare_sink(args.rows)
    absorbed, _ = trio.run(pipeline_absorb, args.rows // 2)
    result["absorb"] = {"bare_sink_rows_per_s": bare, "pipeline_rows_per_s": absorbed}
    print(f"{'SQLite absorb':<44}{'rows/s':>12}{'target':>10}")
    print(f"{'  bare sink, 5,000-row transactions':<44}{bare:>12,.0f}{'':>10}")
    print(f"{'  pipeline (channel, flusher, thread)':<44}{absorbed:>12,.0f}{'>= 20,000':>10}")

    print(f"\n{'offered load (2 rows per call)':<34}{'calls/s':>10}{'rows/s':>10}{'dropped':>10}")
    knee: list[dict[str, Any]] = []
    for rate in (1_000, 2_500, 5_000, 10_000, 20_000, 40_000, 80_000):
        point = trio.run(offered_load, rate, args.seconds, 10_000)
        knee.append(point)
        print(f"{'':<34}{point['achieved_calls_per_s']:>10,.0f}"
              f"{2 * point['achieved_calls_per_s']:>10,.0f}{point['dropped_pct']:>9.1f}%")
        if point["dropped_pct"] > 20:
            break
    first = next((p for p in knee if p["dropped"]), None)
    result["knee"] = {"points": knee, "drops_begin_at_calls_per_s": first["calls_per_s"] if first else None}
    print("  drops begin at " + (f"{first['calls_per_s']:,} calls/s offered" if first else "none of these rates"))

    sessions = trio.run(session_throughput, args)
    result["sessions"] = sessions
    print(f"\n{'real sessions, concurrency 64':<34}{'off':>10}{'sqlite':>10}{'ratio':>8}{'dropped':>9}")
    print(f"{'  calls/s (fake upstream, no delay)':<34}{sessions['calls_per_s_off']:>10,.0f}"
          f"{sessions['calls_per_s_sqlite']:>10,.0f}{sessions['ratio']:>8.2f}{sessions['dropped_sqlite']:>9}")

    with fake_server({"tokens": 8}) as url:
        loop = trio.run(loopback_sequential, url, args.session_calls, args.blocks * 2)
    result["loopback_sequential"] = loop
    print(f"{'  sequential loopback call, median µs':<34}{loop['median_us_off']:>10,.0f}"
          f"{loop['median_us_sqlite']:>10,.0f}{loop['ratio']:>8.2f}{loop['dropped']:>9}")

    if args.postgres:
        result["postgres"] = run_postgres(args)
    path = write_result("telemetry_sink-quick" if args.quick else "telemetry_sink", result)
    print(f"\nresults: {path}")
    if args.overhead:
        print("\noverhead.py with SQLite telemetry on every session:")
        result["overhead_with_telemetry"] = overhead_with_telemetry(args.quick)
        write_result(path.stem, result)


def run_postgres(args: argparse.Namespace) -> list[dict[str, Any]]:
    n_rows = 20_000 if args.quick else 200_000
    if args.postgres != "auto":
        points = trio.run(postgres_compare, args.postgres, n_rows, 1000)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests._postgres_server import postgres_server

        with postgres_server("bench-" + os.urandom(4).hex()) as server:
            points = trio.run(postgres_compare, server.url(), n_rows, 1000)
    print(f"\n{'PostgreSQL, 1,000-row batches':<46}{'rows/s':>10}{'worst loop stall':>18}")
    for p in points:
        print(f"  {p['method']:<44}{p['rows_per_s']:>10,.0f}{p['worst_loop_stall_ms']:>15.1f} ms")
    return points


if __name__ == "__main__":
    main()
