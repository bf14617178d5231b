"""The nesting check every request body, message list and structured answer passes:
``polygate._json.nested_deeper`` against the depth of the value itself."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from polygate._json import nested_deeper

# Strings made to trip a scanner: quotes, backslashes, brackets, and escapes' letters.
_TRICKY = st.text(alphabet=st.sampled_from('"\\[]{}nu0a \n\u00e9\U0001f600'), max_size=8)
_SCALARS = st.none() | st.booleans() | st.integers() | _TRICKY
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
    max_leaves=40,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@given(_VALUES, st.booleans(), st.sampled_from([None, 0, 2]))
def test_the_nesting_found_is_the_values_own(value: Any, ascii_only: bool, indent: int | None) -> None:
    """Brackets, quotes and backslashes inside strings are no nesting, however they are
    escaped, in text and in bytes, for every limit around the real depth."""
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    depth = _depth(value)
    for limit in range(max(0, depth - 2), depth + 2):
        expected = depth > limit
        assert nested_deeper(text, limit) is expected, (text, limit)
        assert nested_deeper(text.encode(), limit) is expected, (text, limit)


def test_escapes_next_to_quotes() -> None:
    """Runs of backslashes before a quote: an even run closes the string, an odd one
    escapes the quote."""
    assert nested_deeper(b'["\\\\", [[]]]', 2)  # "\\" closed: the [[]] is nesting
    assert not nested_deeper(b'["\\\\\\", [[]]]"]', 2)  # \\\" escaped: the rest is text
    assert nested_deeper(b'["\\\\\\\\", [[]]]', 2)  # \\\\: two pairs, closed
    assert not nested_deeper(b'["[[[", "]]]"]', 1)  # brackets in strings
    assert nested_deeper(b'[[["' + b"[" * 10, 2)  # an unterminated string runs to the end
    assert not nested_deeper(b'[[["' + b"[" * 10, 3)
