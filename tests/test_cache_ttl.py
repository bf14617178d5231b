"""An answer lives ``cache_ttl_s`` from the moment it came, on every backend.

The write-behind backends (SQLite, Redis) store an answer a little after it came: the
writer rests between batches, and a store held up (a SQLite lock, a slow Redis) holds
the write up further, within its ``timeout_s``.  Each entry is stored for what is left
of its time, so a delayed write neither extends nor revives an answer.  Memory is
here for comparison: it stores at once."""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router
from tests import _redis_server
from tests._redis_server import RedisServer, command

redis_server = _redis_server.redis_server  # the fixture

BACKENDS = ["memory", "sqlite", "redis"]


class Where:
    """One backend for one test: its cache URL, and a way to peek into the store."""

    def __init__(self, kind: str, url: str, *, path: Path | None = None,
                 server: RedisServer | None = None, prefix: str | None = None) -> None:
        self.kind, self.url, self.path, self.server, self.prefix = kind, url, path, server, prefix

    def settings(self, ttl: float, *, url: str | None = None) -> polygate.Settings:
        source = polygate.Source(name="a", base_url="http://a/v1")
        return polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=ttl)}, cache=url or self.url
        )

    def stored(self) -> int:
        """Entries in the backing store (SQLite rows / Redis keys)."""
        if self.kind == "sqlite":
            assert self.path is not None
            conn = sqlite3.connect(self.path)
            try:
                return int(conn.execute("SELECT count(*) FROM polygate_cache").fetchone()[0])
            finally:
                conn.close()
        assert self.server is not None
        reply = command(self.server.port, "EVAL",
                        f"return #redis.call('KEYS', '{self.prefix}:*')", "0")
        return int(reply[1:])


@pytest.fixture(params=BACKENDS)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    kind = request.param
    if kind == "memory":
        return Where(kind, "memory")
    if kind == "sqlite":
        path = tmp_path / "c.db"
        return Where(kind, f"sqlite://{path}?timeout_s=5", path=path)
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"t{secrets.token_hex(4)}"
    return Where(kind, f"{server.url}?prefix={prefix}&timeout_s=5", server=server, prefix=prefix)


def _q(tag: str = "") -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {tag} {secrets.token_hex(4)}"}]


def _texts(*texts: str) -> FakeUpstream:
    return FakeUpstream([Reply(text=t) for t in texts])


def _counts(st: Any) -> tuple[int, int, int, int]:
    return (st.hits, st.misses, st.coalesced, st.errors)


# --------------------------------------------------------------------------- TTL

async def test_an_answer_whose_write_was_delayed_is_not_served_past_its_ttl(where: Where) -> None:
    """An answer must not be served once it is older than ``cache_ttl_s`` (docs/cache.md:
    "how long an answer of this scope stays stored").  On the write-behind backends the
    TTL starts when the writer stores the batch, not when the answer came: a write
    delayed by a lock (SQLite, within timeout_s) or a slow Redis (within timeout_s)
    resurrects an answer that had already expired in the write-behind queue.
    Real clock: the delay is made by holding the store, never by a race."""
    ttl = 1.0
    up = _texts("x-answer", "q-answer", "q-again")
    x, q = _q("x"), _q("q")
    blocker: sqlite3.Connection | None = None
    async with polygate.session(where.settings(ttl), transport=Router({"a": up})) as s:
        await s.chat(_q("warm"))  # opens the file / the connection
        cache: Any = s._cache
        while cache._pending:  # noqa: ASYNC110 - the warm-up's write has landed
            await trio.sleep(0.01)
        if where.kind == "sqlite":
            blocker = sqlite3.connect(where.path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")  # the writer waits (busy_timeout 5 s)
        elif where.kind == "redis":
            assert where.server is not None
            assert command(where.server.port, "CLIENT", "PAUSE", "2500", "WRITE") == b"+OK"
        # "refresh": no lookups while the store is held (a Redis lookup could queue
        # behind the paused SET on a shared connection)
        await s.chat(x, cache="refresh")  # its batch is taken first and waits for the store
        with trio.fail_after(5):
            while True:  # until the writer has taken x's batch and waits on the store
                await trio.testing.wait_all_tasks_blocked(0.01)
                if cache._recv.statistics().current_buffer_used == 0:
                    break
                await trio.sleep(0.005)  # it rests between batches: not taken yet
        asked = time.monotonic()
        await s.chat(q, cache="refresh")  # answered now, its write queued behind x's
        await trio.sleep(ttl + 0.5)  # q's answer is now older than its TTL
        if blocker is not None:
            blocker.execute("ROLLBACK")
            blocker.close()
        with trio.fail_after(10):
            while cache._pending:  # noqa: ASYNC110 - until the delayed writes landed
                await trio.sleep(0.01)
        age = time.monotonic() - asked
        again = await s.chat(q)
        stats = (await s.statistics()).cache
    assert age > ttl
    assert not again.call_stats.cached, (
        f"{where.kind}: an answer {age:.2f} s old served with cache_ttl_s={ttl}"
    )
    assert again.text == "q-again" and stats.errors == 0


@pytest.mark.parametrize("where", ["memory", "sqlite"], indirect=True)
async def test_the_ttl_counts_from_the_answer_under_mockclock(
    where: Where, autojump_clock: Any
) -> None:
    """Virtual time (docs: memory and SQLite expiry follow trio's MockClock).  An answer
    put while the writer rests between batches (20 ms) is written up to 20 ms later; on
    SQLite its TTL counts from then, so 5 ms past its TTL it is still a hit, where the
    memory cache has dropped it.  (Redis keeps real time: not driven by MockClock.)"""
    ttl = 10.0
    up = _texts("x", "q", "q-again")
    x, q = _q("x"), _q("q")
    async with polygate.session(where.settings(ttl), transport=Router({"a": up})) as s:
        await s.chat(x)  # the writer takes this batch at once, then rests 20 ms
        await s.chat(q)  # put during the rest
        put_at = trio.current_time()
        await trio.sleep_until(put_at + ttl + 0.005)
        again = await s.chat(q)
    assert not again.call_stats.cached, f"{where.kind}: hit 5 ms past the answer's TTL"
