"""The embedded sink: stdlib ``sqlite3`` in WAL mode, written from a worker thread.

WAL lets ``polygate stats`` (and other processes' sessions) read while a session
writes; ``synchronous=NORMAL`` makes a commit a write to the WAL without an fsync
(durable across a process crash, not across a power cut — right for telemetry).
Each batch is one transaction of ``executemany`` inserts.  ``interrupt`` is
``sqlite3.Connection.interrupt()``, which is safe to call from another thread and
aborts the statement the stuck write is running.

URLs: ``sqlite:///var/lib/app/telemetry.db`` is the file ``/var/lib/app/telemetry.db``
(the path after ``sqlite://``); ``sqlite://`` alone is the default file under the
user's state directory (:func:`default_path`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .._errors import ConfigError
from .._paths import state_dir, unencoded_problem
from .._secrets import printable
from .._sqlite_locks import DatabaseUnavailable, held_by_another, no_file_there, unusable_for_now
from ._schema import (
    TABLES,
    check_version,
    foreign_table,
    insert_sql,
    read_transaction,
    shape_checks,
    statements,
    upsert_session_sql,
    version_table,
)
from ._sink import Batch

__all__ = ["SQLiteReader", "SQLiteSink", "default_path", "sqlite_path", "state_dir"]

_CALLS = insert_sql("calls", "sqlite")
_ATTEMPTS = insert_sql("attempts", "sqlite")
#: The most parameters one statement takes (SQLite's limit before 3.32, the oldest).
_MAX_PARAMS = 999
_SESSION = upsert_session_sql("sqlite")
_BUSY_TIMEOUT_S = 5.0
logger = logging.getLogger("polygate.telemetry")


def default_path(env: dict[str, str] | None = None) -> Path:
    return state_dir(env) / "telemetry.db"


def sqlite_path(url: str, env: dict[str, str] | None = None) -> Path:
    """The file a ``sqlite://`` URL names (``sqlite://`` alone: :func:`default_path`).
    A ``#`` or ``?`` would end the path before it (another file): refused."""
    problem = unencoded_problem(url, options=False)
    if problem is not None:
        raise ConfigError(problem)
    path = unquote(urlsplit(url).path)
    if path in ("", "/"):
        return default_path(env)
    if path.startswith("//"):  # sqlite://///x, one slash too many: the same file
        path = "/" + path.lstrip("/")
    return Path(path)


def _wal(conn: sqlite3.Connection) -> None:
    """Switch to WAL, waiting out another connection's lock as the busy timeout does
    for statements: switching a fresh file answers SQLITE_BUSY at once, without the
    busy handler, while another process migrates it (processes starting together).
    A worker thread's blocking wait (``SQLiteSink.open`` runs in one)."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if not held_by_another(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def _connect(path: Path, *, read_only: bool = False, immutable: bool = False) -> sqlite3.Connection:
    """``immutable`` (read-only too): the file as it is, without WAL or locks."""
    if read_only or immutable:
        mode = "mode=ro&immutable=1" if immutable else "mode=ro"
        conn = sqlite3.connect(
            f"{path.absolute().as_uri()}?{mode}", uri=True, timeout=_BUSY_TIMEOUT_S,
            check_same_thread=False,
        )
    else:
        conn = sqlite3.connect(
            path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
    return conn


def _insert(conn: sqlite3.Connection, one_row: str, rows: Sequence[Sequence[Any]]) -> None:
    """``rows`` by ``one_row``'s INSERT, in statements of many rows each.

    Not ``executemany``: it steps SQLite once a row, and the sqlite3 module gives up
    the GIL around each step.  While the event loop keeps the GIL busy (a closed loop of
    calls on a fast upstream), each row waited for it again: a batch of a few hundred
    rows took seconds, and the channel behind it dropped most rows of the run."""
    if not rows:
        return
    head, _, marks = one_row.partition(" VALUES ")
    per = max(1, _MAX_PARAMS // len(rows[0]))
    for start in range(0, len(rows), per):
        chunk = rows[start : start + per]
        conn.execute(f"{head} VALUES {', '.join([marks] * len(chunk))}",
                     [value for row in chunk for value in row])


def _create_private(path: Path) -> None:
    """Create the database file (and any folder missing on its way) readable by its
    owner only: with ``log_content=True`` it holds every prompt and answer.  Folders
    polygate creates are 0700, the file 0600 (SQLite gives its ``-wal`` and ``-shm``
    files the database's mode).  Existing folders and files are left as they are."""
    missing = []
    folder = path.parent
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass  # another process made it first
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)


