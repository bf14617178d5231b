"""The error tree, and the one function that maps wire failures onto it.

::

    PolygateError
    ├── ConfigError (+ ValueError)           bad settings or caller arguments, before any I/O
    ├── UpstreamError                        one attempt against one source failed
    │   ├── FatalUpstreamError               400/422…: the request is wrong; never retried
    │   ├── SourceDeadError                  401/402/403/404/407: source cools down for a long time
    │   ├── TransientUpstreamError           5xx, network, timeouts, bad bodies; retried
    │   │   └── StreamStalled (+ TimeoutError)   a committed stream went silent
    │   └── RateLimitedError                 429: source cools down for Retry-After
    ├── DeadlineExceeded (+ TimeoutError)    the logical call ran out of time
    ├── AllSourcesExhausted                  attempts or sources ran out; .errors has each one
    ├── GovernanceBackendError               the shared backend cannot answer: fail closed
    └── StructuredOutputError                answers never matched the schema (re-asks spent)

A public call raises exactly one of these.  Internal nursery groups ride along as
``__cause__`` at most.  Cancellation (``trio.Cancelled``) is a ``BaseException`` and is
never caught or mapped here.

:func:`classify_status` and :func:`classify_exception` are the only places where HTTP
statuses and httpx/protocol exceptions become polygate errors, so the taxonomy is
decided once and tested as a table.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable
from typing import Any, Final

import httpx

from ._http11 import unquoted
from ._secrets import clip, redact
from ._sockets import os_reasons, out_of
from ._types import CallStats  # (at run time: typing.get_type_hints reads the annotations)

__all__ = [
    "AllSourcesExhausted",
    "ConfigError",
    "DeadlineExceeded",
    "FatalUpstreamError",
    "GovernanceBackendError",
    "PolygateError",
    "RateLimitedError",
    "SourceDeadError",
    "StreamStalled",
    "StructuredOutputError",
    "TransientUpstreamError",
    "UpstreamError",
    "Outcome",
    "classify_status",
    "classify_exception",
    "error_message",
    "redact",
]


class Outcome(str, enum.Enum):
    """How one attempt ended; the values are the telemetry ``error`` column."""

    OK = "ok"
    HEDGE_CANCELLED = "hedge_cancelled"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    RATE_LIMITED = "rate_limited"
    TRANSIENT = "transient"
    DEAD = "dead"
    FATAL = "fatal"
    STALLED = "stalled"


class PolygateError(Exception):
    """Base of every error polygate raises."""


class ConfigError(PolygateError, ValueError):
    """A setting, a configuration key or a caller argument is wrong."""


class GovernanceBackendError(PolygateError):
    """The governance backend could not answer; the call was not sent unadmitted.
    ``backend``: which one (its URL, the password masked), when known."""

    backend: str | None = None


class UpstreamError(PolygateError):
    """One attempt against one source failed.

    ``message`` never contains the source's API key: every constructor in polygate
    passes text through :func:`redact` first.
    """

    outcome: Outcome = Outcome.TRANSIENT

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        status_code: int | None = None,
        retry_after_s: float | None = None,
        outcome: Outcome | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.source = source
        self.status_code = status_code
        self.retry_after_s = retry_after_s
        # The provider's own error code when it sent one ("context_length_exceeded",
        # "content_filter"…): what decides a fallback, beside the status.
        self.code: str | None = None
        # The request parameter the provider said was at fault (OpenAI's
        # ``error.param``: "n", "messages[1].content"), when it said one.
        self.param: str | None = None
        # Set when this error ends a logical call (a fatal error, a committed stream's
        # failure): the call's frozen statistics.
        self.call_stats: CallStats | None = None
        # Set when this error ends a committed stream: the text the caller was shown.
        self.text = ""
        # What this process ran out of (descriptors, socket buffers, memory) when
        # that, not the upstream, failed the attempt: it feeds neither the source's
        # breaker nor its health.
        self.exhausted: str | None = None
        # The connection was cut or reset (no answer of the upstream's own, no
        # timeout): after a caller held the stream long, the cut may be what a
        # server does to a reader that stops reading (see polygate._attempt).
        self.cut = False
        # Set on the error that asks a source again without what it refused of
        # polygate's own way of asking (a prefill, stream_options, streaming): no
        # failure of the source's or of the call's, though its attempt is listed.
        self.asked_again = False
        if outcome is not None:
            self.outcome = outcome

    def __str__(self) -> str:
        where = f"[{self.source}] " if self.source else ""
        status = f"HTTP {self.status_code}: " if self.status_code else ""
        return f"{where}{status}{self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class FatalUpstreamError(UpstreamError):
    """The upstream refused the request itself (400, 422, …); retrying cannot help."""

    outcome = Outcome.FATAL


class SourceDeadError(UpstreamError):
    """The source rejects us (401, 402, 403, 404, 407, or a body that says so: see
    ``classify_status``): it is taken out for a long
    cooldown."""

    outcome = Outcome.DEAD


class TransientUpstreamError(UpstreamError):
    """A failure another attempt (preferably on another source) may not hit."""

    outcome = Outcome.TRANSIENT


class RateLimitedError(UpstreamError):
    """429: the source cools down for ``retry_after_s``; the retry is free of budget."""

    outcome = Outcome.RATE_LIMITED


# _ALWAYS_SET: the call-level errors below (StreamStalled, DeadlineExceeded,
# AllSourcesExhausted, StructuredOutputError) are typed with ``call_stats: CallStats``,
# not optional, so that a caller's ``e.call_stats.attempts`` type-checks: polygate
# sets the figures on every one it raises (AllSourcesExhausted is built first and
# given them as the call ends).  Only one constructed by hand without them holds None.


class StreamStalled(TransientUpstreamError, TimeoutError):
    """A stream already shown to the caller went silent past ``stall_timeout_s``.

    ``text`` is what the caller had received; ``call_stats`` the frozen statistics.
    """

    outcome = Outcome.STALLED
    call_stats: CallStats

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        text: str = "",
        call_stats: CallStats | None = None,
    ) -> None:
        super().__init__(message, source=source)
        self.text = text
        self.call_stats = call_stats  # type: ignore[assignment]  # see _ALWAYS_SET


class DeadlineExceeded(PolygateError, TimeoutError):
    """The logical call's deadline passed; every path was cancelled and cleaned up."""

    #: The call's frozen statistics (see ``_ALWAYS_SET``).
    call_stats: CallStats

    def __init__(self, message: str, *, call_stats: CallStats | None = None) -> None:
        super().__init__(message)
        self.call_stats = call_stats  # type: ignore[assignment]


