"""A ``cache="refresh"`` call is the newest answer: an identical call that was already
in flight when it began, and answers after it, does not replace the refreshed entry.
It did: the refresh's answer stood until the older call's came, then the older one
stood for the whole ``cache_ttl_s`` -- a refresh meant to drop a bad answer undone by
traffic already on its way."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, SECRET


def _settings(cache: str) -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, model="m1")
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=600)},
                             cache=cache)


def _answers(**extra: Any) -> FakeUpstream:
    """The first request answers at 10 s, the next ones at 1 s; each names its turn."""
    turn = itertools.count(1)

    def reply(request: Any, rng: Any) -> Reply:
        n = next(turn)
        return Reply(text=f"answer {n}", model=f"m-{n}", headers_delay_s=10.0 if n == 1 else 1.0,
                     **extra)

    return FakeUpstream(reply)


def _cache(kind: str, tmp_path: Path) -> str:
    return "memory" if kind == "memory" else f"sqlite:///{tmp_path / 'c.db'}"


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_refresh_is_not_undone_by_an_older_call_in_flight(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, kind: str
) -> None:
    out: dict[str, polygate.ChatResponse] = {}
    async with polygate.session(_settings(_cache(kind, tmp_path)),
                                transport=Router({"a": _answers()})) as s:
        async def older() -> None:
            out["older"] = await s.chat(MESSAGES)  # asks at 0, answered at 10

        async def refresh() -> None:
            await trio.sleep(1)
            out["refresh"] = await s.chat(MESSAGES, cache="refresh")  # asks at 1, answered at 2

        async with trio.open_nursery() as nursery:
            nursery.start_soon(older)
            nursery.start_soon(refresh)
        after = await s.chat(MESSAGES)
    assert (out["older"].text, out["refresh"].text) == ("answer 1", "answer 2")
    assert after.call_stats.cached and after.text == "answer 2"


async def test_the_older_calls_waiters_still_get_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its answer is still theirs (they asked with it): only the entry is the refresh's."""
    out: dict[str, polygate.ChatResponse] = {}
    async with polygate.session(_settings("memory"), transport=Router({"a": _answers()})) as s:
        async def call(name: str, at: float, cache: bool | str = True) -> None:
            await trio.sleep(at)
            out[name] = await s.chat(MESSAGES, cache=cache)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "older", 0)
            nursery.start_soon(call, "waiter", 0.5)
            nursery.start_soon(call, "refresh", 1, "refresh")
        after = await s.chat(MESSAGES)
    assert out["waiter"].text == "answer 1" and out["waiter"].call_stats.cached
    assert after.text == "answer 2"


async def test_an_embedding_refresh_is_not_undone_either(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with polygate.session(_settings("memory"), transport=Router({"a": _answers()})) as s:
        async def older() -> None:
            await s.embed(["x"], scope="chat")

        async def refresh() -> None:
            await trio.sleep(1)
            assert (await s.embed(["x"], scope="chat", cache="refresh")).model == "m-2"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(older)
            nursery.start_soon(refresh)
        after = await s.embed(["x"], scope="chat")
    assert after.call_stats.cached and after.model == "m-2"
