"""Behaviours of polygate.aio (and of the trio session under it) that no other test
pinned.

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through; two of them found real bugs (a
rescue after the loop closed while its last session was leaving, and a trio run that
ended early raising trio's error instead of polygate's).

The asyncio tests run each loop by hand (the ``aio`` decorator below), on a fresh
loop of each kind."""
from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
import trio
import trio.testing

import polygate
import polygate.aio
from polygate.aio import _guest_io, _host
from polygate.testing import FakeUpstream, Reply
from tests._aio_support import _new_loop, _run, messages, settings_for, trio_kept_busy

pytestmark = [pytest.mark.timeout(60, method="thread")]


def aio(fn: Any) -> Any:
    """An asyncio test, run as a plain function on a fresh loop of each kind."""
    import functools
    import inspect

    params = list(inspect.signature(fn).parameters.values())

    @pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
    @functools.wraps(fn)
    def test(loop_kind: str, **kwargs: Any) -> None:
        _run(fn(**kwargs), loop_kind)

    test.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("loop_kind", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])
    return test

HANG = Reply(headers_delay_s=3600)


@pytest.fixture(autouse=True, params=["loop-io", "thread-io"])
def guest_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "thread-io":
        monkeypatch.setattr(_guest_io, "_guest_tick", lambda: None)
    return str(request.param)


@aio
async def test_a_call_cancelled_before_it_started_sends_nothing(guest_io: str) -> None:
    """A cancellation handed to trio before the call's task ran (with trio's helper
    thread, both wait in one hand-over batch) must stop the call before it sends: the
    upstream never sees the request.  (Mutants: _Job.cancel no longer records
    cancel_requested, or _run_job ignores it -> the call runs to its end.)  With trio's
    I/O wait on the loop, the call starts first there (and answers, this upstream
    needing no I/O): nothing to pin in that mode."""
    if guest_io == "loop-io":
        return
    up = FakeUpstream(Reply(text="sent anyway"))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        with trio_kept_busy():
            task = asyncio.ensure_future(s.chat(messages("never")))
            await asyncio.sleep(0)  # submitted, not yet started in trio
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert up.statistics().requests == 0
        assert (await s.chat(messages("after"))).text == "sent anyway"


@aio
async def test_a_session_opened_while_the_last_one_closes_waits_for_a_new_run() -> None:
    """The last session's leaving stops the loop's trio run; a session opened in that
    moment (another task) must wait for it and start a new one, not join the run that
    is ending.  (Mutant: Host.stop() leaves ``accepting`` True.)"""
    loop = asyncio.get_running_loop()
    block = polygate.aio.session(settings_for("http://a/v1"), transport=FakeUpstream().transport())
    await block.__aenter__()
    host = _host._hosts.by_loop[loop]
    closing = asyncio.ensure_future(block.__aexit__(None, None, None))
    while host.users:  # noqa: ASYNC110 - every loop iteration: catch the stop as it is asked
        await asyncio.sleep(0)
    async with polygate.aio.session(settings_for("http://a/v1"),
                                    transport=FakeUpstream(Reply(text="new")).transport()) as s2:
        assert (await s2.chat(messages("x"))).text == "new"
    await closing
    assert not trio.lowlevel.in_trio_run()


@aio
async def test_a_cancelled_task_never_goes_on_as_if_not_cancelled() -> None:
    """Cancel a task that opens a session, calls, and leaves, after k loop iterations
    for every k: wherever the cancellation lands (the opening, the call, the leaving,
    the wait for the trio run to end), the task ends in CancelledError, and only once
    the trio run has ended.  (Mutants: settle() swallows the cancellation; settle()
    re-raises it before what it waits for is done.)"""
    # Every k up to 80, then sparser: with trio's I/O wait in its helper thread, how
    # many loop iterations a call takes depends on that thread, more so under load.
    for k in [*range(80), *(80 << i for i in range(1, 10))]:
        after: list[int] = []

        async def body(after: list[int] = after, k: int = k) -> None:
            async with polygate.aio.session(settings_for("http://a/v1"),
                                            transport=FakeUpstream().transport()) as s:
                await s.chat(messages("x"))
            after.append(k)

        task = asyncio.ensure_future(body())
        for _ in range(k):
            await asyncio.sleep(0)
        if task.done():
            assert after == [k]
            break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert after == [], f"cancelled after {k} iterations, the task went on"
        assert not trio.lowlevel.in_trio_run(), f"k={k}: the run outlived its last session"
    else:
        raise AssertionError("the task never finished")


