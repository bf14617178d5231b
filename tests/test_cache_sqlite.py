"""The SQLite cache on real files, with the real clock: persistence across sessions,
private files, WAL, TTL eviction, fail-open on a locked file, telemetry rows and the
hit rate in ``polygate stats``."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

import polygate
from polygate.cache._backend import CacheBackendError
from polygate.cache._sqlite import SQLiteBackend
from polygate.cli import main
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES

pytestmark = pytest.mark.integration


def _settings(url: str, **top: Any) -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1")
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=3600)}, cache=url, **top
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_answers_outlive_the_session(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/state/cache.db"
    up = FakeUpstream(Reply(text="kept"))
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        first = await s.chat(MESSAGES)
        again = await s.chat(MESSAGES)  # served while its write may still be queued
        assert again.call_stats.cached
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        later = await s.chat(MESSAGES)
        embedded = await s.embed(["one", "two"], scope="chat")
        stats = (await s.statistics()).cache
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        embedded_again = await s.embed(["two", "one"], scope="chat")
    assert later.call_stats.cached and later.text == first.text == "kept"
    assert later.message == first.message and later.usage == first.usage
    assert stats.backend == "sqlite" and stats.hits == 1 and stats.errors == 0
    assert embedded_again.call_stats.cached
    assert embedded_again.vectors == embedded.vectors[::-1]
    assert len(up.requests) == 2


async def test_files_are_private_and_in_wal_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = tmp_path / "new" / "deeper" / "cache.db"
        async with polygate.session(_settings(f"sqlite://{path}"),
                                    transport=Router({"a": FakeUpstream()})) as s:
            await s.chat(MESSAGES)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "new") == 0o700 and _mode(tmp_path / "new" / "deeper") == 0o700
    assert _mode(path) == 0o600
    for extra in path.parent.iterdir():  # -wal / -shm, when they are left
        assert _mode(extra) == 0o600, extra
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT count(*) FROM polygate_cache").fetchone()[0] == 1
    conn.close()


async def test_ttl_and_eviction(tmp_path: Path) -> None:
    now = [1000.0]
    backend = SQLiteBackend(tmp_path / "c.db", timeout_s=1.0, clock=lambda: now[0])
    await backend.start()
    try:
        await backend.set_many([("short", b"s", 10.0), ("long", b"l", 1000.0)])
        assert await backend.get_many(["short", "long", "none"]) == [b"s", b"l", None]
        now[0] += 10.0
        assert await backend.get_many(["short"]) == [None]  # expired: never returned
        assert await backend.get_many(["long"]) == [b"l"]
        now[0] += 60.0  # the next write also deletes what has expired
        await backend.set_many([("other", b"o", 1000.0)])
    finally:
        await backend.aclose()
    assert _stored_keys(tmp_path / "c.db") == {"long", "other"}


def _stored_keys(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        keys = {k for (k,) in conn.execute("SELECT key FROM polygate_cache")}
    conn.close()
    return keys


async def test_eviction_goes_on_after_the_wall_clock_steps_back(tmp_path: Path) -> None:
    """Outside review (clocks): the minute between evictions was measured on the wall
    clock, so after it stepped back an hour (an NTP step, a VM restored) no write deleted
    expired answers, as sensitive as the prompts, for an hour and a minute."""
    now = [1_000_000_000.0]
    backend = SQLiteBackend(tmp_path / "c.db", timeout_s=1.0, clock=lambda: now[0])
    await backend.start()
    try:
        await backend.set_many([("before", b"b", 1e6)])  # the first write evicts
        now[0] -= 3600.0  # the wall clock steps back an hour
        await backend.set_many([("short", b"s", 10.0)])
        now[0] += 120.0  # two minutes later: "short" expired
        assert await backend.get_many(["short"]) == [None]
        await backend.set_many([("other", b"o", 1000.0)])
    finally:
        await backend.aclose()
    assert _stored_keys(tmp_path / "c.db") == {"before", "other"}


async def test_many_concurrent_readers(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "c.db", timeout_s=2.0)
    await backend.start()
    try:
        await backend.set_many([(f"k{i}", b"%d" % i, 60.0) for i in range(50)])
        results: dict[int, list[bytes | None]] = {}

        async def read(i: int) -> None:
            results[i] = await backend.get_many([f"k{i}", f"k{(i + 1) % 50}"])

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(read, i)
    finally:
        await backend.aclose()
    assert all(results[i] == [b"%d" % i, b"%d" % ((i + 1) % 50)] for i in range(50))


async def test_cancelled_reads_return_their_connection(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "c.db", timeout_s=2.0)
    await backend.start()
    try:
        for _ in range(20):
            with trio.move_on_after(0):
                await backend.get_many(["x"])
        assert await backend.get_many(["x"]) == [None]
    finally:
        await backend.aclose()
    assert len(backend._readers) == 0  # all closed


async def test_a_locked_file_fails_open(tmp_path: Path) -> None:
    """Another process holds a write transaction past the cache's timeout: the answer
    cannot be stored, the failure is counted, and no call notices."""
    path = tmp_path / "c.db"
    url = f"sqlite://{path}?timeout_s=0.1"
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            blocker.execute("INSERT INTO polygate_cache VALUES ('x', x'00', 0)")
            with trio.fail_after(5):
                r = await s.chat(MESSAGES)
                assert r.text == "answer" and not r.call_stats.cached
                while (await s.statistics()).cache.errors == 0:  # noqa: ASYNC110 - a counter: no event
                    await trio.sleep(0.01)  # the writer gives up after 0.1 s
                # the write is dropped; the backend is paused: the next call is a miss
                again = await s.chat(MESSAGES)
                assert again.text == "answer" and not again.call_stats.cached
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        stats = (await s.statistics()).cache
    assert stats.errors >= 1 and stats.misses == 2 and stats.hits == 0
    assert stats.writes_dropped >= 1
    assert len(up.requests) == 2


async def test_a_file_locked_when_the_session_opens_does_not_hold_it(tmp_path: Path) -> None:
    """A probe opened a session while another process held a write transaction on a
    cache file that already had its schema: the open waited 5 s (not timeout_s) and
    then refused the file with a ConfigError.  It opens at once; the locked file then
    fails open as documented."""
    path = tmp_path / "c.db"
    url = f"sqlite://{path}?timeout_s=0.1"
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(url), transport=Router({"a": up})):
        pass  # the file and its schema
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with trio.fail_after(5):
            async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
                opened_in = time.monotonic() - started
                r = await s.chat(MESSAGES)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert opened_in < 1.0 and r.text == "answer"


class _Held:
    """Another process's exclusive hold on a cache file (``locking_mode = EXCLUSIVE``,
    in a transaction) until :meth:`release` or the end of the ``with`` block."""

    def __init__(self, path: Path) -> None:
        self._conn: sqlite3.Connection | None = sqlite3.connect(path, isolation_level=None)
        self._conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        self._conn.execute("BEGIN EXCLUSIVE")

    def release(self) -> None:
        if self._conn is not None:
            self._conn.execute("ROLLBACK")
            self._conn.close()
            self._conn = None

    def __enter__(self) -> _Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


async def test_a_file_locked_exclusively_when_the_session_opens_fails_open(tmp_path: Path) -> None:
    """Review: another process holding the file exclusively (``locking_mode =
    EXCLUSIVE``) made the session wait 5 s and refuse to open (a ConfigError): every
    call failed, where SPEC §8.3 has a file locked past its timeout be a miss.  The
    session opens within the timeout, its calls go upstream, and once the lock is
    gone the first write opens the file and stores."""
    path = tmp_path / "c.db"
    url = f"sqlite://{path}?timeout_s=0.05"
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(url), transport=Router({"a": up})):
        pass  # the file and its schema
    started = time.monotonic()
    with _Held(path) as held, trio.fail_after(5):
        async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
            opened_in = time.monotonic() - started
            r = await s.chat(MESSAGES)
            held.release()
            await trio.sleep(0.5)  # real time: past the pause the lock's failure began
            stored = await s.chat([{"role": "user", "content": "after the lock"}])
        async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
            hit = await s.chat([{"role": "user", "content": "after the lock"}])
    assert opened_in < 1.0 and r.text == "answer" and not r.call_stats.cached
    assert stored.text == "answer" and hit.call_stats.cached


async def test_an_empty_file_locked_at_the_start_is_opened_by_the_first_look_after_the_lock(
    tmp_path: Path,
) -> None:
    """Review: a file with no schema yet, locked exclusively as the session opened:
    every lookup then failed ("no such table"), pausing the cache, and a write during
    a pause is dropped: it was never written.  The first lookup after the lock opens
    the file (its schema made), and the answer is stored."""
    path = tmp_path / "c.db"
    url = f"sqlite://{path}?timeout_s=0.05"
    up = FakeUpstream(Reply(text="answer"))
    with _Held(path) as held, trio.fail_after(10):
        async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
            await s.chat(MESSAGES)  # a miss: the file is locked
            held.release()
            await trio.sleep(0.5)  # real time: past the pause the failure began
            await s.chat([{"role": "user", "content": "after the lock"}])
        async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
            hit = await s.chat([{"role": "user", "content": "after the lock"}])
    assert hit.call_stats.cached


async def test_a_newer_file_locked_at_the_start_is_never_read(tmp_path: Path) -> None:
    """Review: a file a newer polygate wrote is refused when the session opens; locked
    then, it failed open, and once the lock was gone lookups read it (a hit served
    from another format's rows): its format was checked by a write only."""
    path = tmp_path / "c.db"
    url = f"sqlite://{path}?timeout_s=0.05"
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA user_version = 2")
    conn.close()
    with _Held(path) as held, trio.fail_after(10):
        async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
            held.release()
            first = await s.chat(MESSAGES)
            await trio.sleep(0.5)  # real time: past the pause
            again = await s.chat(MESSAGES)
            stats = (await s.statistics()).cache
    assert not first.call_stats.cached and not again.call_stats.cached
    assert stats.hits == 0 and stats.errors >= 1


async def test_lookups_on_a_file_locked_at_the_start_each_wait_at_most_timeout_s(tmp_path: Path) -> None:
    """Review: every lookup on a file locked at the start took the write lock to open
    it, so lookups in flight together waited one after another (the k-th, k times
    timeout_s).  One opens; the others are misses at once."""
    path = tmp_path / "c.db"
    backend = SQLiteBackend(path, timeout_s=0.25)
    await backend.start()
    await backend.aclose()
    took: list[float] = []
    backend = SQLiteBackend(path, timeout_s=0.25)
    with _Held(path):
        await backend.start()

        async def one(i: int) -> None:
            started = time.monotonic()
            with contextlib.suppress(CacheBackendError):
                await backend.get_many([f"k{i}"])
            took.append(time.monotonic() - started)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
    await backend.aclose()
    assert max(took) < 0.9, sorted(round(t, 2) for t in took)  # (six one after another: 1.5 s)


async def test_a_file_deleted_while_locked_at_the_start_is_made_again_private(tmp_path: Path) -> None:
    """Review: the late opening of a file locked at the start, deleted meanwhile,
    made it again with the umask's mode (0644), where a cache file is 0600."""
    path = tmp_path / "c.db"
    url = f"sqlite://{path}?timeout_s=0.05"
    up = FakeUpstream(Reply(text="answer"))
    old = os.umask(0o022)
    try:
        async with polygate.session(_settings(url), transport=Router({"a": up})):
            pass
        with _Held(path) as held, trio.fail_after(10):
            async with polygate.session(_settings(url), transport=Router({"a": up})) as s:
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{path}{suffix}")
                held.release()
                await s.chat([{"role": "user", "content": "after the lock"}])
    finally:
        os.umask(old)
    assert path.exists()
    modes = {p.name: oct(_mode(p)) for p in path.parent.iterdir()}
    assert all(m == oct(0o600) for m in modes.values()), modes


async def test_every_write_after_a_write_opened_a_file_locked_at_the_start_is_stored(
    tmp_path: Path,
) -> None:
    """Review: a write that opened a file locked at the start did not keep its
    connection: every later write of the session failed ("closed"), and that
    connection was never closed."""
    path = tmp_path / "c.db"
    backend = SQLiteBackend(path, timeout_s=0.05)
    with _Held(path) as held, trio.fail_after(10):
        await backend.start()  # fails open: the file is locked
        held.release()
        await backend.set_many([("k1", b"v1", 60.0)])  # opens it
        await backend.set_many([("k2", b"v2", 60.0)])
        assert await backend.get_many(["k1", "k2"]) == [b"v1", b"v2"]
        await backend.aclose()


async def test_a_file_that_cannot_be_read_fails_open(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(f"sqlite://{path}"), transport=Router({"a": up})) as s:
        path.rename(tmp_path / "moved.db")
        path.mkdir()  # a new read connection finds a folder where the file was
        with trio.fail_after(5):
            r = await s.chat(MESSAGES)
        stats = (await s.statistics()).cache
    assert r.text == "answer" and not r.call_stats.cached
    assert stats.errors >= 1 and stats.misses == 1


@pytest.mark.parametrize(("damage", "errors"), [
    # another program (a DB tool) stored the value as TEXT: a bare AttributeError came
    # out of the call; it is a bad entry, counted
    ("value = CAST(value AS TEXT)", 1),
    # a row whose expiry is no time: the lookup failed as the backend's failure, paused
    # the whole cache and never healed; it is an expired row, no error
    ("expires_at = 'never'", 0),
    # a value nested deeper than the JSON reader goes: a bare RecursionError came out
    # of the call (a later review); it is a bad entry, counted
    ("value = CAST(printf('%.100000c', '[') || printf('%.100000c', ']') AS BLOB)", 1),
])
async def test_a_row_another_program_damaged_is_a_miss_written_over(
    tmp_path: Path, damage: str, errors: int,
) -> None:
    """Probe findings (eighth round): a damaged row is a miss, and the answer replaces it."""
    import sqlite3

    path = tmp_path / "c.db"
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(f"sqlite://{path}"), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE polygate_cache SET {damage}")
    conn.close()  # the with block commits; it does not close (3.13 warns of it)
    async with polygate.session(_settings(f"sqlite://{path}"), transport=Router({"a": up})) as s:
        again = await s.chat(MESSAGES)
        stats = (await s.statistics()).cache
    async with polygate.session(_settings(f"sqlite://{path}"), transport=Router({"a": up})) as s:
        healed = await s.chat(MESSAGES)
    assert again.text == "answer" and not again.call_stats.cached
    assert (stats.errors, stats.misses) == (errors, 1)
    assert healed.call_stats.cached


async def test_an_answer_is_written_when_the_session_ends_by_cancellation(tmp_path: Path) -> None:
    """Review: a session ended by its caller's cancellation (a time budget, Ctrl-C)
    dropped the answers queued to be written behind (writes 0, dropped 1, no row):
    the writer, in the session's nursery, was cancelled with it.  A batch taken is
    written and the queue drained, shielded and bounded as at a normal end."""
    path = tmp_path / "c.db"
    up = FakeUpstream(Reply(text="answer"))
    with trio.move_on_after(30) as budget:
        async with polygate.session(_settings(f"sqlite://{path}"), transport=Router({"a": up})) as s:
            await s.chat(MESSAGES)
            await s.chat([{"role": "user", "content": "and another"}])
            budget.cancel()  # the program's overall time budget runs out
            await trio.lowlevel.checkpoint()  # (where its Cancelled is raised)
    stats = s._cache.statistics()  # type: ignore[attr-defined]
    assert (stats.writes, stats.writes_dropped) == (2, 0)
    async with polygate.session(_settings(f"sqlite://{path}"), transport=Router({"a": up})) as s:
        assert (await s.chat(MESSAGES)).call_stats.cached
    assert len(up.requests) == 2


async def test_a_newer_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(polygate.ConfigError, match="newer polygate"):
        async with polygate.session(_settings(f"sqlite://{path}")):
            pass


async def test_telemetry_rows_and_stats_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "telemetry.db"
    settings = _settings(f"sqlite://{tmp_path}/cache.db", telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": FakeUpstream()})) as s:
        for _ in range(4):
            await s.chat(MESSAGES)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT cached, attempts, generation_ms, outcome FROM calls").fetchall()
    conn.close()
    assert sorted(rows) == [(0, 1, rows[0][2], "ok"), (1, 0, 0.0, "ok"), (1, 0, 0.0, "ok"), (1, 0, 0.0, "ok")]
    assert main(["stats", "--db", f"sqlite://{db}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cache"]["cached_calls"] == 3 and report["cache"]["hit_rate_pct"] == 75.0
    # A source's latency is its own answers': the hits have a row of their own.
    by_source = {row["source"]: row["calls"] for row in report["latency"]}
    assert by_source == {"(all)": 4, "a": 1, "(cache)": 3}
    assert main(["stats", "--db", f"sqlite://{db}"]) == 0
    assert "hit rate 75.0 % of successful calls" in capsys.readouterr().out


async def test_sqlite_under_mockclock(tmp_path: Path, autojump_clock: Any) -> None:
    """The file's timeouts are real time inside the thread: virtual time jumping while
    a read runs does not make it fail."""
    up = FakeUpstream(Reply(text="kept", first_token_s=5.0))
    async with polygate.session(_settings(f"sqlite://{tmp_path}/c.db"), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
        await trio.sleep(1)  # the writer's batch
        hit = await s.chat(MESSAGES)
        stats = (await s.statistics()).cache
    assert hit.call_stats.cached and stats.errors == 0


async def test_entries_expire_in_virtual_time(tmp_path: Path, autojump_clock: Any) -> None:
    """A review found a SQLite entry still a hit long after its ``cache_ttl_s`` under
    ``MockClock``: expiry was read off the wall clock, so virtual time could not drive
    it, as it drives the memory cache's.  Expiry is epoch seconds that move with trio's
    clock, so a virtual-time test sees the entry live, then gone."""
    up = FakeUpstream(Reply(text="kept"))
    source = polygate.Source(name="a", base_url="http://a/v1")
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=10)},
        cache=f"sqlite://{tmp_path}/c.db",
    )
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
        await trio.sleep(1)  # the writer's batch
        assert (await s.chat(MESSAGES)).call_stats.cached
        await trio.sleep(5)
        assert (await s.chat(MESSAGES)).call_stats.cached  # 6 s of 10: live
        await trio.sleep(5)
        assert not (await s.chat(MESSAGES)).call_stats.cached  # 11 s: expired
    assert len(up.requests) == 2


async def test_every_queued_answer_is_written_at_close_under_mockclock(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """A virtual-time run's queued writes all reach the file when the session ends
    (the writes take no virtual time, so the 5 s flush bound never cuts them: it once
    kept about one in eight and did not count the rest)."""
    db = tmp_path / "c.db"
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(_settings(f"sqlite://{db}"), transport=Router({"a": up})) as s:
        for i in range(600):
            await s.chat([{"role": "user", "content": str(i)}])
    stats = (await s.statistics()).cache
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT count(*) FROM polygate_cache").fetchone()[0]
    finally:
        conn.close()
    assert rows == 600 and (stats.writes, stats.writes_dropped) == (600, 0)


class _Threads:
    """Counts the reads that went to a worker thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from polygate.cache import _sqlite

        self.count = 0
        real = _sqlite.run_sync  # type: ignore[attr-defined]

        async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(fn, "__name__", "") == "_read":
                self.count += 1
            return await real(fn, *args, **kwargs)

        monkeypatch.setattr(_sqlite, "run_sync", counted)


@contextlib.asynccontextmanager
async def _warm(path: Path, threads: _Threads) -> AsyncIterator[SQLiteBackend]:
    """A backend holding ``k`` → ``v`` whose first read (the one that opens the loop's
    connection, in a thread) is done."""
    backend = SQLiteBackend(path, timeout_s=2.0)
    await backend.start()
    try:
        await backend.set_many([("k", b"v", 60.0)])
        assert await backend.get_many(["k"]) == [b"v"]
        assert threads.count == 1
        yield backend
    finally:
        await backend.aclose()


async def test_lookups_run_on_the_loop_once_a_connection_is_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _Threads(monkeypatch)
    backend = SQLiteBackend(tmp_path / "c.db", timeout_s=2.0)
    await backend.start()
    try:
        await backend.set_many([(f"k{i}", b"%d" % i, 60.0) for i in range(20)])
        assert await backend.get_many(["k1"]) == [b"1"]  # opens a connection, in a thread
        assert threads.count == 1
        for _ in range(5):
            assert await backend.get_many(["k2"]) == [b"2"]
            assert await backend.get_many(["k3", "nope", "k4"]) == [b"3", None, b"4"]
        assert threads.count == 1  # on the loop
        many = [f"k{i}" for i in range(17)]  # more than a loop read takes
        assert await backend.get_many(many) == [b"%d" % i for i in range(17)]
        assert threads.count == 2
        # an expired entry is not served on the loop either
        await backend.set_many([("old", b"x", -1.0)])
        assert await backend.get_many(["old"]) == [None]
        assert threads.count == 2
    finally:
        await backend.aclose()
    assert backend._loop_reader is None
    with pytest.raises(CacheBackendError, match="closed"):
        await backend.get_many(["k1"])


async def test_a_locked_file_sends_the_read_to_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop never waits for a lock: a read that finds the file busy (a WAL
    recovery, a writer holding it exclusively) is done again in a thread, which waits
    up to ``timeout_s``, and the next reads go there too for a while."""
    threads = _Threads(monkeypatch)
    loop_thread = threading.current_thread()
    busy_on_loop: list[str] = []
    async with _warm(tmp_path / "c.db", threads) as backend:
        real = backend._select

        def select(conn: sqlite3.Connection, keys: Any) -> Any:
            if threading.current_thread() is loop_thread:
                busy_on_loop.append(keys[0])
                raise sqlite3.OperationalError("database is locked")
            return real(conn, keys)

        monkeypatch.setattr(backend, "_select", select)
        assert await backend.get_many(["k"]) == [b"v"]  # busy on the loop, read in a thread
        assert busy_on_loop == ["k"] and threads.count == 2
        assert await backend.get_many(["k"]) == [b"v"]
        assert busy_on_loop == ["k"] and threads.count == 3  # not tried on the loop again yet


async def test_a_slow_read_on_the_loop_sends_the_next_ones_to_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polygate.cache import _sqlite

    threads = _Threads(monkeypatch)
    async with _warm(tmp_path / "c.db", threads) as backend:
        assert await backend.get_many(["k"]) == [b"v"]
        assert threads.count == 1  # on the loop
        monkeypatch.setattr(_sqlite, "_LOOP_SLOW_S", 0.0)  # every read is "slow" now
        assert await backend.get_many(["k"]) == [b"v"]  # on the loop, found slow
        assert threads.count == 1
        assert await backend.get_many(["k"]) == [b"v"]
        assert threads.count == 2


async def test_a_read_on_the_loop_that_fails_is_the_backends_error(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    backend = SQLiteBackend(path, timeout_s=2.0)
    await backend.start()
    try:
        await backend.set_many([("k", b"v", 60.0)])
        assert await backend.get_many(["k"]) == [b"v"]
        assert backend._loop_reader is not None
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("DROP TABLE polygate_cache")
        other.close()
        with pytest.raises(CacheBackendError, match="no such table"):
            await backend.get_many(["k"])
    finally:
        await backend.aclose()


async def test_a_write_waits_for_the_files_lock_up_to_its_timeout_s(tmp_path: Path) -> None:
    """Review of the shielded writes: each steady write was bounded by the 5 s drain
    bound, not the backend's ``timeout_s`` (up to 60 s): a write to a file another
    process locked for 5.3 s, with ``timeout_s=10``, was cut and dropped uncounted as
    an error.  (Real clock: another connection holds the lock 5.3 s.)"""
    import threading
    import time

    path = tmp_path / "c.db"
    up = FakeUpstream(Reply(text="answer"))
    async with polygate.session(_settings(f"sqlite://{path}?timeout_s=10"), transport=Router({"a": up})) as s:
        await s.chat([{"role": "user", "content": "warm"}])  # the file and its table exist
        locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        locker.execute("BEGIN IMMEDIATE")

        def release() -> None:
            time.sleep(5.3)
            locker.execute("COMMIT")
            locker.close()

        holder = threading.Thread(target=release)
        holder.start()
        await s.chat(MESSAGES)
        await trio.to_thread.run_sync(holder.join)
        stats = (await s.statistics()).cache
    assert s._cache.statistics().writes_dropped == 0  # type: ignore[attr-defined]
    assert stats.errors == 0


async def test_expiry_follows_the_wall_clock_on_the_real_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of the MockClock fix: anchoring the real clock once made a session's time
    a monotonic clock's, which falls behind the wall clock after a suspend or a step:
    it then served another process's rows past their TTL.  On trio's real clock the
    expiry is the wall clock's, read at each use."""
    wall = [time.time()]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    backend = SQLiteBackend(tmp_path / "c.db", timeout_s=1.0)
    await backend.start()
    try:
        await backend.set_many([("k", b"v", 60.0)])
        assert await backend.get_many(["k"]) == [b"v"]
        wall[0] += 3600.0  # the wall clock steps (a suspend, an NTP step); trio's does not
        assert await backend.get_many(["k"]) == [None]
    finally:
        await backend.aclose()


async def test_one_embed_of_thousands_of_new_inputs_is_stored_whole(tmp_path: Path) -> None:
    """An outside review (embeddings end to end, 2026-12-05): one call of 5,000 new
    inputs stored only 4,096.  Its answers are put all at once, before the writer can
    run, and the write queue dropped what it had no room for (``writes_dropped``
    903), so the next call sent 903 inputs upstream again."""
    up = FakeUpstream(Reply(), embedding_dim=4)
    inputs = [f"in {i}" for i in range(5_000)]
    url = f"sqlite:///{tmp_path}/c.db"
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=600)}, cache=url)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        first = await s.embed(inputs)
        during = (await s.statistics()).cache
    stats = (await s.statistics()).cache
    assert during.writes_dropped == 0
    assert (stats.writes, stats.writes_dropped) == (5_000, 0)
    sent = up.statistics().requests
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        again = await s.embed(inputs)
    assert again.call_stats.cached and up.statistics().requests == sent
    assert again.vectors == first.vectors


