"""A lookup that looked before an identical call's answer was written.

The write-behind holds an answer until it is written, then lets go of it; a lookup
whose backend read looked before that write committed, and came back after, found it
nowhere, and led a second upstream call for an answer already stored (outside reviews
found it for chat on SQLite, then for embed under plain latencies, and for an embed
waiter whose flight was abandoned).  Before it leads, a call reads again the keys
written since it began, holding their flights (``Cache.written_since``).

The backend here is scripted: a read looks at the data at once and answers later, a
write commits at once (virtual time, MockClock through ``Schedule``, with trio's
scheduling order varied by its seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

import polygate
from polygate.cache import _cache
from polygate.testing import FakeUpstream, Reply, Schedule

MESSAGES = [{"role": "user", "content": "hi"}]


class Lagging:
    """Reads look at the data at once and answer ``read_s`` later; writes commit at
    once."""

    name = "lagging"
    write_behind = True
    timeout_s = 1.0

    def __init__(self, read_s: float) -> None:
        self.read_s = read_s
        self.data: dict[str, tuple[bytes, float]] = {}

    async def start(self) -> str | None:
        return None

    async def aclose(self) -> None:
        return None

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        now = trio.current_time()
        found: list[bytes | None] = []
        for key in keys:
            item = self.data.get(key)
            found.append(item[0] if item is not None and item[1] > now else None)
        await trio.sleep(self.read_s)
        return found

    async def set_many(self, entries: Sequence[tuple[str, bytes, float]]) -> None:
        now = trio.current_time()
        for key, value, ttl in entries:
            self.data[key] = (value, now + ttl)
        await trio.lowlevel.checkpoint()


def _settings(tmp_path: Path) -> polygate.Settings:
    sources = [polygate.Source(name="a", base_url="http://a/v1", api_key="k", model="m")]
    return polygate.Settings(
        cache=f"sqlite:///{tmp_path}/unused.db",  # (replaced by the scripted backend)
        scopes={"chat": polygate.Scope(cache_ttl_s=600, sources=sources),
                "embed": polygate.Scope(cache_ttl_s=600, sources=sources)})


def _inputs(up: FakeUpstream) -> list[str]:
    sent: list[str] = []
    for request in up.requests:
        if request.path.endswith("/embeddings"):
            given = request.body["input"]
            sent += [given] if isinstance(given, str) else list(given)
    return sent


@pytest.mark.parametrize("seed", range(5))
def test_overlapping_embeds_ask_for_each_input_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
) -> None:
    """The second call's read of x and y looks at 0.05 (nothing) and answers at 0.1;
    x was written meanwhile (the first call's), and while its read again of x is on its
    way, the third call answers y and writes it: leading y, the second call read it
    again too (it asked the upstream for y a second time)."""
    monkeypatch.setattr(_cache, "_backend", lambda options: Lagging(0.05))
    up = FakeUpstream(Reply(text="v"))
    stats: list[Any] = []

    async def main() -> None:
        async with polygate.session(_settings(tmp_path), transport=up.transport()) as s:
            async def one(at: float, inputs: list[str]) -> None:
                await trio.sleep(at)
                await s.embed(inputs, scope="embed")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0.0, ["x"])
                nursery.start_soon(one, 0.05, ["x", "y"])
                nursery.start_soon(one, 0.05, ["y"])
            stats.append((await s.statistics()).cache)

    Schedule(seed).run(main)
    assert sorted(_inputs(up)) == ["x", "y"], (_inputs(up), stats)


@pytest.mark.parametrize("deadline", [None, 5.0])
@pytest.mark.parametrize("kind", ["chat", "embed"])
def test_a_waiter_of_an_abandoned_flight_reads_what_was_written_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, deadline: float | None,
) -> None:
    """The leader gives up at 0.8; its waiter (since 0.1) leads then; a ``refresh``
    call (which never waits) answered and wrote the key at about 0.3: the waiter is
    served that answer, a hit.  (With a deadline too: its lookups' share of it is
    reading time, not a window that closed while it waited, a review found.)"""
    monkeypatch.setattr(_cache, "_backend", lambda options: Lagging(0.01))
    up = FakeUpstream([Reply(first_token_s=1.0, text="v"), Reply(first_token_s=0.1, text="v")],
                      then=Reply(first_token_s=0.1, text="v"))
    got: dict[str, Any] = {}

    async def main() -> None:
        async with polygate.session(_settings(tmp_path), transport=up.transport()) as s:
            async def ask(**kw: Any) -> Any:
                if kind == "chat":
                    return (await s.chat(MESSAGES, **kw)).call_stats.cached
                return (await s.embed(["x"], scope="embed", **kw)).call_stats.cached

            async def leader() -> None:
                with trio.move_on_after(0.8):
                    await ask()

            async def waiter() -> None:
                await trio.sleep(0.1)
                got["waiter"] = await ask(call_deadline_s=deadline)

            async def refresher() -> None:
                await trio.sleep(0.2)
                got["refresh"] = await ask(cache="refresh")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(leader)
                nursery.start_soon(waiter)
                nursery.start_soon(refresher)

    Schedule(0).run(main)
    assert got["waiter"] is True, got
    assert len(up.requests) == 2
