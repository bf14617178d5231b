"""The SSE decoder and the chat assembler under hostile shapes: linear work, one cap
whatever the chunking, bounded state."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import polygate
from polygate.transport import ChatAssembler
from polygate.transport._sse import SSEDecoder

MiB = 1024 * 1024


def decode(pieces: list[bytes], max_line: int = 1 << 20, max_body: int = 1 << 30) -> list[bytes]:
    decoder = SSEDecoder(max_body=max_body, max_line=max_line, source="s")
    out = [e.data for p in pieces for e in decoder.feed(p)]
    return out + [e.data for e in decoder.flush()]


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted({p % (len(data) + 1) for p in points})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


# --------------------------------------------------------------------------- F6


def _feed_lines(total: int) -> float:
    """Seconds to feed ``total`` bytes of one event made of 1 KiB ``data:`` lines,
    one line a piece, never a blank line (valid SSE; quadratic before)."""
    line = b"data: " + b"x" * 1017 + b"\n"
    decoder = SSEDecoder(max_body=1 << 30, max_line=1 << 30, source="s")
    start = time.perf_counter()
    for _ in range(total // len(line)):
        for _event in decoder.feed(line):
            pass
    return time.perf_counter() - start


def test_an_event_of_many_lines_costs_linear_time() -> None:
    small = min(_feed_lines(MiB) for _ in range(3))
    big = min(_feed_lines(4 * MiB) for _ in range(3))
    # Linear: 4x the bytes costs ~4x (quadratic was 16x); a loaded machine gets 8x.
    assert big < 8 * small, f"1 MiB {small * 1e3:.1f} ms, 4 MiB {big * 1e3:.1f} ms"


def test_an_event_is_capped_like_a_line() -> None:
    decoder = SSEDecoder(max_body=1 << 30, max_line=100, source="s")
    with pytest.raises(polygate.TransientUpstreamError, match="line cap"):
        for _ in range(20):
            list(decoder.feed(b"data: 0123456789\n"))


# --------------------------------------------------------------------------- F11


@given(size=st.integers(9, 300), points=st.lists(st.integers(0, 400), max_size=6),
       tail=st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n", b""]))
def test_the_line_cap_does_not_depend_on_chunking(size: int, points: list[int], tail: bytes) -> None:
    data = b"data: " + b"x" * size + tail
    for pieces in ([data], cuts(data, points)):
        with pytest.raises(polygate.TransientUpstreamError, match="line cap"):
            decode(pieces, max_line=8)


@given(points=st.lists(st.integers(0, 400), max_size=8))
def test_events_within_the_cap_pass_however_cut(points: list[int]) -> None:
    data = b"data: 0123456789\n\n" * 10 + b"data: last\n"
    assert decode(cuts(data, points), max_line=20) == [b"0123456789"] * 10 + [b"last"]


def test_a_last_event_without_a_blank_line_is_flushed() -> None:
    assert decode([b"data: a\n\ndata: b"]) == [b"a", b"b"]
    assert decode([b"data: a\n\n", b"data: b\n"]) == [b"a", b"b"]


# --------------------------------------------------------------------------- F7


def test_choices_are_capped() -> None:
    assembler = ChatAssembler(max_choices=4, source="s")
    for i in range(4):
        assembler.add({"choices": [{"index": i, "delta": {"content": "x"}}]})
    with pytest.raises(polygate.TransientUpstreamError,
                       match="choice index 4, over the 4 choices one answer may hold") as info:
        assembler.add({"choices": [{"index": 4, "delta": {"content": "x"}}]})
    assert info.value.source == "s"
    assembler.add({"choices": [{"index": 3, "delta": {"content": "y"}}]})  # known ones still fold


def test_tool_calls_are_capped() -> None:
    assembler = ChatAssembler(max_tool_calls=2)
    call = {"function": {"arguments": "{}"}}
    assembler.add({"choices": [{"delta": {"tool_calls": [{**call, "index": 0}, {**call, "index": 1}]}}]})
    with pytest.raises(polygate.TransientUpstreamError, match="more than 2 tool calls"):
        assembler.add({"choices": [{"delta": {"tool_calls": [{**call, "index": 2}]}}]})


def test_tool_calls_without_an_index_are_capped_too() -> None:
    assembler = ChatAssembler(max_tool_calls=3)
    with pytest.raises(polygate.TransientUpstreamError):
        for _ in range(4):
            assembler.add({"choices": [{"delta": {"tool_calls": [{"function": {"name": "f"}}]}}]})


def test_empty_choices_and_calls_hold_nothing() -> None:
    assembler = ChatAssembler(max_choices=2, max_tool_calls=2)
    for i in range(1000):
        assembler.add({"choices": [{"index": i}, {"index": i, "delta": {}, "finish_reason": None}]})
        assembler.add({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i}]}}]})
    body = assembler.build()
    assert len(body["choices"]) == 1
    assert "tool_calls" not in body["choices"][0]["message"]
