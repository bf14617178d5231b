"""polygate.aio: the asyncio front door (SPEC §8.4).

Run by anyio's pytest plugin on plain asyncio and on uvloop (``anyio_backend``
below); the upstream is a FakeUpstream, through its transport face (in polygate's
trio run) or served on loopback by a trio run in another thread (real sockets).
The tests that drive an event loop by hand (stopping, closing it) are plain
functions.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import inspect
import sys
import threading
import time
import weakref
from typing import Any

import attrs
import httpx
import pytest
import trio

import polygate
import polygate.aio
from polygate.aio import _guest_io, _host
from polygate.testing import FakeUpstream, Profile, Reply

from ._aio_support import (
    BACKENDS,
    _new_loop,
    _run,
    governance_idle,
    loopback,
    messages,
    request_for,
    settings_for,
    trio_kept_busy,
    wait_until,
)
from .conftest import ROOT, SECRET, reader_leads

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

# A lost trio wake-up spins or waits inside a loop callback, where asyncio swallows
# pytest-timeout's signal: the thread method ends the run instead of hanging it.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60, method="thread")]

HANG = Reply(headers_delay_s=3600)


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(autouse=True, params=["loop-io", "thread-io"])
def guest_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs twice: with trio's I/O wait on the host loop (the default
    where trio's I/O manager can be polled) and with trio's own helper thread (the
    fallback for other platforms and for a trio whose internals changed)."""
    if request.param == "thread-io":
        monkeypatch.setattr(_guest_io, "_guest_tick", lambda: None)
    return str(request.param)


def fake(behaviour: Any = Reply(text="hello from the fake")) -> FakeUpstream:  # noqa: B008
    return FakeUpstream(behaviour)


# --------------------------------------------------------------------------- surface


def test_public_surface() -> None:
    assert set(polygate.aio.__all__) == {"session", "Session", "ChatStream"}
    for name in ("Session", "ChatStream"):
        assert getattr(polygate.aio, name).__module__ == "polygate.aio"


def test_every_public_session_method_is_bridged() -> None:
    """A method added to polygate.Session is reachable from asyncio with the same
    parameters, whether or not it got its one line in polygate.aio."""
    for name, member in inspect.getmembers(polygate.Session):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            assert isinstance(getattr(polygate.aio.Session, name, None), property), name
            continue
        explicit = getattr(polygate.aio.Session, name, None)
        if explicit is not None:
            assert list(inspect.signature(explicit).parameters) == list(
                inspect.signature(member).parameters), name
            assert inspect.iscoroutinefunction(explicit) == inspect.iscoroutinefunction(member), name


def test_session_takes_the_same_arguments_as_the_trio_one() -> None:
    """SPEC §8.4: 'same arguments as polygate.session' (a probe found rng= refused)."""
    trio_side = inspect.signature(polygate.session).parameters
    aio_side = inspect.signature(polygate.aio.session).parameters
    assert list(aio_side) == list(trio_side)
    assert all(aio_side[n].default == trio_side[n].default for n in trio_side)


async def test_a_seeded_rng_reaches_the_session() -> None:
    import random

    rng = random.Random(7)
    async with polygate.aio.session(settings_for("http://a/v1"), transport=fake(Reply()).transport(),
                                    rng=rng) as s:
        assert s._session._runtime.rng is rng  # what picks sources and jitters backoff


async def test_entering_one_session_block_twice_is_a_polygate_error() -> None:
    """As from trio: a typed error, not contextlib's bare AttributeError."""
    block = polygate.aio.session(settings_for("http://a/v1"), transport=fake(Reply()).transport())
    async with block as s:
        with pytest.raises(polygate.PolygateError, match=r"already entered.*again"):
            async with block:
                pass
        assert (await s.chat(messages("hi"))).text
    with pytest.raises(polygate.PolygateError, match=r"already entered.*again"):
        async with block:
            pass


async def test_a_session_whose_block_was_dropped_stays_open() -> None:
    """``s = await polygate.aio.session(...).__aenter__()`` (a notebook's way to keep
    a session across cells) dropped the block at once, and its opening generator,
    collected, closed the session under ``s``: the next call said 'this session is
    closed', with no warning."""
    s = await polygate.aio.session(settings_for("http://a/v1"),
                                   transport=fake(Reply(text="kept")).transport()).__aenter__()
    gc.collect()
    for _ in range(5):  # (the finalizer's aclose() would run in these)
        await asyncio.sleep(0)
    assert (await s.chat(messages("hi"))).text == "kept"
    assert s._block is not None
    await s._block.__aexit__(None, None, None)


async def test_a_session_dropped_without_being_left_is_closed_with_a_warning() -> None:
    """Dropped with its block, a session is closed by asyncio's finalizer of its
    opening (its calls settle, its connections close), and a ResourceWarning says
    what happened."""
    up = fake(Reply(text="x"))
    s = await polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()).__aenter__()
    assert (await s.chat(messages("hi"))).text == "x"
    closed = s._owner.closed
    held = [s]
    del s

    async def drop() -> None:
        held.clear()
        gc.collect()
        await asyncio.wait_for(asyncio.shield(closed), 10)
        for _ in range(5):  # (the warning follows the close)
            await asyncio.sleep(0)

    with pytest.warns(ResourceWarning, match="never left has been closed by asyncio"):
        await drop()


async def test_a_new_session_method_needs_no_line(monkeypatch: pytest.MonkeyPatch) -> None:
    async def echo(self: polygate.Session, value: int, *, twice: bool = False) -> int:
        await trio.lowlevel.checkpoint()  # trio code, run in polygate's trio run
        return value * (2 if twice else 1)

    monkeypatch.setattr(polygate.Session, "echo", echo, raising=False)
    async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s:
        assert await s.echo(21, twice=True) == 42
        assert s.settings is not None  # a property is read as it is


@pytest.mark.skipif(not hasattr(polygate.Session, "ocr"), reason="no Session.ocr in this build")
async def test_ocr_is_reachable_without_a_line_of_its_own() -> None:
    up = fake(Reply(text="the page's text"))
    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, model="vision")
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(sources=[source])})
    async with polygate.aio.session(settings, transport=up.transport()) as s:
        r = await s.ocr("https://example.com/scans/page-1.png")
        assert r.text == "the page's text" and r.call_stats.attempts == 1
        with pytest.raises(polygate.ConfigError):
            await s.ocr(b"not an image")


@pytest.mark.skipif(not hasattr(polygate, "StructuredOutputError"), reason="no schema= in this build")
async def test_structured_output_through_the_bridge() -> None:
    up = fake(Reply(text='{"city": "Paris"}'))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        r = await s.chat(messages("where?"), schema=schema)
        assert r.parsed == {"city": "Paris"}  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- results


