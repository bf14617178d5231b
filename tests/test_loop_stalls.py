"""The caller's own stalls are not the upstreams' fault (polygate._lag).

An application that blocks its event loop (a synchronous call, a long computation),
or a process stopped whole (SIGSTOP, a laptop asleep, a VM paused), stops trio from
reading its sockets; what the upstreams sent meanwhile waits in the kernel.  trio then
expired the attempts' watchdogs in the same pass that found those bytes readable: a
stream whose tokens were there was cut as stalled, its source's breaker fed, and one
pause of the gateway opened every breaker of a scope.

The upstreams here run in a thread of their own (``loopback``: a trio run of their
own, real sockets), so they go on sending while the test's loop is blocked.  The
blocking ``time.sleep`` calls are the subject of these tests -- an application's
blocking call -- not a wait for something to happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
import polygate.aio
from polygate._attempt import AttemptControl
from polygate._context import AttemptRecord
from polygate._lag import LAG_MIN_S, LOOK_MAX_S, STALL_MIN_S, LoopLag
from polygate.testing import FakeUpstream, Reply, Router

from ._aio_support import loopback
from ._serve_kit import serve_process
from .conftest import SECRET

MESSAGES = [{"role": "user", "content": "hi"}]
#: A token every 50 ms for 3 s: the stall of the caller's loop (1.5 s) falls inside it.
LONG_STREAM = Reply(tokens=60, first_token_s=0.02, inter_token_s=0.05)


def _block(seconds: float) -> None:
    time.sleep(seconds)  # the application's blocking call, on the loop's thread


async def _stall_after(delay: float) -> None:
    """The loop blocked 1.5 s, ``delay`` from now (a call under way by then)."""
    await trio.sleep(delay)
    _block(1.5)


@contextlib.contextmanager
def _upstreams(*names: str, reply: Reply = LONG_STREAM) -> Iterator[dict[str, FakeUpstream | str]]:
    """Each named upstream served from a thread of its own: its URL under its name, the
    upstream itself under ``name + "!"``."""
    with contextlib.ExitStack() as stack:
        out: dict[str, FakeUpstream | str] = {}
        for name in names:
            upstream = FakeUpstream(reply, name=name)
            out[name] = stack.enter_context(loopback(upstream))
            out[name + "!"] = upstream
        yield out


def _settings(ups: dict[str, Any], *, source: dict[str, Any] | None = None, **scope: Any
              ) -> polygate.Settings:
    sources = [polygate.Source(name=n, base_url=u, api_key=SECRET, **(source or {}))
               for n, u in ups.items() if not n.endswith("!")]
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=sources, **scope)})


def _requests(ups: dict[str, Any]) -> int:
    return sum(u.statistics().requests for n, u in ups.items() if n.endswith("!"))


async def _failures(s: polygate.Session) -> dict[str, tuple[int, str]]:
    stats = await s.statistics()
    return {x.state.source: (x.state.consecutive_failures, x.state.breaker)
            for x in stats.governance.sources}


async def test_a_stream_read_through_a_stall_of_the_callers_loop_is_not_stalled() -> None:
    """Its tokens came every 50 ms while the caller blocked 1.5 s (stall_timeout_s 0.5):
    the stream goes on, with no second request and nothing fed to the breaker."""
    with _upstreams("a") as ups:
        settings = _settings(ups, stream=polygate.StreamWatch(stall_timeout_s=0.5, resume=True))
        async with polygate.session(settings) as s:
            texts = []
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    texts.append(chunk.text)
                    if len(texts) == 3:
                        _block(1.5)
            stats = stream.response.call_stats
            assert len(texts) == 60
            assert _requests(ups) == 1
            assert stats.attempts == 1 and stats.resumes == 0
            assert await _failures(s) == {"a": (0, "closed")}


async def test_one_stall_with_streams_running_opens_no_breaker() -> None:
    """Eight streams over two sources, the loop blocked 1.5 s once: every stream ends
    whole, no breaker is fed, and the next call goes at once."""
    with _upstreams("a", "b") as ups:
        settings = _settings(ups, stream=polygate.StreamWatch(stall_timeout_s=0.5),
                             retry=polygate.Retry(max_attempts=1))
        async with polygate.session(settings) as s:
            ended: list[int] = []

            async def one() -> None:
                async with s.stream_chat(MESSAGES) as stream:
                    ended.append(sum([1 async for _ in stream]))

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
                await trio.sleep(0.3)  # (the streams under way: the stall is in their middle)
                _block(1.5)
            assert ended == [60] * 8
            assert await _failures(s) == {"a": (0, "closed"), "b": (0, "closed")}
            with trio.fail_after(5):
                await s.chat(MESSAGES)
            assert _requests(ups) == 9


@pytest.mark.parametrize(
    ("reply", "source"),
    [
        # The first token came at 0.05 s, inside ttft_timeout_s (the message once blamed
        # a stall watchdog that was not even set).
        pytest.param(LONG_STREAM, {"ttft_timeout_s": 0.5}, id="ttft_timeout_s"),
        # A source that cannot stream; its answer (longer than one read) was whole at
        # 0.2 s, inside timeout_s.
        pytest.param(Reply(tokens=200_000, first_token_s=0.2, inter_token_s=0.0),
                     {"timeout_s": 1.0, "streaming": False}, id="timeout_s"),
    ],
)
async def test_an_answer_that_came_in_time_is_read_after_a_stall(
    tmp_path: Path, reply: Reply, source: dict[str, Any]
) -> None:
    db = tmp_path / "t.db"
    with _upstreams("a", reply=reply) as ups:
        settings = _settings(ups, source=source, retry=polygate.Retry(max_attempts=1))
        settings = polygate.Settings(scopes=settings.scopes, telemetry=f"sqlite:///{db}")
        async with polygate.session(settings) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stall_after, 0.01)
                response = await s.chat(MESSAGES)
            assert response.call_stats.attempts == 1
            assert await _failures(s) == {"a": (0, "closed")}
    with contextlib.closing(sqlite3.connect(db)) as con:  # (3.13 warns of one left open)
        rows = con.execute("SELECT error FROM attempts").fetchall()
    assert rows == [("ok",)]


async def _busy(seconds: float, step: float) -> None:
    """A computation that yields to the loop every ``step`` seconds: the loop stalls
    at each turn, and looks at its sockets between them."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        _block(step)  # (step seconds of computation)
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("case", ["stall_timeout_s", "timeout_s"])
async def test_a_hung_upstream_times_out_while_the_loop_is_busy(case: str) -> None:
    """A loop busy turn after turn (100 ms each) still looks at its sockets between
    them: an upstream silent past its limit fails a few turns after it, not once the
    computation ends (the first version of the fix moved the clocks by every turn:
    6.5 s for a limit of 0.5)."""
    if case == "stall_timeout_s":
        reply = Reply(tokens=10, first_token_s=0.01, inter_token_s=0.01, stall_at=3, stall_s=30)
        options: dict[str, Any] = {"stream": polygate.StreamWatch(stall_timeout_s=0.5)}
        source: dict[str, Any] = {}
    else:
        reply = Reply(tokens=4, first_token_s=30, stream=False)
        options, source = {}, {"timeout_s": 0.5, "streaming": False}
    with _upstreams("a", reply=reply) as ups:
        settings = _settings(ups, source=source, retry=polygate.Retry(max_attempts=1), **options)
        async with polygate.session(settings) as s:
            start = trio.current_time()
            failed_after: list[float] = []

            async def call() -> None:
                with pytest.raises(polygate.PolygateError):
                    await s.chat(MESSAGES)
                failed_after.append(trio.current_time() - start)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                nursery.start_soon(_busy, 4.0, 0.1)
            # Due at ~0.5 s; a look of a turn; then the error's way out, a 0.1 s turn a
            # pass: ~1-1.5 s, and not once the computation ends (4 s).
            assert failed_after and failed_after[0] < 2.5, failed_after


