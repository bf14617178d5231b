"""Review finding (failed on main f431ce0, fixed since), Low: an answer that came from the
fallback scope is stored under the asked scope's key (by design: the key is the
request's), but a hit then reports ``call_stats.scope`` = the *asked* scope with
``source`` = a source of the *fallback* scope — a pair that names no configured
source.  The miss said ``("big", "big")``; the hit says ``("chat", "big")``
(polygate/_cached.py:112-117, :220: ``_Call.stats`` always uses ``ctx.scope_name``).
Telemetry rows and ``polygate stats`` per-scope/per-source figures inherit it.

Run: python -m pytest tests/interplay/test_f_cache_hit_scope_of_a_fallback_answer.py -q
"""

from __future__ import annotations

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ..conftest import MESSAGES, SECRET


def _source(name: str) -> polygate.Source:
    return polygate.Source(name=name, base_url=f"http://{name}/v1", api_key=SECRET)


async def test_a_hit_reports_the_scope_its_source_belongs_to(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[_source("small")], fallback="big", cache_ttl_s=60.0,
                               retry=polygate.Retry(max_attempts=1)),
        "big": polygate.Scope(sources=[_source("big")]),
    }, cache="memory")
    routes = {"small": FakeUpstream(Reply(status=503)), "big": FakeUpstream(Reply(text="big answer"))}
    async with polygate.session(settings, transport=Router(routes)) as s:
        miss = await s.chat(MESSAGES)
        hit = await s.chat(MESSAGES)
    assert (miss.call_stats.scope, miss.call_stats.source) == ("big", "big")
    assert hit.call_stats.cached
    # Observed: ("chat", "big")
    assert (hit.call_stats.scope, hit.call_stats.source) == ("big", "big")
