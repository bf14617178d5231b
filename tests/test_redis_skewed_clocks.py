"""The Redis backend keeps time by the server's ``TIME``, so clients whose clocks
disagree still share one RPM window, one cooldown and one breaker.

Two clients of one real ``redis-server``, one after the other, each in its own
``trio.run``: the first runs with every local clock it could read — trio's clock and
the wall clock (``time.time``, ``time.time_ns``) — skewed by ``SKEW_S``, the second
with the true ones.  The first fills a one-request RPM window, puts a source in a 30 s
cooldown and opens another's breaker; the second must then be refused by all three,
with retry times that count from the server's instants (converted to its own clock),
not from the first client's.  Were the scripts to take "now" from the client, a
client ``SKEW_S`` behind would leave entries that a true client sees as long expired
(and would be admitted), and one ``SKEW_S`` ahead would leave retry times ``SKEW_S``
too late.  Both directions run.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import attrs
import pytest
import trio

from polygate.governance import Admission, Feedback, RefusalReason

from . import _redis_server
from ._redis_server import RedisServer
from .test_backend_contract import POLICY, ask, granted, refused, settle

pytestmark = pytest.mark.integration
redis_server = _redis_server.redis_server  # the fixture

T = TypeVar("T")
SKEW_S = 120.0  # two windows: a skewed "now" would expire or keep every entry
COOLDOWN_S = 30.0
BREAKER = attrs.evolve(POLICY, failures=2, open_s=30.0)


class SkewedClock(trio.abc.Clock):
    """trio's clock, ``offset`` seconds off (trio's own clock has a random offset too;
    a fixed one makes the skew exact)."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def start_clock(self) -> None:
        return None

    def current_time(self) -> float:
        return time.perf_counter() + self.offset

    def deadline_to_sleep_time(self, deadline: float) -> float:
        return deadline - self.current_time()


def _run_with_clocks(
    monkeypatch: pytest.MonkeyPatch, skew: float, fn: Callable[..., Awaitable[T]], *args: Any
) -> T:
    """Run ``fn`` in its own trio run, with trio's clock and the wall clock skewed."""
    wall, wall_ns = time.time, time.time_ns
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: wall() + skew)
        patch.setattr(time, "time_ns", lambda: wall_ns() + int(skew * 1e9))
        return trio.run(fn, *args, clock=SkewedClock(1_000.0 + skew))


def _backend(url: str, prefix: str) -> Any:
    from polygate.governance._redis import RedisBackend, parse_redis_url

    return RedisBackend(parse_redis_url(f"{url}?prefix={prefix}"))


@contextlib.asynccontextmanager
async def _started(url: str, prefix: str) -> AsyncIterator[Any]:
    backend = _backend(url, prefix)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.aclose()


async def _use(backend: Any) -> None:
    """One RPM slot of source "a" used, "c" cooling down, "b"'s breaker open."""
    a = await granted(backend, ask(source="a", rpm=1))
    await backend.settle(settle(a, 5))  # sent: the window keeps its entry
    c = await granted(backend, ask(source="c"))
    await backend.settle(settle(c, 0, Feedback.NEUTRAL, cooldown_s=COOLDOWN_S))
    for _ in range(BREAKER.failures):
        b = await granted(backend, ask(source="b", breaker=BREAKER))
        await backend.settle(settle(b, None, Feedback.FAILURE, breaker=BREAKER))


async def _fill(url: str, prefix: str) -> None:
    """The skewed client: one RPM slot used, a cooldown, an open breaker."""
    async with _started(url, prefix) as backend:
        await _use(backend)


