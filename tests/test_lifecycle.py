"""Sessions and streams begin and end cleanly (review R4, R5, R10, R11, suspicious 9):
Ctrl-C arrives as KeyboardInterrupt, a closed session sends nothing, a finished or
abandoned stream says so, and no telemetry row vanishes uncounted."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ._serve_kit import wait_for
from .conftest import MESSAGES, ask, one_source_settings

_CTRL_C = textwrap.dedent('''
    import os, signal, threading, trio, polygate
    from polygate.testing import FakeUpstream, Reply, Router

    sources = [polygate.Source(name=n, base_url=f"http://{{n}}/v1", weight=w)
               for n, w in (("a", 1.0), ("b", 1e-9))]
    hedge = polygate.Hedge(after_s=30) if {hedge} else polygate.Hedge()
    settings = polygate.Settings(scopes={{"chat": polygate.Scope(sources=sources, hedge=hedge)}})
    slow = FakeUpstream(Reply(first_token_s=60))

    async def main():
        async with polygate.session(settings, transport=Router({{"a": slow, "b": slow}})) as s:
            try:
                {body}
            except BaseException as exc:
                print("INNER", type(exc).__name__, flush=True)
                raise

    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        trio.run(main)
    except KeyboardInterrupt:
        print("OUTER KeyboardInterrupt")
    except BaseException as exc:
        print("OUTER", type(exc).__name__)
''')

_BODIES = {
    "sleep": "await trio.sleep(30)",
    "chat": "await s.chat([{'role': 'user', 'content': 'hi'}])",
    "stream": ("async with s.stream_chat([{'role': 'user', 'content': 'hi'}]) as st:\n"
               "                    async for _ in st: pass"),
}


@pytest.mark.parametrize(("body", "hedge"), [
    ("sleep", False), ("chat", False), ("chat", True), ("stream", False), ("stream", True),
])
def test_ctrl_c_is_a_keyboard_interrupt(body: str, hedge: bool) -> None:
    """R4: wherever trio delivers Ctrl-C — the session body, a call's round nursery, a
    stream's producer nursery — it leaves the call and the session as itself, never as
    a (nested) BaseExceptionGroup, so ``except KeyboardInterrupt`` works."""
    script = _CTRL_C.format(hedge=hedge, body=_BODIES[body])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=50, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("INNER", "OUTER"))]
    assert lines == ["INNER KeyboardInterrupt", "OUTER KeyboardInterrupt"], out.stderr[-2000:]


@trio.lowlevel.enable_ki_protection
def _ctrl_c_now() -> None:
    """Ctrl-C as trio takes it while its own code runs: pending, raised in the main
    task at its next wait, whatever shields it is under."""
    signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("seed", range(6))
def test_ctrl_c_as_a_stream_block_is_left_waits_until_the_call_has_settled(seed: int) -> None:
    """Review: Ctrl-C while a stream's block waited for its call to settle left the
    block at once (no shield holds trio's KeyboardInterrupt back), with the upstream
    still connected and the permit held -- when the scheduler ran the block's task
    before the call's.  It now leaves as a nursery's exit would: once every path has
    settled, as itself, in every order."""
    from polygate.testing import Schedule

    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=50))
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            try:
                async with s.stream_chat(MESSAGES) as stream:
                    async for _ in stream:
                        break
                    _ctrl_c_now()
            except KeyboardInterrupt:
                seen["upstream"] = up.in_flight  # (before any checkpoint)
                seen["permits"] = (await s.statistics()).governance.sources[0].state.in_flight
            seen["after"] = (await s.chat(MESSAGES)).text

    Schedule(seed).run(main)
    assert seen["upstream"] == 0 and seen["permits"] == 0 and seen["after"]


@pytest.mark.parametrize("seed", range(6))
def test_ctrl_c_as_a_session_cuts_its_streams_waits_until_they_have_settled(seed: int) -> None:
    """The same as the session's close cuts a stream still running (entered, never
    left): Ctrl-C leaves the session as itself (it left as a group), once the stream's
    call has settled."""
    from polygate.testing import Schedule

    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=50))
    seen: dict[str, Any] = {}

    async def main() -> None:
        try:
            async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
                stream = s.stream_chat(MESSAGES)
                await stream.__aenter__()
                async for _ in stream:
                    break
                _ctrl_c_now()
        except KeyboardInterrupt:
            seen["upstream"] = up.in_flight

    Schedule(seed).run(main)
    assert seen == {"upstream": 0}


def test_ctrl_c_as_a_session_closes_leaves_as_itself_once_its_rows_are_written(
    tmp_path: Path,
) -> None:
    """Review: Ctrl-C during a session's close (its telemetry flushing, say: a second
    Ctrl-C at a slow database) cut the flush short and left the session as a
    ``BaseExceptionGroup``, so ``except KeyboardInterrupt`` around it missed it.  The
    close's steps are each bounded; they now run to their end, and Ctrl-C leaves
    after them as itself."""
    db = tmp_path / "t.db"
    settings = polygate.Settings(scopes=one_source_settings().scopes, telemetry=f"sqlite:///{db}")
    up = FakeUpstream(Reply())
    seen: list[str] = []

    async def main() -> None:
        try:
            async with polygate.session(settings, transport=up.transport()) as s:
                await s.chat(MESSAGES)  # an attempt row and a call row
                _ctrl_c_now()
        except KeyboardInterrupt:
            seen.append("KeyboardInterrupt")

    trio.run(main)
    con = sqlite3.connect(db)
    rows = sum(con.execute(f"select count(*) from {t}").fetchone()[0] for t in ("calls", "attempts"))
    con.close()
    assert seen == ["KeyboardInterrupt"] and rows == 2


@pytest.mark.parametrize("seed", range(4))
def test_ctrl_c_as_a_session_with_its_own_pool_closes_leaves_as_itself(seed: int) -> None:
    """Review: a session with its own connection pool (no ``transport=``: the usual
    one) has a pool tidier in its nursery.  Ctrl-C as the nursery's exit waited for
    the cancelled tidier left the session as ``BaseExceptionGroup([KeyboardInterrupt])``;
    it leaves as itself."""
    from polygate.testing import Schedule

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    seen: list[str] = []

    async def ctrl_c_as_it_closes(s: polygate.Session) -> None:
        while not s._runtime.closed:  # (the session's own state: no event to wait on)
            await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()  # (its close task has run: the nursery's exit next)
        _ctrl_c_now()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            try:
                async with polygate.session(settings) as s:
                    nursery.start_soon(ctrl_c_as_it_closes, s)
            except BaseException as exc:
                seen.append(repr(exc))

    Schedule(seed).run(main)
    assert seen == ["KeyboardInterrupt()"]


def test_ctrl_c_as_the_close_runs_its_own_code_skips_no_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: Ctrl-C that lands while the close's task runs plain Python code (not
    trio's) is raised by trio right there, in that task: the close stopped at that step,
    skipped the cache's (its queued write never reached SQLite), and left as a group.
    The close's task is protected: trio hands Ctrl-C to the main task, which holds it."""
    from polygate import _ocr_renderers

    original = _ocr_renderers.Renderers.aclose

    async def aclose(self: Any) -> None:
        signal.raise_signal(signal.SIGINT)  # (unprotected here: raised where it lands)
        await original(self)

    monkeypatch.setattr(_ocr_renderers.Renderers, "aclose", aclose)
    db = tmp_path / "c.db"
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                                       cache_ttl_s=3600)},
        cache=f"sqlite:///{db}")
    seen: list[str] = []

    async def main() -> None:
        try:
            async with polygate.session(settings, transport=FakeUpstream(Reply()).transport()) as s:
                await s.chat(MESSAGES)  # (its answer queued for the cache's writer)
        except BaseException as exc:
            seen.append(repr(exc))

    trio.run(main)
    con = sqlite3.connect(db)
    rows = con.execute("select count(*) from polygate_cache").fetchone()[0]
    con.close()
    assert (seen, rows) == (["KeyboardInterrupt()"], 1)


