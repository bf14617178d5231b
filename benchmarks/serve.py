"""``polygate serve`` against going direct, and against LiteLLM's proxy, side by side.

One zero-delay FakeUpstream server runs in its own process; each gateway runs in its
own process in front of it; the load generator (asyncio on raw sockets, keep-alive
connections, prebuilt requests) runs here.  Targets are measured through the gateway
and straight to the upstream in the same run, interleaved, so machine noise hits
both; the figures are the medians over ``--repeats`` rounds of the per-round
differences and ratios.

* ``added latency`` at 100 and 500 RPS: an open-loop schedule (request *i* leaves at
  ``t0 + i/rps`` whatever happened before, so a stall shows as latency and is not
  hidden by coordinated omission); latency is measured from the scheduled time.
  Added = gateway quantile − direct quantile.
* ``max RPS``: closed loop, 64 connections, for ``--duration`` seconds.
* ``streams``: N concurrent 50 tokens/s streams (100 tokens each, starts spread over
  a second); a token's lateness is its arrival − request sent − its place in the
  schedule; added = gateway p99 − direct p99.  N doubles until the added p99 passes
  10 ms.
* ``start-up``: process start → the first ``/healthz`` answered.

Gateways: ``polygate`` (``python -m polygate serve``), ``hypercorn`` (the same
session behind a minimal ASGI app on hypercorn's trio worker, ``_serve_asgi.py``; the
server-library comparison, ``--libraries``), ``litellm`` (``litellm --config`` in
``--litellm-venv``, one worker), ``floor`` (a trio proxy that does no work,
``_serve_floor.py``, ``--floor``: what one more hop alone adds on this machine).

    python benchmarks/serve.py                      # polygate vs direct vs LiteLLM, 3 rounds
    python benchmarks/serve.py --libraries          # + hypercorn: the server-library choice
    python benchmarks/serve.py --floor              # + the no-work proxy: the hop's own price
    python benchmarks/serve.py --quick              # a smoke run (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from _common import fake_server, machine, median, quantile, wake_cpu_us, write_result

HERE = Path(__file__).resolve().parent
KEY = "sk-gateway-bench"
BODY = {"model": "chat", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
STREAM_TOKENS = 100
TOKEN_GAP_S = 0.02  # 50 tokens/s
_TOKEN = re.compile(rb'"content":"[^"]')  # a content delta; not a role chunk's ""


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its descendants, from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(p, 0.0) for p in tree)


def wait_healthy(url: str, proc: subprocess.Popen[Any], limit_s: float) -> None:
    give_up = time.monotonic() + limit_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        if time.monotonic() > give_up:
            raise RuntimeError(f"{url}: not healthy after {limit_s} s")
        time.sleep(0.01)


def polygate_toml(upstream: str, path: Path) -> Path:
    path.write_text(
        f'[serve]\napi_keys = ["{KEY}"]\nmax_connections = 8192\n\n'
        f'[scopes.chat.sources.a]\nbase_url = "{upstream}"\nmodel = "m1"\n'
    )
    return path


@contextlib.contextmanager
def gateway(kind: str, upstream: str, workdir: Path, litellm_venv: str) -> Iterator[dict[str, Any]]:
    """Start one gateway in front of ``upstream``; yields its base URL and start-up time."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    if kind in ("polygate", "hypercorn", "floor"):  # each prints "listening on URL"
        config = polygate_toml(upstream, workdir / f"{kind}.toml")
        cmd = {
            "polygate": [sys.executable, "-m", "polygate", "serve", "--config", str(config), "--port", "0"],
            "hypercorn": [sys.executable, str(HERE / "_serve_asgi.py"), "--config", str(config)],
            "floor": [sys.executable, str(HERE / "_serve_floor.py"), "--upstream", upstream],
        }[kind]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if "listening on " not in line:
            proc.kill()
            raise RuntimeError(f"{kind} did not start: {line!r}")
        root = line.split("listening on ", 1)[1]
        health = root + "/healthz"
    else:
        port = free_port()
        yaml = workdir / "litellm.yaml"
        yaml.write_text(
            "model_list:\n  - model_name: chat\n    litellm_params:\n"
            f"      model: openai/m1\n      api_base: {upstream}\n      api_key: sk-upstream\n"
            f"general_settings:\n  master_key: {KEY}\n"
            "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
        )
        env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
        cmd = [str(Path(litellm_venv) / "bin" / "litellm"), "--config", str(yaml),
               "--port", str(port), "--host", "127.0.0.1", "--num_workers", "1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, cwd=workdir)
        root = f"http://127.0.0.1:{port}"
        health = root + "/health/liveliness"
    try:
        wait_healthy(health, proc, 120)
        yield {"url": root + "/v1", "startup_s": time.monotonic() - started, "pid": proc.pid}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- the client


def build_request(url: str, body: dict[str, Any], auth: bool) -> bytes:
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST {parts.path}/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            "content-type: application/json\r\n")
    if auth:
        head += f"authorization: Bearer {KEY}\r\n"
    return (head + f"content-length: {len(data)}\r\n\r\n").encode() + data


