"""Per-session services and per-call state shared by the call, round and attempt layers."""

from __future__ import annotations

import contextvars
import itertools
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import httpx
import trio

from ._config import Scope, Settings, Source
from ._errors import Outcome, UpstreamError
from ._lag import LoopLag
from ._ocr_renderers import Renderers
from ._sketch import LatencySketch
from ._types import CallStats, Usage
from .governance import Admission, Governor
from .transport import Endpoint, Limits, Timeline

__all__ = ["AttemptRecord", "CallContext", "ChatRequest", "Continuation", "Recorder", "Runtime", "refused_context"]


class Recorder(Protocol):
    """Where finished attempts and calls are reported (telemetry).

    Both methods are synchronous and must not block: they run in ``finally`` blocks,
    possibly inside cancelled scopes.  ``call`` gets the call's frozen statistics;
    ``error`` is the exception the call ended with (a polygate error, or
    ``trio.Cancelled`` when the caller cancelled it), ``None`` on success; ``output``
    the answer's assembled message, for telemetry that stores content when asked.
    """

    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None: ...

    def call(
        self,
        ctx: CallContext,
        stats: CallStats,
        usage: Usage | None,
        error: BaseException | None,
        output: Mapping[str, Any] | None = None,
    ) -> None: ...


class NullRecorder:
    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None:
        return None

    def call(
        self,
        ctx: CallContext,
        stats: CallStats,
        usage: Usage | None,
        error: BaseException | None,
        output: Mapping[str, Any] | None = None,
    ) -> None:
        return None


class TraceHeaders(Protocol):
    """The trace context an attempt's request carries (W3C ``traceparent`` and what
    else the application's propagator writes): called as the request is built, once
    or more an attempt; never blocks, never raises."""

    def __call__(self, ctx: CallContext, record: AttemptRecord) -> Sequence[tuple[str, str]]: ...


@attrs.define(eq=False)
class Runtime:
    """What every call of one session shares."""

    settings: Settings
    transport: httpx.AsyncBaseTransport
    governor: Governor
    recorder: Recorder = attrs.field(factory=NullRecorder)
    #: The trace context headers an attempt's request carries (``traceparent``…): the
    #: tracing recorder's, None when the session does not trace.
    trace_headers: TraceHeaders | None = None
    rng: random.Random = attrs.field(factory=random.Random)
    endpoints: dict[tuple[str, str], Endpoint] = attrs.field(init=False)
    limits: Limits = attrs.field(init=False)
    sketches: dict[tuple[str, str], LatencySketch] = attrs.field(factory=dict)
    # OCR's renderer processes (started on first use); the session closes them.
    renderers: Renderers = attrs.field(factory=Renderers)
    # Set when the session's block exits: calls still running (started from a task
    # outside the block) send nothing more.
    closed: bool = False
    # The session's own nursery: where a stream's call runs (see ChatStream), so that
    # the caller's task holds no nursery of polygate's across its ``async with``.
    nursery: trio.Nursery | None = None
    # The streams whose producers run: each one's cancel scope, and the event it sets
    # once it has ended.  Those scopes are shielded from the cancellations that reach
    # the session's nursery (a stream is cancelled through its reader, as a call is
    # through its caller: a shield around the block holds), so the session's closing
    # cuts them itself.
    streams: dict[trio.CancelScope, trio.Event] = attrs.field(factory=dict)
    #: The trio run's watch on its loop's own stalls, which moves the running
    #: attempts' clocks (polygate._lag); None under a test's MockClock.
    loop_lag: LoopLag | None = None

    def __attrs_post_init__(self) -> None:
        others = self.settings.secrets()
        self.endpoints = {
            (scope_name, s.name): Endpoint(s.name, s.url, s.api_key, s.model, s.streaming, others)
            for scope_name, scope in self.settings.scopes.items()
            for s in scope.sources
        }
        self.limits = Limits(self.settings.max_body_bytes, self.settings.max_line_bytes)

    def sketch(self, scope: str, source: str) -> LatencySketch:
        key = (scope, source)
        sketch = self.sketches.get(key)
        if sketch is None:
            sketch = self.sketches[key] = LatencySketch()
        return sketch


_ids = itertools.count(1)
#: 64 random bits: processes that name calls into one store (a telemetry database many
#: workers and CLI runs share for months) never draw the same tag.  With 32 bits, two
#: of ~100,000 processes did so more often than not, and their calls' attempts mixed.
_PROCESS_TAG = os.urandom(8).hex()


