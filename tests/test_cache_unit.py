"""The cache's parts alone: the memory LRU, the codec, and the front's fail-open
lookups and writes behind (with a backend that fails on demand)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.cache import Cache, CacheBackendError, MemoryBackend
from polygate.cache._backend import Entry
from polygate.cache._codec import decode_chat, decode_vector, encode_chat, encode_vector
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES

# --------------------------------------------------------------------------- memory LRU


async def test_lru_bound_by_entries(autojump_clock: trio.testing.MockClock) -> None:
    lru = MemoryBackend(max_entries=2, max_bytes=1 << 20)
    lru.put_now([("a", b"1", 60), ("b", b"2", 60)])
    assert lru.get_now("a") == b"1"  # a is now the most recent
    lru.put_now([("c", b"3", 60)])
    assert lru.get_now("b") is None and lru.get_now("a") == b"1" and lru.get_now("c") == b"3"
    assert lru.statistics().evicted == 1 and lru.statistics().entries == 2


async def test_lru_bound_by_bytes(autojump_clock: trio.testing.MockClock) -> None:
    lru = MemoryBackend(max_entries=100, max_bytes=1000)
    for i in range(10):
        lru.put_now([(f"k{i}", b"x" * 200, 60)])
        assert lru.statistics().bytes <= 1000
    assert lru.statistics().entries == 2  # 200 + key + ~200 of bookkeeping each
    lru.put_now([("huge", b"x" * 5000, 60)])  # never fits: not stored, nothing evicted
    assert lru.get_now("huge") is None and lru.statistics().entries == 2
    lru.put_now([("k9", b"y", 60)])  # replacing an entry frees its bytes first
    assert lru.get_now("k9") == b"y"


async def test_lru_ttl(autojump_clock: trio.testing.MockClock) -> None:
    lru = MemoryBackend(max_entries=10, max_bytes=1 << 20)
    lru.put_now([("a", b"1", 5), ("b", b"2", 50)])
    await trio.sleep(5)
    assert lru.get_now("a") is None and lru.get_now("b") == b"2"
    assert lru.statistics().expired == 1 and lru.statistics().entries == 1


# --------------------------------------------------------------------------- codec


async def test_codec_round_trip(autojump_clock: trio.testing.MockClock) -> None:
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(reasoning_tokens=2))})) as s:
        response = await s.chat(MESSAGES)
    data = encode_chat(response)
    fields = decode_chat(data)
    assert fields.pop("scope") == "chat"  # the scope that answered travels with it
    back = polygate.ChatResponse(**fields, call_stats=response.call_stats)
    assert back == response
    assert back.message is back.choices[0]["message"]  # stored once
    assert data.count(b"reasoning_content") == 1


@pytest.mark.parametrize("number", [b"NaN", b"-Infinity", b"1e400"])
async def test_an_entry_holding_a_number_no_json_holds_does_not_decode(
    autojump_clock: trio.testing.MockClock, number: bytes,
) -> None:
    """Review finding (stores left by older code): an answer holding NaN, stored before
    such answers were refused, was decoded, and every hit was a 502 for the entry's
    whole life.  Such an entry is a bad entry (a miss), as any other foreign value."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        response = await s.chat(MESSAGES)
    data = encode_chat(response)
    assert b'"created":' in data
    decode_chat(data)
    spoiled = data.replace(b'"created":', b'"created":' + number + b',"was":', 1)
    with pytest.raises(ValueError):
        decode_chat(spoiled)


def test_vector_round_trip_is_exact() -> None:
    vector = [0.1, -1e-300, 3.141592653589793, 1e300, -0.0]
    data = encode_vector(vector, model="m", source="a", tokens=3, usage_source="upstream")
    assert decode_vector(data) == (vector, "m", "a", 3, "upstream")


