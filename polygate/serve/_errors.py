"""polygate's errors as OpenAI-shaped HTTP errors: the one table of SPEC §8.5.

=================================  ======  ===========================  ==========================
what happened                      status  type                         code
=================================  ======  ===========================  ==========================
malformed body, bad parameter      400     invalid_request_error        ``invalid_request``
the upstream refused the request   400     invalid_request_error        ``upstream_rejected`` (1)
no or wrong gateway key            401     invalid_request_error        ``invalid_api_key``
/metrics with a key bound to       403     invalid_request_error        ``permission_denied``
scopes
unknown ``model`` (or one outside  404     invalid_request_error        ``model_not_found``
the scopes a key is bound to)
request body over the cap          413     invalid_request_error        ``request_too_large``
every source rate limited          429     rate_limit_error             ``rate_limit_exceeded``
sources exhausted                  502     api_error                    ``sources_exhausted``
an answer JSON cannot carry (NaN)  502     api_error                    ``upstream_error``
a committed stream that failed     502     api_error                    ``upstream_error``
governance backend down            503     api_error                    ``governance_unavailable``
call deadline passed               504     timeout_error                ``deadline_exceeded``
a committed stream went silent     504     timeout_error                ``stream_stalled``
=================================  ======  ===========================  ==========================

(1) or the upstream's own code when it is a context-length or content-policy one.

A 429 carries ``Retry-After`` (whole seconds) and ``retry-after-ms``, both rounded up.
Messages are the polygate error's own text, which never holds a source's key (the
errors module redacts upstream text), and never a gateway key (none reaches here) --
except the 503's: the backend's own message names its host and port, which are the
operator's to read (in the log), not the clients'.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Final

import attrs

from .. import _errors as errors
from .._outage import OUTAGE_LOG
from ._json import Unencodable, dump

__all__ = ["CHALLENGE", "ErrorReply", "error_body", "reply_for"]

log = logging.getLogger("polygate.serve")

#: A 401 names the scheme that would be accepted (RFC 9110 §11.6.1, RFC 6750 §3);
#: browsers show no login prompt for Bearer.
CHALLENGE: Final = ((b"www-authenticate", b"Bearer"),)

_BACKEND_DOWN = (
    "The gateway's governance backend (quotas, breakers) cannot be reached right now; "
    "nothing was sent upstream. The gateway keeps retrying: retry later."
)
#: While the backend is down every call fails so: its reason is logged at most this
#: often (at WARNING), the rest at DEBUG.
_BACKEND_LOG_EVERY_S = 10.0
#: Upstream error codes an upstream refusal's answer keeps (see reply_for).
_PASSED_CODES: Final = errors.CONTEXT_CODES | errors.POLICY_CODES

#: The Retry-After of a 503 governance_unavailable: about one retry of the backend
#: connection (its timeouts are of that order).
_BACKEND_RETRY_S = 1.0
_backend_logged_at = -math.inf


@attrs.frozen
class ErrorReply:
    status: int
    message: str
    type: str
    code: str
    retry_after_s: float | None = None
    #: The request parameter at fault (OpenAI's ``error.param``), when one is.
    param: str | None = None
    #: No retry can succeed: ``x-should-retry: false``, which the OpenAI SDKs obey
    #: (they retry a 429 with backoff whatever ``Retry-After`` says).
    final: bool = False
    #: A 405's ``Allow`` (RFC 9110 §15.5.6): the methods the URL takes.
    allow: str | None = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"content-type", b"application/json")]
        if self.allow is not None:
            out.append((b"allow", self.allow.encode()))
        if self.status == 401:
            out.extend(CHALLENGE)
        if self.final:
            out.append((b"x-should-retry", b"false"))
        if self.retry_after_s is not None:
            seconds = max(1, math.ceil(self.retry_after_s))
            out.append((b"retry-after", str(seconds).encode()))
            out.append((b"retry-after-ms", str(max(1, math.ceil(self.retry_after_s * 1000))).encode()))
        return out

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    payload = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return dump(payload)


#: The parameter a session's argument error is about, when it starts by naming it.
_PARAM = re.compile(r"([a-z_]+(?:\[\d+\])*(?:\.[a-z_]+)*) (?:must|is) ")


OUT_OF_MEMORY = "The gateway ran out of memory answering this request; try again later."


def reply_for(exc: BaseException) -> ErrorReply:
    """The HTTP error for an exception a session call raised (or a bug)."""
    if isinstance(exc, errors.ConfigError):
        message = str(exc)
        found = _PARAM.match(message)  # ("messages[0] must be ...": the parameter it is about)
        return ErrorReply(400, message, "invalid_request_error", "invalid_request",
                          param=found[1] if found else None)
    if isinstance(exc, errors.FatalUpstreamError) and exc.status_code == 508:
        # A chain too long further on: said as such, back to the first hop.
        return ErrorReply(508, str(exc), "api_error", "too_many_hops", final=True)
    if isinstance(exc, errors.FatalUpstreamError):
        # The upstream's own code where clients act on it: the request too long for
        # the model's context (LangChain's context-overflow handling and the SDK's
        # ``e.code`` look for context_length_exceeded), or a content policy's refusal.
        code = exc.code if exc.code in _PASSED_CODES else "upstream_rejected"
        # (The parameter it named is passed on: a client's SDK shows it, and it is
        # the caller's request, not a secret.)
        return ErrorReply(400, str(exc), "invalid_request_error", code, param=exc.param)
    if isinstance(exc, errors.DeadlineExceeded):
        return ErrorReply(504, str(exc), "timeout_error", "deadline_exceeded")
    if isinstance(exc, errors.GovernanceBackendError):
        _log_backend_down(exc)
        # (Retry-After: what "retry later" means -- the SDKs wait that long, up to 60 s,
        # rather than their own backoff's first half second.)
        return ErrorReply(503, _BACKEND_DOWN, "api_error", "governance_unavailable",
                          retry_after_s=_BACKEND_RETRY_S)
    if isinstance(exc, errors.AllSourcesExhausted):
        failed = errors.failed_attempts(exc.errors)
        if failed and all(e.exhausted == "memory" for e in failed):
            # Not the sources': this process could not hold the request or the answer.
            return ErrorReply(503, OUT_OF_MEMORY, "api_error", "out_of_memory")
        if failed and all(e.status_code == 508 for e in failed):
            # Every source led back (a ring of gateways): a loop, said as one to the hop
            # before, which takes this gateway out in turn, and so on back to the first.
            return ErrorReply(508, str(exc), "api_error", "loop_detected", final=True)
        wait = rate_limited_for(exc)
        if wait is not None:
            return ErrorReply(
                429, str(exc), "rate_limit_error", "rate_limit_exceeded", retry_after_s=wait
            )
        # (Too large for every source's quota: no retry of it can be admitted.)
        return ErrorReply(502, str(exc), "api_error", "sources_exhausted", final=exc.too_large)
    if isinstance(exc, errors.StreamStalled):
        return ErrorReply(504, str(exc), "timeout_error", "stream_stalled")
    if isinstance(exc, errors.UpstreamError):
        return ErrorReply(502, str(exc), "api_error", "upstream_error")
    if isinstance(exc, Unencodable):
        return ErrorReply(
            502, "The upstream's answer holds a number that JSON cannot carry (NaN or "
            "Infinity); the gateway does not relay it.", "api_error", "upstream_error",
        )
    if isinstance(exc, errors.PolygateError):
        return ErrorReply(503, str(exc), "api_error", "unavailable")
    return ErrorReply(500, "internal error in the gateway", "api_error", "internal_error")


def _log_backend_down(exc: errors.GovernanceBackendError) -> None:
    global _backend_logged_at
    now = time.monotonic()  # (a log's rate, not the call's time: no trio clock needed)
    # Said at the outage's start whatever the rate (OUTAGE_LOG: its end was the
    # backend's last word), then at most every 10 s.
    backend = exc.backend
    if OUTAGE_LOG.starts(backend) or now - _backend_logged_at >= _BACKEND_LOG_EVERY_S:
        _backend_logged_at = now
        OUTAGE_LOG.said(backend)
        log.warning("calls answered 503 governance_unavailable: %s", exc)
    else:
        log.debug("call answered 503 governance_unavailable: %s", exc)


def rate_limited_for(exc: errors.AllSourcesExhausted) -> float | None:
    """Seconds until a source may take the call again, when every source was rate
    limited; ``None`` when something else exhausted the call.

    Two ways a call ends so.  Admission, at the end, found every source over its
    RPM/TPM quota or cooling down until past the call's deadline (``exc.retry_after_s``,
    the wait it measured): after 429s, or after 5xx answers that sent Retry-After (the
    upstream asked for the wait either way), or with no attempt made.  Or the
    attempts were all answered 429 (``exc.errors`` are all :class:`RateLimitedError`,
    each maybe with its Retry-After).  One state gets one answer, whichever call met it.
    """
    if exc.retry_after_s is not None:
        return exc.retry_after_s
    failed = errors.failed_attempts(exc.errors)
    if failed and all(isinstance(e, errors.RateLimitedError) for e in failed):
        # Each source's latest word (the errors are in order): an earlier 429's
        # Retry-After is older than the wait that source asked for last.
        latest = {e.source: e.retry_after_s for e in failed}
        known = [after for after in latest.values() if after is not None]
        return min(known) if known else 1.0
    return None
