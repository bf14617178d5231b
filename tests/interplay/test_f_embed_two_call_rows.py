"""Review finding (failed on main f431ce0, fixed since), Low: a cached ``embed`` that
computed its own misses and then ran out of time waiting on another call's flight
writes two call rows: run_embed's ``ok`` row (its own logical_call_id) and the cache
layer's DeadlineExceeded row (another id).  ``_Call.within`` records unconditionally
(polygate/_cached.py:98-101) although ``compute`` already set ``recorded``
(:378).  Telemetry then counts one failed call as one success plus one failure.
(The converse also holds: when a joined flight ends in a shared error after the call
computed its own misses, :438 skips the row and the only row says ``ok``.)

Run: python -m pytest tests/interplay/test_f_embed_two_call_rows.py -q
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ..conftest import SECRET


class Capture:
    def __init__(self) -> None:
        self.calls: list[tuple[str, BaseException | None]] = []

    def attempt(self, ctx: Any, record: Any) -> None:
        return None

    def call(self, ctx: Any, stats: polygate.CallStats, usage: Any, error: BaseException | None,
             output: Mapping[str, Any] | None = None) -> None:
        self.calls.append((stats.logical_call_id, error))


async def test_one_call_one_row(autojump_clock: trio.testing.MockClock) -> None:
    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)
    settings = polygate.Settings(
        scopes={"embed": polygate.Scope(sources=[source], cache_ttl_s=60.0)}, cache="memory"
    )
    # first request (the slow leader of "y") takes 10 s, every later one 0.1 s
    up = FakeUpstream([Reply(first_token_s=10.0)], then=Reply(first_token_s=0.1))
    capture = Capture()
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        s._runtime.recorder = capture

        async def leader() -> None:
            await s.embed(["y"])

        async def second() -> None:
            await trio.sleep(0.5)
            with pytest.raises(polygate.DeadlineExceeded):
                await s.embed(["y", "z"], call_deadline_s=3.0)  # leads z, waits on y

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)
            nursery.start_soon(second)
    rows_of_second = capture.calls[:-1]  # the leader's row comes last (t=10)
    # Observed: [(id1, None), (id2, DeadlineExceeded)]
    assert len(rows_of_second) == 1, rows_of_second
    assert isinstance(rows_of_second[0][1], polygate.DeadlineExceeded)
