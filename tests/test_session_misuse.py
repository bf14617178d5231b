"""The session misused as users misuse it (an outside review): a typed, clear error
and nothing taken, where trio's own error was a bare RuntimeError or a corrupted run."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import SECRET

HI = [{"role": "user", "content": "hi"}]


def _settings(**settings: object) -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[source]), "embed": polygate.Scope(sources=[source])},
        **settings)  # type: ignore[arg-type]


def test_a_trio_session_opened_from_asyncio_points_to_polygate_aio() -> None:
    """The commonest misuse (a FastAPI app writing polygate.session()): trio's
    "must be called from async context", raised from deep inside."""
    async def main() -> None:
        async with polygate.session(_settings(), transport=FakeUpstream(Reply()).transport()):
            pass  # pragma: no cover

    with pytest.raises(polygate.PolygateError, match=r"from asyncio use polygate\.aio\.session\(\)"):
        asyncio.run(main())


def test_a_trio_session_from_the_environment_opened_from_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYGATE__CHAT__A__BASE_URL", "http://a/v1")

    async def main() -> None:
        async with polygate.session():
            pass  # pragma: no cover

    with pytest.raises(polygate.PolygateError, match=r"polygate\.aio\.session\(\)"):
        asyncio.run(main())


async def test_a_session_left_by_another_task_is_refused_and_stays_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A session block left by another task (an AsyncExitStack handed to it, say):
    trio's nursery misnesting, then a corrupted run.  Now a PolygateError, the session
    untouched, and the task that entered it leaves it cleanly."""
    upstream = FakeUpstream(Reply())
    block = polygate.session(_settings(), transport=Router({"a": upstream}))
    session = await block.__aenter__()
    errors: list[BaseException] = []

    async def closer() -> None:
        try:
            await block.__aexit__(None, None, None)
        except polygate.PolygateError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(closer)
    assert len(errors) == 1 and "left by the task that entered it" in str(errors[0])
    assert (await session.chat(HI)).text  # still open
    await block.__aexit__(None, None, None)
    with pytest.raises(polygate.PolygateError, match="closed"):
        await session.chat(HI)


@pytest.mark.parametrize("kind", ["chat", "embed", "stream"])
async def test_a_call_in_a_cancelled_scope_takes_no_admission(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, kind: str,
) -> None:
    """chat() in a cancelled scope took a permit and a reservation, and wrote an
    attempt row, for a request it never sent (the memory backend admits without a
    checkpoint); stream_chat() and embed() did not."""
    upstream = FakeUpstream(Reply())
    db = tmp_path / "t.db"
    async with polygate.session(_settings(telemetry=f"sqlite:///{db}"), transport=Router({"a": upstream})) as s:
        with trio.move_on_after(0):
            if kind == "chat":
                await s.chat(HI)
            elif kind == "embed":
                await s.embed(["x"])
            else:
                async with s.stream_chat(HI) as stream:
                    async for _ in stream:
                        pass  # pragma: no cover
        stats = await s.statistics()
    assert upstream.statistics().requests == 0
    assert sum(source.state.admissions for source in stats.governance.sources) == 0
    with contextlib.closing(sqlite3.connect(db)) as connection:
        assert connection.execute("select count(*) from attempts").fetchone() == (0,)
        if kind != "stream":
            assert connection.execute("select outcome, attempts from calls").fetchall() == [("cancelled", 0)]
