"""Reply + request → a :class:`Plan`: the status, headers and a lazy sequence of body
bytes and pauses.  Both faces execute the same plan, so they send the same bytes at
the same (virtual or real) times; only the HTTP framing differs.

The wire shapes imitate the OpenAI captures in ``shared/transcripts``: compact JSON,
one ``data: {json}\\n\\n`` event per chunk, a role chunk first, an empty-delta finish
chunk, a ``choices: []`` usage chunk when the request set
``stream_options.include_usage``, then ``data: [DONE]\\n\\n``.  A request's ``n``
(1 to 128) gets that many choices, each the same answer: a role chunk per choice
first, each token once per choice, and a finish chunk per choice (usage counts every
choice's tokens).  A request's ``max_tokens`` (or
``max_completion_tokens``) caps the tokens and turns ``finish_reason`` into
``"length"``, as a real model does.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import struct
from collections.abc import Iterable, Iterator
from typing import Any, Literal, TypeAlias

import attrs

from ._script import ARGUMENT_PIECE, Reply, ToolCall, split_text

__all__ = [
    "Exchange", "FaultBytes", "Pause", "Plan", "Step", "error_reply", "json_plan", "models_payload", "render",
]

_CREATED = 1_700_000_000
#: The model a fake answers as when neither its Reply nor the request names one.
_DEFAULT_MODEL = "fake-model"
_FINGERPRINT = "fp_fake"
_KEEPALIVE = b": keep-alive\n\n"
_DONE = b"data: [DONE]\n\n"
_PIECE = 1 << 20  # oversized bodies go out in pieces of this size
_ANSWER = (
    "The quick brown fox jumps over the lazy dog while a patient model streams "
    "one token after another until the answer is done"
)
_THINKING = "Let me think about this step by step and check each part first"
_WORDS = _ANSWER.split()
_THOUGHTS = _THINKING.split()
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _dumps(obj: Any) -> str:
    return _JSON.encode(obj)


@attrs.frozen
class Pause:
    """Send nothing for ``seconds`` (a face sleeps, and notices a client leaving).

    A wait split by keep-alive comments is pauses marked ``beat`` and a last one
    whose ``whole`` is the whole wait: it ends where the unsplit wait would, to the
    last bit (see :class:`Due`)."""

    seconds: float
    beat: bool = False
    whole: float | None = None
    #: When set, the step after it is due this long after the schedule's start: a
    #: token's time computed at once (first + k x inter), where adding the gaps up
    #: in floating point drifts (0.7999999999999999 for 0.8).
    until: float | None = None


class Due:
    """A face's absolute schedule of a plan's pauses, from ``start``: a wake-up that
    comes late shortens the next pause instead of delaying every later step, and
    keep-alive beats do not move what follows them (adding the pieces of a split
    wait up in floating point lands a hair off the unsplit time)."""

    __slots__ = ("_start", "_wait_start", "at")

    def __init__(self, start: float) -> None:
        self.at = self._start = start
        self._wait_start: float | None = None

    def after(self, pause: Pause) -> float:
        """When the step after ``pause`` is due."""
        if pause.until is not None:
            self.at = self._start + pause.until
            self._wait_start = None
        elif pause.beat:
            if self._wait_start is None:
                self._wait_start = self.at
            self.at += pause.seconds
        elif pause.whole is not None and self._wait_start is not None:
            self.at = self._wait_start + pause.whole
            self._wait_start = None
        else:
            self.at += pause.seconds
        return self.at


class FaultBytes(bytes):
    """The first bytes of a scripted fault inside a body (a malformed line, an error
    event, an oversized line).  A face that has delivered them records the exchange
    as a ``fault`` however it ends: a client that stops reading there (polygate does,
    its stream failed) was still sent the fault."""


#: A body step: bytes to send, or a pause.
Step: TypeAlias = bytes | Pause
#: How the exchange ends once the steps are exhausted: a clean end of the message;
#: a connection closed before the declared Content-Length was sent; a TCP reset; or
#: no end at all (wait until the client leaves).
Ending: TypeAlias = Literal["complete", "truncate", "reset", "hang"]


@attrs.frozen
class Plan:
    """Everything a face needs to answer one request.

    ``head_delay is None`` means the head is never sent ("silent").  ``chunked``
    bodies are streams (``Transfer-Encoding: chunked``); the others declare
    ``content_length``, which exceeds the bytes sent when ``ending == "truncate"``.
    ``fault`` says whether delivering the whole plan counts as a fault outcome.
    ``joinable`` promises that the steps are a few bytes objects and no pause, so
    the server may join them into one write (most of the cost of a zero-delay
    200-token stream is otherwise per-step overhead).
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    head_delay: float | None
    chunked: bool
    content_length: int | None
    steps: Iterable[Step]
    ending: Ending = "complete"
    fault: bool = False
    joinable: bool = False


