"""The response cache at the call boundary: a logical call, looked up first.

The session calls :func:`cached_chat` and :func:`cached_embed` in place of
``run_chat`` / ``run_embed``.  When the scope caches (``Scope.cache_ttl_s``), the
session has a cache and the call did not say ``cache=False``::

    lookup (fail-open) ── hit ──────────────────────────────> stored answer, cached=True
       └ miss → flight for the key? ── yes: wait (own deadline) ─ answer ─> cached=True
                                    │                          ├ verdict ─> same error
                                    │                          └ abandoned: lead instead
                                    └ no: lead: run_chat / run_embed (admission, hedging,
                                          retries as usual), store the answer, hand it
                                          to the waiters

A hit never enters the retry loop and never touches the governor: it costs no quota,
no permit, no hedge budget.  Its statistics say ``cached=True, attempts=0, hedges=0,
generation_ms=0, ttft_ms=None`` and ``total_latency_ms`` is the lookup; its telemetry
row has ``cached = 1``.  ``stream_chat`` replays a hit (or a coalesced answer) as
chunks through the stream's own ``forward``, so the caller iterates as usual.

The call deadline is one absolute time for the lookup, the wait and the upstream
call: a leader, or a waiter taking over, gets what is left of it.  Coalescing rules
(who shares what when a leader fails): :mod:`polygate.cache._coalesce`.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

import attrs
import trio

from ._call import Rounds, one_apart, run_chat, run_embed
from ._context import CallContext, Runtime
from ._errors import (
    AllSourcesExhausted,
    ConfigError,
    DeadlineExceeded,
    FatalUpstreamError,
    GovernanceBackendError,
    StructuredOutputError,
    failed_attempts,
)
from ._resume import StreamSink
from ._types import CallStats, ChatResponse, EmbeddingResponse, Usage
from .cache import Cache, chat_key, embed_keys
from .cache._coalesce import Flight
from .cache._codec import decode_chat, decode_vector, encode_chat, encode_vector

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["cache_mode", "cached_chat", "cached_embed"]


#: Errors that are a verdict on the request or the upstreams: shared with waiters.
_SHARED = (
    FatalUpstreamError, AllSourcesExhausted, GovernanceBackendError, StructuredOutputError,
)


T = TypeVar("T")

#: The most of what is left of a call's deadline a cache lookup may take; the rest is
#: the upstream's (docs/cache.md, "Failing open").
LOOKUP_SHARE: Final = 0.1


def cache_mode(value: Any) -> bool | str:
    """The per-call ``cache=`` argument: True (default), False or ``"refresh"``."""
    if value is True or value is False or value == "refresh":
        return value  # type: ignore[no-any-return]
    raise ConfigError(f"cache must be True, False or 'refresh', got {value!r}")


def _caching(runtime: Runtime, cache: Cache | None, mode: bool | str, scope: str) -> float | None:
    """The scope's TTL when this call uses the cache, else None."""
    if cache is None or mode is False:
        return None
    return runtime.settings.scopes[scope].cache_ttl_s