class AllSourcesExhausted(PolygateError):
    """Every allowed attempt failed; ``errors`` holds each attempt's error in order.

    ``retry_after_s``: when admission refused the call because every source was over
    its RPM/TPM quota or cooling down (after a 429, or a 5xx that sent Retry-After)
    until past the call's deadline, the
    seconds until the first of them may admit it; ``None`` otherwise (then ``errors``
    says what happened: a 429's own ``retry_after_s`` is on its ``RateLimitedError``).

    ``too_large``: admission refused the call, before any attempt of it, because its
    token estimate alone is over every candidate source's ``tpm``; the same request is
    never admitted (send fewer tokens, or a smaller ``max_tokens``).  Not set when only
    a fallback scope, a structured re-ask or a continuation was too large."""

    call_stats: CallStats

    def __init__(
        self,
        message: str,
        *,
        errors: list[UpstreamError] | None = None,
        call_stats: CallStats | None = None,
        retry_after_s: float | None = None,
        timed: bool = False,
        too_large: bool = False,
    ) -> None:
        super().__init__(message)
        self.too_large = too_large
        self.errors: list[UpstreamError] = list(errors or [])
        self.call_stats = call_stats  # type: ignore[assignment]  # see _ALWAYS_SET
        self.retry_after_s = retry_after_s
        #: Given up at this call's own time limit (its deadline, or its
        #: ``rate_limit_wait_s``) while a source would admit later: no verdict on the
        #: request for a coalesced caller with more time (see polygate._cached).
        self.timed = timed


class StructuredOutputError(PolygateError):
    """No answer of the call matched the schema, and its re-asks are spent (SPEC §8.1).

    ``errors`` has one string per round, in order: that round's validation problems;
    ``text`` is the last answer as the upstream sent it; ``call_stats`` the frozen
    statistics of the whole call (every round's attempts; ``reasks`` made).
    """

    call_stats: CallStats

    def __init__(
        self,
        message: str,
        *,
        errors: list[str] | None = None,
        text: str = "",
        call_stats: CallStats | None = None,
    ) -> None:
        super().__init__(message)
        self.errors: list[str] = list(errors or [])
        self.text = text
        self.call_stats = call_stats  # type: ignore[assignment]  # see _ALWAYS_SET


# --------------------------------------------------------------------------- mapping