async def test_iterating_a_closed_stream_is_a_polygate_error() -> None:
    """R10: after an early exit from its block, iterating the stream raises a clear
    PolygateError (not trio.EndOfChannel); a finished stream just stops."""
    up = FakeUpstream(Reply(tokens=80))
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                break
        with pytest.raises(polygate.PolygateError, match="closed before it finished"):
            await stream.__anext__()
        async with s.stream_chat(MESSAGES) as done:
            async for _ in done:
                pass
        with pytest.raises(StopAsyncIteration):
            await done.__anext__()


async def test_a_stream_entered_after_its_session_closed_sends_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """R11: created while the session was open, entered after it closed: refused with
    "this session is closed" before any I/O, with no error logged."""
    up = FakeUpstream(Reply())
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        late = s.stream_chat(MESSAGES)
    with pytest.raises(polygate.PolygateError, match="session is closed") as info:
        async with late:
            pass
    assert type(info.value) is polygate.PolygateError
    assert up.requests == [] and not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_a_call_outliving_its_session_sends_nothing_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Suspicious point 9: a call started from a task outside the session block keeps
    running when the session closes (it lives in its caller's tree), but its next round
    sends nothing through the closed session: it ends with "this session is closed"."""
    up = FakeUpstream([Reply(status=500, headers_delay_s=5)], then=Reply())
    settings = one_source_settings(retry=polygate.Retry(backoff_base_s=0, backoff_max_s=0))
    outcome: list[BaseException] = []

    async def outside(s: polygate.Session) -> None:
        try:
            await s.chat(MESSAGES)
        except polygate.PolygateError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        async with polygate.session(settings, transport=up.transport()) as s:
            nursery.start_soon(outside, s)
            await trio.sleep(1)
    assert len(up.requests) == 1
    assert [type(e) for e in outcome] == [polygate.PolygateError]
    assert "session is closed" in str(outcome[0])

async def _read_stream(s: polygate.Session, errors: list[BaseException]) -> None:
    """Read a stream to its end; a PolygateError that ends it goes to ``errors``."""
    try:
        async with s.stream_chat(MESSAGES) as chunks:
            async for _ in chunks:
                pass
    except polygate.PolygateError as exc:
        errors.append(exc)


@pytest.mark.integration
async def test_a_call_cut_by_its_session_closing_does_not_feed_the_breaker() -> None:
    """Review (stateful): calls from tasks outside the session block, in flight on the
    session's own connections when it closed, were cut by the pool's close and settled
    as transient failures of the upstream: two of them opened a breaker of
    ``failures=2`` on a healthy source (a shared backend keeps that for every replica).
    The session's own closing is a cancellation, as the caller's would be."""
    upstream = FakeUpstream(Reply(first_token_s=1.0, tokens=2))
    outcomes: list[BaseException] = []
    async with upstream.serve() as base_url:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=base_url, timeout_s=5)],
            retry=polygate.Retry(max_attempts=2, backoff_base_s=0.01),
            breaker=polygate.Breaker(failures=2))})

        async def chat(s: polygate.Session) -> None:
            try:
                await s.chat(MESSAGES)
            except polygate.PolygateError as exc:
                outcomes.append(exc)


        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                async with polygate.session(settings) as s:
                    nursery.start_soon(chat, s)
                    nursery.start_soon(_read_stream, s, outcomes)
                    await wait_for(lambda: upstream.in_flight == 2)  # both in flight
    assert [str(e) for e in outcomes] == ["this session is closed"] * 2
    state = (await s.statistics()).governance.sources[0].state
    assert (state.in_flight, state.tokens_reserved) == (0, 0)
    assert state.consecutive_failures == 0
    assert state.breaker is polygate.governance.BreakerState.CLOSED


async def test_a_call_outliving_its_session_launches_no_hedge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (third round): the same call, hedged, still launched its hedge a
    second after the session had closed.  The primary carries on alone."""
    a, b = FakeUpstream(Reply(first_token_s=5)), FakeUpstream(Reply(first_token_s=5))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        hedge=polygate.Hedge(after_s=2))})
    answers: list[polygate.ChatResponse] = []

    async def outside(s: polygate.Session) -> None:
        answers.append(await s.chat(MESSAGES))

    async with trio.open_nursery() as nursery:
        async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
            nursery.start_soon(outside, s)
            await trio.sleep(1)
    assert b.requests == [] and len(a.requests) == 1
    assert answers[0].call_stats.hedges == 0 and answers[0].call_stats.attempts == 1