class _Call:
    """What the cache layer knows of one logical call: its clock, deadline and row."""

    def __init__(
        self, runtime: Runtime, scope: str, kind: str, deadline_s: float | None, *,
        messages: Sequence[Mapping[str, Any]] = (), messages_json: str = "[]",
        params: Mapping[str, Any], streaming: bool = False,
    ) -> None:
        self.runtime = runtime
        self.ctx = CallContext(
            runtime, scope, runtime.settings.scopes[scope], kind, trio.current_time(),
            messages=messages, messages_json=messages_json, params=params,
            streaming_to_caller=streaming,
        )
        self.deadline_s = deadline_s
        self.deadline_at = None if deadline_s is None else self.ctx.started_at + deadline_s
        # True once this call has a telemetry row, or an upstream call that writes one
        self.recorded = False
        # The upstream calls this call made and finished (an embed's runs of its
        # misses): in its statistics however it ends, a later wait failing included.
        self.runs: list[EmbeddingResponse] = []
        # The contexts of its upstream calls still running (one per run, once it has
        # one), and of those that ended with no statistics of their own (cancelled):
        # their attempts started count too, should this call end before them.
        self.live: list[list[CallContext]] = []
        # One numbering of attempts for all of its upstream calls: each is a context of
        # its own, and its attempts' ids ("<call>.<n>") must not repeat.
        self.numbers = itertools.count(1)
        # The reading time its lookups have left of their share of the deadline (set by
        # the first), and whether one was cut: a second read (see
        # Cache.written_since) gets what is left of it, none after a cut.
        self._lookup_left: float | None = None
        self._lookup_cut = False

    async def within(self, work: Callable[[], Awaitable[Any]]) -> Any:
        """``work`` (a lookup, a wait, a replay) under the call deadline.  Never wraps
        an upstream call: that one runs under its own scope for what is left."""
        if self.deadline_at is None:
            return await work()
        try:
            with trio.fail_at(self.deadline_at):
                return await work()
        except trio.TooSlowError:
            error = self.timed_out()
            if not self.recorded:
                self.record(error.call_stats or self.stats(cached=False), None, error)
            raise error from None

    async def lookup(self, cache: Cache, read: Callable[[], Awaitable[T]], missed: T) -> T:
        """A cache read, ``missed`` when it takes more than ``LOOKUP_SHARE`` of what is
        left of the deadline.  The backend's own timeout can be longer than a short
        deadline: a read that used the deadline up would fail a call the upstream could
        have answered, where the cache must fail open (a slow read is counted as a
        failure, but does not pause the backend: it was this call that had little time).
        A call's reads share the one share, as reading time (not as a window: a waiter
        that waited on an identical call longer than that still reads again before it
        leads), and a cut counts once: the read again of keys written meanwhile gets
        what is left of it (none after a cut)."""
        if self.deadline_at is None or cache.local:  # (a memory lookup never waits)
            return await read()
        now = trio.current_time()
        share = max(0.0, self.deadline_at - now) * LOOKUP_SHARE
        budget = share if self._lookup_left is None else min(share, self._lookup_left)
        if self._lookup_cut or budget <= 0:  # (used up: the backend is not asked)
            await trio.lowlevel.checkpoint()
            return missed
        try:
            with trio.move_on_after(budget):
                return await read()
        finally:
            self._lookup_left = budget - (trio.current_time() - now)
        if not self._lookup_cut:  # (an embed's two runs may read at once: counted once)
            self._lookup_cut = True
            cache.failed("a cache lookup took longer than its share of the call's deadline",
                         pause=False)
        return missed

    def remaining(self) -> float | None:
        """What is left of the deadline for an upstream call; DeadlineExceeded at 0."""
        if self.deadline_at is None:
            return None
        left = self.deadline_at - trio.current_time()
        if left <= 0:
            raise self.timed_out()
        return left

    def stats(
        self, *, cached: bool, source: str | None = None, scope: str | None = None
    ) -> CallStats:
        stats = CallStats(
            logical_call_id=self.ctx.logical_call_id, source=source, cached=cached,
            total_latency_ms=(trio.current_time() - self.ctx.started_at) * 1000.0,
            scope=scope or self.ctx.scope_name,
        )
        if not self.runs and not self.live:  # (a hit: nothing to add, on its path)
            return stats
        return attrs.evolve(
            stats,
            attempts=sum(r.call_stats.attempts for r in self.runs)
            + sum(len(ctx.attempts) for held in self.live for ctx in held),
            generation_ms=sum(r.call_stats.generation_ms for r in self.runs),
        )

    def timed_out(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"call exceeded its deadline of {self.deadline_s} s waiting for the cache "
            f"(scope {self.ctx.scope_name!r})",
            call_stats=self.stats(cached=False),
        )

    def record(
        self, stats: CallStats, usage: Usage | None, error: BaseException | None,
        output: Mapping[str, Any] | None = None,
    ) -> None:
        self.recorded = True
        self.runtime.recorder.call(self.ctx, stats, usage, error, output)

    def shared(self, error: BaseException) -> BaseException:
        """The leader's verdict as this call's own error, with its own statistics."""
        clone = copy.copy(error)
        clone.__traceback__ = clone.__cause__ = clone.__context__ = None
        if isinstance(clone, AllSourcesExhausted):
            clone.errors = list(clone.errors)  # each caller's own list
        elif isinstance(clone, StructuredOutputError):
            clone.errors = list(clone.errors)
        if hasattr(clone, "call_stats"):
            clone.call_stats = self.stats(cached=False)
        return clone


async def _guard(call: _Call, body: Callable[[], Awaitable[Any]]) -> Any:
    """Run the cache's part of a call.  Whatever ends it without a row so far — a
    cancellation while looking up or waiting — still gets one (as upstream calls do)."""
    try:
        return await body()
    except BaseException as exc:
        if not call.recorded:
            call.record(getattr(exc, "call_stats", None) or call.stats(cached=False), None, exc)
        raise


# --------------------------------------------------------------------------- chat