@pytest.mark.parametrize("kind", ["chat", "stream_chat"])
async def test_a_stream_answered_in_time_is_read_after_a_stall_past_timeout_s(kind: str) -> None:
    """200 tokens (~30 KB: several reads), all sent at 0.1 s, timeout_s 1.0, the loop
    blocked 1.5 s: the look lasts while the reads do (its first version ended at the
    first token, whose watch() set the past whole-attempt deadline again)."""
    reply = Reply(tokens=200, first_token_s=0.1, inter_token_s=0.0)
    with _upstreams("a", reply=reply) as ups:
        settings = _settings(ups, source={"timeout_s": 1.0}, retry=polygate.Retry(max_attempts=1))
        async with polygate.session(settings) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stall_after, 0.02)
                if kind == "chat":
                    assert (await s.chat(MESSAGES)).call_stats.attempts == 1
                else:
                    async with s.stream_chat(MESSAGES) as stream:
                        assert len([chunk async for chunk in stream]) == 200
            assert await _failures(s) == {"a": (0, "closed")}


async def test_many_bodies_answered_during_a_stall_are_all_read() -> None:
    """120 answers of ~200 KB that came during a 1.5 s stall take more than one pass,
    and more than 50 ms, to read: none is cut (a look of 50 ms once cut most)."""
    upstream = FakeUpstream(Reply(tokens=40_000, first_token_s=0.1, stream=False), name="a")
    with loopback(upstream) as url:
        source = polygate.Source(name="a", base_url=url, api_key=SECRET, timeout_s=1.0,
                                 streaming=False)
        settings = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[source], retry=polygate.Retry(max_attempts=1))})
        async with polygate.session(settings) as s:
            async def stall() -> None:
                while upstream.statistics().requests < 120:  # noqa: ASYNC110 - every request went first
                    await trio.sleep(0.001)
                _block(1.5)  # their answers come 0.1 s after: during it

            async with trio.open_nursery() as nursery:
                for _ in range(120):
                    nursery.start_soon(s.chat, MESSAGES)
                nursery.start_soon(stall)
            assert await _failures(s) == {"a": (0, "closed")}


