"""FakeUpstream's loopback server face: real sockets, real clock, generous margins.

No test sleeps to win a race: waits are either httpx timeouts the test is about, or
``wait_until`` polls for a condition under a hard deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply

pytestmark = pytest.mark.integration

CHAT = "/chat/completions"
STREAM_BODY = {
    "model": "m1",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}
JSON_BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
REPO_ROOT = Path(polygate.__file__).resolve().parent.parent


async def wait_until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll ``condition`` (a counter of the fake: no event to wait on) until it
    holds; fail after ``limit_s`` seconds."""
    with trio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_stream_and_json_calls() -> None:
    up = FakeUpstream(Reply(tokens=5, inter_token_s=0.01))
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        assert base_url.startswith("http://127.0.0.1:")
        assert base_url.endswith("/v1")
        async with client.stream("POST", CHAT, json=STREAM_BODY) as response:
            assert response.headers["transfer-encoding"] == "chunked"
            assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
            lines = [line async for line in response.aiter_lines() if line]
        plain = await client.post(CHAT, json=JSON_BODY)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "The quick brown fox jumps"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert plain.headers["content-length"] == str(len(plain.content))
    assert plain.json()["choices"][0]["message"]["content"] == text
    assert up.statistics().completed == 2
    assert up.in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_that_is_not_text_is_echoed_escaped(stream: bool) -> None:
    """A raw client can send a lone surrogate escape as the model; the fake echoes the
    model, so it answers with it escaped, and keeps serving (it crashed and stopped
    accepting connections)."""
    up = FakeUpstream(Reply(tokens=2))
    body = b'{"model":"m\\udce9","stream":%s,"messages":[{"role":"user","content":"x"}]}' % (
        b"true" if stream else b"false")
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        answer = await client.post(CHAT, content=body, headers={"content-type": "application/json"})
        again = await client.post(CHAT, json=JSON_BODY)
    assert answer.status_code == 200 and "\\udce9" in answer.text
    answer.content.decode("utf-8")  # valid UTF-8 throughout
    assert again.status_code == 200


async def test_both_faces_send_the_same_bytes() -> None:
    reply = Reply(tokens=6, reasoning_tokens=2, keepalive_s=0.02, first_token_s=0.05)
    bodies = []
    for face in ("transport", "server"):
        up = FakeUpstream(reply, seed=3)
        if face == "transport":
            async with httpx.AsyncClient(transport=up.transport(), base_url="http://x/v1") as c:
                bodies.append(
                    [(await c.post(CHAT, json=b)).content for b in (STREAM_BODY, JSON_BODY)]
                )
        else:
            async with up.serve() as url, httpx.AsyncClient(base_url=url) as c:
                bodies.append(
                    [(await c.post(CHAT, json=b)).content for b in (STREAM_BODY, JSON_BODY)]
                )
    assert bodies[0] == bodies[1]
    assert b": keep-alive\n\n" in bodies[0][0]


async def test_keep_alive_reuses_one_connection() -> None:
    up = FakeUpstream(Reply(tokens=3))
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        for i in range(50):
            body = STREAM_BODY if i % 2 else JSON_BODY
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200
    stats = up.statistics()
    assert (stats.requests, stats.completed, stats.connections) == (50, 50, 1)