async def _check(url: str, prefix: str) -> dict[str, Any]:
    """The true client: refused by all three, retry times from the server's instants."""
    async with _started(url, prefix) as backend:
        now = backend.now()
        rpm = await refused(backend, ask(source="a", rpm=1), RefusalReason.RPM)
        cooling = await refused(backend, ask(source="c"), RefusalReason.COOLING_DOWN)
        opened = await refused(backend, ask(source="b", breaker=BREAKER), RefusalReason.BREAKER_OPEN)
        snapshot = await backend.snapshot("chat", "c")
        fresh = await backend.admit(ask(source="d", rpm=1))  # an untouched source: admitted
        assert isinstance(fresh, Admission)
        await backend.settle(settle(fresh, 1))
        return {
            "rpm": rpm.retry_at - now if rpm.retry_at is not None else None,
            "cooldown": cooling.retry_at - now if cooling.retry_at is not None else None,
            "breaker": opened.retry_at - now if opened.retry_at is not None else None,
            "snapshot_cooldown": snapshot.cooldown_until - now if snapshot.cooldown_until else None,
        }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("skew", [-SKEW_S, SKEW_S], ids=["behind", "ahead"])
def test_skewed_clients_share_windows_cooldowns_and_breakers(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    prefix = f"skew-{secrets.token_hex(4)}"
    _run_with_clocks(monkeypatch, skew, _fill, redis_server.url, prefix)
    waits = _run_with_clocks(monkeypatch, 0.0, _check, redis_server.url, prefix)
    # Measured from the true client's clock: a window, a cooldown and an open time
    # that began moments ago on the server — whatever the first client's clocks said.
    margin = 5.0  # the real time the two runs took, generously
    assert 60.0 - margin < waits["rpm"] <= 60.0 + 0.01, waits
    assert COOLDOWN_S - margin < waits["cooldown"] <= COOLDOWN_S + 0.01, waits
    assert COOLDOWN_S - margin < waits["snapshot_cooldown"] <= COOLDOWN_S + 0.01, waits
    assert BREAKER.open_s - margin < waits["breaker"] <= BREAKER.open_s + 0.01, waits


# ------------------------------------------------------------------ the server's clock

STEP_S = 3600.0


async def _as_if_ahead(url: str, prefix: str, sources: tuple[str, ...]) -> None:
    """The state as scripts write it on a server whose clock reads ``STEP_S`` ahead,
    which then steps back to the true time: every stored instant, and the last TIME a
    script saw, ``STEP_S`` later than the same state written at the true time."""
    import coredis

    step_us = int(STEP_S * 1e6)
    async with coredis.Redis.from_url(url, decode_responses=True) as client:
        for source in sources:
            base = f"{prefix}:chat:{source}"
            for key in (f"{base}:window", f"{base}:permits"):
                for member, score in await client.zrange(key, 0, -1, withscores=True):
                    await client.zadd(key, {member: score + step_us})
            state = await client.hgetall(f"{base}:state")
            for field in ("cu", "du", "oa", "cw", "lt"):
                if float(state.get(field, 0)) > 0:
                    await client.hset(f"{base}:state", {field: str(int(float(state[field])) + step_us)})


async def _server_now(url: str) -> float:
    import coredis

    async with coredis.Redis.from_url(url) as client:
        return (await client.time()).timestamp()  # (coredis gives a datetime)


@pytest.mark.timeout(60)
def test_a_server_clock_stepped_back_keeps_what_was_left_of_each_instant(
    redis_server: RedisServer,
) -> None:
    """Outside review (clocks): the scripts trusted every stored instant against the
    server's TIME, so after the Redis host's clock stepped back an hour (an NTP step, a
    VM restored, a replica promoted whose clock is behind) a full rpm window, a 30 s
    cooldown and a 30 s open breaker each lasted an hour more, and a crashed owner's
    permit too.  Each keeps what was left of it."""
    prefix = f"step-{secrets.token_hex(4)}"

    async def main() -> dict[str, Any]:
        async with _started(redis_server.url, prefix) as backend:
            await _use(backend)
            held = await granted(backend, ask(source="e", mif=1))
            other = await granted(backend, ask(source="e", mif=2))  # (writes e's last TIME)
            await backend.settle(settle(other, 1))
            await _as_if_ahead(redis_server.url, prefix, ("a", "b", "c", "e"))
            now = backend.now()
            rpm = await refused(backend, ask(source="a", rpm=1), RefusalReason.RPM)
            cooling = await refused(backend, ask(source="c"), RefusalReason.COOLING_DOWN)
            opened = await refused(backend, ask(source="b", breaker=BREAKER), RefusalReason.BREAKER_OPEN)
            await refused(backend, ask(source="e", mif=1), RefusalReason.IN_FLIGHT)  # (rewinds e)
            import coredis

            async with coredis.Redis.from_url(redis_server.url) as client:
                (score,) = [s for _, s in await client.zrange(
                    f"{prefix}:chat:e:permits", 0, -1, withscores=True)]
            lease_left = score / 1e6 - await _server_now(redis_server.url)
            await backend.settle(settle(held, 1))
            assert rpm.retry_at is not None and cooling.retry_at is not None
            assert opened.retry_at is not None
            return {"rpm": rpm.retry_at - now, "cooldown": cooling.retry_at - now,
                    "breaker": opened.retry_at - now, "lease": lease_left}

    waits = trio.run(main)
    margin = 5.0  # the real time the run took, generously
    assert 60.0 - margin < waits["rpm"] <= 60.0 + 0.01, waits
    assert COOLDOWN_S - margin < waits["cooldown"] <= COOLDOWN_S + 0.01, waits
    assert BREAKER.open_s - margin < waits["breaker"] <= BREAKER.open_s + 0.01, waits
    # (lease_s, the default; plus the real time since the source's last script: when
    # the step came in between is unknown, so none of that time is counted as gone.)
    assert 0 < waits["lease"] <= 15.0 + margin, waits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lt", ["inf", "1e30", "nan", "-5", "soon"])
def test_another_tools_last_time_moves_nothing(redis_server: RedisServer, lt: str) -> None:
    """Review of the fix: an ``lt`` of inf or 1e30 (another tool's) moved every instant
    back by it: a live owner's permit lapsed (the in-flight limit exceeded) and the rpm
    window emptied."""
    from ._redis_server import command

    prefix = f"lt-{secrets.token_hex(4)}"

    async def main() -> None:
        async with _started(redis_server.url, prefix) as backend:
            held = await granted(backend, ask(source="a", mif=1, rpm=1))
            command(redis_server.port, "HSET", f"{prefix}:chat:a:state", "lt", lt)
            await refused(backend, ask(source="a", mif=1, rpm=1), RefusalReason.IN_FLIGHT)
            await refused(backend, ask(source="a", rpm=1), RefusalReason.RPM)
            await backend.settle(settle(held, 1))

    trio.run(main)


@pytest.mark.timeout(60)
def test_an_older_versions_admission_since_the_step_stays(redis_server: RedisServer) -> None:
    """Review of the fix: in a rolling upgrade an older version (which keeps no last
    TIME) admits after the step; the newer one's next script moved that admission back
    by the whole step too, so its live permit lapsed at once and its window entry left
    early.  What was written since the step stays."""
    import coredis

    from polygate.governance import _redis_scripts as lua

    older_admit = lua.ADMIT.replace("  rewind(now)\n", "")  # (an ADMIT before rewind)
    assert older_admit != lua.ADMIT
    prefix = f"old-{secrets.token_hex(4)}"

    async def main() -> None:
        async with _started(redis_server.url, prefix) as backend:
            x = await granted(backend, ask(source="e", mif=1, rpm=2))
            await backend.settle(settle(x, 1))  # (e's last TIME written)
            await _as_if_ahead(redis_server.url, prefix, ("e",))
            base = f"{prefix}:chat:e"
            keys = [f"{base}:state", f"{base}:window", f"{base}:wtok", f"{base}:open",
                    f"{base}:permits", f"{prefix}:changes"]
            async with coredis.Redis.from_url(redis_server.url, decode_responses=True) as client:
                # member, tokens, rpm, tpm, max_in_flight, open_us, lease_us, window_us, ttl_ms
                reply = await client.eval(older_admit, keys, [
                    "older:1", "10", "2", "-1", "1", "30000000", "15000000", "60000000", "86400000"])
                assert reply[0] == 1, reply
            # Its permit is the only one, and the window holds two admissions.
            await refused(backend, ask(source="e", mif=1, rpm=2), RefusalReason.IN_FLIGHT)
            await refused(backend, ask(source="e", rpm=2), RefusalReason.RPM)

    trio.run(main)
