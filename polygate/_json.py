"""JSON at msgspec's speed, with the standard library's answers.

A cache hit decodes a stored answer and hashes a canonical key: with the standard
``json`` module those two were 9 of a memory hit's 23 µs; msgspec does them in 2
(``benchmarks/cache.py``, docs/benchmarks.md).  msgspec is chosen over orjson because it
reads integers beyond 64 bits exactly, where orjson silently turns them into floats.

Every function here returns exactly what ``json`` would.  Where msgspec refuses a
document ``json`` accepts (a ``NaN`` or ``Infinity`` token, a number that overflows a
double, an escaped lone surrogate, a byte-order mark), the standard library decides;
where it would write what ``json`` would not (``NaN`` as ``null``, which would make
two different values one key), the caller is told to use the standard library.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

__all__ = ["loads", "sorted_dumps"]

_decode = msgspec.json.Decoder().decode
_encode_sorted = msgspec.json.Encoder(order="sorted").encode


def loads(data: bytes | bytearray) -> Any:
    """``json.loads(data.decode("utf-8", "surrogatepass"))``, faster.

    Invalid UTF-8 (a surrogate written with ``surrogatepass``) and what msgspec refuses
    go to the standard library, so a bad document raises its ``ValueError`` (or
    ``UnicodeDecodeError``, one) as before."""
    try:
        return _decode(data)
    except ValueError:  # msgspec.DecodeError is one
        return json.loads(data.decode("utf-8", "surrogatepass"))


def sorted_dumps(value: Any) -> bytes | None:
    """Compact JSON of ``value`` with object keys sorted, as UTF-8; ``None`` when only
    the standard library can write it faithfully.

    ``value`` must already be canonical (``dict``/``list``/``str``/``int``/``float``/
    ``bool``/``None``, string keys).  ``None`` is returned for a non-finite float (msgspec
    writes it as ``null``), a lone surrogate (not UTF-8) and anything msgspec refuses."""
    try:
        encoded = _encode_sorted(value)
    except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
        return None
    # msgspec writes NaN and ±Infinity as null: look for them only when a null is
    # there at all, which in a chat key is rare.
    if b"null" in encoded and _has_non_finite(value):
        return None
    return encoded


def _has_non_finite(value: Any) -> bool:
    kind = type(value)
    if kind is float:
        return not math.isfinite(value)
    if kind is dict:
        return any(_has_non_finite(v) for v in value.values())
    if kind is list:
        return any(_has_non_finite(v) for v in value)
    return False
