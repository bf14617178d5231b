"""The chunked body decoder (polygate/_chunked.py) against h11's own reader.

LeanTransport decodes chunked bodies itself and gives h11 only the head and the
last chunk; these tests hold it to h11's behaviour: the same data for any body cut
any way, the same refusals for malformed framing, and the same bytes left for h11
at the end.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polygate._chunked import ChunkedDecoder

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def h11_decode(body: bytes) -> tuple[bytes, bool]:
    """What h11 makes of ``body`` (after a chunked response head): the data, and
    whether it saw the end of the message.  Raises h11's ProtocolError."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(HEAD + body)
    assert type(conn.next_event()) is h11.Response
    data = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            return data, False
        if type(event) is h11.Data:
            data += event.data
        elif type(event) is h11.EndOfMessage:
            return data, True
        else:  # pragma: no cover - h11 gives nothing else after a Response
            raise AssertionError(event)


def ours(body: bytes, cuts: list[int]) -> tuple[bytes, bytes | None]:
    """Our decoder fed ``body`` cut at ``cuts``: the data, and the bytes left for h11."""
    decoder = ChunkedDecoder()
    data = b""
    start = 0
    for end in [*sorted(set(cuts)), len(body)]:
        piece, last = decoder.decode(body[start:end])
        data += piece
        if last is not None:
            return data, last + body[end:]
        start = end
    return data, None


def frame(payload: bytes, ext: bytes = b"", blanks: bytes = b"", upper: bool = False) -> bytes:
    size = f"{len(payload):X}" if upper else f"{len(payload):x}"
    return size.encode() + ext + blanks + b"\r\n" + payload + b"\r\n"


chunks = st.lists(
    st.tuples(
        st.binary(min_size=1, max_size=300),
        st.sampled_from([b"", b";name=value", b';q="a b"', b";x"]),
        st.sampled_from([b"", b" ", b"\t "]),
        st.booleans(),
    ),
    max_size=12,
)
endings = st.sampled_from([b"0\r\n\r\n", b"0;ext\r\n\r\n", b"0\r\nx-trailer: 1\r\n\r\n", b"0\r\n", b""])


@settings(max_examples=400, deadline=None)
@given(chunks, endings, st.lists(st.integers(min_value=0, max_value=4000), max_size=8))
def test_same_data_as_h11_however_the_body_is_cut(
    parts: list[tuple[bytes, bytes, bytes, bool]], ending: bytes, cuts: list[int]
) -> None:
    body = b"".join(frame(*p) for p in parts) + ending
    cuts = [c for c in cuts if c < len(body)]
    expected, _ = h11_decode(body)
    data, last = ours(body, cuts)
    if ending:
        # The last chunk begins: everything from its size line on is h11's, and h11
        # reaches the same end from there.
        assert last == ending
        assert data == expected
    else:
        assert last is None
        assert data == expected


@settings(max_examples=400, deadline=None)
@given(chunks, st.binary(min_size=1, max_size=8), st.integers(min_value=0, max_value=3000),
       st.lists(st.integers(min_value=0, max_value=4000), max_size=4))
def test_malformed_framing_is_refused_where_h11_refuses_it(
    parts: list[tuple[bytes, bytes, bytes, bool]], junk: bytes, at: int, cuts: list[int]
) -> None:
    """Bytes overwritten anywhere in a valid body: we refuse it exactly when h11 does
    (with h11's exception type), and otherwise decode the same data."""
    body = bytearray(b"".join(frame(*p) for p in parts) + b"0\r\n\r\n")
    at = min(at, len(body) - 1)
    body[at:at + len(junk)] = junk
    raw = bytes(body)
    cuts = [c for c in cuts if c < len(raw)]
    try:
        expected: tuple[bytes, bool] | None = h11_decode(raw)
    except h11.ProtocolError:
        expected = None
    try:
        data, last = ours(raw, cuts)
    except h11.RemoteProtocolError:
        assert expected is None
        return
    if last is not None:
        # h11 judges the last chunk, trailers included: its verdict on that part.
        try:
            tail_ok = h11_decode(last)[1]
        except h11.ProtocolError:
            tail_ok = False
        assert expected is not None or not tail_ok
        if expected is not None:
            assert data == expected[0]
    else:
        assert expected is not None and not expected[1]
        assert data == expected[0]


@pytest.mark.parametrize(
    "body",
    [
        b"0x5\r\nhello\r\n0\r\n\r\n",  # int() would take a 0x prefix
        b"+5\r\nhello\r\n0\r\n\r\n",  # or a sign
        b"5_0\r\nhello\r\n0\r\n\r\n",  # or an underscore
        b" 5\r\nhello\r\n0\r\n\r\n",  # or a leading blank
        b"5\nhello\r\n0\r\n\r\n",  # a bare LF
        b"5\r\nhelloXY0\r\n\r\n",  # no CRLF after the data
        b"123456789012345678901\r\n",  # more than 20 hex digits
        b"\r\n",  # no size at all
    ],
)
def test_refused(body: bytes) -> None:
    with pytest.raises(h11.ProtocolError):
        h11_decode(body)
    with pytest.raises(h11.RemoteProtocolError):
        ours(body, [])


def test_a_size_line_longer_than_h11_allows_is_refused_without_waiting_for_its_end() -> None:
    decoder = ChunkedDecoder()
    decoder.decode(b"5" + b";" + b"x" * 8000)
    with pytest.raises(h11.RemoteProtocolError, match="too long"):
        decoder.decode(b"x" * 9000)


def test_a_chunk_cut_by_reads_comes_out_as_it_arrives() -> None:
    decoder = ChunkedDecoder()
    assert decoder.decode(b"a\r\n01234") == (b"01234", None)
    assert decoder.decode(b"56789\r") == (b"56789", None)
    assert decoder.decode(b"\n3\r\nabc\r\n0\r\n\r\nnext") == (b"abc", b"0\r\n\r\nnext")


@given(st.lists(st.sampled_from([bytes([c]) for c in b"0123456789abcdefABCDEFxX; \t\r\n;"]),
                max_size=24).map(b"".join))
@settings(max_examples=300)
def test_a_size_line_is_accepted_exactly_where_h11s_pattern_accepts_it(line: bytes) -> None:
    """The size line's pattern is not h11's spelling (see _chunked._HEADER), so it is
    held to h11's own on every line: the same lines, the same size."""
    from h11._readers import chunk_header_re

    from polygate._chunked import _HEADER

    theirs = chunk_header_re.fullmatch(line + b"\r\n")
    mine = _HEADER.fullmatch(line)
    assert (mine is None) == (theirs is None), line
    if mine is not None and theirs is not None:
        assert mine[1] == theirs["chunk_size"]


@pytest.mark.parametrize("blanks", [16_000, 64_000])
def test_a_hostile_size_line_is_refused_in_linear_time(blanks: int) -> None:
    """Review finding (complexity): a size line of blanks after ``;`` ending in a bare
    LF made the pattern try every split of the blanks between its two parts: 0.6 s
    for 16,000 blanks, 9 s for 64,000 (one 64 KiB read), the event loop held, no
    deadline firing.  Now each is refused in well under a millisecond's work a KB."""
    import time

    line = b"1;" + b" " * blanks + b"\nx\r\n"
    start = time.perf_counter()
    with pytest.raises(h11.RemoteProtocolError):
        ChunkedDecoder().decode(line)
    assert time.perf_counter() - start < 0.05  # (0.58 s and 9 s before)