async def test_chat_stream_embed_statistics() -> None:
    up = fake(Reply(text="hello from the fake", inter_token_s=0.001))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        assert "polygate.aio.Session" in repr(s)
        r = await s.chat(messages("hi"))
        assert isinstance(r, polygate.ChatResponse)
        assert r.text == "hello from the fake" and r.source == "a"
        assert r.call_stats.attempts == 1 and r.call_stats.ttft_ms is not None

        async with s.stream_chat(messages("stream")) as stream:
            assert isinstance(stream, polygate.aio.ChatStream)
            chunks = [chunk async for chunk in stream]
        assert all(isinstance(c, polygate.StreamChunk) for c in chunks)
        assert "".join(c.text for c in chunks) == "hello from the fake" == stream.text
        assert stream.response is not None and stream.response.text == "hello from the fake"
        with pytest.raises(polygate.PolygateError, match="only once"):
            async with stream:
                pass

        e = await s.embed(["x", "y", "z"])
        assert isinstance(e, polygate.EmbeddingResponse) and len(e.vectors) == 3

        stats = await s.statistics()
        assert isinstance(stats, polygate.SessionStatistics)
        await governance_idle(s)
    assert up.in_flight == 0


async def test_statistics_after_the_session_closed_are_its_final_figures(tmp_path: Any) -> None:
    """Probe finding (third round): in trio, statistics() after the block answers with
    the final figures (the last telemetry flush: the one place to read
    dropped_at_close); polygate.aio raised 'this session is closed'."""
    settings = attrs.evolve(settings_for("http://a/v1"), telemetry=f"sqlite:///{tmp_path}/t.db")
    async with polygate.aio.session(settings, transport=fake(Reply()).transport()) as s:
        await s.chat(messages("hi"))
    after = await s.statistics()
    assert (after.telemetry.written, after.telemetry.queued) == (2, 0)  # a call row, an attempt row
    assert after.governance is not None
    with pytest.raises(polygate.PolygateError, match="closed"):
        await s.chat(messages("again"))


async def test_errors_are_the_same_polygate_errors() -> None:
    fatal = fake(Reply(status=400))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=fatal.transport()) as s:
        with pytest.raises(polygate.ConfigError, match="messages"):
            await s.chat("not a list")  # type: ignore[arg-type]
        with pytest.raises(polygate.ConfigError):
            await s.chat(messages("x"), scope="nope")
        with pytest.raises(polygate.ConfigError):  # raised by the call itself, as in trio
            s.stream_chat(messages("x"), call_deadline_s=-1)
        with pytest.raises(polygate.ConfigError, match="inputs"):
            await s.embed("not a list")  # type: ignore[arg-type]
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(messages("x"))
        with pytest.raises(polygate.FatalUpstreamError):
            async with s.stream_chat(messages("x")) as stream:
                async for _ in stream:
                    pass

    broken = fake(Reply(status=500))
    settings = settings_for("http://a/v1", retry=polygate.Retry(max_attempts=2, backoff_base_s=0.001))
    async with polygate.aio.session(settings, transport=broken.transport()) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.chat(messages("x"))
        assert not isinstance(caught.value, BaseExceptionGroup)
        assert len(caught.value.errors) == 2

    slow = fake(Reply(first_token_s=5))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=slow.transport()) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(messages("x"), call_deadline_s=0.05)
    assert slow.in_flight == 0

    with pytest.raises(polygate.ConfigError):
        async with polygate.aio.session("not settings"):  # type: ignore[arg-type]
            pass
    with pytest.raises(polygate.ConfigError):  # no settings anywhere
        async with polygate.aio.session(env={}):
            pass


async def test_an_error_in_the_body_is_raised_as_itself() -> None:
    class Boom(Exception):
        pass

    up = fake()
    with pytest.raises(Boom):
        async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
            await s.chat(messages("x"))
            raise Boom
    with pytest.raises(polygate.PolygateError, match="closed"):
        await s.chat(messages("x"))


# --------------------------------------------------------------------------- concurrency


async def test_hundred_concurrent_tasks_share_one_session() -> None:
    up = fake(Profile(first_token_s=(0.3, 0.4), tokens=(2, 6)))
    threads_before = threading.active_count()
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        peak_threads = 0

        async def one(i: int) -> polygate.ChatResponse:
            nonlocal peak_threads
            peak_threads = max(peak_threads, threading.active_count())
            if i % 4 == 0:
                async with s.stream_chat(messages(f"call {i}")) as stream:
                    async for _ in stream:
                        peak_threads = max(peak_threads, threading.active_count())
                assert stream.response is not None
                return stream.response
            return await s.chat(messages(f"call {i}"))

        results = await asyncio.gather(*(one(i) for i in range(100)))
        await governance_idle(s)
    assert len({r.call_stats.logical_call_id for r in results}) == 100
    assert all(r.text for r in results)
    assert up.statistics().requests == 100
    assert up.peak_in_flight >= 50  # they really ran at the same time
    # No thread per call: trio's I/O helper at most, whatever the concurrency.
    assert peak_threads <= threads_before + 2


async def test_two_sessions_on_one_loop() -> None:
    one, two = fake(Reply(text="one")), fake(Reply(text="two"))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=one.transport()) as a:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=two.transport()) as b:
            ra, rb = await asyncio.gather(a.chat(messages("x")), b.chat(messages("x")))
            assert (ra.text, rb.text) == ("one", "two")
        assert (await a.chat(messages("x"))).text == "one"  # b leaving did not stop a


async def test_context_variables_reach_the_call() -> None:
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
    seen: list[str] = []
    inner = fake().transport()

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request_id.get())
            return await inner.handle_async_request(request)

    async with polygate.aio.session(settings_for("http://a/v1"), transport=Recording()) as s:

        async def tagged(tag: str) -> None:
            request_id.set(tag)
            await s.chat(messages(tag))

        await asyncio.gather(tagged("r1"), tagged("r2"))
    assert sorted(seen) == ["r1", "r2"]


async def test_a_worker_that_runs_another_call_runs_it_in_that_callers_context() -> None:
    # Sequential calls share one parked trio task (see _Owner._spawn); each must still
    # see its own caller's context variables, and nothing a call set in its context.
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
    set_inside: contextvars.ContextVar[str] = contextvars.ContextVar("set_inside", default="-")
    seen: list[tuple[str, str]] = []
    tasks: list[trio.lowlevel.Task] = []
    inner = fake().transport()

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append((request_id.get(), set_inside.get()))
            set_inside.set("leaked")
            tasks.append(trio.lowlevel.current_task())
            return await inner.handle_async_request(request)

    async with polygate.aio.session(settings_for("http://a/v1"), transport=Recording()) as s:

        async def tagged(tag: str) -> None:
            request_id.set(tag)
            await s.chat(messages(tag))

        for tag in ("r1", "r2", "r3"):
            await asyncio.ensure_future(tagged(tag))  # a task (a context) of its own
        request_id.set("here")
        await s.chat(messages("here"))
    assert seen == [("r1", "-"), ("r2", "-"), ("r3", "-"), ("here", "-")]
    assert len(set(tasks)) == 1  # one worker ran them all