@pytest.mark.parametrize(("hedge", "reply", "streaming"), [
    # the first token was readable when the stall ended
    (polygate.Hedge(after_s=0.5), Reply(tokens=60, first_token_s=0.02, inter_token_s=0.04), True),
    # tokens every 40 ms all along
    (polygate.Hedge(after_s=5.0, stall_after_s=0.5),
     Reply(tokens=60, first_token_s=0.02, inter_token_s=0.04), True),
    # a ~200 KB answer that came during the stall: several reads (one pass once decided)
    (polygate.Hedge(after_s=0.5), Reply(tokens=40_000, first_token_s=0.2, stream=False), False),
], ids=["first_token", "stall_after_s", "big_body"])
async def test_no_hedge_for_a_silence_that_was_the_callers(
    hedge: polygate.Hedge, reply: Reply, streaming: bool
) -> None:
    with _upstreams("a", "b", reply=reply) as ups:
        async with polygate.session(_settings(ups, hedge=hedge,
                                              source={"streaming": streaming})) as s:
            async def blocker() -> None:
                while _requests(ups) < 1:  # noqa: ASYNC110 - another thread's server: no event
                    await trio.sleep(0.001)
                await trio.sleep(0.0 if hedge.stall_after_s is None else 0.3)
                _block(1.5)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocker)
                stats = (await s.chat(MESSAGES)).call_stats
            assert stats.hedges == 0 and stats.attempts == 1, stats
            assert _requests(ups) == 1


@pytest.mark.parametrize("arrives_s", [0.1, 1.2])
async def test_a_deadline_that_passed_in_a_stall_ends_the_call(arrives_s: float) -> None:
    """The call's deadline is the caller's, on the wall clock: the answer (whole before
    the deadline, or after it) is read only after the deadline, when the stall ends --
    DeadlineExceeded, however short the answer (it once depended on whether its read
    reached a checkpoint)."""
    reply = Reply(tokens=4, first_token_s=arrives_s, inter_token_s=0.0)
    with _upstreams("a", reply=reply) as ups:
        async with polygate.session(_settings(ups, call_deadline_s=1.0)) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stall_after, 0.01)
                with pytest.raises(polygate.DeadlineExceeded):
                    await s.chat(MESSAGES)


def test_an_asyncio_application_blocking_its_loop_does_not_cut_its_stream() -> None:
    """polygate.aio: trio runs as a guest of the application's loop, and a blocking call
    in an asyncio task stops both."""
    with _upstreams("a") as ups:
        settings = _settings(ups, stream=polygate.StreamWatch(stall_timeout_s=0.5))

        async def main() -> tuple[int, Any]:
            async with polygate.aio.session(settings) as s:
                got = 0
                async with s.stream_chat(MESSAGES) as stream:
                    async for _ in stream:
                        got += 1
                        if got == 3:
                            _block(1.5)
                stats = await s.statistics()
                return got, stats.governance.sources[0].state

        got, state = asyncio.run(main())
        assert got == 60
        assert state.consecutive_failures == 0 and state.breaker == "closed"