@pytest.mark.parametrize("kind", ["chat", "embed"])
async def test_a_read_that_looked_before_an_identical_answer_was_written_serves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
) -> None:
    """Outside review (workers): B's read ran its SELECT before identical call A's
    answer was written, and came back after; the write-behind had let go of the answer
    once written, so B found it nowhere and led a second upstream call for a stored
    answer ("identical calls in flight at the same time share one upstream call")."""
    settings = polygate.Settings(
        cache=f"sqlite://{tmp_path}/c.db",
        scopes={kind: polygate.Scope(cache_ttl_s=600, sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key="k", model="m")])})
    up = FakeUpstream(Reply(text="answer"))
    read, write = SQLiteBackend.get_many, SQLiteBackend.set_many
    b_looked, a_written = trio.Event(), trio.Event()

    async def get_many(self: SQLiteBackend, keys: Any) -> Any:
        found = await read(self, keys)
        if not b_looked.is_set():  # B's: it has looked, and comes back after A's write
            b_looked.set()
            await a_written.wait()
        return found

    async def set_many(self: SQLiteBackend, entries: Any) -> None:
        await write(self, entries)
        a_written.set()

    monkeypatch.setattr(SQLiteBackend, "get_many", get_many)
    monkeypatch.setattr(SQLiteBackend, "set_many", set_many)

    async def ask(s: polygate.Session) -> Any:
        if kind == "chat":
            return (await s.chat(MESSAGES, scope="chat")).call_stats.cached
        return (await s.embed(["same input"], scope="embed")).call_stats.cached

    async with polygate.session(settings, transport=up.transport()) as s:
        cached: list[Any] = []

        async def b() -> None:
            cached.append(await ask(s))

        async def a() -> None:
            await b_looked.wait()
            cached.append(await ask(s))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(b)
            nursery.start_soon(a)
        stats = (await s.statistics()).cache
    assert len(up.requests) == 1, stats
    assert sorted(map(bool, cached)) == [False, True], cached
    assert stats is not None and (stats.misses, stats.hits) == (1, 1), stats


