"""Per-key quotas: a labelled gateway key's RPM, TPM and in-flight bound
(``polygate serve``; the server reaches them through :meth:`Session._key_quotas`, never
the governance backend itself).

A key's quota is held where the sources' quotas are, in the session's governance
backend, as one more admission: scope :data:`KEY_SCOPE`, source the key's *name*.  So
replicas sharing a Redis backend share each key's windows and permits with the same
atomic scripts, leases and fail-closed bound as the sources' (``docs/distributed.md``),
and nothing about the key but its operator-chosen name is ever written there -- not
the key, not a hash of it (a hash of a short secret can be searched offline).

The rules, chosen so that a key pays for what it got:

* a request is admitted before its call starts, with the call's token estimate
  reserved (the prompt's estimate plus the completion budget, as the call's own
  attempts reserve); the server answers a refusal with a 429 at once, with
  ``Retry-After`` -- the gateway does not queue a client over its own quota;
* it is settled when the call ends, whatever ended it (an answer, an error, the client
  leaving): with the answer's usage when there is one; with 0 tokens for a cache hit
  (no upstream spent anything); voided when no attempt reached a source (the request
  was refused before any upstream work: it counts neither as a request nor as tokens);
  otherwise the estimate stands, as for a cancelled attempt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from .governance import (
    Admission,
    AdmitRequest,
    Feedback,
    Governor,
    Refusal,
    RefusalReason,
    SettleRequest,
    SourceLimits,
    completion_budget,
)

if TYPE_CHECKING:
    from ._config_serve import ServeKey

__all__ = ["KEY_SCOPE", "KeyQuotas", "KeyRefusal"]

#: The governance scope of the keys' quotas.  ``@`` is not allowed in a scope name, so
#: a key's state never shares a backend key with a source's.
KEY_SCOPE: Final = "@key"

#: The Retry-After of a refusal that ends when a call settles, not at a known time: an
#: in-flight cap, or a TPM window full of open reservations.
_OPEN_WAIT_S: Final = 1.0


@attrs.frozen
class KeyRefusal:
    """Why the key ``name`` may not make this call now: ``reason`` is ``rpm``, ``tpm``,
    ``in_flight`` or ``too_large`` (the estimate alone is over the key's ``tpm``),
    ``limit`` the bound it hit, ``wait_s`` when to retry (``None``: no wait cures it)."""

    name: str
    reason: str
    limit: int | None
    tokens: int
    wait_s: float | None


class KeyQuotas:
    """The limited keys of one configuration generation (``Serve.keys`` with at least
    one limit), and how to admit and settle a call against one of them."""

    def __init__(self, keys: Mapping[str, ServeKey], governor: Governor) -> None:
        self.limits = {
            name: SourceLimits(key.rpm, key.tpm, key.max_in_flight)
            for name, key in keys.items() if key.limited
        }
        self._governor = governor
        self._backend = governor.backend

    def chat_estimate(
        self, messages: Any, params: Mapping[str, Any], completion_tokens: int
    ) -> tuple[int, int] | None:
        """The tokens a chat call reserves and, of those, its prompt's; ``None`` when
        ``messages`` is not a list of objects (the session refuses it, 400, before any
        upstream work)."""
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            return None
        prompt = self._governor.prompt_estimate(messages, params)
        return prompt + completion_budget(params, completion_tokens), prompt

    def embed_estimate(self, inputs: Sequence[str]) -> int:
        return self._governor.estimate_inputs(inputs)

    async def admit(self, name: str, tokens: int) -> Admission | KeyRefusal:
        """Reserve one request and ``tokens`` for the key ``name``, or say why not.
        Raises :class:`~polygate.GovernanceBackendError` when the backend cannot
        answer: a key's quota fails closed, as a source's admission does."""
        limits = self.limits[name]
        if limits.tpm is not None and tokens > limits.tpm:
            # No wait cures it, whatever else is full: said first (a full rpm window or
            # in-flight cap would answer with a Retry-After, and the SDKs retry).
            await trio.lowlevel.checkpoint()
            return KeyRefusal(name, RefusalReason.TOO_LARGE.value, limits.tpm, tokens, None)
        result = await self._backend.admit(AdmitRequest(KEY_SCOPE, name, limits, tokens))
        if isinstance(result, Admission):
            return result
        return KeyRefusal(name, result.reason.value, _limit(limits, result), tokens,
                          self._wait_s(result))

    def _wait_s(self, refusal: Refusal) -> float | None:
        if refusal.reason is RefusalReason.TOO_LARGE:
            return None
        wait = None if refusal.retry_at is None else refusal.retry_at - self._backend.now()
        if wait is None or (refusal.sooner and wait > _OPEN_WAIT_S):
            # A permit comes back when a call of this key ends; a TPM window full of
            # open reservations frees as they settle, usually far below their
            # estimates -- ``retry_at`` is only when it frees at the latest.  The
            # SDKs obey a Retry-After of up to 60 s: a client must not sleep a minute
            # for tokens that come back in a moment.
            return _OPEN_WAIT_S
        return max(0.001, wait)

    async def settle(
        self, admission: Admission, *, attempted: bool, tokens: int | None
    ) -> None:
        """Settle by the module's rules: ``attempted`` -- whether any attempt reached a
        source, or the answer came from the cache; ``tokens`` -- the usage to record
        (``None``: the estimate stands).  Never raises: a backend that cannot be
        reached is the lease's to clean up (``docs/distributed.md``, "Leases")."""
        await self._backend.settle(SettleRequest(
            admission, tokens, Feedback.NEUTRAL, sent=attempted,
        ))

    @staticmethod
    def at_least(admission: Admission, prompt: int, streamed: int) -> int | None:
        """What a call that reported no usage settles: its estimate, or -- a stream
        cut after more tokens than that (a client that left near the end of a long
        answer) -- its prompt and the tokens it streamed."""
        floor = prompt + streamed
        return floor if streamed and floor > admission.tokens else None


def _limit(limits: SourceLimits, refusal: Refusal) -> int | None:
    if refusal.reason is RefusalReason.RPM:
        return limits.rpm
    if refusal.reason is RefusalReason.IN_FLIGHT:
        return limits.max_in_flight
    return limits.tpm  # TPM, TOO_LARGE
