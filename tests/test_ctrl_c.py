"""Ctrl-C (a real SIGINT, through trio's handler) in the middle of a call.

Outside review (KeyboardInterrupt through every layer): trio raises KeyboardInterrupt
in whatever unprotected code runs when the signal comes.  Landing between a source's
admission and the attempt's try/finally that settles it (a path's set-up, the
attempt's record), or inside that settle, it left the permit and the reservation
taken for the session's life: with ``max_in_flight=1`` every later call was refused.
Landing just after a caller's transport answered, it left the response open, the
upstream still sending.  The call's own code is now protected: the interrupt comes at
the caller's next checkpoint, as itself, with everything settled."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import trio

import polygate
from polygate import _context
from polygate.governance import _governor
from polygate.testing import FakeUpstream, Reply, Router
from polygate.transport import _exchange

MESSAGES = [{"role": "user", "content": "hello"}]


def _ctrl_c_at(owner: Any, name: str, monkeypatch: pytest.MonkeyPatch, nth: int = 1) -> None:
    """A SIGINT as ``owner.name`` starts its ``nth`` call: where CPython runs a pending
    signal's handler, and trio's raises KeyboardInterrupt unless the code is protected."""
    original = getattr(owner, name)
    calls = [0]

    def ctrl_c() -> None:
        calls[0] += 1
        if calls[0] == nth:
            signal.raise_signal(signal.SIGINT)

    if original.__code__.co_flags & 0x80:  # (a coroutine function)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctrl_c()
            return await original(*args, **kwargs)
    else:
        def wrapper(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            ctrl_c()
            return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs signal.raise_signal")
@pytest.mark.parametrize("where", ["new_attempt", "release", "hedge", "transport"])
def test_ctrl_c_in_a_call_leaves_nothing_taken(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hedged = where == "hedge"
    sources = [polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)]
    if hedged:
        sources.append(polygate.Source(name="b", base_url="http://b/v1", max_in_flight=1))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=sources, hedge=polygate.Hedge(after_s=0.05) if hedged else polygate.Hedge())})
    slow = Reply(text="ok", first_token_s=0.2 if hedged else 0.0, tokens=20, inter_token_s=0.01)
    upstreams = {"a": FakeUpstream(slow), "b": FakeUpstream(Reply(text="ok"))}
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with polygate.session(settings, transport=Router(upstreams)) as s:
            if where in ("new_attempt", "hedge"):
                _ctrl_c_at(_context.CallContext, "new_attempt", monkeypatch, nth=2 if hedged else 1)
            elif where == "release":
                _ctrl_c_at(_governor.Governor, "release", monkeypatch)
            else:
                _ctrl_c_at(_exchange, "is_lean", monkeypatch)
            try:
                await s.chat(MESSAGES)
                # (Held back to a checkpoint, it lands at the caller's next one.)
                await trio.lowlevel.checkpoint()
            except KeyboardInterrupt:
                seen["caught"] = True
            monkeypatch.undo()
            await trio.sleep(0.3)  # (the upstream's side of a closed response)
            states = [x.state for x in (await s.statistics()).governance.sources]
            seen["taken"] = [(x.in_flight, x.tokens_reserved) for x in states]
            seen["upstream_in_flight"] = sum(u.in_flight for u in upstreams.values())
            with trio.fail_after(5):
                seen["next"] = (await s.chat(MESSAGES, call_deadline_s=2)).text

    try:
        trio.run(main)
    except KeyboardInterrupt:  # (not to end the test run: the finding itself)
        pytest.fail("the Ctrl-C escaped the block that catches it")
    assert seen == {"caught": True, "taken": [(0, 0)] * len(sources),
                    "upstream_in_flight": 0, "next": "ok"}, seen
