"""What the gateway serves while its governance backend could not be reached at start.

A replica started while Redis restarts (or before it is up) would otherwise crash and
be restarted in a loop.  Instead it listens, fails closed on every call -- ``503
governance_unavailable``, nothing sent upstream unadmitted -- reports ``/readyz`` 503
so a load balancer sends it nothing, and keeps trying to open its session in the
background (:meth:`polygate.serve.Server._recover`).  ``/healthz`` answers 200: the
process is alive and will serve as soon as the backend answers.
"""

from __future__ import annotations

from typing import Any, NoReturn

from .._config import Settings
from .._errors import GovernanceBackendError

__all__ = ["UnavailableSession"]


class UnavailableSession:
    """Stands in for the session of a generation whose backend did not answer."""

    def __init__(self, settings: Settings, reason: str) -> None:
        self.settings = settings
        self._reason = reason

    def _error(self) -> GovernanceBackendError:
        return GovernanceBackendError(
            f"the governance backend has not answered since this gateway started "
            f"({self._reason}); retrying in the background"
        )

    async def chat(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._error()

    def stream_chat(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._error()

    async def embed(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._error()

    async def statistics(self) -> NoReturn:
        raise self._error()

    def _key_quotas(self) -> None:
        return None  # no call gets as far as a key's quota