def _new_process() -> None:
    """A forked child (a pre-forking server's worker) draws its own tag: inheriting the
    parent's, with the same counter, every worker named its calls as its siblings did,
    in the telemetry file they may share and in the upstream's ``x-polygate-call-id``."""
    global _ids, _PROCESS_TAG
    _ids = itertools.count(1)
    _PROCESS_TAG = os.urandom(8).hex()


if hasattr(os, "register_at_fork"):  # (not on Windows: no fork there)
    os.register_at_fork(after_in_child=_new_process)


#: A front end that must name a call before it starts (the gateway server sends the id
#: in its response headers before the first chunk) sets this around the call; calls
#: started in that context take it as their ``logical_call_id``.
PRESET_CALL_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "polygate_preset_call_id", default=None
)


#: Headers a front end adds to every upstream request of the calls started in its
#: context: the gateway server's ``Via`` (a request that comes back to the server that
#: sent it on is a loop, refused at once).
PRESET_HEADERS: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "polygate_preset_headers", default=()
)


def new_call_id() -> str:
    """Unique across processes (random per-process tag) and cheap (a counter)."""
    preset = PRESET_CALL_ID.get()
    if preset is not None:
        return preset
    return f"{_PROCESS_TAG}-{next(_ids):08x}"


def fresh_call_id() -> str:
    """A new id in the same format, whatever the context says."""
    return f"{_PROCESS_TAG}-{next(_ids):08x}"


@attrs.define(eq=False)
class AttemptRecord:
    """One transport attempt, winners and losers alike; the telemetry ``attempts`` row."""

    attempt_id: str
    source: str
    role: str  # "primary" | "hedge"
    started_at: float
    tokens_reserved: int
    timeline: Timeline = attrs.field(factory=Timeline)
    outcome: Outcome | None = None
    error: UpstreamError | None = None
    #: The error the call lists for this attempt (``every_error``) when it is not the
    #: attempt's own: the one that asked its source again without what it refused of
    #: polygate's own asking (the attempt's row and span keep ``error``, its own).
    listed_error: UpstreamError | None = None
    tokens_settled: int | None = None
    usage: Usage | None = None
    ended_at: float | None = None
    scope: str = ""
    #: The estimate of the prompt this attempt sent (a continuation's is bigger than
    #: the call's): what its usage is estimated with when it reports none.
    prompt_estimate: int = 0
    #: Its live OpenTelemetry span, once its request carried the span's context.
    trace: Any = attrs.field(default=None, repr=False)


@attrs.define(eq=False)
class Continuation:
    """How the rounds of a resumed stream ask for the rest of the answer: the messages
    with the text shown as a trailing assistant message (for a source that accepts a
    prefill, with ``prefill_params``), or followed by a request to continue."""

    prefill_json: str
    prompt_json: str
    prefill_params: Mapping[str, Any]
    refused_prefill: set[str] = attrs.field(factory=set)  # sources that answered 400 to it
    #: The caller's token limits less what was already shown (``max_tokens`` bounds
    #: the whole answer, not each segment of it).
    limits: Mapping[str, Any] = attrs.field(factory=dict)
    #: The answer shown so far, which the rounds send back (content, for telemetry).
    shown: str = ""

    def prefilled(self, source: Source) -> bool:
        # (Nothing shown: the call is asked again as it was, with no prefill to refuse.)
        return bool(self.shown) and source.prefill and source.name not in self.refused_prefill

    def request(self, source: Source, params: Mapping[str, Any]) -> ChatRequest:
        if self.shown and _json_format(params.get("response_format")):
            # The caller's own JSON format is left out of a continuation, as polygate's
            # own is (polygate._structured): a constrained decoder starts a new document
            # rather than finish the cut one, and the joined text was no JSON at all.
            params = {k: v for k, v in params.items() if k != "response_format"}
        if self.prefilled(source):
            return ChatRequest(self.prefill_json, {**params, **self.limits, **self.prefill_params})
        return ChatRequest(self.prompt_json, {**params, **self.limits} if self.limits else params)


def _json_format(response_format: Any) -> bool:
    """A ``response_format`` that constrains the answer to a JSON document."""
    return type(response_format) is dict and response_format.get("type") in ("json_schema", "json_object")


@attrs.frozen
class ChatRequest:
    """What one chat attempt sends when it is not the call's own messages and
    parameters: an OCR page, or a structured call's per-source form of its round.
    The estimates, when set, replace the call's (usage the upstream did not report)."""

    messages_json: str | bytes  # bytes: UTF-8 (an OCR page, prepared off the loop)
    params: Mapping[str, Any]
    prompt_estimate: int | None = None
    completion_estimate: int | None = None
    #: It carries a model's JSON Schema not in strict form where a strict form differs
    #: (a source that refuses it is asked again with that: see _structured).
    loose_schema: bool = False


