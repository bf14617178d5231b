"""The ``Settings.cache`` value, parsed and checked before any I/O.

::

    off                                   no cache (the default)
    memory[?max_entries=N&max_bytes=N]    in-process LRU
    sqlite:///abs/path/cache.db[?timeout_s=S]
    sqlite://                             the default file: <state dir>/cache.db
    redis://[user[:password]@]host[:port][/db][?prefix=P&timeout_s=S]
    rediss://…[&ssl_ca_certs=PATH&ssl_cert_reqs=required|optional|none]

Every problem is a :class:`~polygate.ConfigError` whose message names it (the scheme,
the option, the value) and never holds the password: URLs in messages are masked.
The messages carry no ``cache:`` prefix; the settings validator adds the field name
(``Settings.cache: …``) and the loaders the key (``POLYGATE__CACHE: …``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs

from .._errors import ConfigError
from .._paths import file_path_problem, unencoded_problem
from .._redis_url import SHARED_OPTIONS, check_tls_options, redis_address, shared_option

__all__ = ["CacheOptions", "parse_cache_url"]

Kind = Literal["off", "memory", "sqlite", "redis"]

_DEFAULT_MAX_ENTRIES = 10_000
_DEFAULT_MAX_BYTES = 64 * 1024 * 1024
_INT_OPTIONS = {"max_entries": (1, 10**9), "max_bytes": (1024, 2**40)}
_TIMEOUT = (0.01, 60.0)


@attrs.frozen
class CacheOptions:
    """A parsed ``Settings.cache``.  ``repr`` and :meth:`where` never show the password.

    ``timeout_s`` bounds one backend operation (a read on the call path, a write
    batch): past it the operation counts as failed and the call goes on as a miss.
    """

    kind: Kind
    max_entries: int = _DEFAULT_MAX_ENTRIES
    max_bytes: int = _DEFAULT_MAX_BYTES
    path: Path | None = None  # sqlite; None: the default file under the state directory
    timeout_s: float = 1.0
    host: str | None = None
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ssl: bool = False
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: str | None = None
    prefix: str = "polygate:cache"

    def where(self) -> str:
        """The cache as it may be shown: ``memory``, ``sqlite:///…``, ``redis://host:port/db``."""
        if self.kind == "sqlite":
            return f"sqlite://{self.path}" if self.path is not None else "sqlite://"
        if self.kind == "redis":
            scheme = "rediss" if self.ssl else "redis"
            host = f"[{self.host}]" if self.host and ":" in self.host else self.host
            user = f"{self.username}@" if self.username else ""
            return f"{scheme}://{user}{host}:{self.port}/{self.db}"
        return self.kind


def _masked(url: str) -> str:
    from .._config import mask_url  # lazy: _config imports this module to validate

    return mask_url(url)


def parse_cache_url(url: Any) -> CacheOptions:
    """``Settings.cache`` → :class:`CacheOptions`, or :class:`ConfigError` naming the problem."""
    if not isinstance(url, str):
        raise ConfigError(f"must be 'off', 'memory', sqlite:///path or redis://…, got {type(url).__name__}")
    if url == "off":
        return CacheOptions(kind="off")
    from .._config import _BAD_URL, _url_problem  # lazy: _config imports this module

    shown = _masked(url)
    if not url.startswith("sqlite:"):
        # As the backend's URL: the words never quote the URL, nor a parser's error
        # text (which can hold the start of a password: "Port could not be cast to
        # integer value as 'k9Xq'").
        problem = _url_problem(url)
        if problem is not None:
            raise ConfigError(f"{shown!r} {problem}" if problem == _BAD_URL else problem)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{shown!r} {_BAD_URL}") from None
    query = parse_qsl(parts.query, keep_blank_values=True)
    if (parts.scheme, parts.netloc, parts.path) in (("", "", "memory"), ("memory", "", "")):
        return _memory(query)
    if parts.scheme == "sqlite":
        return _sqlite(url, parts, query)
    if parts.scheme in ("redis", "rediss"):
        if parts.fragment:  # (as Settings.backend refuses it: an unencoded '#' in a password, say)
            raise ConfigError(f"{shown!r} {_BAD_URL}")
        return _redis(shown, parts, port, query)
    from .._config import shown as quoted  # lazy: _config imports this module

    raise ConfigError(
        f"unknown cache {quoted(url)}: expected 'off', 'memory', sqlite:///path or redis://host:port/db"
    )


def _memory(query: list[tuple[str, str]]) -> CacheOptions:
    options: dict[str, Any] = {}
    for name, value in query:
        if name not in _INT_OPTIONS:
            raise _unknown(name, "memory", _INT_OPTIONS)
        lo, hi = _INT_OPTIONS[name]
        try:
            number = int(value)
        except ValueError:
            number = lo - 1
        if not lo <= number <= hi:
            raise ConfigError(f"option {name} must be a whole number in [{lo}, {hi}], got {value!r}")
        options[name] = number
    return CacheOptions(kind="memory", **options)


def _sqlite(url: str, parts: Any, query: list[tuple[str, str]]) -> CacheOptions:
    if parts.netloc or not (url.startswith("sqlite:///") or parts.path == ""):
        raise ConfigError(
            f"a SQLite cache is sqlite:///absolute/path.db (three slashes), got {_masked(url)!r}"
        )
    options: dict[str, Any] = {}
    for name, value in query:
        if name != "timeout_s":
            raise _unknown(name, "sqlite", ["timeout_s"])
        options[name] = _timeout(value)
    path = unquote(parts.path)
    problem = unencoded_problem(url, options=True) or file_path_problem(path)
    if problem is not None:
        raise ConfigError(problem)
    return CacheOptions(kind="sqlite", path=Path(path) if path not in ("", "/") else None, **options)


def _redis(shown: str, parts: Any, port: int | None, query: list[tuple[str, str]]) -> CacheOptions:
    address = redis_address(shown, parts, port)
    options: dict[str, Any] = {"timeout_s": 0.5}
    for name, value in query:
        if name == "timeout_s":
            options[name] = _timeout(value)
        elif not shared_option(options, name, value):
            raise _unknown(name, "redis", ["timeout_s", *SHARED_OPTIONS])
    check_tls_options(parts.scheme, options)
    return CacheOptions(kind="redis", **address, **options)


def _timeout(value: str) -> float:
    lo, hi = _TIMEOUT
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not lo <= number <= hi:  # NaN fails both comparisons
        raise ConfigError(f"option timeout_s must be a number of seconds in [{lo}, {hi}], got {value!r}")
    return number


def _unknown(name: str, kind: str, known: Any) -> ConfigError:
    listed = ", ".join(sorted(known))
    return ConfigError(f"unknown option {name!r} for a {kind} cache (known: {listed})")