@pytest.mark.parametrize("data", [
    b"", b"not json", b"[]", b'{"f": 1, "k": "embed"}', b'{"f": 2, "k": "chat"}',
    b'{"f": 1, "k": "chat", "raw": {}, "text": "", "usage": null, "source": "a", "model": null, "finish": null}',
    b'{"f": 1, "k": "chat", "raw": {"choices": [{"message": 5}]}, "text": "", "usage": null,'
    b' "source": "a", "model": null, "finish": null}',
    b'{"f": 1, "k": "chat", "raw": {"choices": []}, "choices": [], "message": {}, "text": "",'
    b' "usage": [1, 2], "source": "a", "model": null, "finish": null}',
    b'{"f": 1, "k": "embed", "v": "@@@", "model": null, "source": null, "tokens": null, "us": null}',
    b'{"f": 1, "k": "embed", "v": "AAAA", "model": null, "source": null, "tokens": null, "us": null}',
    b"\xff\xfe",
    # a value another program stored as text or a number (a probe found a SQLite TEXT
    # value raising AttributeError out of the call)
    '{"f": 1, "k": "chat"}',
    42,
])
def test_garbage_does_not_decode(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_chat(data)
    with pytest.raises(ValueError):
        decode_vector(data)


# --------------------------------------------------------------------------- fail open


class Flaky:
    """A write-behind backend that fails while ``down`` and records what it saw."""

    name = "flaky"
    write_behind = True

    def __init__(self) -> None:
        self.down = False
        self.slow = 0.0
        self.data: dict[str, bytes] = {}
        self.reads = 0
        self.batches: list[int] = []

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.reads += 1
        await trio.sleep(self.slow)
        if self.down:
            raise CacheBackendError("flaky is down")
        return [self.data.get(k) for k in keys]

    async def set_many(self, entries: Sequence[Entry]) -> None:
        await trio.sleep(self.slow)
        if self.down:
            raise CacheBackendError("flaky is down")
        self.batches.append(len(entries))
        for key, value, _ in entries:
            self.data[key] = value


async def test_failed_lookups_are_misses_and_pause_the_backend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Flaky()
    backend.data["k"] = b"v"
    cache = Cache(backend)
    backend.down = True
    assert await cache.get("k") is None
    assert cache.errors == 1 and backend.reads == 1
    assert await cache.get("k") is None  # paused: not even asked
    assert backend.reads == 1
    backend.down = False
    await trio.sleep(0.25)
    assert await cache.get("k") == b"v"
    assert cache.errors == 1 and backend.reads == 2


async def test_a_paused_backend_serves_nothing_written_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A review found a cache on a dead Redis answering a call as a hit: the answer of
    the call before was still waiting to be written behind, and was served from there
    -- or not, by the writer's timing.  A cache that fails is a miss, every time: while
    the backend is paused nothing is served from, or put into, the write-behind."""
    backend = Flaky()
    cache = Cache(backend)
    backend.down = True
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        assert await cache.get("k") is None  # the lookup fails: paused
        cache.put("k", b"v", 60)  # the call's answer, during the pause
        assert cache.get_local("k") is None
        assert await cache.get("k") is None
        assert await cache.get_many(["k", "j"]) == [None, None]
        assert cache.writes_dropped == 1 and cache._pending == {}
        # Written behind while the backend was up, then it failed: not served either.
        await trio.sleep(0.25)
        backend.down = False
        cache.put("j", b"w", 60)
        backend.down = True
        assert await cache.get("x") is None  # fails: paused again
        assert cache.get_local("j") is None
        assert await cache.get_many(["j"]) == [None]
        await cache.aclose()
        nursery.cancel_scope.cancel()
    assert backend.batches == []


async def test_pauses_grow_and_reset(autojump_clock: trio.testing.MockClock) -> None:
    backend = Flaky()
    cache = Cache(backend)
    backend.down = True
    pauses = []
    for _ in range(10):
        start = trio.current_time()
        reads = backend.reads
        while backend.reads == reads:
            await cache.get("k")
            await trio.sleep(0.01)
        pauses.append(round(trio.current_time() - start, 2))
    assert pauses[0] == 0.01 and pauses[1] >= 0.25 and pauses[-1] <= 30.01
    assert pauses[2] > pauses[1] and max(pauses) == pytest.approx(30.0, abs=0.02)
    backend.down = False
    await trio.sleep(30)
    assert await cache.get("k") is None and cache._pause == 0


async def test_lookups_failing_together_pause_the_backend_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A probe found one short stall (8 lookups in flight, all timing out together)
    doubling the pause 8 times, to the 30 s cap: the cache stayed off long after the
    backend answered again.  A failure that ends during the pause lengthens nothing."""
    backend = Flaky()
    backend.slow = 0.2
    cache = Cache(backend)
    backend.down = True
    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(cache.get, f"k{i}")
    assert cache.errors == 8 and cache._pause == 0.25
    backend.down, backend.slow = False, 0.0
    backend.data["k"] = b"v"
    await trio.sleep(0.25)
    assert await cache.get("k") == b"v"


async def test_writes_go_behind_and_are_served_meanwhile(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Flaky()
    backend.slow = 1.0
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        for i in range(300):
            cache.put(f"k{i}", b"v%d" % i, 60)
        assert await cache.get("k7") == b"v7"  # pending, not yet written
        assert backend.reads == 0
        await trio.sleep(0.5)
        assert backend.batches == []  # the first batch is still being written
        await cache.aclose()
        nursery.cancel_scope.cancel()
    assert backend.batches == [256, 44]
    assert cache.writes == 300 and cache._pending == {}
    assert backend.data["k299"] == b"v299"


@pytest.mark.parametrize("many", [False, True])
async def test_an_answer_waiting_to_be_written_is_served_at_a_schedule_point(
    autojump_clock: trio.testing.MockClock, many: bool
) -> None:
    """Served from ``pending`` (no I/O), a lookup is still a checkpoint: a loop of such
    hits let nothing else run (not even the writer, so the entries stayed pending
    for good), and a cancelled caller was served."""
    backend = Flaky()
    backend.slow = 1.0
    cache = Cache(backend)
    cache.put("k", b"v", 60)

    async def lookup() -> bytes | None:
        return (await cache.get_many(["k"]))[0] if many else await cache.get("k")

    with trio.testing.assert_checkpoints():  # a schedule point and a cancel point
        assert await lookup() == b"v"
    with trio.CancelScope() as scope:
        scope.cancel()
        await lookup()
        raise AssertionError("a cancelled lookup answered")  # pragma: no cover
    assert scope.cancelled_caught
    assert backend.reads == 0


async def test_a_full_queue_drops_writes(autojump_clock: trio.testing.MockClock) -> None:
    cache = Cache(Flaky())  # no writer started: nothing drains the queue
    for i in range(5000):
        cache.put(f"k{i}", b"v", 60)
    assert cache.writes_dropped == 5000 - 4096
    assert await cache.get("k4095") == b"v" and await cache.get("k4096") is None


async def test_writes_given_up_at_close_are_counted(autojump_clock: trio.testing.MockClock) -> None:
    """The flush at close has 5 s: the batch being written when they run out and the
    entries still queued are given up, and counted (writes_dropped) by the time
    aclose returns — every entry is either written or dropped."""
    backend = Flaky()
    backend.slow = 3.0
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        for i in range(1000):
            cache.put(f"k{i}", b"v", 60)
        start = trio.current_time()
        await cache.aclose()
        assert trio.current_time() - start == pytest.approx(5.0)
        assert (cache.writes, cache.writes_dropped) == (256, 744)
        nursery.cancel_scope.cancel()
    assert (cache.writes, cache.writes_dropped) == (256, 744)
    assert backend.batches == [256] and cache._pending == {}


async def test_writes_given_up_at_close_are_counted_on_the_real_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from polygate.cache import _cache

    monkeypatch.setattr(_cache, "_FLUSH_S", 0.2)
    backend = Flaky()
    backend.slow = 2.0
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        for i in range(300):
            cache.put(f"k{i}", b"v", 60)
        with trio.fail_after(1.5):
            await cache.aclose()
        nursery.cancel_scope.cancel()
    assert (cache.writes, cache.writes_dropped) == (0, 300)


async def test_failed_writes_are_counted_and_dropped(autojump_clock: trio.testing.MockClock) -> None:
    backend = Flaky()
    backend.down = True
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        cache.put("a", b"1", 60)
        await trio.sleep(0.01)
        cache.put("b", b"2", 60)  # the backend is paused: dropped without asking it
        await cache.aclose()
        nursery.cancel_scope.cancel()
    assert cache.errors == 1 and cache.writes_dropped == 2 and cache.writes == 0
    assert cache._pending == {}


async def test_a_failing_cache_never_fails_a_call(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="fine"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)}, cache="memory")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        backend = Flaky()
        backend.down = True
        s._cache = Cache(backend)
        async with trio.open_nursery() as nursery:
            s._cache.start(nursery)
            for i in range(3):
                r = await s.chat([{"role": "user", "content": f"question {i}"}])
                assert r.text == "fine" and not r.call_stats.cached
            embedded = await s.embed(["x"], scope="chat")
            assert len(embedded.vectors) == 1
            await s._cache.aclose()
            nursery.cancel_scope.cancel()
        stats = (await s.statistics()).cache
    assert stats.misses == 4 and stats.errors >= 1 and stats.hits == 0
    assert len(up.requests) == 4


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_a_slow_lookup_never_uses_up_the_deadline(
    autojump_clock: trio.testing.MockClock, kind: str
) -> None:
    """A backend slower than what a short deadline leaves (its own timeout is longer)
    is a miss after a tenth of the deadline, not a DeadlineExceeded; it is counted,
    and pauses nothing (the next call asks the backend again)."""
    up = FakeUpstream(Reply(text="fine"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)}, cache="memory")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        backend = Flaky()
        backend.slow = 3600.0  # answers long after any deadline here
        s._cache = Cache(backend)
        async with trio.open_nursery() as nursery:
            s._cache.start(nursery)
            for i in range(2):
                started = trio.current_time()
                if kind == "chat":
                    r: Any = await s.chat([{"role": "user", "content": f"q{i}"}], call_deadline_s=2.0)
                    assert r.text == "fine" and not r.call_stats.cached
                else:
                    r = await s.embed([f"q{i}", "x"], scope="chat", call_deadline_s=2.0)
                    assert len(r.vectors) == 2
                assert trio.current_time() - started == pytest.approx(0.2)
            nursery.cancel_scope.cancel()
        stats = (await s.statistics()).cache
    assert backend.reads == 2  # the second call was not kept from the backend
    # Two lookups cut short, and the write still going at the close (the first call's
    # answer: 3600 s), given up at the writer's bound: a failed write, counted.
    assert stats.errors == 3 and stats.misses >= 2
    assert len(up.requests) == 2
    if kind == "embed":
        # "x", answered by the first call, is still held here (its write to the slow
        # backend pending): the second call's miss is looked at again before it leads
        # (as chat's is), so only "q1" goes upstream.
        assert stats.hits == 1 and up.requests[1].body["input"] == ["q1"]
    else:
        assert stats.hits == 0


