"""Review finding (failed on main f431ce0, fixed since), Low-Medium: with a write-behind
cache (Redis, SQLite) a call whose lookup round trip is in flight when an identical
leader finishes leads a *second* upstream call.  ``cached_chat`` decides "miss" from
a read that started before the leader stored its answer, then claims a flight after
that await (polygate/_cached.py:227 then :237): the leader's flight is already
settled and removed (``_lead`` :281-282) and its answer is only in ``Cache._pending``
(not yet in the backend), which the finished read never saw.  "State decided after
an await" (review README, STYLE habit 14): the coalescing promise ("identical calls
in flight at once share one upstream call") has a window of one lookup round trip.

The backend here is a stand-in for Redis with a 50 ms round trip (virtual time), put
in through ``polygate._session.open_cache`` (a private seam).

Run: python -m pytest tests/interplay/test_f_cache_lookup_race.py -q
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

import polygate
import polygate._session as session_mod
from polygate.cache import Cache
from polygate.testing import FakeUpstream, Reply, Router

from ..conftest import MESSAGES, SECRET


class SlowStore:
    """A remote store: every operation is a 50 ms round trip."""

    name = "slow"
    write_behind = True

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def start(self) -> None:
        return None

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        await trio.sleep(0.05)
        return [self.data.get(k) for k in keys]

    async def set_many(self, entries: Sequence[tuple[str, bytes, float]]) -> None:
        await trio.sleep(0.05)
        for key, value, _ in entries:
            self.data[key] = value

    async def aclose(self) -> None:
        return None


def _slow_cache_settings(monkeypatch: pytest.MonkeyPatch, scope: str) -> polygate.Settings:
    """One source in ``scope``, its cache the slow store (through the private seam)."""

    @asynccontextmanager
    async def slow_cache(url: str) -> AsyncIterator[Cache]:
        yield Cache(SlowStore())

    monkeypatch.setattr(session_mod, "open_cache", slow_cache)
    return polygate.Settings(
        scopes={scope: polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
            cache_ttl_s=60.0,
        )},
        cache="memory",  # replaced by the slow store above
    )


async def test_a_lookup_in_flight_when_the_leader_finishes_does_not_lead_again(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _slow_cache_settings(monkeypatch, "chat")
    up = FakeUpstream(Reply(first_token_s=1.0, text="the answer"))
    async with polygate.session(settings, transport=Router({"a": up})) as s:

        async def leader() -> None:
            await s.chat(MESSAGES)  # lookup 0-0.05, upstream until ~1.05

        async def twin() -> polygate.ChatResponse:
            await trio.sleep(1.03)  # its lookup (1.03-1.08) spans the leader's end
            return await s.chat(MESSAGES)

        out: list[polygate.ChatResponse] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)

            async def run_twin() -> None:
                out.append(await twin())

            nursery.start_soon(run_twin)
    # Observed: 2 upstream requests, the twin not cached.
    assert len(up.requests) == 1, len(up.requests)
    assert out[0].call_stats.cached


async def test_an_embed_lookup_in_flight_when_the_leader_finishes_does_not_lead_again(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same window for embed (a later review): ``start()`` claimed a flight for an
    input straight after its lookup's await, without looking at what the leader had
    just left here."""

    settings = _slow_cache_settings(monkeypatch, "embed")
    up = FakeUpstream(Reply(headers_delay_s=1.0))
    out: list[polygate.EmbeddingResponse] = []
    async with polygate.session(settings, transport=Router({"a": up})) as s:

        async def leader() -> None:
            await s.embed(["x"])  # lookup 0-0.05, upstream until ~1.05

        async def twin() -> None:
            await trio.sleep(1.03)  # its lookup (1.03-1.08) spans the leader's end
            out.append(await s.embed(["x", "y"]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)
            nursery.start_soon(twin)
    assert [r.body["input"] for r in up.requests] == [["x"], ["y"]]
    assert len(out[0].vectors) == 2
