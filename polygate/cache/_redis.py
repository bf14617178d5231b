"""The shared backend: Redis, through coredis, for every process that points at it.

An entry is one string key, ``{prefix}:{sha256 hex}``, written with ``SET … PX ttl``:
Redis keeps the time to live and drops the entry itself.  A lookup is one ``GET`` (or
one ``MGET`` for an ``embed`` call's inputs): one round trip.  Writes are batched by
the cache's writer, off the call path, and pipelined on one connection: a batch is one
round trip whatever its size.

Commands go straight to a pooled connection (``create_request``), as the governance
backend does: coredis's command layer costs more CPU than the round trip on
loopback.  Every operation is bounded by ``timeout_s`` (default 0.5 s); past it, or on
any coredis, OS or protocol error, it raises :class:`CacheBackendError` and the cache
carries on without it (fails open).  coredis reconnects by itself on the next
command, so once Redis is back the cache works again.  A cancelled lookup abandons its
request; the connection still reads the reply and stays in order.

Starting never fails the session: an unreachable Redis (or one that refuses the
credentials) is logged and then treated like any other failing cache.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from .._coredis import closing_connection_class, import_coredis, server_words
from .._redis_url import client_tls
from ._backend import CacheBackendError, Entry
from ._url import CacheOptions

log = logging.getLogger("polygate.cache")

__all__ = ["RedisBackend"]

T = TypeVar("T")


class RedisBackend:
    name = "redis"
    write_behind = True

    def __init__(self, options: CacheOptions) -> None:
        self.options = options
        self.timeout_s = options.timeout_s
        self._where = options.where()
        self._prefix = options.prefix + ":"
        self._client: Any = None
        self._errors: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        #: Round trips waited for: lookups (on a call's path) and write batches (behind).
        self.read_round_trips = 0
        self.write_round_trips = 0

    @classmethod
    def from_options(cls, options: CacheOptions) -> RedisBackend:
        import_coredis("the redis cache")  # ConfigError at once when the extra is missing
        return cls(options)

    def __repr__(self) -> str:
        return f"<RedisBackend {self._where} prefix={self.options.prefix!r}>"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str | None:
        coredis = import_coredis("the redis cache")
        self._errors = coredis.exceptions
        opts = self.options
        ssl_kw = client_tls(opts.ssl, opts.ssl_ca_certs, opts.ssl_cert_reqs, log=log,
                            where=f"cache {self._where}",
                            exposed="the Redis password, every prompt and answer, and rewrite answers")
        self._client = coredis.Redis(
            host=opts.host, port=opts.port, db=opts.db, username=opts.username,
            password=opts.password, connect_timeout=self.timeout_s * 0.5,
            stream_timeout=self.timeout_s, pool_timeout=self.timeout_s,
            # (No client name: coredis would send CLIENT SETNAME at each connection and
            # fail it where an ACL or rename-command refuses CLIENT, a common hardening.)
            retry_policy=coredis.retry.NoRetryPolicy(), **ssl_kw,
        )
        self._client.connection_pool.connection_class = closing_connection_class(coredis)
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self._client)
        self._stack = stack
        try:
            # An MGET under the prefix, not a PING: the commands the cache uses are the
            # ones a least-privilege user is given (a user without PING logged an
            # outage at every start, though the cache worked).
            await self._bounded(lambda: self._client.mget([self._prefix + "probe"]), "MGET")
        except CacheBackendError as exc:
            return str(exc)  # counted and logged with the other failures (open_cache)
        return None

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            # No cancel scope around it: it exits the client's task group, which
            # start() entered outside any scope of ours.
            await stack.aclose()

    # ------------------------------------------------------------------ operations

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        names = [self._prefix + k for k in keys]

        async def send() -> Any:
            # MGET even for one key: a key of another type under the prefix (another
            # program's hash) reads as nil, a miss the answer's SET then writes over;
            # GET fails on it (WRONGTYPE), and the failure would pause the whole cache.
            return await self._request(b"MGET", *names)

        self.read_round_trips += 1
        values = await self._bounded(send, "MGET")
        if not isinstance(values, list) or len(values) != len(names):
            raise CacheBackendError(f"cache {self._where}: unexpected reply to a lookup")
        return [v if isinstance(v, bytes) else None for v in values]

    async def set_many(self, entries: Sequence[Entry]) -> None:
        async def send() -> None:
            pool = self._client.connection_pool
            connection = await pool.get_connection()
            try:
                requests = [
                    connection.create_request(
                        b"SET", self._prefix + key, value, b"PX", _px(ttl_s)
                    )
                    for key, value, ttl_s in entries
                ]
            finally:
                pool.release(connection)
            for request in requests:  # pipelined: the replies arrive together
                await request

        self.write_round_trips += 1
        await self._bounded(send, "SET")

    # ------------------------------------------------------------------ plumbing

    async def _request(self, command: bytes, *args: Any) -> Any:
        pool = self._client.connection_pool
        connection = await pool.get_connection()
        try:
            request = connection.create_request(command, *args)
        finally:
            pool.release(connection)
        return await request

    async def _bounded(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        if self._client is None:
            raise CacheBackendError(f"cache {self._where} is not started")
        with trio.move_on_after(self.timeout_s):
            try:
                return await op()
            except Exception as exc:  # coredis, OS and protocol errors, their groups
                raise CacheBackendError(self._failure(what, exc)) from None
        raise CacheBackendError(f"cache {self._where} did not answer {what} within {self.timeout_s} s")

    def _failure(self, what: str, exc: BaseException) -> str:
        errors = self._errors
        if errors is not None and isinstance(exc, errors.AuthenticationError):
            return f"cache {self._where} refused the credentials"
        root = exc
        while root.__cause__ is not None and root.__cause__ is not root:
            root = root.__cause__
        text = f"{type(root).__name__}: {root}" if str(root) else type(root).__name__
        return f"cache {self._where} failed {what} ({server_words(text, self.options.password)[:300]})"


#: The longest expiry written, in ms (~31,700 years).  Redis refuses a ``PX`` past a
#: 64-bit millisecond time ("value is not an integer or out of range"), and one
#: refused ``SET`` fails the pipelined batch it travels in.
_MAX_PX = 10**15


def _px(ttl_s: float) -> int:
    """A TTL (finite, > 0: validated in Settings) as Redis's ``PX``: at least 1 ms."""
    return max(1, int(min(ttl_s * 1000, _MAX_PX)))  # min first: 1e308 * 1000 is inf