class Client:
    """At most ``size`` keep-alive connections to one origin, one request at a time on
    each; a request waits for a free connection (so an open-loop schedule that falls
    behind queues, as wrk2's does, instead of opening ever more connections)."""

    def __init__(self, url: str, size: int = 64) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.free = asyncio.Semaphore(size)

    async def exchange(self, request: bytes) -> int:
        async with self.free:
            conn = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
            reader, writer = conn
            try:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                lowered = head.lower()
                if b"transfer-encoding: chunked" in lowered:
                    await reader.readuntil(b"\r\n0\r\n\r\n")
                else:
                    at = lowered.index(b"content-length:") + 15
                    await reader.readexactly(int(lowered[at:lowered.index(b"\r\n", at)]))
            except (OSError, asyncio.IncompleteReadError):
                writer.close()
                return 0  # reset or closed: counted as an error
            if b"connection: close" in lowered:
                writer.close()
            else:
                self.idle.append(conn)
            return int(head[9:12])

    async def stream(self, request: bytes) -> list[float]:
        """Send a streamed request on a connection of its own; the arrival time of each
        content event."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        sent = time.perf_counter()
        writer.write(request)
        times: list[float] = []
        buffer = b""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                now = time.perf_counter()
                buffer += data
                times += [now - sent] * len(_TOKEN.findall(data))
                if b"data: [DONE]" in buffer or buffer.endswith(b"\r\n0\r\n\r\n"):
                    break
                buffer = buffer[-16:]
        except OSError:
            pass
        finally:
            writer.close()
        return times

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def open_loop(url: str, auth: bool, rps: float, seconds: float) -> dict[str, float]:
    client = Client(url)
    request = build_request(url, BODY, auth)
    # Warm the connections: the figure is the steady state, not connects.
    await asyncio.gather(*(client.exchange(request) for _ in range(64)))
    n = int(rps * seconds)
    latencies: list[float] = []
    errors = 0
    t0 = time.perf_counter() + 0.05

    async def one(i: int) -> None:
        nonlocal errors
        due = t0 + i / rps
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        status = await client.exchange(request)
        latencies.append(time.perf_counter() - due)
        errors += status != 200

    await asyncio.gather(*(one(i) for i in range(n)))
    client.close()
    _all_answered(url, errors, n)
    return {"p50_ms": quantile(latencies, 0.5) * 1e3, "p99_ms": quantile(latencies, 0.99) * 1e3,
            "errors": errors, "n": n}


def _all_answered(url: str, errors: int, n: int) -> None:
    """A run whose answers were not all 200 times failures (a 401 comes back faster
    than an answer): it stops instead of printing figures that flatter."""
    if errors:
        raise SystemExit(f"{url}: {errors} of {n} answers were not 200 (a key, an "
                         "upstream, a limit?): these figures would time failures")


async def closed_loop(url: str, auth: bool, concurrency: int, seconds: float) -> tuple[float, int]:
    """Requests per second, and how many were made."""
    client = Client(url)
    request = build_request(url, BODY, auth)
    done = errors = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            status = await client.exchange(request)
            done += 1
            errors += status != 200

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    client.close()
    _all_answered(url, errors, done)
    return done / elapsed, done


async def streams(url: str, auth: bool, n: int) -> dict[str, Any]:
    client = Client(url)
    body = {**BODY, "stream": True, "max_tokens": STREAM_TOKENS}
    request = build_request(url, body, auth)
    lateness: list[float] = []
    short = 0

    async def one(i: int) -> None:
        nonlocal short
        await asyncio.sleep(i / n)  # starts spread over a second
        times = await client.stream(request)
        if len(times) < STREAM_TOKENS:
            short += 1
        lateness.extend(t - k * TOKEN_GAP_S for k, t in enumerate(times))

    await asyncio.gather(*(one(i) for i in range(n)))
    return {"p50_ms": quantile(lateness, 0.5) * 1e3, "p99_ms": quantile(lateness, 0.99) * 1e3,
            "short_streams": short, "tokens": len(lateness)}


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = ["polygate"] + (["hypercorn"] if args.libraries else []) + (["floor"] if args.floor else [])
    if not args.no_litellm:
        kinds.append("litellm")
    if args.streams_only:
        kinds = []
    seconds = 1.5 if args.quick else args.duration
    repeats = 1 if args.quick else args.repeats
    rates = (100, 500)
    results: dict[str, Any] = {"machine": machine(), "rounds": []}
    stream_reply = {"tokens": STREAM_TOKENS, "inter_token_s": TOKEN_GAP_S}
    with fake_server() as upstream, fake_server(stream_reply, seed=1) as stream_upstream, \
            tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for round_ in range(repeats):
            # What every blocking wait costs on the machine this round (see
            # _common.wake_cpu_us): the hop's price moves with it.
            rnd: dict[str, Any] = {"direct": {}, "gateways": {}, "wake_cpu_us": wake_cpu_us()}
            print(f"round {round_ + 1}: a sleep and wake-up costs {rnd['wake_cpu_us']} µs of CPU here",
                  flush=True)
            order = kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)] if kinds else []
            for kind in order if kinds else ():
                with gateway(kind, upstream, workdir, args.litellm_venv) as gw:
                    figures: dict[str, Any] = {"startup_s": gw["startup_s"]}
                    for rps in rates:
                        if kind == "litellm" and rps > 100:
                            continue  # it does not sustain it (see max_rps)
                        # Interleaved: direct, then through the gateway, same schedule.
                        direct = asyncio.run(open_loop(upstream, False, rps, seconds))
                        via = asyncio.run(open_loop(gw["url"], True, rps, seconds))
                        rnd["direct"].setdefault(f"{rps}rps", []).append(direct)
                        figures[f"{rps}rps"] = via
                        figures[f"{rps}rps_added_p50_ms"] = via["p50_ms"] - direct["p50_ms"]
                        figures[f"{rps}rps_added_p99_ms"] = via["p99_ms"] - direct["p99_ms"]
                    cpu0 = tree_cpu_s(gw["pid"])
                    figures["max_rps"], done = asyncio.run(closed_loop(gw["url"], True, 64, seconds))
                    # The steadiest figure on a shared machine: the gateway's own CPU.
                    figures["cpu_ms_per_request"] = (tree_cpu_s(gw["pid"]) - cpu0) / done * 1e3
                    direct_max, _ = asyncio.run(closed_loop(upstream, False, 64, seconds))
                    rnd["direct"].setdefault("max_rps", []).append(direct_max)
                    rnd["gateways"][kind] = figures
                    print(f"round {round_ + 1} {kind}: {json.dumps(_short(figures))}", flush=True)
            if not args.no_streams:
                rnd["streams"] = stream_ramp(stream_upstream, workdir, args, quick=args.quick)
            results["rounds"].append(rnd)
    results["summary"] = summarise(results["rounds"], kinds)
    return results


def stream_ramp(upstream: str, workdir: Path, args: argparse.Namespace, quick: bool) -> list[dict[str, Any]]:
    levels = [25, 50] if quick else [25, 50, 100, 200, 400, 800, 1600]
    out = []
    with gateway("polygate", upstream, workdir, args.litellm_venv) as gw:
        for n in levels:
            direct = asyncio.run(streams(upstream, False, n))
            cpu0 = tree_cpu_s(gw["pid"])
            via = asyncio.run(streams(gw["url"], True, n))
            cpu_us = (tree_cpu_s(gw["pid"]) - cpu0) / max(1, via["tokens"]) * 1e6
            added = via["p99_ms"] - direct["p99_ms"]
            out.append({"streams": n, "direct": direct, "gateway": via, "added_p99_ms": added,
                        "gateway_cpu_us_per_token": cpu_us})
            print(f"streams {n}: added p99 {added:.2f} ms (direct p99 {direct['p99_ms']:.2f}, "
                  f"gateway {via['p99_ms']:.2f}, short {via['short_streams']}, "
                  f"gateway CPU {cpu_us:.0f} µs/token)", flush=True)
            if added > 10 or via["short_streams"]:
                break
    return out


def _short(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()
            if not isinstance(v, dict)}


def summarise(rounds: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for kind in kinds:
        keys = {k for r in rounds for k, v in r["gateways"].get(kind, {}).items()
                if not isinstance(v, dict)}
        summary[kind] = {k: median([r["gateways"][kind][k] for r in rounds
                                    if k in r["gateways"].get(kind, {})]) for k in sorted(keys)}
        spread = [r["gateways"][kind].get("500rps_added_p50_ms") for r in rounds]
        summary[kind]["500rps_added_p50_ms_all"] = spread
    if kinds:
        summary["direct_max_rps"] = median([x for r in rounds for x in r["direct"]["max_rps"]])
    if "litellm" in summary:
        pg, ll = summary["polygate"], summary["litellm"]
        summary["vs_litellm"] = {
            "throughput_ratio": pg["max_rps"] / ll["max_rps"],
            "cpu_per_request_ratio": pg["cpu_ms_per_request"] / ll["cpu_ms_per_request"],
            "added_p50_ratio_100rps": pg["100rps_added_p50_ms"] / ll["100rps_added_p50_ms"],
            "added_p99_ratio_100rps": pg["100rps_added_p99_ms"] / ll["100rps_added_p99_ms"],
            "startup_ratio": pg["startup_s"] / ll["startup_s"],
        }
    ramps = [r["streams"] for r in rounds if "streams" in r]
    if ramps:
        summary["streams_max_within_10ms"] = median([
            max([lvl["streams"] for lvl in ramp if lvl["added_p99_ms"] <= 10
                 and not lvl["gateway"]["short_streams"]], default=0) for ramp in ramps])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--libraries", action="store_true", help="also hypercorn's trio worker")
    parser.add_argument("--floor", action="store_true",
                        help="also a proxy that does no work: the added latency of the hop alone")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--no-streams", action="store_true")
    parser.add_argument("--streams-only", action="store_true", help="only the streams ramp")
    parser.add_argument("--litellm-venv", default=os.environ.get("LITELLM_VENV", "/work/venv-litellm"))
    args = parser.parse_args()
    if not args.no_litellm and not (Path(args.litellm_venv) / "bin" / "litellm").exists():
        print(f"no LiteLLM proxy in {args.litellm_venv}: running without it", file=sys.stderr)
        args.no_litellm = True
    results = run(args)
    print(json.dumps(results["summary"], indent=2))
    if not args.quick:
        print("written to", write_result("serve", results))


if __name__ == "__main__":
    main()
