"""A pydantic model's schema and OpenAI's strict mode.

polygate sends ``Model.model_json_schema()`` with ``"strict": true``.  OpenAI (and
Azure OpenAI) accept only a schema in strict form -- every object closed
(``additionalProperties: false``) and every property in ``required`` -- and refuse any
other with a 400 "Invalid schema for response_format ...": a plain
``class Answer(BaseModel)`` failed every call there.  A source that refuses so is
asked again, at once and free of the attempt budget, with the model's schema in
strict form (as openai-python's ``parse()`` sends it), and is asked so from then on.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

import pydantic
import pytest
import trio
import trio.testing

import polygate
from polygate._structured import strict_form
from polygate.testing import FakeUpstream, RecordedRequest, Reply, Router

from .conftest import MESSAGES, one_source_settings


class Place(pydantic.BaseModel):
    name: str


class Answer(pydantic.BaseModel):
    city: str
    population: int
    unit: str = "people"
    capital_of: Place | None = pydantic.Field(default=None, description="the country")
    neighbours: list[Place] = []


GOOD = json.dumps({"city": "Paris", "population": 2100000, "unit": "people",
                   "capital_of": {"name": "France"}, "neighbours": []})


def _strict_problem(schema: Any, root: Any = None, path: str = "") -> str | None:
    """What OpenAI's strict mode refuses in ``schema`` (the rules it names), or None."""
    root = schema if root is None else root
    if isinstance(schema, dict):
        if "$ref" in schema and len(schema) > 1:
            return f"{path}: $ref beside other keywords"
        if schema.get("type") == "object" or "properties" in schema:
            if schema.get("additionalProperties") is not False:
                return f"{path}: 'additionalProperties' is required to be supplied and to be false"
            if sorted(schema.get("required", [])) != sorted(schema.get("properties", {})):
                return f"{path}: 'required' is required to include every key in properties"
        if "default" in schema and schema["default"] is None:
            return f"{path}: a None default"
        if "oneOf" in schema:
            return f"{path}: 'oneOf' is not permitted"
        for key, value in schema.items():
            found = _strict_problem(value, root, f"{path}/{key}")
            if found:
                return found
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found = _strict_problem(value, root, f"{path}/{i}")
            if found:
                return found
    return None


def _like_openai(rec: RecordedRequest, rng: Any) -> Reply:
    sent = rec.body["response_format"]["json_schema"]
    problem = _strict_problem(sent["schema"])
    if problem is not None:
        message = f"Invalid schema for response_format '{sent['name']}': In context=(), {problem}."
        return Reply(status=400, error_body={"error": {
            "message": message, "type": "invalid_request_error",
            "param": "response_format", "code": None}})
    return Reply(text=GOOD)


def test_the_strict_form_of_a_models_schema_is_what_strict_mode_accepts() -> None:
    plain = Answer.model_json_schema()
    assert _strict_problem(plain) is not None  # (what a plain model gives)
    strict = strict_form(plain)
    assert _strict_problem(strict) is None
    assert plain == Answer.model_json_schema()  # (the model's own is left as it is)
    # The same properties, in the same order (models write them in schema order).
    assert list(strict["properties"]) == list(plain["properties"])
    assert strict["properties"]["capital_of"]["description"] == "the country"


