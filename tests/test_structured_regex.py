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
import time
from typing import Any

import jsonschema
import pytest
import trio
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import polygate
from polygate._schema_bounds import MATCH_TIMEOUT_S, Budget, OverBudget
from polygate._structured import Invalid, _json_path, schema_of
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, held_loop, one_source_settings

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
    # A descent picks its class by the subschema's $schema: the root's, reached again
    # by {"$ref": "#"}, and an embedded resource's, handed the walk back to
    # jsonschema's own class, with re (review of the fix).
    "a $schema reached by $ref": (
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
         "properties": {"name": {"type": "string", "pattern": _NESTED}, "child": {"$ref": "#"}}},
        '{"name": "aa", "child": {"name": "' + "a" * 26 + 'b"}}',
    ),
    "an embedded resource's $schema": (
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
         "properties": {"x": {"$ref": "https://example.com/s"}},
         "$defs": {"s": {"$id": "https://example.com/s", "type": "string", "pattern": _NESTED,
                         "$schema": "https://json-schema.org/draft/2020-12/schema"}}},
        '{"x": "' + "a" * 26 + 'b"}',
    ),
    "draft-07": (
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
         "properties": {"x": {"type": "string", "pattern": _NESTED}, "child": {"$ref": "#"}}},
        '{"child": {"x": "' + "a" * 26 + 'b"}}',
    ),
}


async def _refused(schema: Any, answer: str, **scope: Any) -> tuple[polygate.StructuredOutputError, float]:
    """The call's StructuredOutputError, and how long the loop was held while it ran
    (the schema compiled first: jsonschema's first import is not the answer's check)."""
    schema_of(schema).compile()
    up = FakeUpstream(Reply(text=answer))
    settings = one_source_settings(structured=polygate.Structured(max_reasks=0), **scope)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with held_loop() as steps, pytest.raises(polygate.StructuredOutputError) as caught:
            await s.chat(MESSAGES, schema=schema)
    return caught.value, steps.longest


@pytest.mark.parametrize("name", list(_CASES))
async def test_a_backtracking_pattern_neither_stalls_the_loop_nor_passes(name: str) -> None:
    schema, answer = _CASES[name]
    error, longest = await _refused(schema, answer, call_deadline_s=30)
    # The answer is refused (it matches no pattern, or could not be checked), and the
    # loop ran on: a give-up takes MATCH_TIMEOUT_S and a little (generous margins for
    # a loaded machine; Python's re took seconds on each of these).
    assert longest < 0.5, f"the event loop was held {longest:.2f} s"
    [problems] = error.errors
    if "gives up" in name or name in ("patternProperties", "additionalProperties", "nested in $defs"):
        assert f"took over {MATCH_TIMEOUT_S:g} s on a string" in problems, problems


_PATTERNS = st.sampled_from(
    ["^a", "b$", "^[a-c]+$", "x|y", r"\d{2}", "^$", "(ab)*c", "[^a]", "^.{3}$", "é",
     "^{e}$", "x{a}", "[[:alpha:]]", r"\{d\}", "a{,2}b"]
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
@pytest.mark.filterwarnings("ignore::FutureWarning")  # (re's "possible nested set")
def test_the_bounded_keywords_judge_as_jsonschema_does(schema: dict[str, Any], answer: dict[str, Any]) -> None:
    """On patterns that do not backtrack, the same verdict and the same problems as
    jsonschema's own keywords (re and regex agree on these patterns)."""
    ours = schema_of(schema)
    theirs = jsonschema.Draft202012Validator(schema)
    # (the path written as polygate writes it: a key that is no plain name as a string)
    expected = sorted(f"{_json_path(e.absolute_path)}: {e.message}" for e in theirs.iter_errors(answer))
    text = json.dumps(answer, ensure_ascii=False)
    if not expected:
        assert ours.validate(text) == answer
        return
    with pytest.raises(Invalid) as caught:
        ours.validate(text)
    assert sorted(caught.value.problems) == expected


# --------------------------------------------------------------------------- the walk

def _node(op: str) -> dict[str, Any]:
    return {"type": "object", "required": ["op", "args"], "properties": {
        "op": {"const": op}, "args": {"type": "array", "items": {"$ref": "#/$defs/expr"}}}}


#: An expression tree: each level's "mul" node is tried as an "add" first, to the end
#: of everything under it (anyOf gathers all of a failing branch's errors), so the
#: check doubles with each level of nesting: 0.02 s at 8 levels, 5.6 s at 16.
_UNION = {"$defs": {"expr": {"anyOf": [_node("add"), _node("mul"), {"type": "number"}]}},
          "$ref": "#/$defs/expr"}


def _chain(depth: int) -> str:
    value: Any = 1
    for _ in range(depth):
        value = {"op": "mul", "args": [value]}
    return json.dumps(value)


async def test_a_recursive_unions_walk_leaves_the_loop_and_ends_at_the_deadline() -> None:
    """Review finding (complexity): a 353-character answer to an expression-tree schema
    was checked on the event loop for 5.6 s, past a 0.5 s deadline, every other task
    held.  Now the loop gives it 30 ms, a worker thread the rest of the call's time."""
    schema_of(_UNION).compile()
    up = FakeUpstream(Reply(text=_chain(18)))
    async with polygate.session(one_source_settings(call_deadline_s=0.5),
                                transport=Router({"a": up})) as s:
        start = trio.current_time()
        with held_loop() as steps, pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES, schema=_UNION)
        took = trio.current_time() - start
    assert steps.longest < 0.3, f"the event loop was held {steps.longest:.2f} s"
    assert took < 1.5, f"a 0.5 s deadline ended the call after {took:.2f} s"


