"""A JSON Schema's bounded check, after the second review of its fixes: each test
here was a reviewer's probe that failed on the code before its fix.

- a schema mixing drafts keeps its ``$schema``s (taken out, a 2020-12 subschema under
  a draft-07 resource was checked by draft-07's rules: wrong answers passed);
- a worker thread's matches let the interpreter's lock go (held, many slow strings
  starved the event loop for seconds);
- ``patternProperties`` and ``additionalProperties`` look at the budget at each key;
- under a MockClock the thread's budget is not the virtual time left (a valid answer
  was refused by the machine's speed).
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import jsonschema
import pytest
import regex
import trio
import trio.testing

import polygate
from polygate._structured import Invalid, schema_of
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, held_loop, one_source_settings

D7 = "http://json-schema.org/draft-07/schema#"
D20 = "https://json-schema.org/draft/2020-12/schema"

# A 2020-12 subschema (prefixItems) nested inside a draft-07 resource.
NESTED = {
    "$schema": D20, "type": "object",
    "properties": {"o": {"$ref": "https://e.com/old"}},
    "$defs": {"old": {
        "$schema": D7, "$id": "https://e.com/old", "type": "object",
        "properties": {"x": {"$schema": D20, "prefixItems": [{"type": "integer"}]}},
    }},
}
# A draft-07 resource that refers back to the (2020-12) root.
BACK = {
    "$schema": D20, "$id": "https://e.com/root", "type": "object",
    "properties": {"t": {"prefixItems": [{"type": "integer"}]}, "o": {"$ref": "https://e.com/old"}},
    "$defs": {"old": {
        "$schema": D7, "$id": "https://e.com/old", "type": "object",
        "properties": {"back": {"$ref": "https://e.com/root"}},
    }},
}


@pytest.mark.parametrize(("schema", "answer"), [
    (NESTED, {"o": {"x": ["not an integer"]}}),
    (BACK, {"o": {"back": {"t": ["not an integer"]}}}),
])
def test_a_root_draft_subschema_under_another_drafts_resource_keeps_its_draft(
    schema: dict[str, Any], answer: Any,
) -> None:
    assert not jsonschema.validators.validator_for(schema)(copy.deepcopy(schema)).is_valid(answer)
    with pytest.raises(Invalid):
        schema_of(copy.deepcopy(schema)).validate(json.dumps(answer))


PATTERN = r"^(a|aa)+$"


def _slow(n_max: int = 40) -> str:
    """A string this machine takes a fair part of the 0.1 s give-up on, not all of it."""
    compiled = regex.compile(PATTERN)
    text = "a" * 20 + "b"
    for n in range(20, n_max):
        candidate = "a" * n + "b"
        begun = time.perf_counter()
        try:
            compiled.search(candidate, concurrent=False, timeout=0.1)
        except TimeoutError:
            break
        text = candidate
        if time.perf_counter() - begun > 0.03:
            break
    return text


async def test_many_slow_strings_in_a_long_answer_do_not_starve_the_loop() -> None:
    schema = {"type": "array", "items": {"type": "string", "pattern": PATTERN}}
    schema_of(schema).compile()
    answer = json.dumps([_slow()] * 150)
    assert len(answer) > 2048  # (checked in a worker thread)
    up = FakeUpstream(Reply(text=answer))
    settings = one_source_settings(structured=polygate.Structured(max_reasks=0), call_deadline_s=4)
    starved = 0.0  # seconds the loop was late by more than 20 ms (a thread holding the
    # interpreter's lock shows in no task's step: the loop waits to run at all)

    async def ticker() -> None:
        nonlocal starved
        while True:
            before = time.perf_counter()
            await trio.sleep(0.005)
            late = time.perf_counter() - before - 0.005
            if late > 0.02:
                starved += late

    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            try:
                await s.chat(MESSAGES, schema=schema)
            except (polygate.StructuredOutputError, polygate.DeadlineExceeded):
                pass
            nursery.cancel_scope.cancel()
    assert starved < 1.0, f"the event loop was starved {starved:.2f} s"


@pytest.mark.parametrize("keyword", ["patternProperties", "additionalProperties"])
async def test_many_slow_keys_do_not_hold_the_loop(keyword: str) -> None:
    if keyword == "patternProperties":
        schema: dict[str, Any] = {"type": "object", "patternProperties": {PATTERN: {"type": "integer"}}}
    else:
        schema = {"type": "object", "patternProperties": {PATTERN: {}},
                  "additionalProperties": {"type": "integer"}}
    schema_of(schema).compile()
    slow = _slow()
    answer: dict[str, int] = {}
    while len(json.dumps(answer)) < 1950:
        answer[f"{slow}{len(answer)}"] = 1
    up = FakeUpstream(Reply(text=json.dumps(answer)))
    settings = one_source_settings(structured=polygate.Structured(max_reasks=0), call_deadline_s=4)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with held_loop() as steps:
            try:
                await s.chat(MESSAGES, schema=schema)
            except (polygate.StructuredOutputError, polygate.DeadlineExceeded):
                pass
    assert steps.longest < 0.3, f"the event loop was held {steps.longest:.2f} s"


def test_a_valid_big_answer_under_a_mockclock_is_accepted_however_slow_the_machine() -> None:
    schema = {"type": "array", "items": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "string", "minLength": 1}}}}
    answer = json.dumps([{"a": i, "b": "x" * 10} for i in range(20000)])
    schema_of(schema).compile()
    begun = time.perf_counter()
    schema_of(schema).validate(answer)
    assert time.perf_counter() - begun > 0.2  # (longer in real time than the deadline's 0.2)

    async def main() -> None:
        up = FakeUpstream(Reply(text=answer))
        settings = one_source_settings(call_deadline_s=0.2, structured=polygate.Structured(max_reasks=0))
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            response = await s.chat(MESSAGES, schema=schema)
        assert response.parsed == json.loads(answer)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