async def test_no_telemetry_row_vanishes_when_the_session_is_cancelled(tmp_path: Path) -> None:
    """R5: the flusher took the first rows off the channel and lingers; the session is
    cancelled from outside.  Every recorded row is written or counted as dropped."""
    db = tmp_path / "t.db"
    settings = polygate.Settings(
        scopes=one_source_settings().scopes, telemetry=f"sqlite:///{db}")
    up = FakeUpstream(Reply())
    with trio.CancelScope() as cancel:
        async with polygate.session(settings, transport=up.transport()) as s:
            await s.chat(MESSAGES)  # an attempt row and a call row
            await trio.sleep(0.01)  # the flusher holds them, lingering 50 ms
            cancel.cancel()
            await trio.sleep(1)
    stats = (s._telemetry.statistics() if s._telemetry is not None else None)
    assert stats is not None
    con = sqlite3.connect(db)
    rows = sum(con.execute(f"select count(*) from {t}").fetchone()[0] for t in ("calls", "attempts"))
    con.close()
    assert rows + stats.dropped == 2 and stats.written == rows


async def test_the_session_leaves_as_the_bodys_own_exception() -> None:
    """The session's nursery never wraps the body's error (one exception, as itself)."""
    up = FakeUpstream(Reply())
    with pytest.raises(LookupError, match="mine"):
        async with polygate.session(one_source_settings(), transport=Router({"a": up})):
            raise LookupError("mine")


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
async def test_whatever_ends_a_stream_reaches_the_iterator_as_itself(
    raised: type[BaseException],
) -> None:
    """Ctrl-C raised inside the stream's producer — here by the transport itself —
    comes out of the iteration as itself: never EndOfChannel, never a group.  (An
    ordinary exception there is one attempt's unexpected failure: transient.)"""

    def explode(request: object, rng: object) -> Reply:
        raise raised()

    async with polygate.session(one_source_settings(), transport=FakeUpstream(explode).transport()) as s:
        with pytest.raises(raised):
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass


@pytest.mark.parametrize("fault", [None, "truncated"])
async def test_taking_the_chunks_already_here_loses_nothing(
    fault: str | None, autojump_clock: trio.testing.MockClock
) -> None:
    """``ChatStream._ready`` (the gateway's burst write) takes only chunks that have
    arrived; the end of the stream -- the answer, or the error -- stays for the next
    ``__anext__``, so the chunks, their order and the outcome are those of plain
    iteration."""

    async def read(take_ready: bool) -> tuple[list[str], Any]:
        up = FakeUpstream(Reply(tokens=40, fault=fault, fault_after=30))
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            texts: list[str] = []
            try:
                async with s.stream_chat(MESSAGES) as stream:
                    async for chunk in stream:
                        texts.append(chunk.text)
                        if take_ready:
                            texts += [c.text for c in stream._ready(7)]
                outcome: Any = stream.response.text if stream.response else None
            except polygate.PolygateError as exc:
                outcome = type(exc)
            return texts, outcome

    plain = await read(take_ready=False)
    bursts = await read(take_ready=True)
    assert bursts == plain
    assert plain[0]  # the stream carried chunks


