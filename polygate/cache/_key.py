"""The canonical cache key: SHA-256 of a canonical JSON of what decides the answer.

A chat key covers ``(format version, scope, call kind, the scope's models, messages,
parameters)``; an embedding key the same with one input text in place of the
messages, so ``embed`` caches each input on its own.  The canonical JSON is the
compact UTF-8 JSON, object keys sorted, of the value after :func:`canonical`, written
by msgspec (``polygate._json.sorted_dumps``); a value msgspec cannot write faithfully
(a NaN or an infinity, a lone surrogate) is written by
``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True)`` instead.
Either text parses back to the value it was written from, and which one a value gets
depends on the value alone, so equal values share a key and different ones do not:

* object keys are sorted, so key order never matters, at any depth -- except inside
  :data:`ORDERED_PARAMS` (tools, functions, response formats, a ``schema=``): a model
  writes an object's properties in the order its schema lists them (a schema asking
  for ``reasoning`` before ``answer`` gets it first, and another answer), and a
  tool's definition reaches the model as text in the order it was written; there the
  order of every object's keys is part of the key;
* a number is its value: ``1``, ``1.0`` and ``1e0`` are the same (an integral float
  becomes an int), ``0.5`` and ``0.50`` too; ``True`` is not ``1`` (JSON tells them apart);
  an object key is the text JSON writes for it, so the key ``1.0`` (``"1.0"`` on the
  wire) is not the key ``1`` (``"1"``);
* tuples are lists (so are their subclasses, a list's too); any other Mapping is an object;
* strings are compared exactly (no Unicode normalisation: a different prompt is a
  different prompt).

So two requests get the same key exactly when they are equal as JSON values under
these rules (and SHA-256 does not collide).  Every parameter is part of the key —
``temperature``, ``seed``, ``tools``, ``response_format``, ``n``, ``model``,
``max_tokens``… — except :data:`EXCLUDED_PARAMS`, which say who asks or how the answer
travels, never what it is.  The scope's source models are in the key so that pointing
a scope at another model does not serve the old model's answers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._json import plain_messages, sorted_dumps

__all__ = ["EXCLUDED_PARAMS", "KEY_VERSION", "ORDERED_PARAMS", "canonical", "canonical_json", "chat_key", "embed_keys"]

#: Bumped whenever the canonical form changes, so old entries are never misread.
#: 2: written by msgspec (UTF-8) where version 1 used ``json`` (ASCII escapes).
#: 3: a float object key is its JSON text (``"1.0"``), no longer an int's (``"1"``).
#: 4: a scope with a fallback keys its answers with the chain's models too (written
#: under version 3 before that, a fallback's answer read back as the scope's own once
#: the fallback was removed).
#: 5: key order counts inside ORDERED_PARAMS (a schema's property order was left out:
#: a reasoning-first schema was served the answer-first schema's answer).
#: 6: a ``schema=`` is a member of the key of its own, not a parameter (a caller's
#: parameter named as its entry was, ``polygate:schema``, was served its answer).
#: 7: what counts as a complete, successful answer changed under 6 (a finish reason of
#: ``"error"`` or ``"network_error"`` is a failure, ``""`` no finish, content after a
#: proxy's early ``"stop"`` part of the answer): an entry an older version stored may be
#: one this version refuses, served as a hit after an upgrade.  Bumped for such rule
#: changes too, so that an upgrade never serves what it would not store.
#: 8: what a whole answer holds changed under 7 (its reasoning parts are no text, its
#: first choice is the one with index 0, types of its fields are the wire's), and an
#: answer holding NaN is no longer stored (each hit of one was a 502): served after
#: an upgrade, the entries 7 wrote were answers this version would not give.
#: ``tests/test_cache_unit.py`` pins the keys' digests, and what each recorded answer
#: reads as (and whether it is stored) beside this version.
KEY_VERSION = 8

#: Parameters left out of the key: they identify the caller or shape the transport,
#: and never change the answer.
EXCLUDED_PARAMS: frozenset[str] = frozenset({
    "user",               # end-user id for the provider's abuse monitoring
    "safety_identifier",  # its successor
    "metadata",           # tags stored with the completion
    "store",              # whether the provider keeps the completion
    "stream_options",     # include_usage etc.: how a stream reports, not what it says
    "service_tier",       # latency / price class
    "prompt_cache_key",   # a hint for the provider's own prompt cache
})

#: Parameters whose objects' key order is part of the key (see the module's docstring),
#: as it is in a ``schema=`` (``chat_key``'s own member).
ORDERED_PARAMS: frozenset[str] = frozenset({"tools", "functions", "response_format"})

_dumps = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True
).encode


def canonical(value: Any) -> Any:
    """``value`` with integral floats as ints, tuples as lists, Mappings as dicts.

    Raises ``TypeError`` for what JSON cannot hold (callers validated it already)."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        # NaN and ±inf are not integral and stay as they are (JSON's NaN/Infinity).
        return int(value) if value.is_integer() else value
    if kind is dict or isinstance(value, Mapping):
        return {_key_text(k): canonical(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [canonical(v) for v in value]
    # Subclasses (IntEnum, str enums, numpy floats, a NamedTuple, a list of its own):
    # JSON writes their plain value, and the session's checks took them.
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return canonical(float(value))
    if isinstance(value, str):
        return str.__str__(value)
    raise TypeError(f"{kind.__name__} is not JSON")


def _key_text(key: Any) -> str:
    """Object keys as JSON writes them (``1`` → ``"1"``, ``True`` → ``"true"``, ``1.0``
    → ``"1.0"``): a key is text on the wire, so an integral float key is not an int's."""
    if type(key) is str:
        return key
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, float):
        return json.dumps(float(key))
    return json.dumps(canonical(key))


def _in_order(value: Any) -> Any:
    """A canonical value with its objects' key order made part of it: every object a
    ``{"o": [[key, value], ...]}`` in its order, every list a ``{"a": [...]}``, so no
    value written so is another's (sorting the keys of what comes out loses nothing)."""
    if type(value) is dict:
        return {"o": [[k, _in_order(v)] for k, v in value.items()]}
    if type(value) is list:
        return {"a": [_in_order(v) for v in value]}
    return value


def _params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters' part of a key: the kept ones, canonical, in order where it counts."""
    kept = canonical(_kept(params))
    for name in ORDERED_PARAMS.intersection(kept):
        kept[name] = _in_order(kept[name])
    return kept  # type: ignore[no-any-return]


def canonical_json(value: Any) -> str:
    """The canonical JSON of ``value`` (what a key hashes), as text."""
    return _document(canonical(value)).decode("utf-8")


def _document(value: Any) -> bytes:
    """The canonical JSON of an already canonical value."""
    encoded = sorted_dumps(value)
    if encoded is None:
        return _dumps(value).encode("ascii")
    return encoded


def _kept(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in EXCLUDED_PARAMS}


def _digest(document: bytes) -> str:
    return hashlib.sha256(document).hexdigest()


def chat_key(
    scope: str, models: Sequence[str], messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any],
    *, schema: Any = None,
) -> str:
    """The key of one chat call (``chat`` and ``stream_chat`` share it); ``schema``: a
    ``schema=``'s own form (``None``: the call has none), outside the parameters, so
    that no parameter of a call without one is taken for it."""
    document = {
        "v": KEY_VERSION, "kind": "chat", "scope": canonical(scope), "models": canonical(list(models)),
        # Text-only messages are canonical as they are: sorting the keys is enough.
        "messages": messages if plain_messages(messages) else canonical(messages),
        "params": _params(params),
    }
    if schema is not None:
        document["schema"] = _in_order(canonical(schema))
    return _digest(_document(document))


def embed_keys(
    scope: str, models: Sequence[str], inputs: Iterable[str], params: Mapping[str, Any]
) -> list[str]:
    """One key per input text; the shared part is encoded once.

    The text is spliced in as the last member of an object whose other members are
    already canonical, so the document is the canonical JSON of
    ``{"input": text, "kind": "embed", "models", "params", "scope", "v"}`` with
    ``input`` moved last — unambiguous, since a JSON string delimits itself.
    """
    head = _document({
        "v": KEY_VERSION, "kind": "embed", "scope": canonical(scope), "models": canonical(list(models)),
        "params": _params(params),
    })
    prefix = head[:-1] + b',"input":'
    # (canonical: a str subclass, numpy's str_ from a column, is written as the plain
    # text it equals; msgspec refuses it, and the fallback escaped it as ASCII.)
    return [_digest(prefix + _document(canonical(text)) + b"}") for text in inputs]