@attrs.frozen
class Exchange:
    """What the renderer needs to know about one request."""

    index: int
    name: str
    path: str
    body: Any
    embedding_dim: int = 8


# ---------------------------------------------------------------- entry points


def render(reply: Reply, ex: Exchange) -> Plan:
    """The plan for ``reply`` answering ``ex`` (a chat completion or an embedding)."""
    headers = _base_headers(reply, ex)
    if reply.fault == "silent":
        return Plan(reply.status, headers, None, False, None, (), "hang", True)
    if not 200 <= reply.status < 300:
        return _fixed(reply.status, headers, reply.headers_delay_s, _error_body(reply))
    if reply.fault in ("html", "no_choices"):
        delay = reply.headers_delay_s + reply.first_token_s
        if reply.fault == "html":
            return _fixed(reply.status, headers, delay, _HTML, "text/html; charset=utf-8", fault=True)
        return _fixed(reply.status, headers, delay, _no_choices(reply, ex), fault=True)
    if ex.path.endswith("/embeddings"):
        return _embeddings(reply, ex, headers)
    chat = _Chat(reply, ex)
    if chat.streamed:
        return chat.stream_plan(headers)
    return chat.json_plan(headers)


def _times(count: int, seconds: float) -> float:
    """``count`` waits of ``seconds``: none is 0 even for an endless wait (inf x 0 is
    NaN, which no deadline takes)."""
    return count * seconds if count else 0.0


def json_plan(status: int, payload: Any, ex: Exchange) -> Plan:
    """A plain JSON answer with no delay (``/_stats``, 404s, unparseable bodies)."""
    return _fixed(status, _base_headers(Reply(), ex), 0.0, _dumps(payload).encode())


def models_payload(model: str | None) -> dict[str, Any]:
    """``GET /v1/models``: the model the fake answers as (``model``, else its default),
    as OpenAI lists one."""
    return {"object": "list", "data": [{
        "id": model if model is not None else _DEFAULT_MODEL, "object": "model",
        "created": _CREATED, "owned_by": "polygate-testing",
    }]}


def error_reply(status: int, message: str, kind: str, code: str | None) -> Reply:
    """A Reply carrying an OpenAI-style error body."""
    return Reply(status=status, error_body=_error_payload(message, kind, code))


# ---------------------------------------------------------------- helpers


def _base_headers(reply: Reply, ex: Exchange) -> tuple[tuple[str, str], ...]:
    headers = [("x-request-id", f"req-{ex.name}-{ex.index}")]
    if reply.retry_after_s is not None:
        headers.append(("retry-after", _number(reply.retry_after_s)))
    if reply.retry_after_ms is not None:
        headers.append(("retry-after-ms", _number(reply.retry_after_ms)))
    headers.extend(reply.headers)
    return tuple(headers)