@aio
async def test_statistics_awaited_while_the_session_closes_are_its_final_figures(tmp_path: Any) -> None:
    """statistics() from another task while the block is being left (a telemetry flush
    in progress) waits for the close and answers with the final figures, as after it.
    (Mutant: it does not wait, and raises 'this session is closed'.)"""
    settings = polygate.Settings(scopes=settings_for("http://a/v1").scopes,
                                telemetry=f"sqlite:///{tmp_path}/t.db")
    async with polygate.aio.session(settings, transport=FakeUpstream().transport()) as s:
        await s.chat(messages("hi"))
        during = asyncio.ensure_future(s.statistics())  # runs once the leaving began
    stats = await during
    assert (stats.telemetry.written, stats.telemetry.queued) == (2, 0)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_closed_loop_is_not_kept_by_the_rescue(kind: str) -> None:
    """The rescue of a run whose loop closed under it forgets that loop: nothing of
    polygate keeps a closed loop (and its run's state) alive.  (Mutant: the stale
    entry stays in the thread's registry for good.)"""
    loop = _new_loop(kind)
    cm = polygate.aio.session(settings_for("http://a/v1"), transport=FakeUpstream().transport())
    loop.run_until_complete(cm.__aenter__())
    loop.close()
    gone = weakref.ref(loop)
    del loop, cm

    async def next_session() -> None:
        async with polygate.aio.session(settings_for("http://a/v1"),
                                        transport=FakeUpstream().transport()) as s2:
            await s2.chat(messages("x"))

    with pytest.warns(ResourceWarning, match="still open when its event loop closed"):
        _run(next_session(), kind)
    gc.collect()
    assert gone() is None
    assert not any(loop.is_closed() for loop in _host._hosts.by_loop)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_loop_closed_while_its_last_session_was_leaving(kind: str) -> None:
    """A loop closed while its last session's exit waited for the trio run to end (a
    task awaiting polygate's futures is left on the closed loop): the next session in
    the thread finishes that run and works -- nothing raises 'Event loop is closed'.
    (Mutant: settleable() no longer checks the future's loop.)"""
    loop = _new_loop(kind)
    cm = polygate.aio.session(settings_for("http://a/v1"), transport=FakeUpstream().transport())
    loop.run_until_complete(cm.__aenter__())
    host = _host._hosts.by_loop[loop]
    leaving = loop.create_task(cm.__aexit__(None, None, None))

    async def until_stopping() -> None:
        while host.accepting:  # noqa: ASYNC110 - the host's own state: no event
            await asyncio.sleep(0)

    loop.run_until_complete(until_stopping())
    assert not leaving.done()
    # (On asyncio the run is caught past its main task, before its end; uvloop may
    # have finished it already: then there is nothing to rescue.)
    abandoned = not host._done
    if kind == "asyncio":
        assert abandoned
    loop.close()

    async def next_session() -> str:
        async with polygate.aio.session(settings_for("http://a/v1"),
                                        transport=FakeUpstream(Reply(text="ok")).transport()) as s2:
            return (await s2.chat(messages("x"))).text

    if abandoned:
        with pytest.warns(ResourceWarning, match="still open when its event loop closed"):
            assert _run(next_session(), kind) == "ok"
    else:
        assert _run(next_session(), kind) == "ok"
    assert not trio.lowlevel.in_trio_run()
    leaving._log_destroy_pending = False  # (left on the closed loop, on purpose)


@aio
async def test_a_trio_run_that_ends_early_is_a_polygate_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """If polygate's trio run ends before it accepted work, opening a session raises
    PolygateError at once (never a hang).  (Mutant: the run's end does not settle
    ``ready``.)"""
    async def broken_main(self: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(_host.Host, "_main", broken_main)
    with pytest.raises(polygate.PolygateError, match="ended early"):
        await asyncio.wait_for(
            polygate.aio.session(settings_for("http://a/v1"),
                                 transport=FakeUpstream().transport()).__aenter__(), 10)


def test_a_call_on_a_session_whose_trio_run_ended_says_the_session_is_closed() -> None:
    """The application's own trio guest run ends under an open polygate.aio session:
    the session is closed with it, and a call made after that is refused as on any
    closed session ("this session is closed", docs/asyncio.md), not with the run's
    internals.  (Mutant: the owner's run does not mark the session closing when it
    ends from the trio side.)"""
    from tests.test_aio_review import _start_app_guest_run

    async def main() -> None:
        token, stop, done = await _start_app_guest_run()
        async with polygate.aio.session(settings_for("http://a/v1"),
                                        transport=FakeUpstream().transport()) as s:
            await s.chat(messages("before"))
            token.run_sync_soon(stop.set)  # the application's trio run ends
            await asyncio.wait_for(asyncio.shield(done), 10)
            with pytest.raises(polygate.PolygateError, match="this session is closed"):
                await s.chat(messages("after"))
            with pytest.raises(polygate.PolygateError, match="this session is closed"):
                s.stream_chat(messages("after"))

    asyncio.run(main())


@aio
async def test_an_error_closing_the_session_reaches_the_block() -> None:
    """A transport passed in is closed with the session; when that close fails, leaving
    the block raises the error as itself (it is not swallowed).  (Mutant: _open no
    longer reads ``owner.closed``'s result.)"""
    transport = FakeUpstream().transport()

    async def close_fails() -> None:
        raise OSError("the transport would not close")

    transport.aclose = close_fails  # type: ignore[method-assign]
    with pytest.raises(OSError, match="would not close"):
        async with polygate.aio.session(settings_for("http://a/v1"), transport=transport) as s:
            await s.chat(messages("x"))


@aio
async def test_two_readers_waiting_at_the_end_both_end_cleanly() -> None:
    """Two tasks reading one stream, both waiting when its answer ends: both loops end
    with StopAsyncIteration, neither with an error.  (Mutant: the end is not recorded,
    and a second, spurious 'closed' end is queued behind the real one.)"""
    up = FakeUpstream(Reply(tokens=4, inter_token_s=0.02))
    ends: list[str] = []
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("shared")) as stream:

            async def read() -> None:
                try:
                    async for _ in stream:
                        pass
                except polygate.PolygateError as exc:
                    ends.append(f"error: {exc}")
                    return
                ends.append("clean")

            await asyncio.wait_for(asyncio.gather(read(), read()), 10)
    assert ends == ["clean", "clean"]
    assert stream.response is not None


