"""Building OpenAI-compatible requests and reading bodies within their size caps."""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs
import httpx
import trio

from .._errors import (
    TransientUpstreamError,
    body_retry_after,
    classify_status,
    error_code,
    error_message,
    error_param,
    refusal_hint,
)
from .._json import dumps, nested_deeper, plain_keys
from .._secrets import clip, is_header_safe
from .._types import MAX_CHOICES, json_default, valid_text
from ._head import header_of

__all__ = [
    "CALL_ID_HEADER",
    "Endpoint",
    "Limits",
    "body_pieces",
    "chat_body",
    "check_depth",
    "check_encoding",
    "check_readable",
    "Asking",
    "embeddings_body",
    "read_capped",
    "raise_for_status",
    "as_text",
    "body_wait",
    "parse_retry_after",
]


_USER_AGENT = "polygate/0.1"
CALL_ID_HEADER = "x-polygate-call-id"


@attrs.define(eq=False)
class Asking:
    """How a source is asked, as it has taught this session: what it refused of
    polygate's own way of asking (never of a caller's request), not asked of it again."""

    #: False once it refused the ``stream_options`` polygate adds to ask for usage
    #: (Mistral's 422 "Extra inputs are not permitted", Azure before api-version
    #: 2024-09-01, Groq and xAI at times): its usage, when it sends none, is estimated.
    stream_options: bool = True
    #: False once it refused to stream (OpenAI's o3 and gpt-5 for an organization that
    #: has not verified itself): it is asked as a source that cannot stream is.
    stream: bool = True
    #: True once it refused a pydantic model's JSON Schema for not being in strict
    #: form (OpenAI, Azure OpenAI: "Invalid schema for response_format"): a model's
    #: schema goes to it in strict form.
    strict_schemas: bool = False


@attrs.frozen
class Endpoint:
    """Where and as whom to send: what the transport needs to know of a source.

    URLs and headers are built once here, not per request.
    """

    name: str
    url: str
    api_key: str | None = attrs.field(default=None, repr=False)
    model: str | None = None
    streaming: bool = True
    #: The settings' other secrets (other sources' keys, gateway keys, the passwords
    #: of the backend, telemetry and cache URLs): an upstream that echoes one in its
    #: error text must not show it either.
    others: tuple[str, ...] = attrs.field(default=(), repr=False)
    chat_url: httpx.URL = attrs.field(init=False, repr=False)
    embeddings_url: httpx.URL = attrs.field(init=False, repr=False)
    _headers: tuple[tuple[str, str], ...] = attrs.field(init=False, repr=False)
    key_problem: str | None = attrs.field(init=False, repr=False)
    #: Every secret to redact from this source's text, its key first.  Built once: a
    #: gateway's keys are among ``others``, and a tuple of ten thousand built for each
    #: exchange cost ~0.1 ms a request.
    secrets: tuple[str, ...] = attrs.field(init=False, repr=False, eq=False)
    asking: Asking = attrs.field(init=False, factory=Asking, eq=False, repr=False)

    @property
    def streams(self) -> bool:
        """Whether a chat request to it streams: it can, and has not refused to."""
        return self.streaming and self.asking.stream

    def __attrs_post_init__(self) -> None:
        unsendable = self.api_key is not None and (
            not isinstance(self.api_key, str) or not is_header_safe(self.api_key)
        )
        # Never echoed, never sent: a key that cannot be a header value reaches no
        # header; every exchange refuses at once (key_problem), before any I/O.
        object.__setattr__(self, "key_problem", (
            f"the API key of source {self.name!r} cannot be sent: it is not printable "
            "ASCII without blanks (check it for an invisible character)"
        ) if unsendable else None)
        object.__setattr__(self, "chat_url", httpx.URL(self.url + "/chat/completions"))
        object.__setattr__(self, "embeddings_url", httpx.URL(self.url + "/embeddings"))
        headers = [
            ("accept", "application/json, text/event-stream"),
            # No compression: a few hundred compressed bytes can decode to gigabytes,
            # and LLM answers are small.  Any other coding is refused (check_encoding).
            ("accept-encoding", "identity"),
            ("content-type", "application/json"),
            ("user-agent", _USER_AGENT),
        ]
        if self.api_key and not unsendable:
            headers.append(("authorization", f"Bearer {self.api_key}"))
        object.__setattr__(self, "_headers", tuple(headers))
        object.__setattr__(
            self, "secrets", (self.api_key, *self.others) if self.api_key else self.others)

    def headers(
        self, call_id: str | None = None, trace: Sequence[tuple[str, str]] = ()
    ) -> list[tuple[str, str]]:
        """Request headers; ``call_id`` lets upstream logs be joined with polygate's
        (every attempt of one logical call, hedges included, carries the same id), and
        ``trace`` (the attempt's span context) its traces."""
        headers = list(self._headers)
        if call_id is not None:
            headers.append((CALL_ID_HEADER, call_id))
        if trace:
            headers += trace
        return headers



