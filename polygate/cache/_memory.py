"""The in-process backend: an LRU bounded by entries and by bytes, with per-entry TTL.

Time is trio's clock (``trio.current_time()``), so ``MockClock`` tests drive expiry.
Nothing here suspends or does I/O: a lookup is a dict access, which is why the cache
calls :meth:`MemoryBackend.get_now` directly on the hot path.  ``bytes`` counts what
an entry costs here: its value, its key and a fixed allowance for the bookkeeping
around them (an ``OrderedDict`` node and a tuple), so the bound tracks real memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
import trio

from ._backend import Entry

__all__ = ["MemoryBackend", "MemoryStatistics"]

_OVERHEAD = 200  # bytes of bookkeeping per entry, besides the key and the value


@attrs.frozen
class MemoryStatistics:
    entries: int
    bytes: int
    evicted: int  # pushed out by the entry or byte bound
    expired: int  # found past their TTL


class MemoryBackend:
    name = "memory"
    write_behind = False

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._evicted = 0
        self._expired = 0

    def __repr__(self) -> str:
        return f"<MemoryBackend {len(self._data)} entries, {self._bytes} bytes>"

    async def start(self) -> str | None:
        return None

    async def aclose(self) -> None:
        self._data.clear()
        self._bytes = 0

    def statistics(self) -> MemoryStatistics:
        return MemoryStatistics(len(self._data), self._bytes, self._evicted, self._expired)

    # ------------------------------------------------------------------ hot path

    def get_now(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        value, expires_at = item
        if trio.current_time() >= expires_at:
            self._drop(key, value)
            self._expired += 1
            return None
        self._data.move_to_end(key)
        return value

    def put_now(self, entries: Sequence[Entry]) -> int:
        """Store the entries; returns how many were stored (one over ``max_bytes`` on
        its own is not: it would evict everything and still not fit)."""
        now = trio.current_time()
        stored = 0
        for key, value, ttl_s in entries:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= _cost(key, old[0])
            cost = _cost(key, value)
            if cost > self.max_bytes:
                continue
            stored += 1
            self._data[key] = (value, now + ttl_s)
            self._bytes += cost
            while len(self._data) > self.max_entries or self._bytes > self.max_bytes:
                oldest, (gone, _) = self._data.popitem(last=False)
                self._bytes -= _cost(oldest, gone)
                self._evicted += 1
        return stored

    def _drop(self, key: str, value: bytes) -> None:
        del self._data[key]
        self._bytes -= _cost(key, value)

    # ------------------------------------------------------------------ protocol

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get_now(k) for k in keys]

    async def set_many(self, entries: Sequence[Entry]) -> None:
        self.put_now(entries)


def _cost(key: str, value: bytes) -> int:
    return len(key) + len(value) + _OVERHEAD
