"""JSON out of the gateway: strict JSON in valid UTF-8, whatever the upstream sent.

The library keeps an upstream's body as Python objects, and Python's ``json`` accepts
what strict JSON does not: a lone surrogate escape (``"\\ud800"``, which is no Unicode
text and has no UTF-8 form) and the bare tokens ``NaN`` / ``Infinity``.  Relaying
either raw breaks the answer: a surrogate cannot be encoded (a 500, a torn stream),
and ``NaN`` is not JSON to a strict client (a browser, serde_json, Go).  So every
body and event the gateway writes goes through :func:`dump`:

* a lone surrogate becomes U+FFFD, as a decoder replaces any other invalid byte;
* a non-finite float raises :class:`Unencodable` -- a number cannot be repaired
  without changing what it says, so the caller answers 502 (or an SSE error event).

The common case costs one encode, by msgspec (``polygate._json``): the standard
library writes what msgspec cannot write as it would, and the repairs run only when
that fails.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from .._json import dumps

__all__ = ["Unencodable", "dump", "has_lone_surrogate"]

_ENCODE: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


class Unencodable(ValueError):
    """The payload holds a non-finite float, which strict JSON cannot carry."""


def dump(payload: Any) -> bytes:
    """``payload`` as compact, strict JSON in UTF-8, lone surrogates replaced."""
    fast = dumps(payload)
    if fast is not None:
        return fast
    try:
        text = _ENCODE(payload)
    except ValueError:  # allow_nan=False: "Out of range float values ..."
        raise Unencodable("NaN or Infinity cannot be written as JSON") from None
    try:
        return text.encode()
    except UnicodeEncodeError:
        # ensure_ascii=False wrote each surrogate as itself, so it can only sit inside
        # a string literal: replacing it in the text keeps the JSON well formed.
        return _SURROGATE.sub("\ufffd", text).encode()


def has_lone_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value holds a lone surrogate in any string or key.  A
    surrogate pair escaped in JSON (an emoji) decodes to one code point, so any
    surrogate code point left in a ``str`` is a lone one."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False
