"""The persistent backend: one SQLite file in WAL mode, used from worker threads.

WAL lets every process that points at the file read while one of them writes; a
write batch is one ``BEGIN IMMEDIATE`` transaction of ``INSERT OR REPLACE`` rows.
``synchronous=NORMAL``: a commit reaches the WAL without an fsync — durable across a
process crash, not a power cut, which is right for a cache.

**Threads, and reads on the loop.**  Writes, and reads that may wait, run in
``trio.to_thread.run_sync``.  Threaded reads take a connection from a small pool (one
per concurrent reader; WAL readers never wait for the writer) and are *abandoned*
when their caller gives up (cancelled, or out of time), with
``Connection.interrupt()`` so the thread stops at once and returns the connection.
Writes use one connection, serialised by a lock.  SQLite's own ``busy_timeout`` is
``timeout_s``, so a file locked past it fails the operation instead of blocking; it
is real time, kept inside the thread, so a session under ``MockClock`` reads the file
as any other would.

A lookup of a few keys is one indexed ``SELECT`` on pages that are almost always in
memory: 10–30 µs, where the hop to a worker thread and back costs ~190 µs on a 2-core
machine (``benchmarks/cache.py``).  So once a threaded read has opened a connection,
that connection becomes the *loop reader*, and lookups of up to
:data:`_LOOP_KEYS` keys run on the event loop itself, with a ``busy_timeout`` of 0:
they never wait.  A read that finds the file locked (``SQLITE_BUSY``: a WAL recovery,
a writer that took the file exclusively) is done again in a thread, as before; one
that took longer than :data:`_LOOP_SLOW_S` (a cold disk) sends the reads of the next
:data:`_THREADS_FOR_S` seconds to threads, so a slow disk never stalls the loop for
long.  The first read of a session always goes through a thread.

**Time to live.**  A row holds its expiry as epoch seconds (the file outlives
processes and is shared by them): the wall clock, read at each use (never a
monotonic clock anchored once: one that stops while the machine sleeps would fall
behind the other processes').  Under ``MockClock`` it is the wall clock at the
backend's start plus the virtual time since, so that virtual time drives expiry as it
does the memory cache's.  An expired row is never returned; the writer deletes expired rows at most
once a minute, in the transaction of a batch.

**Privacy.**  Cached answers are as sensitive as the prompts: a new folder is created
``0700`` and a new file ``0600`` (SQLite gives its ``-wal`` and ``-shm`` files the
mode of the database), whatever the umask.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

from .._errors import ConfigError
from .._sqlite_locks import held_by_another, no_file_there, unusable_for_now
from .._threads import NoThread, run_sync
from ._backend import CacheBackendError, Entry

__all__ = ["SQLiteBackend"]

log = logging.getLogger("polygate.cache")

T = TypeVar("T")

_SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS polygate_cache ("
    " key TEXT PRIMARY KEY, value BLOB NOT NULL, expires_at REAL NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS polygate_cache_expires ON polygate_cache (expires_at)",
)
_GET = "SELECT value, expires_at FROM polygate_cache WHERE key = ?"
_PUT = "INSERT OR REPLACE INTO polygate_cache (key, value, expires_at) VALUES (?, ?, ?)"
_EXPIRE = "DELETE FROM polygate_cache WHERE expires_at <= ?"


def _epoch_on(clock: trio.abc.Clock) -> Callable[[], float]:
    """Epoch seconds that move with ``clock`` (trio's, read from any thread: a clock's
    ``current_time`` only reads its state)."""
    offset = time.time() - clock.current_time()
    return lambda: offset + clock.current_time()


def _live(expires_at: Any, now: float) -> bool:
    """Whether a row has not expired.  A row another program wrote with a time that is
    no number is treated as expired: a miss (its key is then written over), never a
    failed lookup that would pause the whole cache."""
    return isinstance(expires_at, (int, float)) and expires_at > now


_IN_CHUNK = 500  # keys per SELECT … IN (…): well below SQLite's variable limit
_EVICT_EVERY_S = 60.0
_LOOP_KEYS = 16  # the most keys a read on the event loop looks up
_LOOP_SLOW_S = 0.005  # a read on the loop that took longer (a cold disk; not a 1–3 ms preemption) …
_THREADS_FOR_S = 1.0  # … sends the reads of the next second (real time) to threads


class _Read:
    """One read: ``new`` → ``running`` (in its thread) → ``done``; the lock on the
    pool guards the transitions, so an abandoned read is interrupted only while it
    still owns its connection."""

    __slots__ = ("conn", "state")

    def __init__(self, conn: sqlite3.Connection | None) -> None:
        self.conn = conn  # None: the thread opens a new one
        self.state = "new"


class SQLiteBackend:
    name = "sqlite"
    write_behind = True

    def __init__(
        self, path: Path, *, timeout_s: float = 1.0, clock: Callable[[], float] | None = None
    ) -> None:
        self.path = path
        self.timeout_s = timeout_s
        #: Epoch seconds, called in worker threads too; None: the wall clock, or under
        #: MockClock, virtual time anchored at start().
        self._given_clock = clock
        self._clock: Callable[[], float] = clock if clock is not None else time.time
        self._where = f"sqlite://{path}"
        self._readers: list[sqlite3.Connection] = []  # idle read connections
        self._writer: sqlite3.Connection | None = None
        self._unopened = False  # locked at the start: the first read or write opens it
        self._refused: str | None = None  # why the file is never used (a newer format)
        self._write_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._closed = False
        self._last_evict = -float("inf")
        # Used on the event loop's thread only, never pooled, closed by aclose.
        self._loop_reader: sqlite3.Connection | None = None
        self._threads_until = -float("inf")  # time.monotonic(): reads go to threads until

    def __repr__(self) -> str:
        return f"<SQLiteBackend {self._where}>"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str | None:
        """Create the folder, the file and the table (ConfigError when it cannot).  A
        file locked past ``timeout_s`` (another process holds it exclusively) is no
        reason to refuse the session: the cache fails open, as for a Redis that does
        not answer, and the first lookup or write after the lock opens it."""
        if self._given_clock is None:
            from trio.testing import MockClock  # (lazily: tests only)

            clock = trio.lowlevel.current_clock()
            if isinstance(clock, MockClock):
                self._clock = _epoch_on(clock)
        try:
            return await run_sync(self._open)
        except NoThread as exc:
            # The process's thread limit, not the file: fails open as a locked file does.
            return self._not_now(str(exc))

    def _open(self) -> str | None:
        try:
            no_file_there(self.path)
            _make_private(self.path)
            conn = self._connect(busy_s=self.timeout_s)
        except (OSError, sqlite3.Error) as exc:
            why = unusable_for_now(exc, self.path)
            if why is not None:
                return self._not_now(why)
            raise ConfigError(f"cannot open the cache database {self._where}: {exc}") from None
        try:
            self._prepare(conn, ConfigError)
        except ConfigError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            why = unusable_for_now(exc, self.path)
            if why is not None:
                return self._not_now(why)
            raise ConfigError(f"cannot use {self._where} as a cache database: {exc}") from None
        self._writer = conn
        return None

    def _not_now(self, why: str) -> str:
        """A file locked, or on a full disk, at the start: the cache fails open and the
        first lookup or write after opens it.  (Counted and logged with the other
        failures: open_cache.)"""
        self._unopened = True
        return f"cache {self._where}: {why}"

    def _prepare(self, conn: sqlite3.Connection, newer: type[Exception]) -> None:
        """WAL, the schema when the file has none, and the busy timeout; ``newer``: the
        error for a file a newer polygate wrote."""
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        found = conn.execute("PRAGMA user_version").fetchone()[0]
        if found > _SCHEMA_VERSION:
            raise newer(
                f"the cache database {self._where} was written by a newer polygate "
                f"(format {found}); point the cache elsewhere or upgrade"
            )
        if found != _SCHEMA_VERSION:
            # Only a file without the schema is written here: one that has it opens
            # without the write lock, so that another process writing to it does not
            # hold this session's start (it waited 5 s, then refused the file).
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            conn.execute("COMMIT")
        conn.execute(f"PRAGMA busy_timeout = {int(self.timeout_s * 1000)}")

    def _connect(self, busy_s: float) -> sqlite3.Connection:
        # mode=rw: a connection never creates the file.  Only _make_private does
        # (0600); a reader's connection made a file deleted under the session again
        # with the umask's mode, and every later session stored prompts in it.
        return sqlite3.connect(
            f"{self.path.absolute().as_uri()}?mode=rw", uri=True, timeout=busy_s,
            isolation_level=None, check_same_thread=False,
        )

    async def aclose(self) -> None:
        """Close every connection; bounded, and done in a thread (the writer may be
        finishing a batch).  Shielded: it runs while the session is torn down."""
        loop_reader, self._loop_reader = self._loop_reader, None  # no read uses it now
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + max(self.timeout_s, 1.0)
            try:
                await run_sync(self._close_all, loop_reader, abandon_on_cancel=True)
            except NoThread:
                # Out of threads (the process's limit): closed here, on the loop.  No
                # thread of this cache can be writing a batch meanwhile but one that
                # started before, which its busy timeout bounds.
                self._close_all(loop_reader)

    def _close_all(self, loop_reader: sqlite3.Connection | None = None) -> None:
        if loop_reader is not None:
            loop_reader.close()
        with self._pool_lock:
            self._closed = True
            idle, self._readers = self._readers, []
        for conn in idle:
            conn.close()
        with self._write_lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    # ------------------------------------------------------------------ reads

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        conn = self._loop_reader
        if conn is not None and len(keys) <= _LOOP_KEYS and time.monotonic() >= self._threads_until:
            # A schedule point first, as every trio operation takes: a loop of hits must
            # not starve the other tasks, and a cancelled caller must not be served.
            await trio.lowlevel.checkpoint()
            found = self._read_on_loop(conn, keys)
            if found is not None:
                return found
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        op = _Read(self._reader())
        try:
            # Bounded by SQLite's busy_timeout (real time, inside the thread) rather than
            # a trio deadline: under MockClock a trio deadline would fire at once while
            # the thread runs.  A caller that gives up abandons the read.
            found = await run_sync(self._read, op, keys, abandon_on_cancel=True)
        except sqlite3.Error as exc:
            raise self._read_failed(exc) from None
        finally:
            self._abandon(op)  # cancelled or never started: stop it, return the connection
        if self._loop_reader is None:
            self._promote()
        return found

    def _read_on_loop(self, conn: sqlite3.Connection, keys: Sequence[str]) -> list[bytes | None] | None:
        """The lookup on the event loop; None when it must be done in a thread instead
        (the file is locked).  Any other failure is the backend's."""
        started = time.monotonic()
        try:
            return self._select(conn, keys)
        except sqlite3.Error as exc:
            if not held_by_another(exc):
                raise self._read_failed(exc) from None
            self._threads_until = time.monotonic() + _THREADS_FOR_S
            return None
        finally:
            ended = time.monotonic()
            if ended - started > _LOOP_SLOW_S:
                self._threads_until = max(self._threads_until, ended + _THREADS_FOR_S)

    def _read_failed(self, exc: sqlite3.Error) -> CacheBackendError:
        return CacheBackendError(f"cache {self._where}: read failed ({exc})")

    def _read(self, op: _Read, keys: Sequence[str]) -> list[bytes | None]:
        with self._pool_lock:
            if op.state != "new":
                raise CacheBackendError("abandoned before it started")
            op.state = "running"
        if self._unopened or self._refused is not None:
            try:
                self._open_before_read()  # a file locked at the start: read it only once opened
            except BaseException:
                with self._pool_lock:
                    op.state = "done"
                if op.conn is not None:
                    self._give_back(op.conn)
                raise
        if op.conn is None:
            op.conn = self._connect(busy_s=self.timeout_s)
        conn = op.conn
        try:
            return self._select(conn, keys)
        finally:
            with self._pool_lock:
                op.state = "done"
            self._give_back(conn)

    def _select(self, conn: sqlite3.Connection, keys: Sequence[str]) -> list[bytes | None]:
        now = self._clock()
        if len(keys) == 1:
            row = conn.execute(_GET, (keys[0],)).fetchone()
            return [row[0] if row is not None and _live(row[1], now) else None]
        found: dict[str, bytes] = {}
        for i in range(0, len(keys), _IN_CHUNK):
            chunk = keys[i : i + _IN_CHUNK]
            marks = ",".join("?" * len(chunk))
            rows = conn.execute(
                f"SELECT key, value, expires_at FROM polygate_cache WHERE key IN ({marks})",
                tuple(chunk),
            )
            found.update((k, v) for k, v, e in rows if _live(e, now))
        return [found.get(k) for k in keys]

    def _abandon(self, op: _Read) -> None:
        """After the caller stopped waiting: a read that never started returns its
        connection here; a running one is interrupted and returns it itself."""
        with self._pool_lock:
            state = op.state
            if state == "new":
                op.state = "done"  # its thread, should it start after all, does nothing
            elif state == "running" and op.conn is not None:
                op.conn.interrupt()  # under the lock: it cannot have moved to another read
        if state == "new" and op.conn is not None:
            self._give_back(op.conn)

    def _reader(self) -> sqlite3.Connection | None:
        """An idle read connection, or None: the read's thread opens one."""
        with self._pool_lock:
            if self._closed:
                raise CacheBackendError(f"cache {self._where} is closed")
            return self._readers.pop() if self._readers else None

    def _give_back(self, conn: sqlite3.Connection) -> None:
        with self._pool_lock:
            if not self._closed:
                self._readers.append(conn)
                return
        conn.close()

    def _promote(self) -> None:
        """After a threaded read: one of the pool's connections becomes the loop
        reader, one that never waits for a lock (the loop must not block)."""
        with self._pool_lock:
            if self._closed or self._loop_reader is not None or not self._readers:
                return
            conn = self._readers.pop()
        try:
            conn.execute("PRAGMA busy_timeout = 0")
        except sqlite3.Error:
            conn.close()
            return
        self._loop_reader = conn

    # ------------------------------------------------------------------ writes

    async def set_many(self, entries: Sequence[Entry]) -> None:
        # The clock is read here, not in the thread: a write that waits for the lock
        # must not store its entries for longer than they were given.
        now = self._clock()
        try:
            await run_sync(self._write, entries, now, abandon_on_cancel=True)
        except sqlite3.Error as exc:
            raise CacheBackendError(f"cache {self._where}: write failed ({exc})") from None
        except BaseException:
            writer = self._writer  # one write at a time: this can only stop our own
            if writer is not None:
                writer.interrupt()
            raise

    def _write(self, entries: Sequence[Entry], now: float) -> None:
        with self._write_lock:
            conn = self._writer
            if conn is None:
                conn = self._writer = self._late_writer()
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(_PUT, [(k, v, now + ttl) for k, v, ttl in entries])
                # (A wall clock stepped back counts as a minute gone: measured on it
                # alone, no write would delete anything for as long as the step.)
                if not 0 <= now - self._last_evict < _EVICT_EVERY_S:
                    conn.execute(_EXPIRE, (now,))
                    self._last_evict = now
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise


    def _open_before_read(self) -> None:
        """Open a file that was locked at the start, before a read uses it: its schema
        may not be there yet, and its format is checked first (a newer polygate's).
        One opening at a time, which a read never queues behind: each of the reads
        would wait its own timeout_s after the others' (the k-th, k times it)."""
        if not self._write_lock.acquire(blocking=False):
            raise CacheBackendError(f"cache {self._where}: the file is being opened (it was locked)")
        try:
            if self._writer is None:
                self._writer = self._late_writer()
        finally:
            self._write_lock.release()

    def _late_writer(self) -> sqlite3.Connection:
        """(Under the write lock.)  The writer of a file that was locked at the start;
        raises while it cannot be opened (still locked: ``sqlite3.Error``), and for
        good once the file proves to be a newer polygate's."""
        if self._refused is not None:
            raise CacheBackendError(self._refused)
        if self._closed or not self._unopened:
            raise CacheBackendError(f"cache {self._where} is closed")
        try:
            _make_private(self.path)  # (deleted meanwhile: made again 0600, not the umask's)
        except OSError as exc:
            raise CacheBackendError(f"cache {self._where}: cannot open the file ({exc})") from None
        conn = self._connect(busy_s=self.timeout_s)
        try:
            self._prepare(conn, CacheBackendError)
        except CacheBackendError as exc:  # a newer format: never used, read or written
            conn.close()
            self._refused, self._unopened = str(exc), False
            log.warning("cache %s: %s; the cache stays off for this session", self._where, exc)
            raise
        except BaseException:
            conn.close()
            raise
        self._unopened = False
        return conn


def _make_private(path: Path) -> None:
    """Create the missing folders ``0700`` and the file ``0600`` (no umask involved)."""
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made by someone else meanwhile: not ours to change
        os.chmod(folder, 0o700)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if not (path.is_symlink() and not path.exists()):
            return
        # A link to a file not there yet (a volume's): made here, through the link, as
        # the exclusive create cannot (the link exists).  Left to SQLite, the target
        # took the umask's mode.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
