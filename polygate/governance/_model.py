"""Records exchanged with governance backends, and their policies.

Every backend operation takes and returns these frozen records, so that a Redis
implementation can run each one as a single Lua script: no read-modify-write spans two
calls.
"""

from __future__ import annotations

import enum
import hashlib

import attrs

__all__ = [
    "Admission",
    "AdmitRequest",
    "BreakerPolicy",
    "BreakerState",
    "Feedback",
    "Refusal",
    "RefusalReason",
    "SettleRequest",
    "SourceLimits",
    "SourceSnapshot",
]


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Feedback(str, enum.Enum):
    """What an attempt's end tells the breaker."""

    SUCCESS = "success"
    FAILURE = "failure"
    NEUTRAL = "neutral"  # 429, fatal, cancellation, hedge loser, deadline


class RefusalReason(str, enum.Enum):
    COOLING_DOWN = "cooling_down"
    DEAD = "dead"
    BREAKER_OPEN = "breaker_open"
    RPM = "rpm"
    TPM = "tpm"
    IN_FLIGHT = "in_flight"
    TOO_LARGE = "too_large"  # the estimate alone exceeds tpm: never admissible


@attrs.frozen
class BreakerPolicy:
    """Opens after ``failures`` consecutive failures, or when at least ``rate_min_calls``
    of the last ``rate_window`` outcomes include a share over ``failure_rate`` (1.0:
    never); stays
    open ``open_s``, then half-opens: one probe at a time, and ``probes`` successes in a
    row close it.  A failed probe re-opens it for ``open_s × 2^n`` (n failed probes in a
    row), capped at ``max_open_s``, × the settle's jitter when there is such a backoff
    (``max_open_s`` over ``open_s``)."""

    failures: int = 5
    open_s: float = 30.0
    failure_rate: float = 1.0
    rate_window: int = 20
    rate_min_calls: int = 10
    max_open_s: float = 30.0
    probes: int = 1

    def open_for(self, reopens: int, jitter: float) -> float:
        """How long to stay open after ``reopens`` failed probes in a row."""
        nominal = min(self.max_open_s, self.open_s * 2.0 ** min(reopens, 30))
        # The first opening, and every one without a backoff, is exactly open_s, the
        # period the settings promise; re-openings of a backoff are jittered, so that
        # sources whose probes failed together, or processes each holding a memory
        # breaker, spread their next probes.
        if reopens == 0 or self.max_open_s <= self.open_s:
            return nominal
        return nominal * jitter


@attrs.frozen
class SourceLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_in_flight: int | None = None
    #: What the source reaches (:func:`endpoint_of`): its admissions carry it, so that a
    #: backend shared by ``polygate serve``'s generations can tell the verdicts on an
    #: endpoint a reload replaced (a revoked key's 401s) from the current one's.
    endpoint: str = ""


def endpoint_of(base_url: str, model: str | None, api_key: str | None) -> str:
    """A digest of what a source reaches: its URL, its model and its key (digested,
    never kept: the key is a secret)."""
    text = "\0".join((base_url, model or "", api_key or ""))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@attrs.frozen
class AdmitRequest:
    scope: str
    source: str
    limits: SourceLimits
    tokens: int  # the reserved estimate
    breaker: BreakerPolicy = BreakerPolicy()


@attrs.frozen
class Admission:
    """A granted admission: a reservation of ``tokens`` and one in-flight permit."""

    scope: str
    source: str
    reservation_id: int
    tokens: int
    probe: bool = False  # the half-open breaker's single probe
    endpoint: str = ""  # the admitting source's (SourceLimits.endpoint)


@attrs.frozen
class Refusal:
    """Why a source refused, and the earliest time it may accept (``None``: unknown,
    e.g. waiting for a permit to be released)."""

    source: str
    reason: RefusalReason
    retry_at: float | None = None
    #: ``retry_at`` is when the source may accept at the latest: it may accept sooner
    #: (a TPM window with admissions open, which settle below their estimates or are
    #: voided), so a waiter wakes then but is not given up on because of it.
    sooner: bool = False


@attrs.frozen
class SettleRequest:
    """How an admitted attempt ended.

    ``tokens``: the real cost to record; ``None`` keeps the reserved estimate.
    ``sent=False`` voids the reservation (the request never left).
    ``cooldown_s``: cool the source down (429's Retry-After, a dead source).
    ``jitter``: the factor on the open period, if this settle opens the breaker.
    """

    admission: Admission
    tokens: int | None
    feedback: Feedback
    breaker: BreakerPolicy = BreakerPolicy()
    sent: bool = True
    cooldown_s: float | None = None
    dead: bool = False
    # Multiplies the open period if this settle opens the breaker: in [0.5, 1], drawn
    # by the caller (so that processes sharing a backend do not re-probe in step).
    jitter: float = 1.0


@attrs.frozen
class SourceSnapshot:
    """A source's governance state, as ``statistics()`` reports it."""

    scope: str
    source: str
    breaker: BreakerState
    consecutive_failures: int
    in_flight: int
    requests_in_window: int
    tokens_in_window: int
    tokens_reserved: int
    cooldown_until: float | None
    dead: bool
    # Conservation (estimates): reserved_total == settled_total + released_total
    # + tokens_reserved, where tokens_reserved is held by admissions still open.
    reserved_total: int = 0
    settled_total: int = 0
    released_total: int = 0
    cost_total: int = 0  # what settled reservations actually cost (real usage)
    admissions: int = 0
    # While ``breaker`` is OPEN: when its open period ends (a probe is admitted from
    # then on; ``breaker`` says OPEN until the next admission check moves it to
    # half-open, however long ago that was).  None when not open, or not known.
    breaker_open_until: float | None = None
