"""Behaviour of the response cache (its backends, the writer, coalescing, refresh) no
other test pinned, found by mutating it: each test fails on the mutation its
docstring names and passes on the code as it is."""
from __future__ import annotations

import trio
import trio.testing

from polygate.cache import MemoryBackend


async def test_replacing_an_entry_frees_its_bytes(autojump_clock: trio.testing.MockClock) -> None:
    """Mutation: the old value's cost not taken back when a key is stored again:
    ``bytes`` drifts up with every refresh, and the store evicts live entries to
    honour bytes it does not hold."""
    lru = MemoryBackend(max_entries=100, max_bytes=1000)
    lru.put_now([("a", b"x" * 100, 60), ("b", b"y" * 100, 60)])
    once = lru.statistics().bytes
    for _ in range(5):
        lru.put_now([("a", b"x" * 100, 60)])  # cache="refresh" of the same answer
    assert lru.statistics().bytes == once
    assert lru.get_now("b") == b"y" * 100 and lru.statistics().evicted == 0


def _settings(cache: str = "memory"):
    import polygate
    source = polygate.Source(name="a", base_url="http://a/v1", api_key="sk-test")
    return polygate.Settings(
        scopes={"embed": polygate.Scope(sources=[source], cache_ttl_s=60.0)}, cache=cache)


async def test_an_embed_waiter_gets_the_leaders_vector_as_coalesced(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation: Coalescer.settle without its ``done`` guard: the embed leader's
    ``finally`` (settle every flight, abandoned) overwrote the value it had just
    shared, so every waiter took the flight as abandoned and looked again: a hit, not
    a coalesced answer (and on a backend that had not stored it yet, a second upstream
    call)."""
    import polygate
    from polygate.testing import FakeUpstream, Reply, Router

    up = FakeUpstream(Reply(headers_delay_s=1.0))
    results = []
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        async def one() -> None:
            results.append(await s.embed(["same text"]))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.sleep(0.1)
            nursery.start_soon(one)
        stats = (await s.statistics()).cache
    assert (stats.misses, stats.coalesced, stats.hits) == (1, 1, 0)
    assert len([r for r in up.requests if r.path.endswith("/embeddings")]) == 1


def test_a_flight_keeps_its_first_outcome() -> None:
    from polygate.cache._coalesce import Coalescer
    c = Coalescer()
    flight, leading = c.claim("k")
    assert leading
    c.settle("k", flight, value=b"v")
    c.settle("k", flight)
    assert flight.value == b"v"


class _Backend:
    """A write-behind backend: lookups fail while ``down``; writes take ``slow``."""

    name = "probe"
    write_behind = True

    def __init__(self) -> None:
        self.down = False
        self.slow = 0.0
        self.data: dict[str, bytes] = {}
        self.written: list[list[tuple[str, float]]] = []

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def get_many(self, keys):
        await trio.lowlevel.checkpoint()
        from polygate.cache import CacheBackendError
        if self.down:
            raise CacheBackendError("down")
        return [self.data.get(k) for k in keys]

    async def set_many(self, entries) -> None:
        await trio.sleep(self.slow)
        self.written.append([(k, ttl) for k, _, ttl in entries])
        for key, value, _ in entries:
            self.data[key] = value


async def test_an_entry_that_expired_while_queued_is_not_written(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation: ``if expires > now`` dropped from the writer's batch: an answer whose
    TTL ran out behind a slow write was written anyway (a negative TTL: SQLite rows
    never served, a Redis key of 1 ms) and counted written instead of dropped."""
    from polygate.cache import Cache

    backend = _Backend()
    backend.slow = 3.0
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        cache.put("a", b"1", 60)
        await trio.sleep(0.1)  # the writer is writing "a" (3 s)
        cache.put("b", b"2", 1)  # expires long before the writer can take it
        await trio.sleep(10)
        await cache.aclose()
        nursery.cancel_scope.cancel()
    assert [[k for k, _ in batch] for batch in backend.written] == [["a"]]
    assert (cache.writes, cache.writes_dropped) == (1, 1)


async def test_a_put_while_the_backend_is_paused_is_dropped_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation: put_many no longer drops while paused: an answer put during a pause
    was queued behind a slow write and written once the pause had ended (the module
    docstring: while paused nothing is put in the write-behind)."""
    from polygate.cache import Cache

    backend = _Backend()
    backend.slow = 1.0
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        cache.put("a", b"1", 60)
        await trio.sleep(0.1)  # the writer is writing "a" until t=1.0
        backend.down = True
        assert await cache.get("zzz") is None  # fails: paused for 0.25 s
        backend.down = False
        cache.put("b", b"2", 60)  # paused: dropped
        assert cache.writes_dropped == 1 and "b" not in cache._pending
        await trio.sleep(3)
        await cache.aclose()
        nursery.cancel_scope.cancel()
    assert "b" not in backend.data
    assert (cache.writes, cache.writes_dropped) == (1, 1)


def test_a_ttl_under_a_millisecond_is_still_a_valid_px() -> None:
    """Mutation: ``max(1, ...)`` -> ``max(0, ...)`` in _px: an entry with under 1 ms
    of its TTL left when the writer takes it (a write held up behind a slow one) was
    sent as ``SET ... PX 0``, which Redis refuses ("invalid expire time"): the batch's
    write failed and the cache paused."""
    from polygate.cache._redis import _px

    assert _px(0.0004) == 1
    assert _px(1e-9) == 1
    assert _px(2.5) == 2500


async def test_a_refresh_beside_a_leader_still_stores_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutation: _lead without a flight (``cache="refresh"`` while an identical call
    leads) no longer stores its answer: docs/cache.md says a refresh writes, and its
    answer is the newer one -- the older leader's stayed the entry."""
    import polygate
    from polygate.testing import FakeUpstream, Reply, Router

    source = polygate.Source(name="a", base_url="http://a/v1", api_key="sk-test")
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=60.0)}, cache="memory")
    up = FakeUpstream([Reply(text="old answer", first_token_s=2.0),
                       Reply(text="new answer", first_token_s=2.0)])
    messages = [{"role": "user", "content": "hi"}]
    got = {}
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async def call(name: str, mode: object) -> None:
            got[name] = (await s.chat(messages, cache=mode)).text
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "lead", True)
            await trio.sleep(0.5)
            nursery.start_soon(call, "refresh", "refresh")
        assert got == {"lead": "old answer", "refresh": "new answer"}
        after = await s.chat(messages)
        assert after.call_stats.cached and after.text == "new answer"
