"""Structured output in combination with the cache and failover (outside review,
2026-12-02): each test failed before its fix."""

from __future__ import annotations

from typing import Any

import pydantic
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, RecordedRequest, Reply, Router

MESSAGES = [{"role": "user", "content": "hello there"}]
GOOD = '{"city": "Paris", "population": 2100000}'
NOT_JSON = "Paris, about two million people."
CONTEXT_400 = Reply(status=400, error_body={"error": {
    "message": "This model's maximum context length is 8192 tokens.",
    "type": "invalid_request_error", "code": "context_length_exceeded"}})


class Answer(pydantic.BaseModel):
    city: str
    population: int


class AnswerStrict(pydantic.BaseModel):
    # The same JSON Schema (and name) as Answer, so the same cache key, but a
    # validator that refuses Paris.  (No docstring: it would be the schema's
    # description.)
    city: str
    population: int

    @pydantic.field_validator("city")
    @classmethod
    def not_paris(cls, v: str) -> str:
        if v == "Paris":
            raise ValueError("not Paris")
        return v


AnswerStrict.__name__ = "Answer"


def by_round(*replies: Reply) -> Any:
    """The reply of each round: the re-asks append the answer as an assistant turn."""
    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        done = sum(1 for m in rec.body["messages"] if m.get("role") == "assistant")
        return replies[min(done, len(replies) - 1)]
    return behaviour


def settings(*, cache: str = "memory", **scope: Any) -> polygate.Settings:
    extra = scope.pop("extra_scopes", {})
    model = scope.pop("model", None)
    source = polygate.Source(name="a", base_url="http://a/v1", api_key="sk-x", model=model)
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=60, **scope), **extra},
        cache=cache,
    )


async def test_a_reask_never_resends_to_the_model_that_refused_the_context(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A re-ask round (longer still: the answer and its problems appended) went back to
    the asked scope's small model, which had already refused this call's prompt as too
    long: a second 400 and an attempt for nothing (docs/failover.md: a context-length
    error is never resent to the same model)."""
    small = FakeUpstream(CONTEXT_400)
    large = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=GOOD)))
    big = polygate.Scope(sources=[polygate.Source(name="large", base_url="http://large/v1",
                                                  model="m-128k")])
    st = settings(cache="off", fallback="big", extra_scopes={"big": big}, model="m-8k")
    async with polygate.session(st, transport=Router({"a": small, "large": large})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed is not None and r.call_stats.reasks == 1 and r.call_stats.scope == "big"
    assert len(small.requests) == 1 and r.call_stats.attempts == 3


async def test_a_stored_answer_another_schema_rejects_counts_one_cache_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A waiter whose own validation rejected the leader's answer looked at the same
    entry again once it led, and counted the one lookup's error twice."""
    up = FakeUpstream(by_round(Reply(text=GOOD, first_token_s=1),
                               Reply(text='{"city": "Lyon", "population": 1}')))
    out: dict[str, Any] = {}
    async with polygate.session(settings(), transport=Router({"a": up})) as s:
        async def first() -> None:
            out["a"] = await s.chat(MESSAGES, schema=Answer)

        async def strict() -> None:
            await trio.sleep(0.1)  # waits on the first call's flight
            out["b"] = await s.chat(MESSAGES, schema=AnswerStrict)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            nursery.start_soon(strict)
        cache = (await s.statistics()).cache
    assert out["b"].parsed.city == "Lyon"
    assert (cache.errors, cache.misses, cache.coalesced) == (1, 2, 0)


async def test_a_structured_error_shared_with_a_waiter_is_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The waiter's StructuredOutputError held the leader's ``errors`` list itself (the
    leader's internal one, too): changing one caller's changed the other's."""
    up = FakeUpstream(Reply(text=NOT_JSON, first_token_s=1))
    errors: list[polygate.StructuredOutputError] = []
    async with polygate.session(settings(), transport=Router({"a": up})) as s:
        async def one() -> None:
            try:
                await s.chat(MESSAGES, schema=Answer)
            except polygate.StructuredOutputError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
    leader, waiter = sorted(errors, key=lambda e: -(e.call_stats.attempts if e.call_stats else 0))
    assert waiter.errors == leader.errors and waiter.errors is not leader.errors
    leader.errors.append("changed by its caller")
    assert "changed by its caller" not in waiter.errors
