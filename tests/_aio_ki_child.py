"""Ctrl-C raised inside trio's scheduler under asyncio (tests/test_aio_interrupt.py).

    python -m tests._aio_ki_child asyncio|uvloop

asyncio.run()'s second Ctrl-C raises KeyboardInterrupt wherever the thread is, and
trio installs no protection of its own under a host's SIGINT handler: it can land in
trio's run loop, which then dies in TrioInternalError.  Modelled without timing: the
abort function of a call's wait raises it when trio's run loop delivers a deadline's
cancellation to it.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import trio

import polygate
import polygate.aio


class Interrupting(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raised: list[bool] = []

        def abort(_: Any) -> trio.lowlevel.Abort:
            if not raised:
                raised.append(True)
                raise KeyboardInterrupt  # a forced Ctrl-C, landing in trio's run loop
            return trio.lowlevel.Abort.SUCCEEDED

        with trio.move_on_after(0.01):  # delivered by the run loop as the deadline expires
            await trio.lowlevel.wait_task_rescheduled(abort)
        await trio.sleep_forever()
        raise AssertionError("unreachable")


SETTINGS = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
    polygate.Source(name="a", base_url="http://upstream/v1", model="m")])})


async def main() -> None:
    async with polygate.aio.session(SETTINGS, transport=Interrupting()) as s:
        print("open", flush=True)
        await s.chat([{"role": "user", "content": "hi"}])


if sys.argv[1] == "uvloop":
    import uvloop

    uvloop.run(main())
else:
    asyncio.run(main())
