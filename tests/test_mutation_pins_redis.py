"""Behaviour of the Redis governance backend no other test pinned, found by mutating
its scripts: each test fails on the mutation its docstring names.  A real throwaway
redis-server."""
from __future__ import annotations

from typing import Any

import trio

from polygate.governance import Admission, Feedback, RefusalReason
from tests import _redis_server
from tests._redis_server import command
from tests.test_backend_contract import EPS, ask, granted, settle
from tests.test_backend_edges import _OLD_DEAD_SETTLE, _old_and_new

redis_server = _redis_server.redis_server  # the fixture

# An older version's settle of an ordinary cooldown (a 429): cu only; its admit clears
# dd once the cooldown is over (as the notes in the contract tests say).
_OLD_ORDINARY_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cu = tonumber(redis.call('HGET', KEYS[1], 'cu')) or 0
redis.call('HSET', KEYS[1], 'cu', math.max(cu, now + tonumber(ARGV[1])))
return 1
"""


def test_a_new_admit_clears_an_older_dead_mark_that_ran_out(redis_server: Any) -> None:
    """Mutation (ADMIT's ``if s[2] == '1' then HSET dd 0`` dropped): an older process's dead
    mark ran out; a new process admits (and settles a success); then an older process
    settles an ordinary 429 cooldown.  It is a cooldown, not a dead source: the new
    admit cleared dd (as the older admit did) -- the mutant left dd = 1, so the 429
    read as DEAD to every process, new and old, for the whole Retry-After."""
    h, port, prefix, state = _old_and_new(redis_server, "r6")

    async def body() -> None:
        W = h.window
        async with h.backend(prefix) as b:
            command(port, "EVAL", _OLD_DEAD_SETTLE, "1", state, str(int(W / 60 * 1e6)))
            await trio.sleep(W / 60 + 2 * EPS)  # the older dead mark ran out
            a = await granted(b, ask())
            await b.settle(settle(a, 0, Feedback.SUCCESS))
            start = b.now()
            command(port, "EVAL", _OLD_ORDINARY_SETTLE, "1", state, str(int(W / 2 * 1e6)))
            result = await b.admit(ask())
            if b.now() < start + W / 2 - EPS:
                assert not isinstance(result, Admission)
                assert result.reason is RefusalReason.COOLING_DOWN, result

    h.run(body)


def test_a_refill_never_stores_more_than_the_burst(redis_server: Any) -> None:
    """Mutation (BUDGET_REFILL's ``math.min(burst, level + amount)`` -> ``level + amount``):
    refills past a full bucket are lost (the memory backend's rule): after 50 refills of
    1 with burst 2, a reload that raises the burst to 100 finds 2 tokens -- the mutant
    stored burst + the last refill (3), which a higher burst then let through as a
    hedge never earned."""
    from tests.test_backend_contract import Harness

    h = Harness("redis", 0.6, redis_server.url)

    async def body() -> None:
        async with h.backend() as b:
            for _ in range(50):
                await b.budget_refill("chat", 1.0, 2.0)
            assert await b.budget_level("chat", 2.0) == 2.0
            assert await b.budget_level("chat", 100.0) == 2.0

    h.run(body)
    # the memory backend, the reference, agrees
    from polygate.governance import MemoryBackend

    async def memory() -> None:
        b = MemoryBackend()
        for _ in range(50):
            await b.budget_refill("chat", 1.0, 2.0)
        assert await b.budget_level("chat", 100.0) == 2.0

    import trio
    trio.run(memory)


def test_an_open_breaker_keeps_its_state_key_past_key_ttl(redis_server: Any) -> None:
    """Mutation (``touch()``: the open breaker's period dropped from the state key's TTL):
    with key_ttl_s=60 and a breaker that opens for 600 s, the state key lives at least
    as long as the breaker is open ("forgetting any would let calls through early") --
    the mutant gave it 60 s, after which Redis forgets the open breaker and the source
    is admitted 540 s early."""
    import secrets

    from polygate.governance import BreakerPolicy, BreakerState
    from polygate.governance._redis import RedisBackend, parse_redis_url

    prefix = f"r31{secrets.token_hex(3)}"
    state = f"{prefix}:chat:a:state"
    policy = BreakerPolicy(failures=1, open_s=600.0, max_open_s=600.0)

    async def body() -> None:
        b = RedisBackend(parse_redis_url(f"{redis_server.url}?prefix={prefix}&key_ttl_s=60"), window_s=0.6)
        await b.start()
        try:
            a = await granted(b, ask(breaker=policy))
            await b.settle(settle(a, 0, Feedback.FAILURE, breaker=policy))
            assert (await b.snapshot("chat", "a")).breaker is BreakerState.OPEN
            pttl = int(command(redis_server.port, "PTTL", state).decode().lstrip(":"))
            assert pttl > 590_000, pttl
        finally:
            await b.aclose()

    trio.run(body)
