"""Review finding (failed on main f431ce0, fixed since), Medium-Low: coalescing turns a
failure that is not a "shared verdict" into a queue.  Four identical
``chat(schema=...)`` calls whose answers never validate: without the cache all four
end at t=3 s (1 round + 2 re-asks of 1 s each, concurrently); with the cache the
leader fails with StructuredOutputError (not in ``_SHARED``, polygate/_cached.py:54),
the flight is abandoned (:274-276), one waiter leads again while the others wait on
it, and so on: they end at 3, 6, 9 and 12 s — with exactly the same 12 upstream
requests.  The same queue forms behind any handed-over failure (a leader's own
deadline, a committed stream that stalled, a cancelled leader whose waiters all have
the same deadline...).

Run: python -m pytest tests/interplay/test_f_cache_handover_serialises.py -q
"""

from __future__ import annotations

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ..conftest import MESSAGES, SECRET

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


async def _ends(cache: str) -> tuple[list[float], int]:
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
            cache_ttl_s=60.0,
        )},
        cache=cache,
    )
    upstream = FakeUpstream(Reply(text="not json", first_token_s=1.0))
    ends: list[float] = []
    async with polygate.session(settings, transport=Router({"a": upstream})) as s:

        async def one() -> None:
            try:
                await s.chat(MESSAGES, schema=SCHEMA)
            except polygate.StructuredOutputError:
                ends.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
    return sorted(ends), len(upstream.requests)


async def test_identical_failing_structured_calls_are_not_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    without, sent_without = await _ends("off")
    assert [t - start for t in without] == [3.0] * 4 and sent_without == 12
    start = trio.current_time()
    with_cache, sent_with = await _ends("memory")
    # Observed: [3.0, 6.0, 9.0, 12.0] and 12 requests: no request saved, 4x the latency.
    assert [t - start for t in with_cache] == [3.0] * 4 or sent_with == 3, (
        [t - start for t in with_cache], sent_with
    )