@pytest.mark.parametrize("body", [STREAM_BODY, JSON_BODY], ids=["stream", "json"])
async def test_reset_is_a_transport_error(body: dict[str, Any]) -> None:
    up = FakeUpstream([Reply(tokens=4, fault="reset", fault_after=2), Reply()])

    async def read(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", CHAT, json=body) as response:
            await response.aread()

    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        with pytest.raises(httpx.ReadError, match="reset"):  # RST, not a clean close
            await read(client)
        assert up.requests[0].outcome == "fault"
        ok = await client.post(CHAT, json=JSON_BODY)  # a fresh connection still works
    assert ok.status_code == 200
    assert up.statistics().connections == 2


async def test_silent_gives_a_read_timeout_and_client_closed() -> None:
    up = FakeUpstream(Reply(fault="silent"))
    timeout = httpx.Timeout(10.0, read=0.3)
    async with up.serve() as base_url:
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
            started = trio.current_time()
            with pytest.raises(httpx.ReadTimeout):
                await client.post(CHAT, json=JSON_BODY)
            assert trio.current_time() - started >= 0.3
        await wait_until(lambda: up.in_flight == 0)
    assert up.requests[0].outcome == "client_closed"


async def test_truncated_body_is_a_client_error() -> None:
    up = FakeUpstream(Reply(fault="truncated"))
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(CHAT, json=JSON_BODY)
    assert up.requests[0].outcome == "fault"


async def test_truncated_stream_ends_cleanly() -> None:
    up = FakeUpstream(Reply(tokens=4, fault="truncated", fault_after=2))
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        response = await client.post(CHAT, json=STREAM_BODY)
    assert response.status_code == 200
    assert b"[DONE]" not in response.content
    assert b'"finish_reason":"stop"' not in response.content


async def test_twenty_concurrent_streams() -> None:
    up = FakeUpstream(Reply(first_token_s=1.0, tokens=10, inter_token_s=0.02))
    results: list[bytes] = []

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", CHAT, json=STREAM_BODY) as response:
            results.append(await response.aread())

    async with (
        up.serve() as base_url,
        httpx.AsyncClient(base_url=base_url) as client,
        trio.open_nursery() as nursery,
    ):
        for _ in range(20):
            nursery.start_soon(one, client)
    assert len(results) == 20
    assert all(r.endswith(b"data: [DONE]\n\n") for r in results)
    stats = up.statistics()
    assert (stats.completed, stats.in_flight, stats.peak_in_flight) == (20, 0, 20)


async def test_client_leaving_mid_stream_is_client_closed() -> None:
    up = FakeUpstream(Reply(tokens=100, inter_token_s=0.05))
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        with trio.move_on_after(0.3):
            async with client.stream("POST", CHAT, json=STREAM_BODY) as response:
                async for _ in response.aiter_raw():
                    pass
        await wait_until(lambda: up.in_flight == 0)
    assert up.requests[0].outcome == "client_closed"


async def test_stats_endpoint() -> None:
    up = FakeUpstream(Reply(tokens=1))
    before = time.time()
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        for _ in range(3):
            await client.post(CHAT, json=JSON_BODY)
        stats = (await client.get("/_stats")).json()
        root_stats = (await client.get(base_url.removesuffix("/v1") + "/_stats")).json()
    assert stats["requests"] == stats["completed"] == 3
    assert stats["in_flight"] == 0
    assert len(stats["request_times"]) == 3
    assert all(before <= t <= time.time() for t in stats["request_times"])
    assert root_stats["requests"] == 3


async def test_serve_reraises_the_block_exception_unwrapped() -> None:
    up = FakeUpstream()
    with pytest.raises(KeyError):
        async with up.serve():
            raise KeyError("boom")


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        data = await stream.receive_some(1)
        if not data:
            break
        line += data
    return line


async def test_serve_module_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    command = [sys.executable, "-m", "polygate.testing.serve", "--port", "0", "--seed", "1",
               "--profile", '{"first_token_s": [0.0, 0.01], "tokens": 3}']  # fmt: skip
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT
    )
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        with trio.fail_after(30):
            line = await read_line(process.stdout)
        assert line.startswith(b"listening on http://127.0.0.1:"), line
        assert line.endswith(b"/v1\n"), line
        base_url = line.decode().split()[-1]
        async with httpx.AsyncClient(base_url=base_url) as client:
            response = await client.post(CHAT, json=JSON_BODY)
            stats = (await client.get("/_stats")).json()
        assert response.json()["usage"]["completion_tokens"] == 3
        assert stats["requests"] == 1
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
            assert await read_line(process.stdout) == b""  # exactly one line was printed
            assert await read_line(process.stderr) == b""
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            for pipe in (process.stdout, process.stderr):
                if pipe is not None:
                    await pipe.aclose()


@pytest.mark.parametrize("port", ["70000", "-1", "taken"])
def test_the_serve_module_refuses_a_port_it_cannot_have(port: str) -> None:
    """review: ``--port 70000`` listened on 4464 (70000 - 65536), and a port in use
    ended in a trio traceback: a usage error (exit 2) or one line (exit 1)."""
    import socket

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        value = str(held.getsockname()[1]) if port == "taken" else port
        done = subprocess.run(
            [sys.executable, "-m", "polygate.testing.serve", "--port", value],
            capture_output=True, text=True, timeout=60, env=env, cwd=REPO_ROOT,
        )
    assert done.returncode == (1 if port == "taken" else 2), done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert ("cannot listen on" in last) if port == "taken" else ("--port must be in" in last)


