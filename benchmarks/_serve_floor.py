"""The floor for ``polygate serve``'s added latency (``benchmarks/serve.py --floor``): a
proxy on trio that does no work at all.

It reads a request's head and body off the socket (finding only Content-Length), sends
the body to the upstream unchanged on one kept-alive connection per client
connection, and copies the upstream's body back. There is no HTTP library, no
validation, no key check, no JSON and no streaming from the upstream.  What it adds
over going direct is the price of one more hop on this machine: two more sockets, two
more process wake-ups and trio's scheduling. No gateway that does real work can add
less.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

import trio

_HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n" \
    b'{"status":"ok"}'


def _length(head: bytes) -> int:
    head = head.lower() + b"\r\n"
    at = head.find(b"content-length:")
    if at < 0:
        return 0
    return int(head[at + 15:head.index(b"\r\n", at)])


async def _message(stream: trio.SocketStream, buffer: bytes) -> tuple[bytes, bytes, bytes] | None:
    """One head and body, and what followed them; None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = _length(head)
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        rest += data
    return head, rest[:length], rest[length:]


async def _client(stream: trio.SocketStream, upstream: tuple[str, int], path: bytes) -> None:
    up: trio.SocketStream | None = None
    buffer = from_upstream = b""
    try:
        while True:
            got = await _message(stream, buffer)
            if got is None:
                return
            head, body, buffer = got
            if head.startswith(b"GET"):
                await stream.send_all(_HEALTHY)
                continue
            if up is None:
                up = await trio.open_tcp_stream(*upstream)
            await up.send_all(
                b"POST %s HTTP/1.1\r\nhost: upstream\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % (path, len(body)) + body
            )
            answer = await _message(up, from_upstream)
            if answer is None:
                return
            _, answer_body, from_upstream = answer
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(answer_body) + answer_body
            )
    except trio.BrokenResourceError:
        return
    finally:
        if up is not None:
            await up.aclose()


async def _main(upstream_url: str) -> None:
    parts = urlsplit(upstream_url)
    upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
    path = (parts.path.rstrip("/") + "/chat/completions").encode()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(f"listening on http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", flush=True)

    async def handler(stream: trio.SocketStream) -> None:
        await _client(stream, upstream, path)

    await trio.serve_listeners(handler, listeners)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True, help="the upstream's base URL")
    trio.run(_main, parser.parse_args().upstream)


if __name__ == "__main__":
    main()
