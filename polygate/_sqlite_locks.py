"""What polygate's two SQLite stores (the telemetry sink, the response cache) share:
telling a file that cannot be used *for now* (another connection holds it, its disk
is full or failing) from one that cannot be used at all (a configuration error), and
refusing a path that is no file before anything opens it."""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from pathlib import Path

__all__ = ["DatabaseUnavailable", "held_by_another", "no_file_there", "unusable_for_now"]

_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_IOERR = 10
_SQLITE_FULL = 13

#: An operating-system error opening the file that says as much about the disk as
#: SQLITE_FULL and SQLITE_IOERR do (the file could not be created on a full disk).
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


class DatabaseUnavailable(Exception):
    """The database cannot be used for now; the message says why (see
    :func:`unusable_for_now`)."""


def _says(exc: BaseException, codes: tuple[int, ...], words: tuple[str, ...]) -> bool:
    """Whether the SQLite error ``exc`` is one of ``codes`` (its primary code, which
    Python gives from 3.11) or, before, has one of ``words`` in its message."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in codes
    return any(word in str(exc) for word in words)


def held_by_another(exc: BaseException) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED: another connection holds the file, for now."""
    return _says(exc, (_SQLITE_BUSY, _SQLITE_LOCKED), ("locked", "busy"))


def _disk_failed(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in _DISK_ERRNOS
    return _says(exc, (_SQLITE_IOERR, _SQLITE_FULL), ("disk I/O error", "disk is full"))


def unusable_for_now(exc: BaseException, path: Path) -> str | None:
    """Why the database at ``path`` cannot be used for now, when that is what ``exc``
    says; None when it cannot be used at all.

    For now: another connection holds it, or its disk failed it.  A full disk is the
    common case of the second: a WAL database opened where its ``-shm`` file cannot be
    created answers "disk I/O error" (SQLITE_IOERR_SHMSIZE) to its first statement,
    which would otherwise read as a file that can never work.  A database that worked
    yesterday on a disk that filled overnight is no configuration error: the store
    starts without it (rows dropped and counted, the cache failing open) and opens it
    once it can."""
    if held_by_another(exc):
        return f"the file is locked ({exc})"
    if not _disk_failed(exc):
        return None
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if _no_space(path):
        return f"no space left on its disk ({detail})"
    return f"its disk failed it ({detail})"


def _no_space(path: Path) -> bool:
    """Whether the file system holding ``path`` (or its nearest existing folder) has no
    block left for this process."""
    for where in (path, *path.parents):
        try:
            found = os.statvfs(where)
        except OSError:
            continue
        return found.f_bavail == 0
    return False


def no_file_there(path: Path) -> None:
    """Raise an :class:`OSError` when ``path`` exists and is no regular file (through
    its links).  A FIFO's open blocks until a writer comes (a worker thread held for
    good, the session's start held for the busy timeout), a device's reads are not a
    database's: each is a configuration error, said as such at once."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing (made next), or unreadable: the open says why
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "no file")
        raise OSError(errno.EINVAL, f"it is {kind}, not a regular file")
