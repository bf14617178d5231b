"""Behaviours of the Redis governance backend that no other test pinned
(polygate/governance/_redis.py and its scripts).

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through.  A real redis-server on
loopback, the real clock, short leases."""

from __future__ import annotations

import secrets
from typing import Any

import attrs
import pytest
import trio

from polygate.governance import Admission, BreakerState, Feedback, RefusalReason
from tests import _redis_server
from tests._redis_server import RedisServer
from tests.test_backend_contract import POLICY, ask, granted, refused, settle, snap
from tests.test_redis_multiprocess import _redis, _started

redis_server = _redis_server.redis_server  # fixtures
own_redis = _redis_server.own_redis


def test_a_crashed_probe_holders_lease_frees_the_half_open_slot(redis_server: RedisServer) -> None:
    """A half-open breaker admits one probe.  If the process holding it dies, its
    lease runs out and purge returns the permit; it must also clear the probe slot,
    or the source stays half-open with a probe nobody will ever settle, refusing every
    call (BREAKER_OPEN, retry_at None) in every process for as long as the key lives."""
    prefix = f"pin-probe-{secrets.token_hex(4)}"
    policy = attrs.evolve(POLICY, failures=1, open_s=0.2)

    async def body() -> None:
        crashed = _redis(redis_server.url, prefix, lease_s=0.4)
        async with _started(crashed):
            a = await granted(crashed, ask(breaker=policy))
            await crashed.settle(settle(a, None, Feedback.FAILURE, breaker=policy))
            assert (await snap(crashed)).breaker is BreakerState.OPEN
            await trio.sleep(0.3)
            probe = await granted(crashed, ask(breaker=policy))
            assert probe.probe
            crashed._open.clear()  # the process dies: no renewal, no settle
        async with _started(_redis(redis_server.url, prefix)) as other:
            refusal = await refused(other, ask(breaker=policy), RefusalReason.BREAKER_OPEN)
            assert refusal.retry_at is None  # until the probe settles (or its lease ends)
            with trio.fail_after(5):
                while not isinstance(result := await other.admit(ask(breaker=policy)), Admission):
                    await other.wait_changed(other.now() + 30.0)
            assert result.probe  # a new probe, once the dead one's lease ran out
            await other.settle(settle(result, 1, breaker=policy))
            assert (await snap(other)).breaker is BreakerState.CLOSED

    trio.run(body)


async def test_a_refill_after_redis_recovered_from_an_error_is_applied(own_redis: RedisServer) -> None:
    """The hedge-budget refill is skipped only *while* the last exchange failed: once
    Redis answers again, refills count again (else one OOM blip would starve hedging
    for the rest of the session)."""
    from polygate import GovernanceBackendError

    async with _started(_redis(own_redis.url, f"pin-refill-{secrets.token_hex(4)}", timeout_s=0.5)) as b:
        assert await b.budget_take("chat", 2.0)
        assert await b.budget_level("chat", 2.0) == pytest.approx(1.0)
        _redis_server.command(own_redis.port, "CONFIG", "SET", "maxmemory", "1")
        try:
            with pytest.raises(GovernanceBackendError):
                for _ in range(3):  # (Redis may let the first command after CONFIG SET through)
                    result = await b.admit(ask())
                    assert isinstance(result, Admission)
                    await b.settle(settle(result, 1))
        finally:
            _redis_server.command(own_redis.port, "CONFIG", "SET", "maxmemory", "0")
        assert await b.budget_level("chat", 2.0) == pytest.approx(1.0)  # Redis answers again
        await b.budget_refill("chat", 1.0, 2.0)
        assert await b.budget_level("chat", 2.0) == pytest.approx(2.0)
        assert b.statistics().refill_failures == 0


async def test_an_admission_resent_after_a_lost_reply_is_the_same_admission(redis_server: RedisServer) -> None:
    """ADMIT is retried once on a dead connection (it may have run): the same member
    run twice must be one admission, one permit, one window entry -- not two."""
    from polygate.governance._redis import _ADMIT

    async with _started(_redis(redis_server.url, f"pin-idem-{secrets.token_hex(4)}")) as b:
        a = await granted(b, ask(10, rpm=5, tpm=100, mif=3))
        member = f"{b._token}:{a.reservation_id}"
        args = [member, 10, 5, 100, 3, 30_000_000, b._lease_us, b._window_us, b._ttl_ms]
        reply = await b._script(_ADMIT, b._source_keys(("chat", "a")), args, "admit")
        assert reply[0] == 1
        s = await snap(b)
        assert (s.in_flight, s.requests_in_window, s.tokens_in_window, s.admissions) == (1, 1, 10, 1)
        await b.settle(settle(a, 4))
        s = await snap(b)
        assert (s.in_flight, s.tokens_in_window, s.reserved_total, s.cost_total) == (0, 4, 10, 4)