@pytest.mark.parametrize("face", ["transport", "server"])
async def test_a_request_for_n_choices_gets_n_choices(face: str) -> None:
    """review: ``n`` was ignored (always one choice), so no test could exercise the
    n > 1 path with the fake; each choice now gets the same answer, in both faces."""
    import polygate

    up = FakeUpstream(Reply(tokens=3, reasoning_tokens=1))
    source = polygate.Source(name="a", base_url="http://a/v1")
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[source])})

    async def calls(s: polygate.Session) -> tuple[Any, list[Any]]:
        plain = await s.chat([{"role": "user", "content": "hi"}], n=3)
        async with s.stream_chat([{"role": "user", "content": "hi"}], n=3) as stream:
            chunks = [c async for c in stream]
        return plain, [plain, stream.response, chunks]

    if face == "transport":
        async with polygate.session(settings, transport=up.transport()) as s:
            plain, (_, streamed, chunks) = await calls(s)
    else:
        async with up.serve() as url:
            settings = polygate.Settings(scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=url)])})
            async with polygate.session(settings) as s:
                plain, (_, streamed, chunks) = await calls(s)
    for response in (plain, streamed):
        assert [c["index"] for c in response.choices] == [0, 1, 2]
        texts = {c["message"]["content"] for c in response.choices}
        assert len(texts) == 1 and response.text in texts
        assert response.usage.completion_tokens == 3 * 4  # every choice's tokens
    assert "".join(c.text for c in chunks) == streamed.text


@pytest.mark.parametrize("fault", ["error_event", "reset", "truncated"])
@pytest.mark.parametrize("face", ["transport", "server"])
async def test_a_delivered_fault_is_recorded_alike_on_both_faces(face: str, fault: str) -> None:
    """review: the transport face decided a body's outcome only once it was read past its
    last bytes, so a client that closed once it had read the error event recorded
    ``client_closed`` there and ``fault`` on the server.  (A malformed event mid-stream,
    after which the body goes on, is still ``client_closed`` on the transport face when
    the client stops reading at it: the faces do not mark where a fault's bytes are.)"""
    import polygate

    up = FakeUpstream(Reply(fault=fault, fault_after=1))  # type: ignore[arg-type]

    def settings(url: str) -> polygate.Settings:
        return polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=url)], retry=polygate.Retry(max_attempts=1))})

    with pytest.raises(polygate.PolygateError):
        if face == "transport":
            async with polygate.session(settings("http://a/v1"), transport=up.transport()) as s:
                await s.chat([{"role": "user", "content": "hi"}])
        else:
            async with up.serve() as url, polygate.session(settings(url)) as s:
                await s.chat([{"role": "user", "content": "hi"}])
    assert [r.outcome for r in up.requests] == ["fault"]
    assert up.statistics().faults == 1


@pytest.mark.parametrize("fault", ["malformed_json", "error_event"])
async def test_a_fault_the_client_stops_at_is_recorded_as_delivered(fault: Any) -> None:
    """The transport face's test of the same name, over sockets: a timed stream (its
    steps written one at a time) whose client leaves at the fault's bytes."""
    up = FakeUpstream(Reply(tokens=6, inter_token_s=0.05, fault=fault, fault_after=2))
    async with up.serve() as base_url, httpx.AsyncClient(base_url=base_url) as client:
        async with client.stream("POST", CHAT, json=STREAM_BODY) as response:
            async for line in response.aiter_lines():
                if "unterminated" in line or line.startswith("event: error"):
                    break
        await wait_until(lambda: up.in_flight == 0)
    assert up.requests[0].outcome == "fault"


async def test_a_head_request_gets_a_head() -> None:
    """review: a HEAD (a health check) got no answer: the server wrote a body h11
    refuses for it, and dropped the connection."""
    up = FakeUpstream(Reply())
    async with up.serve() as url, httpx.AsyncClient(base_url=url) as c:
        r = await c.head("/nothing")
        assert r.status_code == 404 and r.content == b""
        r = await c.head("/models")  # (answered since the fake lists its model)
        assert r.status_code == 200 and r.content == b""
        assert (await c.post("/chat/completions", json={"model": "m", "messages": []})).status_code == 200


async def test_a_failing_script_is_recorded_as_the_500_it_was_answered_with(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """review: the server answered a script that raised with a 500, and recorded the
    request with no status, as a scripted fault."""

    def boom(rec: Any, rng: Any) -> Reply:
        raise RuntimeError("nope")

    up = FakeUpstream(boom)
    async with up.serve() as url, httpx.AsyncClient(base_url=url) as c:
        assert (await c.post("/chat/completions", json={"model": "m", "messages": []})).status_code == 500
    assert (up.requests[0].status, up.requests[0].outcome) == (500, "complete")
    assert up.statistics().faults == 0
