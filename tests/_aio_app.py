"""A FastAPI application on polygate.aio, served by uvicorn on uvloop: the process
``tests/test_aio_uvicorn.py`` starts (and the shape docs/asyncio.md describes).

    python tests/_aio_app.py UPSTREAM_BASE_URL

It binds 127.0.0.1 on a port the OS picks and prints ``listening on PORT``; the
lifespan opens the session and prints what it saw when it closes.
"""

# No ``from __future__ import annotations``: FastAPI reads the annotations at run time.

import asyncio
import logging
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Annotated, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

import polygate
import polygate.aio

T = TypeVar("T")


async def cancel_on_disconnect(request: Request, call: Awaitable[T]) -> T:
    """Await ``call``; if the client hangs up first, cancel it (polygate then closes
    the upstream connection before the cancellation goes on) and end the request
    quietly (499: nobody reads it)."""
    task = asyncio.ensure_future(call)
    gone = False

    async def watch() -> None:
        nonlocal gone
        while not task.done():
            if (await request.receive())["type"] == "http.disconnect":
                gone = True
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone:
            raise HTTPException(499, "client closed request") from None
        raise
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


class _Errors(logging.Handler):
    """Counts what the server logs at ERROR (an exception escaping an endpoint)."""

    count = 0

    def emit(self, record: logging.LogRecord) -> None:
        _Errors.count += 1



class Ask(BaseModel):
    question: str


async def get_session(request: Request) -> polygate.aio.Session:
    """The dependency: the session the lifespan opened (``async def``: FastAPI runs
    a plain ``def`` dependency in its thread pool, a thread per request)."""
    session: polygate.aio.Session = request.app.state.polygate
    return session


Session = Annotated[polygate.aio.Session, Depends(get_session)]


def build_app(settings: polygate.Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        print(f"loop: {type(asyncio.get_running_loop()).__module__}", flush=True)
        # (here: uvicorn's logging set-up has replaced the handlers of its loggers)
        logging.getLogger("uvicorn.error").addHandler(_Errors(logging.ERROR))
        async with polygate.aio.session(settings) as session:
            app.state.polygate = session
            yield
            stats = await session.statistics()
            held = sum(s.state.in_flight + s.state.tokens_reserved for s in stats.governance.sources)
            print(f"lifespan: closing, held={held}", flush=True)
        print("lifespan: closed", flush=True)

    app = FastAPI(lifespan=lifespan)

    @app.post("/ask")
    async def ask(body: Ask, request: Request, s: Session) -> dict[str, object]:
        call = s.chat([{"role": "user", "content": body.question}])
        r = await cancel_on_disconnect(request, call)
        return {"answer": r.text, "source": r.source, "attempts": r.call_stats.attempts}

    @app.post("/stream")
    async def stream(body: Ask, s: Session) -> StreamingResponse:
        async def chunks() -> AsyncIterator[str]:
            # Starlette cancels this generator when the client hangs up.
            async with s.stream_chat([{"role": "user", "content": body.question}]) as st:
                async for chunk in st:
                    yield chunk.text

        return StreamingResponse(chunks(), media_type="text/plain")

    @app.get("/process")
    async def process() -> dict[str, int]:
        return {"threads": threading.active_count(), "errors_logged": _Errors.count}

    @app.get("/held")
    async def held(s: Session) -> dict[str, int]:
        stats = await s.statistics()
        return {"held": sum(x.state.in_flight + x.state.tokens_reserved
                            for x in stats.governance.sources)}

    return app


def main() -> None:
    upstream = sys.argv[1]
    source = polygate.Source(name="a", base_url=upstream, api_key="sk-test", model="m")
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[source])})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"listening on {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(build_app(settings), loop="uvloop", lifespan="on",
                            timeout_graceful_shutdown=1, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
