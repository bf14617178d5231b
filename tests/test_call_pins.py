"""Behaviours of the logical call that no other test pinned (_call, _hedge, _stats).

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through."""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.governance import MemoryBackend
from polygate.testing import EventTransport, FakeUpstream, Reply, Router, Schedule
from tests.conftest import FIRST_A, MESSAGES, SECRET

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def _settings(*, names: tuple[str, ...] = ("a", "b"), scope_name: str = "chat",
              **scope: Any) -> polygate.Settings:
    sources = [
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET,
                        weight=FIRST_A.get(n, 1.0))
        for n in names
    ]
    return polygate.Settings(scopes={scope_name: polygate.Scope(sources=sources, **scope)})


async def test_a_hedged_round_with_a_429_and_a_5xx_consumes_an_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutant _call.py ``all(RateLimitedError)`` -> ``any``: only a round in which *every*
    attempt was rate limited is free of max_attempts (SPEC §3, hedging.md "429s inside
    a round keep their rule: a round that only saw rate limiting is free")."""
    a = FakeUpstream([Reply(status=500, headers_delay_s=10)], then=Reply(text="late"))
    b = FakeUpstream([Reply(status=429, retry_after_s=1)], then=Reply(text="late"))
    settings = _settings(hedge=polygate.Hedge(after_s=8), retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    errors = info.value.errors
    assert sorted(type(e).__name__ for e in errors) == ["RateLimitedError", "TransientUpstreamError"]
    assert len(a.requests) == len(b.requests) == 1


async def test_a_same_source_retry_after_a_5xx_backs_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutant _call.py ``if not isinstance(primary_error, RateLimitedError)`` inverted:
    failover.md: with same_source_retries the same source is asked again after a
    backoff (full jitter from backoff_base_s) after a 5xx, not at once."""
    a = FakeUpstream([Reply(status=503)], then=Reply(text="the preferred answer"))
    b = FakeUpstream(Reply(text="backup"))
    settings = _settings(retry=polygate.Retry(same_source_retries=1, backoff_base_s=1.0))
    async with polygate.session(settings, transport=Router({"a": a, "b": b}),
                                rng=random.Random(1)) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "a" and b.requests == []
    assert a.requests[0].started_at == 0
    assert 0 < a.requests[1].started_at <= 1.0


async def test_embeddings_are_never_hedged(autojump_clock: trio.testing.MockClock) -> None:
    """Mutant _hedge.py ``self._hedging`` without ``ctx.kind == "chat"``: hedging.md
    "Embeddings: polygate does not hedge them"."""
    a = FakeUpstream(Reply(first_token_s=20, embedding_dim=4))
    b = FakeUpstream(Reply(embedding_dim=4))
    settings = _settings(scope_name="embed", hedge=polygate.Hedge(after_s=2))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        e = await s.embed(["x"])
    assert e.source == "a" and b.requests == []
    assert e.call_stats.attempts == 1


async def test_a_streaming_hedge_stops_further_extras(autojump_clock: trio.testing.MockClock) -> None:
    """Mutant _hedge.py _next_trigger ``if late == math.inf: return math.inf`` ->
    ``continue``: hedging.md "one healthy attempt is enough ... a hedge that is streaming
    stops further hedges", with max_extra=2 too."""
    a = FakeUpstream(Reply(first_token_s=100, tokens=2))
    b = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=30))
    c = FakeUpstream(Reply(first_token_s=0.5, tokens=2))
    # a, then b before c for the first hedge (weights 1e-9 apart: make it certain; b
    # at 1e-3 put b first about once in 1,000 runs).
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, weight=w)
                 for n, w in (("a", 1.0), ("b", 1e-9), ("c", 1e-18))],
        hedge=polygate.Hedge(after_s=8, max_extra=2))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c})) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "b" and c.requests == []
    assert (r.call_stats.attempts, r.call_stats.hedges) == (2, 1)


class _ShieldedAdmits(MemoryBackend):
    """Like the Redis backend: an admission is a shielded 0.5 s round trip."""

    async def admit(self, request: Any) -> Any:
        with trio.CancelScope(shield=True):
            await trio.sleep(0.5)
        return await super().admit(request)


