"""os.fork() in a process that uses polygate.aio (tests/test_aio_fork.py runs it).

    python -m tests._aio_fork_child URL SCENARIO

preload:   the parent opened and closed a session, then forks; the child opens its own.
own:       the parent forks with a session open (inside asyncio.run, as
           multiprocessing's 'fork' start method does); the child opens its own.
inherited: the parent forks with a session open on a loop it drives; the child calls
           that session on the loop object it inherited, then leaves its block.
exit:      the parent forks inside its session's block (in asyncio.run); the child
           touches nothing of polygate's and ends with sys.exit(0), leaving the
           inherited block (and asyncio.run's shutdown) on its way out.
inflight:  as exit, with another task's call in flight at the fork (the child's
           shutdown cancels it) and a stream's block open around the sys.exit.

Each process prints what it saw, one line each; a child's polygate error is printed
as ``child error: <message>``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import polygate
import polygate.aio

URL, SCENARIO = sys.argv[1], sys.argv[2]
SETTINGS = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
    polygate.Source(name="a", base_url=URL, api_key="sk-test", model="m")])})


def ask(tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": tag}]


async def own_session(tag: str) -> str:
    async with polygate.aio.session(SETTINGS) as s:
        return (await s.chat(ask(tag))).text


def in_child(body: Callable[[], Any]) -> None:
    """Run ``body`` in a forked child (bounded by an alarm), print its outcome."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a hang fails the test instead of holding it
        code = 0
        try:
            print("child", body(), flush=True)
        except polygate.PolygateError as exc:
            print(f"child error: {exc}", flush=True)
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)


def fork_leaving_by_sys_exit() -> None:
    """Fork; the child ends with sys.exit(0), leaving every block it is in on its way
    out; the parent prints the child's status.  The parent waits blocking, not in a
    thread: the child's asyncio.run() shutdown unregisters this loop's self-pipe from
    the epoll they share (asyncio's own hazard: plain asyncio hangs so too), so a
    thread's result would never wake it."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)
        sys.exit(0)  # the child's work is done
    _, status = os.waitpid(pid, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)


if SCENARIO == "preload":
    print("parent", asyncio.run(own_session("before")), flush=True)
    in_child(lambda: asyncio.run(own_session("own")))
    print("parent", asyncio.run(own_session("after")), flush=True)
elif SCENARIO == "exit":

    async def main_exit() -> None:
        async with polygate.aio.session(SETTINGS) as s:
            print("parent", (await s.chat(ask("warm"))).text, flush=True)
            fork_leaving_by_sys_exit()
            print("parent", (await asyncio.wait_for(s.chat(ask("again")), 20)).text, flush=True)
        print("parent closed", flush=True)

    asyncio.run(main_exit())
elif SCENARIO == "inflight":

    async def main_inflight() -> None:
        async with polygate.aio.session(SETTINGS) as s:
            print("parent", (await s.chat(ask("warm"))).text, flush=True)
            slow = asyncio.ensure_future(s.chat(ask("slow")))
            await asyncio.sleep(0.3)  # (the slow call is at the upstream)
            async with s.stream_chat(ask("streamed")) as stream:
                first = await stream.__anext__()  # (the stream is under way at the fork)
                fork_leaving_by_sys_exit()
                rest = "".join([chunk.text async for chunk in stream])
                print("parent", first.text + rest, flush=True)
            print("parent", (await asyncio.wait_for(slow, 20)).text, flush=True)
            print("parent", (await asyncio.wait_for(s.chat(ask("again")), 20)).text, flush=True)
        print("parent closed", flush=True)

    asyncio.run(main_inflight())
elif SCENARIO == "own":

    async def main() -> None:
        async with polygate.aio.session(SETTINGS) as s:
            print("parent", (await s.chat(ask("warm"))).text, flush=True)
            in_child(lambda: asyncio.run(own_session("own")))
            print("parent", (await s.chat(ask("again"))).text, flush=True)

    asyncio.run(main())
else:
    loop = asyncio.new_event_loop()
    block = polygate.aio.session(SETTINGS)
    s = loop.run_until_complete(block.__aenter__())
    print("parent", loop.run_until_complete(s.chat(ask("warm"))).text, flush=True)

    def inherited() -> str:
        try:
            loop.run_until_complete(s.chat(ask("child")))
        except polygate.PolygateError as exc:
            print(f"child error: {exc}", flush=True)
        return str(loop.run_until_complete(block.__aexit__(None, None, None)))

    in_child(inherited)
    print("parent", loop.run_until_complete(asyncio.wait_for(s.chat(ask("again")), 20)).text,
          flush=True)
    loop.run_until_complete(asyncio.wait_for(block.__aexit__(None, None, None), 20))
    loop.close()
    print("parent closed", flush=True)