KEY = "sk-gw-loop-stalls-0123456789"


async def test_a_gateway_stopped_a_while_goes_on_with_its_streams(tmp_path: Path) -> None:
    """``polygate serve`` stopped 3 s (SIGSTOP: a container frozen) with six clients
    streaming (stall_timeout_s 1), its upstreams sending all along: after SIGCONT every
    stream ends whole, and the next request is answered, not refused by breakers that
    a stall of its own opened."""
    with _upstreams("a", "b", reply=Reply(tokens=80, first_token_s=0.02, inter_token_s=0.05)) as ups:
        config = tmp_path / "polygate.toml"
        sources = "".join(
            f'[scopes.chat.sources.{n}]\nbase_url = "{u}"\nmodel = "m"\napi_key = "{SECRET}"\n\n'
            for n, u in ups.items() if not n.endswith("!"))
        config.write_text(
            f'[serve]\napi_keys = ["{KEY}"]\n\n[scopes.chat]\ncall_deadline_s = 20\n\n'
            f"[scopes.chat.stream]\nstall_timeout_s = 1.0\n\n{sources}")
        async with serve_process(config) as running:
            base = f"http://127.0.0.1:{running.port}"
            headers = {"authorization": f"Bearer {KEY}"}
            results: list[tuple[int, int, list[Any]]] = []

            async def one(client: httpx.AsyncClient, i: int) -> None:
                body = {"model": "chat", "stream": True,
                        "messages": [{"role": "user", "content": f"hi {i}"}]}
                async with client.stream("POST", "/v1/chat/completions", json=body,
                                         headers=headers) as answer:
                    chunks, errors = 0, []
                    async for line in answer.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                errors.append(event["error"])
                            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                                chunks += 1
                    results.append((answer.status_code, chunks, errors))

            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                async with trio.open_nursery() as nursery:
                    for i in range(6):
                        nursery.start_soon(one, client, i)
                    await trio.sleep(0.6)  # (the streams under way)
                    os.kill(running.proc.pid, signal.SIGSTOP)
                    try:
                        await trio.sleep(3.0)  # how long the gateway stays stopped
                    finally:
                        os.kill(running.proc.pid, signal.SIGCONT)
                after = await client.post("/v1/chat/completions", headers=headers,
                                          json={"model": "chat", "messages": MESSAGES})
            running.proc.send_signal(signal.SIGTERM)
        assert results == [(200, 80, [])] * 6, results
        assert after.status_code == 200, after.text
        assert _requests(ups) == 7


