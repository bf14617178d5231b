"""JSON at msgspec's speed, with the standard library's answers.

A cache hit decodes a stored answer and hashes a canonical key: with the standard
``json`` module those two were 9 of a memory hit's 23 µs; msgspec does them in 4
(``benchmarks/cache.py``, docs/benchmarks.md).  Upstream chunks and bodies, and the
gateway's requests, are read here too: an SSE chunk in 0.4 µs instead of 1.4.
msgspec is chosen over orjson because it reads integers beyond 64 bits exactly, where
orjson silently turns them into floats.

Every function here returns exactly what ``json`` would.  Where msgspec refuses a
document ``json`` accepts (a ``NaN`` or ``Infinity`` token, a number that overflows a
double, an escaped lone surrogate, a byte-order mark), the standard library decides;
where it would write what ``json`` would not (``NaN`` as ``null``, which would make
two different values one key), the caller is told to use the standard library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["dumps", "loads", "sorted_dumps"]

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_encode_sorted = msgspec.json.Encoder(order="sorted").encode


def loads(data: bytes | bytearray | str, fallback: Callable[[Any], Any] = json.loads) -> Any:
    """``fallback(data)``, by default ``json.loads(data)``, faster.

    What msgspec reads, it reads as ``json.loads`` does, and only from strict UTF-8
    without a lone surrogate.  What it refuses (invalid UTF-8 included, and a document
    nested deeper than it goes) is handed to ``fallback``, which returns what it
    always did or raises its own error: a bad document fails exactly as before."""
    try:
        return _decode(data)
    except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
        return fallback(data)


def dumps(value: Any) -> bytes | None:
    """Compact JSON of ``value`` in UTF-8 (``json``'s ``separators=(",", ":")``,
    ``ensure_ascii=False``); ``None`` when only the standard library can write it as
    ``json`` would: see :func:`sorted_dumps`."""
    return _checked(_encode, value)


def sorted_dumps(value: Any) -> bytes | None:
    """Compact JSON of ``value`` with object keys sorted, as UTF-8; ``None`` when only
    the standard library can write it faithfully.

    ``value`` should hold JSON's types (``dict`` with string keys, ``list``, ``tuple``,
    ``str``, ``int``, ``float``, ``bool``, ``None``).  ``None`` is returned for a
    non-finite float (msgspec writes it as ``null``), a lone surrogate (not UTF-8) and
    anything msgspec refuses."""
    return _checked(_encode_sorted, value)


def _checked(encode: Callable[[Any], bytes], value: Any) -> bytes | None:
    try:
        encoded = encode(value)
    except (TypeError, ValueError, OverflowError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    # msgspec writes NaN and ±Infinity as null: look for them only when a null is
    # there at all, which in a chat key or an answer is rare.
    if b"null" in encoded and _has_non_finite(value):
        return None
    return encoded


def _has_non_finite(value: Any) -> bool:
    """Whether a non-finite float is anywhere in ``value``: a walk with a stack of its
    own, so a value msgspec wrote however deep never exhausts Python's."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return False
