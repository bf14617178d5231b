"""Behaviour of the telemetry pipeline no other test pinned, found by mutating it:
each test fails on the mutation its docstring names (every row written or counted,
the queued-content bound)."""
from __future__ import annotations

import functools
from typing import Any

import pytest

import polygate
import polygate._session
from polygate.telemetry import Batch, open_telemetry
from polygate.testing import FakeUpstream, Reply, Router
from tests._serve_kit import wait_for

SECRET = "sk-test-SECRET-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "hello there"}]


class ListSink:
    name = "list"

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def write(self, batch: Batch) -> None:
        self.batches.append(batch)

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def calls(self) -> list[Any]:
        return [c for b in self.batches for c in b.calls]


def _settings() -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)])},
        log_content=True,
    )


async def _content_of_one_call(monkeypatch: pytest.MonkeyPatch, bound: int) -> tuple[Any, Any]:
    sink = ListSink()
    monkeypatch.setattr(polygate._session, "open_telemetry", functools.partial(
        open_telemetry, sink=sink, linger_s=0, max_queued_content=bound))
    async with polygate.session(_settings(), transport=Router({"a": FakeUpstream(Reply(text="hi"))})) as s:
        await s.chat(MESSAGES)
    stats = (await s.statistics()).telemetry
    [row] = sink.calls
    return row, stats


async def test_content_exactly_at_the_bound_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation (``queued_content + size > max`` -> ``>=``): a call whose content is exactly
    max_queued_content characters fits ("at most N characters of content are queued at
    once"); the mutant wrote it without its content."""
    row, _ = await _content_of_one_call(monkeypatch, 10_000_000)
    size = len(row.content)
    row, stats = await _content_of_one_call(monkeypatch, size)
    assert stats.content_omitted == 0
    assert len(row.content) == size and not row.content.startswith('{"omitted')
    row, stats = await _content_of_one_call(monkeypatch, size - 1)
    assert stats.content_omitted == 1 and row.content.startswith('{"omitted')


def _row(i: int, content: str | None) -> Any:
    from polygate.telemetry import CallEvent
    return CallEvent(
        "s", f"c{i}", "chat", "chat", 0, 0.0, "ok", None, None, 1.0, 1.0, None, None, None,
        None, 1, 0, 0, "a", 0, None, None, None, content,
    )


async def test_content_taken_off_the_queue_once(autojump_clock: Any) -> None:
    """Mutation (``self._dequeued(events[1:])`` -> ``self._dequeued(events)``): a batch of
    three call rows with content, queued as the recorder queues them; once the flusher
    has taken them, the characters counted as queued are back to 0 -- the mutant took
    the first row's content off twice (-100), loosening the MAX_QUEUED_CONTENT bound
    for the rest of the session."""
    import trio

    from polygate.telemetry import Pipeline

    sink = ListSink()
    pipeline = Pipeline(sink, session_id="s", linger_s=0)
    for i in range(3):
        pipeline.send.send_nowait(_row(i, "x" * 100))
        pipeline.counters.queued_content += 100
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        await wait_for(lambda: bool(sink.calls), 10)
        assert [len(b.calls) for b in sink.batches] == [3]
        assert pipeline.counters.queued_content == 0
        await pipeline.aclose()
    assert pipeline.counters.queued_content == 0


async def test_rows_gathered_when_the_shutdown_bound_ends_are_counted() -> None:
    """Mutation (``drop_closed(in_flight + len(gathered) + len(drain))`` without
    ``len(gathered)``): the flusher has taken a batch and waits for the governance
    figures of the sessions row (a slow shared backend) when the session closes; the
    shutdown bound (0.2 s, real time) ends first.  Every row is written or counted as
    dropped: 3 rows, 3 dropped at close -- the mutant lost them uncounted."""
    import trio

    from polygate.telemetry import Pipeline

    class SlowGovernance:
        async def statistics(self) -> Any:
            await trio.sleep_forever()

    sink = ListSink()
    pipeline = Pipeline(sink, session_id="s", linger_s=0, shutdown_timeout_s=0.2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run, SlowGovernance())
        for i in range(3):
            pipeline.send.send_nowait(_row(i, None))
        # The flusher takes them, then waits for the governance.
        await wait_for(lambda: not pipeline.statistics().queued, 10)
        await pipeline.aclose()
    stats = pipeline.statistics()
    assert sink.calls == []
    assert (stats.written, stats.dropped_at_close, stats.dropped) == (0, 3, 3)


async def test_a_write_cancelled_before_its_thread_started_is_written_at_close() -> None:
    """Mutation (in ``_settle_abandoned``, ``self._gathered = [*events, *self._gathered]`` ->
    ``pass``): the first write stalls past write_timeout_s (its row dropped, its thread
    still holding the sink); the next batch's write waits for the sink when the flusher
    is cancelled (the session left by cancellation).  At close, once the stuck thread
    ends, those rows are written: every row is written or counted -- the mutant lost
    the two rows uncounted."""
    import threading

    import trio

    from polygate.telemetry import Pipeline

    class StallOnce(ListSink):
        def __init__(self) -> None:
            super().__init__()
            self.entered = threading.Event()
            self.release = threading.Event()

        def write(self, batch: Batch) -> None:
            if not self.entered.is_set():
                self.entered.set()
                self.release.wait(30)
                return
            super().write(batch)

    sink = StallOnce()
    pipeline = Pipeline(sink, session_id="s", linger_s=0, write_timeout_s=0.2, shutdown_timeout_s=10)
    cancel = trio.CancelScope()

    async def flusher() -> None:
        with cancel:
            await pipeline.run()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flusher)
            pipeline.send.send_nowait(_row(0, None))
            # The stuck write timed out; then the next two wait for the stuck thread.
            await wait_for(lambda: pipeline.statistics().dropped_sink_error >= 1, 10)
            pipeline.send.send_nowait(_row(1, None))
            pipeline.send.send_nowait(_row(2, None))
            await wait_for(lambda: pipeline.statistics().in_flight >= 2, 10)
            cancel.cancel()
            sink.release.set()
            await pipeline.aclose()
    finally:
        sink.release.set()
    stats = pipeline.statistics()
    assert [c.logical_call_id for c in sink.calls] == ["c1", "c2"]
    assert (stats.written, stats.dropped_sink_error, stats.dropped) == (2, 1, 1)
