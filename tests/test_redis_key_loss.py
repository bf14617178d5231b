"""One of a source's keys lost while admissions are open: Redis evicts keys one by one
under ``maxmemory`` with an ``allkeys-*`` or ``volatile-*`` policy, and an operator may
``DEL`` one.  Nothing may then stick: not the half-open probe, not a permit, not the
tokens open reservations hold, and no total may go negative.  A real redis-server;
the replica that dies holding the probe is a real process, killed.  Outside review of
replicas on one Redis, 2026-12-05."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
import trio

from polygate.governance import Admission, BreakerPolicy, BreakerState, Feedback, RefusalReason
from polygate.governance._redis import RedisBackend, parse_redis_url

from ._redis_server import RedisServer, command, need_redis, running_redis
from .conftest import ROOT
from .test_backend_contract import ask, granted, refused, settle, snap

pytestmark = pytest.mark.integration

BREAKER = BreakerPolicy(failures=1, open_s=0.3)

# A replica that takes the half-open probe and waits to be killed.
_HOLDER = """
import sys, trio
from polygate.governance import BreakerPolicy
from polygate.governance._redis import RedisBackend, parse_redis_url
from tests.test_backend_contract import ask, granted

async def main(url):
    b = RedisBackend(parse_redis_url(url))
    await b.start()
    probe = await granted(b, ask(breaker=BreakerPolicy(failures=1, open_s=0.3)))
    print("probe" if probe.probe else "no probe", flush=True)
    await trio.sleep(3600)

trio.run(main, sys.argv[1])
"""


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with running_redis(need_redis()) as server:
        yield server


@contextlib.asynccontextmanager
async def _backend(url: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(parse_redis_url(url))
    await b.start()
    try:
        yield b
    finally:
        await b.aclose()


def _url(redis: RedisServer, lease_s: float = 30) -> tuple[str, str]:
    prefix = f"kl{secrets.token_hex(3)}"
    return prefix, f"{redis.url}?prefix={prefix}&lease_s={lease_s}"


async def _opened(b: RedisBackend) -> None:
    """Trip the breaker, and wait out its open period."""
    a = await granted(b, ask(breaker=BREAKER))
    await b.settle(settle(a, None, Feedback.FAILURE, breaker=BREAKER))
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.OPEN
    await trio.sleep(0.4)


@pytest.mark.timeout(60)
def test_a_replica_dead_with_the_probe_after_its_permit_was_evicted_does_not_shut_the_source(
    redis: RedisServer,
) -> None:
    """Nobody will settle that probe: its holder is dead, and its permit (the lease that
    would have run out) went with the permits key.  It used to shut the source until the
    state key expired (``key_ttl_s``, a day), holding its reservation's tokens as long."""
    prefix, url = _url(redis)

    async def body() -> None:
        async with _backend(url) as b:
            await _opened(b)
            holder = await trio.to_thread.run_sync(lambda: subprocess.Popen(
                [sys.executable, "-c", _HOLDER, url], stdout=subprocess.PIPE, text=True,
                cwd=str(ROOT),
            ))
            try:
                assert holder.stdout is not None
                line = await trio.to_thread.run_sync(holder.stdout.readline)
                assert line.strip() == "probe", line
                await refused(b, ask(breaker=BREAKER), RefusalReason.BREAKER_OPEN)  # (it is out)
                command(redis.port, "DEL", f"{prefix}:chat:a:permits")
            finally:
                holder.kill()
                holder.wait()
                assert holder.stdout is not None
                holder.stdout.close()
            probe = await b.admit(ask(breaker=BREAKER))
            assert isinstance(probe, Admission) and probe.probe, probe
            s = await snap(b)
            # The dead replica's reservation is settled as a lapsed lease: its estimate
            # stays in the window; the tokens it held are held no more.
            assert s.tokens_reserved == 10 and s.in_flight == 1, s
            assert command(redis.port, "HINCRBY", f"{prefix}:chat:a:state", "lx", "0") == b":1"
            await b.settle(settle(probe, None, Feedback.SUCCESS, breaker=BREAKER))
            s = await snap(b)
            assert s.breaker is BreakerState.CLOSED and s.tokens_reserved == 0 and s.in_flight == 0, s

    trio.run(body)