@pytest.fixture
def freezing_upstream() -> Iterator[str]:
    """The base URL of ``_freezing_upstream.py``, in a process of its own."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tests._freezing_upstream"],
                            cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}/v1"
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.parametrize("cont_ms", [1020, 1040])
@pytest.mark.parametrize("clock", ["ttft_timeout_s", "stall_timeout_s", "hedge"])
async def test_a_freeze_in_the_poll_across_a_due_clock_cuts_nothing(
    freezing_upstream: str, clock: str, cont_ms: int,
) -> None:
    """Outside review (a CPU-throttled container): the whole process frozen from 0.9 s
    to ``cont_ms`` while its loop waited in the poll, a token sent at 0.95 s, a clock
    due at 1 s.  A freeze that overshot the due time by under 50 ms counted as no
    stall: the stream was cut (a ttft or stall timeout, its breaker fed), or a hedge
    went out and won against the answer that had come in time (5 of 8)."""
    pid = os.getpid()
    pre = 1 if clock == "stall_timeout_s" else 0
    model = f"freeze:{pid}:{pre}:900:950:{cont_ms}"
    first = polygate.Source(name="a", base_url=freezing_upstream, model=model, weight=1e6,
                            ttft_timeout_s=1.0 if clock == "ttft_timeout_s" else None)
    sources = [first]
    scope: dict[str, Any] = {"retry": polygate.Retry(max_attempts=1)}
    if clock == "stall_timeout_s":
        scope["stream"] = polygate.StreamWatch(stall_timeout_s=1.0)
    if clock == "hedge":
        sources.append(polygate.Source(name="b", base_url=freezing_upstream, weight=1e-6,
                                       model=f"freeze:{pid}:0:0:0:0"))
        scope["hedge"] = polygate.Hedge(after_s=1.0)
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=sources, **scope)})
    async with polygate.session(settings) as s:
        answer = await s.chat(MESSAGES)
        assert "on-time" in answer.text
        assert (answer.source, answer.call_stats.attempts, answer.call_stats.hedges) == ("a", 1, 0)
        assert (await _failures(s))["a"] == (0, "closed")


# --------------------------------------------------------------------------- the instrument


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def current_time(self) -> float:
        return self.now


class _Attempt:
    def __init__(self) -> None:
        self.looks: list[tuple[float, float]] = []

    def stalled(self, now: float, stall: float) -> None:
        self.looks.append((now, round(stall, 9)))


def _lag(due: bool = True) -> tuple[LoopLag, _Clock, _Attempt]:
    clock = _Clock()
    lag = LoopLag(clock)  # type: ignore[arg-type]
    lag.clock_due = lambda: due  # type: ignore[method-assign]  # (trio's heap, outside a run)
    attempt = _Attempt()
    lag.attempts.add(attempt)
    return lag, clock, attempt


def test_a_stall_is_the_tasks_turn_and_a_poll_that_ended_past_its_plan() -> None:
    lag, clock, attempt = _lag()
    clock.now += 1.5  # a task's step blocked the loop
    clock.now += 0.001  # (then a poll planned to take 0 took 1 ms)
    lag.after_io_wait(0.0)
    assert attempt.looks == [(101.501, 1.501)]
    clock.now += 3.5  # stopped while it polled for 0.5 s
    lag.after_io_wait(0.5)
    assert attempt.looks[1] == (105.001, 3.0)


def test_a_poll_that_ends_early_and_an_ordinary_turn_are_no_stall() -> None:
    lag, clock, attempt = _lag()
    clock.now += STALL_MIN_S / 2  # a turn of the loop at work
    clock.now += 0.2  # then a poll planned for 10 s, woken early by a socket
    lag.after_io_wait(10.0)
    clock.now += 0.001  # a short turn
    clock.now += 1.0 + STALL_MIN_S / 4  # a poll late by its timer's granularity
    lag.after_io_wait(1.0)
    assert attempt.looks == []


def test_a_freeze_in_the_poll_that_ends_a_little_past_its_plan_is_a_stall() -> None:
    """Outside review (a CPU-throttled container): the process frozen while its loop
    waited in the poll comes back a little past the deadline the poll was planned
    for, with a token that came before it in the socket.  Counted only past 50 ms, a
    freeze that ended 20 ms late cut the stream as stalled (15 of 200 on-time streams
    under a 20 % CPU quota; 26-73 of 200 through polygate serve, 504s and open
    breakers)."""
    lag, clock, attempt = _lag()
    clock.now += 1.0 + 0.02  # a poll planned for 1 s, frozen from 0.9 s to 1.02 s
    lag.after_io_wait(1.0)
    assert attempt.looks == [(101.02, 0.02)]
    assert lag.look_after(101.0) == 101.02 + LAG_MIN_S  # a hedge's trigger waits for it too


def test_a_short_stall_with_no_clock_due_looks_at_no_attempt() -> None:
    """A loop at work has many short stalls; only a clock due now can lose what came
    in one, and trio's deadline heap says whether one is: the running attempts (a
    gateway's thousands of streams) are looked through only then, or after a long
    stall (which moves the clocks of requests not yet sent)."""
    lag, clock, attempt = _lag(due=False)
    clock.now += 1.0 + 0.02
    lag.after_io_wait(1.0)
    assert attempt.looks == [] and lag.last_stall == (pytest.approx(101.0), 101.02)
    clock.now += 1.0 + LAG_MIN_S * 2
    lag.after_io_wait(1.0)
    assert attempt.looks == [(pytest.approx(102.12), pytest.approx(LAG_MIN_S * 2))]


@pytest.mark.parametrize("peek", [True, False])
async def test_a_clock_due_is_what_trio_expires_next(
    mock_clock: trio.testing.MockClock, peek: bool,
) -> None:
    """Trio's deadline heap, peeked at (its public statistics also count every
    descriptor: ~0.3 ms a busy pass with 8,000 sockets), or the statistics where this
    trio has no heap to peek at."""
    lag = LoopLag(trio.lowlevel.current_clock())
    assert (lag._next_deadline is not None) is True
    if not peek:
        lag._next_deadline = None
    assert lag.clock_due() is False
    with trio.CancelScope(deadline=trio.current_time() + 0.5):
        assert lag.clock_due() is False
        mock_clock.jump(1.0)  # (the deadline passed, and trio has not yet expired it)
        assert lag.clock_due() is True
        await trio.lowlevel.checkpoint()
    assert lag.clock_due() is False


async def test_one_instrument_a_run_from_the_first_session_to_the_last() -> None:
    first = LoopLag.acquire()
    second = LoopLag.acquire()
    assert first is not None and first is second
    first.release()
    second.release()  # (the last: removed from the run)
    with pytest.raises(KeyError):
        trio.lowlevel.remove_instrument(first)
    again = LoopLag.acquire()
    assert again is first
    again.release()


async def test_a_mock_clock_run_has_none(autojump_clock: trio.testing.MockClock) -> None:
    """A MockClock's jumps are time the test makes pass: the clocks must see them."""
    assert LoopLag.acquire() is None


