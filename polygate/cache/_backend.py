"""The interface every cache backend implements, and the one error it raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["CacheBackend", "CacheBackendError", "Entry"]

#: ``(key, value, ttl_s)``: one entry to write, to expire ``ttl_s`` seconds later.
Entry = tuple[str, bytes, float]


class CacheBackendError(Exception):
    """A backend operation failed or ran out of time.  Never reaches a caller: the
    cache counts it and carries on as if the entry were absent (it fails open).
    The message names the backend (never a password) and what went wrong."""


class CacheBackend(Protocol):
    """Where entries live: in this process, a SQLite file, or Redis.

    ``get_many`` answers in the order asked, ``None`` for an absent or expired entry;
    ``set_many`` writes every entry with its own time to live.  Both raise
    :class:`CacheBackendError` (and nothing else) when the store fails, each within
    the backend's bound.  ``write_behind`` says whether writes are worth moving off
    the call path (they do I/O); the memory backend's are not, and none of its
    methods ever suspends.  ``start`` runs once in the session's task before any
    call, ``aclose`` once at the end.  ``start`` returns what failed when the store
    did not answer (the cache then fails open: the failure is counted and logged as
    any operation's), or None.
    """

    name: str
    write_behind: bool

    async def start(self) -> str | None: ...

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    async def set_many(self, entries: Sequence[Entry]) -> None: ...

    async def aclose(self) -> None: ...
