"""What polygate's two SQLite stores (the telemetry sink, the response cache) share:
telling a file another connection holds, for now, from one that cannot be used."""

from __future__ import annotations

import sqlite3

__all__ = ["held_by_another"]

_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6


def held_by_another(exc: BaseException) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED: another connection holds the file, for now (by
    the error's code from Python 3.11, by its message before)."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)