async def test_a_refill_while_redis_hangs_adds_no_wait(own_redis: RedisServer) -> None:
    """The refill runs in every hedged call's ``finally``: while the last exchange
    failed it is skipped (counted), so a hung Redis does not add timeout_s to each call."""
    import signal

    from polygate import GovernanceBackendError

    async with _started(_redis(own_redis.url, f"pin-hang-{secrets.token_hex(4)}", timeout_s=0.5)) as b:
        assert own_redis.proc is not None
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(GovernanceBackendError):
                await b.budget_level("chat", 2.0)
            started = trio.current_time()
            await b.budget_refill("chat", 1.0, 2.0)
            assert trio.current_time() - started < 0.1
            assert b.statistics().refill_failures == 1
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)


def test_calls_settled_by_the_close_feed_nothing_to_the_breaker(redis_server: RedisServer) -> None:
    """settle_left settles the calls still running as a cancelled attempt's: the
    estimate kept, the permit returned, *nothing fed to the breaker*.  A close must not
    count them as failures (three open calls and failures=3 would open the breaker for
    every process sharing the source)."""
    prefix = f"pin-close-{secrets.token_hex(4)}"

    async def body() -> None:
        async with _started(_redis(redis_server.url, prefix)) as b:
            for _ in range(3):
                await granted(b, ask(10, breaker=POLICY))
        async with _started(_redis(redis_server.url, prefix)) as other:
            s = await snap(other)
            assert (s.in_flight, s.settled_total, s.cost_total) == (0, 30, 30)
            assert (s.breaker, s.consecutive_failures) == (BreakerState.CLOSED, 0)

    trio.run(body)


def test_a_snapshot_alone_returns_an_expired_lease(redis_server: RedisServer) -> None:
    """'Any script touching that source then returns the permit': a snapshot (the
    /metrics and status view) after a crashed holder's lease ran out shows the permit
    returned and the reservation settled, not a phantom call in flight."""
    prefix = f"pin-snap-{secrets.token_hex(4)}"

    async def body() -> None:
        crashed = _redis(redis_server.url, prefix, lease_s=0.4)
        async with _started(crashed):
            await granted(crashed, ask(30, mif=1))
            crashed._open.clear()  # the process dies
        await trio.sleep(0.8)
        async with _started(_redis(redis_server.url, prefix)) as other:
            s = await snap(other)
            assert (s.in_flight, s.tokens_reserved, s.settled_total, s.cost_total) == (0, 0, 30, 30)

    trio.run(body)


async def test_a_lease_lost_while_redis_hung_is_counted_and_dropped(own_redis: RedisServer) -> None:
    """'A process that cannot reach Redis for longer than lease_s loses its leases
    (counted as leases_lost)': RENEW reports the members whose lease had run out, so
    the holder stops renewing them and counts them."""
    import signal

    b = _redis(own_redis.url, f"pin-lost-{secrets.token_hex(4)}", lease_s=0.45, timeout_s=0.1)
    async with _started(b):
        a = await granted(b, ask(10, mif=1))
        assert own_redis.proc is not None
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            await trio.sleep(0.9)  # two lease lengths without an answer
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        await trio.sleep(0.5)  # a few renewal rounds on the answering Redis
        stats = b.statistics()
        assert (stats.leases_lost, stats.open_leases) == (1, 0), stats
        await b.settle(settle(a, 4))  # a no-op now: the purge settled it with its estimate
        s = await snap(b)
        assert (s.in_flight, s.cost_total) == (0, 10)


def test_an_abandoned_admission_never_found_is_given_up_after_its_lease(own_redis: RedisServer) -> None:
    """The void loop voids 'again while a void finds nothing ... until the lease would
    have expired it anyway': an admission Redis lost (killed and restarted empty) is
    dropped a lease after Redis first answered, and an idle process then sends nothing."""
    import polygate
    from polygate.testing import FakeUpstream, Reply
    from tests.test_redis_void import abandon_many, evalsha_calls, reconnect, settings_for

    async def body() -> None:
        settings = settings_for(own_redis, lease_s=0.6)
        async with polygate.session(settings, transport=FakeUpstream(Reply(tokens=2)).transport()) as s:
            backend: Any = s._runtime.governor.backend
            await abandon_many(s, own_redis, 3)
            await reconnect(s)
            await trio.sleep(0.6 + 2.5)  # the lease, plus the loop's 1 s timer, twice
            assert not backend._abandoned
            before = evalsha_calls(own_redis.port)
            await trio.sleep(1.5)
            assert evalsha_calls(own_redis.port) == before  # idle: no void rounds left
            assert backend.statistics().abandoned_voided == 0

    trio.run(body)