def _number(value: float) -> str:
    """A header's number: whole, or decimal without an exponent ("0.00001", not
    "1e-05", which a parser of delay-seconds does not read)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{float(value):.6f}".rstrip("0").rstrip(".") or "0"


def _fixed(
    status: int,
    headers: tuple[tuple[str, str], ...],
    delay: float,
    body: bytes,
    content_type: str = "application/json",
    *,
    fault: bool = False,
) -> Plan:
    return Plan(
        status,
        (("content-type", content_type), *headers),
        delay,
        False,
        len(body),
        (body,),
        "complete",
        fault,
        joinable=True,
    )


def _error_payload(message: str, kind: str, code: str | int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


_DEFAULT_ERRORS: dict[int, tuple[str, str, str | None]] = {
    400: ("Invalid request (scripted by FakeUpstream).", "invalid_request_error", None),
    401: ("Incorrect API key provided.", "invalid_request_error", "invalid_api_key"),
    403: ("You are not allowed to use this model.", "permission_denied", None),
    404: (
        "The model does not exist or you do not have access to it.",
        "invalid_request_error",
        "model_not_found",
    ),
    422: ("Unprocessable request.", "invalid_request_error", None),
    429: ("Rate limit reached for requests.", "requests", "rate_limit_exceeded"),
}


def _error_body(reply: Reply) -> bytes:
    if reply.error_body is not None:
        body = reply.error_body
        return body if isinstance(body, bytes) else _dumps(body).encode()
    default = _DEFAULT_ERRORS.get(reply.status)
    if default is None:
        default = ("The server had an error while processing your request.", "server_error", None)
    return _dumps(_error_payload(*default)).encode()


_HTML = (
    b"<!DOCTYPE html>\n<html><head><title>Just a moment...</title></head>"
    b"<body><h1>Checking your browser</h1></body></html>\n"
)


def _no_choices(reply: Reply, ex: Exchange) -> bytes:
    return _dumps(
        {
            "id": f"chatcmpl-{ex.name}-{ex.index}",
            "object": "chat.completion",
            "created": _CREATED,
            "model": _model(reply, ex),
        }
    ).encode()


def _model(reply: Reply, ex: Exchange) -> str:
    if reply.model is not None:
        return reply.model
    requested = ex.body.get("model") if isinstance(ex.body, dict) else None
    if not isinstance(requested, str):
        return _DEFAULT_MODEL
    # Echoed in the answer: a lone surrogate (valid JSON, no text) goes back as its
    # escape, or the answer could not be written as UTF-8.
    return requested.encode("utf-8", "backslashreplace").decode("utf-8")


def _words(n: int, words: list[str]) -> list[str]:
    return [("" if i == 0 else " ") + words[i % len(words)] for i in range(n)]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # (A part's "text" that is no string -- a client's bug -- counts as none: the
        # fake answers it, where a TypeError made it a 500 with a traceback.)
        return "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
    return ""


def _prompt_tokens(body: Any) -> int:
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return 1
    chars = sum(len(_text_of(m.get("content"))) for m in messages if isinstance(m, dict))
    return chars // 4 + 1


def _wait(seconds: float, keepalive: float | None, until: float | None = None) -> Iterator[Step]:
    """``seconds`` of silence, broken by keep-alive comments every ``keepalive``;
    ``until``: when it ends, from the schedule's start (see :attr:`Pause.until`)."""
    if seconds <= 0:
        return
    if keepalive is not None:
        beats = 0
        while (beats + 1) * keepalive < seconds:
            yield Pause(keepalive, beat=True)
            yield _KEEPALIVE
            beats += 1
        if beats:
            yield Pause(seconds - beats * keepalive, whole=seconds, until=until)
            return
    yield Pause(seconds, until=until)


def _timed(reply: Reply) -> bool:
    """Whether a stream of ``reply`` can contain a pause (keep-alives need one)."""
    stall = reply.stall_s if reply.stall_at is not None else 0.0
    return reply.first_token_s > 0 or reply.inter_token_s > 0 or stall > 0


def _padding(total: int, prefix: bytes, suffix: bytes) -> Iterator[bytes]:
    """``prefix`` + ``x`` padding + ``suffix``, ``total`` bytes in all, in pieces."""
    remaining = max(0, total - len(prefix) - len(suffix))
    yield prefix
    piece = b"x" * min(_PIECE, remaining)
    while remaining > 0:
        chunk = piece if remaining >= len(piece) else piece[:remaining]
        remaining -= len(chunk)
        yield chunk
    yield suffix


# ---------------------------------------------------------------- chat


def _choice(delta: str, finish: str = "null", index: int = 0) -> bytes:
    """The part of a chunk after ``"choices":`` for one choice's delta."""
    return (
        f'[{{"index":{index},"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]}}\n\n'
    ).encode()


#: The most choices a fake answers with (a request's ``n`` above it gets one).
_MAX_CHOICES = 128


def _choices_asked(body: Any) -> int:
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= _MAX_CHOICES:
        return n
    return 1


@attrs.frozen
class _Tokens:
    """The answer's tokens, and each token's chunk after the per-request head."""

    thoughts: tuple[str, ...]
    content: tuple[str, ...]
    choices: tuple[bytes, ...]
    cut: bool  # the request's token limit cut the answer short
    deltas: tuple[str, ...]  # each token's delta, as JSON (for the choices after the first)
    #: The tool calls as far as the answer got (the limit may cut one short), as a
    #: non-streamed answer's message has them.
    tools: tuple[dict[str, Any], ...] = ()