async def test_a_parked_worker_holds_nothing_of_its_last_call() -> None:
    # The answer, the prompt and the caller's context variables are the caller's: a
    # worker parked after the call must not keep them alive.
    import weakref

    class Tag:
        pass

    span: contextvars.ContextVar[Tag] = contextvars.ContextVar("span")
    async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s:

        async def one() -> tuple[weakref.ref[Any], weakref.ref[Any]]:
            tag = Tag()
            span.set(tag)
            response = await s.chat(messages("x"))
            return weakref.ref(tag), weakref.ref(response)

        task = asyncio.ensure_future(one())  # (a context of its own)
        tag, response = await task
        del task  # (the finished task holds its context,
        await asyncio.sleep(0)  # and so does the loop's handle that resumed this one)
        gc.collect()
        assert tag() is None
        assert response() is None
        assert (await s.chat(messages("y"))).text == "hello from the fake"  # and it still works


async def test_parked_workers_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    from polygate.aio import _session

    monkeypatch.setattr(_session, "_IDLE_WORKERS", 2)
    tasks: list[trio.lowlevel.Task] = []
    all_in: list[trio.Event] = []
    inner = fake().transport()

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            tasks.append(trio.lowlevel.current_task())
            if len(tasks) == 5:
                all_in[-1].set()
            await all_in[-1].wait()  # all five in flight at once
            return await inner.handle_async_request(request)

    async with polygate.aio.session(settings_for("http://a/v1"), transport=Recording()) as s:
        all_in.append(trio.Event())
        await asyncio.gather(*(s.chat(messages(str(i))) for i in range(5)))
        first = set(tasks)
        tasks.clear()
        all_in.append(trio.Event())
        await asyncio.gather(*(s.chat(messages(str(i))) for i in range(5)))
        second = set(tasks)
    assert len(first) == len(second) == 5
    assert len(first & second) == 2  # two stayed parked; three ended with their calls