async def test_an_undecodable_embedding_is_one_miss_and_one_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: embed looked at a damaged entry twice (the lookup, then the memory
    backend's local look before its claim) and counted two errors for it."""
    up = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)}, cache="memory")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        first = await s.embed(["q"], scope="embed")
        memory: MemoryBackend = s._cache.backend  # type: ignore[union-attr]
        key = next(iter(memory._data))
        memory.put_now([(key, b"garbage", 60)])
        again = await s.embed(["q"], scope="embed")
        stats = (await s.statistics()).cache
    assert again.vectors == first.vectors and not again.call_stats.cached
    assert (stats.misses, stats.errors) == (2, 1), stats


async def test_an_undecodable_entry_is_a_miss(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="fresh"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)}, cache="memory")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
        cache: Any = s._cache
        memory: MemoryBackend = cache.backend
        key = next(iter(memory._data))
        memory.put_now([(key, b"garbage", 60)])
        r = await s.chat(MESSAGES)
        stats = (await s.statistics()).cache
    assert r.text == "fresh" and not r.call_stats.cached
    assert stats.errors == 1 and stats.misses == 2


def test_the_keys_digests_are_pinned() -> None:
    """The keys a cache file or a Redis prefix keeps across upgrades.  Outside review
    (upgrading over old state): the fallback chain's models joined a scope's keys
    without a new ``KEY_VERSION``, so an entry written before, under the key a scope
    without a fallback still had, was served as that scope's own answer after its
    fallback was removed.  If this test fails, the keys' form changed: bump
    ``KEY_VERSION`` (and say so in docs/cache.md), then update the digests here."""
    from polygate.cache import chat_key, embed_keys
    from polygate.cache._key import KEY_VERSION

    hi = [{"role": "user", "content": "hi"}]
    assert KEY_VERSION == 8
    assert chat_key("chat", ["m1"], hi, {"temperature": 0}) == (
        "0d1720d57e3b91b0808e1d1217a2cf0666d9f943153e4daa8e5fb33f13bed725")
    assert chat_key("chat", ["m1", "fallback large: m2"], hi, {"temperature": 0}) == (
        "dceed99a7ba727204c8def9615d7ea8e7c58455ea8c0cbb75e6e9af36155fc44")
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    params = {"max_tokens": 100.0, "logit_bias": {1.0: 5}, "user": "u"}
    schema = {"name": "City", "schema": {"type": "object"}}
    assert chat_key("chat", ["m1"], parts, params, schema=schema) == (
        "4699496f93e8e4889cb99e8257b71e803522d1380aad280cf64dca42410ca28d")
    assert embed_keys("embed", ["e"], ["a", "b"], {"dimensions": 8}) == [
        "72cddbbc23f3b59d907888fc0697299ea1f5a356035a686f40c80e9eb7726197",
        "67c86ac9f46d491378250e960631c5cb2a7967ecba50936671b59947172ad1e9",
    ]


