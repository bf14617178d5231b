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

__all__ = ["FIELD_LINE", "LENGTH", "TOKEN"]

TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
#: A field line, its name and value (h11's ``header_field``, narrowed as above).
FIELD_LINE: Final = re.compile(
    rb"(" + TOKEN + rb"):[ \t]*"
    rb"((?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?)[ \t]*"
)
#: A Content-Length value: h11 allows 20 digits; 18 always fit an int64 (and no
#: body is that long).
LENGTH: Final = re.compile(rb"[0-9]{1,18}")