#: Error codes that say the request was too long for the model's context.
CONTEXT_CODES = frozenset({
    "context_length_exceeded", "string_above_max_length", "model_max_context_length",
    "exceed_context_size_error",  # llama.cpp server's error type
})
#: Error codes that say a content policy refused the request.
POLICY_CODES = frozenset({
    "content_filter", "content_policy_violation", "content_policy", "safety", "moderation",
})


#: Error codes (or types) of a 429 that is no rate limit but an account out of credit
#: (OpenAI's ``insufficient_quota``): the source's state for hours, a 402's.
OUT_OF_CREDIT_CODES = frozenset({"insufficient_quota"})
#: 4xx statuses that servers send for their own failure, not the request's: TGI's 424
#: (a shard failed generating: out of GPU memory, a crash), Groq's 498 (its flex tier
#: at capacity: "try again later").  Retried elsewhere, as a 5xx.
_SERVER_4XX = frozenset({424, 498})
#: Gemini's reasons for a 400 that is its key's state, not the request's.
_KEY_REASONS = frozenset({"API_KEY_INVALID", "API_KEY_EXPIRED", "API_KEY_SERVICE_BLOCKED"})
#: Anthropic answers an account out of credit with a 400 ``invalid_request_error``
#: whose message begins so (anchored: a message that quotes a caller's text saying it
#: is a request's error, not the account's state).
_NO_CREDIT_TEXT = re.compile(
    # (or Anthropic's body inside a proxy's message, as LiteLLM's proxy words it:
    # 'litellm.BadRequestError: AnthropicException - {"type":"error",...}')
    r"\s*your credit balance is too low|.*\"message\"\s*:\s*\"your credit balance is too low",
    re.IGNORECASE | re.DOTALL,
)
#: Gemini's ``FAILED_PRECONDITION`` 400s that are the project's state: its free tier
#: not offered where it is, billing off (a file still processing, a cached content
#: gone, are the request's, and stay fatal).
_PROJECT_TEXT = re.compile(
    r"free tier is not available|enable billing|user location is not supported", re.IGNORECASE
)
#: llama.cpp's server refuses an input longer than its batch with a 500 ("input (N
#: tokens) is too large to process. increase the physical batch size"; before it
#: counted them, "input is too large to process."; gpustack's llama-box the same with
#: a comma): the request's fault, the same every time, not the server's failure.
_TOO_LARGE_TEXT = re.compile(r"\s*input (?:\([0-9]+ tokens\) )?is too large to process[.,]")
#: Google's ``RetryInfo.retryDelay``: a duration in seconds ("37s", "37.5s").
_GOOGLE_DELAY = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,9})?)s")


def one_error(payload: Any) -> Any:
    """An error body as one object: Gemini's OpenAI-compatible endpoint sends its error
    object as the one item of a list (``[{"error": {...}}]``)."""
    if type(payload) is list and len(payload) == 1 and isinstance(payload[0], dict):
        return payload[0]
    return payload


def error_object(payload: Any) -> dict[str, Any] | None:
    """An error body's error object: its ``error`` when it has one, else the body
    itself (vLLM's unwrapped shape), when that is an object."""
    payload = one_error(payload)
    inner = payload.get("error", payload) if isinstance(payload, dict) else None
    return inner if isinstance(inner, dict) else None


def failed_attempts(errors: Iterable[UpstreamError]) -> list[UpstreamError]:
    """The errors of a call's attempts that failed it: all but those that only asked a
    source again without what it refused of polygate's own asking (``asked_again``)."""
    return [e for e in errors if not e.asked_again]


def refusal_hint(status: int, payload: Any) -> str | None:
    """What an error body says of its refusal where its status alone would mislead:

    * ``"dead"``: a 400 that is the source's own state, not the request's -- Gemini's
      invalid or expired key (``details[].reason``), its project's billing off or its
      free tier not offered there (a ``FAILED_PRECONDITION`` that says so), Anthropic's
      credit balance too low (its message's beginning);
    * ``"request"``: a 500 that is the request's fault (llama.cpp's input too large for
      its batch): fatal, as a 400;
    * ``"policy"``: a 403 that refuses this request by a moderation, not us (OpenRouter
      names the flagged input in ``error.metadata``): one caller's prompt must not
      take the source out for every other caller.
    """
    inner = error_object(payload)
    if inner is None:
        return None
    message = inner.get("message")
    message = message[:1000] if isinstance(message, str) else ""
    if status == 400:
        details = inner.get("details")
        if type(details) is list and any(
            isinstance(d, dict) and d.get("reason") in _KEY_REASONS for d in details
        ):
            return "dead"
        if (inner.get("status") == "FAILED_PRECONDITION" and _PROJECT_TEXT.search(message)) or (
            _NO_CREDIT_TEXT.match(message)
        ):
            return "dead"
    elif status == 500 and _TOO_LARGE_TEXT.match(message):
        return "request"
    elif status == 403:
        metadata = inner.get("metadata")
        if isinstance(metadata, dict) and ("flagged_input" in metadata or "reasons" in metadata):
            return "policy"
    return None