def test_a_reservation_whose_permit_was_evicted_is_not_held_for_ever(redis: RedisServer) -> None:
    """Its owner, alive, learns at its next renewal that the lease is lost; the tokens
    its reservation held are freed by the next script that touches the source, not when
    the open key's TTL (a day) runs out."""
    prefix, url = _url(redis)

    async def body() -> None:
        async with _backend(url) as b:
            a = await granted(b, ask(tokens=100))
            command(redis.port, "DEL", f"{prefix}:chat:a:permits")
            s = await snap(b)
            assert s.tokens_reserved == 0 and s.in_flight == 0, s
            assert s.tokens_in_window == 100, s  # (it may have been billed: the estimate stays)
            assert command(redis.port, "HLEN", f"{prefix}:chat:a:open") == b":0"
            await b.settle(settle(a, 30))  # a no-op now
            s = await snap(b)
            assert s.tokens_reserved == 0 and s.settled_total == 100, s

    trio.run(body)


def test_a_settle_after_the_open_key_was_evicted_frees_its_permit_and_its_probe_at_once(
    redis: RedisServer,
) -> None:
    """The reservation is gone, so the settle has nothing to count; its permit and the
    probe are free all the same, now, not a lease later."""
    prefix, url = _url(redis, lease_s=30)

    async def body() -> None:
        async with _backend(url) as b:
            a = await granted(b, ask(mif=1))
            command(redis.port, "DEL", f"{prefix}:chat:a:open")
            await b.settle(settle(a))
            await granted(b, ask(mif=1))  # (refused in_flight for 30 s before)

    trio.run(body)

    prefix, url = _url(redis, lease_s=30)

    async def probe_body() -> None:
        async with _backend(url) as b:
            await _opened(b)
            probe = await granted(b, ask(breaker=BREAKER))
            assert probe.probe
            command(redis.port, "DEL", f"{prefix}:chat:a:open")
            await b.settle(settle(probe, None, Feedback.SUCCESS, breaker=BREAKER))
            again = await b.admit(ask(breaker=BREAKER))
            assert isinstance(again, Admission) and again.probe, again

    trio.run(probe_body)


@pytest.mark.parametrize("later", [None, 7, 200])
def test_the_totals_add_up_after_the_state_key_is_lost(redis: RedisServer, later: int | None) -> None:
    """A reservation made before the state key was lost, settled (alone, or while a
    smaller or a larger one made after the loss is open): its settle took its estimate
    off a counter that restarted at 0, and ``tokens_reserved`` read -100 (the
    ``polygate_source_tokens_reserved`` gauge too) for as long as the source had
    traffic; a first repair then charged it to the later reservation (a review of the
    repair).  The open reservations' estimates go back into the totals, once."""
    prefix, url = _url(redis)

    async def body() -> None:
        async with _backend(url) as b:
            a = await granted(b, ask(tokens=100))
            command(redis.port, "DEL", f"{prefix}:chat:a:state")
            c = await granted(b, ask(tokens=later)) if later is not None else None
            await b.settle(settle(a, 100))
            s = await snap(b)  # (checks reserved = settled + released + open)
            assert s.tokens_reserved == (later or 0), s
            if c is not None:
                await b.settle(settle(c, 5))
            s = await snap(b)
            assert s.tokens_reserved == 0 and s.reserved_total == 100 + (later or 0), s
            # Later reservations count as ever.
            d = await granted(b, ask(tokens=3))
            assert (await snap(b)).tokens_reserved == 3
            await b.settle(settle(d, 2))
            s = await snap(b)
            assert s.tokens_reserved == 0 and s.reserved_total == 103 + (later or 0), s

    trio.run(body)
