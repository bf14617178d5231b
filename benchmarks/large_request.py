"""How long one large request to ``polygate serve`` holds the gateway's event loop.

Everything else the gateway does (other clients' requests, streams' tokens) waits
while the loop is held.  A gateway (``polygate.serve.open_server``) runs in this
process beside a ticker task that wakes every 0.5 ms; a client in a thread sends one
large chat request over a raw socket to a zero-delay FakeUpstream in its own process.
The figure is the longest gap between the ticker's wake-ups during the request, next
to what reading the same body once costs (``json.loads``, the standard library,
timed here, in the same run): the ratio says how many such reads the gateway's
holding is worth.

Shapes (each at about 1 MiB and just under the 8 MiB default ``max_request_bytes``):

* ``tools``: an agent's conversation, assistant tool calls and tool results in turn;
* ``text``: a few messages of long text.

    python benchmarks/large_request.py
    python benchmarks/large_request.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any

from _common import fake_server, machine, median, write_result

_KEY = "sk-gw-bench-key-1234"
_LIMIT = 8 * 1024 * 1024


def _tools(size: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Plan the trip."}]
    used = 0
    i = 0
    while used < size:
        call = {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"city": "Paris", "day": i})},
        }]}
        result = {"role": "tool", "tool_call_id": f"call_{i}", "content": f"Sunny, {i % 30} C."}
        messages += [call, result]
        used += 260
        i += 1
    return messages


def _text(size: int) -> list[dict[str, Any]]:
    line = "The quick brown fox jumps over the lazy dog. "
    return [{"role": "user", "content": line * (size // 4 // len(line))} for _ in range(4)]


def _body(shape: str, size: int) -> bytes:
    messages = _tools(size) if shape == "tools" else _text(size)
    body = json.dumps({"model": "chat", "messages": messages, "max_tokens": 8}).encode()
    while len(body) > _LIMIT - 1024:  # under the limit, whatever the estimate above
        messages = messages[: len(messages) * 9 // 10]
        body = json.dumps({"model": "chat", "messages": messages, "max_tokens": 8}).encode()
    return body


def _post(port: int, body: bytes) -> int:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {_KEY}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


async def _held(settings: Any, body: bytes) -> tuple[float, float]:
    """(the longest gap between the ticker's wake-ups, the request's wall time)."""
    import trio

    from polygate.serve import open_server

    longest = 0.0
    async with open_server(settings, port=0) as server, trio.open_nursery() as nursery:
        async def tick() -> None:
            nonlocal longest
            last = time.perf_counter()
            while True:
                await trio.sleep(0.0005)
                now = time.perf_counter()
                longest = max(longest, now - last)
                last = now

        await trio.to_thread.run_sync(_post, server.port, b'{"model": "chat", "messages": '
                                      b'[{"role": "user", "content": "warm"}]}')
        nursery.start_soon(tick)
        await trio.sleep(0.01)
        started = time.perf_counter()
        status = await trio.to_thread.run_sync(_post, server.port, body)
        took = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    if status != 200:
        raise RuntimeError(f"the gateway answered {status}")
    return longest, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import trio

    import polygate

    sizes = [64 * 1024] if args.quick else [1024 * 1024, _LIMIT]
    repeats = 1 if args.quick else args.repeats
    rows = []
    with fake_server({"text": "ok", "tokens": 2}) as url:
        source = polygate.Source(name="a", base_url=url, model="m1", api_key="sk-upstream")
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[source])},
            serve=polygate.Serve(api_keys=(_KEY,)),
        )
        print(f"{'shape':<6} {'body':>9} {'loop held':>10} {'request':>9} "
              f"{'json.loads':>11} {'held/loads':>11}")
        for shape in ("tools", "text"):
            for size in sizes:
                body = _body(shape, size)
                held, took, reads = [], [], []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    json.loads(body)
                    reads.append(time.perf_counter() - t0)
                    h, t = trio.run(_held, settings, body)
                    held.append(h)
                    took.append(t)
                row = {"shape": shape, "bytes": len(body), "held_ms": median(held) * 1e3,
                       "request_ms": median(took) * 1e3, "json_loads_ms": median(reads) * 1e3}
                row["ratio"] = row["held_ms"] / row["json_loads_ms"]
                rows.append(row)
                print(f"{shape:<6} {len(body) / 2**20:>7.2f}Mi {row['held_ms']:>8.1f}ms "
                      f"{row['request_ms']:>7.1f}ms {row['json_loads_ms']:>9.1f}ms "
                      f"{row['ratio']:>10.2f}x")
    if not args.quick:
        write_result("large_request", {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