def _control(sent_at: float | None = 100.01) -> AttemptControl:
    record = AttemptRecord("c.1", "a", "primary", started_at=100.0, tokens_reserved=10)
    record.timeline.sent_at = sent_at
    control = AttemptControl(record)
    control.start_clocks(whole=100.0 + 30.0, watch=100.0 + 1.0)
    return control


def test_a_clock_due_after_a_stall_gets_a_look_as_long_as_the_stall_a_few_times() -> None:
    """A loop busy turn after turn stalls on every one: a hung upstream's clock would
    never fire if each stall gave it a look (the fix's first version moved the clocks
    by every stall, and a busy loop timed nothing out).  But a look may end inside the
    next of stalls that recur (a container's CPU quota spent every period): a due time
    gets a few (review of the throttled container: with one, 35 of 1,000 on-time
    streams were cut under 80 ms stops every 100 ms)."""
    control = _control()
    scope = control.scope
    assert scope is not None
    control.stalled(100.5, 0.06)  # not due yet: nothing to do
    assert scope.deadline == pytest.approx(101.0, abs=1e-5)
    control.stalled(101.5, 1.5)
    assert scope.deadline == 103.0 and control._look_until == 103.0
    control.stalled(103.08, 0.08)  # the look ended in the next stall: another
    assert scope.deadline == 103.08 + 0.08
    control.stalled(103.25, 0.08)  # and one more
    assert scope.deadline == 103.25 + 0.08
    assert AttemptControl.LOOKS == 3
    control.stalled(103.42, 0.08)  # the same due time had its looks: it fires
    assert scope.deadline == 103.25 + 0.08
    control._look_until = 103.0  # (as it was after the first look, to go on below)
    scope.deadline = 103.0
    control.watch(101.8 + 1.0)  # a token came in the look: the watchdog moves on
    assert scope.deadline == 103.0  # (not before the look's end: a token cannot shorten it)
    control.watch(102.5 + 1.0)
    assert scope.deadline == pytest.approx(103.5, abs=1e-5)
    control.stalled(104.0, 0.02)  # due again, after a short stall: the shortest look
    assert scope.deadline == 104.0 + LAG_MIN_S
    assert control.timed_out(104.01) is False  # (the whole attempt's clock is not moved)
    assert control.timed_out(130.01) is True


def test_a_look_outlasts_a_past_whole_attempt_clock() -> None:
    """A stall past ``timeout_s``: its look is not cut short by the first token read
    in it, whose watch() set the past whole-attempt deadline again (a stream answered
    in time was cut as a timeout)."""
    control = _control()
    control.start_clocks(whole=101.0, watch=math.inf)
    control.stalled(102.5, 2.0)
    control.watch(102.51 + 5.0)
    assert control.scope is not None and control.scope.deadline == 104.5


def test_a_stall_before_the_request_went_moves_the_clocks() -> None:
    """The upstream had not begun (a connect): a source that answers in 0.2 s once
    asked was cut as past its timeout_s by the caller's own stall."""
    control = _control(sent_at=None)
    control.stalled(100.9, 0.6)
    assert control.scope is not None
    assert control.scope.deadline == pytest.approx(101.6, abs=1e-5)
    assert control.timed_out(130.59) is False and control.timed_out(130.61) is True


