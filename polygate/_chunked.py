"""The chunked transfer coding of a response body, decoded on the connection.

Why not h11 for this too: h11 parses every HTTP chunk through its generic event
machinery (a receive buffer, a reader object, a state-machine step and an event
object per chunk, and a second ``next_event`` call to learn that it needs more
data).  An LLM stream sends one small HTTP chunk per token, so that machinery ran
once per token: 23 µs a chunk on the 2-core benchmark machine, against ~1 µs here
(``benchmarks/streams.py``, docs/benchmarks.md) -- more than any other single step
of a token's way through polygate.

``polygate serve`` runs it over a chunked request body before h11 reads it (see
``serve/_http.py``): h11's pattern for the size line is the quadratic one below.

h11 still parses the response head, the last chunk and any trailers, and keeps the
connection's state (``LeanTransport`` hands it the bytes from the last-chunk line on,
so its ``EndOfMessage``, its trailing-data check and keep-alive decision are those of
h11).  What is decoded here is exactly what h11's ``ChunkedReader`` accepts: a chunk
size of 1 to 20 hex digits, optional extensions (ignored), optional blanks, CRLF;
the data; CRLF.  A header line is bounded like one of h11's events (16 KiB), and any
deviation is an ``h11.RemoteProtocolError``, as h11 would raise it.
"""

from __future__ import annotations

import re
from typing import Final

import h11

__all__ = ["PLAIN_END", "ChunkedDecoder"]

#: A chunk-size line without its CRLF (h11's ``chunk_header``): the size, then either
#: extensions (the blanks after them are theirs) or blanks.  Not h11's spelling,
#: ``(?:;[^\n]*)?[ \t]*``, whose two parts can each take the same blanks: a line of
#: blanks ending in a bare LF made the match try every split of them, quadratic (64 KB
#: of them held the event loop for 9 s).  The lines either accepts are the same.
_HEADER: Final = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;[^\n]*|[ \t]*)")
#: h11's bound on an incomplete event, here: one chunk-size line.
_MAX_HEADER: Final = 16 * 1024


class ChunkedDecoder:
    """Feed the body's bytes as they arrive; get the data they carry.

    ``decode(data)`` returns ``(payload, last)``: the chunk data found in ``data``
    (joined, ``b""`` when none), and once the last chunk begins, ``last``: the bytes
    from its size line on (the last chunk, trailers, and whatever follows), for h11.
    A chunk cut by a read is passed on as far as it arrived, like h11's ``Data``.
    """

    __slots__ = ("_crlf", "_left", "_partial")

    def __init__(self) -> None:
        self._left = 0  # data bytes of the current chunk still to come
        self._crlf = 0  # bytes of the CRLF after a chunk's data still to come
        self._partial = b""  # an incomplete size line (or CRLF) held for the next read

    def decode(self, data: bytes) -> tuple[bytes, bytes | None]:
        if self._partial:
            data = self._partial + data
            self._partial = b""
        size = len(data)
        pos = 0
        out: list[bytes] = []
        while pos < size:
            left = self._left
            if left:
                end = pos + left
                if end > size:  # the chunk goes on past this read
                    out.append(data[pos:] if pos else data)
                    self._left = end - size
                    break
                out.append(data[pos:end] if pos or end < size else data)
                self._left = 0
                self._crlf = 2
                pos = end
            if self._crlf:
                if size - pos < self._crlf:
                    # Part of the CRLF: check what is here, keep waiting for the rest.
                    if not b"\r\n"[2 - self._crlf:].startswith(data[pos:]):
                        _lost_sync(data[pos:])
                    self._crlf -= size - pos
                    break
                expected = b"\r\n"[2 - self._crlf:]
                if data[pos:pos + self._crlf] != expected:
                    _lost_sync(data[pos:pos + self._crlf])
                pos += self._crlf
                self._crlf = 0
                continue
            end = data.find(b"\r\n", pos)
            if end < 0:
                if size - pos > _MAX_HEADER:
                    raise h11.RemoteProtocolError("chunk size line too long")
                self._partial = data[pos:]
                break
            if end - pos > _MAX_HEADER:  # (before any matching: bounded work a line)
                raise h11.RemoteProtocolError("chunk size line too long")
            match = _HEADER.fullmatch(data, pos, end)
            if match is None:
                raise h11.RemoteProtocolError("illegal chunk header")
            left = int(match[1], 16)
            if not left:
                return b"".join(out), data[pos:]
            self._left = left
            pos = end + 2
        if len(out) == 1:
            return out[0], None
        return b"".join(out), None

    def end_due(self) -> bytes | None:
        """The bytes still to come of the body's plain end (``0\r\n\r\n``, and the
        CRLF of the chunk before it if that is still due), when it could end with
        them: between chunks, or part of the way into that end; else ``None``."""
        if self._left or not PLAIN_END.startswith(self._partial):
            return None
        return b"\r\n"[2 - self._crlf:] + PLAIN_END[len(self._partial):]


#: A chunked body's plain end: the last chunk, no trailers, nothing after it.
PLAIN_END: Final = b"0\r\n\r\n"


def _lost_sync(got: bytes) -> None:
    raise h11.RemoteProtocolError(
        f"malformed chunk footer: {len(got)} byte(s) where CRLF was expected"
    )
