"""polygate.aio: a loop closed under an open session, finished by the next session
(docs/asyncio.md, "When the host loop stops"); outside review, 2026-12-02."""

from __future__ import annotations

import asyncio
import gc
import sys
import warnings
from typing import Any

import pytest

import polygate.aio
from polygate.aio import _guest_io
from polygate.testing import FakeUpstream, Reply

from ._aio_support import _new_loop, _run, messages, settings_for, wait_until


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_the_rescue_leaves_the_new_loop_its_own_async_generator_hooks(kind: str) -> None:
    """The rescue ends the abandoned trio run inside the *new* loop's run; trio then
    restores the async-generator hooks it saved when that run started -- the closed
    loop's.  From then on, for the rest of the new loop's run, every async generator
    of the application is registered with (and finalized by) the closed loop: an
    abandoned one never runs its ``finally`` and the new loop's
    ``shutdown_asyncgens()`` does not see it."""
    import uvloop

    def new_loop() -> asyncio.AbstractEventLoop:
        return uvloop.new_event_loop() if kind == "uvloop" else asyncio.SelectorEventLoop()

    old = new_loop()
    block = polygate.aio.session(settings_for("http://a/v1"), transport=FakeUpstream().transport())
    old.run_until_complete(block.__aenter__())
    old.close()  # closed under an open session

    cleaned: list[str] = []

    async def app_generator():  # type: ignore[no-untyped-def]
        try:
            yield 1
            yield 2
        finally:
            cleaned.append("cleaned")

    async def main() -> bool:
        async with polygate.aio.session(settings_for("http://a/v1"),
                                        transport=FakeUpstream().transport()) as s:
            await s.chat(messages("x"))
        hooks_are_this_loops = getattr(sys.get_asyncgen_hooks().firstiter, "__self__", None) \
            is asyncio.get_running_loop()
        g = app_generator()
        await g.__anext__()
        del g  # abandoned: asyncio's finalizer hook should schedule its aclose()
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0.01)
        return hooks_are_this_loops

    with pytest.warns(ResourceWarning, match="still open when its event loop closed"):
        hooks_are_this_loops = _run(main(), kind)  # (asyncio.run() on a loop of this kind)
    assert hooks_are_this_loops
    assert cleaned == ["cleaned"]


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("io_mode", ["loop-io", "thread-io"])
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_trio_side_async_generators_stay_trios_after_the_loop_ran_again(
        kind: str, io_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside review: a loop "stopped and run again" (supported) dropped the
    async-generator hooks trio's guest run installed (asyncio's run_forever restores
    the hooks it found when it returns), so polygate's trio-side async generators
    (ChatStream._run, httpx's aiter_raw ...) were registered with the loop on the next
    run, and its shutdown_asyncgens() closed them from an asyncio task: "Task got bad
    yield", "asynchronous generator is already running", OSError(EBADF), a hang.  The
    run's hooks are put back before each of trio's steps."""
    if io_mode == "thread-io":
        monkeypatch.setattr(_guest_io, "_guest_tick", lambda: None)
    up = FakeUpstream(Reply(tokens=1000, inter_token_s=0.01))
    loop = _new_loop(kind)
    reported: list[Any] = []
    loop.set_exception_handler(lambda _l, c: reported.append((c.get("message"), c.get("exception"))))
    block = polygate.aio.session(settings_for("http://a/v1"), transport=up.transport())
    got: list[Any] = []

    async def consume(s: Any) -> None:
        async with s.stream_chat(messages("st")) as stream:
            async for chunk in stream:
                got.append(chunk)

    s = loop.run_until_complete(block.__aenter__())  # run 1: the session opens
    task = loop.create_task(consume(s))  # run 2: a stream in flight
    loop.run_until_complete(wait_until(lambda: len(got) > 3))
    try:
        with warnings.catch_warnings():
            # (The session is never left: closing its opening generator, which is
            # asyncio's, says so with a ResourceWarning.)
            warnings.simplefilter("ignore", ResourceWarning)
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), 10))
    except TimeoutError:
        reported.append(("loop.shutdown_asyncgens() hung", None))
    trio_side = [(m, repr(e)[:80]) for m, e in reported]
    task.cancel()
    loop.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)

        async def again() -> None:  # (finishes the abandoned run)
            async with polygate.aio.session(settings_for("http://a/v1"), transport=FakeUpstream(Reply()).transport()):
                pass

        _run(again(), kind)
    assert trio_side == [], trio_side


async def _own_generator() -> Any:
    yield 1


@pytest.mark.parametrize("io_mode", ["loop-io", "thread-io"])
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_hooks_the_application_installs_after_opening_stay_in_force(
        kind: str, io_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review (asyncio's less common modes): async-generator hooks an application
    installs while a session is open (a tracer wrapping the current ones) were
    replaced by trio's before its next step, for the rest of the loop's run: the
    tracer never saw the application's own generators again.  trio's hooks are in
    place for trio's steps only; between them, the application's."""
    if io_mode == "thread-io":
        monkeypatch.setattr(_guest_io, "_guest_tick", lambda: None)
    seen: list[str] = []

    def trace() -> None:
        wrapped = sys.get_asyncgen_hooks()

        def firstiter(agen: Any) -> None:
            seen.append(agen.__qualname__)
            if wrapped.firstiter is not None:
                wrapped.firstiter(agen)

        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=wrapped.finalizer)

    async def main() -> None:
        async with polygate.aio.session(settings_for("http://a/v1"),
                                        transport=FakeUpstream(Reply()).transport()) as s:
            trace()
            await s.chat(messages("first"))  # trio's steps run here
            assert [x async for x in _own_generator()] == [1]
            async with s.stream_chat(messages("then")) as stream:  # trio's own generators
                assert [c async for c in stream]
            assert [x async for x in _own_generator()] == [1]

    _run(main(), kind)
    assert seen == ["_own_generator", "_own_generator"], seen
