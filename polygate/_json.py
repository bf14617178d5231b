"""JSON at msgspec's speed, with the standard library's answers.

A cache hit decodes a stored answer and hashes a canonical key: timed in a loop of
hits, each piece wrapped, those two took 9 of a memory hit's 23 µs with the standard
``json`` module and take 4.6 with msgspec (docs/benchmarks.md).  Upstream chunks and
bodies, and the gateway's requests and answers, are read and written here too: an SSE
chunk is read in 0.35 µs instead of 1.4.  msgspec is chosen over orjson because it
reads integers beyond 64 bits exactly, where orjson silently turns them into floats.

For JSON's own types (dicts with string keys, lists, strings, numbers, booleans, None)
every function here returns exactly what ``json`` would.  Where msgspec refuses a
document ``json`` accepts (a ``NaN`` or ``Infinity`` token, a number that overflows a
double, an escaped lone surrogate, a byte-order mark), the caller's fallback decides;
where it would write what ``json`` would not (``NaN`` as ``null``, which would make
two different values one key), the caller is told to use the standard library.  Other
types are the caller's to keep out: msgspec writes bytes, sets, dates and dataclasses
where ``json`` raises (the session's message check sends only text-only messages here).
"""

from __future__ import annotations

import gc
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["MAX_DEPTH", "dumps", "loads", "nested_deeper", "plain_messages", "sorted_dumps"]

#: How deep any JSON polygate reads or sends may nest: messages and parameters, a
#: structured answer, a schema, a ``polygate serve`` request body.  Python walks JSON
#: recursively (the encoder, the cache key, telemetry, jsonschema), so a value just
#: under the interpreter's recursion limit passed one walk and broke the next; and that
#: limit differs between Pythons (3.13's decoder reads 3000 levels, 3.11's recursed out
#: at ~1000), so a limit of our own keeps one answer valid on every Python or on none.
MAX_DEPTH = 256

_decode = msgspec.json.Decoder().decode


def _into_bytes(encoder: msgspec.json.Encoder) -> Callable[[Any], bytes]:
    """``encoder.encode``, written through a ``bytearray``.  msgspec's own ``encode``
    (0.22, 0.23) crashes the process (SIGSEGV) when its output buffer cannot grow: out
    of memory, a large answer took ``polygate serve`` down with every request in it
    instead of answering 503.  Through ``encode_into`` the same failure is a
    ``MemoryError``; the copy costs ~0.1 µs for a usual answer, ~5 % for a large one."""
    into = encoder.encode_into

    def encode(value: Any) -> bytes:
        buffer = bytearray()
        into(value, buffer)
        return bytes(buffer)

    return encode


_encode = _into_bytes(msgspec.json.Encoder())
_encode_sorted = _into_bytes(msgspec.json.Encoder(order="sorted"))


def plain_messages(messages: Any) -> bool:
    """Whether ``messages`` is a list of dicts whose keys and values are all strings:
    the usual chat messages, which msgspec writes byte for byte as ``json`` does and a
    cache key needs no canonical walk for (key order aside, which sorting settles)."""
    if type(messages) is not list:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        for k, v in message.items():
            if type(k) is not str or type(v) is not str:
                return False
    return True


def plain_keys(value: Any) -> bool:
    """Whether every object key in ``value`` is a ``str`` or an ``int``, the keys msgspec
    writes as ``json`` does (``json`` writes a float key with ``repr``, ``1e-05``;
    msgspec as ``0.00001``; a bool key as ``true``): a walk with a stack of its own."""
    pending = [value]
    while pending:
        item = pending.pop()
        if type(item) is dict:
            for key in item:
                if type(key) is not str and type(key) is not int:
                    return False
            pending.extend(item.values())
        elif type(item) is list or type(item) is tuple:
            pending.extend(item)
    return True


#: Documents at least this long are decoded with the garbage collector paused.  Each
#: object a decoder makes counts towards the collector's next run, so a large document
#: of small objects (a long tool-calling conversation sent to ``polygate serve``)
#: triggered collection after collection of the objects it had just made: two thirds
#: of the 0.15 s an 8 MiB request took to decode, all of it holding the event loop.
_PAUSE_GC_AT = 256 * 1024