async def test_a_late_cancellation_of_a_finished_call_leaves_the_next_one_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker runs its calls in one cancel scope: a cancellation of a call that has
    # already finished (handed over late, through trio's entry queue) must not reach
    # the call the same worker runs next.
    from polygate.aio import _session

    jobs: list[Any] = []
    start_job = _session._Owner.start_job

    def recorded(owner: Any, job: Any) -> None:
        jobs.append(job)
        start_job(owner, job)

    monkeypatch.setattr(_session._Owner, "start_job", recorded)
    gate = trio.Event()
    waiting: list[str] = []
    inner = fake().transport()

    class Gated(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if waiting:
                waiting.append("in")
                await gate.wait()
            return await inner.handle_async_request(request)

    async with polygate.aio.session(settings_for("http://a/v1"), transport=Gated()) as s:
        await s.chat(messages("one"))
        waiting.append("gate")
        second = asyncio.ensure_future(s.chat(messages("two")))
        await wait_until(lambda: len(waiting) == 2)
        s._host.submit(jobs[0].cancel)
        s._host.submit(gate.set)
        assert (await second).text == "hello from the fake"


# --------------------------------------------------------------------------- cancellation


async def test_cancelling_the_task_settles_the_call_first() -> None:
    up = fake(HANG)
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        task = asyncio.ensure_future(s.chat(messages("hang")))
        await wait_until(lambda: up.in_flight == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Nothing awaited since: the upstream had already seen the abandonment.
        assert request_for(up, "hang").outcome == "client_closed"
        assert up.in_flight == 0
        await governance_idle(s)


async def test_cancelling_before_the_call_started() -> None:
    up = fake()
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        # An idle trio starts a call inside the caller's own step (and this fake
        # answers it there); a busy one (here a task that never blocks) takes it at
        # its next step, which the loop runs after this test's resumption.
        with trio_kept_busy():
            task = asyncio.ensure_future(s.chat(messages("never")))
            await asyncio.sleep(0)  # submitted, not yet started in trio
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (await s.chat(messages("after"))).text  # the session is fine
        await governance_idle(s)


async def test_a_cancelled_caller_leaves_no_unretrieved_error() -> None:
    """A call answered with an error inside the caller's step, whose caller is then
    cancelled at the call's yield point: the caller sees its cancellation, and asyncio
    has no "exception was never retrieved" to report for the answer it did not see."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        up = fake(Reply(status=400))
        async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
            for i in range(3):
                task = asyncio.ensure_future(s.chat(messages(f"bad{i}")))
                await asyncio.sleep(0)  # answered (loop-io: inside its first step), not seen
                task.cancel()
                with pytest.raises((asyncio.CancelledError, polygate.FatalUpstreamError)):
                    await task
                del task
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert reported == []


async def test_cancellation_over_real_sockets_closes_the_connection() -> None:
    up = fake(HANG)
    with loopback(up) as url:
        async with polygate.aio.session(settings_for(url)) as s:
            task = asyncio.ensure_future(s.chat(messages("hang")))
            await wait_until(lambda: up.in_flight == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await governance_idle(s)  # settled on our side before CancelledError
            # The other side notices the closed connection (another scheduler).
            await wait_until(lambda: request_for(up, "hang").outcome == "client_closed")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is 3.11+")
async def test_asyncio_timeout_behaves_like_call_deadline() -> None:
    up = fake(HANG)
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        # Measured on trio's clock base (perf_counter), not loop.time(): uvloop's is
        # libuv's millisecond clock, cached per iteration, on which a 100 ms trio
        # deadline can read as 0.0999999 (and asyncio's own timer fire that early).
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as by_deadline:
            await s.chat(messages("deadline"), call_deadline_s=0.1)
        t1 = time.perf_counter()
        with pytest.raises(TimeoutError) as by_asyncio:
            async with asyncio.timeout(0.1):
                await s.chat(messages("asyncio"))
        t2 = time.perf_counter()
        assert isinstance(by_deadline.value, polygate.DeadlineExceeded)
        assert not isinstance(by_asyncio.value, asyncio.CancelledError)
        for tag in ("deadline", "asyncio"):
            assert request_for(up, tag).outcome == "client_closed"
        assert 0.1 <= t1 - t0 < 2  # trio's deadline, on trio's clock
        assert 0.095 <= t2 - t1 < 2  # asyncio's timer, on the loop's clock (see above)
        await governance_idle(s)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is 3.11+")
@pytest.mark.parametrize("due", ["now", "passed"])
@pytest.mark.parametrize("kind", ["chat", "stream"])
async def test_a_call_whose_asyncio_timeout_is_already_due_sends_nothing(
    kind: str, due: str, tmp_path: Any,
) -> None:
    """Review: inside ``asyncio.timeout(0)`` (a budget already spent) the call started
    in the caller's own step, before the loop ran the timeout's callback: it was
    written to a warm connection and billed, its answer thrown away.  trio's
    ``move_on_after(0)`` sends nothing, and neither does httpx on asyncio.  A deadline
    that passed during blocking work is due as a timer, which asyncio runs behind a
    task that yielded once (a second review).  A chat() still has its one row,
    ``cancelled``, as a trio call cancelled at its first checkpoint has."""
    import sqlite3

    up = fake(Reply(text="billed"))
    db = tmp_path / "t.db"
    with loopback(up) as url:
        settings = attrs.evolve(settings_for(url), telemetry=f"sqlite:///{db}")
        async with polygate.aio.session(settings) as s:
            await s.chat(messages("warm"))  # a kept-alive connection is ready
            loop = asyncio.get_running_loop()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0) if due == "now" else \
                        asyncio.timeout_at(loop.time() + 0.001):
                    if due == "passed":
                        time.sleep(0.01)  # noqa: ASYNC251 - blocking work: the deadline passes, no race
                    if kind == "chat":
                        await s.chat(messages("late"))
                    else:
                        async with s.stream_chat(messages("late")) as stream:
                            async for _ in stream:
                                pass
            await governance_idle(s)
    assert [r.body["messages"][-1]["content"] for r in up.requests] == ["warm"]
    conn = sqlite3.connect(db)
    try:
        # As in trio: a chat() cancelled at its first checkpoint has its row, a
        # stream cancelled entering has none (its call never started).
        rows = sorted(o for (o,) in conn.execute("SELECT outcome FROM calls"))
        assert rows == (["cancelled", "ok"] if kind == "chat" else ["ok"])
    finally:
        conn.close()


async def test_wait_for_timeout_settles_too() -> None:
    up = fake(HANG)
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await asyncio.wait_for(s.chat(messages("w")), 0.05)
        assert request_for(up, "w").outcome == "client_closed"
        await governance_idle(s)


async def test_a_slow_reader_pauses_the_reading_at_most_32_chunks_behind() -> None:
    """As in trio, a stream's reader may fall 32 chunks behind before the reading
    pauses (docs/asyncio.md): the call puts its chunks into the asyncio side's one
    buffer.  Review: the asyncio side once kept a second buffer of 32 behind the trio
    stream's channel, and a slow reader fell 63 behind, its pace shown in
    ``total_latency_ms`` that much later.  The lead is counted exactly: what the call
    has shown (``stream.text``: yielded or queued) is never more than 33 chunks (the
    buffer and the one the call holds, as in trio) ahead of what the reader took.  100 chunks at
    once, read one per 10 ms: the last ~67 are read at the reader's pace before the
    answer is complete.  (Real clock: a lower bound, with a margin.)"""
    up = fake(Reply(first_token_s=0.1, tokens=100))
    pieces: list[str] = []
    shown: list[int] = []  # characters shown, as each chunk was taken
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("slow reader")) as stream:
            async for chunk in stream:
                pieces.append(chunk.text)
                shown.append(len(stream.text))
                await asyncio.sleep(0.01)
    assert len(pieces) == 100 and all(pieces)
    leads = reader_leads(pieces, shown)
    # 32 buffered, and the one the call holds, shown, once it has waited for space (as
    # in trio); the buffer did fill (the bound was reached, not merely respected).
    assert 32 <= max(leads) <= 33
    assert stream.response is not None
    assert stream.response.call_stats.total_latency_ms > 100 + 0.9 * (100 - 33) * 10


async def test_a_chunk_for_a_waiting_reader_takes_none_of_the_buffers_room() -> None:
    """As trio's channel hands a chunk to a reader waiting for it outside its buffer,
    the chunk that wakes a waiting asyncio reader is that reader's: a burst of 33
    chunks (the reader's one and 32 buffered) lets the call complete while the reader
    holds its first.  Review: the woken reader's chunk counted against the 32 until
    asyncio ran it, so the 33rd waited, and the call with it (its answer not cached,
    its connection held).  tests/test_backpressure.py holds trio's twin.  (The burst
    comes 0.1 s after the request, the reader long parked by then: real clock, a
    margin.)"""
    up = fake(Reply(first_token_s=0.1, tokens=33))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("burst")) as stream:
            await stream.__anext__()
            await wait_until(lambda: up.requests[0].outcome == "complete", limit_s=5)
            rest = [chunk async for chunk in stream]
    assert len(rest) == 32 and stream.response is not None


async def test_stream_cancelled_while_iterating() -> None:
    up = fake(Reply(tokens=50, inter_token_s=0.01))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        got: list[str] = []

        async def consume() -> None:
            async with s.stream_chat(messages("stream")) as stream:
                async for chunk in stream:
                    got.append(chunk.text)

        task = asyncio.ensure_future(consume())
        await wait_until(lambda: len(got) >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert request_for(up, "stream").outcome == "client_closed"
        await governance_idle(s)


async def test_stream_left_early_or_failing_body() -> None:
    up = fake(Reply(tokens=200, inter_token_s=0.001))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("early")) as stream:
            async for _ in stream:
                break
        assert request_for(up, "early").outcome == "client_closed"
        assert stream.response is None

        with pytest.raises(KeyError):
            async with s.stream_chat(messages("body")) as stream:
                await stream.__anext__()
                raise KeyError("the application's own error")
        assert request_for(up, "body").outcome == "client_closed"
        with pytest.raises(polygate.PolygateError, match="async with"):
            await s.stream_chat(messages("x")).__anext__()
        await governance_idle(s)


async def test_reading_a_stream_after_its_block_says_so() -> None:
    """As in trio: the stream's block was left, not the session."""
    up = fake(Reply(tokens=200, inter_token_s=0.01))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("early")) as stream:
            await stream.__anext__()
        with pytest.raises(polygate.PolygateError, match="its block exited"):
            async for _ in stream:
                pass
        assert (await s.chat(messages("after"))).text  # the session is open


async def test_a_stream_left_after_its_answer_came_hands_out_nothing_more() -> None:
    """Review finding: with the whole answer buffered when the block was left, the
    stream went on handing out the buffered chunks and ended normally with a
    response; trio's stream says at once that its block exited, and so does this."""
    up = fake(Reply(tokens=5))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("early")) as stream:
            await stream.__anext__()
            await wait_until(lambda: up.in_flight == 0)  # the rest is buffered here
        leftover = []
        with pytest.raises(polygate.PolygateError, match="its block exited"):
            async for chunk in stream:
                leftover.append(chunk.text)
        assert leftover == [] and stream.response is None