def body_retry_after(payload: Any) -> float | None:
    """The wait an error body gives when no header does: Google's ``RetryInfo`` detail
    (Gemini's 429 has no ``Retry-After``; its ``retryDelay`` says "37.5s")."""
    inner = error_object(payload)
    details = inner.get("details") if inner is not None else None
    if type(details) is not list:
        return None
    for detail in details:
        delay = detail.get("retryDelay") if isinstance(detail, dict) else None
        found = _GOOGLE_DELAY.fullmatch(delay) if isinstance(delay, str) else None
        if found is not None:
            return float(found.group(1))
    return None


#: The statuses that say the source, not the request, is wrong (see classify_status).
_DEAD_STATUSES: Final = frozenset({401, 402, 403, 404, 407, 508})


def classify_status(
    status: int,
    detail: str,
    *,
    source: str | None = None,
    retry_after_s: float | None = None,
    code: str | None = None,
    hint: str | None = None,
) -> UpstreamError:
    """Map a non-2xx HTTP status (or an error event's code) to one error class.

    408, 409 and 425 are the server saying "try again"; every other 4xx except the
    auth/not-found family and 429 means our request is wrong.  402 (out of credit) and
    407 (a proxy in front of the source wants credentials) are the source's state, not
    the request's: another source can answer it, so they are dead, not fatal.  So is a
    429 whose ``code`` says the account is out of credit: waiting out a Retry-After
    and asking again, free of ``max_attempts``, would only ask it again and again.
    ``hint`` (:func:`refusal_hint`) corrects a status the body contradicts.  A 402
    that sends ``Retry-After`` says when to ask again (OpenRouter's spending budget
    in flight): a wait, as a 429's, not a dead source.  508 (Loop Detected: the
    source leads back to a gateway this request has passed through, ``polygate
    serve`` among them) is the source's configuration: dead too.  Except ``polygate
    serve``'s ``too_many_hops``: a chain longer than it takes, which a client can make
    up in the request's ``Via``, fails that call alone (fatal), not the source for
    every caller.
    """
    if hint == "dead" or (status == 429 and code in OUT_OF_CREDIT_CODES):
        return SourceDeadError(detail or "out of credit", source=source, status_code=status)
    if hint in ("policy", "request"):
        return FatalUpstreamError(detail or "request refused", source=source, status_code=status)
    if status == 508 and code == "too_many_hops":
        return FatalUpstreamError(detail or "too many hops", source=source, status_code=status)
    if status == 429 or (status == 402 and retry_after_s is not None):
        return RateLimitedError(
            detail or "rate limited", source=source, status_code=status,
            retry_after_s=retry_after_s,
        )
    if status in _DEAD_STATUSES:
        return SourceDeadError(detail or "source rejected us", source=source, status_code=status)
    if status in (408, 409, 425) or status in _SERVER_4XX or status >= 500 or status < 400:
        return TransientUpstreamError(
            detail or "upstream failed", source=source, status_code=status,
            retry_after_s=retry_after_s,
        )
    return FatalUpstreamError(detail or "request rejected", source=source, status_code=status)


#: An egress proxy's refusal (httpcore's words): an HTTP proxy's 407 or 403 to the
#: CONNECT, a SOCKS5 proxy refusing the credentials, the method or, by its rules, the
#: destination.
_PROXY_REFUSED = re.compile(
    r"40[37] |Invalid username/password|Requested .+? from proxy server, but got|"
    r"Proxy Server could not connect: Connection not allowed by ruleset"
)


