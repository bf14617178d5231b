"""The response cache (SPEC §8.3): canonical keys, coalescing, and three backends.

Knows nothing of the transport, admission or hedging (an import-linter contract keeps
it so): the session wraps each logical call with it (see ``polygate._cached``), and a
hit never enters the retry loop.  See ``docs/cache.md``.
"""

from ._backend import CacheBackend as CacheBackend
from ._backend import CacheBackendError as CacheBackendError
from ._cache import Cache as Cache
from ._cache import CacheStatistics as CacheStatistics
from ._cache import open_cache as open_cache
from ._key import EXCLUDED_PARAMS as EXCLUDED_PARAMS
from ._key import ORDERED_PARAMS as ORDERED_PARAMS
from ._key import canonical_json as canonical_json
from ._key import chat_key as chat_key
from ._key import embed_keys as embed_keys
from ._memory import MemoryBackend as MemoryBackend
from ._url import CacheOptions as CacheOptions
from ._url import parse_cache_url as parse_cache_url

__all__ = [
    "EXCLUDED_PARAMS",
    "ORDERED_PARAMS",
    "Cache",
    "CacheBackend",
    "CacheBackendError",
    "CacheOptions",
    "CacheStatistics",
    "MemoryBackend",
    "canonical_json",
    "chat_key",
    "embed_keys",
    "open_cache",
    "parse_cache_url",
]
