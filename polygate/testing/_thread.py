"""The loopback face from code that is not in a trio run: an asyncio test (an app on
``polygate.aio``, FastAPI, the openai SDK) or a plain synchronous one.

The server gets a trio run of its own in a thread that the context manager owns: the
block does not start until the server listens (or its error, the same one
:meth:`FakeUpstream.serve` raises, is raised here), and does not end until the run is
over and the thread joined, so no server outlives the block that asked for it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ._upstream import FakeUpstream

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["serve_in_thread"]

#: How long leaving the block waits for the server's run to end.  It closes every
#: connection at once (a cancel), so only a behaviour callable that blocks its thread
#: can hold it: that is a hang to report, not to wait out.
_STOP_S = 30.0


@contextmanager
def serve_in_thread(upstream: FakeUpstream, host: str, port: int) -> Iterator[str]:
    started = threading.Event()
    # Written by the server's thread before ``started`` is set (or before it ends),
    # read by this one after: the Event orders the two.
    state: dict[str, Any] = {}

    async def serve() -> None:
        stop = trio.Event()
        state["stop"] = stop
        state["token"] = trio.lowlevel.current_trio_token()
        async with upstream.serve(host, port) as url:
            state["url"] = url
            started.set()
            await stop.wait()

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as exc:  # handed to the thread that owns this one
            # The one error inside trio's nurseries' groups (a behaviour's, say) as
            # itself: what a test's ``pytest.raises`` names.
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            state["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=run, name=f"polygate-fake-{upstream.name}", daemon=True)
    thread.start()

    def stop() -> None:
        """Stop the server (once it has started, or failed to) and join its thread."""
        started.wait()
        if "token" in state:
            try:
                state["token"].run_sync_soon(state["stop"].set)
            except trio.RunFinishedError:
                pass  # the run already ended, with an error or before it listened
        thread.join(_STOP_S)
        if thread.is_alive():
            raise RuntimeError(
                f"the fake upstream {upstream.name!r} did not stop within {_STOP_S:g} s "
                "(a behaviour callable that blocks its thread?)")

    try:
        started.wait()
    except BaseException:  # a KeyboardInterrupt while it starts: no server is left behind
        stop()
        raise
    if "url" not in state:  # the server never listened: its own error, here
        thread.join()
        raise state["error"]
    try:
        yield state["url"]
    except BaseException:
        stop()
        if "error" in state:
            # What ended the server (a behaviour that called pytest.fail, say) is what
            # the block's failure came from: raised, with the block's as its context.
            raise state["error"]  # noqa: B904
        raise
    stop()
    if "error" in state:
        raise state["error"]
