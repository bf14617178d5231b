"""What an entry holds, as bytes: a chat answer, or one input's embedding vector.

Entries are compact JSON (UTF-8).  Every hit decodes a fresh copy, so a caller that
mutates ``response.message`` never changes what the next hit returns, and the memory
backend's byte bound is exact.  A chat entry keeps ``raw`` and, only when they are
not the very objects found inside it, ``choices`` and ``message`` (they almost always
are, so an answer is stored once, not three times).  A vector is the base64 of its
IEEE doubles: exact, and far cheaper to decode than a JSON list of floats.

Decoding checks the shape; anything else (another program's key, a truncated value)
raises :class:`ValueError`, which the cache counts as an error and treats as a miss.
"""

from __future__ import annotations

import base64
import json
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from .._json import loads
from .._types import ChatResponse, Usage

__all__ = ["decode_chat", "decode_vector", "encode_chat", "encode_vector"]

_FORMAT = 1
# No NaN or infinity: an answer that holds one is not stored (``ValueError``, counted).
# No client of ``polygate serve`` can be sent it (a 502), and a stored one was replayed
# as that 502 for the entry's whole life, the upstream never asked again.
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_BIG_ENDIAN = sys.byteorder == "big"


def _usage(usage: Usage | None) -> list[Any] | None:
    if usage is None:
        return None
    return [usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.source]


def _read_usage(value: Any) -> Usage | None:
    if value is None:
        return None
    p, c, t, source = value
    if not (all(type(n) is int for n in (p, c, t)) and source in ("upstream", "estimated")):
        raise ValueError("bad usage")
    return Usage(p, c, t, source)


def encode_chat(response: ChatResponse) -> bytes:
    raw = response.raw
    entry: dict[str, Any] = {
        "f": _FORMAT, "k": "chat", "text": response.text, "usage": _usage(response.usage),
        "source": response.source, "model": response.model, "finish": response.finish_reason,
        "raw": raw,
    }
    answered = response.call_stats.scope
    if answered is not None:
        entry["scope"] = answered  # a fallback's answer: the scope that gave it
    inner = raw.get("choices") if isinstance(raw, dict) else None
    if response.choices is not inner:
        entry["choices"] = response.choices
    first = response.choices[0] if response.choices else None
    if not (isinstance(first, dict) and response.message is first.get("message")):
        entry["message"] = response.message
    return _dumps(entry).encode("utf-8", "surrogatepass")


def _utf8_json(data: bytes) -> Any:
    """What msgspec did not read, as entries are written: UTF-8 (with ``surrogatepass``,
    as :func:`encode_chat` writes a lone surrogate), never sniffed for a BOM or UTF-16,
    so an entry another program rewrote is a bad entry, not a hit.  Nor is a number
    no JSON holds (``NaN``, ``1e400``): never written here (an answer holding one is
    not stored), and served, every hit was a 502 for the entry's whole life."""
    return json.loads(data.decode("utf-8", "surrogatepass"), parse_constant=_not_json,
                      parse_float=_finite)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is no JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (_INF, -_INF):
        raise ValueError(f"{text} is past a double")
    return value


_INF = float("inf")


def _check_bytes(data: Any) -> None:
    """An entry is bytes: a value another program stored as text (a SQLite TEXT
    column, say) is a bad entry, not a failed call."""
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"not a polygate entry (a {type(data).__name__}, not bytes)")


def decode_chat(data: bytes) -> dict[str, Any]:
    """A fresh copy of a stored answer: the keyword arguments of a :class:`ChatResponse`
    but its ``call_stats`` (the caller's own), and ``scope``: the scope that answered
    (``None`` when the entry does not say)."""
    _check_bytes(data)
    try:
        entry = loads(data, _utf8_json)
        if entry["f"] != _FORMAT or entry["k"] != "chat":
            raise ValueError("not a chat entry")
        raw = entry["raw"]
        choices = entry["choices"] if "choices" in entry else raw["choices"]
        message = entry["message"] if "message" in entry else choices[0]["message"]
        text, source = entry["text"], entry["source"]
        model, finish = entry["model"], entry["finish"]
        if not (
            type(raw) is dict and type(choices) is list and type(message) is dict
            and type(text) is str and type(source) is str
            and (model is None or type(model) is str)
            and (finish is None or type(finish) is str)
        ):
            raise ValueError("bad chat entry")
        usage = _read_usage(entry["usage"])
    except (KeyError, IndexError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        # (RecursionError: a foreign value nested deeper than the JSON reader goes)
        raise ValueError(f"not a polygate chat entry ({type(exc).__name__})") from None
    scope = entry.get("scope")
    return {
        "text": text, "message": message, "choices": choices, "usage": usage, "source": source,
        "model": model, "finish_reason": finish, "raw": raw,
        "scope": scope if isinstance(scope, str) else None,
    }


def encode_vector(
    vector: Sequence[float], *, model: str | None, source: str | None, tokens: int | None,
    usage_source: str | None,
) -> bytes:
    """One input's vector and what it cost (``tokens``: its share of its batch's usage)."""
    doubles = array("d", vector)
    if _BIG_ENDIAN:
        doubles.byteswap()
    entry = {
        "f": _FORMAT, "k": "embed", "v": base64.b64encode(doubles.tobytes()).decode("ascii"),
        "model": model, "source": source, "tokens": tokens, "us": usage_source,
    }
    return _dumps(entry).encode("utf-8", "surrogatepass")


def decode_vector(data: bytes) -> tuple[list[float], str | None, str | None, int | None, str | None]:
    """``(vector, model, source, tokens, usage_source)`` of an embedding entry."""
    _check_bytes(data)
    try:
        entry = loads(data, _utf8_json)
        if entry["f"] != _FORMAT or entry["k"] != "embed":
            raise ValueError("not an embedding entry")
        doubles = array("d")
        doubles.frombytes(base64.b64decode(entry["v"], validate=True))
        if _BIG_ENDIAN:
            doubles.byteswap()
        model, source, tokens, usage_source = entry["model"], entry["source"], entry["tokens"], entry["us"]
        if not (
            (model is None or isinstance(model, str)) and (source is None or isinstance(source, str))
            and (tokens is None or type(tokens) is int)
            and usage_source in (None, "upstream", "estimated")
        ):
            raise ValueError("bad embedding entry")
    except (KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"not a polygate embedding entry ({type(exc).__name__})") from None
    return doubles.tolist(), model, source, tokens, usage_source
