"""A real FastAPI application on polygate.aio under uvicorn with uvloop, in a
subprocess, hit by a real HTTP client (``tests/_aio_app.py``).

The FakeUpstream is served on loopback by this test's own trio run, so the test sees
what the upstream saw: concurrent requests answered, a client that hangs up cancels
its call and the upstream sees its connection closed, and a shutdown (SIGTERM) with
calls in flight cancels them, settles them and closes the session before the process
exits.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from polygate.testing import FakeUpstream, Reply

from ._aio_support import request_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = Path(__file__).with_name("_aio_app.py")


def _behaviour(rec: Any, _rng: Any) -> Reply:
    question = rec.body["messages"][-1]["content"] if isinstance(rec.body, dict) else ""
    if question.startswith("hang"):
        return Reply(headers_delay_s=3600)
    if question.startswith("stream-hang"):
        return Reply(tokens=20, inter_token_s=3600)
    return Reply(text=f"answer to {question}", first_token_s=0.01)


class Lines:
    """The subprocess's stdout, line by line."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.seen: list[str] = []

    async def next(self) -> str:
        while b"\n" not in self.buffer:
            data = await self.stream.receive_some(4096)
            if not data:
                raise EOFError(f"the application exited; it said {self.seen}")
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        self.seen.append(line.decode())
        return self.seen[-1]

    async def until(self, prefix: str) -> str:
        while True:
            line = await self.next()
            if line.startswith(prefix):
                return line


async def wait_until(condition: Callable[[], bool], limit_s: float = 15.0) -> None:
    with trio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110 - the fake's records: no event to wait on
            await trio.sleep(0.01)


@asynccontextmanager
async def application(upstream_url: str) -> AsyncIterator[tuple[trio.Process, Lines, str]]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(APP), upstream_url], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    lines = Lines(proc.stdout)
    try:
        with trio.fail_after(60):
            port = (await lines.until("listening on ")).split()[-1]
            assert await lines.until("loop: ") == "loop: uvloop"
        yield proc, lines, f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@pytest.mark.timeout(180)
async def test_fastapi_on_uvicorn_with_uvloop() -> None:
    up = FakeUpstream(_behaviour)
    async with up.serve() as url, application(url) as (proc, lines, base):
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            # The application is up once it answers.
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get("/held")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await trio.sleep(0.05)

            # Concurrent requests share the one session of the lifespan.
            answers: dict[int, Any] = {}

            async def ask(i: int) -> None:
                r = await client.post("/ask", json={"question": f"q{i}"})
                answers[i] = (r.status_code, r.json())

            async with trio.open_nursery() as nursery:
                for i in range(30):
                    nursery.start_soon(ask, i)
            assert all(status == 200 for status, _ in answers.values())
            assert {body["answer"] for _, body in answers.values()} == {
                f"answer to q{i}" for i in range(30)}

            r = await client.post("/stream", json={"question": "streamed"})
            assert r.text == "answer to streamed"

            # A client that hangs up cancels its call: the upstream sees it at once.
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(client.post, "/ask", json={"question": "hang-1"}))
                    await wait_until(lambda: any(
                        isinstance(q.body, dict) and q.body["messages"][-1]["content"] == "hang-1"
                        for q in up.requests))
                    nursery.cancel_scope.cancel()  # closes the client's connection
            assert not scope.cancelled_caught
            await wait_until(lambda: request_for(up, "hang-1").outcome == "client_closed")

            # The same for a stream the client stops reading.
            async with client.stream("POST", "/stream", json={"question": "stream-hang"}) as s:
                async for text in s.aiter_text():
                    assert text
                    break
            await wait_until(lambda: request_for(up, "stream-hang").outcome == "client_closed")
            await wait_until(lambda: up.in_flight == 0)
            assert (await client.get("/held")).json() == {"held": 0}
            # No thread per request (a plain-def dependency would take one each), and
            # a hang-up is not an error in the server's log.
            process = (await client.get("/process")).json()
            assert process == {"threads": 1, "errors_logged": 0}, process

            # Shutdown with calls in flight.
            failures: list[Any] = []

            async def doomed(i: int) -> None:
                try:
                    r = await client.post("/ask", json={"question": f"hang-shutdown-{i}"})
                    failures.append(r.status_code)  # uvicorn answers 500 for a cancelled app
                except httpx.HTTPError as exc:
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(doomed, i)
                await wait_until(lambda: up.in_flight == 3)
                proc.send_signal(signal.SIGTERM)
                with trio.fail_after(30):
                    # uvicorn re-raises the signal once it has shut down cleanly.
                    assert await proc.wait() in (0, -signal.SIGTERM)
        # The lifespan closed the session after uvicorn cancelled the requests.
        rest = []
        with trio.fail_after(10):
            while True:
                try:
                    rest.append(await lines.next())
                except EOFError:
                    break
        # (uvicorn cancels the request tasks and starts the lifespan's shutdown at once:
        # the calls may still hold permits then; leaving the session settles them.)
        assert any(line.startswith("lifespan: closing") for line in rest), rest
        assert rest[-1] == "lifespan: closed"
        assert len(failures) == 3
        assert all(f == 500 or isinstance(f, httpx.HTTPError) for f in failures), failures
        for i in range(3):
            assert request_for(up, f"hang-shutdown-{i}").outcome == "client_closed"
        assert up.in_flight == 0
