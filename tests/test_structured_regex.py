"""A JSON Schema's regular expression that backtracks, met by an answer that makes it.

jsonschema checks ``pattern``, ``patternProperties`` and the keys
``additionalProperties`` leaves to them with Python's ``re``, which backtracks and
holds the interpreter's lock for the whole match: ``^(a+)+$`` against ``"aaa…ab"``
held the event loop (and every thread) for seconds on a 30-character answer, past the
call's deadline.  polygate matches them with the ``regex`` module, in bounded time.
The real clock: a match is real CPU time.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import trio
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import polygate
from polygate._schema_patterns import MATCH_TIMEOUT_S
from polygate._structured import Invalid, schema_of
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, one_source_settings

# Python's re backtracks through ~2^26 ways of splitting these a's (seconds); regex
# sees at once that none can end before the b.
_NESTED = r"^(a+)+$"
# Both engines backtrack through ~fib(38) splits: seconds in re; regex gives up.
_ALTERNATION = r"^(a|aa)+$"


def _string_schema(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": {"type": "string", "pattern": pattern}}}


_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "pattern": (_string_schema(_NESTED), '{"x": "' + "a" * 26 + 'b"}'),
    "pattern gives up": (_string_schema(_ALTERNATION), '{"x": "' + "a" * 38 + 'b"}'),
    "patternProperties": (
        {"type": "object", "patternProperties": {_ALTERNATION: {"type": "integer"}}},
        '{"' + "a" * 38 + 'b": "not an integer"}',
    ),
    "additionalProperties": (
        {"type": "object", "patternProperties": {_ALTERNATION: {}}, "additionalProperties": False},
        '{"' + "a" * 38 + 'b": 1}',
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": _NESTED}},
        '{"' + "a" * 26 + 'b": 1}',
    ),
    "nested in $defs": (
        {"$defs": {"s": _string_schema(_ALTERNATION)}, "type": "array", "items": {"$ref": "#/$defs/s"}},
        '[{"x": "' + "a" * 38 + 'b"}]',
    ),
}


@pytest.mark.parametrize("name", list(_CASES))
async def test_a_backtracking_pattern_neither_stalls_the_loop_nor_passes(name: str) -> None:
    schema, answer = _CASES[name]
    up = FakeUpstream(Reply(text=answer))
    settings = one_source_settings(structured=polygate.Structured(max_reasks=0), call_deadline_s=30)
    longest = 0.0

    async def ticker() -> None:
        nonlocal longest
        last = trio.current_time()
        while True:
            await trio.sleep(0.005)
            now = trio.current_time()
            longest = max(longest, now - last)
            last = now

    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            with pytest.raises(polygate.StructuredOutputError) as caught:
                await s.chat(MESSAGES, schema=schema)
            nursery.cancel_scope.cancel()
    # The answer is refused (it matches no pattern, or could not be checked), and the
    # loop ran on: a give-up takes MATCH_TIMEOUT_S and a little (generous margins for
    # a loaded machine; Python's re took seconds on each of these).
    assert longest < 1.0, f"the event loop stalled {longest:.2f} s"
    [problems] = caught.value.errors
    if "gives up" in name or name in ("patternProperties", "additionalProperties", "nested in $defs"):
        assert f"took over {MATCH_TIMEOUT_S:g} s on a string of the answer" in problems, problems


_PATTERNS = st.sampled_from(
    ["^a", "b$", "^[a-c]+$", "x|y", r"\d{2}", "^$", "(ab)*c", "[^a]", "^.{3}$", "é"]
)
_KEYS = st.text(alphabet="abcxy0123é", max_size=5)


@st.composite
def _schemas(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    if draw(st.booleans()):
        schema["properties"] = {k: {"type": "string", "pattern": draw(_PATTERNS)} for k in draw(st.lists(_KEYS, max_size=3))}
    if draw(st.booleans()):
        schema["patternProperties"] = {p: draw(st.sampled_from([{}, {"type": "integer"}, {"pattern": "^a"}])) for p in draw(st.lists(_PATTERNS, max_size=3))}
    extra = draw(st.sampled_from([None, False, True, {"type": "string"}, {"pattern": "y"}]))
    if extra is not None:
        schema["additionalProperties"] = extra
    if draw(st.booleans()):
        schema["propertyNames"] = {"pattern": draw(_PATTERNS)}
    return schema


_VALUES = st.one_of(st.integers(-5, 5), st.text(alphabet="abcxy0123é", max_size=6))


@given(schema=_schemas(), answer=st.dictionaries(_KEYS, _VALUES, max_size=5))
@hsettings(max_examples=300, deadline=None)
def test_the_bounded_keywords_judge_as_jsonschema_does(schema: dict[str, Any], answer: dict[str, Any]) -> None:
    """On patterns that do not backtrack, the same verdict and the same problems as
    jsonschema's own keywords (re and regex agree on these patterns)."""
    ours = schema_of(schema)
    theirs = jsonschema.Draft202012Validator(schema)
    expected = sorted(f"{e.json_path}: {e.message}" for e in theirs.iter_errors(answer))
    text = json.dumps(answer, ensure_ascii=False)
    if not expected:
        assert ours.validate(text) == answer
        return
    with pytest.raises(Invalid) as caught:
        ours.validate(text)
    assert sorted(caught.value.problems) == expected