MAX_JSON_DEPTH = 128


@attrs.frozen
class Limits:
    """The caps on what an upstream can make polygate hold or do, each checked once,
    on the bytes as they arrive (docs/configuration.md, "Limits on upstream input").

    ``max_body_bytes``: a whole body, streamed or not (bytes on the wire: polygate
    accepts no content coding, so they are also the decoded bytes);
    ``max_line_bytes``: one SSE line, and one SSE event (all its lines together);
    ``max_choices``: distinct ``choices[].index`` values in one answer, and the bound on
    an index that carries something;
    ``max_tool_calls``: distinct ``tool_calls[].index`` values in one choice;
    ``max_json_depth``: nesting of arrays and objects in one JSON document.
    """

    max_body_bytes: int = 32 * 1024 * 1024
    max_line_bytes: int = 4 * 1024 * 1024
    max_choices: int = MAX_CHOICES
    max_tool_calls: int = 128
    max_json_depth: int = MAX_JSON_DEPTH


_RESERVED_PARAMS = frozenset({"messages", "stream"})


def chat_body(
    endpoint: Endpoint, messages_json: str | bytes, params: Mapping[str, Any], stream: bool,
    plain: bool | None = None,
) -> bytes:
    """The JSON body of ``POST /chat/completions``; ``messages_json`` is the messages
    array already encoded (once per call, however many attempts it takes), as text or
    as UTF-8 (an OCR page's ~0.7 MB of messages: one copy into the body, not three).

    The source's ``model`` wins over a caller's ``model`` (sources of a scope are
    equivalent only with their own model names); every other parameter passes through
    unchanged.  A streamed request always asks for usage, keeping the caller's other
    ``stream_options``.

    ``plain``: ``plain_keys(params)`` where the caller knows it (once a call: the walk
    is Python's, and a large vendor parameter -- a gateway client's millions of nested
    lists -- held the loop for seconds on every attempt).
    """
    body: dict[str, Any] = {k: v for k, v in params.items() if k not in _RESERVED_PARAMS}
    if endpoint.model is not None:
        body["model"] = endpoint.model
    if stream and endpoint.asking.stream_options:
        body["stream"] = True
        given = body.get("stream_options")
        # (None, the usual, decided without an ABC check: ~0.2 µs.)
        options = dict(given) if given is not None and isinstance(given, Mapping) else {}
        options["include_usage"] = True
        body["stream_options"] = options
    else:
        if stream:
            body["stream"] = True  # (to a source that refused stream_options)
        body.pop("stream_options", None)
    # msgspec (~0.6 µs here against ~2.8 for json's encoder, on every attempt); json's
    # where msgspec would not write what json does (see polygate._json.dumps; a key
    # that is neither a str nor an int, see plain_keys).  The caller's parameters
    # were checked (``polygate._session._check_params``: with json's encoder, or one by one when all
    # are plain JSON scalars, which both encoders write alike), so the types msgspec
    # takes and json refuses (bytes, dates, sets) never reach here.
    # (The body's values are the parameters' and polygate's own plain ones.)
    head = dumps(body) if (plain_keys(body) if plain is None else plain) else None
    if head is None:
        head = _ENCODE(body).encode("utf-8", _ESCAPE)
    middle = b"," if len(head) > 2 else b""
    if not isinstance(messages_json, bytes):
        messages_json = messages_json.encode("utf-8", _ESCAPE)
    return b"".join((head[:-1], middle, b'"messages":', messages_json, b"}"))