@pytest.mark.parametrize("hedge", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
async def test_a_call_cancelled_from_outside_raises_one_cancelled(
    hedge: bool, streaming: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """SPEC §3: a public call raises one exception, never an internal nursery's group.
    Cancelled from outside -- mid-hedge, mid-stream -- it is one ``trio.Cancelled``, so
    a caller's ``except trio.Cancelled:`` clean-up runs whatever the call was doing;
    the caller's scope absorbs it and the session goes on."""
    sources = [polygate.Source(name=n, base_url=f"http://{n}/v1") for n in "ab"]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=sources, hedge=polygate.Hedge(after_s=0.5 if hedge else None))})
    ups = {n: FakeUpstream(Reply(first_token_s=1.0, inter_token_s=0.5, tokens=4)) for n in "ab"}
    caught: list[BaseException] = []
    async with polygate.session(settings, transport=Router(ups)) as s:
        for at in (0.25, 0.75, 1.25, 2.0):
            with trio.move_on_after(at):
                try:
                    await ask(s, streaming)
                except BaseException as exc:
                    caught.append(exc)
                    raise
        assert (await s.chat(MESSAGES)).text
    assert len(caught) == 4
    assert all(type(exc) is trio.Cancelled for exc in caught), caught


@pytest.mark.parametrize("seed", range(12))
def test_two_tasks_reading_one_stream_both_end(seed: int) -> None:
    """Two tasks may read one stream (they split its chunks); whichever takes the end,
    the other's loop ends too -- it raised "the stream ended without an answer" when
    it was waiting as the stream closed."""
    from polygate.testing import Schedule

    async def main() -> tuple[int, bool]:
        up = FakeUpstream(Reply(tokens=10, inter_token_s=0.01))
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            count = 0
            async with s.stream_chat(MESSAGES) as stream:

                async def read() -> None:
                    nonlocal count
                    async for _ in stream:
                        count += 1

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    nursery.start_soon(read)
            return count, stream.response is not None

    assert Schedule(seed).run(main) == (10, True)


def _texts(s: polygate.Session) -> Any:
    """An async generator that yields from inside a ``stream_chat()`` block."""

    async def texts() -> Any:
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                yield chunk.text

    return texts()


async def test_an_async_generator_closed_around_a_stream_or_a_session_closes_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: closing an async generator that yields from inside ``stream_chat`` (or a
    whole session) -- ``gen.aclose()``, ``contextlib.aclosing`` -- raised
    ``BaseExceptionGroup([GeneratorExit()])`` from the block's nursery, where aclose()
    must return None (PEP 525) and a public block never leaves as a group."""
    import contextlib

    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=50))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        gen = _texts(s)
        assert await gen.__anext__()
        await gen.aclose()  # returns None
        async with contextlib.aclosing(_texts(s)) as g:
            async for _ in g:
                break
        stats = await s.statistics()
    assert up.in_flight == 0 and stats.governance.sources[0].state.in_flight == 0

    async def answers() -> Any:
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            while True:
                yield (await s.chat(MESSAGES)).text

    gen = answers()
    assert await gen.__anext__()
    await gen.aclose()


async def test_a_stream_in_an_async_generator_dropped_unclosed_ends_its_call_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: an async generator that yields from inside ``stream_chat()`` and is
    dropped without ``aclose()`` is closed by trio's finalizer, in a task of its own.
    The stream's block then left a nursery entered by another task, and the run died
    in ``TrioInternalError`` ("please file a bug").  Now the block holds no nursery of
    the caller's: the finalizer's exit cancels the call, the upstream sees it go, and
    the session goes on."""
    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=50))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        gen = _texts(s)
        assert await gen.__anext__()
        assert up.in_flight == 1
        # No aclose(): dropped, trio's finalizer closes it from a task of its own (and
        # warns).  (No cycle holds it: CPython collects it here and now.)
        with pytest.warns(ResourceWarning, match="garbage collected"):
            del gen
        await trio.testing.wait_all_tasks_blocked()
        assert up.in_flight == 0
        assert (await s.statistics()).governance.sources[0].state.in_flight == 0
        assert (await s.chat(MESSAGES)).text


