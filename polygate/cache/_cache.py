"""The cache a session owns: lookups that fail open, writes off the call path,
coalescing, and the counters ``Session.statistics()`` reports.

**Fail open.**  A backend that fails — Redis down or slow, SQLite locked past its
timeout, a value that does not decode — makes the lookup a miss: the call goes
upstream as if there were no cache, and the failure is counted (``errors``) and
logged at most every 10 s.  After a failure the backend is left alone for a short,
growing pause (0.25 s doubling to 30 s, reset by the first success), so a dead Redis
does not add its timeout to every call; lookups meanwhile are plain misses.

**Writes behind.**  For the SQLite and Redis backends a store is a ``send_nowait``
into a bounded channel; a writer task in the session's nursery writes batches (one
SQLite transaction, or one pipelined round trip to Redis).  Until its batch has been
written, an entry is served from ``pending``, so a call that follows its twin at once
still hits -- while the backend is up: while it is paused after a failure nothing is
served from, or put in, ``pending`` (a cache that fails is a miss, every time, not a
hit by the writer's timing).  A full channel drops the write (``writes_dropped``), never blocks a
call -- but for one call's own answers (``put_many``: an ``embed`` of thousands of new
inputs puts them all before the writer can run), which wait behind the channel, in
order, up to ``_OVERFLOW`` entries.  When the session ends the writer drains what is queued, each batch bounded by
the backend's own timeout, and gives up on the rest at the first failure or after
``_FLUSH_S``; every entry given up is counted in ``writes_dropped`` (queued ones too),
so ``writes + writes_dropped`` is every entry put.  The memory backend writes in place.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from .._coredis import import_coredis
from .._paths import state_dir
from .._sockets import out_of
from ._backend import CacheBackend, CacheBackendError
from ._coalesce import Coalescer
from ._memory import MemoryBackend
from ._url import CacheOptions, parse_cache_url

__all__ = ["Cache", "CacheStatistics", "open_cache"]

log = logging.getLogger("polygate.cache")

_QUEUE = 4096  # entries waiting for the writer
_OVERFLOW = 65_536  # more, from one call's put_many, waiting behind the channel
_BATCH = 256  # entries per write
_WRITE_EVERY_S = 0.02  # floor on the writer's period
_PAUSE_MIN_S = 0.25
_PAUSE_MAX_S = 30.0
_WARN_EVERY_S = 10.0
_FLUSH_S = 5.0  # the most a session's end waits for queued writes
_WRITTEN_KEYS = 4096  # the keys written last that written_since() knows by name


@attrs.frozen
class CacheStatistics:
    """What the response cache did in this session.

    Each cacheable lookup (one per ``chat``/``stream_chat`` call, one per distinct
    ``embed`` input) is exactly one of ``hits`` (found stored), ``coalesced`` (got the
    answer of an identical call in flight) or ``misses`` (went upstream, including
    ``cache="refresh"`` calls and lookups the backend failed).  ``errors`` counts
    failed backend operations: the check when the session opened (a Redis ``PING``,
    the SQLite file's opening), reads and writes; ``writes`` the entries stored,
    ``writes_dropped`` those given up (queue full, backend failing).  ``in_flight``:
    keys being computed right now.  Calls with ``cache=False``, and scopes without
    ``cache_ttl_s``, are not counted.
    """

    backend: str = "off"
    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    errors: int = 0
    writes: int = 0
    writes_dropped: int = 0
    in_flight: int = 0

    @property
    def hit_rate(self) -> float | None:
        """Share of lookups answered without an upstream call (hits and coalesced)."""
        served = self.hits + self.coalesced
        total = served + self.misses
        return served / total if total else None


_Pending = tuple[bytes, float]  # (value, expires at, trio time)


class Cache:
    """One session's response cache; see the module docstring."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend
        self.flights = Coalescer()
        self._memory = backend if isinstance(backend, MemoryBackend) else None
        #: Whether a lookup needs no I/O (the memory backend): ``get_local`` is the lookup.
        self.local = self._memory is not None
        self._pending: dict[str, _Pending] = {}
        self._send, self._recv = trio.open_memory_channel[tuple[str, _Pending]](_QUEUE)
        #: put_many's entries the channel had no room for; while any wait, every put
        #: waits behind them (the writer takes the channel, then these: in order).
        self._overflow: collections.deque[tuple[str, _Pending]] = collections.deque()
        self._writer_done = trio.Event()
        self._given_up = False  # aclose stopped waiting for the writer: drop, not write
        self._writing: trio.CancelScope | None = None  # the writer's write, shielded
        # What one steady write may take: the backend's timeout bounds it, this only
        # backs it up (a SQLite timeout_s may be up to 60 s).
        self._write_bound = float(getattr(backend, "timeout_s", 0.0)) + _FLUSH_S
        self._writer_started = False
        self._writer_scope = trio.CancelScope()  # aclose gives up on the writer with it
        self._closing = trio.Event()
        self._models: dict[tuple[str, bool], list[str]] = {}
        self._down_until = -math.inf
        self._pause = 0.0
        self._last_warning = -math.inf
        self._warned_down = False  # an outage was logged: its end is logged too
        self._down_kind: str | None = None  # what failed in it (see _answered)
        #: Batches written (see written_since): which batch wrote each of the keys
        #: written last, and the latest batch of the keys forgotten since.
        self.generation = 0
        self._written: dict[str, int] = {}
        self._forgotten = 0
        self.hits = 0
        self.misses = 0
        self.coalesced = 0
        self.errors = 0
        self.writes = 0
        self.writes_dropped = 0

    def __repr__(self) -> str:
        return f"<polygate cache {self.backend!r}>"

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(
            backend=self.backend.name, hits=self.hits, misses=self.misses,
            coalesced=self.coalesced, errors=self.errors, writes=self.writes,
            writes_dropped=self.writes_dropped, in_flight=len(self.flights),
        )

    def models(self, scope: str, scopes: Mapping[str, Any], *, chain: bool = True) -> list[str]:
        """The scope's source models, sorted (part of every key of the scope), then,
        with ``chain`` (a chat's), those of each scope of its fallback chain, named
        (``"fallback large: m"``): an answer may come from any of them, so pointing one
        at another model is a new key too.  A scope without a fallback, or an
        embedding's key (embeddings never fall back), has its own models only."""
        found = self._models.get((scope, chain))
        if found is None:
            found = sorted({s.model or "" for s in scopes[scope].sources})
            target = scopes[scope].fallback if chain else None
            seen = {scope}
            while target is not None and target not in seen:  # (settings refuse a loop)
                seen.add(target)
                found += [f"fallback {target}: {m}"
                          for m in sorted({s.model or "" for s in scopes[target].sources})]
                target = scopes[target].fallback
            self._models[(scope, chain)] = found
        return found

    # ------------------------------------------------------------------ reads

    async def get(self, key: str) -> bytes | None:
        """The stored value, or None: absent, expired, or the backend failed."""
        if self._memory is not None:
            # A checkpoint, as every trio operation has: a loop of hits must not starve
            # the other tasks, and a cancelled caller must not be served.
            await trio.lowlevel.checkpoint()
            return self._memory.get_now(key)
        if key in self._pending and trio.current_time() >= self._down_until:
            # Served from here without I/O, so with the same schedule point (and looked
            # at after it: the writer may have written the entry meanwhile).
            await trio.lowlevel.checkpoint()
            local = self.get_local(key)
            if local is not None:
                return local
        return (await self._read([key]))[0]

    def get_local(self, key: str) -> bytes | None:
        """What this process holds for ``key`` without asking the backend: the memory
        store, or an answer still waiting to be written behind.  A caller that found a
        miss after an await asks again here before it leads: an identical call may
        have finished (and left) meanwhile.

        Nothing is served from the write-behind while the backend is paused: a cache
        that fails is a miss, every time, not a hit or a miss by the writer's timing."""
        if self._memory is not None:
            return self._memory.get_now(key)
        pending = self._pending.get(key)
        if pending is not None:
            now = trio.current_time()
            if self._down_until <= now < pending[1]:
                return pending[0]
        return None

    def written_since(self, key: str, generation: int) -> bool:
        """Whether ``key`` may have been written since :attr:`generation` read
        ``generation``.  A lookup that missed, read from a backend while an identical
        call's answer was being written, may have read before the write committed,
        and find nothing here either (the write-behind lets go of what it wrote): it
        reads again rather than lead a second upstream call for a stored answer."""
        if generation == self.generation:
            return False
        written = self._written.get(key)
        return (written if written is not None else self._forgotten) > generation

    def _wrote(self, keys: Iterable[str]) -> None:
        self.generation += 1
        written = self._written
        for key in keys:
            written.pop(key, None)  # (to the end: the last written go last)
            written[key] = self.generation
        while len(written) > _WRITTEN_KEYS:
            oldest = next(iter(written))
            self._forgotten = max(self._forgotten, written.pop(oldest))

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if self._memory is not None:
            await trio.lowlevel.checkpoint()
            return [self._memory.get_now(k) for k in keys]
        now = trio.current_time()
        found: list[bytes | None] = [None] * len(keys)
        ask: list[int] = []
        up = now >= self._down_until  # (paused: nothing from the write-behind, see get_local)
        for i, key in enumerate(keys):
            pending = self._pending.get(key)
            if up and pending is not None and now < pending[1]:
                found[i] = pending[0]
            else:
                ask.append(i)
        if ask:
            values = await self._read([keys[i] for i in ask])
            for i, value in zip(ask, values, strict=True):
                found[i] = value
        else:
            await trio.lowlevel.checkpoint()  # all served from here: see get()
        return found

    async def _read(self, keys: list[str]) -> list[bytes | None]:
        if trio.current_time() < self._down_until:
            await trio.lowlevel.checkpoint()
            return [None] * len(keys)
        try:
            values = await self.backend.get_many(keys)
        except CacheBackendError as exc:
            self.failed(str(exc), kind="read")
            return [None] * len(keys)
        except Exception as exc:  # a bug in a backend must not fail the call either
            found = out_of(exc)
            if found is not None:  # (no bug: the process's limit; said without a traceback)
                self.failed(_out_of(found), kind="read")
                return [None] * len(keys)
            if trio.current_time() - self._last_warning >= _WARN_EVERY_S:
                log.exception("cache lookup failed")  # (its traceback: at most every 10 s)
            self.failed(f"{type(exc).__name__} in a lookup", kind="read")
            return [None] * len(keys)
        self._answered("read")
        return values

    def _answered(self, kind: str) -> None:
        """The backend answered a ``kind`` of operation (``"read"``, ``"write"``): the
        pause ends, and an outage that was logged is said to be over (without it, the
        log read as if the cache still failed) -- if it was that kind that failed: a
        backend whose writes fail while its reads work (a full Redis, a SQLite file
        another connection holds locked) said "answers again" at each lookup, and the
        next write's failure was a new outage, logged at once: two lines a call."""
        self._pause = 0.0
        if self._warned_down and self._down_kind in (None, kind):
            self._warned_down = False
            log.info("the cache answers again (%d error(s) so far)", self.errors)

    def failed(self, message: str, *, pause: bool = True, down: bool | None = None,
               kind: str | None = None) -> None:
        """Count a failed operation and pause the backend; ``pause=False`` for a bad
        entry (one that does not decode, an answer that cannot be encoded): the
        backend itself is fine.  ``down``: whether it says the backend is down (by
        default, when it pauses it; the check at the start says so without a pause).
        ``kind``: what failed (``"read"``, ``"write"``; None: the backend as a whole),
        which an answer of that kind says is over (see _answered)."""
        if down is None:
            down = pause
        self.errors += 1
        now = trio.current_time()
        if pause and now >= self._down_until:
            # Once per pause: the lookups in flight when the backend stalled all fail
            # together, and each doubling the pause would turn one short stall into the
            # 30 s cap (8 lookups: 0.25 s * 2^7).  A failure that ends during the pause
            # it caused changes nothing.
            self._pause = min(max(self._pause * 2, _PAUSE_MIN_S), _PAUSE_MAX_S)
            self._down_until = now + self._pause
        # At most every 10 s, but always at an outage's start after its last one's end
        # was said (a second outage within 10 s of "answers again" went unsaid, and the
        # log's last word was that the cache answered).
        if down and self._warned_down and self._down_kind != kind:
            # Both kinds failed in this outage (a warning of the first, the other's
            # within its 10 s): any answer ends it, or a backend down for all that
            # answers only lookups again would never be said to answer.
            self._down_kind = None
        if now - self._last_warning >= _WARN_EVERY_S or (down and not self._warned_down):
            self._last_warning = now
            if down:  # (a bad entry's warning says nothing of the backend)
                self._warned_down = True
                self._down_kind = kind
            log.warning("%s; the cache fails open (%d error(s) so far)", message, self.errors)

    # ------------------------------------------------------------------ writes

    def put(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store an answer; never blocks, never raises."""
        self.put_many([(key, value, ttl_s)], spill=False)

    def put_many(self, entries: Sequence[tuple[str, bytes, float]], *, spill: bool = True) -> None:
        """Store one call's answers; never blocks, never raises.  ``spill``: what the
        channel has no room for waits behind it (up to ``_OVERFLOW`` entries) rather
        than being dropped: the writer cannot run while one call puts its answers."""
        if self._memory is not None:
            stored = self._memory.put_now(entries)
            self.writes += stored
            self.writes_dropped += len(entries) - stored  # bigger than the whole store
            return
        now = trio.current_time()
        if now < self._down_until:
            # Paused: the writer would drop them; held meanwhile, they would be served.
            self.writes_dropped += len(entries)
            return
        overflow = self._overflow
        for key, value, ttl_s in entries:
            entry = (value, now + ttl_s)
            if not overflow:
                try:
                    self._send.send_nowait((key, entry))
                except trio.WouldBlock:
                    pass
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    self.writes_dropped += 1
                    continue
                else:
                    self._pending[key] = entry
                    continue
            if (spill or overflow) and len(overflow) < _OVERFLOW and not self._closing.is_set():
                overflow.append((key, entry))
                self._pending[key] = entry
            else:
                self.writes_dropped += 1

    async def run_writer(self) -> None:
        """The writer task (in the session's nursery) for write-behind backends.

        The loop's period has a floor of ``_WRITE_EVERY_S``: the first answer of a
        burst is written at once, the rest gather meanwhile and go as one batch, so a
        stream of misses costs a write per period, not one each (on Redis, a write
        per call would also queue behind the next call's lookup on the connection)."""
        try:
            with self._writer_scope:
                while True:
                    batch = self._queued(_BATCH)  # (the overflow waits behind a full channel)
                    if not batch:
                        try:
                            first = await self._recv.receive()
                        except (trio.EndOfChannel, trio.ClosedResourceError):
                            break
                        batch = [first, *self._queued(_BATCH - 1)]
                    # A batch taken is written, even if the session is cancelled
                    # meanwhile (a caller's time budget): shielded, bounded by the
                    # backend's own timeout (with room: the backend enforces it) and by
                    # aclose, which cancels it when it gives up on the writer.
                    with trio.CancelScope(shield=True) as self._writing:  # bounded
                        self._writing.deadline = trio.current_time() + self._write_bound
                        await self._write(batch)
                    if self._writing.cancelled_caught and not self._given_up:
                        # Its bound fell (a backend past its own timeout): the batch is
                        # dropped, and that is a failed write like any other.
                        self.failed(f"a cache write took longer than {self._write_bound:g} s",
                                    kind="write")
                    with trio.move_on_after(_WRITE_EVERY_S):
                        await self._closing.wait()  # closing: drain without pause
        finally:
            if not self._given_up:
                # Cancelled with the session (a caller's time budget, Ctrl-C): what is
                # queued is still written, as at a normal end -- shielded, and bounded
                # as aclose's drain is (each batch by the backend's timeout).
                with trio.CancelScope(shield=True) as self._writing:  # bounded
                    self._writing.deadline = trio.current_time() + _FLUSH_S
                    while batch := self._queued(_BATCH):
                        await self._write(batch)
            # Whatever is still queued (the writer was given up on, or its drain ran
            # out of time) will never be written: counted, not lost.
            self._drop_queued()
            self._writer_done.set()

    def _queued(self, most: int) -> list[tuple[str, _Pending]]:
        """Up to ``most`` entries already queued, without waiting: the channel's, then
        the overflow's (put after them)."""
        batch: list[tuple[str, _Pending]] = []
        while len(batch) < most:
            try:
                batch.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        overflow = self._overflow
        while overflow and len(batch) < most:
            batch.append(overflow.popleft())
        return batch

    def _drop_queued(self) -> None:
        while True:
            try:
                key, entry = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._dropped(key, entry)
        while self._overflow:
            self._dropped(*self._overflow.popleft())

    def _dropped(self, key: str, entry: _Pending) -> None:
        self.writes_dropped += 1
        if self._pending.get(key) is entry:
            del self._pending[key]

    async def _write(self, batch: list[tuple[str, _Pending]]) -> None:
        """Write one batch; each of its entries ends up in ``writes`` or in
        ``writes_dropped``, a batch cancelled midway (given up at close) in the latter
        (an abandoned SQLite write is interrupted; should its commit have won the race,
        the entries are stored yet counted dropped — never counted twice).

        An entry is stored for what is left of its time to live, which counts from its
        answer, not from this write: a write that the store held up (a lock, a slow
        Redis) must not keep an answer past ``cache_ttl_s``.  One that expired while it
        waited is not written (counted dropped)."""
        written = 0
        try:
            now = trio.current_time()
            if now < self._down_until:
                return
            live = [(key, value, expires - now) for key, (value, expires) in batch if expires > now]
            if not live:
                return
            try:
                await self.backend.set_many(live)
            except CacheBackendError as exc:
                self.failed(str(exc), kind="write")
            except Exception as exc:
                found = out_of(exc)
                if found is None:
                    log.exception("cache write failed")
                self.failed(_out_of(found) if found else f"{type(exc).__name__} in a write",
                            kind="write")
            else:
                self._answered("write")
                written = len(live)
                self._wrote(key for key, _, _ in live)
        finally:
            self.writes += written
            self.writes_dropped += len(batch) - written
            for key, entry in batch:
                if self._pending.get(key) is entry:
                    del self._pending[key]

    def start(self, nursery: trio.Nursery) -> None:
        """Start the writer in the session's nursery (write-behind backends only)."""
        if self.backend.write_behind:
            self._writer_started = True
            nursery.start_soon(self.run_writer, name="polygate cache writer")

    async def aclose(self) -> None:
        """Stop taking writes and let the writer drain the queue: shielded, each batch
        bounded by the backend's timeout, the rest dropped at the first failure, and
        all of it within ``_FLUSH_S``.  Call it before cancelling the writer's nursery.

        At ``_FLUSH_S`` the writer is given up on: the batch it is writing and what is
        still queued are counted in ``writes_dropped`` before this returns."""
        self._send.close()
        self._closing.set()
        if not self._writer_started:
            self._drop_queued()
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_FLUSH_S):
                await self._writer_done.wait()
            # The writer's backend calls abandon their threads or sockets when
            # cancelled, so this is at once; bounded all the same (no unbounded shield).
            self._given_up = True
            self._writer_scope.cancel()
            if self._writing is not None:
                self._writing.cancel()
            with trio.move_on_after(1.0):
                await self._writer_done.wait()
        if self._writer_done.is_set():
            self._drop_queued()  # put between the writer's end and the close: counted


def _backend(options: CacheOptions) -> CacheBackend:
    if options.kind == "memory":
        return MemoryBackend(options.max_entries, options.max_bytes)
    if options.kind == "sqlite":
        from ._sqlite import SQLiteBackend

        path = options.path if options.path is not None else state_dir() / "cache.db"
        return SQLiteBackend(path, timeout_s=options.timeout_s)
    from ._redis import RedisBackend

    return RedisBackend.from_options(options)


def check_cache(url: str) -> None:
    """The ConfigError :func:`open_cache` would raise before any I/O (a missing
    coredis for ``redis://``), or nothing: for ``polygate check-config``."""
    if parse_cache_url(url).kind == "redis":
        import_coredis("the redis cache")


@asynccontextmanager
async def open_cache(url: str) -> AsyncIterator[Cache | None]:
    """The cache ``Settings.cache`` names (None for ``"off"``), its backend started;
    leaving closes the backend.  The session starts the writer (:meth:`Cache.start`)
    and flushes it (:meth:`Cache.aclose`) before its nursery is cancelled.

    A SQLite file that cannot be opened is a :class:`~polygate.ConfigError` here; an
    unreachable Redis is not (the cache fails open until it answers)."""
    options = parse_cache_url(url)
    del url  # (a ConfigError's frames would show it, its password too: see frameless)
    if options.kind == "off":
        yield None
        return
    backend = _backend(options)
    failure = await backend.start()
    try:
        cache = Cache(backend)
        if failure is not None:
            # Counted, and logged at most every 10 s with the failures to come; not a
            # pause: the first lookup or write tries again (a SQLite file locked at
            # the start opens then).
            cache.failed(failure, pause=False, down=True)
        yield cache
    finally:
        await backend.aclose()


def _out_of(found: tuple[str, str]) -> str:
    """A backend's failure for want of a resource of this process's (a thread for a
    SQLite file's work, a descriptor), in the words of the call's own errors."""
    what, code = found
    return f"this process ran out of {what} ({code})"