def loads(data: bytes | bytearray | str, fallback: Callable[[Any], Any] = json.loads) -> Any:
    """``fallback(data)``, by default ``json.loads(data)``, faster.

    What msgspec reads, it reads as ``json.loads`` does, and only from strict UTF-8
    without a lone surrogate.  What it refuses (invalid UTF-8 included, and a document
    nested deeper than it goes) is handed to ``fallback``, which returns what it
    always did or raises its own error: a bad document fails exactly as before."""
    if len(data) < _PAUSE_GC_AT or not gc.isenabled():
        try:
            return _decode(data)
        except (msgspec.DecodeError, ValueError, RecursionError):  # (a ValueError since 0.21)
            return fallback(data)
    # (The collector is the process's: a thread decoding at the same time, or turning
    # it off meanwhile, finds it on again afterwards; one off when the decode starts
    # is left off.)
    try:
        gc.disable()
        return loads(data, fallback)
    finally:
        gc.enable()


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
    # UnicodeEncodeError is a ValueError; msgspec.EncodeError is no ValueError
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError, RecursionError):
        return None
    # msgspec writes NaN and ±Infinity as null: look for them only when a null is
    # there at all.  Rare in a key; common in an answer ("finish_reason": null), where
    # the walk costs a fraction of the encode it follows.  (``find``, not ``in``: bytes'
    # ``in`` raises and formats a TypeError inside before it searches, ~2,400
    # instructions.)
    if encoded.find(b"null") >= 0 and _has_non_finite(value):
        return None
    return encoded


def _has_non_finite(value: Any) -> bool:
    """Whether a non-finite float is anywhere in ``value``: a walk with a stack of its
    own, so a value msgspec wrote however deep never exhausts Python's."""
    pending = [value]
    pop, extend, isfinite = pending.pop, pending.extend, math.isfinite
    while pending:
        item = pop()
        kind = type(item)
        # The exact JSON types first (nearly everything, strings most): one identity
        # test each; subclasses take the isinstance path below.
        if kind is str or kind is int or item is None or kind is bool:
            continue
        if kind is dict:
            extend(item.values())
        elif kind is list:
            extend(item)
        elif kind is float or isinstance(item, float):
            if not isfinite(item):
                return True
        elif isinstance(item, dict):
            extend(item.values())
        elif isinstance(item, (list, tuple)):
            extend(item)
    return False


# Everything but quotes and brackets: what is left once escapes are gone.
_NOT_QUOTES_OR_BRACKETS = bytes(b for b in range(256) if b not in b'"[]{}')
_ONE_KIND = bytes.maketrans(b"{}", b"[]")  # nesting is nesting, whatever the kind
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def nested_deeper(data: bytes | str, limit: int) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects deeper than ``limit``,
    found before it is decoded (or right after it is encoded).

    Python's decoder and encoder recurse once a level: nesting is otherwise bounded
    only by the interpreter's recursion limit (a ``RecursionError`` that looks like a
    bug), and a document that stays just under it breaks whatever walks it later (a
    ``repr``, a cache key, a telemetry row).  Counting brackets nearly always ends the
    check; otherwise the strings are dropped, then everything but brackets, and the
    running depth is summed -- every step a C loop, linear in the size."""
    if isinstance(data, str):
        if data.count("[") + data.count("{") <= limit:
            return False
        data = data.encode("utf-8", "surrogatepass")
    elif data.count(b"[") + data.count(b"{") <= limit:
        return False
    brackets = _outside_strings(data).translate(_ONE_KIND)
    # Each pass drops every innermost pair, so the depth by exactly one: wide JSON
    # ([[],[],...]) shrinks to almost nothing before anything is summed.
    peeled = 0
    while brackets.count(b"[") > limit - peeled:
        shorter = brackets.replace(b"[]", b"")
        if peeled == 3 or len(shorter) == len(brackets):
            break
        brackets, peeled = shorter, peeled + 1
    else:
        return False  # too few openings left to be too deep
    return peeled > limit or bool(
        brackets and peeled + max(itertools.accumulate(map(_STEP.__getitem__, brackets))) > limit
    )


def _outside_strings(data: bytes) -> bytes:
    """The brackets of the JSON text ``data`` that are not inside a string, in order.

    Every step is one pass of a C loop over bytes (a regular expression that skipped
    the strings took 0.18 s over an 8 MiB request, this ~0.04 s).  Escaped
    backslashes go first, then escaped quotes: a run of backslashes loses its pairs
    from the left, so an odd one left escapes what follows it, as in JSON.  What is
    left of a string is then its quotes and any brackets in it.  Two quotes side by
    side have nothing between them, so dropping them changes nothing outside a
    string: an empty string goes, or the end of one and the start of the next, which
    only joins them.  The few strings left that hold a bracket are split away.  A
    string left open runs to the end.  (In JSON a backslash is only ever in a string;
    text that is not JSON gets some answer here and is refused by the decoder.)"""
    kept = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_QUOTES_OR_BRACKETS)
    kept = kept.replace(b'""', b"")
    if kept.find(b'"') < 0:
        return kept
    return b"".join(kept.split(b'"')[::2])
