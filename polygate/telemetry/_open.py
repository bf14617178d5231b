"""A session's telemetry: the sink its settings name, the pipeline, the recorders.

``polygate.session()`` does three things with it::

    async with open_telemetry(settings) as telemetry:      # ConfigError: bad URL,
        async with trio.open_nursery() as nursery:         #   unreachable, newer schema
            runtime = Runtime(..., recorder=telemetry.recorder)
            telemetry.start(nursery, governor)              # the flusher
            ...
            await telemetry.aclose()                        # flush, bounded; then cancel

Opening validates and connects *at session start* — a sink that cannot work is a
configuration error there, not a stream of dropped rows later.  OpenTelemetry spans
are added when ``opentelemetry`` is installed and the application has set a tracer
provider (or one is passed in).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from .._config import Settings, mask_url
from .._context import AttemptRecord, CallContext, NullRecorder, Recorder, TraceHeaders
from .._errors import ConfigError
from .._secrets import frameless
from .._threads import NoThread, run_sync
from .._types import CallStats, Usage
from ._recorder import TelemetryRecorder
from ._sink import OFF, Pipeline, Sink, TelemetryStatistics, _GovernanceLike, real_time_bound

if TYPE_CHECKING:  # (imported only when opentelemetry is: see _otel_recorder)
    from ._otel import OtelRecorder

__all__ = ["Telemetry", "check_sink", "open_sink", "open_telemetry"]

logger = logging.getLogger("polygate.telemetry")

#: Real seconds a sink may take to open (connect, create or migrate the schema).
OPEN_TIMEOUT_S = 15.0
#: PostgreSQL's largest statement_timeout (an int of milliseconds).
_PG_MAX_TIMEOUT_MS = 2**31 - 1


class Telemetry:
    """What one session owns: a pipeline to a sink (or none), and the recorder the
    calls report to."""

    def __init__(
        self, pipeline: Pipeline | None, *recorders: Recorder,
        trace_headers: TraceHeaders | None = None,
    ) -> None:
        self.pipeline = pipeline
        #: The OpenTelemetry recorder's, when one of the recorders makes spans.
        self.trace_headers = trace_headers
        self.recorder: Recorder = (
            NullRecorder() if not recorders
            else recorders[0] if len(recorders) == 1
            else _Both(recorders[0], recorders[1])
        )

    def start(self, nursery: trio.Nursery, governance: _GovernanceLike | None = None) -> None:
        """Start the flusher in the session's nursery."""
        if self.pipeline is not None:
            nursery.start_soon(self.pipeline.run, governance, name="polygate telemetry flusher")

    async def aclose(self) -> None:
        """Flush and close (bounded, shielded); safe to call twice."""
        if self.pipeline is not None:
            await self.pipeline.aclose()

    def statistics(self) -> TelemetryStatistics:
        return self.pipeline.statistics() if self.pipeline is not None else OFF


class _Both:
    """Two recorders (the pipeline's and OpenTelemetry's); neither can stop the other."""

    __slots__ = ("_a", "_b")

    def __init__(self, a: Recorder, b: Recorder) -> None:
        self._a, self._b = a, b

    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None:
        self._a.attempt(ctx, record)
        self._b.attempt(ctx, record)

    def call(
        self,
        ctx: CallContext,
        stats: CallStats,
        usage: Usage | None,
        error: BaseException | None,
        output: Mapping[str, Any] | None = None,
    ) -> None:
        self._a.call(ctx, stats, usage, error, output)
        self._b.call(ctx, stats, usage, error, output)


def check_sink(url: str) -> str:
    """What can be known of a ``telemetry`` setting without opening it: its kind
    (``"off"``, ``"sqlite"`` or ``"postgresql"``), and that the driver it needs is
    installed.  :func:`open_sink` starts with it, and ``polygate check-config`` runs
    it alone, so the two cannot disagree."""
    if url == "off":
        return "off"
    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if scheme == "sqlite":
        return "sqlite"
    if scheme in ("postgresql", "postgres"):
        from ._postgres import _psycopg

        _psycopg()
        return "postgresql"
    raise ConfigError(
        f"telemetry: unknown sink {mask_url(url)!r}; use 'off', sqlite:///path or postgresql://…"
    )


async def open_sink(url: str, *, write_timeout_s: float = 30.0) -> Sink | None:
    """The sink a ``telemetry`` setting names, opened (``None`` for ``"off"``).
    ``write_timeout_s`` (``telemetry_write_timeout_s``) raises PostgreSQL's
    ``statement_timeout`` above its 30 s, so that a write allowed longer can take it.

    Opening runs in a worker thread, bounded by :data:`OPEN_TIMEOUT_S` of real time;
    every failure is a :class:`ConfigError` whose message shows the URL masked.
    """
    handled = sys.exc_info()[1]  # the caller's, if it opens from an except block
    try:
        return await _open_sink(url, write_timeout_s)
    except BaseException as exc:
        # Raised from here, without the URL: the frames that opened it hold it whole,
        # with its password (see frameless), a cancellation's too.
        del url
        raise frameless(exc, handled=handled)  # noqa: B904 (the same error, not a new one)


