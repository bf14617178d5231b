"""The Redis cache against a real redis-server on loopback (real clock): shared by
sessions, TTL kept by Redis, round trips counted by Redis itself, fail-open while
Redis is down and recovery after, ACL users, and no password anywhere."""

from __future__ import annotations

import logging
import secrets
from typing import Any

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from . import _redis_server
from ._redis_server import ALICE_PASSWORD, RedisServer, command

pytestmark = pytest.mark.integration

redis_server = _redis_server.redis_server  # the fixtures
own_redis = _redis_server.own_redis

TTL = 300.0


def _settings(url: str, **scope: Any) -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1")
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=TTL, **scope)}, cache=url
    )


def _url(server: RedisServer, **options: str) -> tuple[str, str]:
    prefix = f"t{secrets.token_hex(4)}"
    query = "&".join(f"{k}={v}" for k, v in {"prefix": prefix, **options}.items())
    return f"{server.url}?{query}", prefix


def _question() -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {secrets.token_hex(4)}"}]


async def _commandstats(server: RedisServer) -> dict[str, int]:
    import coredis

    async with coredis.Redis(host="127.0.0.1", port=server.port) as client:
        info = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()
            if k.startswith("cmdstat_")}


async def test_sessions_share_the_cache(redis_server: RedisServer) -> None:
    url, prefix = _url(redis_server)
    question = _question()
    up = FakeUpstream(Reply(text="from upstream"))
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        first = await s.chat(question)
        embedded = await s.embed(["x", "y"], scope="chat")
    async with polygate.session(_settings(url), transport=Router({"a": up})) as other:
        second = await other.chat(question)
        again = await other.embed(["y", "x"], scope="chat")
        stats = (await other.statistics()).cache
    assert second.call_stats.cached and second.call_stats.attempts == 0
    assert second.text == first.text and second.message == first.message
    assert again.call_stats.cached and again.vectors == embedded.vectors[::-1]
    assert stats.backend == "redis" and stats.hits == 3 and stats.errors == 0
    assert len(up.requests) == 2
    import coredis

    async with coredis.Redis(host="127.0.0.1", port=redis_server.port) as client:
        keys = await client.keys(f"{prefix}:*")
        ttls = [await client.pttl(k) for k in keys]
    assert len(keys) == 3  # one answer, two vectors
    assert all(0.9 * TTL * 1000 < t <= TTL * 1000 for t in ttls)


@pytest.mark.parametrize("ttl", [1e17, 1.7e308])
async def test_a_huge_ttl_is_stored_as_the_longest_redis_keeps(redis_server: RedisServer, ttl: float) -> None:
    """Any finite ``cache_ttl_s`` > 0 is valid (docs/cache.md); one past what Redis's
    ``PX`` holds is the longest it holds, never a refused write that drops the other
    entries of its batch."""
    url, prefix = _url(redis_server)
    question = _question()
    up = FakeUpstream(Reply(text="kept"))
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=ttl),
        "other": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=TTL),
    }, cache=url)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:  # two writes, likely one batch
            nursery.start_soon(lambda: s.chat(question))
            nursery.start_soon(lambda: s.chat(question, scope="other"))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        assert (await s.chat(question)).call_stats.cached
        assert (await s.chat(question, scope="other")).call_stats.cached
        stats = (await s.statistics()).cache
    assert stats.errors == 0
    import coredis

    async with coredis.Redis(host="127.0.0.1", port=redis_server.port) as client:
        ttls = sorted([await client.pttl(k) for k in await client.keys(f"{prefix}:*")])
    assert ttls[0] <= TTL * 1000 and ttls[1] > 10 * 365 * 86400 * 1000


