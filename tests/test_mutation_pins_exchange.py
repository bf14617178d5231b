"""Behaviour of the exchange with an upstream (sniffing a body, error events) no other
test pinned, found by mutating it: each test fails on the mutation its
docstring names and passes on the code as it is."""
from __future__ import annotations

from polygate.transport._exchange import _sniff


class _Pieces:
    def __init__(self, pieces):
        self._pieces = list(pieces)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if not self._pieces:
            raise StopAsyncIteration
        return self._pieces.pop(0)


async def test_leading_blanks_of_exactly_the_line_cap_are_skipped() -> None:
    """Mutation: ``skipped > limit`` -> ``>=``: a body whose leading whitespace is
    exactly the cap was no longer sniffed (its first field lost with it)."""
    head = await _sniff(_Pieces([b" " * 10 + b"data: {}\n\n"]), 10)
    assert head.startswith(b"data: ")
    head = await _sniff(_Pieces([b"\n" * 9, b"\n", b"data", b": {}\n\n"]), 10)
    assert head.startswith(b"data: ")


def test_a_chunk_with_a_null_error_is_a_chunk() -> None:
    """Mutation: ``payload.get("error") is not None`` -> ``"error" in payload``: a
    chunk or a body carrying ``"error": null`` beside its choices is no error."""
    from polygate.transport._exchange import _chunk_of, _is_error
    from polygate.transport._sse import Event
    from polygate.transport._wire import Endpoint

    data = b'{"choices":[{"index":0,"delta":{"content":"hi"}}],"error":null}'
    chunk = _chunk_of(Event(data), Endpoint(name="s", url="http://x/v1"), 128)
    assert chunk is not None and chunk["choices"][0]["delta"]["content"] == "hi"
    assert not _is_error({"choices": [], "error": None})
    assert _is_error({"error": {"message": "x"}})