async def cached_chat(
    runtime: Runtime,
    cache: Cache | None,
    mode: bool | str,
    scope: str,
    messages: Sequence[Mapping[str, Any]],
    messages_json: str,
    params: Mapping[str, Any],
    deadline_s: float | None,
    *,
    forward: StreamSink | None = None,
    delivered: list[str] | None = None,
    rounds: Rounds | None = None,
) -> ChatResponse:
    ttl = _caching(runtime, cache, mode, scope)
    if cache is None or ttl is None:
        return await run_chat(
            runtime, scope, messages, messages_json, params, deadline_s,
            forward=forward, delivered=delivered, rounds=rounds,
        )
    call = _Call(
        runtime, scope, "chat", deadline_s, messages=messages, messages_json=messages_json,
        params=params, streaming=forward is not None,
    )
    keyed, schema = params, None
    if rounds is not None:
        # A schema changes the answer (and whether it is acceptable): it is in the key.
        # With one, ``response_format=None`` is no format of the caller's (polygate's is
        # sent): the same request, and the same key, as leaving it out.
        keyed = {k: v for k, v in params.items() if k != "response_format" or v is not None}
        schema = rounds.cache_key()
    try:
        key = chat_key(scope, cache.models(scope, runtime.settings.scopes), messages, keyed, schema=schema)
    except RecursionError:
        # Messages nested near a recursion limit the application lowered (the key's
        # walk takes two frames a level before Python 3.12): no key, so this call is
        # answered as if its scope did not cache.
        return await run_chat(
            runtime, scope, messages, messages_json, params, deadline_s,
            forward=forward, delivered=delivered, rounds=rounds,
        )

    async def upstream() -> ChatResponse:
        call.remaining()  # DeadlineExceeded when nothing is left
        call.recorded = True  # run_chat writes the row, however it ends
        # The logical call began before the lookup (and any wait on a flight it took
        # over): its deadline, statistics and row count from there.
        return await run_chat(
            runtime, scope, messages, messages_json, params, call.deadline_s,
            forward=forward, delivered=delivered, rounds=rounds,
            started_at=call.ctx.started_at,
        )

    def count(via: str) -> None:
        if via == "hit":
            cache.hits += 1
        else:
            cache.coalesced += 1

    async def served(data: bytes, via: str) -> ChatResponse | None:
        """A stored (``via`` "hit") or coalesced answer as this call's response, counted
        (None: it did not decode)."""
        fields = _decoded(cache, data)
        if fields is None:
            return None
        answered = fields.pop("scope")
        if rounds is not None:
            candidate = ChatResponse(**fields, call_stats=call.stats(cached=True))
            # Validating a stored answer is part of the call: under its deadline.
            judged = await call.within(lambda: rounds.accept(candidate))
            if judged is None:
                cache.failed("a cached answer no longer matches its schema", pause=False)
                return None
            fields["parsed"] = judged.parsed
        if forward is not None:
            chunks = _replay(fields)

            async def replay() -> None:
                for chunk in chunks:
                    if not forward.offer(chunk):  # the consumer is behind: wait for it
                        await forward.deliver_held()

            try:
                await call.within(replay)
            except trio.Cancelled:
                # The answer was complete before its replay began: a reader that leaves
                # (or is cancelled) with chunks unread leaves it a hit and ``ok``, as it
                # leaves a complete upstream answer (docs/telemetry.md, ``outcome``).
                answer(fields, answered, via)
                raise
        return answer(fields, answered, via)

    def answer(fields: dict[str, Any], answered: str, via: str) -> ChatResponse:
        stats = call.stats(cached=True, source=fields["source"], scope=answered)
        response = ChatResponse(**fields, call_stats=stats)
        call.record(stats, response.usage, None, response.message)
        count(via)
        return response

    async def body() -> ChatResponse:
        if rounds is not None:
            # A bad schema is refused before the cache is asked: no lookup, no miss.
            await call.within(rounds.ready)
        rejected: bytes | None = None  # an entry that did not serve: not tried again
        seen = cache.generation  # (what was written before the lookup: see below)
        if looked_up:
            rejected = found
        elif mode != "refresh":
            data = await call.lookup(cache, lambda: cache.get(key), None)
            if data is not None:
                response = await served(data, "hit")
                if response is not None:
                    return response
                rejected = data
        while True:
            if mode == "refresh":
                cache.misses += 1
                return await _lead(cache, key, cache.flights.lead_if_free(key), upstream, ttl,
                                   (messages, keyed))
            flight, leading = cache.flights.claim(key)
            if leading:
                # The miss was decided before an await (the backend's read): an
                # identical call may have finished meanwhile, its answer now held here.
                # Looked at again with no await between the look and the claim.  And
                # if one was written meanwhile (its write may have committed after the
                # read had looked, and the write-behind has let go of it), read again,
                # leading: identical calls wait for this one.
                data = cache.get_local(key)
                if data is None and cache.written_since(key, seen):
                    try:
                        data = await call.lookup(cache, lambda: cache.get(key), None)
                    except BaseException:
                        cache.flights.settle(key, flight)
                        raise
                if data is not None and data != rejected:
                    try:
                        response = await served(data, "hit")
                    except BaseException:
                        cache.flights.settle(key, flight)  # handed over to a waiter
                        raise
                    if response is not None:
                        cache.flights.settle(key, flight, value=data)
                        return response
                    # It did not serve: this call leads (never the same entry twice,
                    # so there is no loop without an await).
                cache.misses += 1
                return await _lead(cache, key, flight, upstream, ttl, (messages, keyed))
            await call.within(flight.done.wait)
            if flight.value is not None:
                response = await served(flight.value, "coalesced")
                if response is not None:
                    return response
                rejected = flight.value  # counted once: not looked at again below
                continue
            if flight.error is not None and _binds(flight.error, rounds):
                if not _sent_alike(flight, (messages, keyed)):
                    # A refusal of another request than this call's (a parameter the key
                    # leaves out, or a number written otherwise): asked for alone, at
                    # once, beside any other such waiter, not queued behind one another.
                    # (The first such waiter opens a flight of its own, which later
                    # identical calls join; the others compute alone.)
                    cache.misses += 1
                    return await _lead(cache, key, cache.flights.lead_if_free(key), upstream,
                                       ttl, (messages, keyed))
                error = call.shared(flight.error)
                call.record(getattr(error, "call_stats", None) or call.stats(cached=False), None, error)
                raise error
            # abandoned, or a verdict that does not bind this call: loop and lead (or
            # wait on whoever led first)

    looked_up, found = False, None
    if cache.local and mode is True and rounds is None and forward is None:
        # The common hit, on the memory backend: looked up and served inline, with
        # none of the machinery a miss needs (a measured third of a hit's cost).
        try:
            await trio.lowlevel.checkpoint()  # as cache.get(): fairness, cancellation
        except BaseException as exc:
            call.record(call.stats(cached=False), None, exc)
            raise
        if call.deadline_at is None or trio.current_time() < call.deadline_at:
            looked_up, found = True, cache.get_local(key)
            if found is not None:
                response = _plain_hit(call, cache, found)
                if response is not None:
                    return response
    result: ChatResponse = await _guard(call, body)
    return result