@attrs.define(eq=False)
class CallContext:
    runtime: Runtime
    scope_name: str
    scope: Scope
    kind: str  # "chat" | "embed"
    started_at: float
    #: The call's one absolute deadline, once its deadline scope is entered (None: no
    #: deadline).  An attempt that it cut tells its source's health how long it waited.
    deadline_at: float | None = None
    messages: Sequence[Mapping[str, Any]] = ()
    messages_json: str = "[]"  # encoded once per call, spliced into every attempt's body
    params: Mapping[str, Any] = attrs.field(factory=dict)
    #: Parameters an attempt sent, and whether their keys are all plain (see
    #: ``_attempt._plain`` and ``_json.plain_keys``): found once a call, not once an attempt.
    plain_params: tuple[Mapping[str, Any], bool] | None = None
    # The caller's texts that are not messages (an embed's inputs, an OCR prompt):
    # like the messages, telemetry never stores them unless asked (log_content).
    input_texts: Sequence[str] = ()
    prompt_estimate: int = 0
    completion_estimate: int = 0
    logical_call_id: str = attrs.field(factory=new_call_id)
    #: What every attempt's request carries besides its own headers (PRESET_HEADERS).
    added_headers: tuple[tuple[str, str], ...] = attrs.field(factory=PRESET_HEADERS.get)
    attempts: list[AttemptRecord] = attrs.field(factory=list)
    # The scopes whose hedge budget refused this call (each counted once per call: a
    # call that moved to a fallback scope is refused there on that scope's budget).
    hedge_refused: set[str] = attrs.field(factory=set)
    streaming_to_caller: bool = False
    continuation: Continuation | None = None  # set once a committed stream resumes
    first_scope: str | None = None  # the scope asked, once the call moved to a fallback
    record_call: bool = True  # False: part of a larger call, which writes the call row
    fallbacks: list[str] = attrs.field(factory=list)  # the scopes it moved to, in order
    reasks: int = 0  # structured output: rounds re-asked after an invalid answer
    # The caller's messages once a re-ask has changed ``messages_json`` (the call
    # row's content is the request, not the last round's conversation).
    asked_json: str | None = None
    # Models that refused this call's request for its context length (a fallback
    # serving only those is skipped: it would refuse it again).
    context_refused: set[str] = attrs.field(factory=set)
    resumes: int = 0  # continuations of a committed stream so far (for any outcome)
    #: The attempt whose stream reached the caller (the latest, after a resume): a
    #: deadline that cuts it still says where the text came from (CallStats.source).
    committed: AttemptRecord | None = None
    #: The earlier committed segments of a resumed stream (the round's), in order.
    segments: list[AttemptRecord] = attrs.field(factory=list)
    #: The numbering of the attempts of the logical call this context is part of, when
    #: it is one of several (an embed's runs of its cache misses); else its own count.
    attempt_numbers: Iterator[int] | None = None
    #: The context of that logical call, when this is one of its runs: each attempt
    #: is listed in its ``attempts`` too (the call's spans are made from that list).
    whole: CallContext | None = None
    #: The call's live OpenTelemetry span, once an attempt needed its context (the
    #: tracing recorder's; None when the session does not trace).
    trace: Any = None

    @property
    def estimate(self) -> int:
        return self.prompt_estimate + self.completion_estimate

    def source(self, name: str) -> Source:
        return self.scope.source(name)

    def new_attempt(self, admission: Admission, role: str, now: float) -> AttemptRecord:
        numbers = self.attempt_numbers
        number = len(self.attempts) + 1 if numbers is None else next(numbers)
        record = AttemptRecord(
            attempt_id=f"{self.logical_call_id}.{number}",
            source=admission.source,
            role=role,
            started_at=now,
            tokens_reserved=admission.tokens,
            scope=admission.scope,
        )
        self.attempts.append(record)
        if self.whole is not None:
            self.whole.attempts.append(record)
        return record


def refused_context(ctx: CallContext) -> frozenset[str]:
    """The sources of the call's scope that serve a model which refused this call's
    context length (in any scope it went through): a context-length error is never
    resent to the same model, in a scope that mixes models too.  None when every
    source does (the asked scope, when the whole chain refused): its error is the
    call's again."""
    if not ctx.context_refused:
        return _NONE
    refused = frozenset(s.name for s in ctx.scope.sources if s.model in ctx.context_refused)
    return _NONE if len(refused) == len(ctx.scope.sources) else refused


_NONE: frozenset[str] = frozenset()