async def test_a_stream_may_be_left_by_another_task_than_the_one_that_entered_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream entered in one task and read and left in another (an ``AsyncExitStack``
    handed over) settles its call; the block's nursery made that corrupt trio's state."""
    import contextlib

    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=50))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        stack = contextlib.AsyncExitStack()
        stream = await stack.enter_async_context(s.stream_chat(MESSAGES))
        seen: list[str] = []

        async def read_then_leave() -> None:
            async for chunk in stream:
                seen.append(chunk.text)
                if len(seen) == 3:
                    break
            await stack.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_then_leave)
        stats = await s.statistics()
        with pytest.raises(polygate.PolygateError, match="block exited"):
            await stream.__anext__()
    assert len(seen) == 3 and up.in_flight == 0
    assert stats.governance.sources[0].state.in_flight == 0


async def test_a_shielded_stream_block_finishes_when_the_session_block_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the producer's move into the session's nursery: a shielded ``finally``
    streaming a last answer while the session's block is cancelled from outside had
    its stream cut (the cancellation reached the producer around the caller's shield,
    through the session's nursery), where ``chat()`` there answers."""
    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=5))
    got: dict[str, Any] = {}
    with trio.move_on_after(10):
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    got["chat"] = (await s.chat(MESSAGES)).text
                    async with s.stream_chat(MESSAGES) as stream:
                        async for _ in stream:
                            pass
                    got["stream"] = stream.response.text if stream.response else None
    assert got["chat"] and got["stream"] == got["chat"]


async def test_a_shielded_stream_block_finishes_when_a_scope_around_the_session_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same, the scope around the session cancelled mid-stream (a shutdown)."""
    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=10))
    got: list[str] = []
    with trio.CancelScope() as outer:
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            with trio.CancelScope(shield=True):
                async with s.stream_chat(MESSAGES) as stream:
                    async for chunk in stream:
                        got.append(chunk.text)
                        if len(got) == 3:
                            outer.cancel()
    assert len(got) == 10 and stream.response is not None


async def test_the_rows_of_a_stream_its_session_cut_reach_telemetry(
    autojump_clock: trio.testing.MockClock, tmp_path: Path,
) -> None:
    """Review: a stream read outside the session's block, cut as the session closed,
    recorded its rows after the telemetry sink had closed (dropped at close).  The
    session cuts its streams before it closes telemetry."""
    import attrs

    db = tmp_path / "t.db"
    settings = attrs.evolve(one_source_settings(), telemetry=f"sqlite://{db}")
    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=50))
    got: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            nursery.start_soon(_read_stream, s, got)
            await trio.sleep(3.5)
    assert [str(e) for e in got] == ["this session is closed"] and up.in_flight == 0
    con = sqlite3.connect(db)
    try:
        outcomes = [row[0] for row in con.execute("select outcome from calls")]
    finally:
        con.close()
    assert outcomes == ["cancelled"]


async def test_a_bug_past_the_producers_handler_reaches_the_reader_as_itself(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: an exception of ours past the producer's own handler reached the reader
    as a copy without its traceback (where the bug is)."""
    import polygate._session as session_module

    class Boom(Exception):
        pass

    def broken(message: Any) -> Any:
        raise Boom("a bug")

    monkeypatch.setattr(session_module, "message_delta", broken)
    up = FakeUpstream(Reply(stream=False, tokens=3))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(Boom) as raised:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
        stats = await s.statistics()
    assert raised.value.__traceback__ is not None
    assert any(frame.name == "broken" for frame in __import__("traceback").extract_tb(raised.value.__traceback__))
    assert stats.governance.sources[0].state.in_flight == 0


async def test_a_failure_its_session_cut_in_delivery_reaches_the_reader_as_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a stream failed behind a full channel (its failure waiting to be
    delivered) as its session closed; the cut ended the delivery, and the reader got a
    copy of an error nobody had raised.  (Its traceback starts where the reader raised
    it: polygate's own frames are dropped, as for every call's error, see test_gc.)"""
    import traceback

    up = FakeUpstream(Reply(first_token_s=0.1, inter_token_s=0.01, tokens=80,
                            fault="truncated", fault_after=32))
    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    got: list[BaseException] = []

    async def reader(stream: polygate.ChatStream) -> None:
        await trio.sleep(10)  # the channel is full: the failure waits behind it
        try:
            async for _ in stream:
                pass
        except polygate.PolygateError as exc:
            got.append(exc)

    async with trio.open_nursery() as nursery:
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            stream = s.stream_chat(MESSAGES)
            await stream.__aenter__()
            nursery.start_soon(reader, stream)
            await trio.sleep(5)
    await stream.__aexit__(None, None, None)
    (error,) = got
    assert isinstance(error, polygate.TransientUpstreamError)
    # The error itself: the one the stream held unraised, now raised (it keeps a copy
    # for a later reader, not this one).
    assert stream._unraised is None and stream._failure is not error
    assert type(stream._failure) is type(error) and str(stream._failure) == str(error)
    frames = [(frame.filename, frame.name) for frame in traceback.extract_tb(error.__traceback__)]
    assert frames[-1][1] == "__anext__" and frames[-1][0].endswith("_session.py"), frames


async def test_a_session_block_cancelled_from_outside_leaves_as_one_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the session's block left as ``BaseExceptionGroup([Cancelled])``, so an
    ``except trio.Cancelled:`` clean-up around it never ran (the stream's block already
    left as one Cancelled)."""
    up = FakeUpstream(Reply(first_token_s=100))
    seen: list[BaseException] = []
    with trio.move_on_after(5):
        try:
            async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
                await s.chat(MESSAGES)
        except trio.Cancelled as exc:
            seen.append(exc)
            raise
    assert len(seen) == 1 and up.in_flight == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block", ["stream", "session"])
