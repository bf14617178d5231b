"""The response cache and structured output together: a schema is part of the key, and
a hit is validated again so that ``parsed`` is set."""

from __future__ import annotations

import json
from typing import Any

import pydantic
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