async def test_round_trips(redis_server: RedisServer) -> None:
    """A hit is one lookup; a miss is one lookup before the upstream call, and its answer
    is written behind (one SET, pipelined with others, off the call path)."""
    url, _ = _url(redis_server)
    question = _question()
    async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream()})) as s:
        cache: Any = s._cache
        backend = cache.backend
        before = await _commandstats(redis_server)
        trips = backend.read_round_trips
        await s.chat(question)  # miss
        miss_trips = backend.read_round_trips - trips
        await cache.aclose()  # let the write land before counting
        after_miss = await _commandstats(redis_server)
        trips = backend.read_round_trips
        for _ in range(10):
            assert (await s.chat(question)).call_stats.cached
        hit_trips = (backend.read_round_trips - trips) / 10
        after_hits = await _commandstats(redis_server)
    assert miss_trips == 1  # the lookup (an MGET of one key) on the call path
    assert after_miss.get("mget", 0) - before.get("mget", 0) == 1
    assert after_miss.get("set", 0) - before.get("set", 0) == 1
    assert hit_trips == 1
    assert after_hits.get("mget", 0) - after_miss.get("mget", 0) == 10
    assert after_hits.get("set", 0) == after_miss.get("set", 0)


async def test_a_key_of_another_type_is_a_miss_written_over(redis_server: RedisServer) -> None:
    """A probe put another program's hash where an answer's key goes: GET failed on it
    (WRONGTYPE), which paused the whole cache and dropped the write that would have
    healed the key.  It is a miss, the answer replaces it, and nothing pauses."""
    url, prefix = _url(redis_server)
    question = _question()
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        await s.chat(question)
        cache: Any = s._cache
        await cache.aclose()  # the write has landed
    import coredis

    async with coredis.Redis(host="127.0.0.1", port=redis_server.port) as client:
        (key,) = await client.keys(f"{prefix}:*")
        await client.delete([key])
        await client.hset(key, {"field": "value"})
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        first = await s.chat(question)
        other = await s.chat(_question())  # an unrelated lookup right after: not paused
        stats = (await s.statistics()).cache
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        healed = await s.chat(question)
    assert not first.call_stats.cached and not other.call_stats.cached
    assert (stats.errors, stats.writes_dropped) == (0, 0)
    assert healed.call_stats.cached


async def test_writes_are_batched(redis_server: RedisServer) -> None:
    url, prefix = _url(redis_server)
    async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream()})) as s:
        cache: Any = s._cache
        trips = cache.backend.read_round_trips
        writes = cache.backend.write_round_trips
        vectors = await s.embed([f"text {i}" for i in range(100)], scope="chat")
        lookups = cache.backend.read_round_trips - trips
        await cache.aclose()
        writes = cache.backend.write_round_trips - writes
    assert len(vectors.vectors) == 100
    assert lookups == 1  # one MGET for the hundred inputs
    assert writes == 1  # one pipelined batch of a hundred SETs
    assert command(redis_server.port, "EXISTS", f"{prefix}:missing") == b":0"


async def test_redis_down_fails_open_and_recovers(own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    url, _ = _url(own_redis, timeout_s="0.2")
    up = FakeUpstream(Reply(text="ok"))
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        await s.chat(_question())
        own_redis.kill()
        with caplog.at_level(logging.WARNING, logger="polygate.cache"), trio.fail_after(10):
            for _ in range(5):
                r = await s.chat(_question())
                assert r.text == "ok" and not r.call_stats.cached
        down = (await s.statistics()).cache
        own_redis.start()
        question = _question()
        with caplog.at_level(logging.INFO, logger="polygate.cache"), trio.fail_after(60):
            while True:  # the pause ends, coredis reconnects, the answer is stored
                await s.chat(question)
                if (await s.chat(question)).call_stats.cached:
                    break
                await trio.sleep(0.2)
    assert down.errors >= 1 and down.misses >= 6 and down.hits == 0
    said = [r.getMessage() for r in caplog.records if r.name == "polygate.cache"]
    assert any("fails open" in line for line in said)
    # Review: the outage's end was never said, and the log read as if it went on.
    back = [i for i, line in enumerate(said) if line.startswith("the cache answers again")]
    assert len(back) == 1 and "fails open" in said[back[0] - 1], said


async def test_redis_down_at_session_start(caplog: pytest.LogCaptureFixture) -> None:
    from ._redis_server import free_port

    url = f"redis://:{ALICE_PASSWORD}@127.0.0.1:{free_port()}/0?timeout_s=0.2"
    with caplog.at_level(logging.WARNING, logger="polygate.cache"):
        async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream()})) as s:
            r = await s.chat(_question())
            stats = (await s.statistics()).cache
    assert not r.call_stats.cached and stats.errors >= 1
    assert caplog.records
    assert all(ALICE_PASSWORD not in rec.getMessage() for rec in caplog.records)


