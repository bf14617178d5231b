from __future__ import annotations

import bisect
import contextlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import settings as hypothesis_settings

import polygate
from polygate.governance import MemoryBackend

# No deadline on an example: a property's examples run on a shared 2-core machine,
# where one descheduled for 200 ms failed its property ("Unreliable test timings")
# with nothing wrong.  Every property that needs a bound sets its own.
hypothesis_settings.register_profile("polygate", deadline=None)
hypothesis_settings.load_profile("polygate")

ROOT = Path(__file__).resolve().parent.parent
# A byte-exact copy of ../shared/transcripts (provenance in its INDEX.md).
TRANSCRIPTS = ROOT / "tests" / "transcripts"

SECRET = "sk-test-SECRET-0123456789abcdef"


def one_source_settings(**scope: Any) -> polygate.Settings:
    return polygate.Settings(
        scopes={
            "chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
                **scope,
            )
        }
    )


# Weights that make picking practically deterministic: "a" first (P(b first) ~ 1e-9).
FIRST_A = {"a": 1.0, "b": 1e-9, "c": 1e-9}


def two_source_settings(
    *,
    source_kw: dict[str, Any] | None = None,
    names: tuple[str, ...] = ("a", "b"),
    weights: dict[str, float] | None = None,
    **scope: Any,
) -> polygate.Settings:
    """Sources named after hosts (``http://a/v1``…) so a testing.Router can serve them."""
    kw = source_kw or {}
    w = weights or {}
    sources = [
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, weight=w.get(n, 1.0), **kw)
        for n in names
    ]
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=sources, **scope)})


MESSAGES = [{"role": "user", "content": "hello there"}]


class CountingBackend(MemoryBackend):
    """The memory backend, counting its admission passes."""

    def __init__(self) -> None:
        super().__init__()
        self.admits = 0

    async def admit(self, request: Any) -> Any:
        self.admits += 1
        return await super().admit(request)


async def ask(s: polygate.Session, streaming: bool, messages: Any = MESSAGES) -> None:
    """One call, ``chat()`` or a ``stream_chat()`` read to its end."""
    if not streaming:
        await s.chat(messages)
        return
    async with s.stream_chat(messages) as stream:
        async for _ in stream:
            pass


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pytest-trio's trio mode marks every async test as a trio test; the asyncio tests
    # (polygate.aio) are anyio's (``@pytest.mark.anyio``): they keep only that mark.
    for item in items:
        if item.get_closest_marker("anyio") is not None:
            item.own_markers[:] = [m for m in item.own_markers if m.name != "trio"]


class LoopSteps(trio.abc.Instrument):
    """The longest run of one task without a checkpoint: how long the event loop was
    held.  (A ticker task misses the gap when it is cancelled right after it.)"""

    def __init__(self) -> None:
        self.longest = 0.0
        self._began: float | None = None  # (None: a step begun before this was added)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._began is not None:
            self.longest = max(self.longest, time.perf_counter() - self._began)


@contextlib.contextmanager
def held_loop() -> Iterator[LoopSteps]:
    steps = LoopSteps()
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)


def reader_leads(pieces: list[str], shown: list[int]) -> list[int]:
    """How many chunks ahead of a stream's reader its call was each time the reader
    took one: ``pieces`` the chunks' texts as taken, ``shown`` the length of
    ``stream.text`` (yielded or queued) at each take."""
    ends = list(itertools.accumulate(map(len, pieces)))
    return [bisect.bisect_right(ends, chars) - taken for taken, chars in enumerate(shown, 1)]