def _decoded(cache: Cache, data: bytes) -> dict[str, Any] | None:
    """A stored chat answer's fields; None (counted as a cache error) if it does not decode."""
    try:
        return decode_chat(data)
    except ValueError as exc:
        cache.failed(f"a cached chat answer did not decode ({exc})", pause=False)
        return None


def _plain_hit(call: _Call, cache: Cache, data: bytes) -> ChatResponse | None:
    """A stored answer served as it is (no schema, no replay); None: it did not decode
    (counted; the caller goes upstream)."""
    fields = _decoded(cache, data)
    if fields is None:
        return None
    answered = fields.pop("scope")
    stats = call.stats(cached=True, source=fields["source"], scope=answered)
    response = ChatResponse(**fields, call_stats=stats)
    call.record(stats, response.usage, None, response.message)
    cache.hits += 1
    return response


def _verdict(error: BaseException) -> BaseException | None:
    """The leader's error as its waiters' answer; None (the flight handed over to a
    waiter) when the leader only ran out of its own time: every source refused it until
    past its deadline or its ``rate_limit_wait_s``, which a waiter with more time (or
    that joined later) would have waited out."""
    if isinstance(error, AllSourcesExhausted) and error.timed:
        return None
    return error


def _about_inputs(error: BaseException) -> bool:
    """Whether an embed run's error may be about, or quote, some of its inputs: a
    refusal of the request (one input the upstream rejects fails its whole batch), no
    source admitting it at all (a batch too large for a quota is the batch's), and an
    outage too (every attempt failed: an upstream's 500 may quote an input).  Of a run
    of several inputs, such an error is a verdict only for a waiter that would send
    every one of them itself (an identical call): any other waiter asks for its own
    inputs, and never reads another caller's in its error or its telemetry row.  A
    governance backend down says nothing of any input, and is shared with all."""
    return isinstance(error, (FatalUpstreamError, AllSourcesExhausted))


def _binds(error: BaseException, rounds: Rounds | None) -> bool:
    """Whether the leader's shared error is this waiter's answer too.

    A ``StructuredOutputError`` is, once the leader had at least the re-asks this call
    may make (identical calls under one schema would end the same way, and asking
    again one after the other would only queue them); not when it had fewer -- a
    ``stream_chat`` leader never re-asks, and a ``chat`` waiter still may."""
    if not isinstance(error, StructuredOutputError) or rounds is None:
        return True
    stats = error.call_stats
    return stats is not None and stats.reasks >= rounds.max_reasks


def _sent_alike(flight: Flight, request: Any) -> bool:
    """Whether a refusal the leader got binds a waiter sending ``request``: only when
    both send the same JSON, every parameter included.  A key counts ``1`` and ``1.0``
    as one value; on the wire they differ (``"max_tokens": 100.0`` is refused where
    ``100`` is taken).  And the parameters the key leaves out do not change an answer,
    but may decide whether a request is taken (``metadata`` without ``store``, a
    ``user`` over the provider's length): a refusal may also quote them, and another
    caller's ``user`` or ``metadata`` is not this one's to read.  Compared only here,
    on the rare path of a shared refusal; anything that cannot be compared counts as
    different (the waiter then asks for itself).  So does an ``AllSourcesExhausted``
    that carries upstream failures: their messages may quote the leader's ``user`` as
    much (one gateway's tenants coalesce); one given by admission alone quotes none."""
    error = flight.error
    upstream_said = isinstance(error, FatalUpstreamError) or (
        isinstance(error, AllSourcesExhausted) and bool(failed_attempts(error.errors)))
    if not upstream_said or flight.request is None:
        return True
    try:
        return _wire_json(flight.request) == _wire_json(request)
    except (TypeError, ValueError, RecursionError):
        return False


def _wire_json(request: Any) -> str:
    """``request`` (a chat's messages and parameters, an embedding's parameters) as
    JSON writes it, numbers as they are sent."""
    return json.dumps(_as_sent(request), sort_keys=True, ensure_ascii=False)


def _as_sent(value: Any) -> Any:
    """``value`` with any Mapping as a dict (its keys as the text JSON sends) and any
    list or tuple as a list: equal requests compare equal whatever their types."""
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else json.dumps(k): _as_sent(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_sent(v) for v in value]
    return value


