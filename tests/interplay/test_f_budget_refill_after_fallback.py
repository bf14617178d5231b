"""Review finding (failed on main f431ce0, fixed since), Low: a call that moved to its
fallback scope refills the *fallback* scope's hedge budget (or none), never the scope
whose token its hedge took.  ``_with_deadline``'s finally reads ``ctx.scope`` /
``ctx.scope_name`` (polygate/_call.py:130-132), which ``_move_to`` (:485-490) changed.

Run: python -m pytest tests/interplay/test_f_budget_refill_after_fallback.py -q
"""

from __future__ import annotations

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ..conftest import MESSAGES, SECRET


def _source(name: str, weight: float = 1.0) -> polygate.Source:
    return polygate.Source(name=name, base_url=f"http://{name}/v1", api_key=SECRET, weight=weight)


async def test_refill_goes_to_the_scope_that_hedged(autojump_clock: trio.testing.MockClock) -> None:
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(
            sources=[_source("a"), _source("b", weight=1e-9)],  # a first, b the hedge
            hedge=polygate.Hedge(after_s=1.0, budget_burst=2, budget_ratio=0.5),
            retry=polygate.Retry(max_attempts=1), fallback="big",
        ),
        "big": polygate.Scope(sources=[_source("big")]),
    })
    a = FakeUpstream(Reply(status=500, headers_delay_s=2.0))  # slow failure: b is hedged
    b = FakeUpstream(Reply(status=500, headers_delay_s=0.5))
    big = FakeUpstream(Reply(text="ok"))
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "big": big})) as s:
        r = await s.chat(MESSAGES)
        budget = (await s.statistics()).governance.hedge_budget
    assert (r.call_stats.scope, r.call_stats.hedges) == ("big", 1)
    # One token taken (2 -> 1), one finished call refills budget_ratio: 1.5.
    # Observed: 1.0 (the refill was skipped: the call ended in 'big', which does not hedge).
    assert budget["chat"] == 1.5, budget