def test_the_bodys_error_is_not_lost_when_its_scope_is_cancelled_as_it_raises(
    seed: int, block: str,
) -> None:
    """review: the body raised right after the scope around it was cancelled; its error
    was kept aside while the nursery's Cancelled left, the scope took that, and the
    code after the scope ran as if the block had succeeded.  As from a plain nursery,
    the body's error is what leaves."""
    from polygate.testing import Schedule

    async def main() -> str:
        up = FakeUpstream(Reply(tokens=50, first_token_s=0.1, inter_token_s=0.1))
        try:
            with trio.CancelScope() as scope:
                async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
                    if block == "session":
                        await s.chat(MESSAGES)
                        scope.cancel()
                        raise LookupError("mine") from KeyError("root")
                    async with s.stream_chat(MESSAGES) as stream:
                        async for _ in stream:
                            scope.cancel()
                            raise LookupError("mine") from KeyError("root")
        except LookupError as exc:
            # ... with its own cause (review: it was raised "from None" inside the
            # handler of the nursery's group, which replaced cause and context)
            return "raised" if isinstance(exc.__cause__, KeyError) else f"cause {exc.__cause__!r}"
        return "lost"

    assert Schedule(seed).run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == "raised"


def _three_reads_of_a_stream_that_stalls(seed: int, **watch: Any) -> list[BaseException | str]:
    """Two tasks reading one stream that stalls after its commit, then a third read:
    what each saw end it (an error, or "clean")."""
    from polygate.testing import Schedule

    async def main() -> list[BaseException | str]:
        up = FakeUpstream([
            Reply(text="a b c d", first_token_s=1.0, inter_token_s=0.1, stall_at=2, stall_s=100),
            Reply(status=500, error_body={"error": {"message": "down"}}),
        ])
        settings = one_source_settings(stream=polygate.StreamWatch(stall_timeout_s=5.0, **watch))
        ends: list[BaseException | str] = []
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            async with s.stream_chat(MESSAGES) as stream:

                async def read() -> None:
                    try:
                        async for _ in stream:
                            pass
                    except polygate.PolygateError as exc:
                        ends.append(exc)
                        return
                    ends.append("clean")

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    nursery.start_soon(read)
                with pytest.raises(polygate.PolygateError) as later:  # and a third look, later
                    await stream.__anext__()
                ends.append(later.value)
            assert stream.response is None
        return ends

    return Schedule(seed).run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("seed", range(6))
def test_two_tasks_reading_a_failed_stream_both_hear_it(seed: int) -> None:
    """review: when the stream failed after its commit, the reader that took the failure
    raised it, and the other's loop ended as if the answer were complete (with no
    ``stream.response``)."""
    ends = _three_reads_of_a_stream_that_stalls(seed)
    assert all(isinstance(e, polygate.StreamStalled) and e.text == "a b" for e in ends), ends


@pytest.mark.parametrize("seed", range(4))
def test_every_reader_of_a_failed_stream_gets_its_cause(seed: int) -> None:
    """review of the fix above: the copy for a reader woken by the channel's close was
    raised "from None" inside the handler, which undid the cause the copy carried."""
    got = _three_reads_of_a_stream_that_stalls(seed, resume=True, max_resumes=1)
    assert all(isinstance(e, BaseException) for e in got) and len({type(e) for e in got}) == 1
    causes = {type(e.__cause__) for e in got if isinstance(e, BaseException)}
    assert len(causes) == 1 and type(None) not in causes, got


def test_each_reader_of_a_failed_stream_gets_its_own_error() -> None:
    """review: the copy a second reader gets shared the first one's notes (one list),
    and lost the error's cause."""
    from polygate._session import twin_error

    try:
        try:
            raise KeyError("root")
        except KeyError as root:
            raise polygate.StreamStalled("silent", source="a") from root
    except polygate.StreamStalled as caught:
        error = caught
    error.__notes__ = ["first reader"]  # (as add_note keeps them, from Python 3.11)
    twin = twin_error(error)
    twin.__notes__.append("second reader")
    assert type(twin) is polygate.StreamStalled and twin is not error
    assert error.__notes__ == ["first reader"]
    assert twin.__notes__ == ["first reader", "second reader"]
    assert isinstance(twin.__cause__, KeyError) and twin.__traceback__ is None


@pytest.mark.parametrize("nested", [False, True], ids=["after-exit", "nested"])
async def test_entering_one_session_block_twice_is_a_polygate_error(nested: bool) -> None:
    """A reviewer found a second ``async with`` of one ``polygate.session()`` failing
    inside contextlib with a bare AttributeError; it is a typed, clear error, and the
    session already open is untouched by it."""
    up = FakeUpstream(Reply(text="hi"))
    block = polygate.session(one_source_settings(), transport=up.transport())
    async with block as s:
        if nested:
            with pytest.raises(polygate.PolygateError, match=r"already entered.*again"):
                async with block:
                    pass
            assert (await s.chat(MESSAGES)).text == "hi"
    if not nested:
        with pytest.raises(polygate.PolygateError, match=r"already entered.*again"):
            async with block:
                pass