def test_a_schema_already_in_strict_form_is_unchanged() -> None:
    class Closed(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str

    schema = Closed.model_json_schema()
    assert strict_form(schema) == schema


async def test_a_source_refusing_a_loose_schema_is_asked_again_with_its_strict_form(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(_like_openai)
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        first = await s.chat(MESSAGES, schema=Answer)
        second = await s.chat(MESSAGES, schema=Answer)
        state = (await s.statistics()).governance.sources[0].state
    assert first.parsed == Answer.model_validate_json(GOOD) and second.parsed == first.parsed
    sent = [r.body["response_format"]["json_schema"]["schema"] for r in up.requests]
    # The first as the contract has it; then, to this source, its strict form.
    assert sent == [Answer.model_json_schema(), strict_form(Answer.model_json_schema()),
                    strict_form(Answer.model_json_schema())]
    assert first.call_stats.attempts == 2 and second.call_stats.attempts == 1
    assert state.consecutive_failures == 0  # (polygate's way of asking, not the source)


async def test_a_callers_dict_schema_is_sent_as_given_and_its_refusal_is_theirs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A dict schema is the caller's own words: not rewritten, and a refusal of it is
    the request's (fatal), as any 400."""
    schema = {"title": "City", "type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    up = FakeUpstream(_like_openai)
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError, match="Invalid schema for response_format"):
            await s.chat(MESSAGES, schema=schema)
    assert len(up.requests) == 1


async def test_another_400_is_still_the_requests(autojump_clock: trio.testing.MockClock) -> None:
    refusal = Reply(status=400, error_body={"error": {
        "message": "Invalid value for 'temperature'", "type": "invalid_request_error",
        "param": "temperature", "code": None}})
    up = FakeUpstream(refusal)
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError, match="temperature"):
            await s.chat(MESSAGES, schema=Answer, temperature=9)
    assert len(up.requests) == 1


class Comment(pydantic.BaseModel):
    text: str
    replies: list[Annotated[Comment, pydantic.Field(description="a reply")]] = []


class Mutual(pydantic.BaseModel):
    name: str
    sub: Sub = pydantic.Field(description="the sub")


class Sub(pydantic.BaseModel):
    back: list[Annotated[Mutual, pydantic.Field(description="back")]] = []


Mutual.model_rebuild()


def _chain(levels: int) -> type[pydantic.BaseModel]:
    """A model whose sub-model at each level is referred to twice, each time with a
    description: unravelled whole, its strict form doubles at every level."""
    model: Any = pydantic.create_model("L0", v=(int, ...))
    for i in range(1, levels + 1):
        model = pydantic.create_model(f"L{i}", left=(model, pydantic.Field(description="l")),
                                      right=(model, pydantic.Field(description="r")))
    return model  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", [Comment, Mutual], ids=["self", "mutual"])
def test_a_described_reference_in_a_cycle_is_kept_as_a_reference(model: type[pydantic.BaseModel]) -> None:
    """Review of the fix: such a model (a comment's replies) unravelled forever --
    every structured call with it raised RecursionError, on any source."""
    strict = strict_form(model.model_json_schema())
    assert strict is not None and _strict_problem(strict) is None


async def test_a_model_with_a_cycle_still_works_where_any_schema_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    good = json.dumps({"text": "x", "replies": [{"text": "y", "replies": []}]})
    up = FakeUpstream(Reply(text=good))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        assert (await s.chat(MESSAGES, schema=Comment)).parsed == Comment.model_validate_json(good)


def test_the_strict_form_is_bounded() -> None:
    """Review of the fix: a 4 KB schema (16 levels) unravelled into 40 MB, for 7 s on
    the event loop, at a call's start; past a bound, a reference keeps no description."""
    schema = _chain(16).model_json_schema()
    assert len(json.dumps(schema)) < 4000
    started = time.perf_counter()
    strict = strict_form(schema)
    assert time.perf_counter() - started < 0.5
    assert strict is not None and _strict_problem(strict) is None
    assert len(json.dumps(strict)) < 2_000_000


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Owner(pydantic.BaseModel):
    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]


def test_a_discriminated_union_is_a_strict_any_of() -> None:
    """Review: pydantic writes a discriminated union as ``oneOf`` (with a
    ``discriminator``), which strict mode refuses: the strict form was refused too.
    Its branches' distinct tags make ``anyOf`` accept the same answers; the model
    still validates them."""
    strict = strict_form(Owner.model_json_schema())
    assert strict is not None and _strict_problem(strict) is None
    assert "discriminator" not in json.dumps(strict)
    assert Owner.model_validate_json('{"pet": {"kind": "dog", "good": true}}').pet == Dog(kind="dog", good=True)