async def test_two_tasks_reading_one_stream_share_it() -> None:
    """As with trio's stream: two consumers split the chunks, and both loops end
    (one waited for ever: a second reader replaced the first's wake-up)."""
    up = fake(Reply(tokens=20, inter_token_s=0.01))
    got: dict[str, list[str]] = {"a": [], "b": []}
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("shared")) as stream:

            async def read(name: str) -> None:
                async for chunk in stream:
                    got[name].append(chunk.text)
                    await asyncio.sleep(0)

            await asyncio.wait_for(asyncio.gather(read("a"), read("b")), 10)
    assert len(got["a"]) + len(got["b"]) == 20
    assert stream.response is not None


async def test_two_tasks_reading_a_failed_stream_both_hear_it() -> None:
    """review: the reader that took the failure raised it, and the other's loop ended as
    if the answer were complete (as in trio's stream, fixed the same day)."""
    up = fake(Reply(tokens=6, inter_token_s=0.01, fault="truncated", fault_after=3))
    settings = attrs.evolve(settings_for("http://a/v1"))
    ends: list[str] = []
    async with polygate.aio.session(settings, transport=up.transport()) as s:
        async with s.stream_chat(messages("shared-fail")) as stream:

            async def read() -> None:
                try:
                    async for _ in stream:
                        await asyncio.sleep(0)
                except polygate.TransientUpstreamError:
                    ends.append("failed")
                    return
                ends.append("clean")

            await asyncio.wait_for(asyncio.gather(read(), read()), 10)
            with pytest.raises(polygate.TransientUpstreamError):
                await stream.__anext__()
    assert ends == ["failed", "failed"] and stream.response is None


async def test_slow_consumer_holds_the_stream_back() -> None:
    up = fake(Reply(tokens=300))
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        async with s.stream_chat(messages("slow")) as stream:
            first = await stream.__anext__()
            await asyncio.sleep(0.05)  # the whole answer is ready upstream by now
            assert len(stream._chunks) <= 40  # bounded: the trio side waits for room
            rest = [c async for c in stream]
        assert "".join(c.text for c in [first, *rest]) == stream.response.text  # type: ignore[union-attr]


async def test_leaving_the_session_cancels_calls_in_flight() -> None:
    up = fake(HANG)
    streamer = fake(Reply(tokens=10, first_token_s=0, inter_token_s=3600))
    outcomes: dict[str, BaseException] = {}
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s, \
            polygate.aio.session(settings_for("http://a/v1"), transport=streamer.transport()) as s2:

        async def call(tag: str) -> None:
            try:
                await s.chat(messages(tag))
            except BaseException as exc:
                outcomes[tag] = exc

        async def stream() -> None:
            try:
                async with s2.stream_chat(messages("stream")) as st:
                    async for _ in st:
                        pass
            except BaseException as exc:
                outcomes["stream"] = exc

        tasks = [asyncio.ensure_future(call(f"c{i}")) for i in range(5)]
        tasks.append(asyncio.ensure_future(stream()))
        await wait_until(lambda: up.in_flight == 5 and streamer.in_flight == 1)
    # Both sessions are closed; every call was cancelled and settled before that.
    assert up.in_flight == 0 and streamer.in_flight == 0
    await asyncio.gather(*tasks)
    assert set(outcomes) == {"c0", "c1", "c2", "c3", "c4", "stream"}
    for exc in outcomes.values():
        assert type(exc) is polygate.PolygateError and "closed" in str(exc)
    with pytest.raises(polygate.PolygateError, match="closed"):
        await s.chat(messages("late"))
    with pytest.raises(polygate.PolygateError, match="closed"):
        s.stream_chat(messages("late"))


async def test_cancelled_while_in_the_session_or_opening_it() -> None:
    up = fake(HANG)
    outcomes: list[BaseException] = []

    async def hold() -> None:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
            try:
                await s.chat(messages("x"))
            except BaseException as exc:
                outcomes.append(exc)
                raise

    holder = asyncio.ensure_future(hold())
    await wait_until(lambda: up.in_flight == 1)
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert [type(e) for e in outcomes] == [asyncio.CancelledError]
    assert up.in_flight == 0

    opener = asyncio.ensure_future(
        polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()).__aenter__())
    await asyncio.sleep(0)
    opener.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opener
    # The loop is left clean: a new session starts and works.
    async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s:
        assert (await s.chat(messages("x"))).text


