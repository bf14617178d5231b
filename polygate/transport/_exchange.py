"""One HTTP exchange with one source: send, read (SSE or JSON), time every content chunk.

The exchange knows nothing of retries, admission or hedging.  It records what happened
on a :class:`Timeline` that the caller owns, so that a caller which cancels it halfway
(a hedge loser, a watchdog) still knows when the request went out and which chunks
arrived.  Every failure leaves as exactly one :class:`~polygate.UpstreamError`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import re
import sys
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import attrs
import httpx
import msgspec
import trio

from .._bugs import log_bug
from .._errors import (
    CONTEXT_CODES,
    POLICY_CODES,
    FatalUpstreamError,
    SourceDeadError,
    TransientUpstreamError,
    UpstreamError,
    classify_exception,
    classify_status,
    error_code,
    error_message,
    error_object,
    error_param,
    error_status,
    refusal_hint,
)
from .._json import loads
from .._secrets import clip, frameless, redact
from .._types import (
    CALL_PAYLOADS,
    LOGPROB_LISTS,
    NOT_TEXT_PARTS,
    call_type,
    carries_call,
    choice_index,
)
from ._assemble import ChatAssembler, _carries_function, carries_extras, index_over, malformed_index
from ._head import header_of
from ._pool import (
    SENT_EXTENSION,
    LeanTransport,
    answered_on_close,
    body_of,
    close_now,
    is_lean,
    reports_sent,
)
from ._sse import Event, SSEDecoder, without_bom
from ._wire import (
    MAX_JSON_DEPTH,
    Endpoint,
    Limits,
    all_text,
    as_text,
    body_pieces,
    body_wait,
    chat_body,
    check_depth,
    check_encoding,
    check_readable,
    embeddings_body,
    over_cap,
    parse_retry_after,
    raise_for_status,
    read_capped,
)

__all__ = ["OnContent", "OnExtra", "Timeline", "chat_exchange", "embeddings_exchange"]

_log = logging.getLogger("polygate.transport")
T = TypeVar("T")
# json.loads on bytes first sniffs the encoding in Python; SSE is UTF-8 by definition.
_decode_json = json.JSONDecoder().decode

#: Called with every content chunk as it is decoded (and the time it was).  It
#: returns ``None`` when it is done with the chunk, or an awaitable the exchange
#: awaits before it reads on (a committed stream whose caller is behind): no
#: coroutine per chunk on the usual path.
OnContent = Callable[[float, dict[str, Any]], Awaitable[None] | None]
#: Called with a chunk that carries no content token but data a stream's caller must
#: see (``carries_extras``); the same contract as :data:`OnContent`, with no time.
OnExtra = Callable[[dict[str, Any]], Awaitable[None] | None]


@attrs.define
class Timeline:
    """When things happened during one exchange (``trio.current_time()`` seconds)."""

    sent_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    # Doubles in an array, not float objects in a list: 8 bytes a token, not 32.
    chunk_times: array[float] = attrs.Factory(lambda: array("d"))
    status_code: int | None = None
    streamed: bool = False
    # Time the reader spent held by its caller (a committed stream's slow consumer):
    # the caller's, not the upstream's.  Chunk times are stamped net of it, so gaps
    # between them are the upstream's own; durations subtract it.
    paused_s: float = 0.0
    #: The longest of those holds, at one stretch (polygate._attempt: a server may cut
    #: a reader that stops reading that long).
    longest_hold_s: float = 0.0
    #: Set once every choice had its finish_reason (a stream; the time of its last
    #: token, 0.0 without one): nothing more can be said, so silence after it is no
    #: stall (polygate._hedge, polygate._attempt).
    finished_at: float | None = None
    #: The usage a stream reported before it was cut (vLLM's continuous usage: on
    #: every chunk), read only if it fails: a resumed answer's usage counts it.
    cut_usage: Callable[[], dict[str, Any] | None] | None = None
    #: What the request carried of polygate's own way of asking: whether it asked for
    #: a stream, and for usage in it (``stream_options``) -- what a refusal refused,
    #: whatever other calls have learnt of the source since (``Endpoint.asking``).
    sent_stream: bool = False
    sent_stream_options: bool = False
    #: Set when an answer came (the source computed it, and may bill it) that polygate
    #: then refused as the request's error (an embeddings answer too large, or of
    #: other dimensions): it settles its estimate, not the nothing of a refusal.
    billed: bool = False

    @property
    def last_token_at(self) -> float | None:
        return self.chunk_times[-1] if self.chunk_times else None


async def chat_exchange(
    transport: httpx.AsyncBaseTransport,
    endpoint: Endpoint,
    messages_json: str | bytes,
    params: Mapping[str, Any],
    *,
    limits: Limits,
    timeline: Timeline,
    on_content: OnContent | None = None,
    call_id: str | None = None,
    trace: Sequence[tuple[str, str]] = (),
    hand_on_first_token: bool = True,
    on_extra: OnExtra | None = None,
    on_finished: Callable[[float], float] | None = None,
    choices: int = 1,
    plain: bool | None = None,
) -> dict[str, Any]:
    """Run one chat completion and return the (assembled) non-streamed response body.

    ``plain``: whether ``params``' keys are all plain, where the caller knows it
    (:func:`chat_body`).

    ``choices``: how many the answer has (the request's ``n``, read as the upstream
    reads it).

    ``on_finished``: called once a stream's every choice has its finish_reason and the
    rest of it must be waited for, with the instant that wait ends (the watchdogs
    stop: silence after the end is no stall).

    ``hand_on_first_token``: someone waits for the first token (a stream's caller), so
    a read that brings more than it is parsed after a pass of the scheduler (see
    :func:`_hand_on_first_token`); False where the whole answer is all anyone waits for
    (a ``chat()`` that no hedge watches), which saves two scheduler passes a call.

    ``trace``: the attempt's trace context headers (``traceparent``…), sent as they are."""
    stream = endpoint.streams

    async def read(response: httpx.Response) -> dict[str, Any]:
        ctype = header_of(response, "content-type")
        labelled = ctype.partition(";")[0].strip().lower() == "text/event-stream"  # any case, any params
        if not stream and not labelled:
            return await _read_chat_json(response, endpoint, limits, ctype)
        if stream and labelled:
            timeline.streamed = True
            return await _read_sse(response, endpoint, limits, timeline, on_content,
                                   hand_on=hand_on_first_token, on_extra=on_extra,
                                   choices=choices, on_finished=on_finished)
        # Any other label, or none: openai-python reads a stream request's answer as
        # SSE whatever the header says, so an upstream that sends its events unlabelled
        # (or as application/json, application/x-ndjson...) streams.  The body decides:
        # SSE if it starts as SSE, else a whole JSON body as before -- an upstream that
        # ignored "stream", or an error object inside a 200.  So does a plain request's
        # answer labelled as events: an upstream (or a proxy before it) that streams
        # whatever it is asked, or one that labels its JSON so.
        # before a byte is read
        check_readable(response, limits.max_body_bytes, endpoint.name, endpoint.secrets)
        pieces = body_of(response) or body_pieces(response)
        head = await _sniff(pieces, limits.max_line_bytes)
        if _SSE_START.match(head):
            timeline.streamed = True
            return await _read_sse(response, endpoint, limits, timeline, on_content, pieces, head,
                                   hand_on=hand_on_first_token, on_extra=on_extra,
                                   choices=choices, on_finished=on_finished)
        return await _read_chat_json(response, endpoint, limits, ctype, pieces, head)

    body = chat_body(endpoint, messages_json, params, stream, plain)
    timeline.sent_stream = stream
    timeline.sent_stream_options = stream and endpoint.asking.stream_options
    return await _exchange(
        transport, endpoint, endpoint.chat_url, body, call_id, timeline, read, trace
    )


async def _exchange(
    transport: httpx.AsyncBaseTransport,
    endpoint: Endpoint,
    url: httpx.URL,
    body: bytes,
    call_id: str | None,
    timeline: Timeline,
    read: Callable[[httpx.Response], Awaitable[T]],
    trace: Sequence[tuple[str, str]] = (),
) -> T:
    """POST ``body``, check the status, ``read`` the response, close it, and turn any
    failure into one UpstreamError; the timeline records send, status and end.

    Everything happens inside the ``try``, building the request included (a header
    value httpx cannot encode is a typed error too).  The error leaves *outside* the
    ``except`` block, so it carries no ``__context__``: the httpx exception it
    replaces holds the request, and the request holds the key.

    ``timeline.sent_at`` is stamped when the request is written: LeanTransport
    reports the write through the :data:`SENT_EXTENSION` callable, after any wait
    for a connection and the connect, and so do the fakes of ``polygate.testing``
    (see :data:`REPORTS_SENT`).  Another transport cannot say when it writes, so the
    request counts as sent when it is handed over (the safe side for quotas) -- but
    only if the attempt was not cancelled first: a hedge launched in the instant its
    round was decided is cancelled before it ever reaches the transport, and is not
    a hedge sent (``CallStats.hedges``).
    """
    error: UpstreamError
    handled = sys.exc_info()[1]  # the caller's, if it calls from an except block
    if endpoint.key_problem is not None:
        # Nothing is sent: the source is unusable as configured (its key cannot be a
        # header).  Dead, like a source that answers 401: the others carry the calls.
        raise SourceDeadError(endpoint.key_problem, source=endpoint.name)
    request: httpx.Request | None = None
    response: httpx.Response | None = None
    try:
        def sent() -> None:
            timeline.sent_at = trio.current_time()

        if type(transport) is LeanTransport:  # (a subclass may hook handle_async_request)
            # No httpx.Request to build and take apart (LeanTransport.post); None
            # for a request that is not plain, which then takes the path below.
            response = await transport.post(url, endpoint.headers(call_id, trace), body, sent)
        if response is None:
            request = httpx.Request(
                "POST", url, content=body, headers=endpoint.headers(call_id, trace),
                extensions={SENT_EXTENSION: sent},
            )
            # A cancelled attempt never reaches the transport (as LeanTransport never
            # writes one): a hedge launched in the instant its round was decided.
            await trio.lowlevel.checkpoint_if_cancelled()  # (no yield unless cancelled)
            if not reports_sent(transport):
                sent()
            response = await _send(transport, request)
            if not is_lean(response) and isinstance(response.stream, httpx.AsyncByteStream):
                # A caller's transport: httpx closes its body itself as the body ends
                # (aiter_raw), where a close that fails would be raised from the read.
                response.stream = _QuietClose(response.stream, endpoint)
        try:
            timeline.status_code = response.status_code
            await raise_for_status(response, endpoint)
            result = await read(response)
            if timeline.ended_at is None:
                timeline.ended_at = trio.current_time()
            return result
        except UpstreamError as exc:
            if exc.status_code is not None and response.status_code < 300:
                # An error inside a 200 (a JSON error body, an SSE error event) with a
                # code: the response's Retry-After applies, as on that real status,
                # before the body's own (raise_for_status's order).
                header = parse_retry_after(response.headers)
                if header is not None:
                    exc.retry_after_s = header
            raise
        finally:
            await _close(response, endpoint)
    except UpstreamError as exc:
        # Every message leaves redacted, whatever built it: some quote what the
        # upstream sent (a header's value, its body), which may carry the key.
        message = redact(exc.message, endpoint.secrets)
        if message != exc.message:
            exc.message = message
            exc.args = (message,)
        # Nor do the frames that read the answer go with it (a crash reporter records
        # their locals: the body, the request's headers): it is raised from here.
        del request, response
        raise frameless(exc, handled=handled)  # noqa: B904 (the same error, not a new one)
    except Exception as exc:
        error = _classified(exc, endpoint)
    except BaseException as exc:
        # A cancellation (the caller's own fail_after) becomes a TimeoutError's
        # context: its frames below held the request's bytes, its key in them.
        del request, response
        raise frameless(exc, handled=handled)  # noqa: B904 (the same one)
    del request, response
    raise error from None


async def _send(transport: httpx.AsyncBaseTransport, request: httpx.Request) -> httpx.Response:
    """Straight to the transport: httpx.AsyncClient would add cookie jars, redirects,
    auth flows and event hooks that an API client must not have, and they cost more
    than the rest of polygate's per-call work together."""
    response = await transport.handle_async_request(request)
    response.request = request
    return response


async def _close(response: httpx.Response, endpoint: Endpoint) -> None:
    """Release (or, after a cancellation, drop) the connection.  A body read to its end
    is closed already; otherwise the close does no network I/O that could hang, so
    shielding it cannot delay a cancellation.  A LeanTransport response closes without
    an await at all, so it needs no shield (a cancel scope each call: ~3 µs)."""
    if not response.is_closed and not close_now(response):
        with trio.CancelScope(shield=True):
            await _closed_quietly(response.aclose, endpoint)


class _QuietClose(httpx.AsyncByteStream):
    """A caller's transport's body, its close made quiet (see :func:`_closed_quietly`)."""

    __slots__ = ("_endpoint", "_inner")

    def __init__(self, inner: httpx.AsyncByteStream, endpoint: Endpoint) -> None:
        self._inner = inner
        self._endpoint = endpoint

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._inner.__aiter__()

    async def aclose(self) -> None:
        await _closed_quietly(self._inner.aclose, self._endpoint)


async def _closed_quietly(close: Callable[[], Awaitable[object]], endpoint: Endpoint) -> None:
    """A close that fails (a caller's transport: a test harness's body stream, a bug)
    is logged, never raised: it would take the place of what was under way -- the
    answer in hand, the error that explains the failure, or the cancellation that cut
    the call (then counted a failure of the source's, feeding its breaker: a source cut
    by five deadlines was shut out).  Its connection is not reused either way."""
    try:
        await close()
    except Exception as exc:
        log_bug(_log, exc, f"closing a response of {endpoint.name}", endpoint.secrets)


#: Failures that bytes from an upstream can cause; anything else is more likely a bug.
_INPUT_ERRORS = (httpx.HTTPError, ValueError, UnicodeDecodeError, RecursionError)

def _classified(exc: BaseException, endpoint: Endpoint) -> UpstreamError:
    """The one polygate error for whatever the wire or the bytes raised.  Anything
    that is not a known network or decoding failure is logged with its traceback
    (rate-limited): it is more likely a bug than an upstream fault, but one
    attempt's bug must not become the caller's crash."""
    error = classify_exception(exc, source=endpoint.name)
    if not isinstance(exc, _INPUT_ERRORS) and error.exhausted is None:  # (not this process's)
        log_bug(_log, exc, f"in an exchange with {endpoint.name}", endpoint.secrets)
    error.message = redact(error.message, endpoint.secrets)
    error.args = (error.message,)
    return error


#: How an SSE body starts (after blank lines): a comment, or a field of the standard.
#: JSON starts with none of them; neither does an HTML page or a plain-text error.
_SSE_START = re.compile(rb":|(?:data|event|id|retry)(?::|\r|\n|$)")


async def _sniff(pieces: AsyncIterator[bytes], limit: int) -> bytes:
    """The first bytes of a body, enough to tell SSE from JSON: six bytes past any
    leading whitespace, or all there is.  The whitespace is dropped (it means nothing
    before an SSE field or a JSON value), and at most ``limit`` bytes of it are read."""
    head = b""
    skipped = 0
    # A leading byte order mark means nothing either; its bytes may come in reads of
    # their own (``mark``: what came of one so far, until it is decided).
    mark: bytes | None = b""
    while len(head) < 6:
        try:
            piece = await pieces.__anext__()
        except StopAsyncIteration:
            break
        if mark is not None:
            rest = without_bom(mark + piece)
            if rest is None:
                mark += piece
                continue
            mark, piece = None, rest
        if not head:
            kept = piece.lstrip()
            skipped += len(piece) - len(kept)
            if skipped > limit:
                break  # read as a JSON body: not JSON, or over the body cap
            piece = kept
        head += piece
    return head


async def _held(
    wait: Awaitable[None], timeline: Timeline, tail: float | None, rest_until: float | None
) -> tuple[float | None, float | None]:
    """Wait for a caller that is behind (its time is its own, ``Timeline.paused_s``); after
    the finish, the grace and its bound move by it: what the upstream sent meanwhile
    (a usage chunk, ``[DONE]``) is read, not cut as if it came late."""
    paused = timeline.paused_s
    await wait
    if tail is None:
        return None, rest_until
    if rest_until is not None:
        rest_until += timeline.paused_s - paused
    return 0.0, rest_until


async def _read_sse(
    response: httpx.Response,
    endpoint: Endpoint,
    limits: Limits,
    timeline: Timeline,
    on_content: OnContent | None,
    pieces: AsyncIterator[bytes] | None = None,
    head: bytes = b"",
    *,
    hand_on: bool = True,
    on_extra: OnExtra | None = None,
    choices: int = 1,
    on_finished: Callable[[float], float] | None = None,
) -> dict[str, Any]:
    """``pieces``/``head``: the body's iterator after :func:`_sniff` read ``head``;
    ``hand_on``: as ``hand_on_first_token`` of :func:`chat_exchange`; ``on_extra``,
    ``on_finished``: as in :func:`chat_exchange`; ``choices``: how many the answer has
    (the request's ``n``)."""
    refused = check_encoding(response, endpoint.name, endpoint.secrets)
    if refused is not None:
        raise TransientUpstreamError(refused, source=endpoint.name)
    decoder = SSEDecoder(
        max_body=limits.max_body_bytes, max_line=limits.max_line_bytes, source=endpoint.name
    )
    assembler = ChatAssembler(
        max_choices=limits.max_choices, max_tool_calls=limits.max_tool_calls,
        source=endpoint.name,
    )
    chunk_times = timeline.chunk_times
    timeline.cut_usage = assembler.last_usage
    depth = limits.max_json_depth
    if pieces is None:
        pieces = body_of(response) or body_pieces(response)
    events_of = decoder.feed
    add = assembler.add
    current_time = trio.current_time
    done = ended = False
    #: Once every choice has finished: until when the rest (a usage chunk, [DONE]) may
    #: come; 0.0 until a read needs it (usually the same read brought the end: no
    #: clock is read, no scope made).
    tail: float | None = None
    # The attempt's own bound on what comes after its finish (its timeout_s, moved by
    # the time its caller held it): content that goes on after a finish_reason re-arms
    # the grace, never past this.  (None: no finish yet.)
    rest_until: float | None = None
    # (As ``async with aclosing(pieces)``, without its three calls a response.)
    try:
        iterator = pieces.__aiter__()
        while True:
            # One path for every event, the last one (``flush``) included; it runs
            # for every token, so the steps are written out here, not called.
            if head:  # the sniffed bytes go first (an exhausted iterator stays so)
                events, head = events_of(head), b""
            else:
                try:
                    if tail is None:
                        piece = await iterator.__anext__()
                    else:
                        if not tail:
                            tail = current_time() + END_GRACE_S
                            if rest_until is None:
                                rest_until = math.inf
                                if on_finished is not None:
                                    # (The attempt's own clocks stop.)
                                    rest_until = on_finished(tail)
                            else:  # re-armed by content after the finish
                                tail = min(tail, rest_until)
                            # A deadline around the call that falls inside the grace
                            # ends the grace, not the call: the answer is in hand, with
                            # what came of the rest (its usage), and there is time to
                            # hand it over.
                            tail = min(tail, trio.current_effective_deadline() - END_MARGIN_S)
                        piece = None
                        with trio.move_on_at(tail):
                            piece = await iterator.__anext__()
                except StopAsyncIteration:
                    events = decoder.flush()
                    ended = True
                except Exception as exc:
                    if not assembler.finished:
                        raise
                    # Every choice had its finish_reason: complete without [DONE] (SPEC
                    # §3), whether the body then ends cleanly, is cut mid-frame or reset
                    # (or a caller's transport fails as its body ends: its close).
                    if not isinstance(exc, httpx.TransportError):
                        log_bug(_log, exc, f"reading the end of {endpoint.name}'s answer", endpoint.secrets)
                    events = decoder.flush()
                    ended = True
                else:
                    if piece is None:
                        # Every choice finished, then nothing for END_GRACE_S: complete
                        # without [DONE] (SPEC §3), its connection closed (the body has
                        # not ended).  A proxy that holds the end back, or a server that
                        # writes [DONE] late, must not turn a delivered answer into a
                        # stall, a timeout, a hedge, or a retry paid for twice.
                        events, ended = [], True
                    else:
                        events = events_of(piece)
            for event in events:
                try:
                    chunk = _chunk_of(event, endpoint, depth)
                except Exception:
                    if ended and assembler.finished:
                        # The body ended inside an event after the answer had its
                        # finish_reason: an event never completed is not dispatched
                        # (WHATWG), and the answer is complete (SPEC §3).
                        break
                    raise
                if chunk is None:
                    done = True
                    break
                content = add(chunk)
                if assembler.malformed is not None:
                    raise TransientUpstreamError(assembler.malformed, source=endpoint.name)
                if content:
                    now = current_time()
                    if not chunk_times:
                        timeline.first_token_at = now
                    chunk_times.append(now - timeline.paused_s)
                    if tail is not None:
                        # Content after every choice said its finish_reason (a proxy
                        # that sends "stop" on every chunk: LiteLLM's for Gemini, Open
                        # WebUI's): the grace bounds the silence after it, not the rest.
                        tail = 0.0
                        timeline.finished_at = chunk_times[-1]
                    if on_content is not None:
                        wait = on_content(now, chunk)
                        if wait is not None:
                            tail, rest_until = await _held(wait, timeline, tail, rest_until)
                        elif hand_on and len(chunk_times) == 1 and event is not events[-1]:
                            await _hand_on_first_token()
                elif on_extra is not None and carries_extras(chunk):
                    wait = on_extra(chunk)  # (no token: no time, no watchdog)
                    if wait is not None:
                        tail, rest_until = await _held(wait, timeline, tail, rest_until)
            if done or ended:
                break
            if tail is None and assembler.finishes >= choices and assembler.all_finished(choices):
                tail = 0.0
                timeline.finished_at = chunk_times[-1] if chunk_times else 0.0
        if done:
            timeline.ended_at = current_time()
            if not answered_on_close(pieces):  # (the close below drains a lean body)
                await _drain_buffered(pieces, endpoint)
    finally:
        await _closed_quietly(pieces.aclose, endpoint)  # type: ignore[attr-defined]
    # After [DONE] the answer is complete: it is never held for the rest of the body.
    # What had already arrived was read (a body whose end is here finishes, and its
    # connection can be reused); closing the response closes a body still open.
    if timeline.ended_at is None:
        timeline.ended_at = current_time()
    if not done and not assembler.finished:
        raise TransientUpstreamError(
            "stream ended before [DONE] and before every choice's finish_reason (truncated)",
            source=endpoint.name,
        )
    if not assembler.saw_choice:
        # ``data: {}`` or only a usage chunk, then [DONE]: an answer with no choice is
        # no answer (a JSON body without choices is refused the same way), so it is
        # retried elsewhere and never cached as an empty text.  Choices that carried
        # no content (``"content": ""``, a finish_reason) are an empty answer.
        raise TransientUpstreamError("malformed stream: no choices in the answer",
                                     source=endpoint.name)
    return assembler.build()


#: How long a stream whose every choice has finished may take to end (its usage
#: chunk, then [DONE]): those come at once from every server seen, so a wait past this
#: is an end held back, not an answer still coming.
END_GRACE_S: Final = 1.0
#: How long before a deadline around the call the grace ends when the deadline falls
#: inside it: time to settle and hand the answer over before the deadline cuts the call.
END_MARGIN_S: Final = 0.05


async def _hand_on_first_token() -> None:
    """Let whoever waits for the first token run before the rest of its read is
    parsed: a read that brings a whole answer (an upstream that generated it before
    the request's head went out, or a burst) would otherwise keep the first token
    back for as long as the other chunks take, ~50 µs each.

    Two scheduling points, not cancellation points: a task woken by the first token
    runs in the next batch, in which trio may order this task first; by the second,
    the woken task has had its turn."""
    await trio.lowlevel.cancel_shielded_checkpoint()
    await trio.lowlevel.cancel_shielded_checkpoint()


async def _drain_buffered(pieces: Any, endpoint: Endpoint) -> None:
    """Read the rest of a body only as far as it is already here: in a cancel scope
    cancelled from the start, the first read that would wait (a checkpoint) ends the
    drain at once, and a rest already buffered is consumed without one."""
    with trio.CancelScope() as drain:
        drain.cancel()
        try:
            async for _ in pieces:
                pass
        except (httpx.HTTPError, TransientUpstreamError):
            pass  # the answer is complete; whatever follows it does not matter
        except Exception as exc:  # (a caller's transport failing as its body ends: its close)
            log_bug(_log, exc, f"reading past the end of {endpoint.name}'s answer", endpoint.secrets)


def _slow_chunk(data: bytes) -> Any:
    """A chunk msgspec did not read: strict UTF-8 (a bad byte fails the stream), and a
    lone surrogate escape read as U+FFFD."""
    text = data.decode("utf-8")
    chunk = _decode_json(text)
    if "\\u" in text:  # a string search first: an escape is rare in a chunk
        chunk = as_text(chunk, text)
    return chunk


def _slow_body(raw: bytes) -> Any:
    """A body msgspec did not read, as ``json.loads`` reads bytes, lone surrogates
    read as U+FFFD.  ``json.loads`` also reads UTF-16 and UTF-32 (a NUL in the first
    bytes, or their byte-order mark), where no byte pattern finds an escaped
    surrogate: every string is checked then."""
    payload = json.loads(raw)
    if b"\x00" in raw[:4] or raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return all_text(payload)
    return as_text(payload, raw)


def _chunk_of(event: Event, endpoint: Endpoint, max_depth: int) -> dict[str, Any] | None:
    """One event's chunk; ``None`` for ``[DONE]``.  Error events raise."""
    data = event.data
    if event.event == "error":
        raise _error_event(data.decode("utf-8", "replace"), endpoint)
    # As openai-python (``sse.data.startswith("[DONE]")``), with spaces before it too;
    # like it, case-sensitive: ``[done]`` is no end, and not JSON (a malformed stream).
    # (A chunk, nearly every event, starts with its "{": then neither test can hold, and
    # a one-byte slice is a shared object -- two method calls and a copy fewer.)
    if data[:1] != b"{" and data.lstrip().startswith(b"[DONE]"):
        return None
    # Nesting needs 2 bytes a level: short events (nearly all) skip the depth check.
    if len(data) > 2 * max_depth:
        check_depth(data, max_depth, endpoint.name)
    chunk = loads(data, _slow_chunk)
    if type(chunk) is not dict:
        raise TransientUpstreamError(
            f"malformed stream chunk: expected an object, got {type(chunk).__name__}",
            source=endpoint.name,
        )
    if _is_error(chunk):
        raise _error_event(chunk, endpoint)
    choices = chunk.get("choices")
    if type(choices) is list:
        for choice in choices:
            if type(choice) is not dict:
                continue
            delta = choice.get("delta")
            if type(delta) is dict and type(delta.get("content")) is list:
                _flatten_parts(delta)
            if choice.get("finish_reason") is not None:
                _refuse_failed(choice, endpoint)
    return chunk


#: Finish reasons that say the answer failed: OpenRouter's "error" (its error beside
#: it), Zhipu's "network_error" ("the model's inference failed").
_FAILED = frozenset({"error", "network_error"})


def _refuse_failed(choice: dict[str, Any], endpoint: Endpoint) -> None:
    """Raise the error of a choice that finished failed (see ``_FAILED``)."""
    reason = choice.get("finish_reason")
    if type(reason) is str and reason in _FAILED:
        raise _choice_error(choice, endpoint)


def _choice_error(choice: dict[str, Any], endpoint: Endpoint) -> UpstreamError:
    """A choice that finished with an error (OpenRouter: ``finish_reason: "error"``, the
    error beside it in the choice): no answer, however much of it came, but an error
    event, classified by its code (a 502 of the provider behind it: transient)."""
    error = choice.get("error")
    return _error_event(
        {"error": error if isinstance(error, dict) else {
            "message": "the upstream finished the answer with an error"}},
        endpoint,
    )


def _typed_fields(message: dict[str, Any]) -> None:
    """A whole answer's message without the values the stream's assembler ignores for
    their type: a ``refusal`` that is no string is null, ``tool_calls`` keep their
    objects (none left, or no list: no key), a ``function_call`` that is no object is
    dropped.  Kept, ``refusal: 5`` or ``tool_calls: "x"`` reached the caller, and
    structured output took them for the model declining, with no re-ask.  Each call
    is typed as the assembled one is (:func:`_typed_call`)."""
    refusal = message.get("refusal")
    if refusal is not None and type(refusal) is not str:
        message["refusal"] = None
    calls = message.get("tool_calls")
    if calls is not None and not (type(calls) is list and all(
            type(c) is dict and carries_call(c) for c in calls)):
        # (A call as the assembler keeps one: an object that sets an id, a type or a
        # payload object; ``{}`` or ``{"function": "f"}`` is none.)
        kept = [c for c in calls if type(c) is dict and carries_call(c)] if type(calls) is list else []
        if kept:
            message["tool_calls"] = calls = kept
        else:
            del message["tool_calls"]
            calls = None
    if calls:
        for call in calls:
            _typed_call(call)
    function_call = message.get("function_call")
    if function_call is not None:
        if type(function_call) is not dict or not _carries_function(function_call):
            del message["function_call"]  # (no object, or one with no name or arguments)
        else:
            _payload_strings(function_call, ("name", "arguments"))
    content = message.get("content")
    if content is not None and type(content) is not str and type(content) is not list:
        # A number, an object: no text, as a stream's is read -- null beside calls or
        # a refusal, "" alone (the assembled message's rule).
        message["content"] = None if (message.get("tool_calls") or message.get("function_call")
                                      or message.get("refusal")) else ""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is not None and type(value) is not str:
            del message[key]


def _typed_call(call: dict[str, Any]) -> None:
    """A whole answer's tool call as the assembler builds one: its ``id`` (null when it
    is none, no string or ``""``), its ``type`` (:func:`call_type`), and its payload's
    ``name`` and ``arguments`` (a custom tool's ``name`` and ``input``) strings.  Kept
    as sent, an ``arguments`` object reached an agent loop's ``json.loads`` (a
    TypeError) and an ``id`` of 7 its next turn."""
    cid = call.get("id")
    if not (type(cid) is str and cid):
        call["id"] = None
    kind = call_type(call)
    call["type"] = kind
    fields = CALL_PAYLOADS.get(kind)
    if fields is None:
        return
    payload = call.get(kind)
    if type(payload) is not dict:
        call[kind] = dict.fromkeys(fields, "")
    else:
        _payload_strings(payload, fields)


def _payload_strings(payload: dict[str, Any], fields: tuple[str, ...]) -> None:
    """Each of ``fields`` a string: a call's ``arguments`` (a custom tool's ``input``)
    that is an object or a list as its JSON (a few servers send arguments as an
    object: the JSON text is what OpenAI's format holds), anything else, or nothing,
    ``""``."""
    for field in fields:
        value = payload.get(field)
        if type(value) is not str:
            payload[field] = (json.dumps(value, ensure_ascii=False)
                              if field != "name" and (type(value) is dict or type(value) is list)
                              else "")


def _typed_logprobs(choice: dict[str, Any]) -> None:
    """A whole answer's choice ``logprobs`` as the stream's relay passes them: no
    object is none, and a ``content`` or ``refusal`` that is no list is left out."""
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return
    if type(logprobs) is not dict:
        choice["logprobs"] = None
        return
    for key in LOGPROB_LISTS:
        value = logprobs.get(key)
        if value is not None and type(value) is not list:
            del logprobs[key]


def _whole_parts(message: dict[str, Any]) -> None:
    """A whole answer's content in typed parts, read as the stream's deltas of the same
    answer are (:func:`_flatten_parts`): thinking and reasoning parts are its
    ``reasoning_content``, refusal parts its ``refusal``, and the rest its content --
    a string when every part left is plain text (``type`` and ``text`` alone), else
    those parts as they came (an image, a text's annotations or citations: flattened,
    the caller lost them; ``message_text`` reads their text)."""
    answer = {k: v for k, v in message.items() if k in ("reasoning_content", "refusal")}
    rest = []
    said = []
    for part in message["content"]:
        if type(part) is dict and part.get("type") in NOT_TEXT_PARTS:
            said.append(part)
        else:
            rest.append(part)
    answer["content"] = said
    _flatten_parts(answer)
    for key in ("reasoning_content", "refusal"):
        if answer.get(key):
            message[key] = answer[key]
    # (A text part whose ``text`` is null or missing is plain too: no text, as the
    # stream reads it.)
    if all(type(p) is dict and _TEXT_PART_KEYS.issuperset(p)
           and (p.get("text") is None or type(p["text"]) is str) for p in rest):
        message["content"] = "".join(p["text"] for p in rest if type(p.get("text")) is str)
    else:
        message["content"] = rest


#: The fields of a plain text part.
_TEXT_PART_KEYS: Final = frozenset({"type", "text"})


def _flatten_parts(delta: dict[str, Any]) -> None:
    """A delta whose ``content`` is a list of typed parts (Mistral's magistral models
    stream ``{"type": "thinking", "thinking": [...]}`` then ``{"type": "text", ...}``
    parts, the shape of their non-streamed message) as the string deltas every
    OpenAI-compatible stream sends: the text parts become ``content``, the thinking
    parts ``reasoning_content`` (a ``reasoning`` part too), refusal parts ``refusal``.
    So the answer's text is assembled, a part is a content
    token (for the commit and the watchdog), and the gateway relays a string."""
    text: list[str] = []
    thought: list[str] = []
    refused: list[str] = []
    for part in delta["content"]:
        if type(part) is not dict:
            continue
        kind = part.get("type")
        if kind == "thinking" or kind == "reasoning":
            # (A reasoning part is no answer text either: kept out of the content.)
            inner = part.get("thinking", part.get("text"))
            if isinstance(inner, str):
                thought.append(inner)
            elif isinstance(inner, list):
                thought += [p["text"] for p in inner if type(p) is dict and isinstance(p.get("text"), str)]
        elif kind == "refusal":
            # OpenAI's own part for a refusal: the message's refusal, as a streamed
            # refusal is (as text it was lost, and structured output re-asked it).
            if isinstance(part.get("refusal"), str):
                refused.append(part["refusal"])
        elif isinstance(part.get("text"), str):
            text.append(part["text"])
    delta["content"] = "".join(text)
    if thought:
        earlier = delta.get("reasoning_content")
        delta["reasoning_content"] = (earlier if isinstance(earlier, str) else "") + "".join(thought)
    if refused:
        earlier = delta.get("refusal")
        delta["refusal"] = (earlier if isinstance(earlier, str) else "") + "".join(refused)


_STATUS_OF_CODE: dict[str | None, int] = {
    **dict.fromkeys(CONTEXT_CODES | POLICY_CODES, 400),
    "rate_limit_exceeded": 429,
    "insufficient_quota": 429,  # (out of credit: dead, see classify_status)
    "invalid_api_key": 401,
    # Anthropic's error types (an event's error.type, when it has no code)
    "rate_limit_error": 429,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "invalid_request_error": 400,
    "request_too_large": 413,
}


def _error_type(payload: Any) -> str | None:
    """An error payload's ``type``, when it is a string."""
    inner = error_object(payload)
    kind = inner.get("type") if inner is not None else None
    return kind if isinstance(kind, str) else None


def _error_event(payload: Any, endpoint: Endpoint) -> UpstreamError:
    """An error inside a 200 stream: classified by its code like an HTTP status."""
    if isinstance(payload, str):
        try:
            check_depth(payload.encode(), MAX_JSON_DEPTH, endpoint.name)
            payload = as_text(json.loads(payload), payload)
        except (ValueError, UpstreamError):
            pass
    status = error_status(payload)
    detail = "error event in stream: " + error_message(payload, 300, endpoint.secrets)
    code = error_code(payload, endpoint.secrets)
    if status is None or 200 <= status < 300:
        # No status, but perhaps a code that says what an HTTP status would have: the
        # request as the problem (too long for the context, refused by a content
        # policy: a 400, which retried elsewhere or resumed would be routed around), a
        # rate limit (a 429: the source cools down), a refused key (a 401: dead).
        status = _STATUS_OF_CODE.get(code)
        if status is None:
            # OpenAI's events name both: {"type": "invalid_request_error", "code":
            # "invalid_value"}: a code it does not know leaves the type to say it.
            status = _STATUS_OF_CODE.get(_error_type(payload))
    if status is None:
        error: UpstreamError = TransientUpstreamError(detail, source=endpoint.name)
    else:
        # The wait the body gives (Google's retryDelay), as an HTTP error body's: a
        # Gemini rate limit inside a 200 cools its source down as long as one outside.
        # (The response's own Retry-After, where there is one, still comes first: see
        # _exchange.)
        # (``code`` is the body's code, else its type: error_code reads both.)
        error = classify_status(
            status, detail, source=endpoint.name, code=code, hint=refusal_hint(status, payload),
            retry_after_s=body_wait(payload),
        )
    error.code = code
    error.param = error_param(payload, endpoint.secrets)
    return error


async def _read_json(
    response: httpx.Response,
    endpoint: Endpoint,
    limits: Limits,
    ctype: str | None = None,
    pieces: AsyncIterator[bytes] | None = None,
    head: bytes = b"",
) -> Any:
    raw = await read_capped(
        response, limits.max_body_bytes, endpoint.name, endpoint.secrets, pieces, head)
    check_depth(raw, limits.max_json_depth, endpoint.name)
    try:
        payload = loads(raw, _slow_body)
    except ValueError:
        if ctype is None:
            ctype = response.headers.get("content-type", "?")
        # The media type only (its parameters are the upstream's to fill), redacted
        # before it is cut (a cut key no longer matches whole).
        shown = clip(ctype.split(";", 1)[0].strip(), 80, endpoint.secrets)
        raise TransientUpstreamError(
            f"malformed upstream body: not JSON (content-type {shown}, {len(raw)} bytes)",
            source=endpoint.name,
        ) from None
    if isinstance(payload, dict):
        if _is_error(payload):
            raise _error_event(payload, endpoint)
        choices = payload.get("choices")
        if type(choices) is list:
            for choice in choices:
                if type(choice) is dict:
                    _refuse_failed(choice, endpoint)
    return payload


def _is_error(payload: dict[str, Any]) -> bool:
    """Whether a 200 body or a stream's chunk is an error: one with an ``error``, or
    vLLM's error body unwrapped (``{"object": "error", "code": 400, ...}``), which is
    never an answer or a chunk (read as one without choices, it was retried as
    malformed, its message lost, or it ended a stream's answer early)."""
    return payload.get("error") is not None or payload.get("object") == "error"


async def _read_chat_json(
    response: httpx.Response,
    endpoint: Endpoint,
    limits: Limits,
    ctype: str,
    pieces: AsyncIterator[bytes] | None = None,
    head: bytes = b"",
) -> dict[str, Any]:
    payload = await _read_json(response, endpoint, limits, ctype or None, pieces, head)
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, dict) and isinstance(c.get("message"), dict) for c in choices)
    ):
        raise TransientUpstreamError(
            "malformed upstream body: no choices with a message", source=endpoint.name
        )
    indexes = []
    for choice in choices:  # the stream's rule: no index may come before 0, or be no index
        index = choice_index(choice)
        if index is None:
            raise TransientUpstreamError(
                malformed_index(choice, "malformed upstream body"), source=endpoint.name
            )
        if index >= limits.max_choices:
            raise TransientUpstreamError(
                index_over(index, limits.max_choices, "malformed upstream body"),
                source=endpoint.name,
            )
        indexes.append(index)
    assert isinstance(payload, dict)
    if indexes != sorted(indexes):
        # Choices in index order, as an assembled stream has them: the first is the
        # answer (choice 0), wherever the body listed it.  (A stable sort: choices
        # that share an index keep the body's order.)
        order = sorted(range(len(choices)), key=indexes.__getitem__)
        payload["choices"] = [choices[i] for i in order]
        indexes = [indexes[i] for i in order]
    if len(set(indexes)) < len(indexes):
        # Two choices at one index (both without one, read as 0; a bridge that gives
        # each choice 0): numbered by their place in index order.  Kept, a client keyed
        # them by index and kept one, and the stream of this answer showed choice 0's
        # text twice.
        for position, choice in enumerate(payload["choices"]):
            choice["index"] = position
    for choice in choices:
        # The same answer reads the same whether the source streams or not (SPEC §1):
        # what the assembled stream's message has, this one has too.
        message = choice["message"]
        if "index" not in choice:
            choice["index"] = 0  # (the one choice of a server that omits it)
        _typed_logprobs(choice)
        if type(message.get("role")) is not str:
            # (Kept as sent -- none, null, 5 -- the caller's next turn, with this
            # message in its history, was refused as the caller's error.)
            message["role"] = "assistant"
        if type(message.get("content")) is list:
            # Typed parts (Mistral's magistral models): text and thinking, as the
            # stream's deltas of the same answer are read.
            _whole_parts(message)
        _typed_fields(message)
        # Reasoning sent only as ``reasoning`` (Ollama, OpenRouter) is also the
        # message's ``reasoning_content``, as the assembled stream's message has it.
        said = message.get("reasoning")
        if type(said) is str and said and not message.get("reasoning_content"):
            message["reasoning_content"] = said
    return payload