# A lone surrogate is refused from the caller (ConfigError, polygate/_session.py), but an
# upstream may send one as a valid JSON escape ("\ud800") that a re-ask or a resume then
# sends back.  A surrogate can only stand inside a JSON string, and "backslashreplace"
# writes it as exactly that escape: the upstream gets back the bytes it sent, the same
# as from an ensure_ascii client.  Valid text never reaches the handler (no cost).
_ESCAPE = "backslashreplace"


_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=json_default).encode


def embeddings_body(endpoint: Endpoint, inputs: Sequence[str], params: Mapping[str, Any]) -> bytes:
    body: dict[str, Any] = dict(params)
    if endpoint.model is not None:
        body["model"] = endpoint.model
    body["input"] = list(inputs)
    return _ENCODE(body).encode("utf-8", _ESCAPE)


def check_depth(data: bytes, limit: int, source: str) -> None:
    """Refuse JSON nested deeper than ``limit`` before it is decoded
    (:func:`polygate._json.nested_deeper`)."""
    if nested_deeper(data, limit):
        raise TransientUpstreamError(
            f"malformed upstream body: JSON nested deeper than {limit} levels", source=source
        )


# Where a decoded JSON document can hold a lone surrogate: a \\uD800-\\uDFFF escape (a
# proper pair matches too, and is left whole), or the raw UTF-8-shaped bytes of one
# (json.loads decodes bytes with "surrogatepass").  Searched before anything is walked:
# nearly every body has neither, and the search is one C pass.
_SURROGATE_STR = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def as_text(payload: Any, source: str | bytes) -> Any:
    """``payload``, decoded from ``source``, with every lone surrogate in its strings
    (keys too) read as U+FFFD.

    JSON allows a lone ``\\ud800`` escape, but it is no Unicode text: left in, an answer
    would not print, encode, or go back into the next call (a chat history) -- the
    library refuses such text from a caller.  U+FFFD is what a UTF-8 decoder with
    ``errors="replace"`` reads for a bad byte; ``polygate serve`` writes the same."""
    if isinstance(source, bytes):
        found = _SURROGATE_BYTES.search(source) is not None
    else:
        found = _SURROGATE_STR.search(source) is not None
    return _mended(payload) if found else payload


def all_text(payload: Any) -> Any:
    """``payload`` with every lone surrogate in its strings read as U+FFFD, found by
    walking it: for a document decoded from bytes no pattern can search."""
    return _mended(payload)


def _mended(value: Any) -> Any:
    if type(value) is str:
        return valid_text(value)
    if type(value) is dict:
        return {_mended(k): _mended(v) for k, v in value.items()}
    if type(value) is list:
        return [_mended(v) for v in value]
    return value


def check_encoding(response: httpx.Response, source: str, secrets: Sequence[str]) -> str | None:
    """Why the body must not be read, or None.

    polygate asks for ``accept-encoding: identity``; a body in any other coding is
    refused unread: decoding it is the one step where a few hundred bytes on the
    wire can become gigabytes in memory (stacked gzip layers), and refusing keeps
    one cap, ``max_body_bytes``, measuring what is held.
    """
    coding = header_of(response, "content-encoding").strip()
    # A list (RFC 9110 8.4; empty items ignored, 5.6.1.2), and repeated lines arrive
    # joined: only items that are all ``identity`` mean no coding.
    if all(item.strip().lower() in ("", "identity") for item in coding.split(",")):
        return None
    # As sent (a key in it is redacted by the exchange only if its case is kept), and
    # cut short of 40 characters the way that drops a key's cut tail.
    shown = clip(coding, 40, secrets)
    return f"upstream sent a body with content-encoding {shown!r} (polygate asks for identity)"