# --------------------------------------------------------------------------- the host loop
# Plain functions: these tests start, stop and close event loops themselves.


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_host_loop_paused_and_resumed(kind: str) -> None:
    """A stopped loop pauses polygate with it; running it again resumes the calls."""
    up = fake(Reply(text="resumed", first_token_s=0.2))
    loop = _new_loop(kind)
    try:
        cm = polygate.aio.session(settings_for("http://a/v1"), transport=up.transport())
        s = loop.run_until_complete(cm.__aenter__())
        task = loop.create_task(s.chat(messages("x")))
        loop.run_until_complete(asyncio.sleep(0.05))  # the call is in flight
        assert up.in_flight == 1 and not task.done()
        # Stopped: nothing runs, no trio tick either (same thread), until resumed,
        # even once the upstream's answer is due.
        time.sleep(0.3)
        assert not task.done() and up.in_flight == 1
        assert loop.run_until_complete(task).text == "resumed"
        loop.run_until_complete(cm.__aexit__(None, None, None))
    finally:
        loop.close()
    assert not trio.lowlevel.in_trio_run()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_asyncio_run_ends_with_a_session_still_open(kind: str) -> None:
    """asyncio.run() cancels the tasks left over: their sessions close, their calls
    settle and the upstream sees the connections closed, before it returns."""
    up = fake(HANG)
    results: list[BaseException] = []

    async def main() -> None:
        async def background() -> None:
            async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
                try:
                    await s.chat(messages("left over"))
                except BaseException as exc:
                    results.append(exc)
                    raise

        asyncio.get_running_loop().create_task(background())
        await wait_until(lambda: up.in_flight == 1)

    _run(main(), kind)
    assert [type(e) for e in results] == [asyncio.CancelledError]
    assert request_for(up, "left over").outcome == "client_closed"
    assert not trio.lowlevel.in_trio_run()
    trio.run(trio.sleep, 0)  # trio is free in this thread again


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_loop_closed_under_an_open_session_is_finished_later(kind: str) -> None:
    """A loop closed while a session was never left cannot run polygate any more; the
    next session in the thread finishes that run first (calls cancelled, connections
    closed) and warns."""
    up = fake(HANG)
    loop = _new_loop(kind)
    cm = polygate.aio.session(settings_for("http://a/v1"), transport=up.transport())
    s = loop.run_until_complete(cm.__aenter__())
    task = loop.create_task(s.chat(messages("abandoned")))
    loop.run_until_complete(wait_until(lambda: up.in_flight == 1))
    task.cancel()  # (only so that the loop does not complain of a pending task)
    loop.stop()
    loop.close()
    assert trio.lowlevel.in_trio_run()  # the orphaned run still holds this thread

    async def next_session() -> str:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s2:
            return (await s2.chat(messages("x"))).text

    with pytest.warns(ResourceWarning, match="still open when its event loop closed"):
        assert _run(next_session(), kind)
    assert request_for(up, "abandoned").outcome == "client_closed"
    assert up.in_flight == 0
    assert not trio.lowlevel.in_trio_run()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_loop_closed_with_a_trio_tick_queued(kind: str) -> None:
    """Right after a result, trio's next tick sits in the loop's queue (the linger);
    closing the loop drops it, and the rescue must run it again."""
    loop = _new_loop(kind)
    cm = polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport())
    s = loop.run_until_complete(cm.__aenter__())
    assert loop.run_until_complete(s.chat(messages("x"))).text
    loop.close()

    async def reopen() -> None:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s2:
            assert (await s2.chat(messages("y"))).text

    t0 = time.monotonic()
    with pytest.warns(ResourceWarning):
        _run(reopen(), kind)
    assert time.monotonic() - t0 < 5  # not the rescue's time limit
    assert not trio.lowlevel.in_trio_run()


async def _answer() -> str:
    """A new session's answer (on whatever loop runs it)."""
    async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s:
        return (await s.chat(messages("x"))).text


def test_a_start_interrupted_leaves_no_run_for_later_sessions_to_wait_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: the loop's host was registered before its run started, so a Ctrl-C
    between the two (a press while the first session opened) left a host whose run
    never started, and every later session on the loop waited for it for ever."""
    loop = _new_loop("asyncio")
    start = _host.Host.start

    def pressed(self: _host.Host) -> None:
        raise KeyboardInterrupt

    try:
        monkeypatch.setattr(_host.Host, "start", pressed)
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(
                polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()).__aenter__())
        monkeypatch.setattr(_host.Host, "start", start)

        assert loop.run_until_complete(asyncio.wait_for(_answer(), 10)) == "hello from the fake"
    finally:
        loop.close()


def test_a_ctrl_c_held_in_the_runs_start_comes_in_the_same_cell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a Ctrl-C held during the guest run's start (a guarded step of trio's)
    waited for the run's first step, posted to the loop: a cell that opened a session
    in the background and ended in that iteration got nothing, and the next cell got
    the KeyboardInterrupt.  It is raised by the opening itself, and the run it had
    started stops, so a later session on the loop starts anew."""
    from polygate.aio import _interrupt

    loop = _new_loop("asyncio")
    start = _host.Host.start

    def pressed_during(self: _host.Host) -> None:
        start(self)
        _interrupt.held.pending = True  # (as the handler holds one that came in it)

    try:
        monkeypatch.setattr(_host.Host, "start", pressed_during)
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(
                polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()).__aenter__())
        assert not _interrupt.held.pending
        monkeypatch.setattr(_host.Host, "start", start)

        assert loop.run_until_complete(asyncio.wait_for(_answer(), 10)) == "hello from the fake"
    finally:
        _interrupt.held.pending = False
        loop.close()


_CTRL_C = """
import asyncio, os, signal, sys, threading
import polygate.aio, trio
from polygate.testing import FakeUpstream, Reply
from tests._aio_support import messages, settings_for

up = FakeUpstream(Reply(headers_delay_s=3600))

async def main():
    async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        await s.chat(messages("x"))

try:
    asyncio.run(main())
except KeyboardInterrupt:
    print(up.statistics().client_closed, up.in_flight, trio.lowlevel.in_trio_run(),
          signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_ctrl_c_under_asyncio_run_ends_the_program_after_settling() -> None:
    """Ctrl-C during a call under asyncio.run() (whose handler cancels the main task):
    KeyboardInterrupt ends the program as usual, the call's upstream connection is
    closed first, and the signal handler is left as found."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _CTRL_C], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.stdout.split() == ["1", "0", "False", "True"], done.stdout + done.stderr


