"""An upstream's response head, read the common way without h11's event machinery.

h11 parsed every response head and ran its state machine through every exchange:
~21 % of a ``chat()`` call's CPU over sockets, the largest single cost after the
kernel's (py-spy, docs/benchmarks.md "The common messages without h11").  Almost
every answer is the same shape: ``HTTP/1.1``, a final status, ``name: value`` lines
ended by CRLF, and a body framed by one Content-Length or by ``Transfer-Encoding:
chunked``.  :func:`parse_head` reads exactly that shape, and only that: anything
else -- an interim (1xx) answer, HTTP/1.0, a body delimited by the close, a folded,
malformed or bare-LF line, a repeated or odd framing header, a head over
``MAX_HEAD`` -- returns ``None``.  LeanTransport refuses a head over ``MAX_HEAD``
itself, however it arrives, and hands any other shape's bytes to h11 as before, so
h11's answer (and its error) decides.  What is accepted is a subset of what h11
accepts, read as h11 reads it (``tests/test_head.py`` holds the two together).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final, NamedTuple

from .._http11 import FIELD_LINE, LENGTH_DIGITS

if TYPE_CHECKING:
    import httpx

__all__ = ["HEAD_EXTENSION", "MAX_HEAD", "Head", "header_of", "parse_head"]

#: Where a response read this way keeps its :class:`Head` (``response.extensions``).
HEAD_EXTENSION: Final = "polygate.head"

#: The most a response head may be (h11's bound on an incomplete event).  LeanTransport
#: refuses a longer one however it arrives (``_pool``'s ``fed``): h11 bounds only a
#: head still incomplete, and accepts a longer one that came whole in one read.
MAX_HEAD: Final = 16 * 1024

_STATUS: Final = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?")


class Head(NamedTuple):
    status: int
    reason: bytes
    #: (name, value) as they came, names in their own case.
    headers: list[tuple[bytes, bytes]]
    #: The body's framing: chunked, or ``length`` bytes (0: no body).
    chunked: bool
    length: int
    #: Neither side said ``Connection: close`` (the request never does on this path).
    keep_alive: bool
    #: The first Content-Type says ``text/event-stream`` (read in small pieces).
    event_stream: bool


def parse_head(head: bytes, method: str) -> Head | None:
    """``head``: a response's bytes up to and including its blank line (``\\r\\n\\r\\n``),
    answering a request of ``method``.  ``None``: not the common shape (see above)."""
    if len(head) > MAX_HEAD or not head.endswith(b"\r\n\r\n"):
        return None
    lines = head[:-4].split(b"\r\n")
    status_line = _STATUS.fullmatch(lines[0])
    if status_line is None or method == "CONNECT":
        return None
    status = int(status_line[1])
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    chunked = False
    keep_alive = True
    content_type: bytes | None = None
    field = FIELD_LINE.fullmatch
    for line in lines[1:]:
        match = field(line)
        if match is None:
            return None
        name, value = match[1], match[2]
        headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > LENGTH_DIGITS:
                return None  # repeated ("5, 5" included) or not a plain number: h11's
            length = int(value)
        elif lower == b"transfer-encoding":
            if chunked or value.lower() != b"chunked":
                return None
            chunked = True
            headers[-1] = (name, b"chunked")  # as h11 hands it on: lower-cased
        elif lower == b"connection":
            if b"close" in (token.strip().lower() for token in value.split(b",")):
                keep_alive = False
        elif lower == b"content-type" and content_type is None:
            content_type = value
    if method == "HEAD" or status in (204, 304):
        length, chunked = 0, False  # no body, whatever the head says (h11's framing)
    elif chunked:
        if length >= 0:
            return None  # both: h11 decides
        length = 0
    elif length < 0:
        return None  # delimited by the close: h11's
    return Head(
        status, status_line[2] or b"", headers, chunked, length, keep_alive,
        content_type is not None and content_type.lower().startswith(b"text/event-stream"),
    )


def header_of(response: httpx.Response, name: str, default: str = "") -> str:
    """``response.headers.get(name, default)``; ``name`` in lower case.

    For a response whose head was read here, from that head: httpx's look-up works
    out the whole head's text encoding and lower-cases every name on each call
    (~2 % of a gateway request's time, for the two the exchange makes).  The same
    answer: every value of that name, joined by ", ".  A value that is not ASCII
    (where the encoding would matter) is left to httpx, as is any other response.
    Only LeanTransport.post's responses carry their head (it goes straight to the
    exchange): one that went through ``handle_async_request`` may have had its
    headers edited on the way (a wrapper transport), and is read through httpx.
    """
    head = response.extensions.get(HEAD_EXTENSION)
    if type(head) is Head:
        key = name.encode("ascii")
        values = [value for field, value in head.headers if field.lower() == key]
        if not values:
            return default
        if all(value.isascii() for value in values):
            return b", ".join(values).decode("ascii")
    found: str = response.headers.get(name, default)
    return found
