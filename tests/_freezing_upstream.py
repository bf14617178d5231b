"""An upstream, in a process of its own, that freezes its client while it streams.

Run as ``python tests/_freezing_upstream.py``: prints its port, then answers each chat
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


def _event(obj: object) -> bytes:
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _delta(content: str | None, finish: str | None = None) -> bytes:
    return _event({"id": "f", "object": "chat.completion.chunk", "created": 0, "model": "m",
                   "choices": [{"index": 0, "delta": {} if content is None else {"content": content},
                                "finish_reason": finish}]})


async def _answer(stream: trio.SocketStream, model: str) -> None:
    _, pid, pre, stop_ms, token_ms, cont_ms = model.split(":")
    start = trio.current_time()
    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                          b"transfer-encoding: chunked\r\n\r\n")
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
    await stream.send_all(_delta("after ") + _delta(None, "stop") + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


async def _serve(stream: trio.SocketStream) -> None:
    data = b""
    async with stream:
        try:
            while True:
                while b"\r\n\r\n" not in data:
                    more = await stream.receive_some(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                              if line.lower().startswith(b"content-length:"))
                while len(data) < length:
                    more = await stream.receive_some(65536)
                    if not more:
                        return
                    data += more
                body, data = data[:length], data[length:]
                await _answer(stream, json.loads(body)["model"])
        except trio.BrokenResourceError:
            pass


async def _main() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(_serve, listeners)


if __name__ == "__main__":
    try:
        trio.run(_main)
    except KeyboardInterrupt:
        sys.exit(0)
