"""The memory backend's edges, as tests/test_governance_pins.py pins them, on both
backends: ``memory`` (MockClock, 60 s windows) and ``redis`` (a real redis-server,
the real clock, small windows), through tests/test_backend_contract.py's harness.
Its bounds hold whatever the scheduling delays: a server instant lies between the
local send and receive of the request that read it, and an assertion that needs an
instant to be still ahead is made only when the reply came back before it."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import trio
import trio.testing

from polygate.governance import (
    Admission,
    BreakerPolicy,
    BreakerState,
    Feedback,
    GovernanceBackend,
    RefusalReason,
    SettleRequest,
)
from tests import _redis_server
from tests._redis_server import command
from tests.test_backend_contract import EPS, Harness, ask, granted, refused, settle, snap

redis_server = _redis_server.redis_server  # the fixture


@pytest.fixture(params=["memory", "redis"])
def h(request: pytest.FixtureRequest) -> Harness:
    if request.param == "memory":
        return Harness("memory", 60.0)
    server = request.getfixturevalue("redis_server")
    return Harness("redis", 1.2, server.url)


# ------------------------------------------------------------------ cooldowns


def test_a_shorter_cooldown_on_the_same_source_keeps_the_longer(h: Harness) -> None:
    async def body() -> None:
        W = h.window
        async with h.backend() as b:
            x, y = await granted(b, ask()), await granted(b, ask())
            long_sent = b.now()
            await b.settle(settle(x, 0, Feedback.NEUTRAL, cooldown_s=W / 2))
            long_recv = b.now()
            await b.settle(settle(y, 0, Feedback.NEUTRAL, cooldown_s=W / 60))
            sent = b.now()
            refusal = await refused(b, ask(), RefusalReason.COOLING_DOWN)
            recv = b.now()
            assert refusal.retry_at is not None
            assert long_sent + W / 2 - EPS <= refusal.retry_at <= long_recv + W / 2 + (recv - sent) + EPS
            await trio.sleep(W / 20)  # the short cooldown is over
            result = await b.admit(ask())
            if b.now() < long_sent + W / 2 - EPS:
                assert not isinstance(result, Admission), result
                assert result.reason is RefusalReason.COOLING_DOWN

    h.run(body)


def test_a_dead_mark_past_its_cooldown_is_not_reported_dead(h: Harness) -> None:
    async def body() -> None:
        W = h.window
        async with h.backend() as b:
            a = await granted(b, ask())
            sent = b.now()
            await b.settle(settle(a, 0, Feedback.FAILURE, cooldown_s=W / 12, dead=True))
            s = await snap(b)
            if b.now() < sent + W / 12 - EPS:
                assert s.dead and s.cooldown_until is not None
            await trio.sleep_until(b.now() + W / 12 + EPS)
            s = await snap(b)
            assert not s.dead and s.cooldown_until is None

    h.run(body)


def test_a_cooldown_after_a_dead_mark_ran_out_is_an_ordinary_one(h: Harness) -> None:
    """(Each backend keeps the dead mark's own end: ``du`` in Redis, ``dead_until``.)"""
    async def body() -> None:
        W = h.window
        async with h.backend() as b:
            a, c = await granted(b, ask()), await granted(b, ask())
            await b.settle(settle(a, 0, Feedback.FAILURE, cooldown_s=W / 12, dead=True))
            await trio.sleep_until(b.now() + W / 12 + EPS)
            sent = b.now()
            await b.settle(settle(c, 0, Feedback.NEUTRAL, cooldown_s=W / 2))
            s = await snap(b)
            assert not s.dead
            result = await b.admit(ask())
            if b.now() < sent + W / 2 - EPS:
                assert not isinstance(result, Admission) and result.reason is RefusalReason.COOLING_DOWN

    h.run(body)


def test_a_live_dead_mark_survives_an_ordinary_cooldown(h: Harness) -> None:
    async def body() -> None:
        W = h.window
        async with h.backend() as b:
            a, c = await granted(b, ask()), await granted(b, ask())
            sent = b.now()
            await b.settle(settle(a, 0, Feedback.FAILURE, cooldown_s=W / 2, dead=True))
            await b.settle(settle(c, 0, Feedback.NEUTRAL, cooldown_s=W / 60))
            result = await b.admit(ask())
            if b.now() < sent + W / 2 - EPS:
                assert not isinstance(result, Admission) and result.reason is RefusalReason.DEAD
                assert (await snap(b)).dead

    h.run(body)


@pytest.mark.parametrize("dead_first", [True, False])
def test_a_longer_ordinary_cooldown_does_not_make_a_dead_mark_longer(h: Harness, dead_first: bool) -> None:
    """Review finding (docs, claim by claim): "a dead mark never outlives its
    cooldown", yet a 429 whose Retry-After outlasted a live dead mark (or a dead mark
    settled during a longer 429 cooldown) left the source dead until the longer end:
    calls failed at once for up to 600 s where they could have waited."""
    async def body() -> None:
        W = h.window
        async with h.backend() as b:
            a, c = await granted(b, ask()), await granted(b, ask())
            dead = settle(a, 0, Feedback.FAILURE, cooldown_s=W / 12, dead=True)
            ordinary = settle(c, 0, Feedback.NEUTRAL, cooldown_s=W / 2)
            start = b.now()
            for request in (dead, ordinary) if dead_first else (ordinary, dead):
                await b.settle(request)
            await trio.sleep_until(start + W / 12 + 4 * EPS)  # the dead mark is over
            s = await snap(b)
            result = await b.admit(ask())
            if b.now() < start + W / 2 - EPS:
                assert not s.dead and s.cooldown_until is not None, s
                assert not isinstance(result, Admission)
                assert result.reason is RefusalReason.COOLING_DOWN, result  # waitable

    h.run(body)


def _old_and_new(redis_server: Any, name: str) -> tuple[Harness, int, str, str]:
    """A harness on the real Redis, its port, a fresh key prefix, and source a's state
    key (which an older version's scripts are run on directly)."""
    prefix = f"{name}{secrets.token_hex(3)}"
    return Harness("redis", 1.2, redis_server.url), redis_server.port, prefix, f"{prefix}:chat:a:state"


def test_a_dead_mark_an_older_version_wrote_holds_until_its_cooldown(redis_server: Any) -> None:
    """Redis state written before ``du``: ``dd = 1`` is dead until ``cu``; a longer
    ordinary cooldown settled over it does not stretch it."""
    h, port, prefix, state = _old_and_new(redis_server, "old")

    async def body() -> None:
        W = h.window
        async with h.backend(prefix) as b:
            a, c = await granted(b, ask()), await granted(b, ask())
            start = b.now()
            await b.settle(settle(a, 0, Feedback.FAILURE, cooldown_s=W / 12, dead=True))
            # As an older polygate left it: the flag, no instant of its own.
            assert command(port, "HDEL", state, "du", "cw") == b":2"
            command(port, "HSET", state, "dd", "1")
            if b.now() < start + W / 12 - EPS:
                assert (await snap(b)).dead
            await b.settle(settle(c, 0, Feedback.NEUTRAL, cooldown_s=W / 2))
            await trio.sleep_until(start + W / 12 + 4 * EPS)
            s = await snap(b)
            result = await b.admit(ask())
            if b.now() < start + W / 2 - EPS:
                assert not s.dead and s.cooldown_until is not None, s
                assert not isinstance(result, Admission) and result.reason is RefusalReason.COOLING_DOWN

    h.run(body)


# The older version's settle of a cooldown (the version before du, SETTLE), for a dead status.
_OLD_DEAD_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local c = redis.call('HMGET', KEYS[1], 'cu', 'dd')
local cu = tonumber(c[1]) or 0
redis.call('HSET', KEYS[1], 'cu', math.max(cu, now + tonumber(ARGV[1])))
redis.call('HSET', KEYS[1], 'dd', '1')
return 1
"""

# The older version's admit (the version before du, ADMIT): refused 'dead' when cu > now and dd = 1.
_OLD_ADMIT_READS_DEAD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local s = redis.call('HMGET', KEYS[1], 'cu', 'dd')
if (tonumber(s[1]) or 0) > now and s[2] == '1' then return 1 end
return 0
"""


def test_an_older_versions_dead_mark_is_dead_after_a_new_ordinary_cooldown(redis_server: Any) -> None:
    """Review of the fix (a rolling upgrade on one Redis): once this version had
    written du, an older version's dead mark (dd = 1, dead until cu) read as an
    ordinary cooldown: calls waited on a source that rejects us."""
    h, port, prefix, state = _old_and_new(redis_server, "mixed")

    async def body() -> None:
        W = h.window
        async with h.backend(prefix) as b:
            a = await granted(b, ask())
            # A new process settles a short ordinary cooldown (a 429): du = 0 written.
            await b.settle(settle(a, 0, Feedback.NEUTRAL, cooldown_s=W / 60))
            await trio.sleep(W / 60 + 2 * EPS)
            # An older process marks the source dead for W/2 (a 401).
            sent = b.now()
            command(port, "EVAL", _OLD_DEAD_SETTLE, "1", state, str(int(W / 2 * 1e6)))
            s = await snap(b)
            result = await b.admit(ask())
            if b.now() < sent + W / 2 - EPS:
                assert s.dead, s
                assert not isinstance(result, Admission)
                assert result.reason is RefusalReason.DEAD, result

    h.run(body)


def test_an_older_process_does_not_read_a_new_ordinary_cooldown_as_dead(redis_server: Any) -> None:
    """The other way: an older process reads dd = 1 with cu > now as dead.  The new
    admit no longer clears a dd whose cooldown ran out (the old one did), and the new
    settle never writes dd: an older mark that ran out, then a 429 settled by a new
    process, reads as dead to every older process for the whole Retry-After."""
    h, port, prefix, state = _old_and_new(redis_server, "mixed")

    async def body() -> None:
        W = h.window
        async with h.backend(prefix) as b:
            command(port, "EVAL", _OLD_DEAD_SETTLE, "1", state, str(int(W / 60 * 1e6)))
            await trio.sleep(W / 60 + 2 * EPS)  # the older dead mark ran out
            a = await granted(b, ask())  # a new process admits
            start = b.now()
            await b.settle(settle(a, 0, Feedback.NEUTRAL, cooldown_s=W / 2))  # and settles a 429
            # What the older admit script reads: cu > now and dd == '1' -> 'dead'.
            old_reads_dead = command(port, "EVAL", _OLD_ADMIT_READS_DEAD, "1", state)
            if b.now() < start + W / 2 - EPS:
                assert old_reads_dead == b":0", "an older process refuses the 429 cooldown as dead"

    h.run(body)


# ------------------------------------------------------------------ tpm


def test_tpm_refusal_time_when_one_entry_frees_exactly_the_excess(h: Harness) -> None:
    async def body() -> None:
        W = h.window
        async with h.backend() as b:
            s1 = b.now()
            first = await granted(b, ask(40, tpm=100))
            r1 = b.now()
            await b.settle(settle(first, 40))
            await trio.sleep(W / 4)
            s2 = b.now()
            second = await granted(b, ask(60, tpm=100))
            await b.settle(settle(second, 60))
            sent = b.now()
            refusal = await refused(b, ask(40, tpm=100), RefusalReason.TPM)  # 40 missing
            recv = b.now()
            assert not refusal.sooner and refusal.retry_at is not None
            # the first entry's expiry, not the second's (which is at or after s2 + W)
            assert s1 + W - EPS <= refusal.retry_at <= r1 + W + (recv - sent) + EPS
            assert refusal.retry_at < s2 + W
            await trio.sleep_until(refusal.retry_at + EPS)
            await granted(b, ask(40, tpm=100))

    h.run(body)


def test_an_open_reservation_that_frees_exactly_the_excess_makes_the_time_sooner(h: Harness) -> None:
    async def body() -> None:
        async with h.backend() as b:
            closed = await granted(b, ask(50, tpm=100))
            await b.settle(settle(closed, 50))
            held = await granted(b, ask(50, tpm=100))
            refusal = await refused(b, ask(50, tpm=100), RefusalReason.TPM)
            assert refusal.sooner
            await b.settle(settle(held, 0))
            await granted(b, ask(50, tpm=100))

    h.run(body)


def test_an_open_reservation_one_short_of_the_excess_is_not_sooner(h: Harness) -> None:
    async def body() -> None:
        async with h.backend() as b:
            closed = await granted(b, ask(51, tpm=100))
            await b.settle(settle(closed, 51))
            await granted(b, ask(49, tpm=100))  # open: 49, one short of the 50 missing
            refusal = await refused(b, ask(50, tpm=100), RefusalReason.TPM)
            assert not refusal.sooner

    h.run(body)


def test_an_open_reservation_already_out_of_the_window_frees_nothing(h: Harness) -> None:
    async def body() -> None:
        W = h.window
        async with h.backend() as b:
            long_call = await granted(b, ask(50, tpm=100))
            await trio.sleep_until(b.now() + W + EPS)
            s_recent = b.now()
            recent = await granted(b, ask(60, tpm=100))
            await b.settle(settle(recent, 60))
            refusal = await refused(b, ask(50, tpm=100), RefusalReason.TPM)
            assert not refusal.sooner
            assert (await snap(b)).tokens_reserved == 50
            await b.settle(settle(long_call, 0))
            result = await b.admit(ask(50, tpm=100))
            if b.now() < s_recent + W - EPS:
                assert not isinstance(result, Admission), result  # nothing freed

    h.run(body)


# ------------------------------------------------------------------ breaker


def rate_policy(h: Harness) -> BreakerPolicy:
    return BreakerPolicy(failures=3, open_s=h.window / 12, failure_rate=0.5, rate_window=4,
                         rate_min_calls=4, max_open_s=1e6)


async def _outcome(b: GovernanceBackend, feedback: Feedback, policy: BreakerPolicy) -> None:
    a = await granted(b, ask(breaker=policy))
    await b.settle(settle(a, 1, feedback, breaker=policy))


async def _open_then_probe(b: GovernanceBackend, policy: BreakerPolicy) -> Admission:
    refusal = await refused(b, ask(breaker=policy), RefusalReason.BREAKER_OPEN)
    assert refusal.retry_at is not None
    await trio.sleep_until(refusal.retry_at + EPS)
    probe = await granted(b, ask(breaker=policy))
    assert probe.probe
    return probe


def test_the_rate_rule_trips_above_the_share_not_at_it(h: Harness) -> None:
    async def body() -> None:
        policy = rate_policy(h)
        async with h.backend() as b:
            for fb in (Feedback.SUCCESS, Feedback.FAILURE, Feedback.SUCCESS, Feedback.FAILURE):
                await _outcome(b, fb, policy)
            assert (await snap(b)).breaker is BreakerState.CLOSED  # 2 of 4: 50 %
            await _outcome(b, Feedback.FAILURE, policy)  # F S F F: 75 %
            assert (await snap(b)).breaker is BreakerState.OPEN

    h.run(body)


def test_closing_clears_the_failure_history(h: Harness) -> None:
    async def body() -> None:
        policy = rate_policy(h)
        async with h.backend() as b:
            for _ in range(3):
                await _outcome(b, Feedback.FAILURE, policy)
            probe = await _open_then_probe(b, policy)
            await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
            assert (await snap(b)).breaker is BreakerState.CLOSED
            await _outcome(b, Feedback.FAILURE, policy)
            s = await snap(b)
            assert s.breaker is BreakerState.CLOSED and s.consecutive_failures == 1

    h.run(body)


def test_a_snapshot_says_when_an_open_breakers_period_ends(h: Harness) -> None:
    """(For the fallback check: OPEN stays in a snapshot until an admission check
    moves it to half-open, however long ago its period ended.)"""
    async def body() -> None:
        W = h.window
        policy = BreakerPolicy(failures=1, open_s=W / 12, rate_min_calls=100)
        async with h.backend() as b:
            assert (await snap(b)).breaker_open_until is None
            sent = b.now()
            await _outcome(b, Feedback.FAILURE, policy)
            received = b.now()
            s = await snap(b)
            assert s.breaker is BreakerState.OPEN and s.breaker_open_until is not None
            assert sent + W / 12 - EPS <= s.breaker_open_until <= received + W / 12 + EPS
            await trio.sleep_until(s.breaker_open_until + 4 * EPS)
            late = await snap(b)  # still OPEN: no admission check since
            assert late.breaker is BreakerState.OPEN and late.breaker_open_until == pytest.approx(
                s.breaker_open_until, abs=EPS)
            probe = await granted(b, ask(breaker=policy))
            assert probe.probe and (await snap(b)).breaker_open_until is None

    h.run(body)


def test_a_stale_failure_while_half_open_does_not_reopen(h: Harness) -> None:
    async def body() -> None:
        policy = BreakerPolicy(failures=1, open_s=h.window / 12, rate_min_calls=100)
        async with h.backend() as b:
            stale = await granted(b, ask(breaker=policy))
            await _outcome(b, Feedback.FAILURE, policy)
            probe = await _open_then_probe(b, policy)
            await b.settle(settle(stale, None, Feedback.FAILURE, breaker=policy))
            assert (await snap(b)).breaker is BreakerState.HALF_OPEN
            await refused(b, ask(breaker=policy), RefusalReason.BREAKER_OPEN)  # probe still out
            await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
            assert (await snap(b)).breaker is BreakerState.CLOSED

    h.run(body)


def test_a_stale_success_while_half_open_does_not_close(h: Harness) -> None:
    async def body() -> None:
        policy = BreakerPolicy(failures=1, open_s=h.window / 12, rate_min_calls=100)
        async with h.backend() as b:
            stale = await granted(b, ask(breaker=policy))
            await _outcome(b, Feedback.FAILURE, policy)
            probe = await _open_then_probe(b, policy)
            await b.settle(settle(stale, 1, Feedback.SUCCESS, breaker=policy))
            assert (await snap(b)).breaker is BreakerState.HALF_OPEN
            await b.settle(settle(probe, 1, Feedback.NEUTRAL, breaker=policy))  # probe back, no verdict
            assert (await snap(b)).breaker is BreakerState.HALF_OPEN
            again = await granted(b, ask(breaker=policy))
            assert again.probe

    h.run(body)


def test_probes_must_succeed_in_a_row_across_a_reopening(h: Harness) -> None:
    async def body() -> None:
        policy = BreakerPolicy(failures=1, open_s=h.window / 12, rate_min_calls=100, probes=2)
        async with h.backend() as b:
            await _outcome(b, Feedback.FAILURE, policy)
            probe = await _open_then_probe(b, policy)
            await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
            probe = await granted(b, ask(breaker=policy))
            assert probe.probe
            await b.settle(settle(probe, None, Feedback.FAILURE, breaker=policy))
            assert (await snap(b)).breaker is BreakerState.OPEN
            probe = await _open_then_probe(b, policy)
            await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
            assert (await snap(b)).breaker is BreakerState.HALF_OPEN
            probe = await granted(b, ask(breaker=policy))
            await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
            assert (await snap(b)).breaker is BreakerState.CLOSED

    h.run(body)


def test_a_failed_probe_doubles_the_open_period(h: Harness) -> None:
    """Re-opening after a failed probe: open_s * 2 (jitter 1.0), on both."""
    async def body() -> None:
        W = h.window
        policy = BreakerPolicy(failures=1, open_s=W / 12, rate_min_calls=100, max_open_s=W)
        async with h.backend() as b:
            await _outcome(b, Feedback.FAILURE, policy)
            probe = await _open_then_probe(b, policy)
            sent = b.now()
            await b.settle(SettleRequest(probe, None, Feedback.FAILURE, policy, jitter=1.0))
            recv = b.now()
            s_ref = b.now()
            refusal = await refused(b, ask(breaker=policy), RefusalReason.BREAKER_OPEN)
            r_ref = b.now()
            assert refusal.retry_at is not None
            assert sent + W / 6 - EPS <= refusal.retry_at <= recv + W / 6 + (r_ref - s_ref) + EPS

    h.run(body)


def test_a_lowered_rate_window_counts_only_the_last_rate_window_outcomes(h: Harness) -> None:
    """A reload that lowers ``rate_window`` keeps its backend (serve.md: governance
    state survives a reload).  admission.md: the rule counts 'the last rate_window
    outcomes'.  Redis truncates its history to the new rate_window at the next outcome;
    the memory backend pops one outcome per append, so its history stays at the old
    length for good and the new rule is computed over the old window."""
    async def body() -> None:
        wide = BreakerPolicy(failures=100, open_s=h.window / 12, failure_rate=0.5,
                             rate_window=10, rate_min_calls=10)
        narrow = BreakerPolicy(failures=100, open_s=h.window / 12, failure_rate=0.5,
                               rate_window=4, rate_min_calls=4)
        async with h.backend() as b:
            for _ in range(10):
                await _outcome(b, Feedback.SUCCESS, wide)
            for _ in range(3):  # the last 4 outcomes: S F F F, 75 % > 50 %
                await _outcome(b, Feedback.FAILURE, narrow)
            assert (await snap(b)).breaker is BreakerState.OPEN

    h.run(body)


# ------------------------------------------------------------------ budget


def test_budget_take_below_a_whole_token_and_a_lowered_burst(h: Harness) -> None:
    async def body() -> None:
        async with h.backend() as b:
            assert await b.budget_take("chat", 1.5)  # 0.5 left
            assert not await b.budget_take("chat", 1.5)
            await b.budget_refill("chat", 0.5, 1.5)
            assert await b.budget_level("chat", 1.5) == 1.0
            await b.budget_refill("chat", 5.0, 3.0)  # a raised burst
            assert await b.budget_level("chat", 3.0) == 3.0
            await b.budget_refill("chat", 0.25, 2.0)  # a lowered one: capped first
            assert await b.budget_level("chat", 2.0) == 2.0

    h.run(body)


# ------------------------------------------------------------------ governor, on Redis

import polygate  # noqa: E402
from polygate.testing import FakeUpstream, Reply, Router  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


def _settings(url: str | None, **scope: Any) -> polygate.Settings:
    kw: dict[str, Any] = {}
    if url is not None:
        kw["backend"] = f"{url}?prefix=edges-{secrets.token_hex(4)}"
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], **scope)}, **kw)


