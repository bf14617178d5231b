"""Every call the server starts is counted once in ``polygate_serve_calls_total``.

A call that ends with an answer or an error is counted where its answer is written.
One whose client left (499) or that a drain cut (503 ``shutting_down``) ends as a
cancellation, which carries no statistics -- yet its attempts reached the upstreams
and the session's own counters have them.  So the server taps the session's
recorder: the call row the library writes for every call, however it ends (its
frozen statistics), is kept for the request that started that call, and the request
counts it on its way out if nothing did before.
"""

from __future__ import annotations

import contextvars
from typing import Any

from .._context import CallContext, Recorder
from .._session import Session
from .._types import CallStats
from ._metrics import Metrics

__all__ = ["CallMeter", "tap"]


class CallMeter:
    """One request's call: counted exactly once."""

    __slots__ = ("call_id", "counted", "scope", "sent", "stats")

    def __init__(self, scope: str, call_id: str) -> None:
        self.scope = scope
        self.call_id = call_id
        self.stats: CallStats | None = None  # the library's call row, once written
        self.counted = False
        #: Whether any attempt of the call sent its request: what a gateway key is
        #: charged by (an attempt cancelled or refused before its request left is
        #: voided on its source's ledger, and the key's follows it).
        self.sent = False

    def count(self, metrics: Metrics, stats: CallStats | None, result: str) -> None:
        if not self.counted:
            self.counted = True
            metrics.call(self.scope, stats, result)

    def count_leftover(self, metrics: Metrics, result: str) -> None:
        """Count a call that ended without an answer written (a cancellation)."""
        self.count(metrics, self.stats, result)


#: The meter of the request whose task (or a task it started) is running a call.
CURRENT: contextvars.ContextVar[CallMeter | None] = contextvars.ContextVar(
    "polygate_serve_meter", default=None
)


class _Tap:
    """The session's recorder, and the call row's statistics (and whether a request
    left) for the request's meter."""

    def __init__(self, inner: Recorder) -> None:
        self.inner = inner

    def attempt(self, ctx: CallContext, record: Any) -> None:
        self.inner.attempt(ctx, record)
        if record.timeline.sent_at is not None:
            meter = CURRENT.get()
            if meter is not None and ctx.logical_call_id == meter.call_id:
                meter.sent = True

    def call(self, ctx: CallContext, stats: CallStats, *rest: Any) -> None:
        self.inner.call(ctx, stats, *rest)  # (usage, error, output: Recorder.call's)
        meter = CURRENT.get()
        if meter is not None and stats.logical_call_id == meter.call_id:
            meter.stats = stats


def tap(session: Session) -> None:
    """Install the tap on ``session`` (once)."""
    runtime = session._runtime
    if not isinstance(runtime.recorder, _Tap):
        runtime.recorder = _Tap(runtime.recorder)
