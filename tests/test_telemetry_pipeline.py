"""The pipeline between the call path and a sink: batching, and above all that a
stalled, slow or failing sink costs rows (dropped, counted, logged) and never a
call's time; closing flushes, bounded."""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polygate
import polygate._session
from polygate.telemetry import Batch, CallEvent, Pipeline, open_telemetry
from polygate.telemetry._recorder import TelemetryRecorder
from polygate.telemetry._sink import real_time_bound
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, two_source_settings


class ListSink:
    """Records every batch; optionally fails or stalls on demand."""

    name = "list"

    def __init__(self, *, fail: bool = False) -> None:
        self.batches: list[Batch] = []
        self.fail = fail
        self.closed = False
        self.interrupted = 0

    def write(self, batch: Batch) -> None:
        if self.fail:
            raise OSError("disk on fire")
        self.batches.append(batch)

    def interrupt(self) -> None:
        self.interrupted += 1

    def close(self) -> None:
        self.closed = True

    @property
    def calls(self) -> list[CallEvent]:
        return [c for b in self.batches for c in b.calls]


class StalledSink(ListSink):
    """``write`` blocks until released (or for ever): a database that stopped answering."""

    name = "stalled"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, batch: Batch) -> None:
        self.entered.set()
        self.release.wait(30)
        super().write(batch)


@pytest.fixture
def stalled() -> Iterator[StalledSink]:
    sink = StalledSink()
    yield sink
    sink.release.set()  # let the abandoned worker thread end


def _use(monkeypatch: pytest.MonkeyPatch, sink: Any, **options: Any) -> None:
    """Make polygate.session() open ``sink`` with these pipeline options."""
    monkeypatch.setattr(
        polygate._session, "open_telemetry", functools.partial(open_telemetry, sink=sink, **options)
    )


def _event(i: int) -> CallEvent:
    return CallEvent(
        "s", f"c{i}", "chat", "chat", 0, 0.0, "ok", None, None, 1.0, 1.0, None, None, None,
        None, 1, 0, 0, "a", 0, None, None, None, None,
    )


def _send(pipeline: Pipeline, numbers: range) -> None:
    """Events ``c<i>`` for each ``i`` of ``numbers``, into the pipeline's channel."""
    for i in numbers:
        pipeline.send.send_nowait(_event(i))


# --------------------------------------------------------------------------- batching