async def _lead(
    cache: Cache, key: str, flight: Flight | None, upstream: Callable[[], Awaitable[ChatResponse]],
    ttl: float, request: Any = None,
) -> ChatResponse:
    """Make the upstream call; store and share its answer, or settle the flight.
    ``request``: what it sends (see :attr:`Flight.request`)."""
    if flight is None:  # cache="refresh" while another call leads: compute alone
        # (That call asked before this one: once this one's answer is stored, the
        # older answer arriving after it must not undo the refresh.)
        older = cache.flights.open(key)
        response = await upstream()
        data = _encoded(cache, response)
        if data is not None:
            cache.put(key, data, ttl)
            if older is not None:
                older.superseded = True
        return response
    flight.request = request
    try:
        response = await upstream()
    except _SHARED as exc:
        cache.flights.settle(key, flight, error=_verdict(exc))
        raise
    except BaseException:
        cache.flights.settle(key, flight)  # handed over to a waiter
        raise
    data = _encoded(cache, response)
    if data is None:
        cache.flights.settle(key, flight)  # not storable: each waiter asks for itself
        return response
    if not flight.superseded:  # (a refresh that asked later stored its answer first)
        cache.put(key, data, ttl)  # stored before the flight ends: no window without either
    cache.flights.settle(key, flight, value=data)
    return response


def _encoded(cache: Cache, response: ChatResponse) -> bytes | None:
    """The answer as an entry; None (counted, the call unharmed) if it cannot be one."""
    try:
        return encode_chat(response)
    except (TypeError, ValueError) as exc:
        cache.failed(f"an answer could not be stored ({type(exc).__name__})", pause=False)
        return None


