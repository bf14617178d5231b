"""The pieces of HTTP/1.1's grammar that polygate reads without h11.

Both ends read the common message themselves -- the transport an upstream's answer
(``transport/_head.py``), the server a client's request (``serve/_http.py``) -- and
hand anything else to h11.  What they accept must stay a subset of what h11
accepts, so they share these patterns, each a strict subset of h11's own
(``h11._abnf``): no control character or NUL anywhere, no obs-fold, CRLF only.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["FIELD_LINE", "LENGTH_DIGITS", "TOKEN", "unquoted"]

TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
#: A field line, its name and value (h11's ``header_field``, narrowed as above).
FIELD_LINE: Final = re.compile(
    rb"(" + TOKEN + rb"):[ \t]*"
    rb"((?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?)[ \t]*"
)
#: A Content-Length value is 1 to LENGTH_DIGITS ASCII digits: h11 allows 20; 18
#: always fit an int64 (and no body is that long).  Checked as
#: ``value.isdigit() and len(value) <= LENGTH_DIGITS`` (``bytes.isdigit`` is ASCII
#: digits only, and false when empty): a regular expression's match costs ~3,000
#: instructions before its first character.
LENGTH_DIGITS: Final = 18


_BYTES_REPR: Final = r"""b(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
_QUOTED_BYTES: Final = re.compile(rf"bytearray\({_BYTES_REPR}\)|(?<!\w){_BYTES_REPR}")


def unquoted(message: str) -> str:
    """An h11 error's message without the bytes it quotes ("illegal status line:
    bytearray(b'...')"): what came on a connection is not always the answer to the
    request that reads it.  An upstream that sends more than its Content-Length said,
    late, has the next request on the connection read the rest of an answer to another
    caller -- another tenant, behind ``polygate serve`` -- whose error reaches it."""
    return _QUOTED_BYTES.sub("(the bytes not shown)", message)