async def test_events_are_batched(autojump_clock: trio.testing.MockClock) -> None:
    sink = ListSink()
    pipeline = Pipeline(sink, session_id="s", linger_s=0.05, max_batch=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        _send(pipeline, range(250))
        await trio.sleep(1)
        await pipeline.aclose()
    assert [len(b) for b in sink.batches if len(b)] == [100, 100, 50]
    assert [c.logical_call_id for c in sink.calls] == [f"c{i}" for i in range(250)]
    assert pipeline.statistics().written == 250
    assert sink.closed
    assert sink.batches[-1].session is not None and sink.batches[-1].session.ended_at is not None


async def test_a_close_does_not_wait_out_the_linger(autojump_clock: trio.testing.MockClock) -> None:
    """Review finding (sessions opened and closed over and over): the flusher, holding
    a quiet session's first rows, lingered its full ``linger_s`` before the close could
    write them, so every session with telemetry on took ~50 ms more to leave (a
    serverless handler opening one per request paid it on each).  The close ends the
    linger: the rows are written at once."""
    sink = ListSink()
    pipeline = Pipeline(sink, session_id="s", linger_s=10, max_batch=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        _send(pipeline, range(3))
        await trio.testing.wait_all_tasks_blocked()  # the flusher lingers on c0
        start = trio.current_time()
        await pipeline.aclose()
        assert trio.current_time() - start == 0
    assert [c.logical_call_id for c in sink.calls] == ["c0", "c1", "c2"]
    assert pipeline.statistics().written == 3 and sink.closed


class _CountedSink(ListSink):
    """A ListSink whose writes (in the pipeline's worker thread) a test can wait for."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__(fail=fail)
        self.attempts = 0
        self._changed = threading.Condition()

    def write(self, batch: Batch) -> None:
        try:
            super().write(batch)
        finally:
            with self._changed:
                self.attempts += 1
                self._changed.notify_all()

    async def tried(self, n: int) -> None:
        """Until ``n`` writes were tried (real time: they run in a thread)."""
        def wait() -> bool:
            with self._changed:
                return self._changed.wait_for(lambda: self.attempts >= n, 10)

        assert await trio.to_thread.run_sync(wait)


async def _accounted(pipeline: Pipeline, rows: int) -> None:
    """Until the pipeline has counted ``rows`` rows written or dropped: a write's
    outcome reaches the flusher from its thread, and each thread round trip here
    gives trio's loop a pass to take it in."""
    for _ in range(1000):
        statistics = pipeline.statistics()
        if statistics.written + statistics.dropped >= rows:
            return
        await trio.to_thread.run_sync(lambda: None)
    raise AssertionError(f"{rows} rows never accounted for: {pipeline.statistics()}")


async def test_a_quiet_session_brings_its_sessions_row_up_to_date(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Review: the sessions row was written only with a batch of rows, at most every
    ``summary_interval_s``: rows written (and dropped, and hedges suppressed) after
    the last one stayed unreported while the session went quiet -- for ``serve``,
    until it closed, days later -- and ``polygate stats`` warned of nothing.  Once the
    interval is over a row that is behind is written alone; one that is not, never.
    (The clock moves only when the test moves it: the writes run in a thread.)"""
    sink = _CountedSink()
    pipeline = Pipeline(sink, session_id="s", linger_s=0, summary_interval_s=10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        pipeline.send.send_nowait(_event(0))
        await sink.tried(1)
        mock_clock.jump(1)
        _send(pipeline, range(1, 6))
        await sink.tried(2)
        assert [b.session is not None for b in sink.batches] == [True, False]
        mock_clock.jump(20)  # the interval is over, the session quiet
        await sink.tried(3)
        assert len(sink.batches[2]) == 0
        last = sink.batches[2].session
        assert last is not None and last.rows_written == 6 and last.ended_at is None
        mock_clock.jump(100)  # nothing new since: nothing written
        await trio.testing.wait_all_tasks_blocked()
        await pipeline.aclose()
    # Only the final row, at close, after the three.
    assert len(sink.batches) == 4 and len(sink.batches[3]) == 0
    assert sink.batches[3].session is not None and sink.batches[3].session.ended_at is not None


async def test_a_summary_that_did_not_land_is_written_again_while_quiet(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Review: a batch carrying the sessions row failed (its rows dropped); the session
    then stayed quiet, and its row in the database never said so."""
    sink = _CountedSink(fail=True)
    pipeline = Pipeline(sink, session_id="s", linger_s=0, summary_interval_s=10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        _send(pipeline, range(5))
        await sink.tried(1)
        await _accounted(pipeline, 5)  # the flusher took the failure in
        assert pipeline.statistics().dropped == 5 and sink.batches == []
        sink.fail = False
        mock_clock.jump(20)
        await sink.tried(2)
        [written] = sink.batches
        assert len(written) == 0 and written.session is not None
        assert written.session.rows_dropped == 5
        await pipeline.aclose()


async def test_closing_without_a_flusher_still_writes_the_queue() -> None:
    sink = ListSink()
    pipeline = Pipeline(sink, session_id="s")
    _send(pipeline, range(10))
    await pipeline.aclose()
    assert len(sink.calls) == 10 and pipeline.statistics().written == 10


async def test_a_flusher_started_after_close_does_nothing() -> None:
    sink = ListSink()
    pipeline = Pipeline(sink, session_id="s")
    pipeline.send.send_nowait(_event(0))
    await pipeline.aclose()
    await pipeline.run()  # scheduled late: returns at once, no error
    assert len(sink.calls) == 1 and pipeline.statistics().written == 1


async def test_failing_sink_counts_drops_and_keeps_going(caplog: pytest.LogCaptureFixture) -> None:
    sink = ListSink(fail=True)
    pipeline = Pipeline(sink, session_id="s", linger_s=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        for i in range(5):
            pipeline.send.send_nowait(_event(i))
            await trio.sleep(0.01)
        await pipeline.aclose()
    stats = pipeline.statistics()
    assert stats.written == 0 and stats.dropped_sink_error == 5 and stats.write_errors >= 2
    assert stats.last_error == "OSError: disk on fire"
    assert "telemetry dropped" in caplog.text


async def test_a_sink_that_writes_again_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Review finding (logs under sustained faults): a sink that failed, then wrote
    again (its lock released, its server back), said nothing more: the log's last word
    on telemetry stayed "dropped ... rows", where the cache and Redis say they answer
    again.  Once, and only after a failure."""
    sink = ListSink(fail=True)
    pipeline = Pipeline(sink, session_id="s", linger_s=0)
    with caplog.at_level(logging.INFO, logger="polygate.telemetry"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipeline.run)
            for i in range(3):
                pipeline.send.send_nowait(_event(i))
                await trio.sleep(0.01)
            sink.fail = False
            for i in range(3, 6):
                pipeline.send.send_nowait(_event(i))
                await trio.sleep(0.01)
            await pipeline.aclose()
    said = [r.getMessage() for r in caplog.records if r.name == "polygate.telemetry"]
    again = [m for m in said if "again" in m]
    assert len(again) == 1 and "3 row(s) dropped" in again[0], said
    # The last word: drops held back by the once-a-minute limit are said before it,
    # not after it at the close (where they read as a new failure).
    assert said[-1] == again[0], said
    assert pipeline.statistics().written == 3


async def test_a_sink_that_writes_only_its_summary_again_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Review finding: a sink whose first write after failing carried only the sessions
    row (a quiet session's close) never said it wrote again."""
    sink = ListSink(fail=True)
    pipeline = Pipeline(sink, session_id="s", linger_s=0)
    with caplog.at_level(logging.INFO, logger="polygate.telemetry"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipeline.run)
            pipeline.send.send_nowait(_event(0))
            await trio.sleep(0.01)
            sink.fail = False
            await pipeline.aclose()
    said = [r.getMessage() for r in caplog.records if r.name == "polygate.telemetry"]
    assert sink.batches and "again" in said[-1], said


async def test_slow_write_is_abandoned_and_interrupted(stalled: StalledSink) -> None:
    pipeline = Pipeline(stalled, session_id="s", linger_s=0, write_timeout_s=0.2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        pipeline.send.send_nowait(_event(0))
        await trio.sleep(1.0)  # real time: five times the write timeout
        assert stalled.interrupted == 1
        stats = pipeline.statistics()
        assert stats.dropped_sink_error == 1 and "longer than 0.2 s" in (stats.last_error or "")
        stalled.release.set()
        await pipeline.aclose()


async def test_a_write_the_session_left_during_counts_as_written(stalled: StalledSink) -> None:
    """The session is left by cancellation while the flusher's batch is in the sink.
    The close waits for that write (bounded) instead of giving it up: it commits, so
    it is counted written, not dropped, and the final sessions row -- written in the
    same transaction as the last rows -- counts every row the sink holds."""
    pipeline = Pipeline(stalled, session_id="s", linger_s=0)
    with trio.CancelScope() as leaving:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipeline.run)
            _send(pipeline, range(5))
            await trio.to_thread.run_sync(stalled.entered.wait)  # the batch is being written
            _send(pipeline, range(5, 8))  # queued behind it
            leaving.cancel()
    stalled.release.set()  # the database answers
    await pipeline.aclose()
    stats = pipeline.statistics()
    assert len(stalled.calls) == 8
    assert (stats.written, stats.dropped) == (8, 0), stats
    final = stalled.batches[-1].session
    assert final is not None and final.ended_at is not None
    assert (final.rows_written, final.rows_dropped) == (8, 0)
    assert stalled.interrupted == 0  # a write that answers in time is never interrupted


@pytest.mark.parametrize("seconds", [threading.TIMEOUT_MAX, 1e10, 1e300])
async def test_bounds_past_what_a_timer_can_wait_are_no_bound(
    seconds: float, tmp_path: Any
) -> None:
    """``telemetry_write_timeout_s`` / ``telemetry_close_timeout_s`` accept any finite
    number > 0; one past what ``threading.Timer`` can wait (~292 years) is no bound,
    never an OverflowError in a timer thread for every batch."""
    with real_time_bound(seconds) as bound:
        await trio.lowlevel.checkpoint()
    assert not bound.cancelled_caught
    settings = attrs.evolve(
        two_source_settings(names=("a",)), telemetry=f"sqlite:///{tmp_path / 't.db'}",
        telemetry_write_timeout_s=seconds, telemetry_close_timeout_s=seconds,
    )
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    assert (await s.statistics()).telemetry.written == 2


async def test_recording_after_close_is_counted() -> None:
    sink = ListSink()
    pipeline = Pipeline(sink, session_id="s")
    recorder = TelemetryRecorder(pipeline.send, pipeline.counters, session_id="s")
    await pipeline.aclose()
    recorder._put(_event(0))
    assert pipeline.statistics().dropped_at_close == 1


def test_real_time_bound_ignores_the_mock_clock() -> None:
    async def main() -> tuple[bool, float]:
        t0 = time.monotonic()
        with real_time_bound(0.2) as bound:
            await trio.to_thread.run_sync(time.sleep, 5, abandon_on_cancel=True)
        return bound.cancelled_caught, time.monotonic() - t0

    caught, took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert caught and 0.19 < took < 3


# --------------------------------------------------------------------------- a stalled sink


async def test_stalled_sink_never_delays_a_call(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    stalled: StalledSink,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Virtual time: every call takes exactly what the upstream takes; rows beyond the
    bound are dropped, counted, and logged once per interval."""
    _use(monkeypatch, stalled, capacity=10, linger_s=0, shutdown_timeout_s=0.3,
         log_interval_s=3600)
    router = Router({"a": FakeUpstream(Reply(first_token_s=1.0, tokens=3)), "b": FakeUpstream(Reply())})
    settings = two_source_settings(names=("a",))
    async with polygate.session(settings, transport=router) as s:
        for _ in range(40):
            t0 = trio.current_time()
            r = await s.chat(MESSAGES)
            assert trio.current_time() - t0 == pytest.approx(1.0)
            assert r.call_stats.total_latency_ms == pytest.approx(1000)
        stats = (await s.statistics()).telemetry
        assert stats.queued == 10 and stats.in_flight > 0 and stats.written == 0
        # in_flight > 0: the flusher has handed a batch to its worker thread, which runs
        # on the real clock; give it real time to reach the sink (not a race to win).
        assert stalled.entered.wait(10)
        assert stats.dropped_queue_full == 80 - 10 - stats.in_flight
    warnings = [r for r in caplog.records if "telemetry dropped" in r.getMessage()]
    # one while dropping (the interval is an hour), one summary when the session closed
    assert len(warnings) == 2
    final = (await s.statistics()).telemetry
    assert final.written == 0
    assert final.dropped == 80  # every row is accounted for: none written, all dropped
    assert final.dropped_at_close == 10 + stats.in_flight


async def test_stalled_sink_in_real_time(
    monkeypatch: pytest.MonkeyPatch, stalled: StalledSink
) -> None:
    """Real clock: 200 calls through a stalled sink finish as fast as ever, and leaving
    the session waits the shutdown timeout, not for the sink."""
    _use(monkeypatch, stalled, capacity=16, shutdown_timeout_s=0.3)
    settings = two_source_settings(names=("a",))
    t0 = time.monotonic()
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        for _ in range(200):
            await s.chat(MESSAGES)
        calls_done = time.monotonic()
    closed = time.monotonic()
    assert calls_done - t0 < 10
    assert 0.25 < closed - calls_done < 3
    assert (await s.statistics()).telemetry.dropped == 400


async def test_queued_content_is_bounded_in_characters(
    monkeypatch: pytest.MonkeyPatch, stalled: StalledSink
) -> None:
    """review: the channel was bounded in rows only, so with ``log_content=True`` a
    stalled sink held 10,000 rows of whatever size (1 MB prompts: 10 GB).  Content is
    bounded too: a row whose content would go over is queued without it, saying so
    (it was once dropped whole, the call's figures with it); once the sink writes
    again, content queues again and every row is written."""
    _use(monkeypatch, stalled, capacity=1000, linger_s=0, shutdown_timeout_s=5,
         max_queued_content=3_500_000)
    settings = attrs.evolve(two_source_settings(names=("a",)), log_content=True)
    big = [{"role": "user", "content": "x" * 1_000_000}]
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        pipeline = s._telemetry.pipeline
        for _ in range(10):
            await s.chat(big)
            assert pipeline.counters.queued_content <= 3_500_000
        stats = (await s.statistics()).telemetry
        # at most three contents queued beside the stalled write's rows; every row queued
        assert stats.queued + stats.in_flight == 20
        assert stats.dropped == 0
        assert stats.content_omitted >= 10 - 3 - stats.in_flight
        await trio.to_thread.run_sync(stalled.entered.wait, 5)
        stalled.release.set()
        with trio.fail_after(10):  # the sink's thread works in real time: wait for it
            while stats.queued or stats.in_flight:
                await trio.sleep(0.01)
                stats = (await s.statistics()).telemetry
        assert pipeline.counters.queued_content == 0
        await s.chat(big)
    stats = (await s.statistics()).telemetry
    assert (stats.written, stats.dropped) == (2 * 11, 0)
    omitted = [c for c in stalled.calls if c.content and c.content.startswith('{"omitted')]
    assert len(omitted) == stats.content_omitted
    for row in omitted:
        assert json.loads(row.content or "")["omitted_characters"] > 1_000_000
        assert (row.outcome, row.source) == ("ok", "a")  # the call's figures are kept
    assert stalled.calls[-1].content is not None and len(stalled.calls[-1].content) > 1_000_000
    assert pipeline.counters.queued_content == 0


async def test_a_call_whose_content_alone_is_over_the_bound_keeps_its_row(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Outside review: one call whose content alone was over the bound (a conversation
    of many images as data URIs passes 64 Mi characters) lost its whole row, counted as
    "queue full" with nothing else queued, while its attempt's row was written."""
    captured = ListSink()
    _use(monkeypatch, captured, linger_s=0, max_queued_content=100_000)
    settings = attrs.evolve(two_source_settings(names=("a",)), log_content=True)
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        response = await s.chat([{"role": "user", "content": "x" * 200_000}])
    stats = (await s.statistics()).telemetry
    assert (stats.written, stats.dropped, stats.content_omitted) == (2, 0, 1)
    [row] = captured.calls
    assert (row.logical_call_id, row.outcome) == (response.call_stats.logical_call_id, "ok")
    assert json.loads(row.content or "")["omitted_characters"] > 200_000
    assert "without its content" in caplog.text


async def test_a_row_without_its_content_is_counted_once_written(
    monkeypatch: pytest.MonkeyPatch, stalled: StalledSink
) -> None:
    """Review: with the channel full in rows as well, a row queued without its content
    was counted in ``content_omitted`` and then dropped as queue full: twice, and
    never written."""
    _use(monkeypatch, stalled, capacity=2, linger_s=0, shutdown_timeout_s=5,
         max_queued_content=1_000)
    settings = attrs.evolve(two_source_settings(names=("a",)), log_content=True)
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        for _ in range(6):
            await s.chat([{"role": "user", "content": "x" * 2_000}])
        stalled.release.set()
    stats = (await s.statistics()).telemetry
    markers = [c for c in stalled.calls if c.content and c.content.startswith('{"omitted')]
    assert stats.written + stats.dropped == 12
    assert stats.dropped_queue_full > 0
    assert stats.content_omitted == len(markers) > 0


async def test_a_sink_that_recovers_writes_again(
    monkeypatch: pytest.MonkeyPatch, stalled: StalledSink
) -> None:
    _use(monkeypatch, stalled, capacity=4, linger_s=0, shutdown_timeout_s=5)
    settings = two_source_settings(names=("a",))
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        for _ in range(10):
            await s.chat(MESSAGES)
        await trio.to_thread.run_sync(stalled.entered.wait, 5)
        stalled.release.set()
        for _ in range(3):
            await s.chat(MESSAGES)
    stats = (await s.statistics()).telemetry
    assert stats.dropped_queue_full > 0
    assert stats.written + stats.dropped == 26
    assert len(stalled.calls) + len([b for b in stalled.batches for _ in b.attempts]) == stats.written


# --------------------------------------------------------------------------- accounting


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.integers(1, 12), calls=st.integers(0, 30), fail_every=st.integers(0, 4))
async def test_every_row_is_written_or_dropped(
    monkeypatch: pytest.MonkeyPatch, capacity: int, calls: int, fail_every: int
) -> None:
    """Invariant: rows recorded = written + dropped, whatever the sink does."""
    writes = 0

    class Flaky(ListSink):
        def write(self, batch: Batch) -> None:
            nonlocal writes
            writes += 1
            if fail_every and writes % fail_every == 0:
                raise OSError("flaky")
            super().write(batch)

    sink = Flaky()
    _use(monkeypatch, sink, capacity=capacity, linger_s=0)
    settings_ = two_source_settings(names=("a",))
    async with polygate.session(settings_, transport=Router({"a": FakeUpstream(Reply())})) as s:
        for _ in range(calls):
            await s.chat(MESSAGES)
    stats = (await s.statistics()).telemetry
    assert stats.written + stats.dropped == 2 * calls
    assert sum(len(b) for b in sink.batches) == stats.written
    assert sink.closed


async def test_a_sink_that_fails_to_close_never_replaces_the_sessions_result(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review, suspicious point 3: closing the sink fails (disk full at the final
    checkpoint).  The session's body result stands — its own exception, or a clean
    exit — and the failure is reported in the statistics and the log."""

    class BadClose(ListSink):
        def close(self) -> None:
            raise OSError("disk full")

    _use(monkeypatch, BadClose())
    router = Router({"a": FakeUpstream(Reply()), "b": FakeUpstream(Reply())})
    with pytest.raises(LookupError, match="the body's own"):
        async with polygate.session(two_source_settings(), transport=router) as s:
            await s.chat(MESSAGES)
            raise LookupError("the body's own")
    async with polygate.session(two_source_settings(), transport=router) as s:
        await s.chat(MESSAGES)
    stats = (await s.statistics()).telemetry
    assert stats.written == 2 and stats.last_error is not None and "disk full" in stats.last_error
    assert any("disk full" in r.getMessage() for r in caplog.records)


async def test_a_sink_opened_after_its_bound_gave_up_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a sink whose opening outlived the bound (a PostgreSQL migration waiting
    on a lock) was opened anyway by its abandoned thread, and its connection held for
    the process's life.  The thread closes what it opened too late."""
    from polygate.telemetry import _open

    monkeypatch.setattr(_open, "OPEN_TIMEOUT_S", 0.1)
    release, done = threading.Event(), threading.Event()
    sink = ListSink()

    def slow_open() -> ListSink:
        release.wait(10)  # past the bound: the session has given up on it
        return sink

    def closing() -> None:
        ListSink.close(sink)
        done.set()

    sink.close = closing  # type: ignore[method-assign]
    with pytest.raises(polygate.ConfigError, match=r"took longer than 0\.1 s"):
        await _open._bounded_open("sqlite:///x.db", slow_open)
    release.set()
    assert await trio.to_thread.run_sync(done.wait, 10)
    assert sink.closed


async def test_a_drop_warning_names_the_database_it_was_bound_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Review: "polygate telemetry dropped 598 row(s) …" did not say where: a process
    with several sessions (a server across reloads) could not tell which sink failed."""
    from polygate.telemetry._sqlite import SQLiteSink

    def full(self: SQLiteSink, batch: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(SQLiteSink, "write", full)
    path = tmp_path / "t.db"
    settings = attrs.evolve(two_source_settings(names=("a",)),
                            telemetry=f"sqlite:///{path}")
    async with polygate.session(settings, transport=FakeUpstream(Reply()).transport()) as s:
        await s.chat(MESSAGES)
    [line] = [r.getMessage() for r in caplog.records if "telemetry dropped" in r.getMessage()]
    assert f"dropped 2 row(s) for sqlite:///{path} (" in line, line
