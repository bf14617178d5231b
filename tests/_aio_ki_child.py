"""A trio run broken under polygate.aio (tests/test_aio_interrupt.py runs it).

    python -m tests._aio_ki_child LOOP MODE SCENARIO

LOOP: asyncio | uvloop.  MODE: loop-io (trio's I/O wait on the loop) | thread-io
(trio's helper thread, as tests/test_aio.py selects it).  SCENARIO:

call, stream: asyncio.run()'s second Ctrl-C raises KeyboardInterrupt wherever the
    thread is, and trio installs no protection of its own under a host's SIGINT
    handler: it can land in trio's run loop, which then dies in TrioInternalError.
    Modelled without timing: the abort function of a call's wait raises it when trio's
    run loop delivers a deadline's cancellation to it (a call, or an open stream).
stats: the same, under a loop driven by hand that, on KeyboardInterrupt, cancels its
    task and asks the session for its figures, bounded by asyncio.wait_for.
bug: not a Ctrl-C but a bug (ValueError) breaks the run, while the application
    handles an earlier Ctrl-C of its own: the bug is not a new Ctrl-C.
left: a bug breaks the run; the call times out and the block is then left normally,
    inside an ``except`` clause of the application's: the block's exit says the run
    ended (a handled exception in ``sys.exc_info()`` is not one leaving the block).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import trio

import polygate
import polygate.aio
from polygate.aio import _guest_io

LOOP, MODE, SCENARIO = sys.argv[1:4]
if MODE == "thread-io":
    _guest_io._guest_tick = lambda: None  # type: ignore[assignment]
ASK = [{"role": "user", "content": "hi"}]


class Breaking(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raised: list[bool] = []

        def abort(_: Any) -> trio.lowlevel.Abort:
            if not raised:
                raised.append(True)
                if SCENARIO in ("bug", "left"):
                    raise ValueError("a bug in trio's run loop")
                raise KeyboardInterrupt  # a forced Ctrl-C, landing in trio's run loop
            return trio.lowlevel.Abort.SUCCEEDED

        with trio.move_on_after(0.01):  # delivered by the run loop as the deadline expires
            await trio.lowlevel.wait_task_rescheduled(abort)
        await trio.sleep_forever()
        raise AssertionError("unreachable")


SETTINGS = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
    polygate.Source(name="a", base_url="http://upstream/v1", model="m")])})
held: list[polygate.aio.Session] = []


async def main() -> None:
    async with polygate.aio.session(SETTINGS, transport=Breaking()) as s:
        held.append(s)
        print("open", flush=True)
        if SCENARIO == "stream":
            async with s.stream_chat(ASK) as stream:
                async for _ in stream:
                    pass
        else:
            await asyncio.wait_for(s.chat(ASK), 5)


def by_hand() -> None:
    """A loop driven by hand: on Ctrl-C, cancel, then report (bounded)."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except KeyboardInterrupt:
        task.cancel()
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        try:
            loop.run_until_complete(asyncio.wait_for(held[0].statistics(), 5))
        except polygate.PolygateError as exc:
            print(f"statistics: {exc}", flush=True)


def handling_a_ctrl_c() -> None:
    """The application's own handling of a first Ctrl-C runs polygate; a bug breaks it."""
    loop = asyncio.new_event_loop()
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            loop.run_until_complete(main())
    except KeyboardInterrupt:
        print("outcome: KeyboardInterrupt", flush=True)
    except BaseException as exc:
        print(f"outcome: {type(exc).__name__}", flush=True)


async def left_in_an_except_clause() -> None:
    try:
        raise LookupError("a miss the application handles")
    except LookupError:
        async with polygate.aio.session(SETTINGS, transport=Breaking()) as s:
            print("open", flush=True)
            try:
                await asyncio.wait_for(s.chat(ASK), 0.5)
            except asyncio.TimeoutError:
                pass


if SCENARIO == "stats":
    by_hand()
elif SCENARIO == "left":
    try:
        asyncio.run(left_in_an_except_clause())
    except polygate.PolygateError as exc:
        print(f"left: {exc}", flush=True)
elif SCENARIO == "bug":
    handling_a_ctrl_c()
elif LOOP == "uvloop":
    import uvloop

    uvloop.run(main())
else:
    asyncio.run(main())