# --------------------------------------------------------------------------- the trio session


async def test_a_stream_entered_in_a_cancelled_scope_sends_nothing() -> None:
    """As a call awaited in a cancelled scope: entering a stream there raises Cancelled
    and starts nothing (its producer runs shielded, so a started one would send).
    (Mutant: ChatStream.__aenter__ skips its checkpoint.)"""
    up = FakeUpstream(Reply(text="sent"))
    async with polygate.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        with trio.CancelScope() as cs:
            cs.cancel()
            async with s.stream_chat(messages("never")):
                pass
        assert cs.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        assert up.statistics().requests == 0


async def test_reading_a_stream_in_a_cancelled_scope_checkpoints() -> None:
    """Every read is a checkpoint, as every trio async operation: in a cancelled scope
    it raises Cancelled even with chunks buffered.  (Mutant: __anext__ skips its
    checkpoint and hands out a buffered chunk.)"""
    up = FakeUpstream(Reply(tokens=6))
    async with polygate.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("x")) as stream:
            await stream.__anext__()
            await trio.testing.wait_all_tasks_blocked()  # the rest is buffered
            with trio.CancelScope() as cs:
                cs.cancel()
                await stream.__anext__()
            assert cs.cancelled_caught
            rest = [c async for c in stream]
            assert rest


async def test_a_closed_trio_session_refuses_at_the_call() -> None:
    """After the block: every call method refuses at once with 'this session is
    closed', stream_chat() included (synchronously, before any ``async with``).
    (Mutant: Session._prepare skips its closed check.)"""
    async with polygate.session(settings_for("http://a/v1"), transport=FakeUpstream().transport()) as s:
        await s.chat(messages("x"))
    with pytest.raises(polygate.PolygateError, match="this session is closed"):
        s.stream_chat(messages("x"))
    with pytest.raises(polygate.PolygateError, match="this session is closed"):
        await s.chat(messages("x"))
    with pytest.raises(polygate.PolygateError, match="this session is closed"):
        await s.embed(["x"])


@aio
async def test_entering_a_stream_twice_is_refused_and_the_first_block_reads_on() -> None:
    """Mutant (ChatStream.__aenter__: the 'entered only once' check dropped): a
    second 'async with' of one stream is a PolygateError saying so, and the block
    already in it reads its whole answer."""
    upstream = FakeUpstream(Reply(text="hello there"))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=upstream.transport()) as s:
        async with s.stream_chat(messages("one")) as stream:
            with pytest.raises(polygate.PolygateError, match="entered only once"):
                async with stream:
                    pass
            text = "".join([chunk.text async for chunk in stream])
        assert text == "hello there"
        assert len(upstream.requests) == 1


@aio
async def test_two_readers_waiting_when_a_stream_fails_both_hear_it() -> None:
    """Mutant (ChatStream.__anext__: a reader woken after another took the failed
    end ends cleanly): two tasks both *waiting* for the next chunk when the stream
    fails must both raise; the one that did not take the end stopped as if the
    answer were complete.  (test_two_tasks_reading_a_failed_stream_both_hear_it
    reads with a sleep per chunk, so its second reader meets the end at the top.)"""
    up = FakeUpstream(Reply(tokens=4, inter_token_s=0.05, fault="truncated", fault_after=2))
    ends: list[str] = []
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("shared-fail")) as stream:

            async def read() -> None:
                try:
                    async for _ in stream:
                        pass
                except polygate.TransientUpstreamError:
                    ends.append("failed")
                    return
                ends.append("clean")

            await asyncio.wait_for(asyncio.gather(read(), read()), 10)
    assert ends == ["failed", "failed"]
