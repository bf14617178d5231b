"""The server-library comparison's other contestant: the same session behind a minimal
ASGI app on hypercorn's trio worker (``benchmarks/serve.py --libraries``).

Only what the benchmark sends is implemented (``POST /v1/chat/completions`` as JSON,
``GET /healthz``, the Bearer key), with the same JSON encoding and headers as
``polygate serve``, so the difference measured is the server library.
"""

from __future__ import annotations

import argparse
import json
import socket
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio

import polygate
from polygate._config_load import settings_from_toml

_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def make_app(session: polygate.Session, key: str) -> Any:
    expected = f"Bearer {key}".encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/healthz":
            await respond(send, 200, b'{"status":"ok"}', [])
            return
        if dict(scope["headers"]).get(b"authorization") != expected:
            await respond(send, 401, b'{"error":{"message":"bad key"}}', [])
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        params = json.loads(body)
        messages = params.pop("messages")
        params.pop("stream", None)
        response = await session.chat(messages, scope=params["model"], **params)
        stats = response.call_stats
        await respond(send, 200, _ENCODE(response.raw).encode(), [
            (b"x-polygate-call-id", stats.logical_call_id.encode()),
            (b"x-polygate-source", (stats.source or "").encode()),
            (b"x-polygate-attempts", b"%d" % stats.attempts),
            (b"x-polygate-hedges", b"%d" % stats.hedges),
            (b"x-polygate-cached", b"false"),
        ])

    return app


async def respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


async def main(path: str) -> None:
    settings = settings_from_toml(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    async with polygate.session(settings) as session:
        async with trio.open_nursery() as nursery:
            await nursery.start(hypercorn.trio.serve, make_app(session, settings.serve.api_keys[0]), config)
            print(f"listening on http://127.0.0.1:{port}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    trio.run(main, parser.parse_args().config)
