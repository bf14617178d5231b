"""polygate against its peers on one loopback server: raw httpx, openai-python,
LiteLLM's Router, and a raw-socket floor.

One FakeUpstream server runs in its own process with zero delays (200 tokens per
answer; the non-streamed calls ask ``max_tokens=8``).  Every client runs the same
workloads against it, each client in its own subprocess so that peak RSS and event
loops are its own:

* ``sequential``: non-streamed calls one after another (per-call time);
* ``c64`` / ``c256``: non-streamed calls, 64 / 256 at a time (throughput);
* ``streams``: streams of 200 chunks one after another (per-stream time).

From asyncio (``asyncio.run``, the same loop for each): ``aio`` (``polygate.aio``,
polygate as a trio guest on the asyncio loop, the same settings as ``polygate``),
``openai-asyncio`` (``openai.AsyncOpenAI`` on asyncio) and ``litellm-async``
(``litellm.acompletion``, no Router).

Clients: ``httpx`` (a raw ``httpx.AsyncClient`` under trio), ``polygate``
(admission limits that never bind, hedging configured but not triggering; plain JSON
sources for the non-streamed workloads so every client sends the same request),
``openai`` (``openai.AsyncOpenAI``; its anyio core runs under trio), ``litellm``
(``litellm.Router`` with two deployments, asyncio) and ``floor`` (asyncio streams on
raw sockets, a hand-written request and Content-Length / chunked framing: the most a
Python client could do against this server).  Each repeat runs every client once, in
a rotated order; ratios are taken within a repeat (side by side) and the medians of
the repeats are reported.  ``cpu_us`` is the client process's CPU per call: on a
shared machine it is the steadiest figure.

    python benchmarks/peers.py                 # 2,000 / 10,000 / 10,000 / 200, 3 repeats
    python benchmarks/peers.py --quick         # small counts, under 2 minutes
    python benchmarks/peers.py --profile       # where raw httpx's (and polygate's) time goes
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from _common import fake_server, machine, median, quantile, write_result

CLIENTS = ("httpx", "polygate", "openai", "litellm", "floor", "aio", "openai-asyncio",
           "litellm-async")
#: The asyncio peers of polygate.aio: the same asyncio loop for all three.
ASYNCIO_PEERS = ("openai-asyncio", "litellm-async")
WORKLOADS = ("sequential", "c64", "c256", "streams")
MESSAGES = [{"role": "user", "content": "Say hello."}]
JSON_PARAMS: dict[str, Any] = {"model": "m", "max_tokens": 8}
API_KEY = "sk-bench"
HERE = Path(__file__).resolve().parent

Call = Callable[[], Awaitable[Any]]


# --------------------------------------------------------------------------- timing


def _summary(times: list[float], wall: float, cpu: float) -> dict[str, float]:
    n = len(times)
    return {
        "calls": n,
        "median_us": median(times) * 1e6,
        "p99_us": quantile(times, 0.99) * 1e6,
        "calls_per_s": n / wall,
        "cpu_us": cpu / n * 1e6,
    }


async def _trio_workload(call: Call, n: int, concurrency: int) -> dict[str, float]:
    import trio

    times: list[float] = []
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            await call()
            times.append(time.perf_counter() - t0)

    cpu0, t0 = time.process_time(), time.perf_counter()
    if concurrency == 1:
        await worker()
    else:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return _summary(times, time.perf_counter() - t0, time.process_time() - cpu0)


async def _asyncio_workload(call: Call, n: int, concurrency: int) -> dict[str, float]:
    times: list[float] = []
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            await call()
            times.append(time.perf_counter() - t0)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _summary(times, time.perf_counter() - t0, time.process_time() - cpu0)


async def _run_all(
    workload: Callable[[Call, int, int], Awaitable[dict[str, float]]],
    call: Call,
    stream: Call,
    counts: dict[str, int],
) -> dict[str, Any]:
    for _ in range(counts["warmup"]):
        await call()
    await stream()
    out: dict[str, Any] = {}
    out["sequential"] = await workload(call, counts["sequential"], 1)
    out["c64"] = await workload(call, counts["concurrent"], 64)
    out["c256"] = await workload(call, counts["concurrent"], 256)
    out["streams"] = await workload(stream, counts["streams"], 1)
    return out


# --------------------------------------------------------------------------- clients


def _polygate_settings(url: str, *, streaming: bool) -> Any:
    import polygate

    source = polygate.Source(
        name="a", base_url=url, api_key=API_KEY, model="m", streaming=streaming,
        rpm=10_000_000, tpm=10_000_000_000, max_in_flight=100_000, timeout_s=60,
    )
    other = polygate.Source(name="b", base_url=url, api_key=API_KEY, model="m",
                            streaming=streaming, weight=1e-9, timeout_s=60)
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[source, other], hedge=polygate.Hedge(after_s=30), call_deadline_s=50)})


async def client_polygate(url: str, counts: dict[str, int]) -> dict[str, Any]:
    import polygate

    async with polygate.session(_polygate_settings(url, streaming=False)) as plain, \
            polygate.session(_polygate_settings(url, streaming=True)) as streamed:

        async def call() -> None:
            response = await plain.chat(MESSAGES, max_tokens=8)
            assert response.text

        async def stream() -> None:
            n = 0
            async with streamed.stream_chat(MESSAGES) as chunks:
                async for _ in chunks:
                    n += 1
            assert n >= 200

        return await _run_all(_trio_workload, call, stream, counts)


async def client_aio(url: str, counts: dict[str, int]) -> dict[str, Any]:
    """polygate.aio from asyncio: the same calls as client_polygate."""
    import polygate.aio

    async with polygate.aio.session(_polygate_settings(url, streaming=False)) as plain, \
            polygate.aio.session(_polygate_settings(url, streaming=True)) as streamed:

        async def call() -> None:
            response = await plain.chat(MESSAGES, max_tokens=8)
            assert response.text

        async def stream() -> None:
            n = 0
            async with streamed.stream_chat(MESSAGES) as chunks:
                async for _ in chunks:
                    n += 1
            assert n >= 200

        return await _run_all(_asyncio_workload, call, stream, counts)


async def client_openai_asyncio(url: str, counts: dict[str, int]) -> dict[str, Any]:
    """openai.AsyncOpenAI on asyncio (client_openai runs it under trio)."""
    return await client_openai(url, counts, workload=_asyncio_workload)


async def client_litellm_acompletion(url: str, counts: dict[str, int]) -> dict[str, Any]:
    """litellm.acompletion on asyncio, no Router: its lightest path."""
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    kw = {"model": "openai/m", "api_base": url, "api_key": API_KEY, "max_retries": 0}

    async def call() -> None:
        r = await litellm.acompletion(messages=MESSAGES, max_tokens=8, **kw)
        assert r.choices[0].message.content

    async def stream() -> None:
        n = 0
        chunks = await litellm.acompletion(messages=MESSAGES, stream=True,
                                           stream_options={"include_usage": True}, **kw)
        async for _ in chunks:
            n += 1
        assert n >= 200

    return await _run_all(_asyncio_workload, call, stream, counts)


async def client_httpx(url: str, counts: dict[str, int]) -> dict[str, Any]:
    import httpx
    from httpx_sse import EventSource

    body = json.dumps({**JSON_PARAMS, "messages": MESSAGES}).encode()
    stream_body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True,
                              "stream_options": {"include_usage": True}}).encode()
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def call() -> None:
            r = await client.post(url + "/chat/completions", content=body, headers=headers)
            r.raise_for_status()
            assert r.json()["choices"][0]["message"]["content"]

        async def stream() -> None:
            n = 0
            async with client.stream("POST", url + "/chat/completions", content=stream_body,
                                     headers=headers) as r:
                async for event in EventSource(r).aiter_sse():
                    if event.data == "[DONE]":
                        break
                    json.loads(event.data)
                    n += 1
            assert n >= 200

        return await _run_all(_trio_workload, call, stream, counts)


async def client_openai(
    url: str, counts: dict[str, int],
    workload: Callable[[Call, int, int], Awaitable[dict[str, float]]] = _trio_workload,
) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=60)
    try:

        async def call() -> None:
            r = await client.chat.completions.create(messages=MESSAGES, **JSON_PARAMS)  # type: ignore[call-overload]
            assert r.choices[0].message.content

        async def stream() -> None:
            n = 0
            chunks = await client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
            )
            async for _ in chunks:
                n += 1
            assert n >= 200

        return await _run_all(workload, call, stream, counts)
    finally:
        await client.close()


async def client_litellm(url: str, counts: dict[str, int]) -> dict[str, Any]:
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    deployment = {"model_name": "m", "litellm_params": {
        "model": "openai/m", "api_base": url, "api_key": API_KEY, "max_retries": 0}}
    router = litellm.Router(model_list=[deployment, json.loads(json.dumps(deployment))],
                            num_retries=0)

    async def call() -> None:
        r = await router.acompletion(model="m", messages=MESSAGES, max_tokens=8)
        assert r.choices[0].message.content

    async def stream() -> None:
        n = 0
        chunks = await router.acompletion(model="m", messages=MESSAGES, stream=True,
                                          stream_options={"include_usage": True})
        async for _ in chunks:
            n += 1
        assert n >= 200

    return await _run_all(_asyncio_workload, call, stream, counts)


async def client_floor(url: str, counts: dict[str, int]) -> dict[str, Any]:
    """Raw sockets: one connection per worker, a prebuilt request, Content-Length or
    chunked framing read by hand.  No JSON parsing: the socket floor, not a client."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    def request(payload: dict[str, Any]) -> bytes:
        body = json.dumps(payload).encode()
        return (f"POST {parts.path}/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
                f"authorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body

    plain = request({**JSON_PARAMS, "messages": MESSAGES})
    streamed = request({"model": "m", "messages": MESSAGES, "stream": True})
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def exchange(data: bytes) -> bytes:
        conn = idle.pop() if idle else await asyncio.open_connection(host, port)
        reader, writer = conn
        writer.write(data)
        head = await reader.readuntil(b"\r\n\r\n")
        lowered = head.lower()
        if b"transfer-encoding: chunked" in lowered:
            body = await reader.readuntil(b"\r\n0\r\n\r\n")
        else:
            at = lowered.index(b"content-length:") + 15
            body = await reader.readexactly(int(lowered[at:lowered.index(b"\r\n", at)]))
        idle.append(conn)
        return body

    async def call() -> None:
        assert b'"content"' in await exchange(plain)

    async def stream() -> None:
        assert (await exchange(streamed)).count(b"data: ") >= 200

    try:
        return await _run_all(_asyncio_workload, call, stream, counts)
    finally:
        for _, writer in idle:
            writer.close()


RUNNERS: dict[str, tuple[str, Callable[[str, dict[str, int]], Awaitable[dict[str, Any]]]]] = {
    "httpx": ("trio", client_httpx),
    "polygate": ("trio", client_polygate),
    "openai": ("trio", client_openai),
    "litellm": ("asyncio", client_litellm),
    "floor": ("asyncio", client_floor),
    "aio": ("asyncio", client_aio),
    "openai-asyncio": ("asyncio", client_openai_asyncio),
    "litellm-async": ("asyncio", client_litellm_acompletion),
}


def worker_main(client: str, url: str, counts: dict[str, int]) -> None:
    """Child-process mode: run one client's workloads, print one JSON line."""
    loop, runner = RUNNERS[client]
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if loop == "trio":
        import trio

        result = trio.run(runner, url, counts)
    else:
        result = asyncio.run(runner(url, counts))
    result["event_loop"] = loop
    result["rss_at_start_mb"] = rss_start
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------- parent


def run_worker(client: str, url: str, counts: dict[str, int], limit_s: float) -> dict[str, Any]:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", client, "--url", url,
           "--counts", json.dumps(counts)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
    try:
        out, _ = proc.communicate(timeout=limit_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{client} worker failed with status {proc.returncode}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def _ratio(value: float, base: float) -> float:
    return value / base if base else float("nan")


def ratios(run: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Within one repeat: every client against raw httpx (times: client/httpx, lower is
    better; throughput: client/httpx, higher is better), polygate against each peer."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    base = run["httpx"]
    for client, result in run.items():
        per: dict[str, dict[str, float]] = {}
        for w in WORKLOADS:
            r, b = result[w], base[w]
            per[w] = {
                "time_vs_httpx": _ratio(r["median_us"], b["median_us"]),
                "p99_vs_httpx": _ratio(r["p99_us"], b["p99_us"]),
                "throughput_vs_httpx": _ratio(r["calls_per_s"], b["calls_per_s"]),
                "cpu_vs_httpx": _ratio(r["cpu_us"], b["cpu_us"]),
                "overhead_median_us": r["median_us"] - b["median_us"],
                "overhead_p99_us": r["p99_us"] - b["p99_us"],
            }
            if client == "aio":
                for peer in (*ASYNCIO_PEERS, "polygate"):
                    if peer in run:
                        per[w][f"throughput_vs_{peer}"] = _ratio(
                            r["calls_per_s"], run[peer][w]["calls_per_s"])
                        per[w][f"time_vs_{peer}"] = _ratio(r["median_us"], run[peer][w]["median_us"])
            if client == "polygate":
                for peer in ("openai", "litellm", "floor"):
                    if peer in run:
                        per[w][f"throughput_vs_{peer}"] = _ratio(
                            r["calls_per_s"], run[peer][w]["calls_per_s"])
                        per[w][f"time_vs_{peer}"] = _ratio(r["median_us"], run[peer][w]["median_us"])
        per["peak_rss_vs_httpx"] = {"ratio": _ratio(result["peak_rss_mb"], base["peak_rss_mb"])}
        out[client] = per
    return out


def _median_tree(trees: list[Any]) -> Any:
    """Element-wise median of equally shaped nested dicts of numbers."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: _median_tree([t[k] for t in trees if k in t]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return median([float(t) for t in trees])
    return first


def targets(med: dict[str, Any], rat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    checks: dict[str, tuple[float, str, float]] = {}
    if "polygate" in rat:
        pg = rat["polygate"]
        checks.update({
            "c64 throughput >= 3x raw httpx": (pg["c64"]["throughput_vs_httpx"], ">=", 3.0),
            "c256 throughput >= 3x raw httpx": (pg["c256"]["throughput_vs_httpx"], ">=", 3.0),
            "sequential per-call <= 0.8x raw httpx": (pg["sequential"]["time_vs_httpx"], "<=", 0.8),
        })
        if "floor" in med:
            checks["c64 throughput >= 0.3x floor"] = (pg["c64"]["throughput_vs_floor"], ">=", 0.3)
            checks["c256 throughput >= 0.3x floor"] = (pg["c256"]["throughput_vs_floor"], ">=", 0.3)
        for peer in ("openai", "litellm"):
            if peer not in med:
                continue
            for w in WORKLOADS:
                key = "throughput" if w.startswith("c") else "time"
                value = pg[w][f"{key}_vs_{peer}"]
                checks[f"{w}: faster than {peer}"] = (value, ">" if key == "throughput" else "<", 1.0)
    if "aio" in rat:
        aio = rat["aio"]
        for peer in ASYNCIO_PEERS:
            if peer not in med:
                continue
            for w in WORKLOADS:
                key = "throughput" if w.startswith("c") else "time"
                value = aio[w][f"{key}_vs_{peer}"]
                checks[f"aio {w}: faster than {peer}"] = (value, ">" if key == "throughput" else "<", 1.0)
        if "polygate" in med:
            checks["aio c64 throughput >= 0.9x polygate (trio)"] = (
                aio["c64"]["throughput_vs_polygate"], ">=", 0.9)
    out = {}
    for name, (value, op, bound) in checks.items():
        met = {">=": value >= bound, "<=": value <= bound, ">": value > bound, "<": value < bound}[op]
        out[name] = {"value": value, "bound": f"{op} {bound}", "met": bool(met)}
    return out


def report(med: dict[str, Any], rat: dict[str, Any], checks: dict[str, Any]) -> None:
    clients = list(med)
    print(f"\n{'per call (median of repeats)':<30}" + "".join(f"{c:>15}" for c in clients))
    rows = [("sequential", "median_us", "µs median"), ("sequential", "p99_us", "µs p99"),
            ("sequential", "cpu_us", "cpu µs/call"),
            ("c64", "calls_per_s", "calls/s"), ("c64", "cpu_us", "cpu µs/call"),
            ("c256", "calls_per_s", "calls/s"), ("c256", "cpu_us", "cpu µs/call"),
            ("streams", "median_us", "µs median"), ("streams", "p99_us", "µs p99")]
    for w, key, label in rows:
        print(f"{w + ' ' + label:<30}" + "".join(f"{med[c][w][key]:>15.0f}" for c in clients))
    print(f"{'peak RSS MB':<30}" + "".join(f"{med[c]['peak_rss_mb']:>15.1f}" for c in clients))
    print(f"\n{'ratio to raw httpx':<30}" + "".join(f"{c:>15}" for c in clients))
    for w in WORKLOADS:
        key = "throughput_vs_httpx" if w.startswith("c") else "time_vs_httpx"
        label = f"{w} {'throughput' if w.startswith('c') else 'time'}"
        print(f"{label:<30}" + "".join(f"{rat[c][w][key]:>15.2f}" for c in clients))
    print(f"{'sequential overhead µs':<30}"
          + "".join(f"{rat[c]['sequential']['overhead_median_us']:>15.0f}" for c in clients))
    print("\ntargets")
    for name, check in checks.items():
        print(f"  {'met ' if check['met'] else 'MISS'} {name:<40} {check['value']:.2f} ({check['bound']})")


def profile(url: str, n: int) -> dict[str, Any]:
    """cProfile raw httpx and polygate at c=256; time grouped by where it is spent."""
    import cProfile
    import pstats

    import trio

    groups = {
        "httpcore connection pool": ("httpcore/_async/connection_pool.py",),
        "httpcore connection + http11": ("httpcore/_async/connection.py", "httpcore/_async/http11.py",
                                         "httpcore/_backends", "httpcore/_models.py"),
        "h11 parsing/serialising": ("/h11/",),
        "httpx client and models": ("/httpx/",),
        "polygate transport (LeanTransport)": ("polygate/transport/_pool.py",),
        "polygate (call, hedge, admission, SSE)": ("/polygate/",),
        "trio scheduler and sockets": ("/trio/",),
        "socket syscalls": ("<method 'send'", "<method 'recv'", "<method 'poll'", "epoll"),
    }
    out: dict[str, Any] = {}
    for client in ("httpx", "polygate"):
        counts = {"warmup": 50, "sequential": 1, "concurrent": n, "streams": 1}
        runner = RUNNERS[client][1]
        prof = cProfile.Profile()
        prof.enable()
        trio.run(runner, url, counts)
        prof.disable()
        stats = pstats.Stats(prof)
        total = 0.0
        grouped = dict.fromkeys([*groups, "other"], 0.0)
        top: list[tuple[float, str]] = []
        for (file, line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            total += tt
            where = f"{file}:{line}({func})"
            top.append((tt, where))
            for name, needles in groups.items():
                if any(s in where for s in needles):
                    grouped[name] += tt
                    break
            else:
                grouped["other"] += tt
        top.sort(reverse=True)
        # httpcore's pool walks every connection for every queued request each time a
        # request enters or leaves it: its cumulative time, callees included.
        scheduling = sum(ct for (file, _l, func), (_cc, _nc, _tt, ct, _c) in stats.stats.items()  # type: ignore[attr-defined]
                         if func == "_assign_requests_to_connections" and "httpcore" in file)
        out[client] = {
            "total_s": total,
            "httpcore_pool_scheduling_pct": 100 * scheduling / total,
            "share_pct": {k: 100 * v / total for k, v in grouped.items() if v},
            "top": [{"tottime_s": t, "where": w.replace(str(Path(sys.prefix)), "<venv>")}
                    for t, w in top[:15]],
        }
        print(f"\n{client}: {total:.2f} s profiled ({n} calls at c=64 and c=256)")
        if scheduling:
            print(f"  {100 * scheduling / total:5.1f} %  httpcore pool scheduling, cumulative"
                  " (_assign_requests_to_connections and its callees)")
        for k, v in sorted(out[client]["share_pct"].items(), key=lambda kv: -kv[1]):
            print(f"  {v:5.1f} %  {k}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sequential", type=int, default=2000)
    parser.add_argument("--concurrent", type=int, default=10_000)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--profile", action="store_true", help="profile raw httpx and polygate")
    parser.add_argument("--name", help="results file name (default: peers, peers-quick)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--counts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.url, json.loads(args.counts))
        return
    if args.quick:
        args.sequential, args.concurrent, args.streams = 150, 600, 15
    counts = {"warmup": 20 if args.quick else 100, "sequential": args.sequential,
              "concurrent": args.concurrent, "streams": args.streams}
    clients = [c for c in args.clients.split(",") if c]
    if "httpx" not in clients:
        parser.error("the httpx client is the baseline: keep it in --clients")
    # A peer that is not installed (litellm is in the ``bench`` extra) is left out, with
    # a word, before anything runs: its worker failing would lose every other result.
    for peer, module in (("openai", "openai"), ("openai-asyncio", "openai"),
                         ("litellm", "litellm"), ("litellm-async", "litellm")):
        if peer in clients and importlib.util.find_spec(module) is None:
            print(f"{peer}: left out, {module} is not installed (pip install -e '.[bench]')")
            clients.remove(peer)
    with fake_server({"tokens": 200}) as url:
        if args.profile:
            result = profile(url, 1000 if args.quick else 4000)
            path = write_result("peers-profile", {"machine": machine(), **result})
            print(f"\nresults: {path}")
            return
        runs: list[dict[str, dict[str, Any]]] = []
        for repeat in range(args.repeats):
            order = clients[repeat % len(clients):] + clients[: repeat % len(clients)]
            run: dict[str, dict[str, Any]] = {}
            for client in order:
                run[client] = run_worker(client, url, counts, limit_s=1800)
                print(f"repeat {repeat + 1}: {client} done", file=sys.stderr, flush=True)
            runs.append({c: run[c] for c in clients})
    med = _median_tree(runs)
    rat = _median_tree([ratios(r) for r in runs])
    checks = targets(med, rat)
    report(med, rat, checks)
    payload = {"machine": machine(), "counts": counts, "repeats": args.repeats,
               "median": med, "ratios": rat, "targets": checks, "runs": runs}
    path = write_result(args.name or ("peers-quick" if args.quick else "peers"), payload)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