async def test_an_answer_stored_under_version_6_is_a_miss(
    autojump_clock: trio.testing.MockClock, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside review (upgrading over old stores): version 6 stored answers that this
    version refuses (a ``"network_error"`` finish, cut at a ``""`` finish or a proxy's
    early ``"stop"``), and an upgrade over the same cache file served them as hits.
    What an older version stored under 6 is now a miss, asked again."""
    from polygate.cache import _key

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=600)},
        cache=f"sqlite:///{tmp_path}/cache.db")
    with monkeypatch.context() as older:
        older.setattr(_key, "KEY_VERSION", 6)
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(
                text="The capital of France is"))})) as s:
            await s.chat(MESSAGES)
    up = FakeUpstream(Reply(text="The capital of France is Paris."))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES)
    assert r.text == "The capital of France is Paris." and not r.call_stats.cached
    assert len(up.requests) == 1


async def test_written_since_names_the_keys_written_and_errs_safe_past_those_it_keeps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lookup reads again when its key was written during its read (see
    ``Cache.written_since``); past the keys it keeps by name, it says yes."""
    from polygate.cache import _cache

    cache = Cache(Flaky())
    seen = cache.generation
    assert not cache.written_since("a", seen)
    await cache._write([("a", (b"1", trio.current_time() + 60))])
    assert cache.written_since("a", seen) and not cache.written_since("b", seen)
    assert not cache.written_since("a", cache.generation)
    later = cache.generation
    await cache._write([("b", (b"2", trio.current_time() + 60))])
    many = [(f"k{i}", (b"v", trio.current_time() + 60)) for i in range(_cache._WRITTEN_KEYS)]
    await cache._write(many)  # ("a" and "b" forgotten: "b" was written since later)
    assert cache.written_since("k0", later) and cache.written_since("b", later)
    assert cache.written_since("a", later)  # (not known any more: yes, to be safe)
    assert not cache.written_since("a", cache.generation)


class WritesFail(Flaky):
    """Reads answer, writes fail (a full Redis under noeviction, a SQLite file another
    connection holds locked); or, with ``stall``, a write that never ends."""

    def __init__(self, stall: bool = False) -> None:
        super().__init__()
        self.stall = stall
        self.failing = True

    async def set_many(self, entries: Sequence[Entry]) -> None:
        if self.stall:
            await trio.sleep_forever()
        if self.failing:
            raise CacheBackendError("OOM command not allowed")
        await super().set_many(entries)


async def test_writes_failing_while_reads_answer_log_once_a_period(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """Outside review (logs): each lookup's answer said "the cache answers again", and
    the next write's failure was a new outage logged at once: two lines a call, some
    29,000 an hour under steady traffic, and the "answers again" ones untrue."""
    import logging

    caplog.set_level(logging.INFO, logger="polygate.cache")
    backend = WritesFail()
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        for i in range(120):  # a call every 0.5 s for a minute: a lookup, then a write
            await cache.get(f"k{i}")
            cache.put(f"k{i}", b"v", 60.0)
            await trio.sleep(0.5)
        lines = [r.getMessage() for r in caplog.records if r.name == "polygate.cache"]
        assert not any("answers again" in line for line in lines), lines
        assert 1 <= len(lines) <= 7, lines  # (the first, then at most one every 10 s)
        backend.failing = False  # the writes answer again: that is said, once
        cache.put("last", b"v", 60.0)
        await trio.sleep(1.0)
        assert [r.getMessage() for r in caplog.records][-1].startswith("the cache answers again")
        await cache.aclose()
        nursery.cancel_scope.cancel()


async def test_a_write_given_up_at_its_bound_is_a_failure_counted_and_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """Outside review (workers): a write past the writer's bound was dropped with no
    error counted and nothing logged ("every failed operation is counted and logged")."""
    import logging

    caplog.set_level(logging.WARNING, logger="polygate.cache")
    cache = Cache(WritesFail(stall=True))
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        cache.put("k", b"v", 60.0)
        await trio.sleep(30.0)
        stats = cache.statistics()
        assert (stats.errors, stats.writes, stats.writes_dropped) == (1, 0, 1), stats
        assert any("took longer than" in r.getMessage() for r in caplog.records), caplog.records
        nursery.cancel_scope.cancel()


class SlowReads(Flaky):
    """Reads that take an hour; writes at once."""

    def __init__(self) -> None:
        super().__init__()
        self.slow_reads = 3600.0

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.reads += 1
        await trio.sleep(self.slow_reads)
        return [self.data.get(k) for k in keys]


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_a_calls_reads_share_one_share_of_its_deadline(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    """Review of the re-read (see Cache.written_since): a lookup cut at its share of the
    deadline, an identical call's answer written meanwhile, read again with a second
    share: one lookup took ~19 % of the deadline and counted two errors."""
    up = FakeUpstream(Reply(text="fine"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)}, cache="memory")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        backend = SlowReads()
        s._cache = Cache(backend)
        took: dict[str, float] = {}
        async with trio.open_nursery() as nursery:
            s._cache.start(nursery)

            async def one(name: str, delay: float) -> None:
                await trio.sleep(delay)
                started = trio.current_time()
                if kind == "chat":
                    await s.chat([{"role": "user", "content": "same"}], call_deadline_s=10.0)
                else:
                    await s.embed(["same"], scope="chat", call_deadline_s=10.0)
                took[name] = trio.current_time() - started

            async with trio.open_nursery() as calls:
                calls.start_soon(one, "a", 0.0)
                calls.start_soon(one, "b", 0.05)
            errors = s._cache.errors
            nursery.cancel_scope.cancel()
    assert took["b"] == pytest.approx(1.0, abs=0.01), (took, backend.reads)
    assert errors == 2 and backend.reads == 2, (errors, backend.reads)  # one cut each


async def test_an_outage_of_both_kinds_ends_at_any_answer(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """Review of the kind-aware log: the whole backend down, a write's failure logged
    first and a lookup's within its 10 s; back, with only hits to serve (nothing to
    write), the log's last word stayed "fails open": the outage was taken for one of
    writes alone."""
    import logging

    caplog.set_level(logging.INFO, logger="polygate.cache")
    backend = Flaky()
    backend.data["hot"] = b"v"
    cache = Cache(backend)
    async with trio.open_nursery() as nursery:
        cache.start(nursery)
        backend.down = True
        cache.put("k0", b"v", 60.0)  # (written at once: the first failure, logged)
        await trio.sleep(1.0)
        assert await cache.get("hot") is None  # (the second, within 10 s)
        assert cache.statistics().errors == 2
        await trio.sleep(1.0)
        backend.down = False
        for _ in range(5):
            assert await cache.get("hot") == b"v"
            await trio.sleep(1.0)
        lines = [r.getMessage() for r in caplog.records if r.name == "polygate.cache"]
        assert lines[-1].startswith("the cache answers again"), lines
        await cache.aclose()
        nursery.cancel_scope.cancel()


#: Bodies whose reading changed under a key version (a reasoning part beside an annotated
#: text part; choices listed out of order; a value no JSON may hold), beside every
#: recorded provider answer.
_READ_BODIES: dict[str, bytes] = {
    "parts.json": json.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "m1",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": [
            {"type": "reasoning", "text": "thought"},
            {"type": "text", "text": "Answer", "annotations": [{"type": "url_citation"}]}]}}]}).encode(),
    "indexes.json": json.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "m1",
        "choices": [{"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": t}}
                    for i, t in ((1, "one-a"), (0, "zero"), (1, "one-b"))]}).encode(),
    "nan.json": b'{"id": "c1", "object": "chat.completion", "created": 1, "model": "m1", "choices": '
                b'[{"index": 0, "finish_reason": "stop", "logprobs": {"content": [{"token": "a", '
                b'"logprob": NaN}]}, "message": {"role": "assistant", "content": "a"}}]}',
}


