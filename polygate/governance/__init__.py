"""Admission and governance: picking, quotas, breaker, permits, cooldowns, hedge budget.

Knows nothing of httpx or the transport (an import-linter contract keeps it so).
"""

from ._backend import GovernanceBackend
from ._estimate import (
    CharEstimator,
    TokenEstimator,
    chars_tokens,
    completion_budget,
    default_estimator,
    positive_count,
)
from ._governor import (
    SETTLE_RULES,
    GovernanceStatistics,
    Governor,
    NoAdmission,
    SourceStatistics,
    only_breakers,
)
from ._memory import WINDOW_S, MemoryBackend
from ._model import (
    Admission,
    AdmitRequest,
    BreakerPolicy,
    BreakerState,
    Feedback,
    Refusal,
    RefusalReason,
    SettleRequest,
    SourceLimits,
    SourceSnapshot,
)
from ._picking import Health, HealthStats, pick_order

__all__ = [
    "SETTLE_RULES",
    "WINDOW_S",
    "Admission",
    "AdmitRequest",
    "BreakerPolicy",
    "BreakerState",
    "CharEstimator",
    "Feedback",
    "GovernanceBackend",
    "GovernanceStatistics",
    "Governor",
    "Health",
    "HealthStats",
    "MemoryBackend",
    "NoAdmission",
    "Refusal",
    "RefusalReason",
    "SettleRequest",
    "SourceLimits",
    "SourceSnapshot",
    "SourceStatistics",
    "TokenEstimator",
    "chars_tokens",
    "completion_budget",
    "default_estimator",
    "only_breakers",
    "pick_order",
    "positive_count",
]
