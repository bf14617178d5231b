"""A KeyboardInterrupt or SystemExit raised inside one polygate.aio call by the
caller's own code (tests/test_aio_interrupt.py runs it).

    python -m tests._aio_raise_child LOOP EXCEPTION

Prints one line a call: the call that raised, a call in flight beside it, and the
next call; then how asyncio.run() ended."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx

import polygate
import polygate.aio
from polygate.testing import FakeUpstream, Reply, Router

LOOP, RAISED = sys.argv[1], {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[sys.argv[2]]
ASK = [{"role": "user", "content": "hi"}]


class Raising(httpx.AsyncBaseTransport):
    """Raises once, for the request that says "boom"."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.armed = inner, True

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if b"boom" in request.content and self.armed:
            self.armed = False
            raise RAISED()
        return await self.inner.handle_async_request(request)


async def main() -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    upstream = FakeUpstream(Reply(text="ok", first_token_s=0.3))
    async with polygate.aio.session(settings, transport=Raising(Router({"a": upstream}))) as s:
        beside = asyncio.ensure_future(s.chat(ASK))
        await asyncio.sleep(0.05)

        async def report(name: str, call: Any) -> None:
            try:
                print(name, "ok", (await call).text)
            except BaseException as exc:  # (what the caller gets is the subject)
                print(name, type(exc).__name__)

        await report("raised", s.chat([{"role": "user", "content": "boom"}]))
        await report("beside", beside)
        await report("next", s.chat(ASK))


try:
    if LOOP == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    print("run returned")
except BaseException as exc:
    print("run raised", type(exc).__name__)
