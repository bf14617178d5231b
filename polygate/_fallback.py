"""Fallback chains: which failures move a logical call to another scope, and where.

Sources inside a scope are interchangeable; scopes are ordered.  When a scope fails a
call for one of its ``fallback_on`` reasons, the call moves — inside the same logical
call and deadline — to ``fallback``, whose own fallback may follow, and so on.  A
failure is described by a set of reasons (pure functions, tested as a table):

============================  =================================================
failure                       reasons
============================  =================================================
``AllSourcesExhausted``       ``exhausted`` (+ ``rate_limited`` when every error
                              was a 429)
context length exceeded       ``context_length``, ``fatal``, ``status:NNN``
content policy refusal        ``content_policy`` only
other fatal 4xx               ``fatal``, ``status:NNN``
anything else                 none (a deadline is the call's, a backend outage
                              fails closed)
============================  =================================================

A content-policy refusal matches nothing but ``content_policy``, so it is never routed
around unless the scope lists that reason by name.  A context-length refusal never goes
to a scope whose every source serves the same model that refused: that scope is
skipped for its own fallback.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ._config import Settings
from ._errors import (
    CONTEXT_CODES,
    POLICY_CODES,
    AllSourcesExhausted,
    FatalUpstreamError,
    PolygateError,
    RateLimitedError,
    failed_attempts,
)

__all__ = ["failure_reasons", "fallback_scope", "is_content_policy", "is_context_length"]

_CONTEXT_TEXT = re.compile(
    r"context.length|context.window|maximum context|too many tokens|prompt is too long"
    r"|input is too long|exceeds? the model'?s? max|reduce the length of the (messages|prompt)"
    # llama.cpp ("exceeds the available context size"), Gemini ("The input token count
    # (…) exceeds the maximum number of tokens allowed"), TGI and Together ("`inputs`
    # tokens + `max_new_tokens` must be <= 4096").
    r"|context size|exceeds the maximum number of tokens|tokens \+ .?max_new_tokens.? must be"
    r"|is too large to process",  # llama.cpp: an input longer than its batch
    re.IGNORECASE,
)
_POLICY_TEXT = re.compile(
    r"content.(management.)?polic|content.filter|flagged by|safety system|responsible ai"
    # OpenRouter's moderation: "… requires moderation on OpenAI. Your input was flagged
    # for "harassment"."
    r"|requires moderation|input was flagged",
    re.IGNORECASE,
)


def is_context_length(error: PolygateError) -> bool:
    if not isinstance(error, FatalUpstreamError):
        return False
    if error.code in CONTEXT_CODES:
        return True
    return bool(_CONTEXT_TEXT.search(error.message)) and not is_content_policy(error)


def is_content_policy(error: PolygateError) -> bool:
    if not isinstance(error, FatalUpstreamError):
        return False
    return error.code in POLICY_CODES or bool(_POLICY_TEXT.search(error.message))


def failure_reasons(error: PolygateError) -> frozenset[str]:
    """Every ``fallback_on`` reason that ``error`` matches."""
    if isinstance(error, AllSourcesExhausted):
        # (An attempt that only taught a source what it refuses of polygate's own
        # asking failed nothing: the source was asked again.)
        errors = failed_attempts(error.errors)
        if errors and all(isinstance(e, RateLimitedError) for e in errors):
            return frozenset({"exhausted", "rate_limited"})
        if not errors and error.retry_after_s is not None:
            # Refused at admission: every source over its quota or still cooling down
            # after a 429 (a later call in the window of the 429 that moved the first).
            return frozenset({"exhausted", "rate_limited"})
        return frozenset({"exhausted"})
    if isinstance(error, FatalUpstreamError):
        if is_content_policy(error):
            return frozenset({"content_policy"})
        reasons = {"fatal"}
        if error.status_code is not None:
            reasons.add(f"status:{error.status_code}")
        if is_context_length(error):
            reasons.add("context_length")
        return frozenset(reasons)
    return frozenset()


def first_not_refused(
    settings: Settings, scope_name: str, refused_models: Collection[str]
) -> str:
    """Where a round of a call asked in ``scope_name`` starts (a structured re-ask):
    the first scope of its fallback chain that does not only serve models that
    refused this call's context -- the asked scope itself when none refused it, or
    when every scope of the chain did (then its error is the round's again)."""
    if not refused_models:
        return scope_name
    return _past_refused(settings, scope_name, refused_models, set()) or scope_name


def _past_refused(
    settings: Settings, target: str | None, refused_models: Collection[str], seen: set[str]
) -> str | None:
    """The first scope of the chain from ``target`` (not in ``seen``) that serves a model
    not in ``refused_models``; ``None`` when the chain runs out (or comes back)."""
    refused = set(refused_models)
    while target is not None and target not in seen:
        seen.add(target)
        candidate = settings.scopes[target]
        if not {s.model for s in candidate.sources} <= refused:
            return target
        target = candidate.fallback
    return None


def fallback_scope(
    settings: Settings, scope_name: str, error: PolygateError,
    refused_models: Collection[str] = (),
) -> str | None:
    """The scope a call failing in ``scope_name`` with ``error`` moves to, or ``None``.

    ``refused_models``: the models that refused this call's request for its context
    length (in any scope it went through); a fallback whose every source serves one
    of them would get the same answer, so it is skipped (for its own fallback)."""
    scope = settings.scopes[scope_name]
    reasons = failure_reasons(error)
    if scope.fallback is None or not reasons & set(scope.fallback_on):
        return None
    # Whatever moves the call, never to a model that refused its context before (in
    # an earlier scope of the chain): the chain never comes back on itself (the
    # settings refuse it), so the walk ends.
    return _past_refused(settings, scope.fallback, refused_models, {scope_name})


def continuation_scope(
    settings: Settings, scope_name: str, refused_models: Collection[str] = ()
) -> str | None:
    """Where a committed stream continues when its scope has no other source: the
    scope's fallback, past the scopes whose every model refused this call's context
    (a continuation is longer still); ``None`` when there is none."""
    return _past_refused(settings, settings.scopes[scope_name].fallback, refused_models, {scope_name})