def _replay(answer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A stored answer (the fields of a ChatResponse) as stream chunks: per choice, its
    reasoning, content, refusal and tool calls, the role on the first chunk and the
    finish reason on the last."""
    raw = answer["raw"]
    text = answer["text"]
    base = {"id": raw.get("id"), "object": "chat.completion.chunk", "created": raw.get("created"),
            "model": answer["model"]}
    # On every chunk of a stream, as the upstream's own chunks carried them (the SDK's
    # stream helper reads the fingerprint from the first chunk).
    for name in ("system_fingerprint", "service_tier"):
        if isinstance(raw.get(name), str):
            base[name] = raw[name]
    chunks: list[dict[str, Any]] = []
    for position, choice in enumerate(answer["choices"]):
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", position)
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        assert isinstance(message, dict)
        content = message.get("content")
        if not isinstance(content, str):
            content = text if index == 0 and text else None
        deltas: list[dict[str, Any]] = []
        # The reasoning under the field the upstream streamed it in (Ollama's and
        # OpenRouter's "reasoning"; the assembler fills "reasoning_content" for all),
        # with OpenRouter's reasoning_details (their signatures go back next turn).
        said = message.get("reasoning")
        field = "reasoning" if isinstance(said, str) and said else "reasoning_content"
        reasoning: dict[str, Any] = {}
        if message.get(field):
            reasoning[field] = message[field]
        if isinstance(message.get("reasoning_details"), list) and message["reasoning_details"]:
            reasoning["reasoning_details"] = message["reasoning_details"]
        if reasoning:
            deltas.append(reasoning)
        for name, value in (("content", content), ("refusal", message.get("refusal"))):
            if value:
                deltas.append({name: value})
        # Any other field of the message (annotations, audio, a legacy function_call)
        # in a delta of its own, as a stream carries it: a hit returns the same message.
        for name, value in message.items():
            if name not in _REPLAYED and value is not None:
                deltas.append({name: value})
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            deltas.append({"tool_calls": [  # (by position: see message_delta)
                {**c, "index": i} if isinstance(c, dict) else c for i, c in enumerate(calls)
            ]})
        logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else None
        # The choice's own other fields (Azure's content_filter_results) on its last
        # chunk, as the upstream's finish chunk carried them: a hit returns the same
        # choices.  A choice that said nothing else still sends one chunk for them.
        extras = {k: v for k, v in choice.items() if k not in _CHOICE_REPLAYED}
        if extras and not deltas:
            deltas.append({})
        for n, delta in enumerate(deltas):
            if n == 0:
                delta = {"role": message.get("role", "assistant"), **delta}
            out: dict[str, Any] = {
                "index": index, "delta": delta,
                "finish_reason": choice.get("finish_reason") if n == len(deltas) - 1 else None,
            }
            if logprobs is not None and ("content" in delta or "refusal" in delta):
                # The text's (or the refusal's), with it, as they came; once.
                out["logprobs"], logprobs = logprobs, None
            if extras and n == len(deltas) - 1:
                out = {**extras, **out}
            chunks.append({**base, "choices": [out]})
    return chunks


#: Choice fields the replay writes itself (any other rides on the choice's last chunk).
_CHOICE_REPLAYED = frozenset({"index", "message", "finish_reason", "logprobs", "delta"})

#: Message fields the replay carries in deltas of their own making.
_REPLAYED = frozenset({
    "role", "content", "refusal", "tool_calls", "reasoning", "reasoning_content",
    "reasoning_details",
})


# --------------------------------------------------------------------------- embed


async def cached_embed(
    runtime: Runtime,
    cache: Cache | None,
    mode: bool | str,
    scope: str,
    inputs: Sequence[str],
    params: Mapping[str, Any],
    deadline_s: float | None,
) -> EmbeddingResponse:
    """Each distinct input is looked up on its own; only the misses go upstream (in
    one ``run_embed``, batched as usual), and the vectors come back in input order."""
    ttl = _caching(runtime, cache, mode, scope)
    if cache is None or ttl is None:
        return await run_embed(runtime, scope, inputs, params, deadline_s)
    call = _Call(runtime, scope, "embed", deadline_s, params=params)
    call.ctx.input_texts = inputs
    try:
        keys = embed_keys(scope, cache.models(scope, runtime.settings.scopes, chain=False), inputs, params)
    except RecursionError:  # (parameters nested near a lowered limit: as cached_chat)
        return await run_embed(runtime, scope, inputs, params, deadline_s)
    texts: dict[str, str] = dict(zip(keys, inputs, strict=True))  # distinct, in order
    own = texts.keys()  # (what this call would send: see Flight.batch)
    found: dict[str, tuple[list[float], str | None, str | None, int | None, str | None]] = {}
    fetched: set[str] = set()  # the inputs this call's own upstream runs answered
    came: dict[str, str] = {}  # how the others came: "hit" or "coalesced"

    # An entry that did not decode, by key: met again (the memory backend's local look
    # before a claim, a flight's value) it is the same miss, counted once (as chat's).
    rejected: dict[str, bytes] = {}

    def take(key: str, data: bytes | None) -> bool:
        if data is None or rejected.get(key) == data:
            return False
        try:
            found[key] = decode_vector(data)
        except ValueError as exc:
            rejected[key] = data
            cache.failed(f"a cached embedding did not decode ({exc})", pause=False)
            return False
        return True

    @trio.lowlevel.enable_ki_protection  # (a task: see _session._ki_protected)
    async def compute(
        led: list[str], flights: dict[str, Flight], reread: bool, supersedes: dict[str, Flight],
    ) -> None:
        """One upstream call for ``led``; store and share each vector, or settle.

        ``reread``: first, read again the keys written since this call began (a read
        may have looked before an identical input's write committed, and the
        write-behind has let go of it), holding their flights, as chat does: served
        from there, they are hits, and their waiters have them.

        ``supersedes``: a refresh's keys that another call was leading when it began,
        with that call's flights (see :attr:`Flight.superseded`)."""
        if reread:
            again = [k for k in led if cache.written_since(k, seen)]
            if again:
                missed: list[bytes | None] = [None] * len(again)
                try:
                    values = await call.lookup(cache, functools.partial(cache.get_many, again), missed)
                except BaseException:
                    for k, f in flights.items():
                        cache.flights.settle(k, f)
                    raise
                for k, data in zip(again, values, strict=True):
                    if take(k, data):
                        cache.hits += 1
                        came[k] = "hit"
                        if k in flights:
                            cache.flights.settle(k, flights.pop(k), value=data)
                led = [k for k in led if k not in found]
                if not led:
                    return
        cache.misses += len(led)
        try:
            call.remaining()  # DeadlineExceeded when nothing is left
            # Part of this call: its attempts carry this call's id, and this layer
            # writes the one call row (however the call ends: _guard, _embedding);
            # its deadline and statistics count from this call's start.
            held: list[CallContext] = []
            call.live.append(held)
            try:
                response = await run_embed(
                    runtime, scope, [texts[k] for k in led], params, call.deadline_s,
                    part_of=call.ctx.logical_call_id, started_at=call.ctx.started_at,
                    live=held, numbers=call.numbers, whole=call.ctx,
                )
            except BaseException as exc:
                if isinstance(getattr(exc, "call_stats", None), CallStats):
                    call.live.remove(held)  # its own statistics count its attempts
                # else (its caller cancelled it): its attempts started count in the
                # call's row from here, as from a run still going
                raise
            call.live.remove(held)
        except _SHARED as exc:
            verdict = _verdict(exc)
            batch = frozenset(led) if len(led) > 1 and _about_inputs(exc) else None
            for k, f in flights.items():
                cache.flights.settle(k, f, error=verdict, batch=batch)
            _count_other_runs(call, exc)
            raise
        except BaseException as exc:
            for k, f in flights.items():
                cache.flights.settle(k, f)
            _count_other_runs(call, exc)
            raise
        call.runs.append(response)
        try:
            shares = _token_shares(response.usage, [texts[k] for k in led])
            usage_source = response.usage.source if response.usage is not None else None
            stored: list[tuple[str, bytes, float]] = []
            for k, vector, tokens in zip(led, response.vectors, shares, strict=True):
                found[k] = (vector, response.model, response.source, tokens, usage_source)
                fetched.add(k)
                data = _encoded_vector(cache, vector, response, tokens, usage_source)
                if data is not None:
                    stored.append((k, data, ttl))
            # All at once: thousands of new inputs are stored whole, not only as many as
            # the writer's queue holds (it cannot run while they are put).  Not over a
            # refresh that asked later and stored first (see Flight.superseded).
            cache.put_many([s for s in stored if s[0] not in flights or not flights[s[0]].superseded])
            for k, _, _ in stored:
                older = supersedes.get(k)
                if older is not None:
                    older.superseded = True
            for k, data, _ in stored:
                if k in flights:
                    cache.flights.settle(k, flights[k], value=data)
        finally:
            for k, f in flights.items():  # whatever was not shared: its waiters ask again
                cache.flights.settle(k, f)

    seen = cache.generation  # (what was written before this call looked: see compute)

    async def body() -> EmbeddingResponse:
        todo = list(texts)
        if mode != "refresh":
            missed: list[bytes | None] = [None] * len(todo)
            values = await call.lookup(cache, lambda: cache.get_many(todo), missed)
            for key, data in zip(todo, values, strict=True):
                if take(key, data):
                    cache.hits += 1
                    came[key] = "hit"
            todo = [k for k in todo if k not in found]
        # What this call leads and what it waits on run side by side: a flight it
        # joined that is abandoned (its leader cancelled) is led again at once, not
        # after this call's own upstream batch (docs/cache.md, "Coalescing").
        orphans: list[str] = []
        apart: list[str] = []  # refused as another call's request: led without waiting

        def start(nursery: trio.Nursery, todo: list[str], refresh: bool = False) -> None:
            led: list[str] = []
            flights: dict[str, Flight] = {}
            supersedes: dict[str, Flight] = {}
            for key in todo:
                if mode == "refresh" or refresh:
                    flight: Flight | None = cache.flights.lead_if_free(key)
                    if flight is not None:
                        flight.request = params
                        flights[key] = flight
                    elif mode == "refresh":
                        older = cache.flights.open(key)
                        if older is not None:
                            supersedes[key] = older
                    led.append(key)
                    continue
                # The miss was decided before an await (the lookup, a wait on a
                # flight): an identical input's leader may have finished meanwhile,
                # its vector now held here.  Looked at again with no await between
                # the look and the claim (as chat does).
                if take(key, cache.get_local(key)):
                    cache.hits += 1
                    came[key] = "hit"
                    continue
                flight, leading = cache.flights.claim(key)
                if leading:
                    flight.request = params  # (the inputs: see Flight.batch)
                    flights[key] = flight
                    led.append(key)
                else:
                    nursery.start_soon(wait_on, nursery, key, flight)
            if led:
                nursery.start_soon(compute, led, flights, mode != "refresh" and not refresh, supersedes)

        @trio.lowlevel.enable_ki_protection  # (a task: see _session._ki_protected)
        async def wait_on(nursery: trio.Nursery, key: str, flight: Flight) -> None:
            await call.within(flight.done.wait)
            if flight.value is not None and take(key, flight.value):
                cache.coalesced += 1
                came[key] = "coalesced"
            elif flight.error is not None and (flight.batch is None or flight.batch <= own):
                if not _sent_alike(flight, params):
                    # a refusal of other parameters than this call's (as chat's): its
                    # inputs asked for at once, beside the leader's other waiters
                    apart.append(key)
                    if len(apart) == 1:
                        nursery.start_soon(relead, nursery, apart)
                    return
                error = call.shared(flight.error)
                if not call.recorded:
                    call.record(getattr(error, "call_stats", None) or call.stats(cached=False), None, error)
                raise error
            else:  # abandoned (or undecodable): lead it, with the others woken with it
                orphans.append(key)
                if len(orphans) == 1:
                    nursery.start_soon(relead, nursery, orphans)

        @trio.lowlevel.enable_ki_protection  # (a task: see _session._ki_protected)
        async def relead(nursery: trio.Nursery, pending: list[str]) -> None:
            # Started by the first of them: it runs after every waiter woken with it
            # (one leader's flights end together) has joined the list: one batch.
            todo = pending[:]
            pending.clear()
            start(nursery, todo, refresh=pending is apart)  # noqa: F821 (see the del below)

        try:
            try:
                if todo:
                    async with trio.open_nursery() as nursery:
                        start(nursery, todo)
                stale = _stale(found, fetched)
                if stale:
                    # Stored (or another call's) vectors of another length than this
                    # call's own from the upstream: the model behind the source changed
                    # (a `model=None` source on vLLM, Ollama).  A bad entry is a miss,
                    # never a failed call: fetched again, and stored over.
                    cache.failed(f"{len(stale)} stored vector(s) of another length than the "
                                 "upstream's now: fetched again", pause=False)
                    for key in stale:
                        del found[key]
                        kind = came.pop(key, None)
                        if kind == "hit":
                            cache.hits -= 1
                        elif kind == "coalesced":
                            cache.coalesced -= 1
                    async with trio.open_nursery() as nursery:
                        start(nursery, stale, refresh=True)
            except BaseExceptionGroup as group:
                error, rest = one_apart(group)
            else:
                return _embedding(call, inputs, keys, found, call.runs, fetched)
        finally:
            # start, wait_on and relead name each other (through their closure's cells):
            # a cycle, with the call's state, that only the cyclic collector would free,
            # every call.  (Emptying one of the cells ends it.)
            del start
        try:
            raise error from rest  # (outside the handler: see one_apart)
        finally:
            del error, rest  # (its traceback holds this frame: a cycle, for a Cancelled too)

    result: EmbeddingResponse = await _guard(call, body)
    return result


def _stale(
    found: Mapping[str, tuple[list[float], str | None, str | None, int | None, str | None]],
    fetched: set[str],
) -> list[str]:
    """The vectors to fetch again when the call's vectors disagree in length: those not
    fetched by this call, of another length than the ones it fetched (all of them when
    it fetched none).  Nothing when they agree, or when the fetched ones disagree among
    themselves (the scope's sources serve different models: an error, not a miss)."""
    lengths = {len(vector) for vector, *_ in found.values()}
    if len(lengths) <= 1:
        return []
    fresh = {len(found[k][0]) for k in fetched}
    if len(fresh) > 1:
        return []
    return [k for k, (vector, *_) in found.items() if k not in fetched and len(vector) not in fresh]


def _count_other_runs(call: _Call, exc: BaseException) -> None:
    """An embed run that failed reports its own attempts: the call's other runs count
    too, those finished before it and those still running (whose attempts started:
    they end with it, cancelled)."""
    stats = getattr(exc, "call_stats", None)
    if isinstance(stats, CallStats) and (call.runs or call.live):
        done = call.stats(cached=False)
        exc.call_stats = attrs.evolve(  # type: ignore[attr-defined]
            stats, attempts=stats.attempts + done.attempts,
            generation_ms=stats.generation_ms + done.generation_ms,
        )


def _encoded_vector(
    cache: Cache, vector: list[float], response: EmbeddingResponse, tokens: int | None,
    usage_source: str | None,
) -> bytes | None:
    try:
        return encode_vector(
            vector, model=response.model, source=response.source, tokens=tokens,
            usage_source=usage_source,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        cache.failed(f"a vector could not be stored ({type(exc).__name__})", pause=False)
        return None


def _token_shares(usage: Usage | None, texts: list[str]) -> list[int | None]:
    """The batch's prompt tokens split over its inputs by length (largest remainder),
    so the shares add up to what the upstream reported."""
    if usage is None:
        return [None] * len(texts)
    total = usage.prompt_tokens
    weights = [len(t) + 1 for t in texts]
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(texts)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return list(shares)


def _embedding(
    call: _Call,
    inputs: Sequence[str],
    keys: list[str],
    found: Mapping[str, tuple[list[float], str | None, str | None, int | None, str | None]],
    runs: list[EmbeddingResponse],
    fetched: set[str],
) -> EmbeddingResponse:
    vectors = [list(found[k][0]) for k in keys]
    distinct = {k: found[k] for k in dict.fromkeys(keys)}
    lengths: dict[int, str | None] = {}  # each vector length, and a source that sent it
    for vector, _, sent_by, _, _ in distinct.values():
        lengths.setdefault(len(vector), sent_by)
    if len(lengths) > 1:
        # Cached, coalesced and fresh vectors from sources serving different models
        # (a failover, a shared cache): they cannot be compared, so none is returned,
        # as when one call's batches disagree (_call._embedding_response).
        seen = ", ".join(f"{n} (source {name!r})" for n, name in lengths.items())
        error = FatalUpstreamError(
            f"the inputs of this call came back with vectors of different dimensions: {seen}; "
            f"the sources of scope {call.ctx.scope_name!r} must serve the same embedding model",
            source=list(lengths.values())[-1],
        )
        error.call_stats = call.stats(cached=False)
        raise error
    usage = _summed(distinct.values())
    # (What this call's own runs answered: a key pays for that, not for the hits.)
    upstream_usage = _summed(v for k, v in distinct.items() if k in fetched)
    model = next((m for _, m, _, _, _ in distinct.values() if m is not None), None)
    if runs:
        first = runs[0].call_stats
        source = runs[0].source
        stats = CallStats(
            logical_call_id=first.logical_call_id,
            attempts=sum(r.call_stats.attempts for r in runs),
            hedges=sum(r.call_stats.hedges for r in runs),
            source=first.source,
            scope=first.scope,
            total_latency_ms=(trio.current_time() - call.ctx.started_at) * 1000.0,
            generation_ms=sum(r.call_stats.generation_ms for r in runs),
        )
    else:
        source = next((s for _, _, s, _, _ in distinct.values() if s is not None), None)
        stats = call.stats(cached=True, source=source)
    call.record(stats, usage, None)  # the call's one row, upstream part or not
    return EmbeddingResponse(vectors=vectors, usage=usage, call_stats=stats, model=model,
                             source=source, upstream_usage=upstream_usage)


def _summed(
    found: Iterable[tuple[list[float], str | None, str | None, int | None, str | None]],
) -> Usage:
    """The usage of these inputs: their token shares, estimated if any share was."""
    tokens = 0
    estimated = False
    for _, _, _, share, usage_source in found:
        tokens += share or 0
        estimated = estimated or usage_source != "upstream"
    return Usage(tokens, 0, tokens, "estimated" if estimated else "upstream")
