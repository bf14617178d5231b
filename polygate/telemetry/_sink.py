"""The sink protocol and the pipeline that feeds it without ever delaying a call.

::

    call path (sync, in finally blocks)          session nursery            worker thread
    ──────────────────────────────────           ───────────────            ─────────────
    recorder.attempt / recorder.call
      └ send_nowait(event) ──► bounded memory channel ──► flusher task ──► sink.write(batch)
           full / closed: drop + count                     batches of up to
                                                           ``max_batch`` events

* The call path only ever does ``send_nowait``: a full channel (the sink is slow,
  stalled or dead) costs the row, counted in :class:`TelemetryStatistics` and logged
  at most once per ``log_interval_s`` — never the call's time.
* The flusher drains whatever has queued into one batch, so batches grow with load
  and a quiet session writes small ones after a short linger.
* A sink is blocking code run in a worker thread, one call at a time (a
  ``CapacityLimiter(1)``; a thread abandoned on cancellation keeps its token until it
  really ends, so writes never overlap).  A write that exceeds ``write_timeout_s`` is
  abandoned, :meth:`Sink.interrupt` is called (PostgreSQL cancels the query
  server-side) and its rows count as dropped; so does a write that raises.
* Closing flushes what is queued, shielded and bounded by ``shutdown_timeout_s``;
  what cannot be written in that time is counted as dropped at close.

The bounds around sink work are measured in **real** time (a ``threading.Timer``
cancels a trio cancel scope): the sink works in real time, and under trio's
``MockClock`` a virtual-time bound would expire the moment the loop idles waiting for
the worker thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Protocol

import attrs
import trio

from .._errors import redact
from .._threads import NoThread, mock_clock, no_thread, run_sync
from ._events import AttemptEvent, CallEvent, Event, SessionEvent

__all__ = [
    "MAX_QUEUED_CONTENT", "Batch", "Pipeline", "Sink", "TelemetryStatistics", "real_time_bound",
]

logger = logging.getLogger("polygate.telemetry")

#: The most characters of ``log_content`` text queued at once.  The channel is bounded
#: in rows; with prompts of megabytes a stalled sink would hold gigabytes in 10,000
#: rows.  A row whose content would go over is queued without it (see
#: ``TelemetryRecorder.call``): the call's figures are kept, its text is not.
MAX_QUEUED_CONTENT = 64 * 2**20


@attrs.frozen
class Batch:
    """What one :meth:`Sink.write` receives: calls, attempts, and at times the
    session's running totals."""

    calls: Sequence[CallEvent] = ()
    attempts: Sequence[AttemptEvent] = ()
    session: SessionEvent | None = None

    def __len__(self) -> int:
        return len(self.calls) + len(self.attempts)


class Sink(Protocol):
    """Where telemetry rows go.  Every method is *blocking* and runs in a worker
    thread, never two at once; they may raise (the batch is dropped and counted).

    ``interrupt`` is the exception: it is called from the trio thread when a write has
    been abandoned (too slow, or the session is closing) and must return at once — a
    sink that can cancel its work server-side starts that here, in the background.
    """

    name: str

    def write(self, batch: Batch) -> None: ...

    def interrupt(self) -> None: ...

    def close(self) -> None: ...


@attrs.frozen
class TelemetryStatistics:
    """Where a session's telemetry stands; ``Session.statistics().telemetry``.

    ``dropped`` is the sum of the three reasons a row is lost: the channel was full
    (``dropped_queue_full``: the sink could not keep up), the sink failed or timed out
    writing it (``dropped_sink_error``), or it was still queued when the session's
    shutdown timeout ran out, or recorded after the session closed
    (``dropped_at_close``).  ``content_omitted``: call rows written without their
    ``log_content`` text, which did not fit in what may be queued at once.
    """

    sink: str = "off"
    capacity: int = 0
    queued: int = 0
    in_flight: int = 0
    written: int = 0
    dropped_queue_full: int = 0
    dropped_sink_error: int = 0
    dropped_at_close: int = 0
    write_errors: int = 0
    recorder_errors: int = 0
    last_error: str | None = None
    content_omitted: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_sink_error + self.dropped_at_close