async def test_the_ping_at_the_start_is_counted_and_logged_as_the_failures_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A docs sweep of cache.md ("every failed operation is counted and logged at
    most once every 10 s"): the PING at the start logged a warning of its own, not
    counted, and the first failed lookup logged again at once."""
    from ._redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.2"
    with caplog.at_level(logging.WARNING, logger="polygate.cache"):
        async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream()})) as s:
            assert (await s.statistics()).cache.errors == 1  # the PING
            r = await s.chat(_question())
            stats = (await s.statistics()).cache
    assert not r.call_stats.cached and stats.errors == 2  # and the lookup (not paused)
    [warning] = [rec for rec in caplog.records if rec.name == "polygate.cache"]
    assert "fails open (1 error(s) so far)" in warning.getMessage()


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_a_redis_that_does_not_answer_never_fails_a_call_with_a_deadline(kind: str) -> None:
    """A black-holed Redis (connections accepted, nothing answered) with a timeout
    longer than the call's deadline: the lookup gives up within a tenth of the
    deadline and the call goes upstream (it used to fail with DeadlineExceeded)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    held: list[trio.SocketStream] = []

    async def hold(stream: trio.SocketStream) -> None:
        held.append(stream)  # read nothing, answer nothing, until the test ends
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, hold, listeners)
        url = f"redis://127.0.0.1:{port}/0?timeout_s=2"
        up = FakeUpstream(Reply(text="answered"))
        async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
            with trio.fail_after(20):
                if kind == "chat":
                    r: Any = await s.chat(_question(), call_deadline_s=1.0)
                    assert r.text == "answered" and not r.call_stats.cached
                else:
                    r = await s.embed(["one", "two"], scope="chat", call_deadline_s=1.0)
                    assert len(r.vectors) == 2
            stats = (await s.statistics()).cache
            nursery.cancel_scope.cancel()
    assert stats.errors >= 1 and stats.hits == 0 and len(up.requests) == 1


async def test_acl_user_and_wrong_password(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    base = f"redis://alice:{ALICE_PASSWORD}@127.0.0.1:{redis_server.port}/0?prefix=t{secrets.token_hex(3)}"
    question = _question()
    async with polygate.session(_settings(base), transport=Router({"a": FakeUpstream()})) as s:
        await s.chat(question)
        await s._cache.aclose()  # type: ignore[union-attr]
        assert (await s.chat(question)).call_stats.cached
    wrong = base.replace(ALICE_PASSWORD, "not-the-password")
    with caplog.at_level(logging.WARNING, logger="polygate.cache"):
        async with polygate.session(_settings(wrong), transport=Router({"a": FakeUpstream()})) as s:
            r = await s.chat(question)
            assert repr(s.settings).count("not-the-password") == 0
    assert not r.call_stats.cached
    messages = " ".join(rec.getMessage() for rec in caplog.records)
    assert "credentials" in messages or "fails open" in messages
    assert "not-the-password" not in messages and ALICE_PASSWORD not in messages


async def test_prefixes_keep_caches_apart(redis_server: RedisServer) -> None:
    question = _question()
    url_a, _ = _url(redis_server)
    url_b, _ = _url(redis_server)
    async with polygate.session(_settings(url_a), transport=Router({"a": FakeUpstream()})) as s:
        await s.chat(question)
    async with polygate.session(_settings(url_b), transport=Router({"a": FakeUpstream()})) as s:
        assert not (await s.chat(question)).call_stats.cached
