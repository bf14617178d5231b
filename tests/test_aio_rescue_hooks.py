"""polygate.aio: a loop closed under an open session, finished by the next session
(docs/asyncio.md, "When the host loop stops"); outside review, 2026-12-02."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest

import polygate.aio
from polygate.testing import FakeUpstream

from ._aio_support import _run, messages, settings_for


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