async def test_a_file_deleted_under_a_session_is_never_made_again_by_a_read(tmp_path: Path) -> None:
    """Review finding (files changed under a running session): a read in a worker
    thread (an embed of more than 16 inputs) opened a connection that made the deleted
    file again with the umask's mode (0644), and the next session stored every prompt
    and answer in it.  A read never creates the file; the next session makes it again,
    0600."""
    path = tmp_path / "cache.db"
    src = [polygate.Source(name="a", base_url="http://a/v1", model="m1")]
    emb = [polygate.Source(name="e", base_url="http://e/v1", model="emb")]
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=src, cache_ttl_s=3600),
                "embed": polygate.Scope(sources=emb, cache_ttl_s=3600)},
        cache=f"sqlite://{path}")
    router = Router({"a": FakeUpstream(Reply(text="secret answer")), "e": FakeUpstream(Reply())})
    old = os.umask(0o022)
    try:
        async with polygate.session(settings, transport=router) as s:
            await s.chat([{"role": "user", "content": "my secret prompt"}])
            for name in os.listdir(tmp_path):
                os.unlink(tmp_path / name)  # the cache cleared by deleting its files
            read = await s.embed([f"text {i}" for i in range(20)], scope="embed")
            assert len(read.vectors) == 20
            modes = {name: oct(_mode(tmp_path / name)) for name in os.listdir(tmp_path)}
        async with polygate.session(settings, transport=router) as s:
            await s.chat([{"role": "user", "content": "my secret prompt"}])
    finally:
        os.umask(old)
    assert modes == {}, modes  # (no read made the file again, with the umask's mode)
    after = {name: oct(_mode(tmp_path / name)) for name in os.listdir(tmp_path)}
    assert after and all(m == oct(0o600) for m in after.values()), after