@pytest.mark.parametrize("dead", [True, False], ids=["401 dead", "429 cooldown"])
async def test_a_verdict_settled_after_its_lease_lapsed_still_reaches_the_others(
    own_redis: RedisServer, dead: bool,
) -> None:
    """Review finding (replicas on one Redis): a holder paused (or cut off from Redis)
    past its lease, whose call then came back 401 or 429, settled after the purge had
    settled its reservation; the settle found nothing open and returned, dropping the
    dead mark or the Retry-After cooldown, so every other replica went on sending to
    a source known to refuse.  The marks are maxima: applied however late, or twice,
    they say the same."""
    import signal

    prefix = f"pin-verdict-{secrets.token_hex(4)}"
    b = _redis(own_redis.url, prefix, lease_s=0.45, timeout_s=0.1)
    async with _started(b):
        a = await granted(b, ask(10, mif=1))
        assert own_redis.proc is not None
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            await trio.sleep(0.9)  # the lease runs out while Redis is unreachable
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        await trio.sleep(0.5)
        assert b.statistics().leases_lost == 1
        late = settle(a, 0, Feedback.FAILURE if dead else Feedback.NEUTRAL, cooldown_s=30.0, dead=dead)
        await b.settle(late)
        await b.settle(late)  # (a retried settle: its failure counted once)
    async with _started(_redis(own_redis.url, prefix)) as other:
        s = await snap(other)
        assert s.dead is dead and s.cooldown_until is not None, s
        assert (s.consecutive_failures, s.cost_total, s.in_flight) == (int(dead), 10, 0), s
        await refused(other, ask(10), RefusalReason.DEAD if dead else RefusalReason.COOLING_DOWN)


_QUICK = attrs.evolve(POLICY, failures=1, open_s=0.2, max_open_s=0.2)


async def _lapsed(b: Any) -> None:
    """The holder pauses (no renewal) until a purge has settled its leases."""
    b._open.clear()
    with trio.fail_after(5):
        while (await snap(b)).in_flight:  # noqa: ASYNC110 - a purge's doing: no event
            await trio.sleep(0.05)


async def _half_open(b: Any) -> None:
    a = await granted(b, ask(breaker=_QUICK))
    await b.settle(settle(a, None, Feedback.FAILURE, breaker=_QUICK))
    assert (await snap(b)).breaker is BreakerState.OPEN
    await trio.sleep(0.3)  # (the open period, 0.2 s, is over)


@pytest.mark.parametrize("late", [False, True], ids=["on time", "after its lease lapsed"])
def test_a_failed_probe_reopens_the_breaker_however_late_it_settles(
    redis_server: RedisServer, late: bool,
) -> None:
    """Review finding (of the lapsed verdicts): a half-open breaker's probe whose
    holder paused past its lease, and whose call then failed, only counted a failure:
    the breaker stayed half-open and admitted the next call as a new probe to a source
    known to fail.  A probe's verdict is a probe's, on time or late."""
    prefix = f"pin-late-probe-{secrets.token_hex(4)}"

    async def body() -> None:
        b = _redis(redis_server.url, prefix, lease_s=0.4)
        async with _started(b):
            await _half_open(b)
            probe = await granted(b, ask(breaker=_QUICK))
            assert probe.probe
            if late:
                await _lapsed(b)
            await b.settle(settle(probe, None, Feedback.FAILURE, breaker=_QUICK))  # a 5xx
            assert (await snap(b)).breaker is BreakerState.OPEN
            await refused(b, ask(breaker=_QUICK), RefusalReason.BREAKER_OPEN)

    trio.run(body)


def test_a_lapsed_probes_late_verdict_belongs_to_its_own_half_open_period(
    redis_server: RedisServer,
) -> None:
    """Review finding (of the late probe's verdict): probe A of one half-open period
    lapsed; the period closed on another probe; the source failed again, and in the
    new half-open period, with no probe out, A's late success closed the breaker:
    full traffic back to a source nothing had found well."""

    async def body() -> None:
        b = _redis(redis_server.url, f"pin-period-{secrets.token_hex(4)}", lease_s=0.4)
        async with _started(b):
            await _half_open(b)
            a = await granted(b, ask(breaker=_QUICK))
            assert a.probe
            await _lapsed(b)
            closer = await granted(b, ask(breaker=_QUICK))
            await b.settle(settle(closer, None, Feedback.SUCCESS, breaker=_QUICK))
            assert (await snap(b)).breaker is BreakerState.CLOSED
            await _half_open(b)  # the next period
            c = await granted(b, ask(breaker=_QUICK))
            await b.settle(settle(c, None, Feedback.NEUTRAL, breaker=_QUICK))
            await b.settle(settle(a, None, Feedback.SUCCESS, breaker=_QUICK))  # A, late
            assert (await snap(b)).breaker is BreakerState.HALF_OPEN

    trio.run(body)


