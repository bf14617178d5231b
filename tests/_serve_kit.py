"""Helpers for the gateway-server tests: a server in front of a loopback FakeUpstream,
and a raw HTTP/1.1 client on trio sockets (h11) for what the SDK cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import h11
import trio

import polygate
from polygate.serve import Server, open_server
from polygate.testing import FakeUpstream, Reply

from ._raw_server import RawServer, raw_server
from ._raw_server import Reply as RawReply

GATEWAY_KEY = "sk-gw-test-0123456789"
AUTH = {"authorization": f"Bearer {GATEWAY_KEY}"}
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def settings_for(
    url: str,
    *,
    serve: polygate.Serve | None = None,
    sources: int = 1,
    telemetry: str = "off",
    backend: str = "memory",
    cache: str = "off",
    source_tpm: int | None = None,
    **scope: Any,
) -> polygate.Settings:
    chat = polygate.Scope(
        sources=[
            polygate.Source(name=f"s{i}", base_url=url, model="m1", api_key="sk-upstream-key",
                            tpm=source_tpm)
            for i in range(sources)
        ],
        **scope,
    )
    embed = polygate.Scope(sources=[polygate.Source(name="e", base_url=url, model="emb")])
    return polygate.Settings(
        scopes={"chat": chat, "embed": embed},
        serve=serve or polygate.Serve(api_keys=[GATEWAY_KEY], models={"gpt-4o": "chat"}),
        telemetry=telemetry,
        backend=backend,
        cache=cache,
    )


def one_source(url: str, **scope: Any) -> polygate.Settings:
    """Scope ``chat`` of one source at ``url``, behind the test gateway key."""
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url=url)], **scope)},
        serve=polygate.Serve(api_keys=[GATEWAY_KEY]))


@asynccontextmanager
async def raw_gateway(reply: RawReply, **scope: Any) -> AsyncIterator[tuple[Server, RawServer]]:
    """A gateway in front of one raw-bytes upstream answering as ``reply`` (see
    ``tests/_raw_server.py``), its scope's other settings ``scope``."""
    async with raw_server(reply) as upstream, open_server(one_source(upstream.url, **scope), port=0) as server:
        yield server, upstream


@asynccontextmanager
async def gateway(
    behaviour: Any = Reply(),  # noqa: B008 - Reply is frozen
    **settings: Any,
) -> AsyncIterator[tuple[Server, FakeUpstream]]:
    upstream = behaviour if isinstance(behaviour, FakeUpstream) else FakeUpstream(behaviour)
    async with upstream.serve() as url, open_server(settings_for(url, **settings), port=0) as server:
        yield server, upstream


@attrs.define
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request_bytes(
    method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> bytes:
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "host: gateway"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body is not None:
        lines.append(f"content-length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def read_answer(stream: trio.SocketStream, conn: h11.Connection | None = None) -> Answer:
    """One response; the connection stays usable when the server allows it."""
    conn = conn or h11.Connection(h11.CLIENT)
    status, headers, body = 0, {}, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return Answer(status, headers, bytes(body))


async def http(
    server: Server, method: str, path: str, body: Any = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    """One request on a fresh connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        data = request_bytes(method, path, body, headers)
        conn.send(h11.Request(method=method, target=path, headers=_h11_headers(data)))
        await stream.send_all(data)
        return await read_answer(stream, conn)


def _h11_headers(data: bytes) -> list[tuple[str, str]]:
    """The headers ``request_bytes`` wrote, so the client-side h11 knows the framing."""
    head = data.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")[1:]
    return [tuple(line.split(": ", 1)) for line in head]  # type: ignore[misc]


async def read_until_closed(stream: trio.SocketStream, limit_s: float = 10) -> bytes:
    out = bytearray()
    with trio.fail_after(limit_s):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            out += data
    return bytes(out)


async def wait_for(predicate: Any, limit_s: float = 5.0, period_s: float = 0.005) -> float:
    """Poll ``predicate`` on the real clock; returns when it became true."""
    with trio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110 - state of another component: no event
            await trio.sleep(period_s)
    return trio.current_time()


# --------------------------------------------------------------------------- a server process


class Running:
    def __init__(self, proc: trio.Process, port: int) -> None:
        self.proc = proc
        self.port = port


@asynccontextmanager
async def serve_process(
    config: Path | None, *, cwd: Path | None = None, env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> AsyncIterator[Running]:
    """``polygate serve`` on a free port (``config`` None: no ``--config``, the
    configuration found from ``cwd`` and ``env``), once it listens."""
    where = [] if config is None else ["--config", str(config)]
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "polygate", "serve", *where, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env, preexec_fn=preexec_fn,
    )
    try:
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(1)
                if not chunk:
                    err = await proc.stderr.receive_some(65536) if proc.stderr else b""
                    raise AssertionError(f"server exited: {err.decode()}")
                line += chunk
        assert b"listening on http://127.0.0.1:" in line, line
        yield Running(proc, int(line.rsplit(b":", 1)[1]))
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.move_on_after(10):
            await proc.wait()


class _Port:
    """Just enough of a Server for the raw-socket helpers."""

    def __init__(self, port: int) -> None:
        self.port = port


async def two_replicas_alternately(
    config: Path, calls: int, headers: dict[str, str], body: Any = CHAT
) -> list[Answer]:
    """Two ``polygate serve`` processes on one configuration, sent ``calls`` chat
    requests in turn (so each replica alone would admit its share), then stopped with
    SIGTERM; both must exit cleanly."""
    import signal

    answers = []
    async with serve_process(config) as one, serve_process(config) as two:
        for i in range(calls):
            replica = (one, two)[i % 2]
            answers.append(await http(_Port(replica.port), "POST", "/v1/chat/completions", body, headers))
        for replica in (one, two):
            replica.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await one.proc.wait() == 0
            assert await two.proc.wait() == 0
    return answers