@pytest.fixture(params=["memory", "redis"])
def url(request: pytest.FixtureRequest) -> str | None:
    if request.param == "memory":
        return None
    return str(request.getfixturevalue("redis_server").url)


@pytest.mark.parametrize(("retry_after", "cooled"), [(None, 1.0), (0, 0.1)])
def test_a_429_cools_the_source(url: str | None, retry_after: float | None, cooled: float) -> None:
    async def body() -> None:
        a = FakeUpstream([Reply(status=429, retry_after_s=retry_after), Reply()])
        async with polygate.session(_settings(url), transport=Router({"a": a})) as s:
            response = await s.chat(MESSAGES)
        assert response.source == "a"
        gap = a.requests[1].started_at - a.requests[0].started_at
        assert cooled - EPS <= gap
        if url is None:
            assert gap == pytest.approx(cooled)
        else:
            assert gap < cooled + 0.5  # scheduling slack; 0.1 vs 1.0 stay apart

    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0) if url is None else None)


def test_a_successful_probe_resets_the_failure_health(url: str | None) -> None:
    async def body() -> None:
        a = FakeUpstream([Reply(status=503), Reply()])
        settings = _settings(url, breaker=polygate.Breaker(failures=1, open_s=0.3),
                             retry=polygate.Retry(max_attempts=1))
        async with polygate.session(settings, transport=Router({"a": a})) as s:
            with pytest.raises(polygate.AllSourcesExhausted):
                await s.chat(MESSAGES)
            await trio.sleep(0.3 + EPS)
            await s.chat(MESSAGES)  # the probe
            stats = await s.statistics()
        record = next(r for r in stats.governance.sources if r.state.source == "a")
        assert record.state.breaker is BreakerState.CLOSED
        assert record.health.failure_ewma == 0

    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0) if url is None else None)