async def test_what_an_answer_reads_as_is_pinned_with_the_key_version(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review finding (stores left by older code): three commits changed what a stored
    answer holds (a whole answer's parts and choice order) or whether it is stored at
    all (one holding NaN) without a new ``KEY_VERSION``, and the entries an older
    version wrote were served after an upgrade: a reasoning part's text inside the
    answer, the upstream's choice 1 as the answer, a 502 for the entry's whole life.
    What each recorded answer reads as, and whether it is stored, is pinned here beside
    the version.  If this test fails, that changed: bump ``KEY_VERSION`` (and say so in
    docs/cache.md), then update the digest."""
    import hashlib
    import json as json_

    import httpx

    from polygate.cache._key import KEY_VERSION

    from .conftest import TRANSCRIPTS

    bodies = {p.name: p.read_bytes() for p in sorted(TRANSCRIPTS.iterdir())
              if p.suffix in (".sse", ".json") and "embeddings" not in p.name and "error" not in p.name}
    bodies |= _READ_BODIES
    digest = hashlib.sha256()
    for name, data in bodies.items():
        ctype = "text/event-stream" if name.endswith(".sse") else "application/json"
        transport = httpx.MockTransport(
            lambda request, data=data, ctype=ctype: httpx.Response(  # type: ignore[misc]
                200, headers={"content-type": ctype}, content=data))
        settings = polygate.Settings(cache="memory", scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", model="m1",
                                     streaming=name.endswith(".sse"))], cache_ttl_s=60)})
        async with polygate.session(settings, transport=transport) as s:
            try:
                first = await s.chat(MESSAGES)
            except polygate.PolygateError as exc:
                digest.update(f"{name} {type(exc).__name__}\n".encode())
                continue
            again = await s.chat(MESSAGES)
        seen = [first.text, first.message, first.choices, first.finish_reason, again.call_stats.cached]
        digest.update(f"{name} {json_.dumps(seen, sort_keys=True, default=repr)}\n".encode())
    assert (KEY_VERSION, digest.hexdigest()) == (
        8, "fb2229c9e7303784389144923ff1fed996d64db15b2bc39c8dfdffdd29002f60")