def body_pieces(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive, undecoded (a body some transport already read
    into memory comes from there)."""
    return response.aiter_bytes() if response.is_stream_consumed else response.aiter_raw()


def check_readable(
    response: httpx.Response, limit: int, source: str, secrets: Sequence[str]
) -> None:
    """Refuse a body unread: one in a coding polygate did not ask for, or one whose
    declared Content-Length is over ``limit``.  ``secrets``: what the refusal, which
    quotes the coding, must not show (the key, whole or cut)."""
    refused = check_encoding(response, source, secrets)
    if refused is not None:
        raise TransientUpstreamError(refused, source=source)
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _over_cap(f"response body of {declared} bytes", limit, source)


async def read_capped(
    response: httpx.Response,
    limit: int,
    source: str,
    secrets: Sequence[str],
    pieces: AsyncIterator[bytes] | None = None,
    head: bytes = b"",
) -> bytes:
    """The whole body, or a transient error as soon as it passes ``limit``: a declared
    Content-Length over the limit is refused before a byte is read.  ``pieces`` and
    ``head``: the body's iterator, after ``head`` was read from it (to sniff it; the
    caller checked the body was readable before that read)."""
    if pieces is None:
        check_readable(response, limit, source, secrets)
    parts: list[bytes] = [head]
    size = len(head)
    if size > limit:
        raise _over_cap("response body", limit, source)
    async for part in body_pieces(response) if pieces is None else pieces:
        size += len(part)
        if size > limit:
            raise _over_cap("response body", limit, source)
        parts.append(part)
    return b"".join(parts)


#: The words of a body over ``max_body_bytes``, which ``over_cap`` knows it by.
_OVER_CAP = " exceeds the "


def _over_cap(body: str, limit: int, source: str) -> TransientUpstreamError:
    """The error of a body over ``max_body_bytes``."""
    return TransientUpstreamError(f"{body}{_OVER_CAP}{limit}-byte cap", source=source)


def over_cap(error: TransientUpstreamError) -> bool:
    """Whether ``error`` is a body refused for its size (``_over_cap``'s)."""
    return error.message.startswith("response body ") and _OVER_CAP in error.message \
        and error.message.endswith("-byte cap")


#: How much of an error response's body is read for its message.
_EXCERPT_BYTES = 65536
#: How long it may take, at most (and at most half of what is left of the time the
#: caller has): the status line classifies the failure, the body only words it.
_EXCERPT_S = 1.0


async def raise_for_status(response: httpx.Response, endpoint: Endpoint) -> None:
    """Raise the classified error of a non-2xx response (reading a bounded excerpt)."""
    if 200 <= response.status_code < 300:
        return
    excerpt = b""
    cut = False
    code = None
    refused = check_encoding(response, endpoint.name, endpoint.secrets)
    if refused is None:
        # A body that stalls must not turn a 400, a 401 or a 429 into a timeout of the
        # attempt (retried, the source not marked dead, Retry-After lost): what came
        # by the bound words the error, the status classifies it.
        now = trio.current_time()
        left = trio.current_effective_deadline() - now
        with trio.move_on_at(now + min(_EXCERPT_S, max(left, 0.0) / 2)):
            try:
                async for part in body_pieces(response):
                    excerpt += part
                    if len(excerpt) > _EXCERPT_BYTES:
                        excerpt, cut = excerpt[:_EXCERPT_BYTES], True
                        break
            except httpx.HTTPError:
                pass  # the status alone classifies the failure
    payload: Any = None
    if refused is None:
        detail, code, payload = _error_detail(excerpt, cut, endpoint.secrets)
    else:
        detail = refused
    status = response.status_code
    retry_after = parse_retry_after(response.headers)
    if retry_after is None and payload is not None:
        retry_after = body_wait(payload)
    error = classify_status(
        status, detail, source=endpoint.name, retry_after_s=retry_after, code=code,
        hint=refusal_hint(status, payload) if payload is not None else None,
    )
    error.code = code
    error.param = error_param(payload, endpoint.secrets)
    raise error


def _error_detail(
    excerpt: bytes, cut: bool, secrets: tuple[str, ...]
) -> tuple[str, str | None, Any]:
    """The message of an error body, redacted before it is shortened, the provider's
    error code when the body says one, and the body read as JSON (``None`` when it is
    not: cut, or text)."""
    text = excerpt.decode("utf-8", "replace").strip()
    if not text:
        return "", None, None
    if not cut:
        try:
            payload = as_text(json.loads(text), text)
        except (ValueError, RecursionError):
            pass
        else:
            return error_message(payload, 300, secrets), error_code(payload, secrets), payload
    return clip(text, 200, secrets, cut=cut), None, None


# Retry hints: openai-python reads retry-after-ms, then retry-after as seconds or an
# HTTP date.  Garbage and negatives are ignored; anything longer is clamped so a
# broken header cannot park a source for hours.
RETRY_AFTER_CAP_S = 600.0


#: Delta-seconds (RFC 9110: ``1*DIGIT``), with the fraction some servers send: ASCII
#: digits only (``float()`` also reads "1_000", "٥", "1e3", "inf" and "nan").
_DELTA = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def _http_date(raw: str | None) -> float | None:
    """An HTTP date as a POSIX timestamp; None when absent or unreadable."""
    if raw is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(raw.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        # HTTP dates are GMT (RFC 9110): the asctime form and a "-0000" zone parse
        # without one, and .timestamp() would read them as the local time.
        when = when.replace(tzinfo=datetime.timezone.utc)
    try:
        return when.timestamp()
    except (OverflowError, ValueError, OSError):
        return None


def body_wait(payload: Any) -> float | None:
    """The wait an error body gives (Google's ``retryDelay``: ``body_retry_after``),
    capped as a header's is; ``None`` when it gives none."""
    wait = body_retry_after(payload)
    return None if wait is None else min(wait, RETRY_AFTER_CAP_S)


def _lines(headers: Mapping[str, str], name: str) -> list[str]:
    """Each line of a header apart: ``httpx.Headers.get`` joins repeated lines with
    ", ", which no delta-seconds reads (and an HTTP date has a comma of its own)."""
    get_list = getattr(headers, "get_list", None)
    if get_list is not None:
        return list(get_list(name))
    one = headers.get(name)
    return [] if one is None else [one]


def _deltas(lines: list[str]) -> list[float]:
    """The delta-seconds among ``lines``, a line that lists several (a proxy's own
    join) read part by part."""
    found = []
    for line in lines:
        for part in line.split(","):
            # What was matched is what is read: str.strip also takes the separator
            # characters \x1c-\x1f, which h11 lets through in a value and float refuses.
            part = part.strip()
            if _DELTA.fullmatch(part):
                found.append(float(part))
    return found


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from ``retry-after-ms`` / ``retry-after``; ``None`` when absent
    or unparseable; clamped to ``[0, RETRY_AFTER_CAP_S]``.  Sent more than once (a
    proxy on the way adding its own beside the upstream's), the longest wait read."""
    ms = _deltas(_lines(headers, "retry-after-ms"))
    if ms:
        # (Digits too many for a float read as infinity: the cap, as any wait past it.)
        return min(max(ms) / 1000.0, RETRY_AFTER_CAP_S)
    lines = _lines(headers, "retry-after")
    if not lines:
        return None
    waits = _deltas(lines)  # (digits too many for a float: infinity, the cap below)
    dates = [d for d in (_http_date(line) for line in lines) if d is not None]
    if dates:
        wait = _date_wait(max(dates), headers)
        if math.isfinite(wait):
            waits.append(wait)
    if not waits:
        return None
    return min(max(waits), RETRY_AFTER_CAP_S)


def _date_wait(when: float, headers: Mapping[str, str]) -> float:
    """Seconds until ``when``, an HTTP date's instant."""
    # Counted from the answer's own Date where it has one: both instants are then the
    # server's, and the wait does not depend on this host's clock.  A replica whose
    # clock is minutes behind would otherwise park the source for minutes on every
    # replica sharing its cooldown (or, ahead, not at all).
    # A cache on the way says how long it held the answer (Age, RFC 9111 §4.2.3): the
    # server's now is about Date + Age.
    sent = _http_date(headers.get("date"))
    if sent is not None:
        age = (headers.get("age") or "").strip()
        if age.isascii() and age.isdigit():
            sent += min(int(age[:12]), 10**11)
    return max(when - (sent if sent is not None else time.time()), 0.0)