_CTRL_C_NO_HANDLER = """
import asyncio, os, signal, sys, threading, time
import httpx, trio
import polygate.aio
from polygate.aio import _guest_io, _interrupt
from polygate.testing import FakeUpstream, Reply
from tests._aio_support import messages, settings_for

if sys.argv[1] == "thread-io":
    _guest_io._guest_tick = lambda: None

def say(*words):
    print(*words, flush=True)

def ctrl_c_soon():
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()

cell = 0

def run(aw):  # one cell of a REPL: the loop runs until it is done
    global cell
    cell += 1
    return loop.run_until_complete(aw)

class CtrlCInside(httpx.AsyncBaseTransport):
    # Presses Ctrl-C from inside a step of trio's (a call's task), once, and notes
    # in which cell.
    def __init__(self, inner):
        self.inner, self.armed, self.pressed_in = inner, False, None
    async def handle_async_request(self, request):
        if self.armed:
            self.armed = False
            self.pressed_in = cell
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # (Python runs the handler here, inside the step)
                pass
        return await self.inner.handle_async_request(request)
    async def aclose(self):
        await self.inner.aclose()

up = FakeUpstream([Reply(headers_delay_s=3600), Reply(text="second"), Reply(text="third"),
                   Reply(text="fourth")])
inside = CtrlCInside(up.transport())
loop = asyncio.new_event_loop()  # as IPython's terminal: run_until_complete per cell
cm = polygate.aio.session(settings_for("http://a/v1"), transport=inside)
s = run(cm.__aenter__())
say("default", signal.getsignal(signal.SIGINT) is signal.default_int_handler)

# A call that hangs: Ctrl-C interrupts the cell at once.
ctrl_c_soon()
t0 = time.monotonic()
try:
    run(s.chat(messages("x")))
except KeyboardInterrupt:
    say("call-interrupted", time.monotonic() - t0 < 5)

# Plain code between cells: interrupted as ever.
ctrl_c_soon()
t0 = time.monotonic()
try:
    while time.monotonic() - t0 < 10:
        time.sleep(0.01)
except KeyboardInterrupt:
    say("sleep-interrupted", time.monotonic() - t0 < 5)

# An unrelated await: interrupted, the session left alone.
ctrl_c_soon()
try:
    run(asyncio.sleep(10))
except KeyboardInterrupt:
    say("await-interrupted", True)

def settle_asyncio():
    try:
        # asyncio's own: where the task run_until_complete waited for finished in the
        # iteration a KeyboardInterrupt left, that run's stop is still queued.
        run(asyncio.sleep(0))
    except RuntimeError:
        pass

# Ctrl-C inside one of trio's steps: held to the step's end, then raised by the code
# that ran the step, in the same cell; trio's run goes on.
inside.armed = True
task = loop.create_task(s.chat(messages("y")))
try:
    run(task)
except KeyboardInterrupt:
    say("step-interrupted", inside.pressed_in == cell, _interrupt.held.pending)
if task.done():  # (the step ran in the caller's own step, and the Ctrl-C ended it)
    say("caller", type(task.exception()).__name__)
else:  # (bounded: a Ctrl-C raised inside trio's step broke the run)
    say("caller", run(asyncio.wait_for(task, 20)).text)
settle_asyncio()

# A cell that starts a call in the background and ends at once: the Ctrl-C pressed
# in that call's step comes in the cell in which it was pressed, never a later one.
background = []

async def start_one():
    background.append(asyncio.ensure_future(s.chat(messages("v"))))
    for _ in range(2):  # (the call's first steps run in the second)
        await asyncio.sleep(0)

inside.armed = True
came_in = []
for aw in (start_one(), asyncio.sleep(0.2), asyncio.sleep(0.2)):
    try:
        run(aw)
    except KeyboardInterrupt:
        came_in.append(cell)
    except RuntimeError:
        pass  # (asyncio's queued stop, as above)
say("late-press", came_in == [inside.pressed_in], _interrupt.held.pending)
settle_asyncio()

# The same session, and a new one on the same loop, still work.
say("again", run(s.chat(messages("z"))).text)

async def fresh():
    async with polygate.aio.session(
        settings_for("http://a/v1"), transport=FakeUpstream(Reply(text="fresh")).transport()
    ) as s2:
        return (await s2.chat(messages("w"))).text

say("fresh", run(fresh()))

# Leaving the session cancels the call the first Ctrl-C left behind and closes its
# connection; the run ends and the default handler is back.
run(cm.__aexit__(None, None, None))
say("left", up.statistics().client_closed, up.in_flight, trio.lowlevel.in_trio_run(),
    signal.getsignal(signal.SIGINT) is signal.default_int_handler)
loop.close()
"""


def test_ctrl_c_without_a_handler_interrupts_and_the_session_lives_on(guest_io: str) -> None:
    """A loop run by run_until_complete (IPython's terminal, ``python -m asyncio``,
    scripts) leaves SIGINT to Python's default handler.  trio's guest run took it over
    and treated the application's code as protected: Ctrl-C was held back from a
    ``time.sleep`` and then ended the run, closing every session on the loop.  Now it
    interrupts wherever the program is, as before a session opened; one that comes
    inside a step of trio's is raised when the step ends, by the code that ran it:
    the caller's own step (with the loop driver, a call's first steps run there: the
    caller ends, and its call with it) or the loop's callback (the caller goes on).
    Review: it was posted to the loop, and came in a later cell when the cell's run
    ended in that iteration."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _CTRL_C_NO_HANDLER, guest_io], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.splitlines() == [
        "default False",
        "call-interrupted True",
        "sleep-interrupted True",
        "await-interrupted True",
        "step-interrupted True False",
        "caller KeyboardInterrupt" if guest_io == "loop-io" else "caller second",
        "late-press True False",
        "again fourth",
        "fresh fresh",
        "left 1 0 False True",
    ], done.stdout + done.stderr


def test_sessions_on_loops_in_other_threads() -> None:
    """Each thread's loop gets its own trio run."""
    results: list[str] = []

    def worker(tag: str) -> None:
        async def main() -> None:
            async with polygate.aio.session(settings_for("http://a/v1"),
                                            transport=fake(Reply(text=tag)).transport()) as s:
                results.append((await s.chat(messages(tag))).text)

        _run(main())

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == ["t0", "t1", "t2"]


def test_a_session_used_from_another_loop_says_so() -> None:
    async def main() -> None:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s:
            await _refused_elsewhere(
                lambda: _run(s.chat(messages("x"))),
                lambda: s.stream_chat(messages("x")),  # no running loop in that thread
            )
            assert (await s.chat(messages("x"))).text  # still fine on its own loop

    _run(main())


async def _refused_elsewhere(*steps: Any) -> None:
    """Run each step in another thread: each raises PolygateError("… another event loop")."""
    errors: list[BaseException] = []

    def elsewhere() -> None:
        for step in steps:
            try:
                step()
            except BaseException as exc:
                errors.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    await asyncio.get_running_loop().run_in_executor(None, thread.join)
    assert [type(e) for e in errors] == [polygate.PolygateError] * len(steps), errors
    assert all("another event loop" in str(e) for e in errors)


def test_a_stream_used_from_another_loop_says_so() -> None:
    """Review finding: a stream read or left from another thread handed trio work from
    that thread: trio's RuntimeError there, and the stream (after an exit, the whole
    session) stuck for ever on its own loop.  Now a PolygateError, and nothing moves."""
    async def main() -> None:
        up = fake(Reply(tokens=60))
        async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s:
            async with s.stream_chat(messages("x")) as stream:
                first = await stream.__anext__()
                await _refused_elsewhere(
                    lambda: _run(stream.__anext__()),
                    lambda: _run(stream.__aexit__(None, None, None)),
                )
                texts = [first.text] + [chunk.text async for chunk in stream]  # the rest, here
            assert stream.response is not None and "".join(texts) == stream.response.text
            assert (await s.chat(messages("y"))).text

    _run(main())


def test_a_session_left_from_another_loop_says_so_and_changes_nothing() -> None:
    """Review: the session's own ``__aexit__`` from another thread closed the session
    (its call in flight cancelled, new ones refused), then failed with asyncio's bare
    RuntimeError about a future of another loop; in the on-loop I/O mode it even
    stepped trio's run from that thread.  Now it is refused first, as a stream's is."""
    async def main() -> None:
        up = fake(Reply(text="x", first_token_s=0.05))
        block = polygate.aio.session(settings_for("http://a/v1"), transport=up.transport())
        s = await block.__aenter__()
        try:
            in_flight = asyncio.ensure_future(s.chat(messages("in flight")))
            await asyncio.sleep(0.01)
            await _refused_elsewhere(lambda: _run(block.__aexit__(None, None, None)))
            assert (await asyncio.wait_for(in_flight, 10)).text == "x"  # changed nothing
            assert (await s.chat(messages("after"))).text == "x"
        finally:
            await block.__aexit__(None, None, None)

    _run(main())


