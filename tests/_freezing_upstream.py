"""An upstream, in a process of its own, that freezes its client while it streams.

Run as ``python -m tests._freezing_upstream``: prints its port, then answers each chat
request (streamed) as the request's ``model`` says, ``freeze:PID:PRE:STOP:TOKEN:CONT``:
``PRE`` tokens at once, then ``SIGSTOP`` to the process ``PID`` at ``STOP`` ms, a token
at ``TOKEN`` ms (during the freeze), ``SIGCONT`` at ``CONT`` ms, and the rest of the
answer.  Times are from the request.  The client's loop is frozen while it waits in
its poll, as a container's spent CPU quota or a paused VM freezes it: a freeze the
client's own code cannot make (a blocked loop is a turn, not a late poll).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import trio

from tests._raw_server import chunk, raw_server, sse_head


def _event(obj: object) -> bytes:
    return chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _delta(content: str | None, finish: str | None = None) -> bytes:
    return _event({"id": "f", "object": "chat.completion.chunk", "created": 0, "model": "m",
                   "choices": [{"index": 0, "delta": {} if content is None else {"content": content},
                                "finish_reason": finish}]})


async def _answer(stream: trio.SocketStream, model: str) -> None:
    _, pid, pre, stop_ms, token_ms, cont_ms = model.split(":")
    start = trio.current_time()
    await stream.send_all(sse_head(b"transfer-encoding: chunked\r\n") + b"\r\n")
    for i in range(int(pre)):
        await stream.send_all(_delta(f"early{i} "))
    await trio.sleep_until(start + int(stop_ms) / 1000)
    os.kill(int(pid), signal.SIGSTOP)
    try:
        await trio.sleep_until(start + int(token_ms) / 1000)
        await stream.send_all(_delta("on-time "))
        await trio.sleep_until(start + int(cont_ms) / 1000)
    finally:
        os.kill(int(pid), signal.SIGCONT)
    await stream.send_all(_delta("after ") + _delta(None, "stop") + chunk(b"data: [DONE]\n\n")
                          + b"0\r\n\r\n")


async def _main() -> None:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        body = server.requests[-1].partition(b"\r\n\r\n")[2]
        await _answer(stream, json.loads(body)["model"])

    async with raw_server(reply) as server:
        print(server.port, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    try:
        trio.run(_main)
    except KeyboardInterrupt:
        sys.exit(0)