def test_each_lapsed_probe_of_a_period_keeps_its_verdict(redis_server: RedisServer) -> None:
    """Review finding: probe A lapsed, the next probe B lapsed too, and A's late
    failure counted as no probe's: the breaker stayed half-open."""

    async def body() -> None:
        b = _redis(redis_server.url, f"pin-two-{secrets.token_hex(4)}", lease_s=0.4)
        async with _started(b):
            await _half_open(b)
            a = await granted(b, ask(breaker=_QUICK))
            await _lapsed(b)
            second = await granted(b, ask(breaker=_QUICK))
            assert a.probe and second.probe
            await _lapsed(b)
            await b.settle(settle(a, None, Feedback.FAILURE, breaker=_QUICK))  # A, late: a 5xx
            assert (await snap(b)).breaker is BreakerState.OPEN

    trio.run(body)


def test_a_lapsed_probes_verdict_survives_a_clock_step_back(redis_server: RedisServer) -> None:
    """Review finding (of the late probe's verdict, third round): the period a lapsed
    probe belongs to was told by the breaker's opening instant, which the scripts move
    back when the server's clock steps back; after such a step the probe's late
    failure was no probe's, and the next call went through as a new probe."""
    import coredis

    from tests.test_redis_skewed_clocks import STEP_S, _as_if_ahead

    prefix = f"pin-step-{secrets.token_hex(4)}"

    async def body() -> None:
        b = _redis(redis_server.url, prefix, lease_s=0.4)
        async with _started(b):
            await _half_open(b)
            a = await granted(b, ask(breaker=_QUICK))
            assert a.probe
            await _lapsed(b)
            # Everything stored so far as if written by a clock STEP_S ahead, which
            # then stepped back: every instant, and any record made of one.
            async with coredis.Redis.from_url(redis_server.url, decode_responses=True) as client:
                key = f"{prefix}:chat:a:state"
                before = await client.hgetall(key)
                await _as_if_ahead(redis_server.url, prefix, ("a",))
                lp, oa = before.get("lp", ""), before.get("oa", "")
                if oa and lp.startswith(f"{oa}|"):
                    ahead = str(int(float(oa)) + int(STEP_S * 1e6))
                    await client.hset(key, {"lp": ahead + lp[len(oa):]})
            await b.settle(settle(a, None, Feedback.FAILURE, breaker=_QUICK))  # A, late: a 5xx
            assert (await snap(b)).breaker is BreakerState.OPEN

    trio.run(body)


async def test_the_breaker_a_failure_opened_on_redis_skips_the_backoff(redis_server: RedisServer) -> None:
    """The retry loop reads the breaker's open period from the backend's snapshot, in
    trio's time: on Redis too, the 500 that opened the only source's breaker moves the
    call to its fallback without the backoff (here 1 s: every draw halfway), while a
    Redis that answers slowly or not at all is not what this tests."""
    import random

    import polygate
    from polygate.testing import FakeUpstream, Reply, Router

    class Halfway(random.Random):
        def random(self) -> float:
            return 0.5

    settings = polygate.Settings(
        scopes={
            "chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://a/v1")],
                retry=polygate.Retry(max_attempts=3, backoff_base_s=2.0, backoff_max_s=8.0),
                breaker=polygate.Breaker(failures=1, open_s=30.0), fallback="backup"),
            "backup": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1")]),
        },
        backend=f"{redis_server.url}?prefix=pin-open-{secrets.token_hex(4)}",
    )
    a, b = FakeUpstream(Reply(status=500)), FakeUpstream(Reply(text="from backup"))
    async with polygate.session(settings, transport=Router({"a": a, "b": b}), rng=Halfway()) as s:
        start = trio.current_time()
        r = await s.chat([{"role": "user", "content": "hi"}])
        elapsed = trio.current_time() - start
    assert (r.text, r.call_stats.scope, len(a.requests)) == ("from backup", "backup", 1)
    assert elapsed < 0.5, elapsed  # the backoff alone is 1 s