def _tool_tokens(calls: tuple[ToolCall, ...], prefix: str) -> list[tuple[int, str, str | None]]:
    """Each tool call's tokens in order, as ``(call index, id or name, argument piece)``:
    its head (``(i, id, None)``, the name in the call) and then its pieces."""
    tokens: list[tuple[int, str, str | None]] = []
    for i, call in enumerate(calls):
        tokens.append((i, call.id if call.id is not None else f"{prefix}{i}", None))
        args = call.arguments
        tokens.extend((i, "", args[k : k + ARGUMENT_PIECE]) for k in range(0, len(args), ARGUMENT_PIECE))
    return tokens


@functools.lru_cache(maxsize=256)
def _tokens(text: str | None, count: int, reasoning: int, limit: int | None,
            calls: tuple[ToolCall, ...] = (), prefix: str = "") -> _Tokens:
    """Cached: benchmarks repeat one Reply thousands of times, and encoding each
    token's JSON is most of the cost of rendering a long zero-delay stream.
    ``prefix``: the start of a tool call's id that the Reply leaves to the fake (per
    request, so only given for a Reply with tool calls)."""
    if text is None and limit is not None:
        # Only the words that can be sent: a large count under a small max_tokens
        # built (and cached) every word first.
        count = min(count, limit + 1)  # (one more: the cut still shows)
    # (With tool calls and no text, a model that only calls tools: no content.)
    content = split_text(text) if text is not None else [] if calls else _words(count, _WORDS)
    thoughts = _words(reasoning if limit is None else min(reasoning, limit + 1), _THOUGHTS)
    tools = _tool_tokens(calls, prefix)
    cut = limit is not None and len(thoughts) + len(content) + len(tools) > limit
    if limit is not None:
        thoughts = thoughts[:limit]
        content = content[: max(0, limit - len(thoughts))]
        tools = tools[: max(0, limit - len(thoughts) - len(content))]
    deltas = [_dumps({"reasoning_content": t}) for t in thoughts]
    deltas += [_dumps({"content": t}) for t in content]
    assembled: list[dict[str, Any]] = []
    for i, ident, piece in tools:
        if piece is None:
            call = calls[i]
            head = {"index": i, "id": ident, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            deltas.append(_dumps({"tool_calls": [head]}))
            assembled.append({"id": ident, "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
        else:
            deltas.append(_dumps({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
            assembled[-1]["function"]["arguments"] += piece
    choices = [_choice(d) for d in deltas]
    return _Tokens(tuple(thoughts), tuple(content), tuple(choices), cut, tuple(deltas),
                   tuple(assembled))


class _Chat:
    """One chat completion: the token list and the shared JSON fragments."""

    def __init__(self, reply: Reply, ex: Exchange) -> None:
        self.reply = reply
        body = ex.body if isinstance(ex.body, dict) else {}
        self.streamed = reply.stream if reply.stream is not None else bool(body.get("stream"))
        options = body.get("stream_options")
        self.include_usage = (
            reply.usage and isinstance(options, dict) and bool(options.get("include_usage"))
        )
        self.id = f"chatcmpl-{ex.name}-{ex.index}"
        self.model = _model(reply, ex)
        # The first of the two that is a limit, as an upstream reads them (a null
        # max_completion_tokens is none: the answer is capped by max_tokens).  (Not
        # polygate's own reading, imported: the fake is the oracle its tests check.)
        limit = next((cap for cap in (body.get("max_completion_tokens"), body.get("max_tokens"))
                      if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0), None)
        calls = reply.tool_calls
        prefix = f"call_{ex.name}_{ex.index}_" if calls else ""
        self.tokens = _tokens(reply.text, reply.tokens, reply.reasoning_tokens, limit, calls, prefix)
        self.thoughts = self.tokens.thoughts
        self.content = self.tokens.content
        #: A model that only calls tools (no ``text``, not even ""): content null.
        self.null_content = bool(calls) and reply.text is None
        self.finish_reason = "length" if self.tokens.cut else reply.finish_reason
        self.n = _choices_asked(body)
        self.prompt_tokens = _prompt_tokens(body)
        self.head = (
            f'data: {{"id":"{self.id}","object":"chat.completion.chunk","created":{_CREATED},'
            f'"model":{_dumps(self.model)},"system_fingerprint":"{_FINGERPRINT}","choices":'
        ).encode()

    def usage(self, completion: int) -> dict[str, Any]:
        """``completion``: one choice's tokens (every choice's are counted)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion * self.n,
            "total_tokens": self.prompt_tokens + completion * self.n,
            "completion_tokens_details": {"reasoning_tokens": len(self.thoughts) * self.n},
        }

    def _chunk(self, delta: str, finish: str = "null", index: int = 0) -> bytes:
        return self.head + _choice(delta, finish, index)

    # -- streamed

    def stream_plan(self, headers: tuple[tuple[str, str], ...]) -> Plan:
        r = self.reply
        return Plan(
            r.status,  # (any 2xx: the script says which)
            (("content-type", "text/event-stream; charset=utf-8"), *headers),
            r.headers_delay_s,
            True,
            None,
            self._stream_steps(),
            "reset" if r.fault == "reset" else "complete",
            r.fault is not None,
            joinable=not _timed(r) and r.fault != "oversized",
        )

    def _stream_steps(self) -> Iterator[Step]:
        r = self.reply
        head, choices = self.head, self.tokens.choices
        n = len(choices)
        stall_at = None if r.stall_at is None else min(r.stall_at, n)
        fault_at = None if r.fault is None else min(r.fault_after, n)
        deltas, others = self.tokens.deltas, range(1, self.n)
        # (A model that only calls tools says "content": null, as OpenAI's streams do.)
        role = ('{"role":"assistant","content":null}' if self.null_content
                else '{"role":"assistant","content":""}')
        for index in range(self.n):
            yield self._chunk(role, index=index)
        for i in range(n + 1):
            if i == fault_at:
                if r.fault in ("truncated", "reset"):
                    return
                if r.fault == "error_event":
                    yield FaultBytes(self._error_event())
                    return
                yield from self._bad_line()
            gap = r.first_token_s if i == 0 else r.inter_token_s if i < n else 0.0
            if i == stall_at:
                gap += r.stall_s
            if gap > 0:
                # Token i is due at first + i x inter (+ the stall once past it), from the
                # body's start, exactly (the non-streamed answer's delay is that sum too).
                stalled = r.stall_s if stall_at is not None and i >= stall_at else 0.0
                until = r.first_token_s + _times(min(i, max(n - 1, 0)), r.inter_token_s) + stalled
                yield from _wait(gap, r.keepalive_s, until)
            if i < n:
                yield head + choices[i]
                for index in others:
                    yield head + _choice(deltas[i], index=index)
        for index in range(self.n):
            yield self._chunk("{}", _dumps(self.finish_reason), index)
        if self.include_usage:
            usage = _dumps(self.usage(n))
            yield head + f'[],"usage":{usage}}}\n\n'.encode()
        if r.done:
            yield _DONE

    def _error_event(self) -> bytes:
        code = self.reply.error_event_code
        payload = _error_payload("The server had an error while generating.", "server_error", code)
        return f"event: error\ndata: {_dumps(payload)}\n\n".encode()

    def _bad_line(self) -> Iterator[bytes]:
        if self.reply.fault == "oversized":
            prefix = f'data: {{"id":"{self.id}","padding":"'.encode()
            pieces = _padding(self.reply.oversized_bytes, prefix, b'"}\n\n')
            yield FaultBytes(next(pieces))
            yield from pieces
        else:  # malformed_json: a JSON object cut off mid-string
            yield FaultBytes(self.head + b'[{"index":0,"delta":{"content":"unterminated\n\n')

    # -- not streamed

    def message_body(self) -> dict[str, Any]:
        tools = self.tokens.tools
        message: dict[str, Any] = {
            "role": "assistant",
            # (None when a model only calls tools, as OpenAI's answers have it.)
            "content": None if self.null_content else "".join(self.content),
            "refusal": None,
        }
        if self.thoughts:
            message["reasoning_content"] = "".join(self.thoughts)
        if tools:
            # (A copy: the cached token list's dicts are shared by every request.)
            message["tool_calls"] = [{**t, "function": dict(t["function"])} for t in tools]
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": _CREATED,
            "model": self.model,
            "choices": [
                {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                }
                for index in range(self.n)
            ],
        }
        if self.reply.usage:
            body["usage"] = self.usage(len(self.tokens.choices))
        body["system_fingerprint"] = _FINGERPRINT
        return body

    def json_plan(self, headers: tuple[tuple[str, str], ...]) -> Plan:
        r = self.reply
        n = len(self.tokens.choices)
        delay = r.headers_delay_s + r.first_token_s + _times(max(0, n - 1), r.inter_token_s)
        if r.stall_at is not None:
            delay += r.stall_s
        if r.fault == "error_event":
            payload = _error_payload(
                "The server had an error while generating.", "server_error", r.error_event_code
            )
            return _fixed(r.status, headers, delay, _dumps(payload).encode(), fault=True)
        if r.fault == "oversized":
            prefix = f'{{"id":"{self.id}","padding":"'.encode()
            return _oversized(r.status, r.oversized_bytes, prefix, headers, delay)
        return _faulty_json(r, headers, delay, _dumps(self.message_body()).encode())


def _oversized(
    status: int, total: int, prefix: bytes, headers: tuple[tuple[str, str], ...], delay: float
) -> Plan:
    size = max(total, len(prefix) + 2)
    return Plan(
        status,
        (("content-type", "application/json"), *headers),
        delay,
        False,
        size,
        _padding(size, prefix, b'"}'),
        "complete",
        True,
    )


def _faulty_json(
    reply: Reply, headers: tuple[tuple[str, str], ...], delay: float, body: bytes
) -> Plan:
    """A JSON body, damaged as ``reply.fault`` says (malformed, truncated, reset)."""
    plan = _fixed(reply.status, headers, delay, body)
    if reply.fault == "malformed_json":
        broken = body[:-1] + b","
        return attrs.evolve(plan, steps=(broken,), content_length=len(broken), fault=True)
    if reply.fault == "truncated":
        return attrs.evolve(plan, steps=(body[: len(body) // 2],), ending="truncate", fault=True)
    if reply.fault == "reset":
        return attrs.evolve(plan, steps=(), ending="reset", fault=True)
    return plan


# ---------------------------------------------------------------- embeddings


def _embedding_inputs(body: Any) -> list[str] | None:
    """The inputs as strings (token-id lists keyed by their JSON); None if invalid."""
    value = body.get("input") if isinstance(body, dict) else None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        return None
    if value and all(isinstance(v, int) for v in value):
        return [_dumps(value)]
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(isinstance(v, list) for v in value):
        return [_dumps(v) for v in value]
    return None


def _vector(text: str, dim: int) -> bytes:
    """A unit vector derived from ``text`` only, as little-endian float32 bytes."""
    digest = b""
    block = 0
    while len(digest) < 4 * dim:
        digest += hashlib.blake2b(f"{block}:{text}".encode(), digest_size=64).digest()
        block += 1
    raw = struct.unpack(f"<{dim}I", digest[: 4 * dim])
    xs = [v / 2**31 - 1.0 for v in raw]
    norm = sum(x * x for x in xs) ** 0.5 or 1.0
    return struct.pack(f"<{dim}f", *(x / norm for x in xs))


_MAX_DIMENSIONS = 16_384  # more than any embedding model offers


def _embeddings(reply: Reply, ex: Exchange, headers: tuple[tuple[str, str], ...]) -> Plan:
    body = ex.body if isinstance(ex.body, dict) else {}
    inputs = _embedding_inputs(body)
    if inputs is None:
        bad = error_reply(400, "'input' must be a string or a list.", "invalid_request_error", None)
        return _fixed(400, headers, reply.headers_delay_s, _error_body(bad))
    dim = body.get("dimensions")
    if isinstance(dim, int) and not isinstance(dim, bool) and dim > _MAX_DIMENSIONS:
        # As a provider answers an absurd size (one of 10**9 froze the fake server).
        bad = error_reply(400, f"'dimensions' must be at most {_MAX_DIMENSIONS}.",
                          "invalid_request_error", None)
        return _fixed(400, headers, reply.headers_delay_s, _error_body(bad))
    if not (isinstance(dim, int) and not isinstance(dim, bool) and dim > 0):
        dim = reply.embedding_dim or ex.embedding_dim
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for i, text in enumerate(inputs):
        packed = _vector(text, dim)
        vector: Any = (
            base64.b64encode(packed).decode()
            if as_base64
            else list(struct.unpack(f"<{dim}f", packed))
        )
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(len(t) // 4 + 1 for t in inputs)
    payload: dict[str, Any] = {"object": "list", "data": data, "model": _model(reply, ex)}
    if reply.usage:
        payload["usage"] = {"prompt_tokens": tokens, "total_tokens": tokens}
    delay = reply.headers_delay_s + reply.first_token_s
    if reply.fault == "error_event":
        payload = _error_payload("The server had an error.", "server_error", reply.error_event_code)
        return _fixed(reply.status, headers, delay, _dumps(payload).encode(), fault=True)
    if reply.fault == "oversized":
        return _oversized(reply.status, reply.oversized_bytes, b'{"object":"list","padding":"', headers, delay)
    return _faulty_json(reply, headers, delay, _dumps(payload).encode())
