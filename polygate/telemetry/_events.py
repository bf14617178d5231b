"""Telemetry events: one frozen record per logical call, per attempt, per session.

The records are :class:`typing.NamedTuple` classes rather than attrs classes, and
that is deliberate.  They are built on the call path (in ``finally`` blocks of every
attempt and call), so construction cost is overhead on every call: a 25-field
NamedTuple builds in ~0.6 µs, a frozen slotted attrs class in ~2 µs.  And a tuple
whose field order *is* the column order goes to ``executemany`` / ``COPY`` as it
is, with no conversion in the writer thread.  They are as frozen as attrs' frozen
classes (tuples), carry no ``__dict__``, and are typed field by field.

Time stamps (``started_at``) are wall-clock seconds since the epoch
(``time.time()``), so rows from many processes line up; durations are milliseconds
measured with trio's clock, exactly as :class:`polygate.CallStats` reports them.

Field order is the column order of the ``calls``, ``attempts`` and ``sessions``
tables (see :mod:`._schema`); adding a field means adding a schema migration.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["AttemptEvent", "CallEvent", "Event", "SessionEvent"]


class CallEvent(NamedTuple):
    """One logical call: the ``calls`` row.

    ``outcome`` is ``ok``, ``error`` (the call raised; ``error_class`` names the
    polygate error, e.g. ``DeadlineExceeded``) or ``cancelled`` (the caller cancelled
    it: ``error_class`` is ``Cancelled``).  ``content`` is ``None`` unless the
    settings ask for ``log_content``.
    """

    session_id: str
    logical_call_id: str
    scope: str
    kind: str  # "chat" | "embed" | "ocr"
    stream: int  # 1: stream_chat(), 0: chat() / embed()
    started_at: float
    outcome: str
    error_class: str | None
    error_message: str | None
    total_latency_ms: float
    generation_ms: float
    ttft_ms: float | None
    stall_ms: float | None
    stall_count: int | None
    active_generation_ms: float | None
    attempts: int
    hedges: int
    hedge_won: int
    source: str | None
    cached: int
    prompt_tokens: int | None
    completion_tokens: int | None
    usage_source: str | None  # "upstream" | "estimated" | None
    content: str | None
    # Schema version 2 (defaults: rows built by code that predates them stay valid).
    reasks: int = 0  # structured-output re-asks (CallStats.reasks)
    resumes: int = 0  # committed streams continued on another source (CallStats.resumes)
    answered_scope: str | None = None  # CallStats.scope: the scope that answered


class AttemptEvent(NamedTuple):
    """One transport attempt, winner or loser: the ``attempts`` row.

    ``call_id`` is the attempt's own id (``<logical_call_id>.<n>``); ``error`` is the
    attempt's :class:`polygate._errors.Outcome` value (``ok``, ``hedge_cancelled``,
    ``cancelled``, ``timeout``, ``rate_limited``, ``transient``, ``dead``, ``fatal``,
    ``stalled``).  ``latency_ms`` runs from the request being sent (or, when it never
    was, from admission) to the attempt's end.
    """

    call_id: str
    logical_call_id: str
    scope: str
    source: str
    role: str  # "primary" | "hedge"
    started_at: float
    latency_ms: float
    ttft_ms: float | None
    status_code: int | None
    streamed: int
    error: str
    error_class: str | None
    error_message: str | None
    tokens_reserved: int
    tokens_settled: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    usage_source: str | None


class SessionEvent(NamedTuple):
    """A session's running totals: the ``sessions`` row, upserted now and then.

    It carries what no call row can: rows this session dropped (a lower bound on what
    the tables are missing) and, per scope as a JSON object, the calls the hedge budget
    denied a hedge (each call counted once, however often its trigger re-checked).
    """

    session_id: str
    started_at: float
    updated_at: float
    ended_at: float | None
    pid: int
    polygate_version: str
    rows_written: int
    rows_dropped: int
    hedges_suppressed: str  # JSON object: scope -> calls denied a hedge by the budget


Event = CallEvent | AttemptEvent