async def test_a_cache_path_that_is_a_dangling_link_makes_its_target_private(tmp_path: Path) -> None:
    """Review finding: ``cache.db -> /volume/cache.db``, the target not there yet: the
    exclusive create failed on the link (it exists), and SQLite made the target with
    the umask's mode (0644).  The telemetry file beside it was 0600."""
    (tmp_path / "vol").mkdir()
    link = tmp_path / "cache.db"
    link.symlink_to(tmp_path / "vol" / "cache.db")
    old = os.umask(0o022)
    try:
        async with polygate.session(_settings(f"sqlite://{link}"),
                                    transport=Router({"a": FakeUpstream(Reply(text="answer"))})) as s:
            await s.chat([{"role": "user", "content": "a prompt"}])
    finally:
        os.umask(old)
    assert link.is_symlink()
    modes = {name: oct(_mode(tmp_path / "vol" / name)) for name in os.listdir(tmp_path / "vol")}
    assert "cache.db" in modes and all(m == oct(0o600) for m in modes.values()), modes


@pytest.mark.parametrize("store", ["cache", "telemetry"])
async def test_a_path_that_is_a_fifo_is_refused_at_once(tmp_path: Path, store: str) -> None:
    """Review finding (files of odd kinds): a FIFO as the telemetry file held the
    session's start 15 s and left a thread blocked in its open for good; as the cache
    file it failed open with "disk I/O error".  Neither is a database: a ConfigError
    that says so, before anything waits on it."""
    fifo = tmp_path / "x.db"
    os.mkfifo(fifo)
    source = polygate.Source(name="a", base_url="http://a/v1")
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=60)},
                                 **{store: f"sqlite://{fifo}"})
    with trio.fail_after(5), pytest.raises(polygate.ConfigError, match="not a regular file"):
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})):
            pass
