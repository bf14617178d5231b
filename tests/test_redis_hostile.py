"""Foreign data in the Redis backend's keys (another tool's, a hand's, an older
version's): the backend fails closed with a typed error, leaves nothing half-done, and
recovers once the state is sane again (outside review, hostile Redis state)."""
from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply

from ._redis_server import RedisServer, command, need_redis, running_redis

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with running_redis(need_redis()) as server:
        yield server


def settings(redis: RedisServer, prefix: str, **src: Any) -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1", **src)])},
        backend=f"{redis.url}?timeout_s=0.5&lease_s=15&prefix={prefix}",
    )


@pytest.mark.parametrize("spoil", ["changes", "counter"])
def test_foreign_data_fails_an_admission_before_it_holds_a_permit(
    redis: RedisServer, spoil: str,
) -> None:
    """``P:changes`` of the wrong type (or a counter field that is no integer, ``rt``)
    failed ADMIT after it had written the permit and the window entry (Redis keeps a
    failed script's writes), and the client reads an error reply as "nothing ran":
    once the key was repaired, the source stayed blocked by a permit nobody owned, for
    the whole lease."""
    prefix = f"h{secrets.token_hex(3)}"
    state = f"{prefix}:chat:a:state"

    async def body() -> None:
        up = FakeUpstream(Reply(text="ok"))
        async with polygate.session(settings(redis, prefix, max_in_flight=1), transport=up.transport()) as s:
            assert (await s.chat(MESSAGES)).text == "ok"
            if spoil == "changes":
                command(redis.port, "DEL", f"{prefix}:changes")
                command(redis.port, "HSET", f"{prefix}:changes", "x", "1")
            else:
                command(redis.port, "HSET", state, "rt", "junk")
            with pytest.raises(polygate.GovernanceBackendError):
                await s.chat(MESSAGES)
            # The state is sane again.
            if spoil == "changes":
                command(redis.port, "DEL", f"{prefix}:changes")
            else:
                command(redis.port, "HDEL", state, "rt")
            assert command(redis.port, "ZCARD", f"{prefix}:chat:a:permits") == b":0"
            assert (await s.chat(MESSAGES, call_deadline_s=3)).text == "ok"

    trio.run(body)


@pytest.mark.parametrize("value", ["-inf", "-1e300"])
def test_a_hostile_budget_level_recovers_by_refills(redis: RedisServer, value: str) -> None:
    """The memory backend's bucket stays in [0, burst]; a level written below 0 was
    kept (and written back) for ever: hedging never came back."""
    prefix = f"h{secrets.token_hex(3)}"

    async def body() -> None:
        async with polygate.session(settings(redis, prefix), transport=FakeUpstream().transport()) as s:
            backend: Any = s._runtime.governor.backend
            command(redis.port, "SET", f"{prefix}:chat:budget", value)
            for _ in range(20):
                await backend.budget_refill("chat", 1.0, 10.0)
            level = await backend.budget_level("chat", 10.0)
            assert level == 10.0, level
            assert await backend.budget_take("chat", 10.0)

    trio.run(body)


@pytest.mark.parametrize(("field", "value"), [("cf", "nan"), ("cf", "-5"), ("ot", "1e30"), ("ad", "inf")])
def test_snapshot_of_junk_fields_is_sane_or_typed(redis: RedisServer, field: str, value: str) -> None:
    """NaN, inf or 1e30 in a counter came back in ``statistics()`` as the smallest
    64-bit integer (Redis's cast of a script's number)."""
    prefix = f"h{secrets.token_hex(3)}"

    async def body() -> None:
        async with polygate.session(settings(redis, prefix), transport=FakeUpstream().transport()) as s:
            assert (await s.chat(MESSAGES)).text
            command(redis.port, "HSET", f"{prefix}:chat:a:state", field, value)
            try:
                stats = await s.statistics()
            except polygate.GovernanceBackendError:
                return
            text = repr(stats)
            assert "-9223372036854775808" not in text, text[:2000]

    trio.run(body)