async def embeddings_exchange(
    transport: httpx.AsyncBaseTransport,
    endpoint: Endpoint,
    inputs: Sequence[str],
    params: Mapping[str, Any],
    *,
    limits: Limits,
    timeline: Timeline,
    call_id: str | None = None,
    trace: Sequence[tuple[str, str]] = (),
) -> tuple[list[list[float]], dict[str, Any]]:
    """Run one embeddings request; vectors come back in input order (``trace``: as
    :func:`chat_exchange`'s)."""

    wanted = params.get("dimensions")
    packed = _packed_bits(params)
    # Binary embeddings packed 8 dimensions to a number (Jina's embedding_type, Azure
    # AI Inference's and vLLM's encodings "binary" / "ubinary"): 64 dimensions come
    # as 8 numbers.
    length = -(-wanted // 8) if packed and type(wanted) is int and wanted > 0 else wanted

    async def read(response: httpx.Response) -> tuple[list[list[float]], dict[str, Any]]:
        try:
            payload = await _read_json(response, endpoint, limits)
        except TransientUpstreamError as exc:
            if not (over_cap(exc) and _could_be_this_large(len(inputs), wanted, limits)):
                raise  # (a source sending more than its answer could be: its fault)
            # An embeddings answer's size is its batch's (inputs x dimensions), the
            # same from every source: asked again, it is computed and billed again,
            # to be refused again.  The request's error, said with what to change.
            timeline.billed = True
            raise FatalUpstreamError(
                f"{exc.message}: an embeddings answer's size is its batch's (inputs x "
                "dimensions); lower embed_batch_size or raise max_body_bytes",
                source=endpoint.name,
            ) from None
        vectors = _vectors(payload, len(inputs), endpoint)
        if length is not None and vectors and len(vectors[0]) != length:
            # An upstream that ignores ``dimensions`` (its model has one size): vectors
            # of another length are not what was asked for, and would fail later, in
            # the caller's vector store.  Not a fault of the source's health (no
            # breaker, no retry): the scope's sources do not all serve what the call
            # asks, as with sources of different models.
            timeline.billed = True
            ignored = "the binary encoding asked for" if packed and len(vectors[0]) == wanted \
                else "dimensions"
            raise FatalUpstreamError(
                f"the upstream answered vectors of {len(vectors[0])} "
                + ("numbers" if packed else "dimensions") + f" to dimensions={wanted}"
                + (" packed as binary" if packed else "") + f": it does not honour {ignored}",
                source=endpoint.name,
            )
        return vectors, payload

    body = embeddings_body(endpoint, inputs, params)
    return await _exchange(
        transport, endpoint, endpoint.embeddings_url, body, call_id, timeline, read, trace
    )


_PACKED = frozenset({"binary", "ubinary"})
#: The most a vector of an embeddings answer takes in JSON, a number: ~32 bytes
#: (``-0.0123456789012345,`` and the spaces some servers add).
_JSON_NUMBER_BYTES = 32
#: The most dimensions an embedding model gives, for a call that does not say.
_MOST_DIMENSIONS = 8192


def _could_be_this_large(inputs: int, dimensions: Any, limits: Limits) -> bool:
    """Whether a batch's answer could pass ``max_body_bytes`` by its size alone (then
    it is the request's error), rather than by a source sending more than any
    answer to it could be (a fault of the source's, transient)."""
    dims = dimensions if type(dimensions) is int and dimensions > 0 else _MOST_DIMENSIONS
    return inputs * dims * _JSON_NUMBER_BYTES > limits.max_body_bytes


def _packed_bits(params: Mapping[str, Any]) -> bool:
    """Whether the call asked for binary embeddings, packed a bit a dimension."""
    for name in ("embedding_type", "encoding_format", "output_dtype"):
        value = params.get(name)
        if isinstance(value, str) and value in _PACKED:
            return True
    return False


def _vectors(payload: Any, expected: int, endpoint: Endpoint) -> list[list[float]]:
    """The vectors of an embeddings body in input order: one per input, each indexed
    once by a plain ``int`` (not a ``bool``), all of one non-zero length, all finite."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or len(data) != expected:
        got = len(data) if isinstance(data, list) else "no"
        raise TransientUpstreamError(
            f"malformed embeddings body: {got} vectors for {expected} inputs", source=endpoint.name
        )
    vectors: list[list[float] | None] = [None] * expected
    size = -1
    for position, item in enumerate(data):
        if not isinstance(item, dict):
            raise TransientUpstreamError("malformed embeddings item", source=endpoint.name)
        index = item.get("index", position)
        if (
            not isinstance(index, int) or isinstance(index, bool)
            or not 0 <= index < expected or vectors[index] is not None
        ):
            raise TransientUpstreamError(
                f"malformed embeddings body: bad index {index!r}", source=endpoint.name
            )
        vector = _vector(item.get("embedding"), endpoint)
        if size != len(vector):
            if size >= 0:
                raise TransientUpstreamError(
                    f"malformed embedding vector: {len(vector)} dimensions after {size}",
                    source=endpoint.name,
                )
            size = len(vector)
        vectors[index] = vector
    return [v for v in vectors if v is not None]


def _vector(value: Any, endpoint: Endpoint) -> list[float]:
    """One non-empty vector of finite floats.

    Finiteness is one C-speed ``sum``: a NaN or an infinity makes it non-finite, and
    float32 values (base64) cannot overflow a float64 sum; JSON values so large that
    their sum overflows are refused too (no embedding has them).  A JSON integer too
    large for a float (``OverflowError``) is malformed, not a bug.
    """
    vector: list[float] | None = None
    if isinstance(value, str):  # encoding_format="base64": little-endian float32
        floats = array("f")
        try:
            floats.frombytes(base64.b64decode(value, validate=True))
        except ValueError:  # binascii.Error, or a length that is not whole floats
            pass
        else:
            if sys.byteorder == "big":
                floats.byteswap()
            vector = floats.tolist()
    elif isinstance(value, list):
        # Numbers only (not a bool, a string or null), each as a float, a JSON integer
        # too large for one refused: msgspec's check, ~20x a loop's speed here (256
        # vectors of 3,072 held the event loop for ~0.23 s, every other call and
        # stream with it).
        try:
            vector = msgspec.convert(value, list[float], strict=True)
        except msgspec.ValidationError:
            vector = None
    if vector and math.isfinite(sum(vector)):
        return vector
    raise TransientUpstreamError("malformed embedding vector", source=endpoint.name)
