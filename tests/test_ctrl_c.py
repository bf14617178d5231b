"""Ctrl-C (a real SIGINT, through trio's handler) in the middle of a call.

Outside review (KeyboardInterrupt through every layer): trio raises KeyboardInterrupt
in whatever unprotected code runs when the signal comes.  Landing between a source's
admission and the attempt's try/finally that settles it (a path's set-up, the
attempt's record), or inside that settle, it left the permit and the reservation
taken for the session's life: with ``max_in_flight=1`` every later call was refused.
Landing just after a caller's transport answered, it left the response open, the
upstream still sending.  Its review: landing as a stream's producer task started, it
made the stream's block impossible to leave (a second Ctrl-C too); in the cache's
leader, it left a flight claimed that every later identical call waited on.  A call's
code is now protected: the interrupt comes at the next checkpoint, as itself, with
everything settled."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply, Router

pytestmark = [pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs raise_signal"),
              pytest.mark.timeout(60)]  # (a stream's block that cannot be left: a hang)

MESSAGES = [{"role": "user", "content": "hello"}]
PACKAGE = os.path.dirname(polygate.__file__)


@contextmanager
def _ctrl_c_at(filename: str, function: str, nth: int = 1) -> Iterator[list[int]]:
    """A SIGINT as polygate's ``filename``'s ``function`` starts its ``nth`` call (its
    first line: where CPython runs a pending signal's handler, and trio's raises
    KeyboardInterrupt unless the code there is protected).  A profile hook, not a
    wrapper: a wrapper of a task's function would be the task's own unprotected frame."""
    path = os.path.join(PACKAGE, filename)
    calls = [0]

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        # ("call" is also a coroutine's resume: only its start, where a signal lands.)
        if event != "call" or code.co_name != function or code.co_filename != path \
                or frame.f_lasti > _start(code):
            return
        calls[0] += 1
        if calls[0] == nth:
            sys.setprofile(None)
            signal.raise_signal(signal.SIGINT)

    sys.setprofile(hook)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def _start(code: Any) -> int:
    import dis

    return next((i.offset for i in dis.get_instructions(code)
                 if i.opname == "RESUME" and i.arg == 0), 0)


CASES = {
    # (kind, polygate file, function, which call of it)
    "new_attempt": ("chat", "_context.py", "new_attempt", 1),
    "release": ("chat", "governance/_governor.py", "release", 1),
    "hedge": ("hedge", "_context.py", "new_attempt", 2),
    "transport": ("chat", "transport/_pool.py", "is_lean", 1),
    "producer": ("stream", "_session.py", "_producer", 1),
    "cache_leader": ("cached", "_cached.py", "_encoded", 1),
    "cache_put": ("cached", "cache/_cache.py", "put", 1),
    "embed_compute": ("embed", "_cached.py", "compute", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ctrl_c_in_a_call_leaves_nothing_taken(case: str) -> None:
    kind, filename, function, nth = CASES[case]
    sources = [polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)]
    if kind == "hedge":  # (a the primary, always: b answers only as the hedge)
        sources.append(polygate.Source(name="b", base_url="http://b/v1", max_in_flight=1,
                                       weight=1e-9))
    cached = kind in ("cached", "embed")
    scope = polygate.Scope(sources=sources,
                           hedge=polygate.Hedge(after_s=0.05) if kind == "hedge" else polygate.Hedge(),
                           cache_ttl_s=3600 if cached else None)
    settings = polygate.Settings(scopes={"chat": scope, "embed": scope},
                                 cache="memory" if cached else "off")
    slow = Reply(text="ok", first_token_s=0.2 if kind == "hedge" else 0.0, tokens=20, inter_token_s=0.01)
    upstreams = {"a": FakeUpstream(slow), "b": FakeUpstream(Reply(text="ok"))}
    seen: dict[str, Any] = {}

    async def call(s: polygate.Session) -> str:
        if kind == "stream":
            async with s.stream_chat(MESSAGES) as stream:
                return "".join([chunk.text async for chunk in stream])
        if kind == "embed":
            return str(len((await s.embed(["one", "two"])).vectors))
        return (await s.chat(MESSAGES)).text

    async def main() -> None:
        async with polygate.session(settings, transport=Router(upstreams)) as s:
            with _ctrl_c_at(filename, function, nth) as calls:
                try:
                    await call(s)
                    # (Held back to a checkpoint, it lands at the caller's next one.)
                    await trio.lowlevel.checkpoint()
                except KeyboardInterrupt:
                    seen["caught"] = True
            assert calls[0] >= nth, f"{function} was not called {nth} time(s)"
            await trio.sleep(0.3)  # (the upstream's side of a closed response)
            states = [x.state for x in (await s.statistics()).governance.sources]
            seen["taken"] = [(x.in_flight, x.tokens_reserved) for x in states]
            seen["upstream_in_flight"] = sum(u.in_flight for u in upstreams.values())
            with trio.move_on_after(5):
                seen["next"] = await call(s)

    try:
        trio.run(main)
    except KeyboardInterrupt:  # (not to end the test run: the finding itself)
        pytest.fail("the Ctrl-C escaped the block that catches it")
    assert seen.get("taken") and set(seen["taken"]) == {(0, 0)}, seen  # (each scope's sources)
    assert seen == {"caught": True, "taken": seen["taken"], "upstream_in_flight": 0,
                    "next": "2" if kind == "embed" else "ok"}, seen
