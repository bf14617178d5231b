"""polygate.aio edge cases an outside review found (2026-12-02): a stream whose
session is left mid-stream, and a loop closed under an open session."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
import trio

import polygate
import polygate.aio
from polygate.aio import _guest_io
from polygate.testing import FakeUpstream, Reply

from ._aio_support import BACKENDS, messages, settings_for, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60, method="thread")]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(autouse=True, params=["loop-io", "thread-io"])
def guest_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "thread-io":
        monkeypatch.setattr(_guest_io, "_guest_tick", lambda: None)
    return str(request.param)


async def test_buffered_chunks_after_the_session_was_left_are_not_skipped() -> None:
    """A slow consumer (the bridge's 32-chunk buffer is full, its trio side waits for
    space) whose session is left by another part of the program (a lifespan ending)
    while the stream's block is still open.  Docs: the caller gets
    PolygateError("the session was closed while this call was in flight").

    It was: after 16 chunks, __anext__ raised PolygateError("polygate's trio run has
    ended (its loop is shutting down)") -- the 17th chunk popped and dropped -- and
    iterating again went on with chunk 18 and later raised the right error."""
    up = FakeUpstream(Reply(tokens=100, inter_token_s=0.0005))
    block = polygate.aio.session(settings_for("http://a/v1"), transport=up.transport())
    s = await block.__aenter__()
    texts: list[str] = []
    errors: list[str] = []
    async with s.stream_chat(messages("slow")) as stream:
        for _ in range(200):  # let the trio side fill the buffer and wait for space
            await asyncio.sleep(0.002)
            if len(stream._chunks) >= 32:
                break
        await block.__aexit__(None, None, None)
        for _ in range(3):
            try:
                async for chunk in stream:
                    texts.append(chunk.text)
                break
            except polygate.PolygateError as exc:
                errors.append(str(exc))
    assert errors[:1] == ["the session was closed while this call was in flight"], errors
    assert len(texts) == 32  # every chunk that had come, none skipped


async def _start_app_guest_run() -> tuple[Any, Any, asyncio.Future[Any]]:
    """The application runs trio as a guest on its asyncio loop (docs/asyncio.md: then
    polygate.aio's sessions live in that run, "the application's own guest run")."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    ready: asyncio.Future[Any] = loop.create_future()

    async def app_trio() -> None:
        stop = trio.Event()
        ready.set_result((trio.lowlevel.current_trio_token(), stop))
        await stop.wait()

    trio.lowlevel.start_guest_run(
        app_trio, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        done_callback=done.set_result, host_uses_signal_set_wakeup_fd=True)
    token, stop = await ready
    return token, stop, done


@pytest.mark.parametrize("body_error", [False, True])
def test_leaving_a_session_whose_trio_run_ended_is_quiet(body_error: bool) -> None:
    """Outside review: the application's trio guest run ends while a polygate.aio
    session is still open.  The session's calls are cancelled and settled; leaving the
    block then raised PolygateError("polygate's trio run has ended (its loop is
    shutting down)"), which replaced an error of the body's own.  Leaving a session
    its run already closed is quiet."""

    class AppError(Exception):
        pass

    async def main() -> BaseException | None:
        token, stop, done = await _start_app_guest_run()
        hang = FakeUpstream(Reply(headers_delay_s=3600))
        try:
            async with polygate.aio.session(settings_for("http://a/v1"), transport=hang.transport()) as s:
                call = asyncio.ensure_future(s.chat(messages("h")))
                await wait_until(lambda: hang.in_flight == 1)
                token.run_sync_soon(stop.set)  # the application's trio run ends
                await asyncio.wait_for(asyncio.shield(done), 10)
                with pytest.raises(polygate.PolygateError, match="in flight"):
                    await asyncio.wait_for(call, 10)  # cancelled and settled: fine
                assert hang.in_flight == 0
                if body_error:
                    raise AppError("the application's own error")
        except AppError:
            return None
        except BaseException as exc:  # what leaving the block raised instead
            return exc
        return None

    left_with = asyncio.run(main())
    assert left_with is None, f"leaving the session raised {left_with!r}"


def test_a_stream_whose_entry_was_cancelled_hands_out_nothing() -> None:
    """Review: a task cancelled while its ``async with stream`` was entering (the
    block never ran, and ``async with`` calls no __aexit__) left the stream readable:
    reads handed out the cancelled call's buffered chunks, even its whole answer.
    Every read is the PolygateError of a stream whose block was left.  (In both
    guest-I/O modes: the module's guest_io fixture.)"""

    async def main() -> list[str]:
        up = FakeUpstream(Reply(tokens=200, inter_token_s=0.0))
        async with polygate.aio.session(
                settings_for("http://a/v1", embed=False), transport=up.transport()) as s:
            stream = s.stream_chat(messages("x"))

            async def body() -> None:
                async with stream:
                    raise AssertionError("the block ran")

            task = asyncio.ensure_future(body())
            await asyncio.sleep(0)  # the task waits in the stream's __aenter__
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            seen = []
            for _ in range(2):
                try:
                    seen.append(f"chunk {(await stream.__anext__()).text!r}")
                except polygate.PolygateError as exc:
                    seen.append(str(exc))
            return seen

    seen = asyncio.run(main())
    assert seen == ["this stream was closed before it finished (its block exited)"] * 2, seen


# --------------------------------------------------------------------------- anyio's
# cancellation: anyio cancels a task again at each loop iteration until it leaves the
# cancelled scope, so a cancellation lands in the middle of every wait on the way out.
# Outside review of polygate.aio inside real asyncio programs, 2026-12-05.


async def test_a_session_left_under_anyio_cancellation_leaves_no_host_behind() -> None:
    """The loop's host stayed registered (closed, its run ended) after the last session
    was left: the loop, the host and trio's finished run stayed referenced until this
    thread's next session."""
    import anyio

    from polygate.aio import _host

    loop = asyncio.get_running_loop()
    up = FakeUpstream(Reply(text="ok"))
    with anyio.CancelScope() as scope:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
            assert (await s.chat(messages("x"))).text == "ok"
            scope.cancel()
            await anyio.sleep(1)
    assert scope.cancelled_caught
    assert loop not in _host._hosts.by_loop, _host._hosts.by_loop


async def test_an_opening_cancelled_by_anyio_that_then_fails_logs_nothing() -> None:
    """As test_aio's single task.cancel(), with anyio's repeated cancellation: the
    failed opening is nobody's news, and the loop must not log "Future exception was
    never retrieved" for it."""
    import gc

    import anyio

    from ._aio_support import redis_that_never_answers

    reported: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
    with redis_that_never_answers() as settings:
        with anyio.move_on_after(0.1) as scope:
            async with polygate.aio.session(settings):
                pass
        assert scope.cancelled_caught
    gc.collect()
    await asyncio.sleep(0)
    gc.collect()
    assert [c.get("message") for c in reported] == []


def test_a_sync_method_called_while_its_loop_is_not_running_says_so() -> None:
    """Between two run_until_complete() calls, in the session's own thread: there is no
    other loop, so the message must not say there is (it said "belongs to another
    event loop (or thread)")."""
    loop = asyncio.new_event_loop()
    try:
        block = polygate.aio.session(settings_for("http://a/v1"),
                                     transport=FakeUpstream(Reply(text="ok")).transport())
        s = loop.run_until_complete(block.__aenter__())
        with pytest.raises(polygate.PolygateError, match="no event loop is running here") as caught:
            s.stream_chat(messages("st"))
        assert "another event loop" not in str(caught.value)
        loop.run_until_complete(block.__aexit__(None, None, None))
    finally:
        loop.close()