def test_a_reload_that_lowers_rate_window_trips_on_the_new_window(url: str | None) -> None:
    """What serve does on a reload: a new session on the same governance state, with
    the new breaker settings.  Ten successes under rate_window=10, then rate_window=4
    (rate_min_calls=4, failure_rate=0.5): three failures make the last 4 outcomes
    S F F F (75 %), so the source must be open (it is on Redis)."""
    from polygate._session import session_on
    from polygate.governance import MemoryBackend

    prefix = f"reload-{secrets.token_hex(4)}"

    def settings(window: int) -> polygate.Settings:
        kw: dict[str, Any] = {} if url is None else {"backend": f"{url}?prefix={prefix}"}
        return polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1")],
            breaker=polygate.Breaker(failures=100, failure_rate=0.5, rate_window=window,
                                     rate_min_calls=window),
            retry=polygate.Retry(max_attempts=1))}, **kw)

    async def body() -> None:
        memory = MemoryBackend()

        def opened(s: polygate.Settings) -> Any:
            if url is None:  # serve keeps one memory backend across reloads
                return session_on(s, memory, transport=Router({"a": up}))
            return polygate.session(s, transport=Router({"a": up}))

        up = FakeUpstream([Reply()] * 10 + [Reply(status=503)] * 3)
        async with opened(settings(10)) as s:
            for _ in range(10):
                await s.chat(MESSAGES)
        async with opened(settings(4)) as s:
            for _ in range(3):
                with pytest.raises(polygate.AllSourcesExhausted):
                    await s.chat(MESSAGES)
            stats = await s.statistics()
        state = next(r.state for r in stats.governance.sources if r.state.source == "a")
        assert state.breaker is BreakerState.OPEN, state

    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0) if url is None else None)