def classify_exception(exc: BaseException, *, source: str | None = None) -> UpstreamError:
    """Map an httpx / protocol / decoding exception to one error class.

    Everything that is not an HTTP status is transient: the connection, the bytes or
    the clock failed, not the request.  Timeouts are marked so telemetry can tell them
    apart from other transient failures.
    """
    if isinstance(exc, UpstreamError):
        return exc
    found = out_of(exc)
    if found is not None:
        # Not the upstream's failure (the breaker is fed only by real ones), and
        # not its message: a connect's says "all attempts ... failed", or names
        # whatever file the process could not open.
        what, code = found
        error = TransientUpstreamError(
            f"this process ran out of {what} ({code}): the attempt failed for a reason "
            "of this process's, not the upstream's", source=source)
        error.exhausted = what
        return error
    name = type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return TransientUpstreamError(
            f"timed out ({name})", source=source, outcome=Outcome.TIMEOUT
        )
    if isinstance(exc, httpx.ProxyError) and _PROXY_REFUSED.match(str(exc)):
        # An egress proxy refused to open a tunnel to the source for us (its
        # credentials, its policy): the source is unusable as configured, as when the
        # proxy answers a plain-HTTP request 407 (classify_status).  One that could
        # not reach the source (unreachable, refused) says nothing of the sort.
        return SourceDeadError(f"the egress proxy refused the tunnel: {exc}", source=source)
    if isinstance(exc, httpx.TransportError):
        # httpx messages carry host:port at most; never headers.  h11's quote the bytes
        # that did not parse, which may be another caller's answer: cut (unquoted).  A
        # connect's says only that every attempt failed: the OS's reasons tell refused
        # from no route.
        text = unquoted(str(exc))
        reasons = [reason for reason in os_reasons(exc) if reason not in text]
        if reasons:
            text = f"{text} ({'; '.join(reasons)})" if text else "; ".join(reasons)
        error = TransientUpstreamError(f"transport error ({name}): {text}", source=source)
        error.cut = True
        return error
    if isinstance(exc, RecursionError):  # bytes nested past what a decoder can follow
        return TransientUpstreamError(f"malformed upstream body ({name})", source=source)
    if isinstance(exc, (ValueError, UnicodeDecodeError, KeyError, TypeError)):
        return TransientUpstreamError(f"malformed upstream body ({name}): {exc}", source=source)
    return TransientUpstreamError(f"unexpected failure ({name}): {exc}", source=source)


def error_status(payload: Any) -> int | None:
    """The HTTP-like status carried by an OpenAI-style error object, when it has one."""
    payload = one_error(payload)
    if not isinstance(payload, dict):
        return None
    inner = payload.get("error", payload)
    candidates: list[Any] = []
    if isinstance(inner, dict):
        candidates += [inner.get("code"), inner.get("status_code"), inner.get("status")]
    candidates += [payload.get("code"), payload.get("status_code"), payload.get("status")]
    for value in candidates:
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and 100 <= value <= 599:
            return value
        if isinstance(value, float) and math.isfinite(value) and 100 <= value <= 599:
            return int(value)
        # ASCII digits only: str.isdigit() also takes "²" (which int() refuses: the
        # well-formed error then read as a malformed body) and other scripts' digits.
        if isinstance(value, str) and value.isascii() and value.isdigit() and 100 <= int(value) <= 599:
            return int(value)
    return None


def error_code(payload: Any, secrets: Iterable[str] = ()) -> str | None:
    """The provider's symbolic error code (``error.code``, else ``error.type``), when it
    is a short word rather than a number, redacted of ``secrets`` like the message (an
    upstream may echo the key it refused in any field)."""
    inner = error_object(payload)
    if inner is None:
        return None
    for value in (inner.get("code"), inner.get("type")):
        if isinstance(value, str) and 0 < len(value) <= 64 and not value.isdigit():
            return redact(value, secrets)
    return None


def error_param(payload: Any, secrets: Iterable[str] = ()) -> str | None:
    """The parameter a provider's error names (``error.param``), when it is a short
    printable string, redacted like the code."""
    inner = error_object(payload)
    value = inner.get("param") if inner is not None else None
    if isinstance(value, str) and 0 < len(value) <= 128 and value.isprintable():
        return redact(value, secrets)
    return None


def error_message(payload: Any, limit: int = 300, secrets: Iterable[str] = ()) -> str:
    """A short human message from an OpenAI-style (or vLLM-style) error body.

    The whole message is redacted of ``secrets`` first and cut to ``limit``
    characters after (see :func:`polygate._secrets.clip`): a key echoed across the
    cut point is never left half-visible.
    """
    message: Any = None
    payload = one_error(payload)
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict):
            message = inner.get("message") or inner.get("type") or inner.get("code")
        elif isinstance(inner, str):
            message = inner
        if message is None:
            message = payload.get("message")
    if message is None:
        message = payload
    if not isinstance(message, str):
        try:
            message = json.dumps(message, ensure_ascii=False, default=repr)
        except (ValueError, RecursionError):
            message = f"<{type(message).__name__}>"
    return clip(message, limit, secrets)