async def test_a_hedge_admission_granted_after_the_win_is_released(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant _hedge.py _try_hedge: ``await governor.release(result, ...)`` of an admission
    found too late dropped.  The primary (admitted 0.5, sent 0.5) answers at 8.8; the
    hedge triggers at 8.5 and its admission round trip ends at 9.0, after the win: it is
    never sent, and its permit and reservation go back (hedging.md: "a granted admission
    found too late is released unsent")."""
    import polygate._session as session_mod

    backend = _ShieldedAdmits()
    monkeypatch.setattr(session_mod, "_backend_for", lambda settings: backend)
    a = FakeUpstream(Reply(first_token_s=8.2, inter_token_s=0.1, tokens=2))
    b = FakeUpstream(Reply(first_token_s=1))
    settings = _settings(hedge=polygate.Hedge(after_s=8))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
        await trio.sleep(1)
        stats = await s.statistics()
    assert (r.source, r.call_stats.hedges) == ("a", 0)
    assert b.requests == []
    state = next(x.state for x in stats.governance.sources if x.state.source == "b")
    assert state.in_flight == 0 and state.tokens_reserved == 0


async def test_a_gap_exactly_at_the_stall_threshold_is_no_stall_despite_float_noise(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutant _stats.py ``threshold_ms / 1000.0 + _EPSILON_S`` -> ``threshold_ms / 1000.0``:
    tokens every 2.0 s from 2.3 s land at 2.3, 4.3, 6.3, 8.3, 10.3, and one difference
    reads 2.000000000000001; a gap equal to stall_threshold_ms (2000) is not a stall
    (statistics: "longer than stall_threshold_ms")."""
    a = FakeUpstream(Reply(first_token_s=2.3, inter_token_s=2.0, tokens=5))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)])})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        r = await s.chat(MESSAGES)
    st = r.call_stats
    assert (st.stall_count, st.stall_ms) == (0, 0.0)
    assert st.active_generation_ms == pytest.approx(8000)


def test_one_error_prefers_the_polygate_error_over_a_plain_exception() -> None:
    """Mutant _call.py one_error ``next(... PolygateError ...)`` -> ``errors[0]``: a nursery
    group holding a bug's exception and the call's polygate error surfaces the polygate
    error (SPEC §3: a public call raises exactly one polygate error; its docstring's
    order)."""
    from polygate._call import one_error

    fatal = polygate.FatalUpstreamError("bad request", source="a")
    group = BaseExceptionGroup("round", [ValueError("bug"), BaseExceptionGroup("inner", [fatal])])
    assert one_error(group) is fatal
    assert isinstance(one_error(BaseExceptionGroup("g", [ValueError("bug")])), ValueError)


from tests.test_hedge import _Rows  # noqa: E402


@pytest.mark.parametrize("seed", range(16))
def test_a_hedge_cancelled_by_a_fatal_primary_cannot_win_in_the_same_batch(seed: int) -> None:
    """Mutant _hedge.py _may_win without ``not path.control.cancelled``: the primary's 400
    (at 9) and the hedge's whole buffered answer (sent 8, done 9) wake in one batch.
    Whichever runs first decides: a fatal error ends the round and cancels the hedge,
    which then cannot win (hedging.md: "a cancelled path can neither commit nor ..."; a
    path wins only if "it was not cancelled"); or the hedge wins and the 400 is a loser's.
    Never both: the fatal row and the hedge's answer.  (Mutant-equivalent on its own:
    _attempt checks ``control.cancelled`` before claiming too; this pins the pair.)"""
    a = FakeUpstream(Reply(status=400, headers_delay_s=9))
    b = FakeUpstream(Reply(first_token_s=1, tokens=1))
    rows = _Rows()

    async def call() -> Any:
        settings = _settings(hedge=polygate.Hedge(after_s=8))
        async with polygate.session(settings, transport=EventTransport({"a": a, "b": b})) as s:
            s._runtime.recorder = rows  # type: ignore[assignment]
            try:
                return await s.chat(MESSAGES)
            except polygate.FatalUpstreamError as exc:
                return exc

    result = Schedule(seed).run(call)
    outcomes = {source: outcome for source, _, outcome in rows.rows}
    if isinstance(result, polygate.FatalUpstreamError):
        assert outcomes == {"a": "fatal", "b": "hedge_cancelled"}, outcomes
    else:
        assert result.source == "b", result
        assert outcomes["b"] == "ok" and outcomes["a"] != "fatal", outcomes


@pytest.mark.parametrize("seed", range(16))
def test_a_stream_cancelled_by_a_fatal_primary_never_commits(seed: int) -> None:
    """Mutant _hedge.py _committer without ``not path.control.cancelled``: as above for
    stream_chat(); the hedge's first content chunk arrives in the batch of the primary's
    400.  Either the 400 is raised and the caller saw nothing, or the hedge committed
    first and its whole text is the answer."""
    a = FakeUpstream(Reply(status=400, headers_delay_s=9))
    b = FakeUpstream(Reply(first_token_s=1, text="one two three"))
    shown: list[str] = []

    async def call() -> Any:
        settings = _settings(hedge=polygate.Hedge(after_s=8))
        async with polygate.session(settings, transport=EventTransport({"a": a, "b": b})) as s:
            try:
                async with s.stream_chat(MESSAGES) as stream:
                    async for chunk in stream:
                        shown.append(chunk.text)
                return stream.response
            except polygate.PolygateError as exc:
                return exc

    result = Schedule(seed).run(call)
    if isinstance(result, polygate.PolygateError):
        assert isinstance(result, polygate.FatalUpstreamError), repr(result)
        assert "".join(shown) == "", shown
    else:
        assert result.source == "b" and result.text == "".join(shown) == "one two three"