@pytest.mark.parametrize("seed", range(8))
def test_a_stream_cut_off_by_its_block_fails_every_later_read_of_another_task(seed: int) -> None:
    """Review: a task still reading a stream whose block another task leaves got "the
    stream ended without an answer" once, then StopAsyncIteration on every later read:
    a stream cut off read as cleanly finished.  Every read fails, with the message
    polygate.aio gives for the same misuse."""
    from polygate.testing import Schedule

    async def main() -> list[str]:
        seen: list[str] = []

        async def read(stream: polygate.ChatStream) -> None:
            for _ in range(3):  # the loop, then two more reads
                try:
                    async for _ in stream:
                        pass
                except polygate.PolygateError as exc:
                    seen.append(str(exc))
                else:
                    seen.append("clean end")

        up = FakeUpstream(Reply(tokens=50, inter_token_s=0.05))
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            stream = s.stream_chat(MESSAGES)
            async with trio.open_nursery() as nursery:
                async with stream:
                    nursery.start_soon(read, stream)
                    await trio.sleep(0.2)
        return seen

    cut = "this stream was closed before it finished (its block exited)"
    assert Schedule(seed).run(main) == [cut] * 3


@pytest.mark.parametrize("door", ["trio", "aio"])
def test_leaving_a_session_block_never_entered_is_refused_without_opening_it(
    door: str, tmp_path: Path
) -> None:
    """Review: ``__aexit__`` on a session block never entered ran the session's
    generator to its yield (the telemetry file created, the aio door's trio run
    started), then raised a bare RuntimeError and left that session open."""
    import asyncio

    import attrs

    import polygate.aio

    db = tmp_path / "t.db"
    settings = attrs.evolve(one_source_settings(), telemetry=f"sqlite:///{db}")
    seen: list[BaseException] = []

    async def body() -> None:
        opener = polygate.session if door == "trio" else polygate.aio.session
        block = opener(settings, transport=FakeUpstream(Reply()).transport())
        try:
            await block.__aexit__(None, None, None)
        except Exception as exc:
            seen.append(exc)

    if door == "trio":
        trio.run(body)
    else:
        asyncio.run(body())
    assert not db.exists()
    assert len(seen) == 1 and type(seen[0]) is polygate.PolygateError, seen
    assert "never entered" in str(seen[0])


@pytest.mark.parametrize("tokens", [31, 32, 33])
def test_a_reader_as_the_block_exits_with_the_end_unsent_hears_the_cut(tokens: int) -> None:
    """Review: with the channel full, the producer waits to send the end as the block
    exits; it counted the end as sent before the send, so another task reading then
    got every chunk and a clean end, with no response."""

    async def main() -> list[str]:
        seen: list[str] = []
        go = trio.Event()

        async def read(stream: polygate.ChatStream) -> None:
            await go.wait()
            try:
                async for _ in stream:
                    pass
            except polygate.PolygateError as exc:
                seen.append(f"error: {exc}")
            else:
                seen.append(f"clean end, response={stream.response is not None}")

        up = FakeUpstream(Reply(tokens=tokens))
        async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
            stream = s.stream_chat(MESSAGES)
            async with trio.open_nursery() as nursery:
                async with stream:
                    nursery.start_soon(read, stream)
                    await trio.sleep(1)  # (the answer is in: MockClock)
                    await trio.testing.wait_all_tasks_blocked()
                    go.set()  # the reader wakes as this block exits
        return seen

    seen = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(seen) == 1 and seen[0] != "clean end, response=False", seen


async def test_a_call_from_another_trio_run_is_refused_at_once() -> None:
    """Review: a call made on a session from another thread's trio.run used this run's
    events and locks; under contention (a permit this run held) the release set an
    event of the other run, and trio's assertion came out of an innocent call here.
    The other run's call is refused, typed; this run's carries on."""
    upstream = FakeUpstream(Reply(tokens=2, first_token_s=0.2))
    async with upstream.serve() as url:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=url, model="m1", max_in_flight=1)])})
        async with polygate.session(settings) as s:
            errors: list[BaseException] = []

            def other_thread() -> None:
                async def call() -> None:
                    await s.chat(MESSAGES)

                try:
                    trio.run(call)
                except BaseException as exc:  # (recorded: asserted below)
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.chat, MESSAGES)  # holds the only permit
                await trio.to_thread.run_sync(other_thread)
            answer = await s.chat(MESSAGES)
    assert [type(e) for e in errors] == [polygate.PolygateError]
    assert "belongs to another trio run" in str(errors[0])
    assert answer.text