def _migrate(conn: sqlite3.Connection, where: str) -> int:
    """Create or upgrade the schema in one ``BEGIN IMMEDIATE`` transaction, so two
    processes opening a fresh file do not both create it.  Returns the version."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(version_table("sqlite"))
        found = conn.execute("SELECT max(version) FROM polygate_schema").fetchone()[0] or 0
        check_version(found, where)
        if not found:
            for (table,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND lower(name) IN (?, ?, ?)", TABLES
            ).fetchall():
                raise foreign_table(table, where, "it was there before polygate's schema")
        for version, stmts in statements("sqlite", found):
            for statement in stmts:
                conn.execute(statement)
            conn.execute("INSERT INTO polygate_schema VALUES (?, ?)", (version, time.time()))
            found = version
        for table, query in shape_checks():
            try:
                conn.execute(query)
            except sqlite3.Error as exc:
                raise foreign_table(table, where, exc) from None
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return int(found)


def _open_connection(
    path: Path, where: str, watch: Callable[[sqlite3.Connection | None], None] = lambda _: None,
) -> sqlite3.Connection:
    """A connection to ``path`` with the schema in place.  :class:`ConfigError` when the
    file cannot be a telemetry database; :class:`~polygate._sqlite_locks.DatabaseUnavailable` when
    it cannot be used for now (another connection held it past the busy timeout, its
    disk is full: see :func:`~polygate._sqlite_locks.unusable_for_now`).  ``watch`` is
    handed the connection while it waits for the file (None once it is done), so that
    an interrupt can reach it."""
    try:
        no_file_there(path)
        _create_private(path)
        conn = _connect(path)
    except (OSError, sqlite3.Error) as exc:
        why = unusable_for_now(exc, path)
        if why is not None:
            raise DatabaseUnavailable(why) from None
        raise ConfigError(f"cannot open the telemetry database {where}: {exc}") from None
    watch(conn)
    try:
        _wal(conn)
        conn.execute("PRAGMA synchronous=NORMAL")
        _migrate(conn, where)
    except ConfigError:
        conn.close()
        raise
    except sqlite3.Error as exc:
        conn.close()
        why = unusable_for_now(exc, path)
        if why is not None:
            raise DatabaseUnavailable(why) from None
        raise ConfigError(f"cannot use {where} as a telemetry database: {exc}") from None
    finally:
        watch(None)
    return conn


class SQLiteSink:
    """A :class:`~polygate.telemetry.Sink` writing to one SQLite file."""

    name = "sqlite"

    def __init__(self, conn: sqlite3.Connection | None, path: Path) -> None:
        #: None until the file is opened: a sink whose file was locked when the
        #: session started opens it with a later batch (see open).
        self._conn = conn
        self._closed = False
        # A write that opens the file (locked at the start) waits for it, out of
        # _conn's reach: the connection it waits on, and whether the pipeline gave
        # up on that write meanwhile (it must not land then: its rows are counted
        # dropped).
        self._opening: sqlite3.Connection | None = None
        self._abandoned = False
        self.path = path
        # (Shown in messages and warnings: on one line, whatever the name holds.)
        self._where = printable(f"sqlite://{path}" if path.is_absolute() else str(path))
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path) -> SQLiteSink:
        """Open (creating the file, its folder and the schema when missing); blocking.
        Raises :class:`ConfigError` when the file cannot be a telemetry database.  A
        file that cannot be used *for now* is no such error: one another connection
        holds locked past the busy timeout (a process migrating it, a long write, a
        ``VACUUM``), one on a full disk.  A dead sink never stops calls, so the sink
        starts without it, its rows are dropped and counted, and a later batch opens
        it (a batch while it stays unusable fails as a write)."""
        sink = cls(None, path)
        try:
            sink._conn = _open_connection(path, sink._where)
        except DatabaseUnavailable as exc:
            logger.warning(
                "telemetry database %s cannot be used for now: %s; calls go on, rows are "
                "dropped and counted until it can be written", sink._where, exc,
            )
        return sink

    def write(self, batch: Batch) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the telemetry database is closed")
            conn = self._conn
            if conn is None:  # locked when the session started: try again
                self._abandoned = False
                conn = self._conn = _open_connection(self.path, self._where, self._watch)
                if self._abandoned:  # (opened: the next batch writes on it)
                    raise RuntimeError("the write was abandoned while the file was opened")
            conn.execute("BEGIN")
            try:
                _insert(conn, _CALLS, batch.calls)
                _insert(conn, _ATTEMPTS, batch.attempts)
                if batch.session is not None:
                    conn.execute(_SESSION, batch.session)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _watch(self, conn: sqlite3.Connection | None) -> None:
        self._opening = conn

    def interrupt(self) -> None:
        # (From the trio thread, while a write runs in the worker.)
        self._abandoned = True
        conn = self._conn or self._opening
        if conn is not None:
            conn.interrupt()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class SQLiteReader:
    """Read-only access for ``polygate stats``: never creates a file or a table."""

    paramstyle = "?"

    def __init__(self, path: Path) -> None:
        self.where = printable(str(path))
        self._conn = _connect(path, read_only=True)
        try:
            self._conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.Error as exc:
            self._conn.close()  # (not left to the collector: a file that is no database)
            if not isinstance(exc, sqlite3.OperationalError) or "unable to open" not in str(exc):
                raise
            wal = path.with_name(path.name + "-wal")
            if wal.exists() and wal.stat().st_size > 0:
                # Committed rows may wait in the WAL (a writer killed, a copy taken
                # without its -shm): read as immutable, they would be missing, silently.
                raise ConfigError(
                    f"{path} is on a read-only volume and its write-ahead log {wal.name} "
                    "still holds rows; copy the database and its -wal file to a writable "
                    "folder and read the copy"
                ) from None
            # A closed WAL database on a read-only volume (a snapshot, a sidecar's
            # ``:ro`` mount): a reader must create its ``-shm`` file, and cannot.  No
            # writer can be live there (it would need that file too), and the WAL is
            # empty, so the file is read as immutable: as it is.
            self._conn = _connect(path, immutable=True)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def tables(self) -> set[str]:
        rows = self.query("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {r[0] for r in rows}

    def snapshot(self) -> AbstractContextManager[None]:
        # In WAL mode a read transaction sees the database as it was at its first read.
        return read_transaction(self._conn.execute, "BEGIN")

    def close(self) -> None:
        self._conn.close()