def test_an_aio_session_opened_from_plain_trio_says_what_to_use() -> None:
    """Review: from trio code (no asyncio loop) it was asyncio's bare RuntimeError
    ("no running event loop")."""
    async def main() -> None:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()):
            pass

    with pytest.raises(polygate.PolygateError, match=r"use polygate\.session"):
        trio.run(main)


async def test_a_transport_passed_in_is_closed_with_the_session(anyio_backend: Any) -> None:
    """Review: an httpx transport passed to the session could not be closed by the
    application (its connections are trio sockets: closing them from asyncio raised
    trio's RuntimeError), so its sockets leaked.  The session closes it, in its trio
    run, when it closes; the application's own close then finds nothing left."""
    up = fake(Reply(text="hello"))
    with loopback(up) as url:
        async with httpx.AsyncHTTPTransport() as transport:
            async with polygate.aio.session(settings_for(url), transport=transport) as s:
                assert (await s.chat(messages("x"))).text == "hello"
            pool: Any = transport._pool
            assert pool.connections == []  # closed in the trio run


def test_secret_never_in_repr() -> None:
    async def main() -> str:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s:
            return repr(s) + repr(s.settings)

    assert SECRET not in _run(main())


async def test_cancelled_while_opening_then_the_open_fails_logs_nothing() -> None:
    """A task cancelled while its session is still opening gets CancelledError once
    the open has ended; if the open then failed, that error is nobody's news: the loop
    must not log "Future exception was never retrieved"."""
    import gc

    from ._aio_support import redis_that_never_answers

    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    with redis_that_never_answers() as settings:

        async def opener() -> None:
            async with polygate.aio.session(settings):
                pass

        task = asyncio.ensure_future(opener())
        await asyncio.sleep(0.1)  # (the open is under way: it waits for Redis)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
    del task
    gc.collect()
    await asyncio.sleep(0)
    assert [c.get("message") for c in reported] == []


class _SlowClose(httpx.AsyncBaseTransport):
    """A transport whose close takes 0.5 s: its session stays closing meanwhile."""

    def __init__(self) -> None:
        self.inner = fake().transport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await trio.sleep(0.5)


def test_statistics_from_another_loop_while_the_session_closes_says_so() -> None:
    """Outside review (2026-12-02): ``statistics()`` waited for a closing session's
    close before checking its loop: from another thread it touched the owning loop's
    future (not thread-safe) and failed with asyncio's bare RuntimeError."""

    async def main() -> None:
        block = polygate.aio.session(settings_for("http://a/v1"), transport=_SlowClose())
        s = await block.__aenter__()
        await s.chat(messages("x"))
        closing = asyncio.ensure_future(block.__aexit__(None, None, None))
        await asyncio.sleep(0)  # the close begins (it takes 0.5 s)
        assert s._owner.closing and not s._owner.closed.done()
        await _refused_elsewhere(lambda: asyncio.run(asyncio.wait_for(s.statistics(), 5)))
        await closing

    _run(main())


def test_leaving_a_stream_never_entered_is_the_trio_error() -> None:
    """The same errors as polygate.Session: a ChatStream left without being entered."""

    async def on_trio() -> str:
        async with polygate.session(settings_for("http://a/v1"), transport=fake().transport()) as s:
            with pytest.raises(polygate.PolygateError) as info:
                await s.stream_chat(messages("x")).__aexit__(None, None, None)
        return str(info.value)

    async def on_asyncio() -> str:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=fake().transport()) as s:
            with pytest.raises(polygate.PolygateError) as info:
                await s.stream_chat(messages("x")).__aexit__(None, None, None)
        return str(info.value)

    expected = trio.run(on_trio)
    assert "never entered" in expected
    assert _run(on_asyncio()) == expected


_REQUEST: contextvars.ContextVar[Any] = contextvars.ContextVar("polygate_test_request", default="-")


class _ClosingRecorder(httpx.AsyncBaseTransport):
    """A caller's transport, which the session closes: in whose context?"""

    def __init__(self) -> None:
        self.inner = FakeUpstream(Reply()).transport()
        self.closed_in: list[Any] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        self.closed_in.append(_REQUEST.get())
        await self.inner.aclose()


@pytest.mark.parametrize("upstream_s", [0.0, 0.05])
def test_a_sessions_own_work_runs_in_its_openers_context_and_holds_no_other(
    upstream_s: float,
) -> None:
    """Outside review (asyncio configurations, 2026-12-03): a session's own work (its
    opening, background tasks, closing) ran in the context of the task that first
    started the loop's shared trio run -- request A's, for a session request B opened --
    and kept A's context (its request object, span...) alive while any session on the
    loop was open.  As with ``polygate.session()``, it is its own opener's.  And a call
    that waited on its upstream (fifth diff review) left its caller's context in the
    loop's timer for trio's next wake-up, armed a day ahead."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})

    class RequestState:
        pass

    async def main() -> tuple[list[Any], bool]:
        a_open, b_done, a_may_leave = asyncio.Event(), asyncio.Event(), asyncio.Event()
        held = [RequestState()]  # (in a list: the test lets go of it below)
        ref = weakref.ref(held[0])
        recorder = _ClosingRecorder()

        async def request_a() -> None:
            _REQUEST.set(held[0])
            slow = FakeUpstream(Reply(first_token_s=upstream_s)).transport()
            async with polygate.aio.session(settings, transport=slow) as s:
                await s.chat(messages("a"))
                a_open.set()
                await a_may_leave.wait()

        async def request_b() -> None:
            _REQUEST.set("B")
            async with polygate.aio.session(settings, transport=recorder) as s:
                await s.chat(messages("b"))

        async def lifespan() -> None:  # a long-lived session, opened while A's is open
            _REQUEST.set("lifespan")
            async with polygate.aio.session(settings, transport=FakeUpstream(Reply()).transport()):
                await b_done.wait()

        task_a = asyncio.ensure_future(request_a())
        await a_open.wait()
        task_l = asyncio.ensure_future(lifespan())
        await asyncio.ensure_future(request_b())
        a_may_leave.set()
        await task_a
        del task_a
        held.clear()
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        alive = ref() is not None  # request A is over, its session closed
        b_done.set()
        await task_l
        return recorder.closed_in, alive

    closed_in, alive = asyncio.run(main())
    assert closed_in == ["B"]
    assert not alive
