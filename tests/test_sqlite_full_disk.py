"""A full disk under polygate's SQLite stores (the telemetry sink, the response cache).

A database that worked yesterday, on a disk that filled overnight: the docs promise
that a full or dead telemetry database costs rows, never a call, and that a cache
that fails never fails a call.  At the start the two stores refused the file as a
configuration error instead ("disk I/O error": a WAL database opened where its
``-shm`` file cannot be created), so the session did not open and ``polygate serve``
exited 2 (a supervisor restarting it in a loop).  These tests fill a small tmpfs
(they need to mount one: root, as on the CI machine) and check the session opens,
calls answer, and the store comes back once there is space again.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import polygate
from polygate._sqlite_locks import unusable_for_now
from polygate.testing import FakeUpstream, Reply, Router

from ._serve_kit import serve_process

MESSAGES = [{"role": "user", "content": "hello there"}]


def _settings(**top: object) -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1")
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=600)}, **top  # type: ignore[arg-type]
    )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs (skipped where this process cannot mount one)."""
    where = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)],
        capture_output=True, check=False,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(disk: Path) -> Path:
    """Write a file until the disk has no block left; returns it (delete it to make room)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
    try:
        for size in (65536, 4096, 512, 1):
            while True:
                try:
                    if os.write(fd, b"x" * size) < size:
                        break
                except OSError:
                    break
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0
    return filler


async def _until(condition: object, limit_s: float = 30.0) -> None:
    with trio.fail_after(limit_s):
        while not await condition():  # type: ignore[operator]  # noqa: ASYNC110 - a thread's write
            await trio.sleep(0.02)


# --------------------------------------------------------------------------- which errors


def _sqlite_error(message: str, code: int) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]  # (as SQLite sets it, 3.11+)
    return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_sqlite_error("database is locked", 5), "the file is locked (database is locked)"),
        (_sqlite_error("database table is locked", 6), "the file is locked"),
        (_sqlite_error("disk I/O error", 4874), "disk I/O error"),  # SQLITE_IOERR_SHMSIZE
        (_sqlite_error("database or disk is full", 13), "database or disk is full"),
        (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
        (_sqlite_error("no such table: x", 1), None),
        (_sqlite_error("file is not a database", 26), None),
        (OSError(errno.EISDIR, "Is a directory"), None),
        (OSError(errno.EACCES, "Permission denied"), None),
    ],
)
def test_for_now_or_for_good(tmp_path: Path, exc: BaseException, expected: str | None) -> None:
    """Locked or a failing disk: for now; anything else says the file cannot be one."""
    why = unusable_for_now(exc, tmp_path / "x.db")
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why


def test_a_full_disk_is_named(small_disk: Path) -> None:
    _fill(small_disk)
    why = unusable_for_now(_sqlite_error("disk I/O error", 4874), small_disk / "t.db")
    assert why == "no space left on its disk (disk I/O error)"


# --------------------------------------------------------------------------- the stores


def _existing_wal_database(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()


@pytest.mark.timeout(90)
async def test_telemetry_on_a_full_disk_costs_rows_not_the_session(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = small_disk / "t.db"
    settings = _settings(telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)  # the file and its schema, yesterday
    filler = _fill(small_disk)
    caplog.set_level(logging.WARNING, logger="polygate.telemetry")
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        assert any("no space left on its disk" in r.getMessage() for r in caplog.records)
        first = await s.chat(MESSAGES)
        assert first.text

        async def dropped() -> bool:
            return (await s.statistics()).telemetry.dropped_sink_error >= 2

        await _until(dropped)
        filler.unlink()  # room again: a later batch opens the file and writes
        second = await s.chat(MESSAGES)

        async def written() -> bool:
            return (await s.statistics()).telemetry.written >= 2

        await _until(written)
    conn = sqlite3.connect(db)
    try:
        ids = [row[0] for row in conn.execute("SELECT DISTINCT logical_call_id FROM calls")]
    finally:
        conn.close()
    assert second.call_stats.logical_call_id in ids
    assert first.call_stats.logical_call_id not in ids  # (its rows: dropped, counted)


@pytest.mark.timeout(90)
async def test_a_cache_on_a_full_disk_fails_open_then_comes_back(small_disk: Path) -> None:
    db = small_disk / "c.db"
    settings = _settings(cache=f"sqlite://{db}")
    upstream = FakeUpstream(Reply())
    async with polygate.session(settings, transport=Router({"a": upstream})) as s:
        await s.chat(MESSAGES)  # the file, yesterday
    filler = _fill(small_disk)
    async with polygate.session(settings, transport=Router({"a": upstream})) as s:
        answer = await s.chat([{"role": "user", "content": "a miss, answered"}])
        assert answer.text and not answer.call_stats.cached
        filler.unlink()

        async def hit() -> bool:  # the file opens now (after the failures' pause)
            return (await s.chat(MESSAGES)).call_stats.cached

        await _until(hit)  # yesterday's answer


@pytest.mark.timeout(90)
async def test_serve_starts_with_its_telemetry_disk_full(small_disk: Path, tmp_path: Path) -> None:
    db = small_disk / "t.db"
    _existing_wal_database(db)
    async with polygate.session(_settings(telemetry=f"sqlite://{db}"),
                                transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    _fill(small_disk)
    config = tmp_path / "polygate.toml"
    config.write_text(
        f'telemetry = "sqlite://{db}"\n[scopes.chat.sources.a]\nbase_url = "http://127.0.0.1:9/v1"\n'
    )
    async with serve_process(config) as running:  # it listens (exit 2 before)
        assert running.proc.returncode is None  # (serve_process kills it)
