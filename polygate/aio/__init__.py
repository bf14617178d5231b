"""polygate.aio: polygate for asyncio applications (asyncio, uvloop, FastAPI under
uvicorn, trio-asyncio's loop), without changing their event loop.

    async with polygate.aio.session(settings) as s:
        r = await s.chat(messages)

Same methods, arguments, results and errors as :class:`polygate.Session`.  polygate
runs as a trio *guest* on the running asyncio loop (one trio run per loop, shared by
its sessions; no thread per call).  Cancelling the asyncio task cancels the logical
call, and ``CancelledError`` arrives only after every path has settled.  See
docs/asyncio.md.
"""

from .._public import publish as _publish
from ._session import ChatStream as ChatStream
from ._session import Session as Session
from ._session import session as session

__all__ = ["ChatStream", "Session", "session"]

_publish(globals(), __all__, __name__)  # tracebacks and reprs say polygate.aio.X
del _publish