def test_stalls_before_the_request_went_move_the_clocks_by_one_limit_at_most() -> None:
    """Outside review (a CPU-throttled container): stalls that recur moved the clocks
    by each, so a connect to a host that drops its SYNs (the kernel retries them
    meanwhile) timed out after 8 s of a timeout_s of 1.  In all they move the clocks
    by the first limit (here the 1 s watchdog) at most; past it, a due clock has its
    looks, as once the request went."""
    control = _control(sent_at=None)
    scope = control.scope
    assert scope is not None
    for i in range(1, 8):  # 80 ms stops every 100 ms: the first 0.96 s of them move
        control.stalled(100.0 + 0.1 * i, 0.08)
    assert scope.deadline == pytest.approx(101.56, abs=1e-5)
    control.stalled(101.0, 0.5)  # 0.44 s more may move: the rest is past it
    assert scope.deadline == pytest.approx(102.0, abs=1e-5)
    assert control.timed_out(130.99) is False and control.timed_out(131.01) is True
    control.stalled(102.2, 0.3)  # due: a look, as long as the stall
    assert scope.deadline == pytest.approx(102.5, abs=1e-5)


def test_a_long_stall_gives_a_look_of_two_seconds_at_most() -> None:
    """Outside review (a session that lives for weeks): a look as long as the stall
    held a hung upstream's attempt, and a hedge due in the stall, as long again after
    it: a process paused 10 minutes kept its calls on a hung upstream 10 minutes more
    (no call deadline by default).  What a stall leaves to read does not grow with it."""
    assert LOOK_MAX_S == 2.0
    control = _control()
    assert control.scope is not None
    control.stalled(700.0, 599.0)  # a virtual machine paused ten minutes
    assert control.scope.deadline == 700.0 + LOOK_MAX_S
    lag, clock, _ = _lag()
    clock.now += 600.0
    lag.after_io_wait(0.0)
    assert lag.look_after(101.0) == clock.now + LOOK_MAX_S


@pytest.mark.parametrize("what", ["timeout_s", "hedge"])
async def test_after_a_long_freeze_a_due_clock_fires_after_the_longest_look(
    monkeypatch: pytest.MonkeyPatch, what: str,
) -> None:
    """The same, end to end on the real clock: the loop blocked 1.5 s while an attempt
    waits on a hung upstream, its ``timeout_s`` (or a hedge) due during the block.
    With the longest look shortened to 0.3 s here, the attempt fails (the hedge goes)
    ~0.3 s after the loop is back, not 1.5 s."""
    monkeypatch.setattr("polygate._lag.LOOK_MAX_S", 0.3)
    hung = FakeUpstream(Reply(first_token_s=math.inf), name="a")
    fast = FakeUpstream(Reply(first_token_s=0.01, text="ok"), name="b")
    if what == "timeout_s":
        sources = [polygate.Source(name="a", base_url="http://a/v1", timeout_s=0.5)]
        scope = polygate.Scope(sources=sources, retry=polygate.Retry(max_attempts=1))
    else:
        sources = [polygate.Source(name="a", base_url="http://a/v1"),
                   polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)]
        scope = polygate.Scope(sources=sources, hedge=polygate.Hedge(after_s=0.5))
    settings = polygate.Settings(scopes={"chat": scope})
    thawed: list[float] = []

    async def block() -> None:
        while hung.statistics().requests < 1:  # noqa: ASYNC110 - the transport's count
            await trio.sleep(0.001)
        await trio.sleep(0.2)
        _block(1.5)
        thawed.append(trio.current_time())

    async with polygate.session(settings, transport=Router({"a": hung, "b": fast}),
                                rng=random.Random(0)) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(block)
            if what == "timeout_s":
                with pytest.raises(polygate.AllSourcesExhausted):
                    await s.chat(MESSAGES)
                late = trio.current_time() - thawed[0]
            else:
                assert (await s.chat(MESSAGES)).call_stats.hedge_won
                late = fast.requests[0].started_at - thawed[0]
    assert late < 1.0, f"{late:.2f} s after a 1.5 s stall"


def test_a_held_attempt_is_left_to_its_hold() -> None:
    control = _control()
    control._held = True  # (in hold_while: its clocks are off, and the hold moves them)
    assert control.scope is not None
    control.scope.deadline = math.inf
    control.stalled(101.5, 1.5)
    assert control.scope.deadline == math.inf