async def test_a_stream_built_outside_any_run_runs_in_the_sessions_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the run check raised trio's bare RuntimeError for stream_chat() called
    in a worker thread (a plain method: it only builds the stream), which had worked.
    Built there, the stream is entered here; entered from another run, it is refused."""
    async with polygate.session(one_source_settings(), transport=Router({"a": FakeUpstream(Reply(tokens=2))})) as s:
        stream = await trio.to_thread.run_sync(lambda: s.stream_chat(MESSAGES))
        async with stream:
            assert [c.text async for c in stream]
        other = s.stream_chat(MESSAGES)
        errors: list[BaseException] = []

        def enter_elsewhere() -> None:
            async def enter() -> None:
                async with other:
                    pass

            try:
                trio.run(enter)
            except BaseException as exc:  # (recorded: asserted below)
                errors.append(exc)

        await trio.to_thread.run_sync(enter_elsewhere)
    assert [type(e) for e in errors] == [polygate.PolygateError]
    assert "belongs to another trio run" in str(errors[0])


async def test_a_call_awaited_on_an_asyncio_loop_is_refused_typed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a trio session awaited from an asyncio loop (another thread: the app
    forgot polygate.aio) raised trio's bare RuntimeError ('must be called from async
    context') from chat, embed and statistics, and an AttributeError from deep inside
    trio from entering a stream.  Each is refused, typed, pointing to polygate.aio;
    nothing is admitted, and the session goes on."""
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")]),
        "embed": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")]),
    })
    transport = Router({"a": FakeUpstream(Reply(tokens=2))})
    async with polygate.session(settings, transport=transport) as s:

        async def stream() -> None:
            async with s.stream_chat(MESSAGES) as chunks:
                [c async for c in chunks]

        calls: dict[str, Any] = {
            "chat": lambda: s.chat(MESSAGES),
            "embed": lambda: s.embed(["x"]),
            "statistics": s.statistics,
            "stream": stream,
        }

        def on_asyncio() -> dict[str, BaseException | None]:
            import asyncio

            seen: dict[str, BaseException | None] = {}
            for name, call in calls.items():
                try:
                    asyncio.run(call())
                    seen[name] = None
                except BaseException as exc:  # (recorded: asserted below)
                    seen[name] = exc
            return seen

        seen = await trio.to_thread.run_sync(on_asyncio)
        assert (await s.chat(MESSAGES)).text
        statistics = await s.statistics()
    assert {name: type(exc) for name, exc in seen.items()} == dict.fromkeys(
        calls, polygate.PolygateError)
    assert all("polygate.aio" in str(exc) for exc in seen.values())
    assert sum(source.state.admissions for source in statistics.governance.sources) == 1


def _raised_on_asyncio(call: Any) -> BaseException | None:
    """What ``call()`` raised, awaited on an asyncio loop of this thread's own."""
    import asyncio

    try:
        asyncio.run(call())
    except BaseException as exc:  # (recorded: the caller asserts it)
        return exc
    return None


def _raised_on_trio(call: Any) -> BaseException | None:
    """What ``call()`` raised, awaited in a trio run of this thread's own."""
    try:
        trio.run(call)
    except BaseException as exc:  # (recorded: the caller asserts it)
        return exc
    return None


async def test_a_stream_read_outside_its_sessions_run_is_refused_typed() -> None:
    """Diff review: a stream entered in its session's run, then read from an asyncio
    loop in a thread, gave trio's bare RuntimeError; read from another thread's
    trio.run, a TrioInternalError ("please file a bug") while its channel was empty,
    and the chunks themselves once they were buffered.  Each read is refused, typed;
    the stream then reads on in its own run."""
    slow = FakeUpstream(Reply(tokens=4, inter_token_s=0.05))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=Router({"a": slow})) as s:
        async with s.stream_chat(MESSAGES) as stream:

            refused = [await trio.to_thread.run_sync(_raised_on_asyncio, stream.__anext__),
                       await trio.to_thread.run_sync(_raised_on_trio, stream.__anext__)]
            await wait_for(lambda: slow.in_flight == 0)  # every chunk buffered
            refused.append(await trio.to_thread.run_sync(_raised_on_trio, stream.__anext__))
            text = "".join([chunk.text async for chunk in stream])
    assert [type(exc) for exc in refused] == [polygate.PolygateError] * 3, refused
    assert "polygate.aio" in str(refused[0]) and "another trio run" in str(refused[1])
    assert text == stream.response.text != ""


async def test_statistics_after_close_outside_the_run_is_typed() -> None:
    """Diff review: with the memory backend, statistics() after the session closed,
    awaited on an asyncio loop, gave trio's bare RuntimeError (its windows are read on
    the run's clock).  Refused, typed; in the session's run it reads on."""
    async with polygate.session(one_source_settings(), transport=Router(
            {"a": FakeUpstream(Reply(tokens=2))})) as s:
        await s.chat(MESSAGES)

    refused = await trio.to_thread.run_sync(_raised_on_asyncio, s.statistics)
    assert type(refused) is polygate.PolygateError and "polygate.aio" in str(refused)
    assert (await s.statistics()).governance.sources[0].state.admissions == 1
