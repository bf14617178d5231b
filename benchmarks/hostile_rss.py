"""Peak RSS, CPU and event-loop lag of one call against a hostile upstream, default
settings (32 MiB body cap), the server in its own process.

Complements ``../shared/security/exhaust.py`` (the review's scenarios) with the shapes
the hardening added caps for.  Each scenario runs in a fresh process whose address
space is capped at 3 GiB, so a bomb ends in MemoryError rather than the OOM killer.

    python benchmarks/hostile_rss.py                        # every scenario
    python benchmarks/hostile_rss.py wide_json              # one
    python benchmarks/hostile_rss.py --polygate /path/tree  # another source tree
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import trio

MiB = 1024 * 1024
SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
Reply = Callable[[trio.SocketStream], Awaitable[None]]


def _events(make: Callable[[int], dict[str, object]], total: int) -> list[bytes]:
    out, size, i = [], 0, 0
    while size < total:
        event = b"data: " + json.dumps(make(i), separators=(",", ":")).encode() + b"\n\n"
        out.append(event)
        size += len(event)
        i += 1
    return out


def scenario(name: str) -> Reply:
    if name == "choice_flood_with_content":
        events = _events(lambda i: {"choices": [
            {"index": i * 100 + j, "delta": {"content": "x"}} for j in range(100)]}, 30 * MiB)
    elif name == "tool_call_flood":
        events = _events(lambda i: {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i * 100 + j, "function": {"name": "f"}} for j in range(100)]}}]}, 30 * MiB)
    elif name == "wide_json_extras":  # small containers retained across events
        events = _events(lambda i: {"x": [[]] * 50_000}, 30 * MiB)
    elif name == "deep_json_129":
        events = [b"data: " + b"[" * 129 + b"]" * 129 + b"\n\n"]
    else:
        raise SystemExit(f"unknown scenario {name}")

    async def reply(stream: trio.SocketStream) -> None:
        await stream.send_all(SSE)
        for event in events:
            await stream.send_all(event)
        await stream.send_all(b"data: [DONE]\n\n")

    return reply


NAMES = ["choice_flood_with_content", "tool_call_flood", "wide_json_extras", "deep_json_129"]


async def serve(name: str) -> None:
    reply = scenario(name)

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        try:
            await reply(stream)
        except trio.BrokenResourceError:
            pass

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(handle, listeners)


async def client(name: str, port: int) -> str:
    import polygate

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-x-0123456789",
                                 timeout_s=60)],
        retry=polygate.Retry(max_attempts=1),
    )})
    lag = [0.0]

    async def probe() -> None:
        while True:
            start = trio.current_time()
            await trio.sleep(0.01)
            lag[0] = max(lag[0], trio.current_time() - start - 0.01)

    began = time.perf_counter()
    async with polygate.session(settings) as s, trio.open_nursery() as nursery:
        nursery.start_soon(probe)
        try:
            response = await s.chat([{"role": "user", "content": "hi"}])
            outcome = f"returned, {len(response.choices)} choice(s)"
        except polygate.PolygateError as exc:
            errors = getattr(exc, "errors", None) or [exc]
            outcome = f"{type(exc).__name__}: {str(errors[0])[:90]}"
        except MemoryError:
            outcome = "MemoryError"
        nursery.cancel_scope.cancel()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (f"{name:<28}{time.perf_counter() - began:7.2f}s  peak RSS {peak:6.0f} MiB  "
            f"cpu {time.process_time():5.1f}s  lag {lag[0] * 1000:5.0f} ms  {outcome}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", default=NAMES)
    parser.add_argument("--polygate", help="import polygate from this source tree")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args.serve)
        return
    if args.client:
        limit = 3 * 1024**3
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(trio.run(client, args.client[0], int(args.client[1])), flush=True)
        return
    env = dict(os.environ)
    if args.polygate:
        env["PYTHONPATH"] = args.polygate
    for name in args.names:
        server = subprocess.Popen([sys.executable, __file__, "--serve", name], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            done = subprocess.run([sys.executable, __file__, "--client", name, port], env=env,
                                  capture_output=True, text=True, timeout=300, cwd="/")
            print(done.stdout.strip() or f"{name}: rc={done.returncode} {done.stderr.strip()[-300:]}", flush=True)
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
