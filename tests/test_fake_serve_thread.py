"""``FakeUpstream.serve_in_thread()``: the loopback face for tests that are not in a
trio run (a synchronous test, an asyncio application's test).  Real sockets, real
clock; nothing here sleeps to win a race: the block starts only once the server
listens, and leaving it returns only once the server's thread has ended."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading

import httpx
import pytest

import polygate
import polygate.aio
from polygate.testing import FakeUpstream, RecordedRequest, Reply, _thread

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

pytestmark = pytest.mark.integration

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def _fake_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("polygate-fake-")]


def _refused(base_url: str) -> bool:
    host, port = base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_synchronous_test_gets_answers_and_the_server_is_gone_after() -> None:
    up = FakeUpstream(Reply(text="hello there", tokens=2), name="sync")
    with up.serve_in_thread() as base_url:
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        answer = httpx.post(f"{base_url}/chat/completions", json=CHAT, timeout=10)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["content"] == "hello there"
        # Recorded before the answer was sent, so the client's answer implies it.
        assert [r.body for r in up.requests] == [CHAT]
        assert len(_fake_threads()) == 1
    assert _fake_threads() == []  # joined, not left running
    assert _refused(base_url)
    stats = up.statistics()
    assert (stats.requests, stats.completed, stats.in_flight) == (1, 1, 0)


def test_an_asyncio_application_calls_it_through_polygate_aio() -> None:
    up = FakeUpstream(Reply(text="from asyncio", tokens=3), name="aio")

    async def main(base_url: str) -> tuple[str, str]:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[
                polygate.Source(name="a", base_url=base_url, api_key="k", model="m1")])})
        async with polygate.aio.session(settings) as s:
            plain = await s.chat(CHAT["messages"])
            async with s.stream_chat(CHAT["messages"]) as stream:
                streamed = "".join([chunk.text async for chunk in stream])
        return plain.text, streamed

    with up.serve_in_thread() as base_url:
        assert asyncio.run(main(base_url)) == ("from asyncio", "from asyncio")
    assert up.statistics().completed == 2


def test_a_port_in_use_is_the_servers_own_error_raised_at_the_with() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        up = FakeUpstream()
        with pytest.raises(OSError) as caught, up.serve_in_thread(port=port):
            pytest.fail("the block ran without a server")  # pragma: no cover
        assert caught.value.errno is not None
    finally:
        taken.close()
    assert _fake_threads() == []


def test_a_host_that_is_not_one_address_is_refused_as_serve_refuses_it() -> None:
    with pytest.raises(TypeError, match="one host"), FakeUpstream().serve_in_thread(host=None):  # type: ignore[arg-type]
        pytest.fail("the block ran without a server")  # pragma: no cover
    assert _fake_threads() == []


def test_the_blocks_own_error_comes_out_as_itself_after_the_server_stopped() -> None:
    up = FakeUpstream(name="fails")
    with pytest.raises(KeyError, match="the test's own"), up.serve_in_thread() as base_url:
        raise KeyError("the test's own")
    assert _fake_threads() == []
    assert _refused(base_url)


def test_a_connection_left_open_does_not_hold_the_exit() -> None:
    """A client that keeps its kept-alive connection (and one mid-request) does not
    keep the server's thread alive past the block."""
    up = FakeUpstream(Reply(text="x", tokens=1), name="open")
    with up.serve_in_thread() as base_url, httpx.Client(timeout=10) as client:
        assert client.post(f"{base_url}/chat/completions", json=CHAT).status_code == 200
        half = socket.create_connection(
            tuple(base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)))  # type: ignore[arg-type]
        half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    with half:
        assert _fake_threads() == []
        try:  # the server closed it: a FIN, or a reset if it had not read the bytes yet
            assert half.recv(10) == b""
        except ConnectionResetError:
            pass


def test_a_behaviour_that_blocks_its_thread_is_reported_not_waited_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_thread, "_STOP_S", 0.5)
    release = threading.Event()
    entered = threading.Event()

    def stuck(request: RecordedRequest, rng: object) -> Reply:
        entered.set()
        release.wait(30)  # blocks the server's whole trio run
        return Reply()

    up = FakeUpstream(stuck, name="stuck")
    client = threading.Thread(
        target=lambda: httpx.post(f"{url}/chat/completions", json=CHAT, timeout=30), daemon=True)
    try:
        with pytest.raises(RuntimeError, match=r"'stuck' did not stop within 0\.5 s"), \
                up.serve_in_thread() as url:
            client.start()
            assert entered.wait(30)
    finally:
        release.set()
        client.join(30)
        for thread in _fake_threads():
            thread.join(30)
    assert _fake_threads() == []


def test_an_interrupt_while_it_starts_leaves_no_server_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a KeyboardInterrupt that came while the block waited for the server
    to listen left the server running until the process ended."""

    class Interrupted(threading.Event):
        made = 0

        def __init__(self) -> None:
            super().__init__()
            Interrupted.made += 1
            self.first = Interrupted.made == 1  # the block's: made before its thread's own
            self.interrupted = False

        def wait(self, timeout: float | None = None) -> bool:
            if self.first and not self.interrupted:  # the wait for the server to listen
                self.interrupted = True
                raise KeyboardInterrupt
            return super().wait(timeout)

    monkeypatch.setattr(_thread.threading, "Event", Interrupted)
    with pytest.raises(KeyboardInterrupt), FakeUpstream(name="interrupted").serve_in_thread():
        pytest.fail("the block ran")  # pragma: no cover
    assert _fake_threads() == []


def test_what_ended_the_server_is_raised_when_the_block_fails_for_it() -> None:
    """Review: a behaviour that raised a BaseException (``pytest.fail``'s) ended the
    server's run; the block then failed with its client's dropped connection, and the
    behaviour's own message was lost."""

    class Verdict(BaseException):
        pass

    def checks(request: RecordedRequest, rng: object) -> Reply:
        raise Verdict(f"the app sent the wrong model: {request.body['model']}")

    with pytest.raises(Verdict, match="wrong model: m1") as caught, \
            FakeUpstream(checks, name="verdict").serve_in_thread() as base_url:
        httpx.post(f"{base_url}/chat/completions", json=CHAT, timeout=10)
    assert isinstance(caught.value.__context__, httpx.HTTPError)  # the block's own, kept
    assert _fake_threads() == []


async def test_a_behaviours_own_error_survives_the_server_stopping_as_it_leaves() -> None:
    """CI (the floors' run): the error above was lost one run in five.  A behaviour's
    BaseException left its connection's task through trio's close of the connection,
    a checkpoint; a stop of the server that landed there replaced it with Cancelled,
    which the stop absorbed.  Here the block leaves exactly then: the behaviour wakes
    it and raises, and the block's task runs at that checkpoint."""
    import trio

    class Verdict(BaseException):
        pass

    reached = trio.Event()

    def checks(request: RecordedRequest, rng: object) -> Reply:
        reached.set()
        raise Verdict("the app sent the wrong model")

    caught: BaseException | None = None
    try:
        async with FakeUpstream(checks, name="race").serve() as base_url:
            host, port = base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
            client = await trio.open_tcp_stream(host, int(port))
            body = b'{"model": "m1", "messages": []}'
            await client.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await reached.wait()
    except BaseException as exc:  # the test is about which one
        caught = exc
    finally:
        await client.aclose()
    leaves = [caught]
    while leaves and isinstance(leaves[0], BaseExceptionGroup):
        leaves = list(leaves[0].exceptions)
    assert any(isinstance(e, Verdict) for e in leaves), repr(caught)