def test_the_thread_stops_itself_at_its_budget() -> None:
    """An abandoned check does not compute on for minutes: it ends at its budget."""
    import time

    schema = schema_of(_UNION)
    start = time.perf_counter()
    with pytest.raises(OverBudget):
        schema.validate(_chain(24), Budget(time.monotonic() + 0.2))
    assert time.perf_counter() - start < 1.0
    shallow = _chain(6)  # a shallow one passes
    assert schema.validate(shallow, Budget(time.monotonic() + 0.2)) == json.loads(shallow)
    stopped = Budget(time.monotonic() + 60)
    stopped.stop()  # (its call was cancelled)
    with pytest.raises(OverBudget):
        schema.validate(_chain(24), stopped)


async def test_with_no_deadline_an_endless_check_is_an_invalid_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from polygate import _structured

    monkeypatch.setattr(_structured, "_OFF_LOOP_S", 0.3)
    up = FakeUpstream(Reply(text=_chain(24)))
    settings = one_source_settings(structured=polygate.Structured(max_reasks=0))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as caught:
            await s.chat(MESSAGES, schema=_UNION)
    [problems] = caught.value.errors
    assert "took over 0.3 s" in problems, problems


# --------------------------------------------------------------------------- review of the fix

@pytest.mark.parametrize(("pattern", "answers"), [
    (r"^/users/{id}$", ["/users/{id}", "/users/7"]),  # regex: a fuzzy constraint, "expected }"
    (r"^env:{env}$", ["env:{env}", "env:"]),
    (r"^[A-Z]{2}{e}$", ["AB{e}", "AB"]),  # regex: "nothing for fuzzy constraint"
    (r"^/v1/{s}/", ["/v1/{s}/", "/v1//"]),  # regex: a fuzzy match, another verdict
    (r"^{d}$", ["{d}", ""]),
    (r"^[[:alpha:]]+$", ["abc", "a]", ":]"]),  # regex: a POSIX class; re: a set, then "]"
    (r"^a{2,}b{,3}c{1}$", ["aab", "aabbbc", "ac"]),  # plain quantifiers: regex, bounded
])
@pytest.mark.filterwarnings("ignore::FutureWarning")  # (re's "possible nested set")
def test_a_pattern_the_engines_read_apart_is_judged_as_jsonschema_does(
    pattern: str, answers: list[str]
) -> None:
    """Review of the fix: the regex module reads a brace group that is no quantifier as
    a fuzzy-matching constraint (or fails: a ConfigError after the call was paid for)
    and "[[:alpha:]]" as a POSIX class, where re (and jsonschema's check of the
    schema) reads text and a set.  Such a pattern is matched by re."""
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    theirs = jsonschema.Draft202012Validator(schema)
    ours = schema_of(schema)
    for answer in answers:
        text = json.dumps({"p": answer})
        if theirs.is_valid({"p": answer}):
            assert ours.validate(text) == {"p": answer}, (pattern, answer)
        else:
            with pytest.raises(Invalid):
                ours.validate(text)


def test_many_quick_matches_are_no_give_up_in_a_busy_process() -> None:
    """Review of the fix: matched with the interpreter's lock let go, each match then
    waited to take it back, and the wait counted against its 0.1 s: valid answers
    were refused "as backtracking" (and re-asked, paid for) while other threads ran,
    and 3,000 strings took a minute."""
    import threading

    schema = schema_of({"type": "array", "items": {"type": "string", "pattern": r"^[a-z]+@[a-z]+\.com$"}})
    answer = ["someone@example.com"] * 3000
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            pass

    threads = [threading.Thread(target=busy) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        start = time.perf_counter()
        for _ in range(3):
            assert schema.validate(json.dumps(answer)) == answer
        took = time.perf_counter() - start
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert took < 20, took


async def test_many_slow_strings_are_bounded_by_the_budget_not_string_by_string() -> None:
    """Review of the fix: the give-up is one string's; an answer of many strings, each
    just under it, held the event loop for seconds.  ``pattern`` looks at the budget
    too: the loop gives the check 30 ms and a match, then a thread takes the rest."""
    import regex

    compiled = regex.compile(_ALTERNATION)
    slow = "a" * 20 + "b"
    for n in range(20, 40):  # a string this machine takes a fair part of the give-up on
        text = "a" * n + "b"
        begun = time.perf_counter()
        try:
            compiled.search(text, concurrent=False, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            break
        slow = text
        if time.perf_counter() - begun > MATCH_TIMEOUT_S / 3:
            break
    answer = json.dumps([slow] * (1900 // (len(slow) + 4)))
    assert len(answer) <= 2048  # (checked on the event loop)
    schema = {"type": "array", "items": {"type": "string", "pattern": _ALTERNATION}}
    _, longest = await _refused(schema, answer, call_deadline_s=60)
    assert longest < 0.5, f"the event loop was held {longest:.2f} s"


def test_without_the_regex_module_patterns_are_matched_by_re(monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonschema installed alone (not the structured extra): a dict schema still
    works, its patterns matched as jsonschema matches them."""
    import sys

    from polygate import _schema_bounds

    monkeypatch.setitem(sys.modules, "regex", None)  # import regex: ImportError
    _schema_bounds._compiled.cache_clear()
    try:
        schema = schema_of({"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-z]+-x$"}}})
        assert schema.validate('{"p": "ab-x"}') == {"p": "ab-x"}
        with pytest.raises(Invalid):
            schema.validate('{"p": "AB-x"}')
        assert _schema_bounds._compiled("^[a-z]+-x$")[1] is False  # (re's, unbounded)
    finally:
        _schema_bounds._compiled.cache_clear()
