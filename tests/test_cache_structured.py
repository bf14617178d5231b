"""The response cache and structured output together: a schema is part of the key, and
a hit is validated again so that ``parsed`` is set."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply

from .conftest import MESSAGES, SECRET


class City(pydantic.BaseModel):
    city: str
    population: int


ANSWER = json.dumps({"city": "Lyon", "population": 522000})


def _settings() -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
            cache_ttl_s=60,
        )},
        cache="memory",
    )


async def test_a_schema_is_part_of_the_key_and_a_hit_is_parsed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(text=ANSWER))
    schema: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}
    async with polygate.session(_settings(), transport=up.transport()) as s:
        plain = await s.chat(MESSAGES)
        first = await s.chat(MESSAGES, schema=City)  # not the plain call's entry
        again = await s.chat(MESSAGES, schema=City)  # its own entry: a hit, parsed
        other = await s.chat(MESSAGES, schema=schema)  # another schema: another key
    assert plain.parsed is None and not first.call_stats.cached
    assert isinstance(first.parsed, City)
    assert again.call_stats.cached and again.call_stats.attempts == 0
    assert again.parsed == City(city="Lyon", population=522000)
    assert not other.call_stats.cached and other.parsed == {"city": "Lyon", "population": 522000}
    assert len(up.requests) == 3


async def test_response_format_none_with_a_schema_shares_the_key_of_the_call_without_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (feature pairs): ``response_format=None`` beside a schema is no
    format of the caller's, so both calls send the same body; the second one went
    upstream again, under a key of its own."""
    up = FakeUpstream(Reply(text=ANSWER))
    async with polygate.session(_settings(), transport=up.transport()) as s:
        first = await s.chat(MESSAGES, schema=City)
        again = await s.chat(MESSAGES, schema=City, response_format=None)
    assert not first.call_stats.cached and again.call_stats.cached
    assert again.parsed == first.parsed and len(up.requests) == 1


# A schema over the size checked at the call's start (off the loop), and invalid.
BIG_BAD_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    **{f"p{i}": {"type": "string", "description": "x" * 40} for i in range(60)},
    "bad": {"type": "strnig"},
}}


async def test_a_bad_schema_is_refused_before_the_cache_is_asked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (feature pairs): a large invalid schema raised its ConfigError
    after the lookup, counted as a miss ("a lookup that went upstream") though
    nothing was sent."""
    assert len(json.dumps(BIG_BAD_SCHEMA)) > 2048
    up = FakeUpstream(Reply(text=ANSWER))
    async with polygate.session(_settings(), transport=up.transport()) as s:
        with pytest.raises(polygate.ConfigError, match="strnig"):
            await s.chat(MESSAGES, schema=BIG_BAD_SCHEMA)
        with pytest.raises(polygate.ConfigError, match="strnig"):
            async with s.stream_chat(MESSAGES, schema=BIG_BAD_SCHEMA) as stream:
                async for _ in stream:
                    pass
        cache = (await s.statistics()).cache
    assert cache is not None and (cache.misses, cache.hits, cache.in_flight) == (0, 0, 0)
    assert len(up.requests) == 0


async def test_a_parameter_named_as_a_schemas_entry_once_was_is_not_the_schema(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a schema went into the key as a parameter named ``polygate:schema``, so a
    call without one that sent a vendor field of that name (another request: no
    ``response_format``) was served the structured call's answer."""
    up = FakeUpstream(Reply(text=ANSWER))
    city = City.model_json_schema()
    async with polygate.session(_settings(), transport=up.transport()) as s:
        await s.chat(MESSAGES, schema=City)
        plain = await s.chat(MESSAGES, **{"polygate:schema": {"name": "City", "schema": city}})
    assert "response_format" not in up.requests[-1].body
    assert not plain.call_stats.cached and len(up.requests) == 2
