"""Moving to a fallback past open breakers counts one admission an attempt (outside review of 2ca7b4f, 2026-12-02)."""
from __future__ import annotations

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

MESSAGES = [{"role": "user", "content": "hello there"}]


async def test_moving_to_the_fallback_counts_one_admission_per_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """_fallback_admits (polygate/_call.py) admits the call on the fallback and gives
    the admission back (sent=False) before the call moves there and is admitted again:
    the fallback's source counts two ``admissions`` (docs/reference: metric
    ``polygate_source_admissions`` "Attempts admitted to the source") for one attempt."""
    a_up = FakeUpstream(Reply(status=500))
    b_up = FakeUpstream(Reply(text="from b"))
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                               fallback="large", retry=polygate.Retry(max_attempts=1),
                               breaker=polygate.Breaker(failures=1, open_s=30.0, max_open_s=30.0)),
        "large": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1")],
                                retry=polygate.Retry(max_attempts=1)),
    })
    async with polygate.session(settings, transport=Router({"a": a_up, "b": b_up})) as s:
        await s.chat(MESSAGES)  # a fails (breaker opens), b answers
        r = await s.chat(MESSAGES)  # a's breaker open: straight to b
        assert r.text == "from b"
        stats = await s.statistics()
    b = next(x.state for x in stats.governance.sources if x.state.source == "b")
    assert len(b_up.requests) == 2
    assert b.admissions == 2, b
    assert b.released_total == 0, b