async def _open_sink(url: str, write_timeout_s: float) -> Sink | None:
    kind = check_sink(url)
    if kind == "off":
        return None
    if kind == "sqlite":
        from ._sqlite import SQLiteSink, sqlite_path

        path = sqlite_path(url)
        return await _bounded_open(url, lambda: SQLiteSink.open(path))
    from ._postgres import PostgresSink

    connected = threading.Event()
    # Never below 30 s (a migration at open runs under it too): a shorter write
    # timeout is the pipeline's own bound, which cancels the query on the server.
    statement_timeout_ms = int(min(max(30.0, write_timeout_s) * 1000, _PG_MAX_TIMEOUT_MS))

    def still_connecting() -> Sink | None:
        # A server that has not answered within the bound (libpq gives each host of a
        # multi-host URL, and each address of a name, its own connect_timeout) is a
        # server that does not answer: the session starts, as when the connect fails.
        # A slow schema migration on a server that answered stays an error.
        if connected.is_set():
            return None
        logger.warning(
            "telemetry database %s did not answer within %s s: calls go on, rows are "
            "dropped and counted until it answers", mask_url(url), OPEN_TIMEOUT_S,
        )
        return PostgresSink.unconnected(url, statement_timeout_ms=statement_timeout_ms, failed=(
            time.monotonic(), f"no answer within {OPEN_TIMEOUT_S} s"))

    return await _bounded_open(
        url,
        lambda: PostgresSink.open(url, connected=connected, statement_timeout_ms=statement_timeout_ms),
        on_timeout=still_connecting,
    )


async def _bounded_open(
    url: str, opener: Any, *, on_timeout: Callable[[], Sink | None] | None = None,
) -> Sink:
    """``opener()`` in a worker thread, bounded.  A thread that opens its sink after
    the bound gave up on it closes that sink itself: abandoned, it would hold a
    database connection (and a PostgreSQL session) for the process's life.  When
    the bound falls, ``on_timeout`` may give the sink to use instead."""
    lock = threading.Lock()
    given_up = False
    opened: list[Sink] = []  # the thread's sink, for the bound to find (see below)

    def open_or_close() -> Sink:
        sink: Sink = opener()
        with lock:
            if not given_up:
                opened.append(sink)
                return sink
        sink.close()  # nobody will: the session went on (or failed) without it
        return sink

    sink: Sink | None = None
    try:
        with real_time_bound(OPEN_TIMEOUT_S):
            try:
                sink = await run_sync(open_or_close, abandon_on_cancel=True)
            except NoThread as exc:
                raise ConfigError(f"telemetry: cannot open {mask_url(url)}: {exc}") from None
    finally:
        if sink is None:  # the bound fell, or the session's opening was cancelled
            with lock:
                given_up = True
                # Opened in the instant the wait ended (its result on its way, dropped
                # with the wait): taken rather than leaked -- or, when the opening is
                # cancelled, closed.
                sink = opened[0] if opened else None
            if sink is not None and sys.exc_info()[1] is not None:
                sink.close()
                sink = None
    if sink is None and on_timeout is not None:
        sink = on_timeout()
    if sink is None:
        raise ConfigError(
            f"telemetry: opening {mask_url(url)} took longer than {OPEN_TIMEOUT_S} s"
        )
    return sink


def _otel_recorder(settings: Settings, tracer_provider: Any) -> OtelRecorder | None:
    if tracer_provider is None and "opentelemetry.trace" not in sys.modules:
        # An application that never imported OpenTelemetry has set no provider: skip
        # the import (tens of milliseconds) at every session start.
        return None
    try:
        from ._otel import OtelRecorder, tracer_if_configured
    except ImportError:
        if tracer_provider is not None:
            raise ConfigError(
                "OpenTelemetry tracing needs opentelemetry-sdk: pip install 'opentelemetry-sdk>=1.20' "
                "(polygate's otel extra)"
            ) from None
        return None
    tracer = tracer_if_configured(tracer_provider)
    if tracer is None:
        return None
    return OtelRecorder(tracer, log_content=settings.log_content, secrets=settings.secrets())


@asynccontextmanager
async def open_telemetry(
    settings: Settings,
    *,
    sink: Sink | None = None,
    tracer_provider: Any = None,
    **pipeline_options: Any,
) -> AsyncIterator[Telemetry]:
    """Open the telemetry ``settings.telemetry`` names (or ``sink``, which replaces
    it); closes it (flushing, bounded) on exit.  ``pipeline_options`` tune
    :class:`Pipeline` (capacity, batch size, timeouts)."""
    where = type(sink).__name__ if sink is not None else mask_url(settings.telemetry)
    if sink is None:
        sink = await open_sink(settings.telemetry, write_timeout_s=settings.telemetry_write_timeout_s)
    try:
        pipeline = None
        recorders: list[Recorder] = []
        if sink is not None:
            from .. import __version__

            session_id = os.urandom(8).hex()
            secrets = settings.secrets()
            options = {
                "capacity": settings.telemetry_queue,
                "max_batch": settings.telemetry_batch,
                "write_timeout_s": settings.telemetry_write_timeout_s,
                "shutdown_timeout_s": settings.telemetry_close_timeout_s,
                **pipeline_options,
            }
            pipeline = Pipeline(
                sink, session_id=session_id, version=__version__, secrets=secrets,
                where=where, **options,
            )
            recorders.append(TelemetryRecorder(
                pipeline.send, pipeline.counters, session_id=session_id,
                log_content=settings.log_content, secrets=secrets,
            ))
        otel = _otel_recorder(settings, tracer_provider)
        if otel is not None:
            recorders.append(otel)
        telemetry = Telemetry(
            pipeline, *recorders, trace_headers=otel.trace_headers if otel is not None else None
        )
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    try:
        yield telemetry
    finally:
        await telemetry.aclose()