#: The statistics of a session without telemetry.
OFF = TelemetryStatistics()


class Counters:
    """Mutable tallies shared by the recorder (call path) and the flusher; touched
    only from the trio thread.  Dropping logs at most once per ``log_interval_s``
    (real time), with what was dropped since the last message."""

    __slots__ = (
        "_failing_since",
        "_logged_dropped",
        "_next_log",
        "_next_omitted_log",
        "content_omitted",
        "dropped_at_close",
        "dropped_queue_full",
        "dropped_sink_error",
        "last_error",
        "log_interval_s",
        "max_queued_content",
        "queued_content",
        "recorder_errors",
        "secrets",
        "where",
        "write_errors",
        "written",
    )

    def __init__(
        self, log_interval_s: float = 60.0, secrets: tuple[str, ...] = (),
        max_queued_content: int = MAX_QUEUED_CONTENT, where: str = "its sink",
    ) -> None:
        # What the warnings name: the sink's URL, masked (a process may write to several).
        self.where = where
        # Characters of content in rows queued in the channel (MAX_QUEUED_CONTENT):
        # added by the recorder as it queues a row, taken off as the flusher takes it.
        self.queued_content = 0
        self.max_queued_content = max_queued_content
        self.written = 0
        self.dropped_queue_full = 0
        self.dropped_sink_error = 0
        self.dropped_at_close = 0
        self.write_errors = 0
        self.recorder_errors = 0
        self.last_error: str | None = None
        self.log_interval_s = log_interval_s
        self.secrets = secrets
        self._next_log = -math.inf
        self._logged_dropped = 0
        #: dropped_sink_error when writes began to fail (None: the last write worked).
        self._failing_since: int | None = None
        self.content_omitted = 0
        self._next_omitted_log = -math.inf

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_sink_error + self.dropped_at_close

    def drop_full(self) -> None:
        self.dropped_queue_full += 1
        self.maybe_log()

    def omit_content(self, size: int) -> None:
        self.content_omitted += 1
        now = time.monotonic()
        if now >= self._next_omitted_log:
            self._next_omitted_log = now + self.log_interval_s
            logger.warning(
                "polygate telemetry wrote a call row to %s without its content (%d "
                "characters; %d rows so far): at most %d characters of content are queued "
                "at once", self.where, size, self.content_omitted, self.max_queued_content,
            )

    def drop_closed(self, n: int = 1) -> None:
        self.dropped_at_close += n
        self.maybe_log()

    def wrote(self, rows: int) -> None:
        """``rows`` written; after failed writes, said once (the log's last word on the
        sink was that it dropped rows)."""
        self.written += rows
        if self._failing_since is not None:  # (a batch of the sessions row alone, too)
            lost = self.dropped_sink_error - self._failing_since
            self._failing_since = None
            self.maybe_log(force=True)  # (drops not yet said go first: the last word is this)
            logger.info("polygate telemetry writes to %s again (%d row(s) dropped while it "
                        "failed)", self.where, lost)

    def write_failed(self, rows: int, error: BaseException | str) -> None:
        if self._failing_since is None:
            self._failing_since = self.dropped_sink_error
        self.dropped_sink_error += rows
        self.write_errors += 1
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.last_error = redact(text, self.secrets)[:500]
        self.maybe_log()

    def close_failed(self, error: BaseException) -> None:
        self.write_errors += 1
        self.last_error = redact(f"closing the sink: {type(error).__name__}: {error}", self.secrets)[:500]
        logger.warning("polygate telemetry (%s): %s", self.where, self.last_error)

    def maybe_log(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_log:
            return
        new = self.dropped - self._logged_dropped
        if new <= 0:
            return
        self._next_log = now + self.log_interval_s
        self._logged_dropped = self.dropped
        logger.warning(
            "polygate telemetry dropped %d row(s) for %s (%d in all: %d queue full, %d sink "
            "errors, %d at close)%s", new, self.where, self.dropped, self.dropped_queue_full,
            self.dropped_sink_error, self.dropped_at_close,
            f"; last sink error: {self.last_error}" if self.last_error else "",
        )


@contextmanager
def real_time_bound(seconds: float, *, shield: bool = False) -> Iterator[trio.CancelScope]:
    """``trio.move_on_after`` in wall-clock time: a timer thread cancels the scope.

    Used around work done by a worker thread or a database, which runs in real time
    whatever clock trio uses.
    """
    scope = trio.CancelScope(shield=shield)
    if seconds >= threading.TIMEOUT_MAX:  # ~292 years: a timer thread cannot wait that long
        with scope:
            yield scope
        return
    token = trio.lowlevel.current_trio_token()

    def fire() -> None:
        try:
            token.run_sync_soon(scope.cancel)
        except trio.RunFinishedError:
            pass

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError as exc:
        if not no_thread(exc):
            raise
        # The process's thread limit: trio's clock bounds it instead, real time but
        # under a MockClock (where what needs a thread fails at once anyway).  Raised,
        # telemetry failed the session it must never fail, at its start and its end.
        if mock_clock() is None:
            scope.deadline = trio.current_time() + seconds
    try:
        with scope:
            yield scope
    finally:
        timer.cancel()  # (one never started: nothing to stop)


class _GovernanceLike(Protocol):
    async def statistics(self) -> _HasSuppressed: ...


class _HasSuppressed(Protocol):
    @property
    def hedges_suppressed_by_budget(self) -> Mapping[str, int]: ...


class Pipeline:
    """The bounded channel, the flusher task and the sink of one session."""

    def __init__(
        self,
        sink: Sink,
        *,
        session_id: str,
        version: str = "",
        capacity: int = 10_000,
        max_batch: int = 5_000,
        linger_s: float = 0.05,
        write_timeout_s: float = 30.0,
        shutdown_timeout_s: float = 5.0,
        summary_interval_s: float = 10.0,
        log_interval_s: float = 60.0,
        secrets: tuple[str, ...] = (),
        max_queued_content: int = MAX_QUEUED_CONTENT,
        where: str = "its sink",
    ) -> None:
        self.sink = sink
        self.session_id = session_id
        self.version = version
        self.capacity = capacity
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.write_timeout_s = write_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.summary_interval_s = summary_interval_s
        self.counters = Counters(log_interval_s, secrets, max_queued_content, where)
        self.send, self._receive = trio.open_memory_channel[Event](capacity)
        self._limiter = trio.CapacityLimiter(1)
        self._started_at = time.time()
        self._in_flight = 0
        self._flusher_scope = trio.CancelScope()
        self._stopped = trio.Event()
        self._running = False
        self._closing = trio.Event()  # set by aclose; it also ends the flusher's linger
        self._governance: _GovernanceLike | None = None
        self._gathered: list[Event] = []  # taken off the channel, not yet written
        self._next_summary = 0.0
        # A write the flusher was cancelled out of (the session left by cancellation):
        # its thread goes on and may commit, so it is settled by aclose once the
        # thread is done -- (its outcome, filled by the thread if it ran; its events).
        self._abandoned: tuple[list[BaseException | None], list[Event]] | None = None

    # ------------------------------------------------------------------ flusher

    async def run(self, governance: _GovernanceLike | None = None) -> None:
        """The flusher: runs in the session's nursery until the channel is closed and
        drained (or it is cancelled)."""
        if self._closing.is_set():  # closed before the flusher ever ran: aclose wrote the queue
            return
        self._governance = governance
        self._running = True
        self._next_summary = trio.current_time()  # a first sessions row with the first batch
        # Rows written since the last sessions row (its counts are behind them): a
        # session that then goes quiet still gets its row brought up to date once the
        # interval is over -- rows dropped in a burst, hedges the budget suppressed --
        # rather than days later, when it closes.
        behind = False
        try:
            with self._flusher_scope:
                while True:
                    batch = await self._next_batch(self._next_summary if behind else None)
                    if batch is None:
                        return
                    summary = None
                    if trio.current_time() >= self._next_summary:
                        self._next_summary = trio.current_time() + self.summary_interval_s
                        summary = await self._summary(ended=False)
                    # Behind: a batch without the summary, or one that did not land
                    # (its rows dropped, the row in the database not updated).
                    behind = not await self._write(batch, summary) or summary is None
        finally:
            self._running = False
            self._stopped.set()

    async def _next_batch(self, until: float | None = None) -> list[Event] | None:
        """The next batch; ``None`` once the channel is closed and drained; empty when
        ``until`` (trio time) comes first."""
        try:
            if until is None:
                first = await self._receive.receive()
            else:
                with trio.move_on_at(until) as waited:
                    first = await self._receive.receive()
                if waited.cancelled_caught:
                    return []
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        # The batch being gathered lives on self, not in a local: a flusher cancelled
        # while it lingers (the session left by cancellation) leaves it for aclose(),
        # which writes it or counts it — a row is never lost uncounted.
        events = self._gathered = [first]
        self._dequeued(events)  # (now: a flusher cancelled while it lingers counts it too)
        buffered = self._receive.statistics().current_buffer_used
        if self.linger_s > 0 and buffered < self.max_batch // 2 and not self._closing.is_set():
            # Let a quiet session's rows gather -- until the close, which writes them
            # at once (a session opened per request paid the whole linger to leave).
            with trio.move_on_after(self.linger_s):
                await self._closing.wait()
        receive_nowait = self._receive.receive_nowait
        while len(events) < self.max_batch:
            try:
                events.append(receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._dequeued(events[1:])
        return events

    def _dequeued(self, events: Sequence[Event]) -> None:
        """Events have left the channel: their content no longer counts as queued."""
        counters = self.counters
        if counters.queued_content:
            counters.queued_content -= sum(
                len(e.content) for e in events if type(e) is CallEvent and e.content
            )

    async def _write(self, events: Sequence[Event], summary: SessionEvent | None) -> bool:
        """Write a batch; whether it landed (nothing to write lands too)."""
        batch = _split(events, summary)
        if not len(batch) and summary is None:
            return True
        # Whoever accounts for the batch (this write, or aclose giving up on it) takes
        # the in-flight count, so a row is never both written and dropped.
        self._in_flight = len(batch)
        self._gathered = []
        if summary is not None:
            # The rows and the summary commit in one transaction: it counts them.
            summary = summary._replace(rows_written=summary.rows_written + len(batch))
            batch = Batch(batch.calls, batch.attempts, summary)
        outcome: list[BaseException | None] = []

        def write() -> None:
            try:
                self.sink.write(batch)
            except BaseException as exc:
                outcome.append(exc)
                raise
            outcome.append(None)

        try:
            with real_time_bound(self.write_timeout_s) as bound:
                await run_sync(
                    write, abandon_on_cancel=True, limiter=self._limiter,
                    background=True,  # a stuck sink must not freeze virtual time
                )
        except trio.Cancelled:
            # Left by cancellation: the thread may still commit (or may never have
            # started); aclose settles it.
            if self._take_in_flight():
                self._abandoned = (outcome, list(events))
            raise
        except Exception as exc:
            self.counters.write_failed(self._take_in_flight(), exc)
            return False
        if bound.cancelled_caught:
            self._interrupt()
            self.counters.write_failed(
                self._take_in_flight(), f"write took longer than {self.write_timeout_s} s"
            )
            return False
        self.counters.wrote(self._take_in_flight())
        return True

    async def _settle_abandoned(self) -> None:
        """Wait for the write the flusher was cancelled out of (its thread holds the
        limiter until it ends), then count its rows by what it did."""
        if self._abandoned is None:
            return
        await run_sync(_nothing, limiter=self._limiter, abandon_on_cancel=True, background=True)
        (outcome, events), self._abandoned = self._abandoned, None
        if not outcome:  # cancelled before its thread started: written with the rest
            self._gathered = [*events, *self._gathered]
        elif outcome[0] is None:
            self.counters.wrote(len(_split(events, None)))
        else:
            self.counters.write_failed(len(_split(events, None)), outcome[0])

    def _take_in_flight(self) -> int:
        n, self._in_flight = self._in_flight, 0
        return n

    def _interrupt(self) -> None:
        try:
            self.sink.interrupt()
        except Exception as exc:  # a sink's bug must not end the flusher
            logger.debug("telemetry sink interrupt failed: %r", exc)

    async def _summary(self, *, ended: bool) -> SessionEvent:
        suppressed: Mapping[str, int] = {}
        if self._governance is not None:
            try:
                with trio.move_on_after(2.0):  # a shared backend may be slow to answer
                    stats = await self._governance.statistics()
                    suppressed = stats.hedges_suppressed_by_budget
            except Exception:  # governance trouble is reported by the calls themselves
                suppressed = {}
        now = time.time()
        c = self.counters
        return SessionEvent(
            session_id=self.session_id,
            started_at=self._started_at,
            updated_at=now,
            ended_at=now if ended else None,
            pid=os.getpid(),
            polygate_version=self.version,
            # (_write adds the rows written with it: they commit together)
            rows_written=c.written,
            rows_dropped=c.dropped,
            hedges_suppressed=json.dumps(dict(suppressed), sort_keys=True),
        )

    # ------------------------------------------------------------------ closing

    async def aclose(self) -> None:
        """Flush what is queued and close the sink, bounded by ``shutdown_timeout_s``
        of real time and shielded (a session left by cancellation still flushes)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.send.close()
        with real_time_bound(self.shutdown_timeout_s, shield=True) as bound:
            if self._running:
                await self._stopped.wait()  # the flusher drains the channel, then stops
            await self._settle_abandoned()
            leftovers = [*self._gathered, *self._drain()]
            self._gathered = leftovers
            summary = await self._summary(ended=True)
            await self._write(leftovers, summary)
            try:
                try:
                    await run_sync(
                        self.sink.close, abandon_on_cancel=True, limiter=self._limiter,
                        background=True,
                    )
                except NoThread:
                    # Out of threads (the process's limit): closed here, on the loop, as
                    # the cache does.  Left open, a database waited for the cyclic
                    # collector (Python 3.13 warns then, in whatever runs), unflushed.
                    self.sink.close()
            except Exception as exc:
                # Telemetry never fails the session: a close that fails (disk full at
                # the checkpoint) is reported, and the session's own result stands.
                self.counters.close_failed(exc)
        if bound.cancelled_caught:
            self._flusher_scope.cancel()
            self._interrupt()
            gathered, self._gathered = self._gathered, []
            abandoned, self._abandoned = self._abandoned, None
            self.counters.drop_closed(
                self._take_in_flight() + len(gathered) + len(self._drain())
                + (len(_split(abandoned[1], None)) if abandoned is not None else 0)
            )
            _close_in_background(self.sink)
        self._receive.close()
        self.counters.maybe_log(force=True)

    def _drain(self) -> list[Event]:
        out: list[Event] = []
        while True:
            try:
                out.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                self._dequeued(out)
                return out

    def statistics(self) -> TelemetryStatistics:
        c = self.counters
        queued = 0 if self._closing.is_set() else self._receive.statistics().current_buffer_used
        return TelemetryStatistics(
            sink=self.sink.name,
            capacity=self.capacity,
            queued=queued,
            in_flight=self._in_flight,
            written=c.written,
            dropped_queue_full=c.dropped_queue_full,
            dropped_sink_error=c.dropped_sink_error,
            dropped_at_close=c.dropped_at_close,
            write_errors=c.write_errors,
            recorder_errors=c.recorder_errors,
            last_error=c.last_error,
            content_omitted=c.content_omitted,
        )


def _nothing() -> None:
    return None


def _split(events: Sequence[Event], summary: SessionEvent | None) -> Batch:
    calls = [e for e in events if type(e) is CallEvent]
    attempts = [e for e in events if type(e) is AttemptEvent]
    return Batch(calls, attempts, summary)


def _close_in_background(sink: Sink) -> None:
    """A stuck sink is closed by a daemon thread, whenever its stuck write lets go."""

    def close() -> None:
        try:
            sink.close()
        except Exception as exc:
            logger.debug("telemetry sink close failed: %r", exc)

    try:
        threading.Thread(target=close, name="polygate-telemetry-close", daemon=True).start()
    except RuntimeError as exc:
        if not no_thread(exc):
            raise
        logger.debug("telemetry sink left to the garbage collector: %r", exc)

